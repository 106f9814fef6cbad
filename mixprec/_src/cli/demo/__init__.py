"""``mixprec demo``: real data, a training loop, reports and a plot.

Private; reached through ``mixprec demo`` (``mixprec/_src/cli/main.py``); the
training loop also serves ``mixprec bench`` and ``benchmarks/bench_accuracy.py``.
The models live in ``mixprec/_src/cli/models.py``. Nothing here runs at import
time.
"""
