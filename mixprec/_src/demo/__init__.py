"""The `mixprec demo` workloads: real data, small models, a training loop, reports.

Private; reached through ``mixprec demo`` (``mixprec/_src/cli.py``) and
``mixprec bench``. Nothing here runs at import time.
"""
