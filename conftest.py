# Loaded by pytest before anything imports JAX's backends, for the tests and
# for the doctests in mixprec/ alike: eight CPU devices for sharding tests.
import os


os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("MPLBACKEND", "Agg")
# The suite checks the bfloat16 CPU dot formulation for CPUs with native
# bfloat16 matmuls (jaxprs with bf16 dots, their exact backward numerics) on any
# CPU; tests/test_cpu_bf16.py covers the other formulation and the detection
# with explicit overrides. Without this, an AVX2-only CI machine would pick the
# other formulation for every test. `MIXPREC_CPU_BF16=emulated pytest ...` runs
# the behavioural tests under the other one.
os.environ.setdefault("MIXPREC_CPU_BF16", "native")
