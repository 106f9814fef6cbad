"""The ``mixprec`` command line.

* ``main.py``: the one parser and the entry point
  (``mixprec = "mixprec._src.cli.main:main"``; ``python -m mixprec``).
* ``errors.py``: :class:`~mixprec._src.cli.errors.CLIError` and the exit
  statuses, shared by every command (so no command imports ``main.py``).
* ``numerics.py``: ``mixprec inspect`` and ``mixprec diagnose``.
* ``bench.py``: ``mixprec bench``.
* ``demo/``: ``mixprec demo`` (the runner, the report and the plot).

The models, data, training loop and timing helpers the commands run are in
``mixprec/_src/workloads/``, shared with ``benchmarks/``.

Private. Importing this package does no work: each command imports what it needs
(rich, matplotlib, optax, flax) when it runs.
"""
