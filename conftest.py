# Loaded by pytest before anything imports JAX's backends, for the tests and
# for the doctests in mixprec/ alike: eight CPU devices for sharding tests.
import os


os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("MPLBACKEND", "Agg")
