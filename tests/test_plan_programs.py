"""Precision plans on programs shaped like the ones people run: a whole train
step with optax and a loss scale, Flax NNX, Equinox and Haiku models under a
measured plan and a hand-written rules file, a padded attention, the compact
optimizer state, eight devices, and diagnose's suggested plan re-run.

Each test checks what runs (explain's decisions against the lowered program)
and its values against float32 with the per-dtype tolerances of
``tests/helpers.py``.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_tree_dtypes, assert_trees_close, executed_lines

import mixprec
from mixprec._src.plan import Site


LOW = {"bfloat16": "mixed_bfloat16", "float16": "mixed_float16"}
OTHER = {"bfloat16": "float16", "float16": "bfloat16"}


def _chain_loss(w, x, y):
    with jax.named_scope("l0"):
        h = jnp.tanh(x @ w["a"])
    with jax.named_scope("l1"):
        h = h @ w["b"]
    with jax.named_scope("l2"):
        out = jnp.tanh(h) @ w["c"]
    return jnp.mean((out - y) ** 2)


def _chain(d=32, n=16):
    k = jax.random.split(jax.random.key(0), 5)
    w = {
        n_: jax.random.normal(kk, (d, d)) / 6
        for n_, kk in zip("abc", k[:3], strict=True)
    }
    return w, jax.random.normal(k[3], (n, d)), jax.random.normal(k[4], (n, d))


def _dots(fn, *args, policy):
    """``(site, backward, in_dtypes)`` of each product explain reports."""
    report = mixprec.explain(fn, *args, policy=policy)
    return [(op.site, op.backward, op.in_dtypes) for op in report.find("dot_general")]


def _hlo_dots(fn, *args, platform="cuda"):
    """The operand element types of each ``dot_general`` the lowered program
    executes (a called function's once per call)."""
    text = jax.export.export(jax.jit(fn), platforms=[platform])(*args).mlir_module()
    dots = []
    for line in executed_lines(text):
        if "stablehlo.dot_general" in line:
            ins = line.rsplit(" : ", 1)[1].split(" -> ")[0]
            dots.append(tuple(re.findall(r"tensor<(?:[\d?]+x)*(\w+)>", ins)))
    return dots


_HLO = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


# ------------------------------------------- a site in another 16-bit dtype


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
def test_a_site_in_the_other_16_bit_dtype_runs_in_it(low):
    # The base lowers the activations to `low`; the site reading them runs
    # in the other 16-bit dtype, as the plan says (it used to run as
    # written, in float32: its operand was in neither float32 nor its own
    # compute dtype).
    site = OTHER[low]
    w, x, y = _chain()
    plan = mixprec.Plan(LOW[low], sites=(Site("l1", "dot_general", 0, LOW[site]),))
    fn = jax.grad(_chain_loss)
    dots = _dots(fn, w, x, y, policy=plan)
    assert len(dots) == 3 + 5
    for key, _, dtypes in dots:
        assert dtypes == ((site,) * 2 if key[0] == "l1" else (low,) * 2), dots
    hlo = _hlo_dots(mixprec.autocast(fn, plan), w, x, y)
    assert sorted(hlo) == sorted((_HLO[d[0]],) * 2 for _, _, d in dots)
    g = jax.jit(mixprec.autocast(fn, plan))(w, x, y)
    assert_tree_dtypes(g, jnp.float32)
    assert_trees_close(g, fn(w, x, y), dtype="bfloat16", grad=True)


def test_a_precision_scope_in_the_other_16_bit_dtype_runs_in_it():
    def f(x, a, b):
        h = jnp.tanh(x @ a)
        with mixprec.precision_scope("mixed_float16"):
            return h @ b

    x, a, b = jnp.ones((8, 16)), jnp.ones((16, 16)) / 4, jnp.ones((16, 16)) / 4
    ops = mixprec.explain(f, x, a, b, policy="mixed_bfloat16").find("dot_general")
    assert [op.in_dtypes for op in ops] == [("bfloat16",) * 2, ("float16",) * 2]
    out = mixprec.autocast(f, "mixed_bfloat16")(x, a, b)
    assert out.dtype == jnp.float32
    assert_trees_close(out, f(x, a, b), dtype="bfloat16")
