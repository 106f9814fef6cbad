"""Tests for `mixprec.equinox.MixedPrecision`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_dtypes, assert_trees_close

import mixprec
import mixprec.equinox as mpe


BF16, F16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)


class Net(eqx.Module):
    lin1: eqx.nn.Linear
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear
    steps: jax.Array  # an integer buffer: never cast
    tag: str = eqx.field(static=True)

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.lin1 = eqx.nn.Linear(5, 16, key=k1)
        self.norm = eqx.nn.LayerNorm(16)
        self.head = eqx.nn.Linear(16, 3, key=k2)
        self.steps = jnp.zeros((), jnp.int32)
        self.tag = "net"

    def __call__(self, x):
        h = jax.nn.relu(self.lin1(x))
        h = self.norm(h)
        return self.head(h.astype(self.head.weight.dtype))


X = jax.random.normal(jax.random.key(1), (5,))


def test_only_floating_leaves_cast_static_fields_untouched():
    net = Net(jax.random.key(0))
    model = mpe.MixedPrecision(net, "p=bf16,c=bf16,o=f32")
    assert model.module.lin1.weight.dtype == BF16
    assert model.module.steps.dtype == jnp.int32
    assert model.module.tag == "net" and model.module.lin1.in_features == 5
    # The static structure (treedef) is unchanged apart from dtypes.
    assert jax.tree.structure(model.module) == jax.tree.structure(net)


@pytest.mark.standard_promotion  # eqx.nn.LayerNorm mixes its f32 params with inputs
def test_call_values_dtypes_and_overrides():
    net = Net(jax.random.key(0))
    model = mpe.MixedPrecision(
        net, "mixed_bfloat16", overrides={eqx.nn.LayerNorm: "p=f32,c=f32,o=bf16"}
    )
    assert_tree_dtypes(eqx.filter(model.module, eqx.is_inexact_array), F32)
    seen = {}

    class Spy(eqx.Module):
        inner: eqx.nn.LayerNorm

        def __call__(self, x):
            seen["x"], seen["w"] = x.dtype, self.inner.weight.dtype  # pyright: ignore[reportOptionalMemberAccess]
            return self.inner(x)

    spied = eqx.tree_at(lambda n: n.norm, net, Spy(net.norm))
    model = mpe.MixedPrecision(spied, "mixed_bfloat16", overrides={Spy: "float32"})
    y = model(X)
    assert y.dtype == F32
    assert seen == {"x": F32, "w": F32}
    # Two bf16 matmuls around a norm: a few bf16 ulps (2**-8) of error.
    ref = spied(X)
    np.testing.assert_allclose(y, ref, atol=3e-2 * float(jnp.max(jnp.abs(ref))))


def test_filter_jit_and_filter_grad_with_loss_scaling():
    net = Net(jax.random.key(0))
    model = mpe.MixedPrecision(
        net, "mixed_float16", overrides={eqx.nn.LayerNorm: "float32"}
    )

    @eqx.filter_jit
    def grads_of(model, x, scale):
        params, static = eqx.partition(model, eqx.is_inexact_array)

        def loss(p):
            return jnp.sum(eqx.combine(p, static)(x) ** 2)

        return mixprec.value_and_grad(loss)(params, loss_scale=scale)

    # 2**15 would overflow the float16 backward pass here (|dL/dy| ~ 5).
    _, g, finite = grads_of(model, X, mixprec.DynamicLossScale(2.0**10))
    assert bool(finite)
    ref = eqx.filter_grad(lambda m, x: jnp.sum(m(x) ** 2))(net, X)
    assert_tree_dtypes(g.module, eqx.filter(net, eqx.is_inexact_array))
    assert_trees_close(
        eqx.filter(g.module, eqx.is_inexact_array),
        eqx.filter(ref, eqx.is_inexact_array),
        dtype=jnp.float16,
        grad=True,
    )
    g2 = eqx.filter_grad(lambda m, x: jnp.sum(m(x) ** 2))(model, X)
    assert g2.module.lin1.weight.dtype == F32


def test_errors():
    net = Net(jax.random.key(0))
    with pytest.raises(TypeError, match="module classes"):
        mpe.MixedPrecision(net, "float32", overrides={"norm": "float32"})  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="mapping"):
        mpe.MixedPrecision(net, "float32", overrides=[eqx.nn.LayerNorm])  # pyright: ignore[reportArgumentType]


def test_explain_names_each_linear_layer():
    net = Net(jax.random.key(0))
    report = mixprec.explain(lambda n, x: n(x), net, X, policy="mixed_bfloat16")
    dots = report.find("dot_general")
    # Equinox names a module's class in the name stack, not its attribute, so
    # the user's line that called each layer tells them apart.
    assert [op.layer for op in dots] == ["eqx.nn.Linear", "eqx.nn.Linear"]
    wheres = [op.where for op in dots]
    assert len(set(wheres)) == 2
    assert all(w.startswith("eqx.nn.Linear @ test_equinox.py:") for w in wheres)
