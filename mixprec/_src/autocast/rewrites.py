"""The rewrite passes: fusions recognised in a jaxpr before it is walked.

Each pass takes a jaxpr (with the values of its constants, and of its first
inputs where they are constants known before the walk) and returns it with
what it recognised replaced by one equation of a private primitive, or the
same jaxpr. The primitive has its own op-table entry (flag
:data:`~mixprec._src.autocast.ops.FUSION`) and rule: the walk, ``explain``
and ``diagnose`` meet an ordinary op, decided from its entry
(:func:`~mixprec._src.autocast.decide.decide_fusion`). A pass proves what it
replaces; a bug in a pass raises, it never silently keeps the equations.

The passes are those of the registered fusions
(:func:`~mixprec._src.autocast.fusions.passes`), in the order of
:data:`~mixprec._src.autocast.fusions.REGISTERED`: a new fusion is a folder
under ``fusions/`` and one line there.

Examples:
    >>> import jax, jax.numpy as jnp
    >>> def attn(q, k, v):
    ...     s = jnp.einsum("bthd,bshd->bhts", q, k) / 8.0
    ...     return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)
    >>> x = jnp.ones((2, 16, 4, 64))
    >>> closed = jax.make_jaxpr(attn)(x, x, x)
    >>> [e.primitive.name for e in rewrite(closed.jaxpr, closed.consts).eqns]
    ['dot_product_attention', 'transpose']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax.extend.core import Jaxpr

from mixprec._src.autocast import fusions


__all__ = ["rewrite"]


def rewrite(jaxpr: Jaxpr, consts: Sequence[Any], known: Sequence[Any] = ()) -> Jaxpr:
    """``jaxpr`` after the passes of every registered fusion, in order."""
    for rewrite_pass in fusions.passes():
        jaxpr = rewrite_pass(jaxpr, consts, known)
    return jaxpr
