"""Measuring steps fairly, and recording the machine they were measured on.

Shared by ``mixprec demo``, ``mixprec bench`` and the scripts in ``benchmarks/``:

* :func:`interleaved`: every variant runs once per round, the order rotating
  between rounds, so that a burst of load from other processes slows every
  variant of that round, not just one; report medians over rounds.
* :func:`memory_analysis`: XLA's ``compiled.memory_analysis()`` as a dict.
* :func:`residual_bytes`: the bytes the forward pass saves for the backward pass
  (the leaves of the ``jax.vjp`` closure, by shape: nothing runs).
* :func:`environment`: JAX/jaxlib/mixprec versions, the device, the CPU model,
  the CPU flags that decide what runs natively (``avx512_bf16``, ``amx_bf16``...)
  and the bfloat16 dot formulation autocast picked from them, for every JSON
  result.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import math
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np


# The CPU features that decide whether half-precision math is native: x86
# (AVX-512 BF16/FP16, AMX) and Arm (FP16 and BF16 vector arithmetic, SVE).
CPU_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_fp16",
    "asimdhp",
    "fphp",
    "bf16",
    "sve",
    "sve2",
)


# ----------------------------------------------------------------------------- timing


def interleaved(
    fns: Mapping[str, Callable[[], Any]],
    *,
    rounds: int,
    warmup: int = 0,
    setup: bool = False,
) -> dict[str, list[float]]:
    """Wall seconds of each call of each function, measured in interleaved rounds.

    Every function is first called ``warmup`` times (not timed). Then each round
    calls every function once, blocking until its result is ready; round ``r``
    starts with function ``r mod n``, so no variant always runs first (after a
    pause) or last.

    Args:
      fns: name -> a function of no arguments (one step, or a few steps, of a
        variant); what it returns is waited for with ``jax.block_until_ready``.
      rounds: timed rounds.
      warmup: untimed calls per function before the first round.
      setup: if true, each function is a factory: it is called untimed and the
        function it returns is the one timed, so that every round times fresh
        objects (tracing or compiling with no cache hit).

    Returns:
      name -> ``rounds`` durations in seconds, in round order.

    Examples:
      >>> times = interleaved({"a": lambda: 1, "b": lambda: 2}, rounds=3)
      >>> {k: len(v) for k, v in times.items()}
      {'a': 3, 'b': 3}
    """
    if rounds < 1:
        raise ValueError(f"`interleaved(rounds=...)` must be >= 1, got {rounds}.")
    names = list(fns)

    def call(name: str) -> float:
        fn = fns[name]() if setup else fns[name]
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        return time.perf_counter() - t0

    for name in names:
        for _ in range(warmup):
            call(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % max(len(names), 1)
        for name in names[shift:] + names[:shift]:
            times[name].append(call(name))
    return times


def median(values: Sequence[float]) -> float:
    """The median, or NaN for no values.

    Examples:
      >>> median([3.0, 1.0, 2.0]), median([])
      (2.0, nan)
    """
    return float(statistics.median(values)) if len(values) else math.nan


def ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``, NaN when either is missing or zero.

    Examples:
      >>> ratio(2.0, 1.0), ratio(1.0, 0.0)
      (2.0, nan)
    """
    if not (math.isfinite(numerator) and math.isfinite(denominator)):
        return math.nan
    return numerator / denominator if denominator else math.nan


def round_ratios(
    base_times: Sequence[float], times: Sequence[float]
) -> tuple[float, float] | None:
    """The lowest and highest per-round ratio ``base / this`` of two variants
    timed in the same interleaved rounds (round ``i`` against round ``i``).

    This is the run-to-run noise of a speed-up: a ratio whose range includes
    1.0 cannot tell the two step times apart (:func:`within_noise`). ``None``
    with fewer than two rounds, where the noise is not measured.

    Examples:
      >>> round_ratios([1.0, 1.2, 1.0], [0.9, 1.0, 1.1])
      (0.9090909090909091, 1.2)
      >>> round_ratios([1.0], [0.5]) is None
      True
    """
    pairs = [
        b / t
        for b, t in zip(base_times, times, strict=False)
        if t > 0 and math.isfinite(b) and math.isfinite(t)
    ]
    if len(pairs) < 2:
        return None
    return min(pairs), max(pairs)


def within_noise(spread: tuple[float, float] | None) -> bool:
    """Whether a speed-up's per-round range (:func:`round_ratios`) includes 1.0:
    in some rounds this variant was faster, in others slower.

    Examples:
      >>> within_noise((0.95, 1.3)), within_noise((1.1, 1.3)), within_noise(None)
      (True, False, False)
    """
    return spread is not None and spread[0] <= 1.0 <= spread[1]


# ----------------------------------------------------------------------------- memory


def memory_analysis(compiled: Any) -> dict[str, int | None]:
    """XLA's memory analysis of a compiled computation, in bytes.

    Args:
      compiled: ``jax.jit(f).lower(...).compile()``.

    Returns:
      ``temp_bytes``, ``argument_bytes``, ``output_bytes``, ``alias_bytes`` and
      ``generated_code_bytes``; ``None`` values where the backend has no analysis.

    Examples:
      >>> import jax.numpy as jnp
      >>> c = jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile()
      >>> memory_analysis(c)["argument_bytes"]
      16
    """
    try:
        ma = compiled.memory_analysis()
    except Exception:  # a backend without the analysis
        ma = None
    fields = ("temp", "argument", "output", "alias", "generated_code")
    return {
        f"{f}_bytes": (
            None if ma is None else int(getattr(ma, f"{f}_size_in_bytes", 0) or 0)
        )
        for f in fields
    }


def tree_bytes(tree: Any) -> int:
    """Total bytes of the array leaves (or shape/dtype structs) of a pytree.

    Examples:
      >>> import jax.numpy as jnp
      >>> tree_bytes({"w": jnp.zeros((2, 3)), "n": jax.ShapeDtypeStruct((4,), "int8")})
      28
    """
    return int(
        sum(
            math.prod(x.shape) * np.dtype(x.dtype).itemsize
            for x in jax.tree.leaves(tree)
            if hasattr(x, "shape") and hasattr(x, "dtype")
        )
    )


def residual_bytes(fn: Callable[..., Any], params: Any, *args: Any) -> int:
    """Bytes the forward pass of ``fn(params, *args)`` saves for the backward pass.

    These are the array leaves of the ``jax.vjp`` closure with respect to
    ``params``, measured by shape with ``jax.eval_shape``: nothing is computed.

    Examples:
      >>> import jax.numpy as jnp
      >>> w, x = jnp.ones((8, 8)), jnp.ones((4, 8))
      >>> residual_bytes(lambda w, x: jnp.sum(jnp.tanh(x @ w)), w, x) > 0
      True
    """

    def residuals(p: Any, *a: Any) -> Any:
        return jax.tree.leaves(jax.vjp(lambda q: fn(q, *a), p)[1])

    return tree_bytes(jax.eval_shape(residuals, params, *args))


def device_peak_bytes() -> int | None:
    """The device's peak bytes in use by this process, where the backend reports
    it (GPUs; ``None`` on CPU)."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # a backend without memory statistics
        return None
    peak = (stats or {}).get("peak_bytes_in_use")
    return None if peak is None else int(peak)


_HLO_VALUE = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[")
_HLO_PARAM = re.compile(r"([\w.\-]+): (\w+)\[")
_HLO_DOT = re.compile(
    r"\s*(?:ROOT )?%[\w.\-]+ = (\w+)\[[^=]*\bdot\(%([\w.\-]+), %([\w.\-]+)\)"
)


def hlo_dot_types(hlo_text: str) -> list[tuple[str | None, str | None, str]]:
    """``(lhs, rhs, out)`` element types of every dot in compiled HLO text
    (``compiled.as_text()``): what XLA really runs, after its own rewrites.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> f = lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)
      >>> a = jnp.ones((4, 4), jnp.float32)
      >>> hlo_dot_types(jax.jit(f).lower(a, a).compile().as_text())
      [('f32', 'f32', 'f32')]
    """
    found = []
    for block in re.split(r"\n(?=\S)", hlo_text):  # one computation each
        header, _, _ = block.partition("\n")
        types: dict[str, str] = {
            m.group(1): m.group(2) for m in _HLO_PARAM.finditer(header)
        }
        lines = block.splitlines()
        for line in lines:
            if m := _HLO_VALUE.match(line):
                types[m.group(1)] = m.group(2)
        for line in lines:
            if m := _HLO_DOT.match(line):
                found.append((types.get(m.group(2)), types.get(m.group(3)), m.group(1)))
    return found


# ----------------------------------------------------------------------------- machine


def on_gpu() -> bool:
    """Whether JAX's default backend is a GPU."""
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def cpu_info(path: str = "/proc/cpuinfo") -> dict[str, Any]:
    """The CPU model and which of :data:`CPU_FLAGS` it has.

    Args:
      path: the ``cpuinfo`` file (Linux); elsewhere the flags are unknown.

    Returns:
      ``{"model": str, "flags": {flag: bool}}``; ``flags`` is empty when the file
      cannot be read.

    Examples:
      >>> info = cpu_info()
      >>> isinstance(info["model"], str) and isinstance(info["flags"], dict)
      True
    """
    model: str | None = None
    present: set[str] | None = None
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model is None:
                    model = value.strip()
                elif key in ("flags", "Features") and present is None:  # x86, Arm
                    present = set(value.split())
    except OSError:
        pass
    model = model or platform.processor() or platform.machine()
    flags = {} if present is None else {f: f in present for f in CPU_FLAGS}
    return {"model": model, "flags": flags}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """What a result was measured on: versions, device, CPU model and flags, load.

    Examples:
      >>> env = environment()
      >>> env["jax"] == jax.__version__, set(env["cpu_flags"]) <= set(CPU_FLAGS)
      (True, True)
    """
    dev = jax.devices()[0]
    cpu = cpu_info()
    load = loadavg()
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "mixprec": _version("mixprec") or "source tree",
        "python": platform.python_version(),
        "backend": jax.default_backend(),
        "device": describe_device(dev, cpu),
        "device_count": jax.device_count(),
        "machine": platform.machine(),
        "cpu_model": cpu["model"],
        "cpu_count": os.cpu_count(),
        "cpu_flags": cpu["flags"],
        "cpu_bf16": _cpu_bf16(),
        "loadavg": load,
    }


def loadavg() -> list[float] | None:
    """The 1, 5 and 15-minute load averages (``None`` where unavailable).

    Examples:
      >>> load = loadavg()
      >>> load is None or len(load) == 3
      True
    """
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):  # not available on this platform
        return None


def describe_device(
    dev: Any, cpu: Mapping[str, Any] | None = None, *, cores: int | None = None
) -> str:
    """The device a result was measured on, for a person to read.

    A GPU is named by its kind (``"gpu: NVIDIA H100 80GB HBM3"``). A CPU device
    has the kind ``"cpu"``, which says nothing, so it is named by the CPU model
    of ``/proc/cpuinfo``, the cores this process may use and whether the CPU
    has bfloat16 dot instructions (``avx512_bf16``/``amx_bf16`` on x86,
    ``bf16`` on Arm).

    Examples:
      >>> class Dev:
      ...     platform, device_kind = "cpu", "cpu"
      >>> cpu = {"model": "AMD EPYC", "flags": {"avx2": True, "avx512_bf16": True}}
      >>> describe_device(Dev(), cpu, cores=2)
      'cpu: AMD EPYC, 2 cores, bfloat16 dot instructions (avx512_bf16)'
    """
    kind = str(getattr(dev, "device_kind", "") or "")
    if dev.platform != "cpu":
        return f"{dev.platform}: {kind}".rstrip(": ")
    cpu = cpu if cpu is not None else cpu_info()
    flags = cpu.get("flags") or {}
    bf16 = [f for f in ("avx512_bf16", "amx_bf16", "bf16") if flags.get(f)]
    if bf16:
        native = f"bfloat16 dot instructions ({', '.join(bf16)})"
    elif flags:
        native = "no bfloat16 dot instructions"
    else:
        native = "CPU flags unknown"
    cores = cores or _usable_cores()
    return f"cpu: {cpu.get('model') or kind}, {cores} cores, {native}"


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _cpu_bf16() -> dict[str, Any] | None:
    """How autocast runs bfloat16 dots on this CPU (``None`` off the CPU)."""
    if jax.default_backend() != "cpu":
        return None
    from mixprec._src.autocast import capability

    cap = capability.cpu_bf16()
    return {
        "native": cap.native,
        "formulation": cap.formulation,
        "describe": cap.describe(),
    }


def flags_summary(flags: Mapping[str, bool]) -> str:
    """The flags that are present, comma-separated (``"none"`` or ``"unknown"``).

    Examples:
      >>> flags_summary({"avx2": True, "amx_bf16": False})
      'avx2'
    """
    if not flags:
        return "unknown"
    return ", ".join(f for f, on in flags.items() if on) or "none"
