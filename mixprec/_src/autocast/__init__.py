"""Autocast: run any JAX function in mixed precision.

Modules, in the order data flows: ``api`` (``autocast``, the cache),
``config`` (what one transform was asked to do), ``ops`` (the op table: class,
reason, flags and rule of every op; the op lists), ``decide`` (the dtype rule),
``interpreter`` (the one walk over a jaxpr, shared with explain and diagnose),
``rules`` (dots, control flow, calls, defaults), ``dots`` (per-backend
low-precision dots and convolutions), ``modes``, ``mixlist`` and ``regions``
(``float32_scope``, ``precision_scope``).
"""
