"""Naming the matmul sites of a jaxpr, for precision plans.

A plan (:class:`mixprec.Plan`) gives each matmul-like product a policy by
its site: ``(layer, op, index)``, the layer path of its name stack (module
path and named scopes, JAX's transformation wrappers removed), its
primitive, and its occurrence among the forward products of that layer and
primitive in the jaxpr. :func:`name_sites` computes them once per jaxpr
walked, before the rewrite passes (a fused attention's products keep the
names they had), and the walk reads them where it gives an equation its
region (:meth:`~mixprec._src.autocast.interpreter.Walk.for_eqn`).

Backward products follow their forward site. JAX's transpose of
``dot(x, w)`` is ``dot(g, w)`` and ``dot(x, g)``: each keeps a forward
operand as its residual, so a backward product is traced to the forward
product that read the same variable (through reshapes, transposes and
converts). One that cannot be traced back (its residual crossed a ``jit``
or ``scan`` boundary) takes the widest policy of the sites of its layer and
primitive.

Examples:
    >>> import jax, jax.numpy as jnp
    >>> def f(x, w):
    ...     with jax.named_scope("mlp"):
    ...         return jnp.sum(jnp.tanh(x @ w) @ w)
    >>> closed = jax.make_jaxpr(jax.grad(f, 1))(jnp.ones((2, 2)), jnp.ones((2, 2)))
    >>> names = name_sites(closed.jaxpr)
    >>> for keys in sorted(set(names.values())):
    ...     print(keys)
    (('mlp', 'dot_general', 0),)
    (('mlp', 'dot_general', 0), ('mlp', 'dot_general', 1))
    (('mlp', 'dot_general', 1),)
"""

from __future__ import annotations

import functools as ft
import weakref
from collections.abc import Iterator
from typing import Any

from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal

from mixprec._src import _compat
from mixprec._src.autocast import ops


__all__ = ["SiteKey", "layer_of", "name_sites", "program_sites"]

#: ``(layer, op, index)``; ``index`` is ``None`` for a backward product not
#: traced back to a forward one.
SiteKey = tuple[str, str, int | None]

# Ops a residual may pass through between a forward product and the
# backward product that reads it.
_THROUGH = frozenset(
    ["transpose", "reshape", "convert_element_type", "copy", "copy_p", "squeeze"]
)


def layer_of(eqn: JaxprEqn, scope: str = "") -> str:
    """The layer path of ``eqn`` (after ``scope``, the name stack of the
    higher-order equations around its jaxpr)."""
    from mixprec._src.numerics.record import layer_path

    stack = _compat.eqn_name_stack(eqn.source_info)
    full = f"{scope}/{stack}" if scope and stack else scope or stack
    return layer_path(full)


def _is_product(eqn: JaxprEqn) -> bool:
    spec = ops.spec_for(eqn.primitive.name)
    return spec is not None and spec.product is not None


def _is_backward(eqn: JaxprEqn) -> bool:
    return _compat.name_stack_transformed_by(eqn.source_info.name_stack, "transpose")


_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def name_sites(
    jaxpr: Jaxpr,
    scope: str = "",
    backward: bool = False,
    outer: dict[int, tuple[SiteKey, ...]] | None = None,
) -> dict[int, tuple[SiteKey, ...]]:
    """Per product equation of ``jaxpr`` and of the bodies in its equations'
    parameters (by ``id``), the sites it belongs to: one for a forward
    product, those of the forward products it was traced back to for a
    backward one (``backward``: the whole jaxpr is a backward pass).

    The index counts a layer's products in program order across bodies: a
    product in a ``cond`` branch or a called function's body is not the
    same site as one of the same layer outside it. A body reached twice
    (a ``scan`` body, for every iteration; one function called twice from
    the same layer) keeps the names of its first visit. ``outer``: the
    names the walk has for the jaxpr around this body; used when they name
    this body's products in its layers (else the body is named on its own,
    from index 0).
    """
    if outer:
        hit = _inherited(jaxpr, scope, outer)
        if hit is not None:
            return hit
    per_jaxpr = _cache.setdefault(jaxpr, {})
    hit = per_jaxpr.get((scope, backward))
    if hit is not None:
        return hit
    out: dict[int, tuple[SiteKey, ...]] = {}
    _name(jaxpr, scope, backward, out, {})
    per_jaxpr[(scope, backward)] = out
    return out


def _inherited(
    jaxpr: Jaxpr, scope: str, outer: dict[int, tuple[SiteKey, ...]]
) -> dict[int, tuple[SiteKey, ...]] | None:
    """``outer`` if it names every product of ``jaxpr`` in the layer it has
    under ``scope``."""
    found = False
    for eqn in jaxpr.eqns:
        if not _is_product(eqn):
            continue
        keys = outer.get(id(eqn))
        if not keys or any(k[0] != layer_of(eqn, scope) for k in keys):
            return None
        found = True
    return outer if found else None


def _name(
    jaxpr: Jaxpr,
    scope: str,
    backward: bool,
    out: dict[int, tuple[SiteKey, ...]],
    counts: dict[tuple[str, str], int],
) -> None:
    read_by: dict[Any, list[SiteKey]] = {}
    producer: dict[Any, JaxprEqn] = {}
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            producer[v] = eqn
        if not _is_product(eqn):
            subs = list(_sub_jaxprs(eqn))
            if subs:
                stack = _compat.eqn_name_stack(eqn.source_info)
                inner = f"{scope}/{stack}" if scope and stack else scope or stack
                for sub in subs:
                    if not any(id(e) in out for e in sub.eqns if _is_product(e)):
                        _name(sub, inner, backward or _is_backward(eqn), out, counts)
            continue
        layer = layer_of(eqn, scope)
        op = eqn.primitive.name
        if not (backward or _is_backward(eqn)):
            index = counts.get((layer, op), 0)
            counts[(layer, op)] = index + 1
            key: SiteKey = (layer, op, index)
            out[id(eqn)] = (key,)
            for v in eqn.invars:
                if type(v) is not Literal:
                    read_by.setdefault(v, []).append(key)
            continue
        found: list[SiteKey] = []
        for v in eqn.invars:
            for u in _upstream(v, producer):
                for k in read_by.get(u, ()):
                    if k[1] == op and k not in found:
                        found.append(k)
        out[id(eqn)] = tuple(found) if found else ((layer, op, None),)


def _upstream(v: Any, producer: dict[Any, JaxprEqn]) -> Iterator[Any]:
    """``v`` and the variables it was reshaped, transposed or converted from."""
    for _ in range(8):
        if type(v) is Literal:
            return
        yield v
        eqn = producer.get(v)
        if eqn is None or eqn.primitive.name not in _THROUGH or not eqn.invars:
            return
        v = eqn.invars[0]


def _sub_jaxprs(eqn: JaxprEqn) -> Iterator[Jaxpr]:
    for value in eqn.params.values():
        items = value if isinstance(value, tuple | list) else (value,)
        for x in items:
            if isinstance(x, ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, Jaxpr):
                yield x


@ft.lru_cache(maxsize=256)
def _program_sites(jaxpr: Jaxpr, scope: str) -> frozenset[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for eqn in jaxpr.eqns:
        if _is_product(eqn):
            found.add((layer_of(eqn, scope), eqn.primitive.name))
        subs = list(_sub_jaxprs(eqn))
        if subs:
            stack = _compat.eqn_name_stack(eqn.source_info)
            inner = f"{scope}/{stack}" if scope and stack else scope or stack
            for sub in subs:
                found |= _program_sites(sub, inner)
    return frozenset(found)


def program_sites(jaxpr: Jaxpr, scope: str = "") -> frozenset[tuple[str, str]]:
    """``(layer, op)`` of every product of ``jaxpr`` and of the jaxprs in its
    equations' parameters (for checking a plan's rules against a program)."""
    return _program_sites(jaxpr, scope)
