"""Attention recognised in a jaxpr, and run as one fused kernel on a GPU.

JAX has no attention primitive: ``jax.nn.dot_product_attention`` on float32
inputs (JAX picks its XLA implementation at trace time) and attention written
by hand (Flax's ``MultiHeadDotProductAttention``, Equinox's and Haiku's
``MultiheadAttention``, the usual GPT) reach autocast as the same few
equations: a ``dot_general`` of queries and keys, an optional scale, masks
(``where`` with a very negative fill) and additive biases, a softmax written
out (``reduce_max``, ``exp``, ``reduce_sum``, ``div``), and a ``dot_general``
with the values. :func:`find` recognises that chain; the walker then runs it
as one unit through :func:`fused`, formulated per platform
(:func:`~mixprec._src.autocast.platforms.per_platform`):

* **cuda**: ``jax.nn.dot_product_attention(..., implementation="cudnn")`` on
  16-bit queries, keys and values (cuDNN's flash attention keeps its softmax
  statistics in float32, and has its own derivative). A causal mask that is a
  constant ``tril`` becomes ``is_causal=True``; other masks and biases are
  passed as they are. JAX asks cuDNN for its version when it traces the call;
  where that fails (no cuDNN on the host that traces, or shapes cuDNN refuses,
  such as a head dimension that is not a multiple of 8) the branch keeps the
  other platforms' formulation.
* **every other platform**: the equations as autocast runs them one by one
  today (the result is the same bits as without recognition).

The chain is recognised only where it is provably attention: each
intermediate value has no other use, the softmax normalises over the keys'
axis of the scores, the scale is a constant scalar (a literal or a scalar
function of literals, e.g. ``/ jnp.sqrt(d)``), a mask fills with a
value below ``-1e7`` (after scaling) and the values are contracted over that
same axis. Dropout on the weights, a softmax over another axis, a per-head
scale array, or any other normalisation is left alone.

In a differentiated program (a whole train step) the backward pass reads
the forward's intermediates: there the chain is followed among those reads,
and its backward pass is found by proof (:func:`_backward`); both run as one
unit each, or neither does.

Examples:
    >>> import jax, jax.numpy as jnp
    >>> def attn(q, k, v):
    ...     s = jnp.einsum("bthd,bshd->bhts", q, k) / 8.0
    ...     return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)
    >>> x = jnp.ones((2, 16, 4, 64))
    >>> jaxpr = jax.make_jaxpr(attn)(x, x, x)
    >>> [m.pattern for m in find(jaxpr.jaxpr, jaxpr.consts).values()]
    ['scaled q·kᵀ, softmax, ·v']
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Jaxpr, JaxprEqn, Literal, Primitive, new_jaxpr_eqn

from mixprec._src import _compat
from mixprec._src.autocast import folding, jaxprs
from mixprec._src.autocast.fusions.attention import remat


__all__ = [
    "ATTENTION_P",
    "Match",
    "canonical_layout",
    "constant_values",
    "find",
    "rewrite",
    "step_out_labels",
    "unpaired",
]

#: The private primitive of a recognised attention: one equation in place of
#: its forward equations (``part="forward"``) or of its proven backward pass
#: (``part="backward"``). Only the walk runs it (its rule:
#: :mod:`mixprec._src.autocast.fusions.attention.rule`); it is never bound.
ATTENTION_P = Primitive("dot_product_attention")
ATTENTION_P.multiple_results = True

# A fill below this (after scaling) gives an exactly zero weight in float32.
_FILL_MAX = -1e7
_VIEWS = frozenset(
    {"transpose", "reshape", "broadcast_in_dim", "squeeze", "expand_dims", "copy"}
)
Label = Any  # ("b", i) | "A" | "B" | "H" | None (a unit axis)


@dataclasses.dataclass(frozen=True, eq=False)
class _Step:
    """A mask or bias applied to the scores: the top-level equation, which of
    its operands carries the scores, their labels there, and the scale still
    to be applied after it."""

    kind: str  # "mask" | "bias"
    eqn: JaxprEqn
    operand: int
    labels: tuple[Label, ...]
    factor: float


@dataclasses.dataclass(frozen=True, eq=False)
class _Raw:
    """A mask or bias as found: the scale reached before it, a mask's fill."""

    kind: str
    eqn: JaxprEqn
    operand: int
    labels: tuple[Label, ...]
    scale: float
    fill: float | None


@dataclasses.dataclass(frozen=True, eq=False)
class Match:
    """A recognised attention: which equations, and how to run them fused.

    Attributes:
        first: index of the scores ``dot_general`` in the jaxpr.
        anchor: index of the ``dot_general`` with the values (the result).
        region: indices of every equation the fused kernel replaces.
        inputs: the values the region reads from outside it.
        q, k, v: positions of the queries, keys and values in ``inputs``, with
            per array the axes of its batch labels, its sequence and its head.
        out_labels: the labels of the result's axes.
        scale: the constant the scores are multiplied by.
        steps: masks and biases (in order).
        causal: the masks are exactly a causal ``tril`` (constant).
        pattern: what was recognised, for reports.
        eqn: an equation that stands for the whole region in reports.
        backward: in a differentiated program, its backward pass.
        eqns: the region's equations in order (set by :func:`rewrite`).
        outvars: what the fused equation computes: the result, then the
            values the backward pass reads (set by :func:`rewrite`).
        residuals: where its backward pass is in the transposed body of a
            ``scan`` (:mod:`.scan_pair`), the shapes of the fused kernel's
            residuals, which the forward equation computes after
            ``outvars`` and the backward one reads after its ``reads``;
            ``None`` where both are in one jaxpr.
    """

    first: int
    anchor: int
    region: frozenset[int]
    inputs: tuple[Any, ...]
    q: tuple[int, tuple[int, ...], int, int]
    k: tuple[int, tuple[int, ...], int, int]
    v: tuple[int, tuple[int, ...], int, int]
    batch: tuple[int, ...]
    query: str
    out_labels: tuple[Label, ...]
    scale: float
    steps: tuple[_Step, ...]
    causal: bool
    pattern: str
    eqn: JaxprEqn
    backward: Backward | None = None
    eqns: tuple[JaxprEqn, ...] = ()
    outvars: tuple[Any, ...] = ()
    residuals: tuple[Any, ...] | None = None

    def __repr__(self) -> str:
        return f"Match({self.pattern!r})"


@dataclasses.dataclass(frozen=True, eq=False)
class Backward:
    """The backward pass of a recognised attention in a program that
    differentiates it (a whole train step), proven to be JAX's derivative of
    the forward equations (see :func:`_backward`).

    Attributes:
        region: indices of the equations the fused kernel's derivative
            replaces (some are forward residuals, such as ``1 / sum**2``).
        ct: the cotangent of the attention's result.
        saved: the forward region's values those equations read (the
            unfused formulation's residuals).
        reads: everything the region reads from outside: ``ct``, the
            attention's inputs, ``saved``.
        grads: per queries, keys and values, the variable that holds its
            cotangent (``None``: the program does not compute it).
        at: the index of the equation before which it runs (the first that
            reads a gradient; ``len(eqns)`` for none).
        eqn: an equation that stands for it in reports.
        dropped: dead equations that read the forward's intermediates (what
            JAX's derivative of ``reduce_max`` leaves behind): never run.
        eqns: the region's equations in order (set by :func:`rewrite`).
        outvars: the gradients it computes (set by :func:`rewrite`).
    """

    region: frozenset[int]
    ct: Any
    saved: tuple[Any, ...]
    reads: tuple[Any, ...]
    grads: tuple[Any, ...]
    at: int
    eqn: JaxprEqn
    dropped: frozenset[int]
    eqns: tuple[JaxprEqn, ...] = ()
    outvars: tuple[Any, ...] = ()

    def __repr__(self) -> str:
        return "Backward()"


# ----------------------------------------------------------------- recognition


class _Fail(Exception):
    pass


class _Users(dict):
    """The equations that read each variable (``-1``: an output of the jaxpr).

    ``forward`` (a differentiated program, where the forward equations'
    values are also read by the backward pass): the backward pass's and dead
    equations are left out, and the chain takes, among what remains, the one
    user that has the shape it expects next (see :func:`_pick`).
    """

    forward: bool = False
    eqns: Sequence[JaxprEqn] = ()
    # Values of constants known before the walk, read as a mask's fill where
    # JAX's derivative of a loop hoisted the broadcast fill out of its body
    # (set by :func:`find` and :func:`unpaired`).
    given: dict[Any, Any] = {}


def _users(jaxpr: Jaxpr, ignore: frozenset[int] = frozenset()) -> _Users:
    found = _Users(jaxprs.users(jaxpr, ignore))
    found.eqns = jaxpr.eqns
    found.forward = bool(ignore)
    return found


def _index(seq: Sequence[Any], x: Any) -> int:
    """Where ``x`` is in ``seq`` (``_Fail`` where it is not)."""
    for i, y in enumerate(seq):
        if y is x or y == x:
            return i
    raise _Fail


def _pick(users: dict[Any, list[int]], v: Any, fits: Any) -> list[int]:
    """The users of ``v``; in a differentiated program only those that
    ``fits(eqn)`` (the others read forward values for the backward pass)."""
    us = users.get(v, [])
    if isinstance(users, _Users) and users.forward:
        us = [i for i in us if i < 0 or fits(users.eqns[i])]
        if len(us) > 1:
            us = [i for i in us if i >= 0]
    return us


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(getattr(v.aval, "shape", ()))


def _is_f32(v: Any) -> bool:
    return getattr(v.aval, "dtype", None) == np.dtype(np.float32)


def _view_labels(eqn: JaxprEqn, labels: tuple[Label, ...]) -> tuple[Label, ...]:
    """The labels of a view's result, or ``_Fail`` if it moves data between
    labelled axes (only transposes and unit-axis changes are views here)."""
    name = eqn.primitive.name
    src, out = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    if name == "transpose":
        return tuple(labels[p] for p in eqn.params["permutation"])
    if name in ("copy", "reduce_precision"):  # (an exact one: `_is_view`)
        return labels
    if name == "broadcast_in_dim":
        if math.prod(src) != math.prod(out):
            raise _Fail
        res: list[Label] = [None] * len(out)
        for j, d in enumerate(eqn.params["broadcast_dimensions"]):
            res[d] = labels[j]
        return tuple(res)
    # reshape, squeeze, expand_dims: unit axes added or removed only.
    kept = [lab for lab, n in zip(labels, src, strict=True) if n != 1]
    if [n for n in src if n != 1] != [n for n in out if n != 1]:
        raise _Fail
    it = iter(kept)
    return tuple(next(it) if n != 1 else None for n in out)


def _scalar_literal(jaxpr: Jaxpr, v: Any) -> float | None:
    """The value of a scalar literal, possibly broadcast or converted, or of a
    scalar computed from such values only (``/ jnp.sqrt(d)``, ``* lax.rsqrt(d)``,
    ``d ** -0.5``): the value the program computes."""
    x = _scalar_value(jaxpr, v)
    return None if x is None else float(x)


def _scalar_value(jaxpr: Jaxpr, v: Any) -> Any:
    # Evaluated equation by equation as written, like `_concrete`, but only
    # through scalars: a scale's few equations, never a tensor's history.
    if isinstance(v, Literal):
        return v.val if np.ndim(v.val) == 0 else None
    eqn = jaxprs.producers(jaxpr).get(v)
    if eqn is None:
        return None
    name = eqn.primitive.name
    if name == "broadcast_in_dim":
        return _scalar_value(jaxpr, eqn.invars[0])
    if name == "convert_element_type" and _shape(v):  # of a broadcast scalar
        x = _scalar_value(jaxpr, eqn.invars[0])
        return None if x is None else np.asarray(x).astype(v.aval.dtype)
    if (
        _shape(v)
        or not eqn.invars  # (axis_index: a value of where it runs)
        or eqn.effects
        or len(eqn.outvars) != 1
        or _is_extended(v)
        or jaxprs.has_jaxpr_params(eqn.params)
        or any(_shape(u) or _is_extended(u) for u in eqn.invars)
    ):
        return None
    args = [_scalar_value(jaxpr, u) for u in eqn.invars]
    if any(a is None for a in args):
        return None
    return np.asarray(folding.evaluate(eqn, args)[0])


def _is_fill(v: Any, given: dict[Any, Any]) -> bool:
    """Whether ``v`` may be a ``where``'s fill: a scalar, or a float32
    constant of known value (see :func:`_fill_value`)."""
    return not _shape(v) or (v in given and _is_f32(v))


def _fill_value(jaxpr: Jaxpr, v: Any, given: dict[Any, Any]) -> float | None:
    """The value of a ``where``'s fill: a scalar literal (possibly broadcast
    or converted), or a floating constant in ``given`` whose elements are all
    one value (what a fill becomes when JAX's derivative of ``lax.scan``
    hoists its broadcast out of the body)."""
    if not _shape(v):
        return _scalar_literal(jaxpr, v)
    x = given.get(v)
    if x is None or _compat.is_tracer(x):
        return None
    x = np.asarray(x)
    if x.size == 0 or not np.issubdtype(x.dtype, np.floating):
        return None
    first = x.flat[0]
    return float(first) if bool(np.all(x == first)) else None


def _only_user(users: dict[Any, list[int]], v: Any, fits: Any = None) -> int:
    us = _pick(users, v, fits or (lambda e: True))
    if len(us) != 1 or us[0] < 0:
        raise _Fail
    return us[0]


def _follow_views(
    jaxpr: Jaxpr,
    users: dict[Any, list[int]],
    v: Any,
    labels: tuple[Label, ...],
    region: set[int],
) -> tuple[Any, tuple[Label, ...]]:
    """Follows single-use views forward from ``v``."""
    while True:
        # (In a differentiated program: the one view, where nothing else
        # continues the chain.)
        us = _pick(users, v, lambda e: _is_view(e) or e.primitive.name in _CONTINUES)
        if len(us) != 1 or us[0] < 0:
            return v, labels
        eqn = jaxpr.eqns[us[0]]
        name = eqn.primitive.name
        if name == "convert_element_type" and _is_f32(eqn.outvars[0]):
            labels = labels
        elif name not in _VIEWS and not _is_exact_rounding(eqn):
            return v, labels
        else:
            labels = _view_labels(eqn, labels)
        region.add(us[0])
        v = eqn.outvars[0]


def _is_view(eqn: JaxprEqn) -> bool:
    name = eqn.primitive.name
    return (
        name in _VIEWS
        or (name == "convert_element_type" and _is_f32(eqn.outvars[0]))
        or _is_exact_rounding(eqn)
    )


def _is_exact_rounding(eqn: JaxprEqn) -> bool:
    """A ``reduce_precision`` of a float32 to float32's own precision (what
    ``jax.checkpoint`` puts on the residuals its policy saves): a copy."""
    return (
        eqn.primitive.name == "reduce_precision"
        and _is_f32(eqn.outvars[0])
        and eqn.params.get("exponent_bits") == 8
        and eqn.params.get("mantissa_bits") == 23
    )


_CHAIN = frozenset({"mul", "div", "add", "select_n", "jit", "pjit"}) | _VIEWS
# What continues an attention's chain (other users of its values in a
# differentiated program compute residuals for the backward pass).
_CONTINUES = _CHAIN | {"reduce_max", "sub", "exp", "reduce_sum", "dot_general"}


def _is_where_call(
    jaxpr: Jaxpr, eqn: JaxprEqn, operand: int, given: dict[Any, Any]
) -> bool:
    """Whether a ``jit`` is a ``where`` of the scores (``jnp.where``'s body:
    views and one ``select_n``) with a condition and a scalar literal fill
    (or a fill of known value in ``given``, see :func:`_fill_value`)."""
    inner = eqn.params.get("jaxpr")
    if inner is None or len(eqn.invars) != 3 or not eqn.outvars:
        return False
    body = getattr(inner, "jaxpr", inner)
    names = [e.primitive.name for e in body.eqns]
    allowed = _VIEWS | {"select_n", "ne", "convert_element_type"}
    if names.count("select_n") != 1 or not set(names) <= allowed:
        return False
    # Under differentiation the body also returns what its transpose reads
    # (the condition, broadcast): never a value computed from the scores.
    sel = next(e for e in body.eqns if e.primitive.name == "select_n")
    if body.outvars[0] is not sel.outvars[0]:
        return False
    others = [u for k, u in enumerate(eqn.invars) if k != operand]
    return (
        sum(
            _is_fill(u, given) and _fill_value(jaxpr, u, given) is not None
            for u in others
        )
        == 1
    )


def _scores_chain(
    jaxpr: Jaxpr,
    users: dict[Any, list[int]],
    v: Any,
    labels: tuple[Label, ...],
    region: set[int],
) -> tuple[Any, tuple[Label, ...], float, list[_Raw]]:
    """From the scores, through views, scales, masks and biases, to the input
    of the softmax. Returns it, its labels, the scale and the steps with the
    scale reached at each."""
    scale = 1.0
    steps: list[_Raw] = []
    given = users.given if isinstance(users, _Users) else {}
    while True:
        v, labels = _follow_views(jaxpr, users, v, labels, region)
        us = _pick(users, v, lambda e: e.primitive.name in _CHAIN)
        if len(us) != 1 or us[0] < 0:
            return v, labels, scale, steps
        i = us[0]
        eqn = jaxpr.eqns[i]
        name = eqn.primitive.name
        pos = list(eqn.invars).index(v)
        others = [u for j, u in enumerate(eqn.invars) if j != pos]
        if name in ("mul", "div") and len(others) == 1:
            c = _scalar_literal(jaxpr, others[0])
            if c is None or c == 0 or (name == "div" and pos != 0):
                return v, labels, scale, steps
            scale = scale * c if name == "mul" else scale / c
        elif name == "add" and len(others) == 1 and _shape(eqn.outvars[0]) == _shape(v):
            steps.append(_Raw("bias", eqn, pos, labels, scale, None))
        elif name == "select_n" and pos in (1, 2):
            fill = _scalar_literal(jaxpr, eqn.invars[3 - pos])
            if fill is None:
                raise _Fail
            steps.append(_Raw("mask", eqn, pos, labels, scale, fill))
        elif name in ("jit", "pjit") and _is_where_call(jaxpr, eqn, pos, given):
            fills = [
                _fill_value(jaxpr, u, given)
                for j, u in enumerate(eqn.invars)
                if j != pos and _is_fill(u, given)
            ]
            if len(fills) != 1 or fills[0] is None:
                raise _Fail
            if _shape(eqn.outvars[0]) != _shape(v):
                out_labels = _where_labels(eqn, pos, labels)
            else:
                out_labels = labels
            steps.append(_Raw("mask", eqn, pos, labels, scale, fills[0]))
            labels = out_labels
        else:
            return v, labels, scale, steps
        region.add(i)
        v = eqn.outvars[0]


def _where_labels(eqn: JaxprEqn, pos: int, labels: tuple[Label, ...]) -> tuple:
    """The labels of a ``where`` call's result, following its body's views."""
    body = getattr(eqn.params["jaxpr"], "jaxpr", eqn.params["jaxpr"])
    users = _users(body)
    v, labs = _follow_views(body, users, body.invars[pos], labels, set())
    sel = _only_user(users, v)
    out = body.eqns[sel].outvars[0]
    if body.outvars[0] is not out:
        raise _Fail
    if _shape(out) != _shape(v):
        raise _Fail
    return labs


def _stat_chain(
    jaxpr: Jaxpr,
    users: dict[Any, list[int]],
    v: Any,
    labels: tuple[Label, ...],
    until: str,
    region: set[int],
) -> tuple[JaxprEqn, int, tuple[Label, ...]]:
    """From a row statistic (a max or a sum) through ``max(-inf, .)``,
    ``stop_gradient`` and views to the ``until`` equation that uses it.
    Returns that equation, the operand position and the statistic's labels."""

    def fits(e: JaxprEqn) -> bool:
        name = e.primitive.name
        if name == until:
            return len(e.invars) == 2 and e.invars[1] is not e.invars[0]
        return (
            name in ("max", "stop_gradient") or name in _VIEWS or _is_exact_rounding(e)
        )

    while True:
        i = _only_user(users, v, fits)
        eqn = jaxpr.eqns[i]
        name = eqn.primitive.name
        if name == until:
            return eqn, list(eqn.invars).index(v), labels
        if name == "max":
            other = [u for u in eqn.invars if u is not v]
            c = _scalar_literal(jaxpr, other[0]) if len(other) == 1 else None
            if c is None or c != -np.inf:
                raise _Fail
        elif name in _VIEWS or _is_exact_rounding(eqn):
            labels = _view_labels(eqn, labels)
        elif name != "stop_gradient":
            raise _Fail
        region.add(i)
        v = eqn.outvars[0]


def _reduced(labels: tuple[Label, ...], axis: int) -> tuple[Label, ...]:
    return labels[:axis] + labels[axis + 1 :]


def _keyless(labels: Sequence[Label], key: Label) -> list[Label]:
    return [None if lab == key else lab for lab in labels]


def _softmax(
    jaxpr: Jaxpr,
    users: dict[Any, list[int]],
    x: Any,
    labels: tuple[Label, ...],
    key: Label,
    region: set[int],
) -> tuple[Any, tuple[Label, ...]]:
    """The softmax over the ``key`` axis written out from ``x`` (``exp(x -
    max) / sum``); returns its result and labels."""
    axis = labels.index(key)
    us = _pick(
        users, x, lambda e: e.primitive.name in ("reduce_max", "sub") or _is_view(e)
    )
    if len(us) != 2 or min(us) < 0:
        raise _Fail
    rmax = [i for i in us if jaxpr.eqns[i].primitive.name == "reduce_max"]
    if len(rmax) != 1 or tuple(jaxpr.eqns[rmax[0]].params["axes"]) != (axis,):
        raise _Fail
    region.update(us)
    # The scores, possibly through views, into the subtraction.
    other = jaxpr.eqns[[i for i in us if i != rmax[0]][0]]
    x2, labels2 = x, labels
    if other.primitive.name in _VIEWS:
        labels2 = _view_labels(other, labels)
        x2, labels2 = _follow_views(jaxpr, users, other.outvars[0], labels2, region)
        other = jaxpr.eqns[_only_user(users, x2, lambda e: e.primitive.name == "sub")]
    if other.primitive.name != "sub" or other.invars[0] is not x2:
        raise _Fail
    sub, pos, mlabels = _stat_chain(
        jaxpr, users, jaxpr.eqns[rmax[0]].outvars[0], _reduced(labels, axis), "sub",
        region,
    )  # fmt: skip
    if sub is not other or pos != 1 or list(mlabels) != _keyless(labels2, key):
        raise _Fail
    i = _only_user(users, sub.outvars[0], lambda e: e.primitive.name == "exp")
    exp = jaxpr.eqns[i]
    if exp.primitive.name != "exp":
        raise _Fail
    region.update((i, next(j for j in users[x2] if jaxpr.eqns[j] is other)))
    e = exp.outvars[0]
    # (Where the weights are a saved residual of a checkpoint, through the
    # exact rounding it puts on them.)
    while len(us := users.get(e, [])) == 1 and us[0] >= 0:
        if not _is_exact_rounding(jaxpr.eqns[us[0]]):
            break
        region.add(us[0])
        e = jaxpr.eqns[us[0]].outvars[0]
    us = _pick(
        users,
        e,
        lambda q: (
            q.primitive.name == "reduce_sum"
            or (q.primitive.name == "div" and q.invars[0] is e)
        ),
    )
    if len(us) != 2 or min(us) < 0:
        raise _Fail
    by = {jaxpr.eqns[i].primitive.name: i for i in us}
    if set(by) != {"reduce_sum", "div"}:
        raise _Fail
    axis2 = _index(labels2, key)
    rsum = jaxpr.eqns[by["reduce_sum"]]
    if tuple(rsum.params["axes"]) != (axis2,):
        raise _Fail
    region.update(us)
    div, pos, slabels = _stat_chain(
        jaxpr, users, rsum.outvars[0], _reduced(labels2, axis2), "div", region
    )
    if div is not jaxpr.eqns[by["div"]] or pos != 1 or div.invars[0] is not e:
        raise _Fail
    if list(slabels) != _keyless(labels2, key):
        raise _Fail
    return div.outvars[0], labels2


def _dims(eqn: JaxprEqn) -> tuple[tuple[int, ...], ...]:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    return (
        tuple(map(int, lc)),
        tuple(map(int, rc)),
        tuple(map(int, lb)),
        tuple(map(int, rb)),
    )


def _free(ndim: int, *used: Sequence[int]) -> list[int]:
    taken = {d for u in used for d in u}
    return [d for d in range(ndim) if d not in taken]


def _one_free(shape: Sequence[int], free: Sequence[int]) -> int:
    big = [d for d in free if shape[d] != 1]
    if len(big) != 1:
        raise _Fail
    return big[0]


def _match_at(jaxpr: Jaxpr, users: dict[Any, list[int]], first: int) -> Match:
    dot1 = jaxpr.eqns[first]
    lhs, rhs = dot1.invars
    if not (_is_f32(lhs) and _is_f32(rhs) and _is_f32(dot1.outvars[0])):
        raise _Fail
    lc, rc, lb, rb = _dims(dot1)
    if len(lc) != 1 or len(lb) == 0:
        raise _Fail
    ls, rs = _shape(lhs), _shape(rhs)
    lfree, rfree = _free(len(ls), lc, lb), _free(len(rs), rc, rb)
    la, rb_ = _one_free(ls, lfree), _one_free(rs, rfree)
    labels: tuple[Label, ...] = (
        *[("b", i) for i in range(len(lb))],
        *["A" if d == la else None for d in lfree],
        *["B" if d == rb_ else None for d in rfree],
    )
    region = {first}
    x, labels, scale, raw_steps = _scores_chain(
        jaxpr, users, dot1.outvars[0], labels, region
    )
    keys = [lab for lab in labels if lab in ("A", "B")]
    if sorted(keys) != ["A", "B"]:
        raise _Fail
    # The softmax axis is the keys' axis.
    red = [j for j, lab in enumerate(labels) if lab in ("A", "B")]
    for axis in red:
        key = labels[axis]
        try:
            trial = set(region)
            p, plabels = _softmax(jaxpr, users, x, labels, key, trial)
        except _Fail:
            continue
        region = trial
        break
    else:
        raise _Fail
    p, plabels = _follow_views(jaxpr, users, p, plabels, region)
    anchor = _only_user(users, p, lambda e: e.primitive.name == "dot_general")
    dot2 = jaxpr.eqns[anchor]
    if dot2.primitive.name != "dot_general" or not _is_f32(dot2.outvars[0]):
        raise _Fail
    region.add(anchor)
    c2l, c2r, b2l, b2r = _dims(dot2)
    ppos = list(dot2.invars).index(p)
    if dot2.invars[1 - ppos] is p:
        raise _Fail
    v = dot2.invars[1 - ppos]
    pc, vc = (c2l, c2r) if ppos == 0 else (c2r, c2l)
    pb, vb = (b2l, b2r) if ppos == 0 else (b2r, b2l)
    if len(pc) != 1 or plabels[pc[0]] != key:
        raise _Fail
    nb = len(lb)
    if sorted(plabels[d] for d in pb) != [("b", i) for i in range(nb)]:
        raise _Fail
    query = "B" if key == "A" else "A"
    pfree = _free(len(plabels), pc, pb)
    if [plabels[d] for d in pfree if plabels[d] is not None] != [query]:
        raise _Fail
    vs = _shape(v)
    vfree = _free(len(vs), vc, vb)
    vh = _one_free(vs, vfree)
    # Batch axes of q, k and v ordered by label.
    q_op, k_op = (lhs, rhs) if query == "A" else (rhs, lhs)
    qb, kb = (lb, rb) if query == "A" else (rb, lb)
    qc, kc = (lc[0], rc[0]) if query == "A" else (rc[0], lc[0])
    qseq, kseq = (la, rb_) if query == "A" else (rb_, la)
    vbatch = [0] * nb
    for pd, vd in zip(pb, vb, strict=True):
        vbatch[plabels[pd][1]] = vd
    batch = tuple(int(ls[d]) for d in lb)
    if _shape(q_op)[qc] != _shape(k_op)[kc]:
        raise _Fail
    # Labels of the result: batch in dot2's order, then lhs free, rhs free.
    out: list[Label] = [plabels[d] for d in pb]
    pside = ["T" if plabels[d] == query else None for d in pfree]
    vside = ["H" if d == vh else None for d in vfree]
    out += pside + vside if ppos == 0 else vside + pside
    # Everything the region reads from outside.
    produced = {o for i in region for o in jaxpr.eqns[i].outvars}
    inputs: list[Any] = []
    for i in sorted(region):
        for u in jaxpr.eqns[i].invars:
            if not isinstance(u, Literal) and u not in produced and u not in inputs:
                inputs.append(u)
        for o in jaxpr.eqns[i].outvars:
            if i == anchor or (isinstance(users, _Users) and users.forward):
                continue  # (a differentiated program's are checked by `_backward`)
            if any(j not in region for j in users.get(o, [])):
                raise _Fail
    steps = []
    for r in raw_steps:
        factor = scale / r.scale
        if r.kind == "mask" and not (
            r.fill is not None and r.fill * factor <= _FILL_MAX
        ):
            raise _Fail
        steps.append(_Step(r.kind, r.eqn, r.operand, tuple(r.labels), factor))
    parts = ["scaled q·kᵀ" if scale != 1.0 else "q·kᵀ"]
    if any(s.kind == "mask" for s in steps):
        parts.append("mask")
    if any(s.kind == "bias" for s in steps):
        parts.append("bias")
    parts += ["softmax", "·v"]
    # The two matmuls' FLOPs: 2 b t s h for the scores, 2 b t s h_v for ·v.
    qs = _shape(q_op)
    flops = 2 * math.prod(batch) * qs[qseq] * _shape(k_op)[kseq] * (qs[qc] + vs[vh])
    record = new_jaxpr_eqn(
        [q_op, k_op, v],
        list(dot2.outvars),
        ATTENTION_P,
        {"flops": flops},
        set(),
        dot1.source_info,
    )
    return Match(
        first=first,
        anchor=anchor,
        region=frozenset(region),
        inputs=tuple(inputs),
        q=(_index(inputs, q_op), tuple(qb), qseq, qc),
        k=(_index(inputs, k_op), tuple(kb), kseq, kc),
        v=(_index(inputs, v), tuple(vbatch), vc[0], vh),
        batch=batch,
        query=query,
        out_labels=tuple(out),
        scale=scale,
        steps=tuple(steps),
        causal=False,
        pattern=", ".join(parts),
        eqn=record,
    )


def _given(jaxpr: Jaxpr, consts: Sequence[Any], known: Sequence[Any]) -> dict[Any, Any]:
    """The constvars' and first invars' values known before the walk."""
    return {
        v: x
        for v, x in (
            *zip(jaxpr.constvars, consts, strict=False),
            *zip(jaxpr.invars, known, strict=False),
        )
        if x is not None and not _compat.is_tracer(x)
    }


def _untaken_matches(
    jaxpr: Jaxpr, users: _Users, dots: Sequence[int], taken: set[int]
) -> Iterator[Match]:
    """The attentions matched at ``dots`` that share no equation with
    ``taken`` (read as it is when each is found: the caller adds the regions
    it keeps)."""
    for i in dots:
        if i in taken:
            continue
        try:
            m = _match_at(jaxpr, users, i)
        except _Fail:
            continue
        if not m.region & taken:
            yield m


def find(
    jaxpr: Jaxpr, consts: Sequence[Any] = (), known: Sequence[Any] = ()
) -> dict[int, Match]:
    """The attentions of ``jaxpr`` (its own equations, not sub-jaxprs), by the
    index of their last equation.

    ``consts`` are the values of its constvars and ``known`` those of its
    first invars where they are constants known before the walk (``None``
    where not): a mask computed from constants only is evaluated, and a
    causal one becomes ``is_causal``.
    """
    dots = [i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "dot_general"]
    if len(dots) < 2:
        return {}
    given = _given(jaxpr, consts, known)
    users = _users(jaxpr)
    users.given = given
    out: dict[int, Match] = {}
    taken: set[int] = set()
    for m in _untaken_matches(jaxpr, users, dots, taken):
        m = _with_causal(jaxpr, given, m)
        taken |= m.region
        out[m.anchor] = m
    backward = remat.backward_eqns(jaxpr)
    if not backward:
        return out
    # A differentiated program: its forward attentions with their backward.
    dead = jaxprs.dead_eqns(jaxpr)
    fwd_users = _users(jaxpr, ignore=backward | dead)
    fwd_users.given = given
    for i in dots:
        if i in taken or i in backward:
            continue
        try:
            m = _match_at(jaxpr, fwd_users, i)
        except _Fail:
            continue
        if m.region & taken:
            continue
        bwd = _backward(jaxpr, m, users, dead)
        if bwd is None or bwd.region & taken:
            continue
        m = dataclasses.replace(_with_causal(jaxpr, given, m), backward=bwd)
        taken |= m.region | bwd.region
        out[m.anchor] = m
    return out


def unpaired(
    jaxpr: Jaxpr, consts: Sequence[Any] = (), known: Sequence[Any] = ()
) -> list[Match]:
    """The attentions of ``jaxpr`` recognised but left unfused because the
    values their backward pass reads leave ``jaxpr``.

    Such an attention is its forward equations only (found as :func:`find`
    finds them in a differentiated program, its masks' fills read from
    ``consts`` and ``known`` too), and some of its values other than its
    result are results of ``jaxpr``: the residuals JAX returns from the
    forward body of a differentiated ``lax.scan`` (or ``jit``) for a backward
    pass it puts in another body. :func:`rewrite` has nothing to prove its
    backward pass against, so neither pass is fused. (Whether ``jaxpr`` is
    such a body is for the caller to know: a function that returns its
    attention weights is one too.)
    """
    dots = [i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "dot_general"]
    if len(dots) < 2:
        return []
    given = _given(jaxpr, consts, known)
    taken: set[int] = set()
    for m in find(jaxpr, consts, known).values():
        taken |= m.region | (m.backward.region if m.backward else frozenset())
    users = _users(jaxpr, ignore=jaxprs.dead_eqns(jaxpr))
    users.forward = True
    users.given = given
    every = jaxprs.users(jaxpr)
    out = []
    for m in _untaken_matches(jaxpr, users, dots, taken):
        result = jaxpr.eqns[m.anchor].outvars[0]
        if not any(
            -1 in every.get(o, ())
            for j in m.region
            for o in jaxpr.eqns[j].outvars
            if o is not result
        ):
            continue
        taken |= m.region
        out.append(_with_causal(jaxpr, given, m))
    return out


# ----------------------------------------------------------------- the rewrite


def rewrite(
    jaxpr: Jaxpr, consts: Sequence[Any] = (), known: Sequence[Any] = ()
) -> Jaxpr:
    """``jaxpr`` with each recognised attention replaced by one equation of
    :data:`ATTENTION_P` (and, in a differentiated program, its backward pass
    by another, placed before the first equation that reads a gradient).

    The equations replaced travel in the :class:`Match`; the walk decides the
    new equation like any op and runs it fused or, where it is not fused, runs
    them in its place (see :mod:`mixprec._src.autocast.fusions.attention.rule`).
    """
    matches = find(jaxpr, consts, known)
    if not matches:
        return jaxpr
    eqns = jaxpr.eqns
    drop: set[int] = set()
    put: dict[int, JaxprEqn] = {}
    before: dict[int, list[JaxprEqn]] = {}
    for m in matches.values():
        bwd = m.backward
        out_var = eqns[m.anchor].outvars[0]
        saved = () if bwd is None else bwd.saved
        if bwd is not None:
            grads = tuple(g for g in bwd.grads if g is not None)
            bwd = dataclasses.replace(
                bwd, eqns=tuple(eqns[i] for i in sorted(bwd.region)), outvars=grads
            )
        m = dataclasses.replace(
            m,
            backward=bwd,
            eqns=tuple(eqns[i] for i in sorted(m.region)),
            outvars=(out_var, *saved),
        )
        flops = m.eqn.params["flops"]
        put[m.anchor] = new_jaxpr_eqn(
            list(m.inputs),
            list(m.outvars),
            ATTENTION_P,
            {"part": "forward", "fusion": m, "flops": flops},
            set(),
            # In the scopes every equation it replaces is in: each of them
            # is decided in its own (`decide.decide_fusion`).
            _compat.common_source_info([eqns[i].source_info for i in sorted(m.region)]),
        )
        drop |= m.region
        if bwd is not None:
            before.setdefault(bwd.at, []).append(
                new_jaxpr_eqn(
                    list(bwd.reads),
                    list(bwd.outvars),
                    ATTENTION_P,
                    {"part": "backward", "fusion": m, "flops": 2 * flops},
                    set(),
                    bwd.eqn.source_info,
                )
            )
            drop |= bwd.region | bwd.dropped
    out: list[JaxprEqn] = []
    for i, eqn in enumerate(eqns):
        out += before.get(i, ())
        if i in put:
            out.append(put[i])
        elif i not in drop:
            out.append(eqn)
    out += before.get(len(eqns), ())
    return jaxpr.replace(eqns=out)


# ----------------------------------------------------------------- differentiated


def _backward(
    jaxpr: Jaxpr, m: Match, users: dict[Any, list[int]], dead: frozenset[int]
) -> Backward | None:
    """The backward pass of the attention ``m`` (matched in a differentiated
    program), or ``None`` where it cannot be proven to be exactly it.

    The proof: JAX's ``vjp`` of the matched forward equations, with respect
    to the queries, keys and values, is traced and each of its values named
    structurally (primitive, parameters, operands' names; ``jit`` bodies
    inlined; :class:`~mixprec._src.autocast.jaxprs.StructuralNames`), its
    inputs leaves of their own. The program's values computed from the
    attention's inputs and the cotangent of its result are named the same
    way, with those leaves (:func:`~mixprec._src.autocast.jaxprs.names_from`).
    The program's equations that compute a value of that ``vjp`` are its
    backward pass, and the variables that hold its results the gradients.
    Nothing else may read their values (nor the forward's intermediates).
    """
    out_var = jaxpr.eqns[m.anchor].outvars[0]
    p_var = next(u for u in jaxpr.eqns[m.anchor].invars if u is not m.inputs[m.v[0]])
    # The cotangent is the other operand of the product that computes the
    # values' gradient from the softmax.
    cts = []
    for i in users.get(p_var, []):
        e = jaxpr.eqns[i] if i >= 0 else None
        if e is not None and i != m.anchor and e.primitive.name == "dot_general":
            cts += [
                u
                for u in e.invars
                if u is not p_var
                and type(u) is not Literal
                and _shape(u) == _shape(out_var)
            ]
    for ct in cts:
        try:
            bwd = _prove(jaxpr, m, users, dead, ct)
        except _Fail:
            continue
        if bwd is not None:
            return bwd
    return None


def _aval_struct(v: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(_shape(v), v.aval.dtype)


# The reference derivatives traced so far, by the structure of what they
# differentiate (see `_structure`).
_references: dict[Any, Any] = {}


def _structure(
    eqns: Sequence[JaxprEqn],
    inputs: Sequence[Any],
    out_var: Any,
    ct: Any,
    diff: Sequence[int],
) -> Any:
    """What ``eqns`` compute from ``inputs`` as a hashable key: each
    equation's primitive, parameters and operands (an input's position, a
    literal's value, an earlier result's place); ``None`` if unhashable."""
    place: dict[Any, Any] = {v: ("in", i) for i, v in enumerate(inputs)}
    parts = []
    for k, e in enumerate(eqns):
        operands = []
        for u in e.invars:
            if type(u) is Literal:
                operands.append(("lit", jaxprs.param_key(np.asarray(u.val))))
            elif u in place:
                operands.append(place[u])
            else:
                return None
        params = tuple(sorted((n, jaxprs.param_key(x)) for n, x in e.params.items()))
        parts.append((e.primitive.name, params, tuple(operands)))
        for j, o in enumerate(e.outvars):
            place[o] = ("out", k, j)
    if out_var not in place:
        return None
    avals = tuple(str(v.aval) for v in (*inputs, ct))
    key = (tuple(parts), avals, place[out_var], tuple(diff))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _prove(
    jaxpr: Jaxpr, m: Match, users: dict[Any, list[int]], dead: frozenset[int], ct: Any
) -> Backward | None:
    region_eqns = [jaxpr.eqns[i] for i in sorted(m.region)]
    out_var = jaxpr.eqns[m.anchor].outvars[0]
    diff = sorted({m.q[0], m.k[0], m.v[0]})
    if len(diff) < 3:
        return None  # one array as two of them: its gradient is a sum (not fused)

    def forward(*vals: Any) -> Any:
        env = dict(zip(m.inputs, vals, strict=True))
        for e in region_eqns:
            outs = jaxprs.bind_as_written(e, [jaxprs.read(env, u) for u in e.invars])
            env.update(zip(e.outvars, outs, strict=True))
        return env[out_var]

    def reference(vals: Sequence[Any], g: Any) -> Any:
        def of(*d: Any) -> Any:
            full = list(vals)
            for j, x in zip(diff, d, strict=True):
                full[j] = x
            return forward(*full)

        return jax.vjp(of, *[vals[j] for j in diff])[1](g)

    # Every layer of a model has the same attention: its derivative is traced
    # once per structure.
    key = _structure(region_eqns, m.inputs, out_var, ct, diff)
    ref = _references.get(key) if key is not None else None
    if ref is None:
        ref = jax.make_jaxpr(reference)(
            [_aval_struct(v) for v in m.inputs], _aval_struct(ct)
        )
        if key is not None:
            if len(_references) >= 256:
                _references.clear()
            _references[key] = ref
    # The reference and the program are named in one table, the attention's
    # inputs and the cotangent leaves of their own in both. Only the program's
    # values computed from those leaves are named, going forward from them and
    # no further than the reference's names: the cost is the attention's, not
    # the program's.
    names = jaxprs.StructuralNames()
    leaves = [names.leaf(k) for k in range(len(m.inputs) + 1)]
    ref_ids = names.of_jaxpr(ref.jaxpr, ref.consts, leaves)
    stop = frozenset(leaves)
    wanted = names.ancestors(ref_ids, stop) - stop
    ids = jaxprs.names_from(
        jaxpr, names, dict(zip((*m.inputs, ct), leaves, strict=True)), wanted, users
    )
    at_eqn = jaxprs.positions(jaxpr)
    region = frozenset(
        i
        for i in {at_eqn[o] for o in ids}
        if i not in m.region
        and i not in dead
        and all(o in ids for o in jaxpr.eqns[i].outvars)
    )
    if not region:
        return None
    produced = {o: i for i in sorted(region) for o in jaxpr.eqns[i].outvars}
    by_id = {ids[o]: o for o in produced}
    grads = tuple(by_id.get(r) for r in ref_ids)
    if all(g is None for g in grads):
        return None
    # Nothing outside reads the backward's values but its gradients, or the
    # forward's but the backward (and the result).
    fwd_out = {o for i in m.region for o in jaxpr.eqns[i].outvars}
    for o in produced:
        if o in grads:
            continue
        if any(j < 0 or (j not in region and j not in dead) for j in users.get(o, [])):
            return None
    saved = []
    for o in fwd_out:
        if o is out_var:
            continue
        for j in users.get(o, []):
            if j < 0 or (j not in m.region and j not in region and j not in dead):
                return None
            if j in region and o not in saved:
                saved.append(o)
    reads: list[Any] = [ct]
    # (A constant it reads is computed from literals only: the zeros JAX's
    # transposed `where` is given.)
    const = jaxprs.constant_vars(jaxpr)
    for i in sorted(region):
        for u in jaxpr.eqns[i].invars:
            if isinstance(u, Literal) or u in produced or u in reads:
                continue
            if u not in fwd_out and u not in m.inputs and u not in const:
                return None
            reads.append(u)
    # It runs where its first gradient is read, once its cotangent exists.
    readers = [
        j
        for g in grads
        if g is not None
        for j in users.get(g, [])
        if j not in region and j not in dead
    ]
    at = (
        min((len(jaxpr.eqns) if j < 0 else j) for j in readers)
        if readers
        else len(jaxpr.eqns)
    )
    ct_at = at_eqn.get(ct, -1)
    if not (m.anchor < at and ct_at < at) or ct_at in region or ct_at in m.region:
        return None
    transposed = region & remat.backward_eqns(jaxpr)
    if not transposed:
        return None
    ops = [m.inputs[m.q[0]], m.inputs[m.k[0]], m.inputs[m.v[0]]]
    record = new_jaxpr_eqn(
        [ct, *ops],
        [g for g in grads if g is not None],
        ATTENTION_P,
        {"flops": 2 * m.eqn.params["flops"]},
        set(),
        _compat.common_source_info(
            [jaxpr.eqns[i].source_info for i in sorted(transposed)]
        ),
    )
    full: list[Any] = [None, None, None]
    for j, pos in enumerate(diff):
        for slot, spec in enumerate((m.q, m.k, m.v)):
            if spec[0] == pos:
                full[slot] = grads[j]
    # The dead equations that read what is replaced, and those reading them.
    dropped: set[int] = set()
    stack = [j for o in (*fwd_out, *produced) for j in users.get(o, ()) if j in dead]
    while stack:
        i = stack.pop()
        if i not in dropped:
            dropped.add(i)
            stack += [
                j for o in jaxpr.eqns[i].outvars for j in users.get(o, ()) if j in dead
            ]
    return Backward(
        dropped=frozenset(dropped),
        region=region,
        ct=ct,
        saved=tuple(saved),
        reads=tuple(reads),
        grads=tuple(full),
        at=at,
        eqn=record,
    )


# ----------------------------------------------------------------- constant masks


def _is_extended(v: Any) -> bool:
    """Whether ``v`` holds no plain array (a PRNG key, a token)."""
    dtype = getattr(v.aval, "dtype", None)
    return dtype is None or jnp.issubdtype(dtype, jax.dtypes.extended)


def _concrete(jaxpr: Jaxpr, given: dict[Any, Any], v: Any, memo: dict) -> Any:
    """The value of ``v`` if it is computed from literals and the constants
    whose values are ``given`` only."""
    if isinstance(v, Literal):
        return v.val
    if v in memo:
        return memo[v]
    if v in given:
        memo[v] = given[v]
        return memo[v]
    eqn = jaxprs.producers(jaxpr).get(v)
    if eqn is not None and not any(_is_extended(o) for o in eqn.outvars):
        args = [_concrete(jaxpr, given, u, memo) for u in eqn.invars]
        if any(a is None for a in args):
            memo[v] = None
            return None
        res = folding.evaluate(eqn, args)
        for o, r in zip(eqn.outvars, res, strict=True):
            memo[o] = np.asarray(r)
        return memo[v]
    memo[v] = None
    return None


def constant_values(
    jaxpr: Jaxpr, given: dict[Any, Any], variables: Sequence[Any]
) -> list[Any]:
    """The values of ``variables`` of ``jaxpr`` that are computed from
    literals and the constants whose values are ``given`` only (``None`` for
    the others): what the body of an equation that reads them knows of its
    constant operands."""
    memo: dict[Any, Any] = {}
    return [_concrete(jaxpr, given, v, memo) for v in variables]


def _with_causal(jaxpr: Jaxpr, given: dict[Any, Any], m: Match) -> Match:
    """``m`` with its masks replaced by ``is_causal`` where they are a
    constant causal ``tril`` and it has no bias."""
    masks = [s for s in m.steps if s.kind == "mask"]
    if not masks or len(masks) != len(m.steps):
        return m
    memo: dict[Any, Any] = {}
    keep = None
    for s in masks:
        args = []
        for j, u in enumerate(s.eqn.invars):
            if j == s.operand:
                args.append(np.zeros(_shape(u), np.float32))
                continue
            val = _concrete(jaxpr, given, u, memo)
            if val is None:
                return m
            args.append(val)
        res = np.asarray(folding.evaluate(s.eqn, args)[0]) == 0
        one = np.asarray(canonical_layout(res, step_out_labels(s), m.batch, m.query))
        keep = one if keep is None else keep & one
    assert keep is not None
    t, s_len = keep.shape[-2:]
    if not np.array_equal(
        np.broadcast_to(np.tril(np.ones((t, s_len), bool)), keep.shape), keep
    ):
        return m
    return dataclasses.replace(
        m, steps=(), causal=True, pattern=m.pattern.replace("mask", "causal mask")
    )


def step_out_labels(step: _Step) -> tuple[Label, ...]:
    if step.eqn.primitive.name in ("jit", "pjit") and _shape(
        step.eqn.outvars[0]
    ) != _shape(step.eqn.invars[step.operand]):
        return _where_labels(step.eqn, step.operand, step.labels)
    return step.labels


# ----------------------------------------------------------------- the fused kernel


def canonical_layout(
    x: Any, labels: Sequence[Label], batch: Sequence[int], query: str
) -> Any:
    """A mask or bias in the scores' labels as ``[B, N, T, S]``."""
    order = [j for j, lab in enumerate(labels) if isinstance(lab, tuple)]
    order.sort(key=lambda j: labels[j][1])
    key = "B" if query == "A" else "A"
    seq = [labels.index(query), labels.index(key)]
    units = [j for j, lab in enumerate(labels) if lab is None]
    perm = order + seq + units
    y = jnp.transpose(x, perm) if isinstance(x, jax.Array) else np.transpose(x, perm)
    shape = y.shape[: len(order) + 2]
    y = y.reshape(shape)
    full = (*batch, *shape[len(order) :])
    y = (
        jnp.broadcast_to(y, full)
        if isinstance(y, jax.Array)
        else np.broadcast_to(y, full)
    )
    b = math.prod(batch[:-1])
    return y.reshape((b, batch[-1], *shape[len(order) :]))
