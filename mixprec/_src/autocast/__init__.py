"""Autocast: run any JAX function in mixed precision.

Modules, in the order data flows: ``api`` (``autocast``, the cache),
``nnx_state`` (Flax NNX objects in and out of an autocast function),
``config`` (what one transform was asked to do), ``modes`` (how much of a
function is lowered), ``ops`` (the op table: class, reason, flags and rule of
every op; the op lists), ``mixlist`` (editing the op lists), ``regions``
(``float32_scope``, ``precision_scope``), ``decide`` (the dtype rule),
``interpreter`` (the one walk over a jaxpr, shared with explain and diagnose),
``avals`` (what a value or a jaxpr variable is), ``attention`` (attention
recognised in a jaxpr and fused), ``rules`` (products, control flow, calls,
defaults), ``dots`` and ``float8_dots`` (low-precision and float8 dots and
convolutions, per platform), ``platforms`` (formulations chosen when a
computation is lowered), ``capability`` (whether this CPU multiplies bfloat16
natively).
"""
