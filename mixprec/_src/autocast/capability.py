"""Does this CPU run bfloat16 matmuls natively? Decided once per process.

XLA:CPU (jaxlib 0.10.x) hands ``bfloat16 x bfloat16 -> float32`` dots to
YNNPACK on every x86 CPU, but only CPUs with bfloat16 dot instructions
(AVX-512 BF16, AMX-BF16) compute them faster than float32: elsewhere YNNPACK's
AVX2 kernel widens each bfloat16 to float32 on the fly, and the GEMM runs at
0.7x float32's rate (measured on this project's CPUs; ``docs/performance.md``).
:mod:`~mixprec._src.autocast.dots` formulates bfloat16 dots for either case,
and this module says which one the CPU is:

1. ``MIXPREC_CPU_BF16=native|emulated`` in the environment (read once at
   import), or :func:`override` in code, decides outright.
2. On x86: the CPU's own feature bits, as NumPy read them at run time
   (``cpuid``): native if and only if ``AVX512BF16`` is present (every CPU
   with AMX-BF16 has it too). ``/proc/cpuinfo``'s ``avx512_bf16`` /
   ``amx_bf16`` flags when NumPy does not say.
3. Elsewhere (Arm, or nothing known): a micro-probe that times one
   ``bfloat16 x bfloat16 -> float32`` GEMM against a float32 one (about
   0.3 s, once per process): native if the bfloat16 one is at least
   :data:`PROBE_SPEEDUP` times faster.

Off the CPU (GPU, TPU) this module is not consulted: their bfloat16 matmuls are
native.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import platform as _platform
import statistics
import threading
import time
from collections.abc import Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from mixprec._src import _compat, _config


__all__ = ["Capability", "cpu_bf16", "override"]

CHOICES = ("native", "emulated")
# The micro-probe calls bfloat16 native when its GEMM is this much faster than
# float32's (native CPUs measure 1.9x to 3.6x, AVX2-only ones 0.7x to 1.0x).
PROBE_SPEEDUP = 1.15
_PROBE_N = 512
_PROBE_ROUNDS = 5
# Sources that decide without looking at the CPU, and how reports name them.
_FORCED = {
    "MIXPREC_CPU_BF16": "MIXPREC_CPU_BF16",
    "override": "override",
    "argument": "cpu_bf16",
}
_X86 = ("x86_64", "amd64", "i386", "i686", "x86")


@dataclasses.dataclass(frozen=True)
class Capability:
    """Whether the CPU has native bfloat16 matmuls, and how that was found.

    Attributes:
        native: True when bfloat16 GEMMs are faster than float32 ones here.
        source: how it was decided: ``"MIXPREC_CPU_BF16"``, ``"override"``,
            ``"argument"`` (a ``cpu_bf16=`` argument that differs from what
            was detected), ``"CPU features"``, ``"/proc/cpuinfo"`` or
            ``"probe"``.
        evidence: what was seen (``"AVX512BF16"``, ``"no AVX512BF16"``,
            ``"bf16 GEMM 0.70x float32"``).

    Examples:
        >>> cap = Capability(native=False, source="CPU features",
        ...                  evidence="no AVX512BF16")
        >>> cap.formulation
        'emulated'
        >>> print(cap.describe())
        no native bfloat16 matmul (no AVX512BF16; from CPU features)
    """

    native: bool
    source: str
    evidence: str

    @property
    def formulation(self) -> str:
        """``"native"`` or ``"emulated"``: the CPU formulation of bf16 dots."""
        return "native" if self.native else "emulated"

    @property
    def forced(self) -> bool:
        """True when set (``MIXPREC_CPU_BF16``, :func:`override`, an argument)
        rather than detected from the CPU."""
        return self.source in _FORCED

    def describe(self) -> str:
        """A short phrase for reports."""
        what = "native bfloat16 matmuls" if self.native else "no native bfloat16 matmul"
        if self.forced:
            return f"{what} assumed ({_FORCED[self.source]}={self.formulation})"
        return f"{what} ({self.evidence}; from {self.source})"


_override: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "mixprec_cpu_bf16_override", default=None
)


@contextlib.contextmanager
def override(formulation: str | None) -> Iterator[None]:
    """Forces the CPU formulation of bfloat16 dots inside the ``with`` block.

    An autocast transform takes the formulation when it is created
    (``mixprec.autocast(...)``; on CPUs whose features do not tell, when it
    is first called) or, with ``policy=None``, when it is called; tests and
    benchmarks use this to build both formulations in one process.
    ``None`` restores automatic detection.

    Args:
        formulation: ``"native"``, ``"emulated"`` or ``None``.

    Raises:
        ValueError: another value.

    Examples:
        >>> with override("emulated"):
        ...     print(cpu_bf16().describe())
        no native bfloat16 matmul assumed (override=emulated)
    """
    if formulation is not None and formulation not in CHOICES:
        raise ValueError(
            f"`override(formulation=...)` must be one of {', '.join(CHOICES)} or "
            f"None, got {formulation!r}."
        )
    token = _override.set(formulation)
    try:
        yield
    finally:
        _override.reset(token)


def cpu_bf16() -> Capability:
    """Whether this process's CPU runs bfloat16 matmuls natively.

    Returns:
        A :class:`Capability`; detection runs once per process and is cached
        (an :func:`override` or ``MIXPREC_CPU_BF16`` takes precedence).

    Examples:
        >>> cpu_bf16().formulation in ("native", "emulated")
        True
    """
    forced = _override.get()
    if forced is not None:
        return Capability(forced == "native", "override", f"forced {forced}")
    if _config.cpu_bf16 != "auto":
        native = _config.cpu_bf16 == "native"
        return Capability(native, "MIXPREC_CPU_BF16", f"set to {_config.cpu_bf16}")
    return _detected()


def cpu_bf16_without_probe() -> Capability | None:
    """:func:`cpu_bf16`, or ``None`` when only the micro-probe (which compiles
    and runs a GEMM, so it initialises JAX's CPU backend) could tell.

    Examples:
        >>> with override("native"):
        ...     cpu_bf16_without_probe().formulation
        'native'
    """
    forced = _override.get()
    if forced is not None or _config.cpu_bf16 != "auto":
        return cpu_bf16()
    with _lock:
        if _detected_value is not None:
            return _detected_value
    return from_features(
        _compat.cpu_features(), _platform.machine(), _proc_cpuinfo_flags()
    )


_lock = threading.Lock()
_detected_value: Capability | None = None


def _detected() -> Capability:
    global _detected_value
    with _lock:
        if _detected_value is None:
            found = from_features(
                _compat.cpu_features(), _platform.machine(), _proc_cpuinfo_flags()
            )
            if found is None:
                found = from_timings(*probe_gemm_seconds())
            _detected_value = found
        return _detected_value


def from_features(
    features: Mapping[str, bool] | None,
    machine: str,
    proc_flags: frozenset[str] | None = None,
) -> Capability | None:
    """The capability from CPU feature bits, or ``None`` when they cannot say.

    Args:
        features: NumPy's run-time CPU features (``_compat.cpu_features()``).
        machine: ``platform.machine()``.
        proc_flags: the ``flags`` of ``/proc/cpuinfo``, or ``None``.

    Returns:
        A :class:`Capability` on x86 when either source is known, else ``None``
        (then the micro-probe decides).

    Examples:
        >>> from_features({"AVX2": True, "AVX512BF16": False}, "x86_64").native
        False
        >>> from_features(None, "x86_64", frozenset({"avx2", "amx_bf16"})).native
        True
        >>> from_features({"ASIMD": True}, "aarch64") is None
        True
    """
    if machine.lower() not in _X86:
        return None
    if features:
        native = bool(features.get("AVX512BF16", False))
        evidence = "AVX512BF16" if native else "no AVX512BF16"
        return Capability(native, "CPU features", evidence)
    if proc_flags:
        present = sorted({"avx512_bf16", "amx_bf16"} & proc_flags)
        if present:
            return Capability(True, "/proc/cpuinfo", ", ".join(present))
        return Capability(False, "/proc/cpuinfo", "no avx512_bf16 or amx_bf16")
    return None


def from_timings(bf16_seconds: float, f32_seconds: float) -> Capability:
    """The capability from the micro-probe's GEMM times.

    Examples:
        >>> from_timings(1.0, 0.7).describe()
        'no native bfloat16 matmul (bf16 GEMM 0.70x float32; from probe)'
        >>> from_timings(0.4, 1.0).native
        True
    """
    speedup = f32_seconds / bf16_seconds if bf16_seconds > 0 else 0.0
    return Capability(
        speedup >= PROBE_SPEEDUP, "probe", f"bf16 GEMM {speedup:.2f}x float32"
    )


def _proc_cpuinfo_flags(path: str = "/proc/cpuinfo") -> frozenset[str] | None:
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return None


def probe_gemm_seconds(
    n: int = _PROBE_N, rounds: int = _PROBE_ROUNDS
) -> tuple[float, float]:
    """Median seconds of an ``n``-cubed ``bf16 x bf16 -> f32`` and ``f32`` GEMM.

    The two are timed in alternation on the CPU device, after one untimed call
    each, so that load from other processes slows both alike.

    Examples:
        >>> bf16_s, f32_s = probe_gemm_seconds(n=64, rounds=1)
        >>> bf16_s > 0 and f32_s > 0
        True
    """
    device = jax.devices("cpu")[0]
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)

    def gemm(x: jax.Array, y: jax.Array) -> jax.Array:
        return jax.lax.dot(x, y, preferred_element_type=jnp.float32)

    # The probe may run while a user's function is being traced: evaluate
    # eagerly, never into that trace.
    with jax.ensure_compile_time_eval():
        calls = []
        for dtype in (jnp.bfloat16, jnp.float32):
            x = jax.device_put(a.astype(dtype), device)
            y = jax.device_put(b.astype(dtype), device)
            compiled = jax.jit(gemm).lower(x, y).compile()
            jax.block_until_ready(compiled(x, y))
            calls.append((compiled, x, y))
        times: list[list[float]] = [[], []]
        for _ in range(rounds):
            for i, (compiled, x, y) in enumerate(calls):
                t0 = time.perf_counter()
                jax.block_until_ready(compiled(x, y))
                times[i].append(time.perf_counter() - t0)
    return statistics.median(times[0]), statistics.median(times[1])
