"""Autocast: run any JAX function in mixed precision.

Modules, in the order data flows: ``api`` (``autocast``, the cache),
``nnx_state`` (Flax NNX objects in and out of an autocast function),
``config`` (what one transform was asked to do), ``modes`` (how much of a
function is lowered), ``ops`` (the op table: class, reason, flags and rule of
every op; the op lists), ``mixlist`` (editing the op lists), ``regions``
(``float32_scope``, ``precision_scope``), ``rewrites`` (the passes run on a
jaxpr before it is walked) and ``attention`` (the attention pass: recognition,
proof of its backward pass, the rewrite), ``jaxprs`` (jaxpr facts both share,
computed once per jaxpr), ``interpreter`` (the one walk over a jaxpr, shared
with explain and diagnose), ``facts`` (what the walk learns of one jaxpr's
values), ``decide`` (the dtype rule, and every other dtype decision),
``request`` (what a product's formulation is asked for), ``operands``
(carrying a decision out: casts, saturation, the default rule), ``avals``
(what a value or a jaxpr variable is), ``rules`` (products, control flow,
calls, fused attention, defaults), ``dots`` and ``float8_dots`` (low-precision
and float8 dots and convolutions, per platform), ``platforms`` (formulations
chosen when a computation is lowered), ``capability`` (whether this CPU
multiplies bfloat16 natively).
"""
