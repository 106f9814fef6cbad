"""The recogniser of a written-out RMSNorm with its scale, and its rewrite.

What it recognises, in a float32 program (as autocast traces it)::

    y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis, keepdims) + eps) * scale

with ``jnp.square(x)``, ``x * x`` or ``x ** 2``; ``keepdims`` or the statistic
broadcast back (``[..., None]``) after the ``rsqrt``; either operand order of
each ``mul``. It proves what it replaces: the square is of the very ``x`` the
statistic multiplies, the sum's axes are the axes the statistic is broadcast
along, the divisor is their size, ``eps`` is a constant scalar, every value
between ``x`` and the result is read by the next equation of the pattern
alone (nothing else, the program's results included, sees an intermediate),
and ``scale`` is an array of the result's rank (a constant scalar factor is
not a scale). A
differentiated program whose backward pass reads the statistic is left as
written (an intermediate read elsewhere). Anything else stays unfused.

Examples:
    >>> import jax, jax.numpy as jnp
    >>> def rms_norm(x, scale):
    ...     ms = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    ...     return x * jax.lax.rsqrt(ms + 1e-6) * scale[None, :]
    >>> closed = jax.make_jaxpr(rms_norm)(jnp.ones((4, 16)), jnp.ones(16))
    >>> [e.primitive.name for e in rewrite(closed.jaxpr, closed.consts).eqns]
    ['broadcast_in_dim', 'rms_norm']
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.extend.core import Jaxpr, JaxprEqn, Literal, Primitive, new_jaxpr_eqn

from mixprec._src import _compat
from mixprec._src.autocast.avals import aval_shape


__all__ = ["RMS_NORM_P", "Match", "find", "rewrite"]

#: The op of a recognised RMSNorm: one equation in place of its equations
#: (``part="forward"``). Only the walk runs it (its rule: :mod:`.rule`); it is
#: never bound.
RMS_NORM_P = Primitive("rms_norm")
RMS_NORM_P.multiple_results = True

_F32 = np.dtype(np.float32)


@dataclasses.dataclass(frozen=True, eq=False)
class Match:
    """A recognised RMSNorm.

    Attributes:
        inputs: ``(x, scale)``, the values it reads.
        axes: the normalised axes of ``x``.
        eps: the constant added to the mean square.
        eqns: the equations it replaces, in order.
        outvars: its result.
        pattern: what was recognised, for reports.
    """

    inputs: tuple[Any, Any]
    axes: tuple[int, ...]
    eps: float
    eqns: tuple[JaxprEqn, ...]
    outvars: tuple[Any, ...]
    pattern: str = "x·rsqrt(mean(x²) + eps)·scale"

    def __repr__(self) -> str:
        return f"Match({self.pattern!r})"


class _Fail(Exception):
    pass


def _literal_scalar(v: Any) -> float:
    if type(v) is not Literal or np.ndim(v.val) != 0:
        raise _Fail
    return float(v.val)


def _is_f32(v: Any) -> bool:
    return type(v) is not Literal and np.dtype(v.aval.dtype) == _F32


def find(jaxpr: Jaxpr) -> dict[int, tuple[Match, frozenset[int]]]:
    """The RMSNorms of ``jaxpr``: for each, the index of its last equation,
    the match and the indices of the equations it replaces."""
    producer: dict[Any, int] = {}
    users: dict[Any, list[int]] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if type(v) is not Literal:
                users.setdefault(v, []).append(i)
        for v in eqn.outvars:
            producer[v] = i
    outs = {v for v in jaxpr.outvars if type(v) is not Literal}
    found: dict[int, tuple[Match, frozenset[int]]] = {}
    taken: set[int] = set()
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name != "rsqrt" or i in taken:
            continue
        try:
            m, region, last = _match(jaxpr, i, producer, users, outs)
        except _Fail:
            continue
        if region & taken:
            continue
        taken |= region
        found[last] = (m, region)
    return found


def _match(
    jaxpr: Jaxpr,
    at: int,
    producer: dict[Any, int],
    users: dict[Any, list[int]],
    outs: set[Any],
) -> tuple[Match, frozenset[int], int]:
    eqns = jaxpr.eqns
    region: set[int] = set()

    def take(i: int) -> JaxprEqn:
        eqn = eqns[i]
        for v in eqn.outvars:
            if not _is_f32(v):
                raise _Fail
        region.add(i)
        return eqn

    def only_user(v: Any) -> int:
        """The one equation reading the intermediate ``v``."""
        used = users.get(v, [])
        if v in outs or len(used) != 1:
            raise _Fail
        return used[0]

    def made_by(v: Any, *names: str) -> int:
        if type(v) is Literal:
            raise _Fail
        i = producer.get(v)
        if i is None or eqns[i].primitive.name not in names:
            raise _Fail
        only_user(v)
        return i

    rsqrt = take(at)
    # Backwards: rsqrt(ms + eps), ms = sum(x²) / n (broadcast for keepdims).
    add = take(made_by(rsqrt.invars[0], "add"))
    a, b = add.invars
    if type(a) is Literal:
        a, b = b, a
    eps = _literal_scalar(b)
    if not eps >= 0.0:
        raise _Fail
    v = a
    i = made_by(v, "div", "broadcast_in_dim")
    keep_before = None
    if eqns[i].primitive.name == "broadcast_in_dim":
        keep_before = take(i)
        v = keep_before.invars[0]
        i = made_by(v, "div")
    div = take(i)
    if type(div.invars[0]) is Literal:
        raise _Fail
    n = _literal_scalar(div.invars[1])
    v = div.invars[0]
    i = made_by(v, "reduce_sum", "broadcast_in_dim")
    if eqns[i].primitive.name == "broadcast_in_dim":
        if keep_before is not None:
            raise _Fail
        keep_before = take(i)
        v = keep_before.invars[0]
        i = made_by(v, "reduce_sum")
    total = take(i)
    axes = tuple(sorted(total.params["axes"]))
    sq = take(made_by(total.invars[0], "square", "integer_pow", "mul"))
    name = sq.primitive.name
    if name == "integer_pow" and sq.params["y"] != 2:
        raise _Fail
    if name == "mul" and sq.invars[0] is not sq.invars[1]:
        raise _Fail
    x = sq.invars[0]
    if not _is_f32(x):
        raise _Fail
    shape = aval_shape(x)
    kept = tuple(d for d in range(len(shape)) if d not in axes)
    if not axes or n != float(np.float32(math.prod(shape[d] for d in axes))):
        raise _Fail
    keep_shape = tuple(1 if d in axes else s for d, s in enumerate(shape))
    # Forwards: rsqrt's result, broadcast back if it is not yet, times x.
    v = rsqrt.outvars[0]
    if keep_before is None:
        bcast = take(only_user(v))
        if bcast.primitive.name != "broadcast_in_dim":
            raise _Fail
        v = bcast.outvars[0]
        bcast_dims = tuple(bcast.params["broadcast_dimensions"])
    else:
        bcast_dims = tuple(keep_before.params["broadcast_dimensions"])
    if bcast_dims != kept or aval_shape(v) != keep_shape:
        raise _Fail
    normed = take(only_user(v))
    if normed.primitive.name != "mul" or not (
        (normed.invars[0] is x and normed.invars[1] is v)
        or (normed.invars[0] is v and normed.invars[1] is x)
    ):
        raise _Fail
    scaled_at = only_user(normed.outvars[0])
    scaled = take(scaled_at)
    if scaled.primitive.name != "mul":
        raise _Fail
    p, q = scaled.invars
    scale = q if p is normed.outvars[0] else p
    if scale is normed.outvars[0] or not _is_f32(scale):
        raise _Fail
    scale_shape = aval_shape(scale)
    if (
        len(scale_shape) != len(shape)
        or any(a not in (1, b) for a, b in zip(scale_shape, shape, strict=True))
        or aval_shape(scaled.outvars[0]) != shape
    ):
        raise _Fail
    ordered = tuple(eqns[j] for j in sorted(region))
    m = Match(
        inputs=(x, scale),
        axes=axes,
        eps=eps,
        eqns=ordered,
        outvars=(scaled.outvars[0],),
    )
    return m, frozenset(region), scaled_at


def rewrite(
    jaxpr: Jaxpr, consts: Sequence[Any] = (), known: Sequence[Any] = ()
) -> Jaxpr:
    """``jaxpr`` with each recognised RMSNorm replaced by one equation of
    :data:`RMS_NORM_P` at the place of its last equation (its scale may be
    computed between its statistic and its result)."""
    del consts, known
    if not any(e.primitive.name == "rsqrt" for e in jaxpr.eqns):
        return jaxpr
    matches = find(jaxpr)
    if not matches:
        return jaxpr
    drop = set().union(*(region for _, region in matches.values()))
    out: list[JaxprEqn] = []
    for i, eqn in enumerate(jaxpr.eqns):
        if i in matches:
            m, region = matches[i]
            size = math.prod(aval_shape(m.inputs[0]))
            out.append(
                new_jaxpr_eqn(
                    list(m.inputs),
                    list(m.outvars),
                    RMS_NORM_P,
                    # Per element: square, sum, x·r, ·scale (the per-row
                    # divide, add and rsqrt are not counted).
                    {"part": "forward", "fusion": m, "flops": 4 * size},
                    set(),
                    _compat.common_source_info(
                        [jaxpr.eqns[j].source_info for j in sorted(region)]
                    ),
                )
            )
        elif i not in drop:
            out.append(eqn)
    return jaxpr.replace(eqns=out)
