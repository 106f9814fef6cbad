"""Autocast: run any JAX function in mixed precision (issue 3).

Modules: ``op_lists`` (allow / deny / infer / clear), ``modes`` (the seven
precision modes and :func:`~mixprec._src.autocast.modes.decide`), ``mixlist``
(``modify_mixlist``), ``rules`` (the cast-rule table), ``hop_rules`` (rules for
higher-order primitives), ``interpreter`` (the jaxpr interpreter), ``regions``
(``float32_scope``, ``precision_scope``), ``dots`` (per-backend low-precision
dots and convolutions) and ``api`` (``autocast``).
"""
