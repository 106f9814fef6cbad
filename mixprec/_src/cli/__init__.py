"""The ``mixprec`` command line and the workloads behind it.

* ``main.py``: the one parser, the one exit-code policy, the entry point
  (``mixprec = "mixprec._src.cli.main:main"``; ``python -m mixprec``).
* ``numerics.py``: ``mixprec inspect`` and ``mixprec diagnose``.
* ``bench.py``: ``mixprec bench``.
* ``demo/``: ``mixprec demo`` (data, training loop, report, plot).
* ``models.py``: the MLP, LM and CNN (``jax.numpy`` and Flax), written once for
  the demo, ``mixprec bench`` and ``benchmarks/``.
* ``timing.py``: interleaved timing, XLA memory analysis, bytes saved for the
  backward pass, and the machine facts (CPU flags, versions) every result records.

Private. Importing this package does no work: each command imports what it needs
(rich, matplotlib, optax, flax) when it runs.
"""
