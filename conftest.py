# Loaded by pytest before anything imports JAX's backends, for the tests and
# for the doctests in mixprec/ alike: eight CPU devices for sharding tests.
import os


os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
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
