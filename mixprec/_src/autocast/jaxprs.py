"""Facts about a jaxpr that the rewrite passes and the walk share.

Each is computed once per jaxpr object and kept beside it (weakly), never
once per match or per equation: who produces and who reads each variable,
which equations are dead (as ``pe.dce_jaxpr`` would drop them), which JAX's
transposition emitted, and structural names (equal names, equal
computations), with which a rewrite proves that a program's equations
compute what another jaxpr computes.

Examples:
    >>> import jax, jax.numpy as jnp
    >>> closed = jax.make_jaxpr(lambda x: (jnp.sin(x), jnp.sin(x)))(1.0)
    >>> names = structural_names(closed.jaxpr)
    >>> a, b = closed.jaxpr.eqns[0].outvars[0], closed.jaxpr.eqns[1].outvars[0]
    >>> names.of[a] == names.of[b]  # sin(x) computed twice is one value
    True
    >>> unused_cos = jax.make_jaxpr(lambda x: (jnp.cos(x), x)[1])(1.0).jaxpr
    >>> sorted(dead_eqns(unused_cos))  # the cos nothing reads
    [0]
"""

from __future__ import annotations

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
    "dead_eqns",
    "has_jaxpr_params",
    "param_key",
    "producers",
    "read",
    "structural_names",
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
        if "transpose(" in _compat.eqn_name_stack(e.source_info)
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
    its operands' names (``jit`` bodies inlined); an input of a program is a
    leaf of its own. :attr:`of` names every variable of the program the
    table was made for; :meth:`of_jaxpr` names another jaxpr's values in the
    same table, so that equal computations get equal names.
    """

    def __init__(self) -> None:
        self.table: dict[Any, int] = {}
        self.children: dict[int, tuple[int, ...]] = {}
        self.of: dict[Any, int] = {}

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
            inner = (
                e.params.get("jaxpr") if e.primitive.name in ("jit", "pjit") else None
            )
            if inner is not None:
                body = getattr(inner, "jaxpr", inner)
                outs = self.of_jaxpr(body, getattr(inner, "consts", ()), ins)
            else:
                params = tuple(sorted((k, param_key(v)) for k, v in e.params.items()))
                key = (e.primitive.name, params, ins)
                outs = [self._intern((*key, k), ins) for k in range(len(e.outvars))]
            env.update(zip(e.outvars, outs, strict=True))

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
def structural_names(jaxpr: Jaxpr) -> StructuralNames:
    """The structural names of every variable of ``jaxpr`` (its inputs and
    constants leaves of their own), in a table shared by whatever is named
    against it later."""
    names = StructuralNames()
    env: dict[Any, int] = {
        v: names.leaf(("free", id(v))) for v in (*jaxpr.constvars, *jaxpr.invars)
    }
    names._run(jaxpr, env)
    names.of = env
    return names


@_per_jaxpr
def eqns_by_name(jaxpr: Jaxpr) -> dict[int, tuple[int, ...]]:
    """The indices of the equations of ``jaxpr`` that compute a variable of
    each structural name (see `structural_names`): finding the equations of a
    set of names is then a look-up, not a scan of the program."""
    of = structural_names(jaxpr).of
    out: dict[int, list[int]] = {}
    for i, e in enumerate(jaxpr.eqns):
        for o in e.outvars:
            n = of.get(o)
            if n is not None and (not out.get(n) or out[n][-1] != i):
                out.setdefault(n, []).append(i)
    return {n: tuple(i) for n, i in out.items()}
