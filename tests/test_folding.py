"""Constants computed while tracing: NumPy's results are XLA's, bit for bit."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Literal

from mixprec._src.autocast import folding, jaxprs


def _run(fn: Any, *args: Any) -> list[tuple[Any, list[Any], list[Any]]]:
    """Each top-level equation of ``fn``'s jaxpr with what ``evaluate`` and
    binding under ``ensure_compile_time_eval`` give."""
    closed = jax.make_jaxpr(fn)(*args)
    env: dict[Any, Any] = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(closed.jaxpr.invars, [np.asarray(a) for a in args], strict=True))
    rows = []
    for eqn in closed.jaxpr.eqns:
        ins = [v.val if type(v) is Literal else env[v] for v in eqn.invars]
        got = folding.evaluate(eqn, ins)
        with jax.ensure_compile_time_eval():
            want = jaxprs.bind_as_written(eqn, ins)
        env.update(zip(eqn.outvars, [np.asarray(w) for w in want], strict=True))
        rows.append((eqn, got, want))
    return rows


def _same_bits(got: Any, want: Any) -> bool:
    g, w = np.asarray(got), np.asarray(want)
    if g.dtype != w.dtype or g.shape != w.shape:
        return False
    if g.dtype.kind == "f" or jnp.issubdtype(g.dtype, jnp.floating):
        gf, wf = g.astype(np.float64), w.astype(np.float64)
        return bool(np.all((gf == wf) | (np.isnan(gf) & np.isnan(wf))))
    return bool(np.array_equal(g, w))


CASES = {
    "tril_mask": (lambda: jnp.tril(jnp.ones((5, 7), bool)), ()),
    "tril_float": (lambda: jnp.tril(jnp.ones((4, 4))), ()),
    "where_fill": (
        lambda x: jnp.where(jnp.tril(jnp.ones((3, 3), bool)), x, -jnp.inf),
        (np.arange(9, dtype=np.float32).reshape(3, 3),),
    ),
    "int_wraps": (
        lambda x: (x + np.int32(2**31 - 1), x * np.int32(65537), -x, ~x),
        (np.array([1, -3, 2**30], np.int32),),
    ),
    "int_compare_logic": (
        lambda x, y: ((x < y) & (x != 0)) | ~(x >= y),
        (np.array([1, 2, 3], np.int32), np.array([3, 2, 1], np.int32)),
    ),
    "moves": (
        lambda x: (x.reshape(2, 3).T, jnp.broadcast_to(x[None], (4, 6)), x[None]),
        (np.arange(6, dtype=np.int32),),
    ),
    "iota_convert": (
        lambda: (
            jax.lax.broadcasted_iota(jnp.int32, (3, 4), 1).astype(jnp.float32),
            jax.lax.iota(jnp.int32, 5).astype(jnp.bfloat16),
            jax.lax.iota(jnp.int32, 5).astype(jnp.float16) * 0.5,
        ),
        (),
    ),
    "float_arith": (
        lambda x: (x * 3.0, x / 7.0, x - 1e5, x + x, x * 1e-7),
        (np.array([1.5, -2.25, 1e30, 0.1], np.float32),),
    ),
    "bf16_f16_rounding": (
        lambda x: (
            x.astype(jnp.bfloat16),
            x.astype(jnp.float16),
            x.astype(jnp.bfloat16) * jnp.bfloat16(3),
            x.astype(jnp.float16) / jnp.float16(3),
        ),
        (np.array([1.0 + 2**-9, 70000.0, -0.3, 1e-3], np.float32),),
    ),
    "div_by_powers_of_two": (
        lambda x: (x / 64.0, x / 0.125, x / -2.0, x.astype(jnp.bfloat16) / 4),
        (np.random.default_rng(0).standard_normal(512).astype(np.float32) * 1e3,),
    ),
    "nan_inf": (
        lambda x: (x * np.inf, x - np.inf, x > np.nan),
        (np.array([1.0, 0.0, -1.0], np.float32),),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_evaluate_matches_xla_bit_for_bit(name: str) -> None:
    fn, args = CASES[name]
    for eqn, got, want in _run(fn, *args):
        assert len(got) == len(want), eqn
        for g, w in zip(got, want, strict=True):
            assert _same_bits(g, w), (eqn, g, w)


@pytest.mark.parametrize(
    "name",
    [
        "tril_mask",
        "tril_float",
        "where_fill",
        "int_wraps",
        "moves",
        "div_by_powers_of_two",
    ],
)
def test_exact_equations_are_computed_without_xla(name: str) -> None:
    fn, args = CASES[name]
    for eqn, got, _ in _run(fn, *args):
        assert all(type(g) is np.ndarray for g in got), eqn


def test_inexact_equations_are_bound_as_before() -> None:
    """``exp``, integer division, a float to int conversion and subnormal
    operands go to XLA (its ``exp`` is not NumPy's; it may flush
    subnormals), and so does a division by other than a power of two (a
    CPU's XLA divides within one ulp, not correctly rounded)."""
    x = np.array([1.0, 2.5, 1e-40], np.float32)
    i = np.array([-7, 7], np.int32)
    rows = _run(
        lambda x, i: (
            jnp.exp(x[:2]),
            jax.lax.div(i, 2),
            x.astype(jnp.int32),
            x * 2,
            x[:2] / 7.0,
        ),
        x,
        i,
    )
    bound = {str(e.primitive) for e, got, _ in rows if type(got[0]) is not np.ndarray}
    assert {"exp", "div", "convert_element_type", "mul"} <= bound
    for eqn, got, want in rows:
        assert _same_bits(got[0], want[0]), eqn
