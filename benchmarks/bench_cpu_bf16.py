"""Benchmark: autocast's two CPU formulations of bfloat16 dots, on one CPU.

autocast computes a bfloat16 dot on CPU one of two ways
(``mixprec/_src/autocast/dots.py``): ``native`` (bfloat16 GEMMs forward and
backward, for CPUs with AVX-512 BF16 or AMX-BF16) and ``emulated`` (float32
GEMMs on bfloat16-rounded operands with bfloat16 residuals, for CPUs without).
This script times both against float32, in ONE interleaved run per workload,
and records what the CPU has:

* ``float32``: the plain float32 training step.
* ``bf16_dots_f32out``: every dot ``bf16 x bf16 -> f32`` by hand, JAX's autodiff
  (what a user gets from casting by hand).
* ``autocast``: ``mixprec.autocast(loss, "mixed_bfloat16")`` with the
  formulation this CPU was detected to need.
* ``autocast_native`` / ``autocast_emulated``: the same, formulation forced.
* ``candidate_round_all`` / ``candidate_keep_f32`` (with ``--candidates``): the
  other formulations for CPUs without native bfloat16 that were measured
  before ``emulated`` was chosen. Both are float32 GEMMs with a ``custom_vjp``;
  ``round_all`` rounds every operand to bfloat16 in the forward pass and saves
  the bfloat16 copies (float32 weights too), ``keep_f32`` does not round
  float32 operands at all (forward or saved). ``emulated`` rounds every
  operand in the forward pass and keeps float32 operands as they are.
* ``autocast_baseline`` (with ``--baseline-ref REF``): autocast from another git
  revision of mixprec (e.g. ``main``), imported in the same process under the
  name ``mixprec_baseline``, to compare the native path before and after a
  change in one interleaved run.

Workloads (``bench_autocast.py``'s full sizes; ``--quick`` shrinks them): the
MLP 784-4096-4096-10 at batch 1024 (memory at batch 8192) and the GPT char-LM
(4 layers, d_model 256, seq 256, batch 8). A step is forward, backward and SGD.

Per variant: median step time and its ratio to float32; the bytes saved for
the backward pass (the ``jax.vjp`` closure's leaves by ``jax.eval_shape``) and
their ratio to float32; XLA's temp bytes; and the element types of every dot in
the compiled step (how many run as ``bf16 x bf16``).

``--emulate-cpu avx2`` builds ``benchmarks/cpu_emulation/cpuid_avx2.c`` with the
C compiler and runs the script again under it (``LD_PRELOAD``): the process
then sees an AVX2-only CPU (no AVX-512, no AVX-512 BF16, no AMX), so XLA's code
generator and YNNPACK's kernel dispatch pick their AVX2 code, as on such a CPU.
Only the instruction set is emulated: cores, caches and memory are this
machine's. The JSON says so (``emulation``) and records the features the
process saw.

Usage::

    python benchmarks/bench_cpu_bf16.py [--quick] [--repeats N] [--workloads mlp,lm]
    python benchmarks/bench_cpu_bf16.py --emulate-cpu avx2
    python benchmarks/bench_cpu_bf16.py --baseline-ref main
    python benchmarks/bench_cpu_bf16.py --emulate-cpu avx2 --candidates
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import importlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from typing import Any


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_ROOT, _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

_EMULATION_ENV = "MIXPREC_BENCH_EMULATED_CPU"

# --- CPU emulation (before JAX is imported) -------------------------------------


def _build_shim(isa: str) -> str:
    src = os.path.join(_HERE, "cpu_emulation", f"cpuid_{isa}.c")
    if not os.path.exists(src):
        raise SystemExit(f"--emulate-cpu: no {src}; valid: avx2")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("--emulate-cpu needs a C compiler (cc or gcc) on PATH")
    out = os.path.join(tempfile.mkdtemp(prefix="mixprec_cpuid_"), f"libcpuid_{isa}.so")
    # Not under a CPUID mask already preloaded: compilers catch SIGSEGV too.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", out, src], check=True, env=env)
    return out


def _reexec_emulated(isa: str, argv: list[str]) -> int:
    """Runs this script again, in this process, with the CPUID mask preloaded."""
    lib = _build_shim(isa)
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(filter(None, [lib, env.get("LD_PRELOAD")]))
    env[_EMULATION_ENV] = isa
    # The code generator is told too (it would see the masked CPU anyway).
    env["XLA_FLAGS"] = " ".join(
        filter(None, [env.get("XLA_FLAGS"), f"--xla_cpu_max_isa={isa.upper()}"])
    )
    rest = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--emulate-cpu":
            skip = True
            continue
        if a.startswith("--emulate-cpu="):
            continue
        rest.append(a)
    # Replace this process (no child left behind if the caller kills it).
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *rest], env)


def _masked_calls() -> int:
    """CPUID instructions the mask has answered in this process so far."""
    lib = ctypes.CDLL(None)
    return ctypes.c_long.in_dll(lib, "mixprec_cpuid_masked_calls").value


def _emulation_record() -> dict[str, Any] | None:
    isa = os.environ.get(_EMULATION_ENV)
    if not isa:
        return None
    lib = ctypes.CDLL(None)
    try:
        faulting = ctypes.c_int.in_dll(lib, "mixprec_cpuid_faulting").value
        masked = ctypes.c_long.in_dll(lib, "mixprec_cpuid_masked_calls").value
    except ValueError:
        raise SystemExit(
            "CPU emulation requested but the CPUID mask is not loaded"
        ) from None
    if not faulting:
        raise SystemExit("CPU emulation requested but CPUID faulting is unavailable")
    return {
        "isa": isa,
        "how": (
            "CPUID faulting (benchmarks/cpu_emulation/cpuid_avx2.c, LD_PRELOAD) "
            "hides AVX-512, AVX-512 BF16/FP16, AVX-VNNI and AMX from the process; "
            f"XLA_FLAGS has --xla_cpu_max_isa={isa.upper()}. Cores, caches and "
            "memory are this machine's: only the instruction set is emulated."
        ),
        "cpuid_calls_masked": masked,
    }


# --- the benchmark ---------------------------------------------------------------


def _import_baseline(ref: str) -> Any:
    """``mixprec`` at git revision ``ref``, importable as ``mixprec_baseline``."""
    tmp = tempfile.mkdtemp(prefix="mixprec_baseline_")
    blob = subprocess.run(
        ["git", "-C", _ROOT, "archive", "--format=tar", ref, "mixprec"],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(tmp, filter="data")
    pkg = os.path.join(tmp, "mixprec_baseline")
    os.rename(os.path.join(tmp, "mixprec"), pkg)
    for dirpath, _, files in os.walk(pkg):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            with open(path) as f:
                text = f.read()
            text = re.sub(
                r"(?m)^(\s*)import mixprec$",
                r"\1import mixprec_baseline as mixprec",
                text,
            )
            text = re.sub(r"(?m)^(\s*)from mixprec\b", r"\1from mixprec_baseline", text)
            with open(path, "w") as f:
                f.write(text)
    sys.path.insert(0, tmp)
    return importlib.import_module("mixprec_baseline")


def _candidate_dots(how: str) -> Any:
    """A context that swaps autocast's bfloat16 CPU dot for a candidate
    formulation while a step is traced (see the docstring)."""
    import functools as ft

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    from mixprec._src.autocast import dots

    f32, bf16 = np.dtype(np.float32), np.dtype(jnp.bfloat16)

    def prepared(x: Any) -> tuple[Any, Any]:
        """(operand for the forward GEMM, what is saved)."""
        if how == "keep_f32" and x.dtype == f32:
            return x, x
        low = x.astype(bf16)
        return low.astype(f32), low

    @ft.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
    def dot(lhs: Any, rhs: Any, dn: Any, precision: Any, out: Any, dts: Any) -> Any:
        return fwd(lhs, rhs, dn, precision, out, dts)[0]

    def fwd(lhs, rhs, dn, precision, out, dts):
        (a, a_saved), (b, b_saved) = prepared(lhs), prepared(rhs)
        res = lax.dot_general(a, b, dn, precision=precision)
        return res.astype(out), (a_saved, b_saved)

    def bwd(dn, precision, out, dts, saved, g):
        a, b = (x.astype(f32) for x in saved)
        g = g.astype(f32)
        (da,) = jax.linear_transpose(
            lambda u: lax.dot_general(u, b, dn, precision=precision), a
        )(g)
        (db,) = jax.linear_transpose(
            lambda v: lax.dot_general(a, v, dn, precision=precision), b
        )(g)
        return da.astype(dts[0]), db.astype(dts[1])

    dot.defvjp(fwd, bwd)
    original = dots.dot_general

    def patched(lhs: Any, rhs: Any, **kw: Any) -> Any:
        if np.dtype(kw["low_dtype"]) != bf16 or kw.get("forward_mode_ad"):
            return original(lhs, rhs, **kw)
        lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
        dn = dots._canon_dn(kw["dimension_numbers"])
        out = np.dtype(kw["out_dtype"])
        return dot(lhs, rhs, dn, kw.get("precision"), out, (lhs.dtype, rhs.dtype))

    @contextlib.contextmanager
    def swapped() -> Any:
        dots.dot_general = patched
        try:
            yield
        finally:
            dots.dot_general = original

    return swapped()


def dot_types(hlo_text: str) -> dict[str, int]:
    """``"lhs x rhs -> out"`` element types of the dots in compiled HLO text."""
    from mixprec._src.workloads import timing

    counts: dict[str, int] = {}
    for lhs, rhs, out in timing.hlo_dot_types(hlo_text):
        key = f"{lhs} x {rhs} -> {out}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps each")
    parser.add_argument("--workloads", default="mlp,lm")
    parser.add_argument("--variants", default=None, help="comma-separated subset")
    parser.add_argument(
        "--emulate-cpu", choices=["avx2"], default=None, help="see the docstring"
    )
    parser.add_argument("--baseline-ref", default=None, help="git revision")
    parser.add_argument(
        "--candidates", action="store_true", help="add the candidate formulations"
    )
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args(argv)
    if args.emulate_cpu and not os.environ.get(_EMULATION_ENV):
        return _reexec_emulated(args.emulate_cpu, argv)
    emulation = _emulation_record()

    import bench_autocast as ba
    import jax

    import mixprec
    from mixprec._src import _compat
    from mixprec._src.autocast import capability
    from mixprec._src.workloads import timing

    sizes = ba.QUICK if args.quick else ba.FULL
    repeats = args.repeats or (1 if args.quick else 9)
    if repeats < 1:
        parser.error(f"--repeats must be >= 1, got {repeats}")
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in workloads:
        if w not in sizes:
            parser.error(f"unknown workload {w!r}; choose from {sorted(sizes)}")
    names = ["float32", "bf16_dots_f32out", "autocast"]
    names += ["autocast_native", "autocast_emulated"]
    if args.candidates:
        names += ["candidate_round_all", "candidate_keep_f32"]
    baseline = None
    if args.baseline_ref:
        baseline = _import_baseline(args.baseline_ref)
        names.append("autocast_baseline")
    if args.variants:
        keep = {v.strip() for v in args.variants.split(",")} | {"float32"}
        unknown = keep - set(names)
        if unknown:
            parser.error(f"unknown variants {sorted(unknown)}; choose from {names}")
        names = [n for n in names if n in keep]

    env = timing.environment()
    detected = capability.cpu_bf16()
    features = _compat.cpu_features() or {}
    probe_n = 256 if args.quick else 1024
    bf16_s, f32_s = capability.probe_gemm_seconds(n=probe_n, rounds=5)
    flops = 2.0 * probe_n**3
    cpu = dict(
        detected=dataclasses.asdict(detected),
        detected_formulation=detected.formulation,
        runtime_features={
            k: features.get(k)
            for k in ("AVX2", "FMA3", "AVX512F", "AVX512BW", "AVX512BF16", "AVX512FP16")
        },
        proc_cpuinfo_flags=env["cpu_flags"],
        gemm_probe=dict(
            n=probe_n,
            bf16_gflops=flops / bf16_s / 1e9,
            f32_gflops=flops / f32_s / 1e9,
            bf16_vs_f32=f32_s / bf16_s,
        ),
    )
    print(
        f"CPU: {env['cpu_model']}; /proc/cpuinfo: "
        f"{timing.flags_summary(env['cpu_flags'])}; run-time features: "
        f"{', '.join(k for k, v in cpu['runtime_features'].items() if v)}; "
        f"detected: {detected.describe()}; {probe_n}^3 GEMM: bf16 "
        f"{cpu['gemm_probe']['bf16_gflops']:.0f} vs f32 "
        f"{cpu['gemm_probe']['f32_gflops']:.0f} GFLOP/s"
        + (f"; EMULATED {emulation['isa']}" if emulation else ""),
        flush=True,
    )

    def losses(workload: str, cfg: dict[str, Any]) -> dict[str, Callable[..., Any]]:
        out: dict[str, Callable[..., Any]] = {}
        for name in names:
            plain = ba.plain_loss(workload, cfg, None)
            if name == "float32":
                out[name] = plain
            elif name == "bf16_dots_f32out":
                out[name] = ba.plain_loss(workload, cfg, ba.mm_bf16_f32out)
            elif name == "autocast":
                out[name] = mixprec.autocast(plain, "mixed_bfloat16")
            elif name == "autocast_baseline":
                out[name] = baseline.autocast(plain, "mixed_bfloat16")
            elif name.startswith("candidate_"):
                with capability.override("emulated"):
                    out[name] = mixprec.autocast(plain, "mixed_bfloat16")
            else:
                forced = name.removeprefix("autocast_")
                with capability.override(forced):
                    out[name] = mixprec.autocast(plain, "mixed_bfloat16")
        return out

    results: list[dict[str, Any]] = []
    for workload in workloads:
        cfg = sizes[workload]
        x, y = ba.make_data(workload, cfg, cfg["batch"])
        params = ba.init_params(workload, cfg)
        fns = losses(workload, cfg)
        mem_batch = cfg.get("memory_batch", cfg["batch"])
        xm, ym = ba.make_data(workload, cfg, mem_batch)
        runners: dict[str, Callable[[], Any]] = {}
        # Process CPU seconds of each call (XLA's threads included): on a
        # shared machine, the work a step did without the waits for a core.
        cpu_times: dict[str, list[float]] = {}
        rows: dict[str, dict[str, Any]] = {}
        hlo: dict[str, str] = {}
        for name, loss in fns.items():
            print(f"[{workload}] compiling {name} ...", flush=True)
            swap = (
                _candidate_dots(name.removeprefix("candidate_"))
                if name.startswith("candidate_")
                else contextlib.nullcontext()
            )
            with swap:
                compiled = jax.jit(ba.make_step(loss)).lower(params, x, y).compile()
                saved = timing.residual_bytes(loss, params, xm, ym)
            hlo[name] = compiled.as_text()
            state = {"params": params}
            cpu_times[name] = []

            def run(
                compiled: Any = compiled,
                state: dict[str, Any] = state,
                batch: tuple[Any, Any] = (x, y),
                cpu: list[float] = cpu_times[name],
            ) -> Any:
                t0 = time.process_time()
                state["params"] = jax.block_until_ready(
                    compiled(state["params"], *batch)
                )
                cpu.append(time.process_time() - t0)
                return state["params"]

            runners[name] = run
            rows[name] = dict(
                workload=workload,
                variant=name,
                dots=dot_types(hlo[name]),
                temp_bytes=timing.memory_analysis(compiled)["temp_bytes"],
                memory_batch=mem_batch,
                residual_bytes=saved,
            )
        if "autocast_baseline" in hlo and "autocast_native" in hlo:
            strip = re.compile(r"metadata=\{[^}]*\}|, (?:stack_frame_id|op_name)=\S+")
            same = strip.sub("", hlo["autocast_baseline"]) == strip.sub(
                "", hlo["autocast_native"]
            )
            rows["autocast_native"]["hlo_identical_to_baseline"] = same
        load0 = os.getloadavg()[0]
        print(
            f"[{workload}] timing {len(runners)} variants x {repeats} rounds",
            flush=True,
        )
        times = timing.interleaved(runners, rounds=repeats, warmup=args.warmup)
        load1 = os.getloadavg()[0]
        base = timing.median(times["float32"])
        base_res = rows["float32"]["residual_bytes"]
        cpu_s = {n: c[-repeats:] for n, c in cpu_times.items()}
        base_cpu = timing.median(cpu_s["float32"])
        for name, t in times.items():
            r = rows[name]
            r.update(
                median_s=timing.median(t),
                times_s=t,
                speedup_vs_float32=timing.ratio(base, timing.median(t)),
                cpu_median_s=timing.median(cpu_s[name]),
                cpu_times_s=cpu_s[name],
                cpu_speedup_vs_float32=timing.ratio(
                    base_cpu, timing.median(cpu_s[name])
                ),
                residual_ratio=r["residual_bytes"] / base_res,
                loadavg=[load0, load1],
            )
            results.append(r)

    data = dict(
        config=dict(
            quick=args.quick,
            repeats=repeats,
            warmup=args.warmup,
            workloads={
                w: {
                    **{k: v for k, v in sizes[w].items() if k != "model"},
                    "model": dataclasses.asdict(sizes[w]["model"]),
                }
                for w in workloads
            },
            baseline_ref=args.baseline_ref,
            command=" ".join(["python", "benchmarks/bench_cpu_bf16.py", *argv]),
        ),
        environment=env,
        jax=env["jax"],
        cpu_flags=env["cpu_flags"],
        cpu=cpu,
        emulation=(
            None
            if emulation is None
            else {**emulation, "cpuid_calls_masked": _masked_calls()}
        ),
        results=results,
        loadavg_end=[round(v, 2) for v in os.getloadavg()],
    )
    tag = f"emulated_{emulation['isa']}" if emulation else "host"
    out_path = args.out or os.path.join(
        _HERE, "results", f"bench_cpu_bf16_{tag}{'_quick' if args.quick else ''}.json"
    )
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(data, f, indent=2)
    md = markdown(data)
    with open(os.path.splitext(out_path)[0] + ".md", "w") as f:
        f.write(md + "\n")
    print(md)
    print(f"wrote {out_path}")
    return 0


def markdown(data: dict[str, Any]) -> str:
    env, cpu, emu = data["environment"], data["cpu"], data["emulation"]
    flags = ", ".join(k for k, v in env["cpu_flags"].items() if v) or "unknown"
    seen = ", ".join(k for k, v in cpu["runtime_features"].items() if v)
    probe = cpu["gemm_probe"]
    lines = [
        "# autocast on CPU: native vs emulated bfloat16 dots",
        "",
        f"- date: {env['date']}; jax {env['jax']}, jaxlib {env['jaxlib']}; "
        f"{env['cpu_model']}, {env['cpu_count']} CPUs",
        f"- /proc/cpuinfo flags: {flags}",
        f"- CPU features the process saw (NumPy, cpuid): {seen}",
        "- "
        + (
            f"**EMULATED {emu['isa'].upper()}-only CPU**: {emu['how']} "
            f"({emu['cpuid_calls_masked']} CPUID calls masked)"
            if emu
            else "no emulation: the host CPU as it is"
        ),
        f"- detected: {cpu['detected']['evidence']} (from "
        f"{cpu['detected']['source']}) -> `{cpu['detected_formulation']}`",
        f"- {probe['n']}^3 GEMM: bf16 x bf16 -> f32 {probe['bf16_gflops']:.0f} "
        f"GFLOP/s, f32 {probe['f32_gflops']:.0f} GFLOP/s "
        f"({probe['bf16_vs_f32']:.2f}x)",
        f"- command: `{data['config']['command']}`; {data['config']['repeats']} "
        f"interleaved rounds after {data['config']['warmup']} warm-up steps, medians. "
        "step ms: wall time; CPU ms/step: the process's CPU time per step (XLA's "
        "threads included), which waits for a core on a busy machine do not inflate",
        "",
        "| workload | variant | step ms | vs float32 | CPU ms/step | vs float32 (CPU) "
        "| saved-for-bwd MiB (batch) | vs float32 | XLA temp MiB "
        "| dots in the compiled step | load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    mib = 2.0**20
    for r in data["results"]:
        dots = "; ".join(f"{v}x {k}" for k, v in r["dots"].items())
        if r.get("hlo_identical_to_baseline") is not None:
            dots += (
                " (HLO identical to baseline)"
                if r["hlo_identical_to_baseline"]
                else " (HLO differs from baseline)"
            )
        lines.append(
            f"| {r['workload']} | {r['variant']} | {r['median_s'] * 1e3:.1f} "
            f"| {r['speedup_vs_float32']:.2f}x "
            f"| {r.get('cpu_median_s', float('nan')) * 1e3:.1f} "
            f"| {r.get('cpu_speedup_vs_float32', float('nan')):.2f}x "
            f"| {r['residual_bytes'] / mib:.1f} ({r['memory_batch']}) "
            f"| {r['residual_ratio']:.2f}x | {(r['temp_bytes'] or 0) / mib:.1f} "
            f"| {dots} | {r['loadavg'][0]:.1f}->{r['loadavg'][1]:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
