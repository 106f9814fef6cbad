"""Where ``mixprec.plan``'s measurement spends its time.

``mixprec.plan`` measures every (site, candidate) with one compiled program
of the loss and gradients in which each site's candidate is an argument
(``bench_plan.py`` times the whole call). This splits that program, for
``bench_plan.py``'s model (the massive-activation LM, seed 0, one batch),
into trace (for autocast: its interpreter), lower, XLA compile and one warm
run, beside the per-site programs it replaces (three sites, each compiled
alone at one candidate), the float32 reference (plain ``jax.jit``) and a
float32 AdamW training step. Writes
``benchmarks/results/plan_cost_<backend>.json``; set
``XLA_FLAGS=--xla_backend_optimization_level=0`` and ``--tag O0`` to see
what a cheaper CPU compile would save (the results go to
``plan_cost_<backend>_O0.json``).

    python benchmarks/bench_plan_cost.py
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time


_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
for p in (_ROOT, _HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from bench_plan import make_model, timed_plan  # noqa: E402

import mixprec  # noqa: E402
from mixprec._src.numerics import plan as planner  # noqa: E402
from mixprec._src.plan import Plan, Site  # noqa: E402
from mixprec._src.policy import get_policy  # noqa: E402
from mixprec._src.workloads import data, timing  # noqa: E402


SITES = (
    (("block_1/mlp", "dot_general", 0), "mixed_float8"),
    (("block_0/mlp", "dot_general", 0), "mixed_bfloat16"),
    (("block_0/attn", "dot_general", 1), "mixed_bfloat16"),
)


def _warm(compiled, *args, reps=5):
    times = []
    for _ in range(reps):
        s = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - s)
    return float(np.median(times))


def phases(fn, *args):
    """Seconds to trace, lower and compile ``jit(fn)``, and one warm run."""
    f = jax.jit(fn)
    t0 = time.perf_counter()
    traced = f.trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    return {
        "trace": t1 - t0,
        "lower": t2 - t1,
        "compile": t3 - t2,
        "run": _warm(compiled, *args),
    }


def switched_phases(loss_fn, keys, names, params, batch):
    """:func:`phases` of ``mixprec.plan``'s measuring program (its selector
    set to ``keys[0]`` alone at ``names[0]``)."""
    order = sorted(names, key=lambda c: planner.policy_rank(get_policy(c)))
    switch = planner._Switch(
        keys, [get_policy(c) for c in order], order.index("float32")
    )
    fn = mixprec.autocast(loss_fn, planner._SwitchPlan(get_policy("float32"), switch))

    def measure(sel, *a):
        switch.sel = sel
        try:
            return jax.value_and_grad(fn)(*a)
        finally:
            switch.sel = None

    sel = np.full(len(keys), order.index("float32"), np.int32)
    sel[0] = order.index(names[0])
    return phases(measure, sel, params, batch)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    env = timing.environment()
    text = data.load_shakespeare(["hamlet"])
    _, loss_fn, init = make_model(len(text.vocab), 128, 2, 64, 1e5)
    params = init(jax.random.key(0))
    batch = tuple(
        jax.numpy.asarray(a)
        for a in next(data.iterate_sequences(text.train, 16, 64, seed=0))
    )
    out = {
        "float32 reference (plain jit)": phases(
            jax.value_and_grad(loss_fn), params, batch
        )
    }
    for key, c in SITES:
        alone = Plan(get_policy("float32"), sites=(Site(*key, policy=c),))
        fn = jax.value_and_grad(mixprec.autocast(loss_fn, alone))
        out[f"{'/'.join(map(str, key))} alone at {c}"] = phases(fn, params, batch)
    # The one program `mixprec.plan` compiles: every site, every candidate.
    report = mixprec.explain(loss_fn, params, batch, policy=Plan("float32"))
    keys = list(
        dict.fromkeys(
            (op.site[0], op.site[1], int(op.site[2]))
            for op in report.ops
            if op.site is not None and not op.backward and op.site[2] is not None
        )
    )
    names = ["mixed_float8", "mixed_bfloat16", "float32"]
    out[f"one program: {len(keys)} sites x {len(names)} candidates"] = switched_phases(
        loss_fn, keys, names, params, batch
    )
    opt = optax.adamw(3e-3)

    def step(p, s, b):
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    out["float32 AdamW training step"] = phases(step, params, opt.init(params), batch)
    for k, v in out.items():
        print(k, {a: round(b, 3) for a, b in v.items()})
    # The whole call, twice (the first in this process pays one-time
    # warm-up), against the warm float32 training step.
    step_s = out["float32 AdamW training step"]["run"]
    whole = []
    for _ in range(2):
        _, seconds, breakdown = timed_plan(loss_fn, params, batch)
        whole.append(
            {"seconds": seconds, "steps": seconds / step_s, "breakdown": breakdown}
        )
        print(f"mixprec.plan {seconds:.1f} s = {seconds / step_s:.0f} steps", breakdown)
    res = {
        "benchmark": "bench_plan_cost",
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "seconds": out,
        "whole_plan": whole,
        "environment_start": env,
        "loadavg_end": timing.loadavg(),
    }
    suffix = f"_{args.tag}" if args.tag else ""
    path = (
        pathlib.Path(_HERE)
        / "results"
        / f"plan_cost_{jax.default_backend()}{suffix}.json"
    )
    path.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
