# Loaded by pytest before anything imports JAX's backends, for the tests and
# for the doctests in mixprec/ alike: eight CPU devices for sharding tests.
import os
from importlib import metadata


def _jaxlib_before(major: int, minor: int) -> bool:
    try:
        parts = metadata.version("jaxlib").split(".")[:2]
        return (int(parts[0]), int(parts[1])) < (major, minor)
    except (metadata.PackageNotFoundError, ValueError):
        return False


_XLA_FLAGS = ["--xla_force_host_platform_device_count=8"]
# Compile XLA:CPU's fusions with its classic emitters, not the MLIR fusion
# emitters that are its default in jaxlib 0.10 (0.11's XLA no longer has the
# flag, and an unknown flag aborts XLA): the same fusions and buffers, each
# fused loop generated another way. Compiling a corpus program's value and
# gradients took 2.5-3x less CPU time this way (4.3 s to 1.5 s for the
# scan-over-layers GPT). Setting XLA_FLAGS yourself replaces both flags.
if _jaxlib_before(0, 11):
    _XLA_FLAGS.append("--xla_cpu_use_fusion_emitters=false")
os.environ.setdefault("XLA_FLAGS", " ".join(_XLA_FLAGS))
os.environ.setdefault("MPLBACKEND", "Agg")
# Compile with LLVM's optimizer off (JAX's own `jax_disable_most_optimizations`):
# XLA's HLO pipeline (fusion, layouts, buffer assignment: what the tests
# inspect) is the default one; only the machine code is less tuned (a float32
# reduction may add in another order; the suite passes either way).
# Compilation is most of the suite's time: this takes 30% off the suite's CPU
# time on two cores. Set it to 0 to run the suite with JAX's defaults; the
# benchmarks never set it.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# The suite checks the bfloat16 CPU dot formulation for CPUs with native
# bfloat16 matmuls (jaxprs with bf16 dots, their exact backward numerics) on any
# CPU; tests/test_cpu_bf16.py covers the other formulation and the detection
# with explicit overrides. Without this, an AVX2-only CI machine would pick the
# other formulation for every test. `MIXPREC_CPU_BF16=emulated pytest ...` runs
# the behavioural tests under the other one.
os.environ.setdefault("MIXPREC_CPU_BF16", "native")
