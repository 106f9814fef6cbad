"""Benchmark: what autocast adds to tracing, on a GPT as deep as people train.

A GPT written in plain ``jax.numpy`` with written-out causal attention
(``mixprec/_src/workloads/gpt2.py``, ``attention="einsum"``; d 64, 4 heads,
T 32, vocabulary 256, batch 2) and an AdamW step, at 12, 48 and 96 layers.
Three variants of the same step, each a fresh function every time (autocast
caches what it built per function), timed as ``jax.jit(step).trace(...).lower()``:

* ``plain``: the float32 step under ``jax.jit``;
* ``loss``: ``mixprec.autocast(loss, "mixed_bfloat16")`` inside the step;
* ``step``: ``mixprec.autocast(step, "mixed_bfloat16")`` around the whole step.

Interleaved rounds (each round times every variant, the order rotating),
medians, and the ratio to ``plain``; both wall time and the process's CPU time
over the same calls (tracing is single-threaded: CPU time is the cost without
the waits for a core that a loaded machine adds). ``ms/layer`` is the median
divided by the depth: flat across depths means linear in depth. The target is
a ratio of at most 1.5 for both wraps at every depth.

With ``--cold`` every timing is the first trace in a fresh process (JAX's and
mixprec's caches empty, imports done before the clock starts): what a user
waits for when a training script starts. Without it, JAX's caches are warm
(a warm-up round first) and each variant is a fresh function.

Usage::

    python benchmarks/bench_trace.py [--layers 12 48 96] [--rounds 3] [--cold]
        [--out PATH]

Prints the table and writes JSON (and a Markdown copy next to it) with the JAX
version, the CPU model and its flags.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import mixprec
from mixprec._src.workloads import gpt2, timing


VARIANTS = ("plain", "loss", "step")
POLICY = "mixed_bfloat16"


def config(layers: int) -> gpt2.GPT2Config:
    """The GPT of the benchmark at ``layers`` layers."""
    return gpt2.GPT2Config(
        vocab_size=256, seq_len=32, d_model=64, num_heads=4, num_layers=layers
    )


def make_step(kind: str, cfg: gpt2.GPT2Config) -> Callable[..., Any]:
    """A fresh AdamW step of the ``kind`` variant."""
    opt = optax.adamw(1e-3)

    def loss(params: Any, x: Any, y: Any) -> Any:
        return gpt2.loss(params, x, y, config=cfg, attention="einsum")

    if kind == "loss":
        loss = mixprec.autocast(loss, POLICY)

    def step(params: Any, state: Any, x: Any, y: Any) -> Any:
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    if kind == "step":
        step = mixprec.autocast(step, POLICY)
    return step


def _arguments(cfg: gpt2.GPT2Config) -> tuple[Any, ...]:
    params = jax.tree.map(jnp.asarray, gpt2.init(cfg))
    state = optax.adamw(1e-3).init(params)
    x, y = gpt2.batch(cfg, 2)
    return (params, state, x, y)


def _time_once(kind: str, cfg: gpt2.GPT2Config, args: Any) -> tuple[float, float]:
    fn = make_step(kind, cfg)
    wall, cpu = time.perf_counter(), time.process_time()
    jax.jit(fn).trace(*args).lower()
    return time.perf_counter() - wall, time.process_time() - cpu


def _cold_once(kind: str, layers: int) -> tuple[float, float]:
    """The first trace+lower of ``kind`` in a fresh process."""
    out = subprocess.run(
        [sys.executable, __file__, "--one", kind, str(layers)],
        capture_output=True,
        text=True,
        check=True,
    )
    wall, cpu = json.loads(out.stdout.strip().splitlines()[-1])
    return float(wall), float(cpu)


def measure(layers: int, rounds: int, *, cold: bool = False) -> dict[str, Any]:
    """Median trace+lower wall and CPU seconds of every variant at ``layers``
    (``cold``: each the first trace in a fresh process)."""
    cfg = config(layers)
    args = _arguments(cfg)

    def once(kind: str) -> tuple[float, float]:
        if cold:
            return _cold_once(kind, layers)
        return _time_once(kind, cfg, args)

    if not cold:
        for kind in VARIANTS:  # warm-up: JAX's own caches of shared helpers
            once(kind)
    walls: dict[str, list[float]] = {k: [] for k in VARIANTS}
    cpus: dict[str, list[float]] = {k: [] for k in VARIANTS}
    for r in range(rounds):
        order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
        for kind in order:
            w, c = once(kind)
            walls[kind].append(w)
            cpus[kind].append(c)
    eqns = {
        kind: len(jax.jit(make_step(kind, cfg)).trace(*args).jaxpr.eqns)
        for kind in VARIANTS
    }
    row: dict[str, Any] = {"layers": layers, "cold": cold, "eqns_top_level": eqns}
    for kind in VARIANTS:
        row[f"{kind}_wall_s"] = timing.median(walls[kind])
        row[f"{kind}_cpu_s"] = timing.median(cpus[kind])
    for kind in ("loss", "step"):
        row[f"{kind}_ratio_cpu"] = timing.ratio(
            row[f"{kind}_cpu_s"], row["plain_cpu_s"]
        )
        row[f"{kind}_ratio_wall"] = timing.ratio(
            row[f"{kind}_wall_s"], row["plain_wall_s"]
        )
    return row


def table(rows: list[dict[str, Any]]) -> str:
    """The result table in Markdown."""
    lines = [
        "| layers | plain CPU s | loss-only CPU s | whole step CPU s "
        "| loss-only / plain | whole step / plain | plain ms/layer "
        "| loss-only ms/layer | whole step ms/layer | wall ratios (loss, step) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        n = r["layers"]
        lines.append(
            f"| {n} | {r['plain_cpu_s']:.2f} | {r['loss_cpu_s']:.2f} | "
            f"{r['step_cpu_s']:.2f} | {r['loss_ratio_cpu']:.2f}x | "
            f"{r['step_ratio_cpu']:.2f}x | {1e3 * r['plain_cpu_s'] / n:.1f} | "
            f"{1e3 * r['loss_cpu_s'] / n:.1f} | {1e3 * r['step_cpu_s'] / n:.1f} | "
            f"{r['loss_ratio_wall']:.2f}x, {r['step_ratio_wall']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; prints the table and writes JSON and Markdown."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 48, 96])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--cold",
        action="store_true",
        help="time each trace as the first in a fresh process (caches empty)",
    )
    parser.add_argument(
        "--one", nargs=2, metavar=("VARIANT", "LAYERS"), help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path(__file__).parent / "results" / "bench_trace_cpu.json",
    )
    args = parser.parse_args(argv)
    if args.one is not None:  # a child of --cold: one timing, as JSON
        kind, layers = args.one[0], int(args.one[1])
        cfg = config(layers)
        inputs = _arguments(cfg)
        print(json.dumps(_time_once(kind, cfg, inputs)))
        return 0
    if args.rounds < 1 or any(n < 1 for n in args.layers):
        parser.error("`--rounds` and every `--layers` value must be >= 1.")
    rows = []
    for n in args.layers:
        print(f"[trace] {n} layers x {args.rounds} rounds ...", flush=True)
        rows.append(measure(n, args.rounds, cold=args.cold))
    env = timing.environment()
    text = table(rows)
    flags = timing.flags_summary(env["cpu_flags"])
    header = (
        f"Measured {env['date']} on {env['cpu_model']} ({env['cpu_count']} CPUs; "
        f"CPU flags: {flags}), jax {env['jax']}, load average {env['loadavg']}. "
        f"Command: `python benchmarks/bench_trace.py --layers "
        f"{' '.join(map(str, args.layers))} --rounds {args.rounds}"
        f"{' --cold' if args.cold else ''}`."
    )
    print(header)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"environment": env, "rows": rows}, indent=2))
    args.out.with_suffix(".md").write_text(
        f"{header}\n\n{text}\n\nMedians of interleaved rounds; CPU s: the process's "
        "CPU time over `jax.jit(step).trace(...).lower()` of a fresh function"
        f"{' in a fresh process (cold caches)' if args.cold else ''}. "
        "ms/layer flat across depths: linear in depth. Target: both ratios at "
        "most 1.5x.\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
