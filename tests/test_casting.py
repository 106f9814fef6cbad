"""cast_tree and friends: only floating arrays change, under every transform."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mixprec


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_cast_tree_dtypes_and_values(dtype):
    tree = {"a": jnp.linspace(0, 1, 5), "b": (jnp.arange(3), jnp.ones(2, jnp.float16))}
    out = mixprec.cast_tree(tree, dtype)
    assert out["a"].dtype == jnp.dtype(dtype) and out["b"][1].dtype == jnp.dtype(dtype)
    assert out["b"][0].dtype == jnp.int32
    np.testing.assert_allclose(
        np.asarray(out["a"], np.float64), np.linspace(0, 1, 5), atol=4e-3
    )


def test_cast_tree_rejects_non_float_dtype():
    with pytest.raises(ValueError, match=r"`dtype` to be a floating dtype.*int32"):
        mixprec.cast_tree(jnp.ones(2), jnp.int32)
    with pytest.raises(TypeError, match=r"`dtype` to be a floating dtype"):
        mixprec.cast_tree(jnp.ones(2), "not-a-dtype")


def test_is_floating_array():
    assert mixprec.is_floating_array(jnp.ones(2))
    assert mixprec.is_floating_array(np.float32(1.0))
    assert not mixprec.is_floating_array(jax.random.key(0))
    assert not mixprec.is_floating_array(1.0)
    assert not mixprec.is_floating_array(jnp.array([True]))


def test_cast_tree_under_vmap_scan_and_grad():
    def f(x):
        return jnp.sum(mixprec.cast_tree(x, jnp.bfloat16).astype(jnp.float32) ** 2)

    x = jnp.arange(6.0).reshape(2, 3)
    per_row = jax.vmap(f)(x)
    np.testing.assert_allclose(per_row, [5.0, 50.0])
    g = jax.grad(f)(x)
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, 2 * x)

    def body(carry, xs):
        y = mixprec.cast_tree(xs, jnp.bfloat16)
        return carry + y.astype(jnp.float32).sum(), y

    total, ys = jax.lax.scan(body, jnp.float32(0), x)
    assert ys.dtype == jnp.bfloat16 and float(total) == 15.0


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_cast_tree_leaves_loss_scales_alone(dtype):
    state = {
        "w": jnp.ones(2),
        "dyn": mixprec.DynamicLossScale(2.0**16),  # inf in float16
        "static": mixprec.StaticLossScale(2.0**17),
    }
    out = mixprec.get_policy("float32").with_compute_dtype(dtype).cast_to_compute(state)
    assert out["w"].dtype == jnp.dtype(dtype)
    assert out["dyn"].loss_scale.dtype == jnp.float32
    assert float(out["dyn"].loss_scale) == 2.0**16
    assert out["static"].loss_scale.dtype == jnp.float32
    assert out["dyn"] is state["dyn"]
