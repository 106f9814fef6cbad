"""What the walk learns about the values of one jaxpr, in one table.

A :class:`Facts` table is made when the walk enters a jaxpr and is passed
beside it (every :class:`~mixprec._src.autocast.interpreter.Walk` of that
jaxpr holds the same table; a body gets a table of its own). The walk fills
it as equations run; :mod:`~mixprec._src.autocast.decide` and the rules read
it:

* ``producers``: the equation that computed each variable (a value computed
  twice is still one value: :func:`~mixprec._src.autocast.decide.same_value`);
* ``ranges``, ``values``, ``scalars``: what is known of constants (closed-over
  arrays, literals and what is computed from them), so that a constant that
  does not fit the low dtype keeps its op in float32 and a fill saturates;
* ``partners``: per operand of a forward product, the dtype the other operand
  ran in (a backward product that keeps it computes the other's gradient);
* ``wide``: float32 products of CPU dots, for a bias add that follows;
* ``casts``: inputs rounded once for every product that reads them;
* ``fused``: what a fused op's forward pass left for its backward pass
  (its residuals, and the dtype it ran in).

Examples:
    >>> import numpy as np
    >>> facts = Facts()
    >>> note_constant(facts, "c", np.array([0.0, -3.0, 1e-3]))
    >>> facts.ranges["c"]
    (3.0, 0.001)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import JaxprEqn, Literal

from mixprec._src import _compat
from mixprec._src.autocast import folding, jaxprs, ops
from mixprec._src.autocast.avals import aval_shape, float_dtype
from mixprec._src.autocast.decide import CONST


__all__ = [
    "FOLD_LIMIT",
    "Facts",
    "KnownRange",
    "fold_constant",
    "known_value",
    "note_constant",
    "note_scalar",
    "value_range",
]

#: The largest constant (in elements) whose value is computed while walking,
#: to know its range (see :func:`fold_constant`).
FOLD_LIMIT = 1 << 16


class Facts:
    """The facts of one jaxpr being walked (see the module docstring)."""

    __slots__ = (
        "casts",
        "fused",
        "partners",
        "producers",
        "ranges",
        "scalars",
        "values",
        "wide",
    )

    def __init__(self) -> None:
        self.wide: dict[Any, Any] = {}
        self.scalars: dict[Any, Any] = {}
        self.partners: dict[Any, np.dtype] = {}
        self.producers: dict[Any, JaxprEqn] = {}
        self.ranges: dict[Any, tuple[float, float]] = {}
        self.values: dict[Any, Any] = {}
        self.casts: dict[tuple[int, Any], tuple[Any, Any]] = {}
        self.fused: dict[Any, Any] = {}

    def of_constants(self) -> Facts:
        """New facts that know what these know of constants (their values and
        ranges) and producers, and nothing of traced values: for a
        formulation of a fused op traced on its own (a platform branch), whose
        equations are decided as they are in place (a known constant beyond
        the low range keeps its add in float32 there too)."""
        new = Facts()
        new.scalars = dict(self.scalars)
        new.ranges = dict(self.ranges)
        new.values = dict(self.values)
        new.producers = dict(self.producers)
        return new

    def constant_range(self, var: Any) -> tuple[float, float] | None:
        """``(largest finite, smallest non-zero)`` magnitude of a constant
        whose value is known (a literal, a closed-over array, a constant
        computed from those), or ``None``."""
        if type(var) is Literal:
            return value_range(var.val)
        known = self.scalars.get(var)
        if known is not None:
            return value_range(known)
        return self.ranges.get(var)


def value_range(x: Any) -> tuple[float, float]:
    """``(largest finite, smallest non-zero finite)`` magnitude of ``x``
    (``(0.0, inf)`` when it has none).

    Examples:
        >>> value_range(np.array([0.0, -3.0, 1e-3, np.inf]))
        (3.0, 0.001)
    """
    if isinstance(x, bool | int | float | np.generic | np.ndarray) and np.ndim(x) == 0:
        scalar = np.asarray(x)
        if scalar.dtype.kind in "biuf":  # (a literal: most constants asked about)
            m = abs(float(scalar))
            if not math.isfinite(m):
                return 0.0, float("inf")
            return m, m if m > 0 else float("inf")
    a = np.abs(np.asarray(x, dtype=np.float64))
    a = a[np.isfinite(a)]
    if a.size == 0:
        return 0.0, float("inf")
    nonzero = a[a > 0]
    return float(a.max()), float(nonzero.min()) if nonzero.size else float("inf")


class KnownRange(tuple):
    """``(largest finite, smallest non-zero)`` magnitude of a constant whose
    value is not kept (too large): what a body is told of such an operand."""

    __slots__ = ()


def note_constant(facts: Facts, var: Any, x: Any) -> None:
    """Records the range (and, if small, the value) of a constant whose value
    is known before the walk (a closed-over array), or the range a
    :class:`KnownRange` gives."""
    if isinstance(x, KnownRange):
        facts.ranges[var] = (float(x[0]), float(x[1]))
        return
    if _compat.is_tracer(x) or not hasattr(x, "dtype"):
        return
    if jnp.issubdtype(x.dtype, jax.dtypes.extended):
        return  # a PRNG key
    if float_dtype(x) is not None:
        facts.ranges[var] = value_range(x)
    if np.size(x) <= FOLD_LIMIT:
        facts.values[var] = np.asarray(x)
    if np.ndim(x) == 0:
        facts.scalars[var] = np.asarray(x)  # a fill of it saturates without a clamp


def known_value(facts: Facts, var: Any) -> Any:
    """The value of a constant operand known while walking (a literal, a small
    closed-over array, a constant folded from those), or ``None``."""
    if type(var) is Literal:
        return np.asarray(var.val)
    if var in facts.values:
        return facts.values[var]
    known = facts.scalars.get(var)
    if known is not None:
        return np.broadcast_to(np.asarray(known), aval_shape(var))
    return None


def fold_constant(facts: Facts, eqn: JaxprEqn, inmarks: Sequence[int]) -> None:
    """Computes, as written, a small constant made from known constants (a
    ``1e5 * 3`` the program computes), to know its range: the same in
    ``autocast``, ``explain`` and ``diagnose``, whatever is traced."""
    if not all(m & CONST for m in inmarks) or eqn.effects:
        return
    if len(eqn.outvars) != 1 or jaxprs.has_jaxpr_params(eqn.params):
        return
    out = eqn.outvars[0]
    if not hasattr(out.aval, "dtype") or int(np.prod(aval_shape(out))) > FOLD_LIMIT:
        return
    if out in facts.scalars:
        return  # a view of a known scalar: its range is known
    args = [known_value(facts, v) for v in eqn.invars]
    if any(a is None for a in args):
        return
    try:
        [value] = folding.evaluate(eqn, args)
        value = np.asarray(value)
    except Exception:  # noqa: BLE001  (not computable here: range unknown)
        return
    facts.values[out] = value
    if float_dtype(value) is not None:
        facts.ranges[out] = value_range(value)


def note_scalar(facts: Facts, eqn: JaxprEqn, inmarks: Sequence[int]) -> None:
    """Remembers the value of a constant that views a known scalar (a scalar
    broadcast, reshaped or converted), for a fill that saturates it."""
    if not (inmarks and inmarks[0] & CONST and len(eqn.outvars) == 1):
        return
    spec = ops.spec_for(eqn.primitive.name)
    if spec is None or ops.VIEW not in spec.flags:
        return
    src = eqn.invars[0]
    known = src.val if type(src) is Literal else facts.scalars.get(src)
    if known is not None and np.ndim(known) == 0:
        facts.scalars[eqn.outvars[0]] = known
