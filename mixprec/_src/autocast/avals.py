"""What a value or a jaxpr variable is: its floating dtype, its shape.

The decisions (:mod:`~mixprec._src.autocast.decide`), the interpreter and the
rules ask these questions of arrays, tracers, NumPy literals and jaxpr
variables alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np


__all__ = ["aval_dtype", "aval_shape", "float_dtype", "same_shape", "size"]

_F32 = np.dtype(np.float32)


def float_dtype(x: Any) -> np.dtype | None:
    """The floating dtype of a value or an aval, or ``None`` (integers,
    booleans, PRNG keys, tokens). A Python float counts as float32.

    Examples:
        >>> float_dtype(jnp.ones(2, jnp.bfloat16)), float_dtype(jnp.arange(2))
        (dtype(bfloat16), None)
    """
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        if isinstance(x, float):
            return _F32
        return None
    try:
        return _FLOAT_OR_NONE[dtype]
    except (KeyError, TypeError):  # not seen yet, or not hashable
        pass
    try:
        found = np.dtype(dtype) if jnp.issubdtype(dtype, jnp.floating) else None
    except TypeError:  # extended dtypes (PRNG keys)
        found = None
    try:
        _FLOAT_OR_NONE[dtype] = found
    except TypeError:
        pass
    return found


# Every dtype asked about, and its answer: asked for each operand of each
# equation a walk meets, of a few dtypes in all.
_FLOAT_OR_NONE: dict[Any, np.dtype | None] = {}


def aval_shape(var: Any) -> tuple[Any, ...]:
    """The shape of a jaxpr variable (``()`` for tokens and other non-arrays)."""
    return tuple(getattr(var.aval, "shape", ()))


def aval_dtype(var: Any) -> Any:
    """The dtype of a jaxpr variable (``None`` for tokens and other non-arrays)."""
    return getattr(var.aval, "dtype", None)


def same_shape(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Whether two shapes are known to be equal (symbolic ones compared as
    written; undecidable comparisons are False)."""
    try:
        return tuple(a) == tuple(b)
    except Exception:  # noqa: BLE001  (undecidable symbolic dimensions)
        return False


def size(shape: Sequence[Any]) -> Any:
    """The number of elements of ``shape`` (the shape itself when a dimension
    is symbolic, so that two sizes compare equal only when the shapes do)."""
    try:
        return int(np.prod([int(d) for d in shape]))
    except Exception:  # noqa: BLE001  (symbolic dimensions)
        return tuple(shape)
