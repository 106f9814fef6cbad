"""Tests for `mixprec.flax`: Linen `apply` and NNX `set_policy`."""

from typing import cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import assert_tree_dtypes, assert_trees_close

import mixprec
import mixprec.flax as mpf


# Flax layers rely on implicit promotion (e.g. f32 batch statistics with
# bfloat16 activations).
pytestmark = pytest.mark.standard_promotion

BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        x = nn.Dense(16)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.LayerNorm()(nn.relu(x))


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        x = Block()(x, train)
        x = nn.relu(nn.Dense(16)(x))
        return nn.Dense(4, name="head")(x)


X = jax.random.normal(jax.random.key(1), (8, 5))


def _init():
    return Net().init(jax.random.key(0), X, train=False)


def _dtypes_of_calls(variables, **kw):
    _, state = mpf.apply(
        Net(),
        variables,
        X,
        capture_intermediates=True,
        mutable=["intermediates"],
        **kw,
    )
    inter = state["intermediates"]
    return jax.tree.map(lambda x: x.dtype, inter)


def test_linen_apply_casts_per_module_and_keeps_overrides_float32():
    variables = _init()
    d = _dtypes_of_calls(
        variables,
        policy="mixed_bfloat16",
        overrides={"head": "float32", nn.LayerNorm: "p=f32,c=f32,o=bf16"},
    )
    assert d["Block_0"]["Dense_0"]["__call__"][0] == BF16
    assert d["Dense_0"]["__call__"][0] == BF16
    # The head runs in float32 and the model output is float32.
    assert d["head"]["__call__"][0] == F32
    assert d["__call__"][0] == F32
    # The norm computed in f32 and handed bf16 on (its policy's output dtype).
    assert d["Block_0"]["LayerNorm_0"]["__call__"][0] == BF16


def test_linen_values_and_grads_match_float32():
    variables = _init()

    def loss(params, policy):
        y = mpf.apply(
            Net(),
            {**variables, "params": params},
            X,
            policy=policy,
            overrides={"head": "float32", nn.LayerNorm: "float32"},  # class: traced
        )
        return jnp.mean(y.astype(jnp.float32) ** 2)

    vg = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    ref_l, ref_g = vg(variables["params"], "float32")
    loss_val, g = vg(variables["params"], "mixed_bfloat16")
    assert_trees_close(loss_val, ref_l, dtype=jnp.bfloat16)
    assert_trees_close(g, ref_g, dtype=jnp.bfloat16, grad=True)
    assert_tree_dtypes(g, variables["params"])  # float32 master gradients
    # The override is honoured inside the differentiated function too.
    ls = mixprec.DynamicLossScale(2.0**15)
    _, g2, finite = jax.jit(mixprec.value_and_grad(loss), static_argnums=1)(
        variables["params"], "mixed_float16", loss_scale=ls
    )
    assert bool(finite)
    assert_trees_close(g2, ref_g, dtype=jnp.float16, grad=True)


def test_linen_batch_stats_stay_float32():
    variables = _init()
    _, ref = Net().apply(variables, X, train=True, mutable=["batch_stats"])
    _, upd = mpf.apply(
        Net(),
        variables,
        X,
        train=True,
        mutable=["batch_stats"],
        policy="mixed_bfloat16",
    )
    assert_tree_dtypes(upd["batch_stats"], ref["batch_stats"])
    assert_tree_dtypes(upd["batch_stats"], F32)
    assert_trees_close(upd["batch_stats"], ref["batch_stats"], dtype=jnp.bfloat16)


def test_linen_path_patterns_apply_to_subtrees():
    variables = _init()
    d = _dtypes_of_calls(
        variables, policy="mixed_bfloat16", overrides={"Block_0": "float32"}
    )
    assert d["Block_0"]["Dense_0"]["__call__"][0] == F32
    assert d["Block_0"]["LayerNorm_0"]["__call__"][0] == F32
    assert d["Dense_0"]["__call__"][0] == BF16
    # Full-match: "Dense_" does not match "Dense_0".
    d = _dtypes_of_calls(
        variables, policy="mixed_bfloat16", overrides={"Dense_": "float32"}
    )
    assert d["Dense_0"]["__call__"][0] == BF16


def test_linen_errors():
    variables = _init()
    with pytest.raises(ValueError, match="regular expression"):
        mpf.apply(Net(), variables, X, policy="float32", overrides={"(": "float32"})
    with pytest.raises(TypeError, match="path patterns"):
        mpf.apply(Net(), variables, X, policy="float32", overrides={3: "float32"})
    with pytest.raises(TypeError, match="Linen module"):
        mpf.apply(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), {}, X, policy="float32")  # pyright: ignore[reportArgumentType]


def _nnx_model():
    rngs = nnx.Rngs(0)
    return nnx.Sequential(
        nnx.Linear(5, 16, rngs=rngs),
        nnx.BatchNorm(16, rngs=rngs),
        nnx.LayerNorm(16, rngs=rngs),
        nnx.Linear(16, 4, rngs=rngs),
    )


def test_nnx_set_policy_dtypes_values_and_batch_stats():
    ref = _nnx_model()
    model = mpf.set_policy(
        _nnx_model(),
        "mixed_bfloat16",
        overrides={nnx.LayerNorm: "float32", "layers/3": "float32"},
    )
    dtypes = [getattr(layer, "dtype") for layer in model.layers]  # noqa: B009
    assert dtypes == [BF16, BF16, F32, F32]  # Linear, BatchNorm, LayerNorm, head
    params = nnx.state(model, nnx.Param)
    assert_tree_dtypes(params, F32)
    y, y_ref = model(X), ref(X)
    assert y.dtype == F32
    assert_trees_close(y, y_ref, dtype=jnp.bfloat16)
    # Training-mode batch norm: statistics updated in float32, close to f32's.
    bstats = nnx.state(model, nnx.BatchStat)
    assert_tree_dtypes(bstats, F32)
    assert_trees_close(bstats, nnx.state(ref, nnx.BatchStat), dtype=jnp.bfloat16)


def test_nnx_grads_are_float32_and_close():
    ref = _nnx_model()
    model = mpf.set_policy(
        _nnx_model(), "mixed_float16", overrides={"layers/3": "float32"}
    )
    ref.eval()
    model.eval()  # batch norm reads its running statistics: no mutation under grad

    def loss(m):
        return jnp.mean(m(X).astype(jnp.float32) ** 2)

    g_ref = nnx.grad(loss)(ref)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_params(p):
        return loss(nnx.merge(graphdef, p, rest))

    _, g, finite = mixprec.value_and_grad(loss_params)(
        params, loss_scale=mixprec.DynamicLossScale(2.0**15)
    )
    assert bool(finite)
    assert_tree_dtypes(g, F32)
    assert_trees_close(g, g_ref, dtype=jnp.float16, grad=True)


def test_nnx_errors():
    with pytest.raises(TypeError, match="NNX module"):
        mpf.set_policy(Net(), "float32")  # pyright: ignore[reportArgumentType]


def test_linen_unedited_under_autocast():
    # The other route: autocast the apply function. Dots run low, norms and
    # reductions stay float32 per the op lists; gradients are float32.
    variables = _init()

    def apply(params, x) -> jax.Array:
        return cast(jax.Array, Net().apply({**variables, "params": params}, x))

    mixed = mixprec.autocast(apply, "mixed_bfloat16")
    y, ref = mixed(variables["params"], X), apply(variables["params"], X)
    assert y.dtype == F32
    assert_trees_close(y, ref, dtype=jnp.bfloat16)

    def loss(p):
        return jnp.mean(mixed(p, X) ** 2)

    _, g, finite = jax.jit(mixprec.value_and_grad(loss))(
        variables["params"], loss_scale=mixprec.DynamicLossScale(2.0**15)
    )
    g_ref = jax.grad(lambda p: jnp.mean(apply(p, X) ** 2))(variables["params"])
    assert bool(finite)
    assert_tree_dtypes(g, F32)
    assert_trees_close(g, g_ref, dtype=jnp.bfloat16, grad=True)


def test_explain_names_each_dense_layer_linen_and_nnx():
    variables = _init()
    report = mixprec.explain(
        lambda v, x: Net().apply(v, x), variables, X, policy="mixed_bfloat16"
    )
    layers = [op.layer for op in report.find("dot_general")]
    assert layers == ["Net/Block_0/Dense_0", "Net/Dense_0", "Net/head"]
    # The source line is in flax; the report also names the user's line.
    assert all("linear.py" in op.source for op in report.find("dot_general"))
    assert "Net/head @ test_flax.py:" in str(report)

    # NNX puts no module path in the name stack: the layer is the user's line
    # that called it.
    class Mlp(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(5, 8, rngs=rngs)
            self.b = nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, x):
            h = self.a(x)  # <- a
            return self.b(h)  # <- b

    graphdef, state = nnx.split(Mlp(nnx.Rngs(0)))
    report = mixprec.explain(
        lambda s, x: nnx.merge(graphdef, s)(x), state, X, policy="mixed_bfloat16"
    )
    layers = [op.layer for op in report.find("dot_general")]
    assert len(set(layers)) == 2
    assert all(layer.startswith("test_flax.py:") for layer in layers)
    assert all("Mlp.__call__" in layer for layer in layers)
