"""Compact training state: low-precision master weights and optimizer moments.

``bits.py``: the counter hash that gives every element its random bits, and
the roundings built on it (stochastic rounding, the exact bfloat16 + remainder
split, updates that land exactly). ``codes.py``: block-wise 8-bit moment codes
(int8 with a non-linear code, float8 e4m3 with a per-block scale).
``optimizer.py``: the optax wrapper (imported only by ``mixprec.optax``).
"""
