"""``mixprec demo``: the runner, the report (tables, markdown, JSON) and the plot.

Private; reached through ``mixprec demo`` (``mixprec/_src/cli/main.py``). The
models, data and training loop are in ``mixprec/_src/workloads/``. Nothing here
runs at import time.
"""
