"""mixprec policies in Haiku's `hk.mixed_precision` (the JMP drop-in)."""

import haiku as hk
import jax
import jax.numpy as jnp
import pytest
from helpers import assert_tree_dtypes, assert_trees_close

import mixprec
import mixprec.haiku as mph


BF16, F16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)


@pytest.fixture(autouse=True)
def _clear_policies():
    yield
    for cls in (hk.Linear, hk.LayerNorm, hk.nets.MLP):
        hk.mixed_precision.clear_policy(cls)


def _net(x):
    h = jax.nn.relu(hk.Linear(16)(x))
    h = hk.LayerNorm(-1, True, True)(h)
    return hk.Linear(3)(h)


X = jax.random.normal(jax.random.key(1), (4, 5))


def _spy_dtypes(f, params):
    seen = []

    def interceptor(next_f, args, kwargs, context):
        out = next_f(*args, **kwargs)
        if context.method_name == "__call__":
            seen.append((context.module.module_name, args[0].dtype, out.dtype))
        return out

    with hk.intercept_methods(interceptor):
        y = f.apply(params, None, X)
    return y, seen


@pytest.mark.parametrize("use_mixprec_helper", [False, True])
def test_set_policy_on_linear_with_a_mixprec_policy(use_mixprec_helper):
    f = hk.transform(_net)
    ref_params = f.init(jax.random.key(0), X)
    ref = f.apply(ref_params, None, X)
    policy = mixprec.get_policy("p=f32,c=bf16,o=f32")
    if use_mixprec_helper:
        mph.set_policy(hk.Linear, "p=f32,c=bf16,o=f32")
    else:
        hk.mixed_precision.set_policy(hk.Linear, policy)  # pyright: ignore[reportArgumentType]
    params = f.init(jax.random.key(0), X)
    assert_tree_dtypes(params, F32)
    y, seen = _spy_dtypes(f, params)
    # Our interceptor sits inside Haiku's: each Linear computes bf16 -> bf16,
    # then Haiku casts its output to f32, which is what LayerNorm (no policy) gets.
    names = [s[0] for s in seen]
    assert names == ["linear", "layer_norm", "linear_1"]
    assert seen[0][1:] == (BF16, BF16) and seen[2][1:] == (BF16, BF16)
    assert seen[1][1:] == (F32, F32)
    assert y.dtype == F32
    assert_trees_close(y, ref, dtype=jnp.bfloat16)


@pytest.mark.standard_promotion  # haiku's LayerNorm mixes dtypes internally
def test_model_class_policy_with_float32_norms_and_loss_scaled_grads():
    def net(x):
        return hk.nets.MLP([16, 3])(x)

    f = hk.transform(net)
    ref_params = f.init(jax.random.key(0), X)
    mph.set_policy(hk.nets.MLP, "mixed_float16", float32=[hk.LayerNorm])
    params = f.init(jax.random.key(0), X)
    assert_tree_dtypes(params, F32)  # master weights in f32
    assert hk.mixed_precision.get_policy(hk.LayerNorm) == mixprec.get_policy("float32")

    def loss(p):
        return jnp.mean(f.apply(p, None, X) ** 2)

    _, g, finite = jax.jit(mixprec.value_and_grad(loss))(
        params, loss_scale=mixprec.DynamicLossScale(2.0**15)
    )
    hk.mixed_precision.clear_policy(hk.nets.MLP)
    g_ref = jax.grad(loss)(ref_params)
    assert bool(finite)
    assert_tree_dtypes(g, F32)
    assert_trees_close(g, g_ref, dtype=jnp.float16, grad=True)


def test_push_policy_half_params():
    f = hk.transform(lambda x: hk.Linear(2)(x))
    with mph.push_policy(hk.Linear, "half"):
        params = f.init(jax.random.key(0), X)
        y = f.apply(params, None, X)
    assert_tree_dtypes(params, F16)
    assert y.dtype == F16
    assert hk.mixed_precision.get_policy(hk.Linear) is None


def test_errors():
    with pytest.raises(TypeError, match="hk.Module"):
        mph.set_policy(int, "half")  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="policy string"):
        mph.set_policy(hk.Linear, 3)  # pyright: ignore[reportArgumentType]


def test_explain_names_each_linear_layer():
    f = hk.without_apply_rng(hk.transform(_net))
    params = f.init(jax.random.key(0), X)
    report = mixprec.explain(f.apply, params, X, policy="mixed_bfloat16")
    layers = [op.layer for op in report.find("dot_general")]
    assert layers == ["linear", "linear_1"]
    assert {op.layer for op in report.ops if op.primitive == "rsqrt"} == {"layer_norm"}
