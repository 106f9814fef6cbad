"""Facts about a jaxpr that the rewrite passes and the walk share.

Each is computed once per jaxpr object and kept beside it (weakly), never
once per match or per equation: who produces and who reads each variable,
which equations are dead (as ``pe.dce_jaxpr`` would drop them), which JAX's
transposition emitted, which values are computed from literals only. And
structural names (equal names, equal computations), with which a rewrite
proves that a program's equations compute what another jaxpr computes; they
are given going forward from chosen leaves, so a proof costs what it looks
at, not the whole program.

Examples:
    >>> import jax, jax.numpy as jnp
    >>> program = jax.make_jaxpr(lambda x: (jnp.sin(x) * 2, jnp.cos(x)))(1.0).jaxpr
    >>> ref = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(1.0).jaxpr
    >>> names = StructuralNames()
    >>> leaf = names.leaf("x")
    >>> [want] = names.of_jaxpr(ref, [], [leaf])
    >>> found = names_from(program, names, {program.invars[0]: leaf},
    ...                    names.ancestors([want], frozenset([leaf])), users(program))
    >>> [str(e.primitive) for e in program.eqns if e.outvars[0] in found]  # not cos
    ['sin', 'mul']
    >>> unused_cos = jax.make_jaxpr(lambda x: (jnp.cos(x), x)[1])(1.0).jaxpr
    >>> sorted(dead_eqns(unused_cos))  # the cos nothing reads
    [0]
"""

from __future__ import annotations

import heapq
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal

from mixprec._src import _compat


__all__ = [
    "StructuralNames",
    "backward_eqns",
    "bind_as_written",
    "constant_vars",
    "dead_eqns",
    "has_jaxpr_params",
    "names_from",
    "param_key",
    "positions",
    "producers",
    "read",
    "users",
]

T = TypeVar("T")


def read(env: dict[Any, Any], v: Any) -> Any:
    """The value of ``v`` in ``env`` (a literal's own value)."""
    return v.val if type(v) is Literal else env[v]


def bind_as_written(eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """Runs ``eqn`` exactly as traced; returns its results as a list."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns: Sequence[Any] = ()
    if isinstance(params, tuple):  # older JAX: (subfuns, params)
        subfuns, params = params
    out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def has_jaxpr_params(params: dict[str, Any]) -> bool:
    """Whether an equation's parameters hold a jaxpr (a body)."""
    for v in params.values():
        if isinstance(v, Jaxpr | ClosedJaxpr):
            return True
        if isinstance(v, tuple | list) and any(
            isinstance(x, Jaxpr | ClosedJaxpr) for x in v
        ):
            return True
    return False


def _per_jaxpr(fn: Callable[[Jaxpr], T]) -> Callable[[Jaxpr], T]:
    """``fn(jaxpr)`` computed once per jaxpr object (kept while it lives)."""
    memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def once(jaxpr: Jaxpr) -> T:
        try:
            return memo[jaxpr]
        except KeyError:
            pass
        except TypeError:  # not weakly referenceable: computed each time
            return fn(jaxpr)
        out = memo[jaxpr] = fn(jaxpr)
        return out

    once.__doc__ = fn.__doc__
    once.__name__ = fn.__name__
    return once


@_per_jaxpr
def producers(jaxpr: Jaxpr) -> dict[Any, JaxprEqn]:
    """The equation that computes each variable of ``jaxpr``."""
    return {o: e for e in jaxpr.eqns for o in e.outvars}


def users(jaxpr: Jaxpr, ignore: frozenset[int] = frozenset()) -> dict[Any, list[int]]:
    """The indices of the equations that read each variable (``-1``: an
    output of the jaxpr), leaving out the equations in ``ignore``."""
    found: dict[Any, list[int]] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        if i in ignore:
            continue
        for v in eqn.invars:
            if type(v) is not Literal:
                found.setdefault(v, []).append(i)
    for v in jaxpr.outvars:
        if type(v) is not Literal:
            found.setdefault(v, []).append(-1)
    return found


@_per_jaxpr
def dead_eqns(jaxpr: Jaxpr) -> frozenset[int]:
    """The equations whose results nothing reads and that have no effect."""
    live = {v for v in jaxpr.outvars if type(v) is not Literal}
    dead = set()
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        e = jaxpr.eqns[i]
        if e.effects or any(o in live for o in e.outvars):
            live.update(v for v in e.invars if type(v) is not Literal)
        else:
            dead.add(i)
    return frozenset(dead)


@_per_jaxpr
def backward_eqns(jaxpr: Jaxpr) -> frozenset[int]:
    """The equations of ``jaxpr`` that JAX's transposition emitted."""
    return frozenset(
        i
        for i, e in enumerate(jaxpr.eqns)
        if _compat.eqn_transformed_by(e.source_info, "transpose")
    )


_PLAIN = frozenset([bool, int, float, str, type(None)])


def param_key(x: Any) -> Any:
    """A hashable form of an equation parameter."""
    if type(x) in _PLAIN or isinstance(x, np.dtype):
        return x
    if isinstance(x, tuple | list):
        if all(type(y) in _PLAIN for y in x):  # shapes, axes: most of them
            return tuple(x)
        return tuple(param_key(y) for y in x)
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return ("array", x.dtype.str, x.shape, x.tobytes())
    if isinstance(x, bool | int | float | str | type(None)):
        return x
    return str(x)


class StructuralNames:
    """Structural names of values: equal names, equal computations.

    A value's name is an integer interned from its primitive, parameters and
    its operands' names (``jit`` bodies inlined); an input is a leaf of its
    own (:meth:`leaf`). :meth:`of_jaxpr` names a whole jaxpr's values and
    `names_from` a program's values computed from given leaves, in the same
    table, so that equal computations get equal names.
    """

    def __init__(self) -> None:
        self.table: dict[Any, int] = {}
        self.children: dict[int, tuple[int, ...]] = {}

    def _intern(self, key: Any, children: tuple[int, ...] = ()) -> int:
        n = self.table.setdefault(key, len(self.table))
        self.children.setdefault(n, children)
        return n

    def leaf(self, key: Any) -> int:
        """A name of its own for ``key``."""
        return self._intern(("leaf", key))

    def _literal(self, v: Any) -> int:
        x = np.asarray(v.val)
        return self._intern(("lit", x.dtype.str, x.shape, x.tobytes()))

    def _const(self, x: Any) -> int:
        if _compat.is_tracer(x):
            return self._intern(("tracer", id(x)))
        a = np.asarray(x)
        return self._intern(("const", a.dtype.str, a.shape, a.tobytes()))

    def of_jaxpr(
        self, jaxpr: Jaxpr, consts: Sequence[Any], ins: Sequence[int]
    ) -> list[int]:
        """The names of ``jaxpr``'s results, its inputs named ``ins``."""
        env = {v: self._const(c) for v, c in zip(jaxpr.constvars, consts, strict=True)}
        env.update(zip(jaxpr.invars, ins, strict=True))
        self._run(jaxpr, env)
        return [
            self._literal(v) if type(v) is Literal else env[v] for v in jaxpr.outvars
        ]

    def _run(self, jaxpr: Jaxpr, env: dict[Any, int]) -> None:
        for e in jaxpr.eqns:
            ins = tuple(
                [self._literal(u) if type(u) is Literal else env[u] for u in e.invars]
            )
            env.update(zip(e.outvars, self.of_eqn(e, ins), strict=True))

    def of_eqn(self, e: JaxprEqn, ins: tuple[int, ...]) -> list[int]:
        """The names of ``e``'s results, its operands named ``ins``."""
        inner = e.params.get("jaxpr") if e.primitive.name in ("jit", "pjit") else None
        if inner is not None:
            body = getattr(inner, "jaxpr", inner)
            return self.of_jaxpr(body, getattr(inner, "consts", ()), ins)
        params = tuple(sorted((k, param_key(v)) for k, v in e.params.items()))
        key = (e.primitive.name, params, ins)
        return [self._intern((*key, k), ins) for k in range(len(e.outvars))]

    def ancestors(self, roots: Sequence[int], stop: frozenset[int]) -> set[int]:
        """Every name ``roots`` are computed from, not looking past ``stop``."""
        seen: set[int] = set()
        stack = list(roots)
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n not in stop:
                stack.extend(self.children.get(n, ()))
        return seen


@_per_jaxpr
def positions(jaxpr: Jaxpr) -> dict[Any, int]:
    """The index of the equation that computes each variable of ``jaxpr``."""
    return {o: i for i, e in enumerate(jaxpr.eqns) for o in e.outvars}


@_per_jaxpr
def constant_vars(jaxpr: Jaxpr) -> frozenset[Any]:
    """The variables of ``jaxpr`` computed from literals only (an ``iota``,
    a mask built from it, a ``broadcast`` of a literal), by equations without
    effects."""
    const: set[Any] = set()
    for e in jaxpr.eqns:
        if not e.effects and all(type(u) is Literal or u in const for u in e.invars):
            const.update(e.outvars)
    return frozenset(const)


def names_from(
    jaxpr: Jaxpr,
    names: StructuralNames,
    leaves: dict[Any, int],
    keep: frozenset[int] | set[int],
    users: dict[Any, list[int]],
) -> dict[Any, int]:
    """The structural names of the values of ``jaxpr`` computed from
    ``leaves`` (variables named there) and from literals, whose names are in
    ``keep``; found going forward from the leaves, so the cost is that of the
    equations reached, not of the program.

    A value computed from anything else (another input of the program, a value
    not named in ``keep``) is left out: its name could not be in ``keep`` when
    ``keep`` holds every name its members are computed from (as
    `StructuralNames.ancestors` gives). ``users`` is `users` of ``jaxpr``.
    """
    env = dict(leaves)
    const = constant_vars(jaxpr)
    at = positions(jaxpr)

    def name_of(u: Any) -> int | None:
        if type(u) is Literal:
            return names._literal(u)
        n = env.get(u)
        if n is not None or u not in const:
            return n
        # A constant: named from its producers (computed from literals only).
        stack = [u]
        while stack:
            v = stack[-1]
            if v in env:
                stack.pop()
                continue
            e = jaxpr.eqns[at[v]]
            missing = [w for w in e.invars if type(w) is not Literal and w not in env]
            if missing:
                stack += missing
                continue
            stack.pop()
            ins = operands(e)
            assert ins is not None  # every operand is named now
            env.update(zip(e.outvars, names.of_eqn(e, ins), strict=True))
        return env[u]

    def operands(e: JaxprEqn) -> tuple[int, ...] | None:
        ins = []
        for u in e.invars:
            n = name_of(u)
            if n is None:
                return None
            ins.append(n)
        return tuple(ins)

    found: dict[Any, int] = {}
    heap = sorted({i for v in leaves for i in users.get(v, ()) if i >= 0})
    queued = set(heap)
    while heap:
        i = heapq.heappop(heap)
        e = jaxpr.eqns[i]
        ins = operands(e)
        if ins is None:
            continue
        for o, n in zip(e.outvars, names.of_eqn(e, ins), strict=True):
            if n not in keep:
                continue
            env[o] = found[o] = n
            for j in users.get(o, ()):
                if j >= 0 and j not in queued:
                    queued.add(j)
                    heapq.heappush(heap, j)
    return found
