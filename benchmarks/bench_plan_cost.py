"""What ``mixprec.plan`` costs, against one float32 training step.

``mixprec.plan`` measures every (site, candidate) with one compiled program
of the loss and gradients in which each site's candidate is an argument;
its float32 run also hands each site's operands and candidates' results to
the host for the op measurements (no ``diagnose`` run). For
``bench_plan.py``'s model (the massive-activation LM, seed 0, one batch)
this times:

* trace, lower, XLA compile and one warm run of the float32 AdamW training
  step (the unit), of one per-site program (one site alone at float8, what
  the one program replaced), of the measuring program as it was before
  (``--before``, a commit whose ``numerics/plan.py`` is loaded from git), as
  it is now, now without shared branches (``_Switch.shares`` off) and now
  without the recording callbacks (what they cost): each compiled
  ``--rounds`` times, interleaved (the order rotates each round),
  medians reported, so that a loaded machine slows every variant alike
  (``compile_cpu``: the process's CPU seconds in the compile, less
  sensitive to other jobs than the wall time);
* the whole ``mixprec.plan`` call, first in the process (cold: it pays
  one-time warm-up) and again after the rounds (warm), split into
  ``explain`` runs, the measuring program's first call (trace, compile,
  the float32 run and its recording), the
  measurement runs, the host's op measurements and ``diagnose`` runs, with
  every XLA compile in the call summed (``jax.monitoring``'s compile
  events). Reported in float32 training steps, in training-step compiles
  (the call's compile seconds over the step's) and in steps excluding
  compiles.

Writes ``benchmarks/results/plan_cost_<backend>.json``; ``--tag`` adds a
suffix (set ``XLA_FLAGS`` yourself to compare compiler settings).

    python benchmarks/bench_plan_cost.py
    python benchmarks/bench_plan_cost.py --rounds 1 --tag smoke
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time


_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
for p in (_ROOT, _HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from bench_plan import make_model, timed_phases  # noqa: E402

import mixprec  # noqa: E402
from mixprec._src.numerics import plan as planner  # noqa: E402
from mixprec._src.plan import Plan, Site  # noqa: E402
from mixprec._src.policy import get_policy  # noqa: E402
from mixprec._src.workloads import data, timing  # noqa: E402


#: The commit before the op measurements moved into the measuring program
#: (its `numerics/plan.py` builds the program as it was).
BEFORE = "60a4e21ba9caea4f6b9c956cea6efdee01cd8469"
NAMES = ("mixed_float8", "mixed_bfloat16", "float32")
COMPILE_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}


class _CompileClock:
    """Sums JAX's trace, lower and XLA compile durations while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.seconds = {"trace": 0.0, "lower": 0.0, "compile": 0.0}
        self.compiles = 0
        jax.monitoring.register_event_duration_secs_listener(self._heard)

    def _heard(self, event: str, duration: float, **_: object) -> None:
        name = COMPILE_EVENTS.get(event)
        if self.on and name is not None:
            self.seconds[name] += duration
            self.compiles += name == "compile"

    def start(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self.compiles = 0
        self.on = True

    def stop(self) -> dict[str, float]:
        self.on = False
        return {**self.seconds, "xla_compiles": self.compiles}


def _load_before(rev: str):
    """``numerics/plan.py`` at ``rev``, as a module of its own."""
    src = subprocess.run(
        ["git", "-C", _ROOT, "show", f"{rev}:mixprec/_src/numerics/plan.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = pathlib.Path(tempfile.mkdtemp()) / "plan_before.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("_plan_before", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (its dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


def _warm(compiled, *args, reps=3):
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
    t2, c2 = time.perf_counter(), time.process_time()
    compiled = lowered.compile()
    t3, c3 = time.perf_counter(), time.process_time()
    return {
        "trace": t1 - t0,
        "lower": t2 - t1,
        "compile": t3 - t2,
        "compile_cpu": c3 - c2,
        "run": _warm(compiled, *args),
    }, compiled


def measuring(mod, loss_fn, keys, params, batch, shares=True, records=True):
    """:func:`phases` of the measuring program ``mod`` (a version of
    ``numerics/plan.py``) builds, its selector at ``keys[0]`` alone at
    float8; for a version that records, also its recording run (the float32
    run that hands the op measurements over, and the host's share)."""
    order = sorted(NAMES, key=lambda c: mod.policy_rank(get_policy(c)))
    switch = mod._Switch(keys, [get_policy(c) for c in order], order.index("float32"))
    if hasattr(switch, "shares"):
        switch.shares = shares
    if not records:  # what the recording costs: the program without it
        switch._record = lambda *a, **k: None
    fn = mixprec.autocast(loss_fn, mod._SwitchPlan(get_policy("float32"), switch))

    def measure(sel, *a):
        switch.sel = sel
        try:
            return jax.value_and_grad(fn)(*a)
        finally:
            switch.sel = None

    sel = np.full(len(keys), order.index("float32"), np.int32)
    sel[0] = order.index(NAMES[0])
    out, compiled = phases(measure, sel, params, batch)
    if hasattr(switch, "recording") and records:
        ref = np.full(len(keys), order.index("float32"), np.int32)
        switch.recording = True
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(ref, params, batch))
        jax.effects_barrier()
        t1 = time.perf_counter()
        switch.recording = False
        switch.op_measurements()
        out["recording_run"] = t1 - t0
        out["op_measurements"] = time.perf_counter() - t1
        switch.calls.clear()
    return out


def timed_plan(loss_fn, params, batch, clock, mod=planner):
    """``mod.plan(loss_fn, params, batch)`` (``mod`` a version of
    ``numerics/plan.py``) and where its time goes."""
    with timed_phases(mod) as parts:
        clock.start()
        try:
            t0 = time.perf_counter()
            plan = mod.plan(loss_fn, params, batch, candidates=NAMES)
            seconds = time.perf_counter() - t0
        finally:
            compiles = clock.stop()
    first, *runs = parts["measure"] or [0.0]
    return (
        plan,
        seconds,
        {
            "explain_runs": len(parts["explain"]),
            "explain_seconds": sum(parts["explain"]),
            "diagnose_runs": len(parts["diagnose"]),
            "diagnose_seconds": sum(parts["diagnose"]),
            "first_call_seconds": first,
            "first_call_includes": "trace, compile, the float32 run, its recording "
            "and the host's op measurements",
            "op_measurements_seconds": sum(parts["op_measurements"]),
            "measurement_runs": len(runs),
            "measurement_run_seconds": sum(runs),
            "measurement_run_median_seconds": float(np.median(runs)) if runs else 0.0,
            "compile_events": compiles,
        },
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tag", default="")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before", default=BEFORE, help="commit of the 'before' program")
    args = ap.parse_args(argv)
    env = timing.environment()
    uptime_start = subprocess.run(["uptime"], capture_output=True, text=True).stdout
    clock = _CompileClock()
    text = data.load_shakespeare(["hamlet"])
    _, loss_fn, init = make_model(len(text.vocab), 128, 2, 64, 1e5)
    params = init(jax.random.key(0))
    batch = tuple(
        jax.numpy.asarray(a)
        for a in next(data.iterate_sequences(text.train, 16, 64, seed=0))
    )
    report = mixprec.explain(loss_fn, params, batch, policy=Plan("float32"))
    keys = list(
        dict.fromkeys(
            (op.site[0], op.site[1], int(op.site[2]))
            for op in report.ops
            if op.site is not None and not op.backward and op.site[2] is not None
        )
    )
    before = _load_before(args.before)
    opt = optax.adamw(3e-3)

    def train_step():
        # A new function each time: nothing of an earlier trace is reused.
        def step(p, s, b):
            loss, g = jax.value_and_grad(loss_fn)(p, b)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s, loss

        return step

    alone = Plan(
        get_policy("float32"),
        sites=(Site("block_1/mlp", "dot_general", 0, policy="mixed_float8"),),
    )
    n = f"{len(keys)} sites x {len(NAMES)} candidates"
    variants = {
        "float32 AdamW training step": lambda: phases(
            train_step(), params, opt.init(params), batch
        )[0],
        "per-site program (block_1/mlp 0 alone at mixed_float8)": lambda: phases(
            jax.value_and_grad(mixprec.autocast(loss_fn, alone)), params, batch
        )[0],
        f"measuring program before ({args.before[:7]}), {n}": lambda: measuring(
            before, loss_fn, keys, params, batch
        ),
        f"measuring program now, {n}": lambda: measuring(
            planner, loss_fn, keys, params, batch
        ),
        f"measuring program now without shared branches, {n}": lambda: measuring(
            planner, loss_fn, keys, params, batch, shares=False
        ),
        f"measuring program now without the recording, {n}": lambda: measuring(
            planner, loss_fn, keys, params, batch, records=False
        ),
    }
    # The whole call first in this process (cold: it pays JAX's one-time
    # warm-up and the eager dispatch compiles of the host's counts), again
    # after the rounds (warm).
    whole = [timed_plan(loss_fn, params, batch, clock)]
    names = list(variants)
    rounds = {k: [] for k in names}
    for r in range(args.rounds):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            rounds[k].append(variants[k]())
            print(f"round {r}: {k}", {a: round(b, 3) for a, b in rounds[k][-1].items()})
    medians = {
        k: {a: float(np.median([v[a] for v in vs])) for a in vs[0]}
        for k, vs in rounds.items()
    }
    step_s = medians[names[0]]
    whole.append(timed_plan(loss_fn, params, batch, clock))
    # The call as it was (one `diagnose` run per candidate), warm, beside.
    whole.append(timed_plan(loss_fn, params, batch, clock, before))
    plans = [w[0] for w in whole]
    same = {
        "policies": all(
            [s.policy for s in p.sites] == [s.policy for s in plans[0].sites]
            for p in plans
        ),
        "largest effect difference": max(
            abs(
                (a.measurements()[c].get("effect") or 0.0)
                - (b.measurements()[c].get("effect") or 0.0)
            )
            for p in plans[1:]
            for a, b in zip(plans[0].sites, p.sites, strict=True)
            for c in NAMES
        ),
    }
    print("the plans agree:", same)
    calls = (
        "first in the process (cold)",
        "again (warm)",
        f"as it was before ({args.before[:7]}: a diagnose run per candidate), warm",
    )
    for i, (_, seconds, breakdown) in enumerate(whole):
        compile_s = breakdown["compile_events"]["compile"]
        whole[i] = {
            "call": calls[i],
            "seconds": seconds,
            "steps": seconds / step_s["run"],
            "step_compiles": compile_s / step_s["compile"],
            "steps_excluding_compiles": (seconds - compile_s) / step_s["run"],
            "breakdown": breakdown,
        }
        print(
            f"mixprec.plan {seconds:.1f} s = {seconds / step_s['run']:.0f} steps "
            f"= {compile_s / step_s['compile']:.2f} step compiles + "
            f"{(seconds - compile_s) / step_s['run']:.0f} steps",
            breakdown,
        )
    res = {
        "benchmark": "bench_plan_cost",
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "rounds": args.rounds,
        "seconds_median": medians,
        "seconds_each_round": rounds,
        "whole_plan": whole,
        "plans_agree": same,
        "environment_start": env,
        "uptime_start": uptime_start.strip(),
        "uptime_end": subprocess.run(
            ["uptime"], capture_output=True, text=True
        ).stdout.strip(),
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
