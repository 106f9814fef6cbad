"""The attention a ``jax.checkpoint`` recomputes in a whole train step.

In a differentiated program JAX transposes a ``jax.checkpoint`` into one
body of its backward pass that first recomputes the checkpointed forward
(its name stack under JAX's ``rematted_computation`` scope) and then runs
the backward equations (their name stacks without the ``transpose`` that
the checkpoint equation itself is under). :func:`backward_eqns` tells the
two apart, so that the attention recogniser follows the recomputed forward
and proves the backward beside it as it does at top level.

Where the checkpoint ends at the attention's result, nothing in the body
reads that result: the recomputation stops at the attention weights (the
backward pass reads them), and its ``·v`` product is not there to be
matched. :func:`complete` puts it back, as the ``dot_general`` that the two
backward products of the body are the transposes of, its result one more
(unread) result of the body; the recogniser then proves the backward
against the forward with it. A product put back where nothing is proven is
taken out again. Fused on a GPU, the body recomputes the forward as cuDNN's
forward kernel (its result unused, its softmax statistics read) and runs
cuDNN's backward kernel: the kernels the loss-only wrap gets, where
``jax.checkpoint`` recomputes the fused forward too.

Examples:
    >>> import jax, jax.numpy as jnp
    >>> def attn(q, k, v):
    ...     s = jnp.einsum("bthd,bshd->bhts", q, k) / 8.0
    ...     return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)
    >>> def loss(q, k, v):
    ...     return jnp.sum(jax.checkpoint(attn)(q, k, v) * v)
    >>> x = jnp.ones((2, 16, 4, 64))
    >>> closed = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, x, x)
    >>> [body] = [e.params["jaxpr"] for e in closed.eqns
    ...           if e.primitive.name in REMAT_PRIMITIVES]
    >>> body, added = complete(body)
    >>> added
    1
    >>> from mixprec._src.autocast.fusions.attention import pattern
    >>> [(m.pattern, m.backward is not None) for m in pattern.find(body).values()]
    [('scaled q·kᵀ, softmax, ·v', True)]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.extend.core import Jaxpr, JaxprEqn, Literal, Var, new_jaxpr_eqn

from mixprec._src import _compat
from mixprec._src.autocast import jaxprs


__all__ = [
    "REMAT_PRIMITIVES",
    "backward_eqns",
    "complete",
    "recomputed_attentions",
    "recomputed_eqns",
]

#: The primitives of ``jax.checkpoint`` (``jax.remat``) across JAX releases.
REMAT_PRIMITIVES = frozenset({"remat2", "checkpoint", "remat_opt"})


def recomputed_eqns(jaxpr: Jaxpr) -> frozenset[int]:
    """The equations of ``jaxpr`` that recompute a checkpointed forward (in
    the body of a transposed ``jax.checkpoint``)."""
    return frozenset(
        i for i, e in enumerate(jaxpr.eqns) if _compat.eqn_rematerialized(e.source_info)
    )


def backward_eqns(jaxpr: Jaxpr) -> frozenset[int]:
    """The equations of ``jaxpr`` that JAX's transposition emitted
    (:func:`~mixprec._src.autocast.jaxprs.backward_eqns`); in the body of a
    transposed ``jax.checkpoint``, every equation but the recomputed forward."""
    found = jaxprs.backward_eqns(jaxpr)
    if found:
        return found
    recomputed = recomputed_eqns(jaxpr)
    if not recomputed:
        return found
    return frozenset(range(len(jaxpr.eqns))) - recomputed


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(getattr(v.aval, "shape", ()))


def _is_f32(v: Any) -> bool:
    return getattr(v.aval, "dtype", None) == np.dtype(np.float32)


def _dims(eqn: JaxprEqn, pos: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The contracting and batch axes of operand ``pos`` of a ``dot_general``."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    con, bat = (lc, lb) if pos == 0 else (rc, rb)
    return tuple(map(int, con)), tuple(map(int, bat))


def _labels(
    rank: int, con: Sequence[int], con_label: str, bat: Sequence[int], bat_labels: Any
) -> list[Any] | None:
    """Per axis its label: batch axes theirs, the contracted one ``con_label``
    and the one left ``"free"`` (``None`` where more than one is left)."""
    labels: list[Any] = [None] * rank
    for d, lab in zip(bat, bat_labels, strict=True):
        labels[d] = lab
    if len(con) != 1:
        return None
    labels[con[0]] = con_label
    rest = [d for d in range(rank) if labels[d] is None]
    if len(rest) != 1:
        return None
    labels[rest[0]] = "free"
    return labels


def _product(jaxpr: Jaxpr, d1: int, ppos: int, d2: int, cpos: int) -> JaxprEqn | None:
    """The forward ``·v`` whose transposes are ``d1`` (the values' gradient:
    the cotangent times the weights, operand ``ppos``) and ``d2`` (the
    weights' gradient: the cotangent, operand ``cpos``, times the values)."""
    e1, e2 = jaxpr.eqns[d1], jaxpr.eqns[d2]
    p, c = e1.invars[ppos], e1.invars[1 - ppos]
    v = e2.invars[1 - cpos]
    if not all(_is_f32(x) for x in (p, c, v)):
        return None
    p_con, p_bat = _dims(e1, ppos)
    c_con, c_bat = _dims(e1, 1 - ppos)
    nb = len(c_bat)
    batch = [("b", i) for i in range(nb)]
    # The cotangent: batch, queries ("free" in d1: contracted with the
    # weights' queries), head; the weights: batch, queries, keys.
    c_lab = _labels(len(_shape(c)), c_con, "T", c_bat, batch)
    p_lab = _labels(len(_shape(p)), p_con, "T", p_bat, batch)
    c2_con, c2_bat = _dims(e2, cpos)
    v_con, v_bat = _dims(e2, 1 - cpos)
    if c_lab is None or p_lab is None or len(c2_con) != 1:
        return None
    if c_lab[c2_con[0]] != "free" or sorted(c2_bat) != sorted(c_bat):
        return None
    v_lab = _labels(len(_shape(v)), v_con, "H", v_bat, [c_lab[d] for d in c2_bat])
    if v_lab is None or len(c_lab) != nb + 2:
        return None
    # A dot_general's result is its batch axes, then the left operand's free
    # axis, then the right's: the cotangent's layout says which is which.
    if c_lab[:nb] != batch:
        return None
    v_first = c_lab[nb] == "free"
    lhs, rhs = (v, p) if v_first else (p, v)
    l_lab, r_lab = (v_lab, p_lab) if v_first else (p_lab, v_lab)
    # The keys are "free" in both: contracted by the forward product.
    dims = (
        ((l_lab.index("free"),), (r_lab.index("free"),)),
        (tuple(l_lab.index(b) for b in batch), tuple(r_lab.index(b) for b in batch)),
    )
    out_shape = (
        *(_shape(lhs)[d] for d in dims[1][0]),
        *(_shape(lhs)[d] for d in range(len(l_lab)) if l_lab[d] in ("T", "H")),
        *(_shape(rhs)[d] for d in range(len(r_lab)) if r_lab[d] in ("T", "H")),
    )
    if (
        out_shape != _shape(c)
        or _shape(lhs)[dims[0][0][0]] != _shape(rhs)[dims[0][1][0]]
    ):
        return None
    return new_jaxpr_eqn(
        [lhs, rhs],
        [Var(c.aval)],
        e1.primitive,
        dict(e1.params, dimension_numbers=dims),
        set(),
        _compat.as_rematerialized(e1.source_info),
    )


def _candidates(jaxpr: Jaxpr) -> list[tuple[int, JaxprEqn]]:
    """Per recomputed attention weights with no ``·v`` beside them, the
    index after which their ``·v`` goes and the product."""
    recomputed = recomputed_eqns(jaxpr)
    if not recomputed:
        return []
    eqns = jaxpr.eqns
    at = jaxprs.positions(jaxpr)
    users = jaxprs.users(jaxpr)

    def forward_value(x: Any) -> bool:
        return type(x) is not Literal and (x not in at or at[x] in recomputed)

    dots = [
        i
        for i, e in enumerate(eqns)
        if i not in recomputed and e.primitive.name == "dot_general"
    ]
    out: list[tuple[int, JaxprEqn]] = []
    seen: set[Any] = set()
    for d1 in dots:
        for ppos in (0, 1):
            p, c = eqns[d1].invars[ppos], eqns[d1].invars[1 - ppos]
            if p in seen or type(c) is Literal or forward_value(c):
                continue
            if p not in at or at[p] not in recomputed:
                continue
            if any(
                j >= 0 and j in recomputed and eqns[j].primitive.name == "dot_general"
                for j in users.get(p, ())
            ):
                continue  # its ·v is recomputed too
            for d2 in dots:
                e2 = eqns[d2]
                if d2 == d1 or c not in e2.invars or len(set(e2.invars)) != 2:
                    continue
                cpos = list(e2.invars).index(c)
                v = e2.invars[1 - cpos]
                if v is p or not forward_value(v):
                    continue
                eqn = _product(jaxpr, d1, ppos, d2, cpos)
                if eqn is not None:
                    after = max(at.get(p, -1), at.get(v, -1))
                    out.append((after, eqn))
                    seen.add(p)
                    break
    return out


def _with(jaxpr: Jaxpr, products: Sequence[tuple[int, JaxprEqn]]) -> Jaxpr:
    after: dict[int, list[JaxprEqn]] = {}
    for i, eqn in products:
        after.setdefault(i, []).append(eqn)
    eqns = list(after.get(-1, ()))
    for i, eqn in enumerate(jaxpr.eqns):
        eqns.append(eqn)
        eqns += after.get(i, ())
    outvars = [*jaxpr.outvars, *(eqn.outvars[0] for _, eqn in products)]
    return jaxpr.replace(eqns=eqns, outvars=outvars)


def recomputed_attentions(
    jaxpr: Jaxpr, known: Sequence[Any] = ()
) -> tuple[Jaxpr, list[Any]]:
    """The body of a transposed ``jax.checkpoint`` with the ``·v`` products
    of its proven attentions put back (see :func:`complete`), and those
    attentions (:class:`~.pattern.Match`, each with its backward)."""
    products = _candidates(jaxpr)
    from mixprec._src.autocast.fusions.attention import pattern  # (imports this)

    trial = _with(jaxpr, products) if products else jaxpr
    proven = [m for m in pattern.find(trial, (), known).values() if m.backward]
    anchors = {id(trial.eqns[m.anchor]) for m in proven}
    kept = [(i, eqn) for i, eqn in products if id(eqn) in anchors]
    if len(kept) == len(products):
        return trial, proven
    done = _with(jaxpr, kept) if kept else jaxpr
    proven = [m for m in pattern.find(done, (), known).values() if m.backward]
    return done, proven


def complete(jaxpr: Jaxpr, known: Sequence[Any] = ()) -> tuple[Jaxpr, int]:
    """``jaxpr`` (the body of a transposed ``jax.checkpoint``) with the
    ``·v`` product of each recomputed attention that lacks one put back, as
    results after its own; and how many were put back. Only those of an
    attention whose backward pass is proven are kept (``known``: the values
    of its first inputs where they are constants)."""
    if not _candidates(jaxpr):
        return jaxpr, 0
    done, _ = recomputed_attentions(jaxpr, known)
    return done, len(done.outvars) - len(jaxpr.outvars)
