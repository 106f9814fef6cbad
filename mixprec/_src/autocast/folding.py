"""Constants computed while tracing, in NumPy where the result is exact.

Autocast computes a few constants of the program it traces: a mask built from
``iota``s (``jnp.tril``), a fill value, a small constant made from literals.
Bound under ``jax.ensure_compile_time_eval``, each such equation is compiled
by XLA on its first use in a process: a dozen small compilations, as much
time as tracing a 12-layer GPT once. The equations that make such constants
are nearly all integer, boolean or structural (``iota``, ``broadcast_in_dim``,
``select_n``, comparisons, a ``jit`` of those): NumPy computes them to the
same bits without compiling. :func:`evaluate` does so where the result is the
same bits as XLA's by construction (integer and boolean arithmetic,
comparisons, moves of values; on normal numbers float add, subtract and
multiply, which IEEE rounds correctly, and division by a power of two) and
binds the equation as before otherwise.

Examples:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> jaxpr = jax.make_jaxpr(lambda: jnp.tril(jnp.ones((3, 3))))().jaxpr
    >>> env = {}
    >>> for eqn in jaxpr.eqns:
    ...     env.update(zip(eqn.outvars, evaluate(
    ...         eqn, [v.val if hasattr(v, "val") else env[v] for v in eqn.invars])))
    >>> env[jaxpr.outvars[0]]
    array([[1., 0., 0.],
           [1., 1., 0.],
           [1., 1., 1.]], dtype=float32)
    >>> type(env[jaxpr.outvars[0]]) is np.ndarray  # computed without XLA
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import JaxprEqn, Literal

from mixprec._src.autocast import jaxprs
from mixprec._src.autocast.avals import aval_shape


__all__ = ["evaluate"]


class _NotExact(Exception):
    """NumPy's result might differ from XLA's (or NumPy cannot compute it)."""


def evaluate(eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """The results of ``eqn`` on the constant values ``invals``, as XLA
    computes them: in NumPy where that gives the same bits, else bound under
    ``jax.ensure_compile_time_eval`` (raising what binding raises)."""
    try:
        return _numpy_eqn(eqn, invals)
    except _NotExact:
        pass
    with jax.ensure_compile_time_eval():
        return jaxprs.bind_as_written(eqn, invals)


def _dtype(v: Any) -> np.dtype:
    aval = v.aval
    if not hasattr(aval, "dtype") or jnp.issubdtype(aval.dtype, jax.dtypes.extended):
        raise _NotExact
    return np.dtype(aval.dtype)


def _is_float(d: np.dtype) -> bool:
    return d.kind == "f" or jnp.issubdtype(d, np.floating)


def _subnormal(x: np.ndarray) -> bool:
    """Whether ``x`` holds a subnormal number (an XLA that flushes them to
    zero computes otherwise than NumPy)."""
    a = np.abs(x.astype(np.float64))
    return bool(np.any((a > 0) & (a < jnp.finfo(x.dtype).tiny)))


def _numpy_eqn(eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    name = eqn.primitive.name
    if eqn.effects:
        raise _NotExact
    if name in ("jit", "pjit"):
        return _numpy_jit(eqn, invals)
    fn = _RULES.get(name)
    if fn is None or len(eqn.outvars) != 1:
        raise _NotExact
    args = []
    for v, x in zip(eqn.invars, invals, strict=True):
        d = _dtype(v)
        scalar = type(v) is Literal or isinstance(x, bool | int | float)
        a = np.asarray(x, d) if scalar else np.asarray(x)
        if a.dtype != d:
            raise _NotExact
        if _is_float(d) and _subnormal(a):
            raise _NotExact
        args.append(a)
    out_dtype = _dtype(eqn.outvars[0])
    with np.errstate(all="ignore"):
        out = np.asarray(fn(eqn.params, out_dtype, *args))
    if out.dtype != out_dtype or out.shape != aval_shape(eqn.outvars[0]):
        raise _NotExact
    if _is_float(out_dtype) and _subnormal(out):
        raise _NotExact
    return [out]


def _numpy_jit(eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """A ``jit`` whose every equation NumPy computes exactly (else none of
    it: XLA compiles the body as one computation)."""
    closed = eqn.params["jaxpr"]
    body = closed.jaxpr
    env: dict[Any, Any] = dict(zip(body.constvars, closed.consts, strict=True))
    env.update(zip(body.invars, invals, strict=True))
    for e in body.eqns:
        ins = [jaxprs.read(env, u) for u in e.invars]
        env.update(zip(e.outvars, _numpy_eqn(e, ins), strict=True))
    return [
        np.asarray(v.val, _dtype(v)) if type(v) is Literal else env[v]
        for v in body.outvars
    ]


def _ints_only(*args: np.ndarray) -> None:
    if any(_is_float(a.dtype) or a.dtype.kind == "c" for a in args):
        raise _NotExact


def _no_complex(*args: np.ndarray) -> None:
    if any(a.dtype.kind == "c" for a in args):
        raise _NotExact


def _arith(op: Callable[..., Any]) -> Callable[..., Any]:
    """Integer arithmetic wraps in both; float add, sub and mul round
    correctly in both (NumPy computes 16-bit floats in float32 and rounds,
    which is exact for these three; division: :func:`_div`)."""

    def rule(params: dict[str, Any], out: np.dtype, *args: np.ndarray) -> Any:
        _no_complex(*args)
        return op(*args).astype(out, copy=False)

    return rule


def _int_only(op: Callable[..., Any]) -> Callable[..., Any]:
    def rule(params: dict[str, Any], out: np.dtype, *args: np.ndarray) -> Any:
        _ints_only(*args)
        return op(*args).astype(out, copy=False)

    return rule


def _compare(op: Callable[..., Any]) -> Callable[..., Any]:
    def rule(params: dict[str, Any], out: np.dtype, *args: np.ndarray) -> Any:
        _no_complex(*args)
        return op(*args)

    return rule


def _div(params: dict[str, Any], out: np.dtype, x: np.ndarray, y: np.ndarray) -> Any:
    """Float division by powers of two only: exact (a normal result), where
    XLA's division on a CPU is otherwise not correctly rounded; its integer
    division rounds toward zero, NumPy's down."""
    if not _is_float(x.dtype) or x.dtype.kind == "c":
        raise _NotExact
    mantissa, _ = np.frexp(y.astype(np.float64))
    if not np.all(np.abs(mantissa) == 0.5):
        raise _NotExact
    return np.divide(x, y).astype(out, copy=False)


def _iota(params: dict[str, Any], out: np.dtype) -> Any:
    if params.get("sharding") is not None:
        raise _NotExact
    shape, dim = tuple(params["shape"]), params["dimension"]
    view = [1] * len(shape)
    view[dim] = shape[dim]
    return np.broadcast_to(np.arange(shape[dim], dtype=out).reshape(view), shape)


def _broadcast_in_dim(params: dict[str, Any], out: np.dtype, x: np.ndarray) -> Any:
    if params.get("sharding") is not None:
        raise _NotExact
    shape = tuple(params["shape"])
    view = [1] * len(shape)
    for i, d in enumerate(params["broadcast_dimensions"]):
        view[d] = x.shape[i]
    return np.broadcast_to(x.reshape(view), shape)


def _reshape(params: dict[str, Any], out: np.dtype, x: np.ndarray) -> Any:
    if params.get("dimensions") is not None or params.get("sharding") is not None:
        raise _NotExact
    return x.reshape(tuple(params["new_sizes"]))


def _transpose(params: dict[str, Any], out: np.dtype, x: np.ndarray) -> Any:
    return np.transpose(x, tuple(params["permutation"]))


def _squeeze(params: dict[str, Any], out: np.dtype, x: np.ndarray) -> Any:
    return np.squeeze(x, tuple(params["dimensions"]))


def _select_n(
    params: dict[str, Any], out: np.dtype, which: np.ndarray, *cases: Any
) -> Any:
    _no_complex(*cases)
    if which.dtype == np.bool_:
        which = which.astype(np.int32)
    return np.choose(which, cases)


def _convert(params: dict[str, Any], out: np.dtype, x: np.ndarray) -> Any:
    """Booleans and integers to any integer or float type (a float only
    where each value is exact in it), floats to floats (rounded to nearest
    even in both)."""
    if params.get("sharding") is not None:
        raise _NotExact
    src_float, out_float = _is_float(x.dtype), _is_float(out)
    if x.dtype.kind == "c" or out.kind == "c" or (src_float and not out_float):
        raise _NotExact
    if src_float and x.dtype.itemsize > 4:
        raise _NotExact  # float64 to 16 bits: NumPy may round twice
    y = x.astype(out)
    if out_float and not src_float and np.any(y.astype(x.dtype) != x):
        raise _NotExact
    return y


_RULES: dict[str, Callable[..., Any]] = {
    "iota": _iota,
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": _reshape,
    "transpose": _transpose,
    "squeeze": _squeeze,
    "select_n": _select_n,
    "convert_element_type": _convert,
    "copy": lambda params, out, x: x.copy(),
    "copy_p": lambda params, out, x: x.copy(),
    "add": _arith(np.add),
    "sub": _arith(np.subtract),
    "mul": _arith(np.multiply),
    "div": _div,
    "neg": _arith(np.negative),
    "max": _int_only(np.maximum),
    "min": _int_only(np.minimum),
    "and": _int_only(np.bitwise_and),
    "or": _int_only(np.bitwise_or),
    "xor": _int_only(np.bitwise_xor),
    "not": _int_only(np.invert),
    "eq": _compare(np.equal),
    "ne": _compare(np.not_equal),
    "lt": _compare(np.less),
    "le": _compare(np.less_equal),
    "gt": _compare(np.greater),
    "ge": _compare(np.greater_equal),
}
