"""Tests for `mixprec.value_and_grad` and `mixprec.grad`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_dtypes, assert_trees_close

import mixprec


def _params(dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w": jax.random.normal(k1, (8, 4), jnp.float32).astype(dtype),
        "b": jax.random.normal(k2, (4,), jnp.float32).astype(dtype) * 0.1,
    }


def _batch():
    kx, ky = jax.random.split(jax.random.key(1))
    return jax.random.normal(kx, (16, 8)), jax.random.normal(ky, (16, 4))


def _loss(params, x, y, compute_dtype=jnp.float32):
    p = mixprec.cast_tree(params, compute_dtype)
    h = x.astype(compute_dtype) @ p["w"] + p["b"][None, :]
    return jnp.mean((h.astype(jnp.float32) - y) ** 2)


SCALES = [
    mixprec.NoOpLossScale(),
    mixprec.StaticLossScale(2.0**12),
    mixprec.DynamicLossScale(2.0**15),
]


@pytest.mark.parametrize("compute", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("scale", SCALES, ids=lambda s: type(s).__name__)
def test_value_and_grad_matches_float32_reference(compute, scale):
    params = _params()
    x, y = _batch()
    ref_loss, ref_grads = jax.value_and_grad(_loss)(params, x, y)
    f = jax.jit(mixprec.value_and_grad(_loss), static_argnums=3)
    loss, grads, finite = f(params, x, y, compute, loss_scale=scale)
    assert bool(finite)
    assert loss.dtype == jnp.float32
    assert_tree_dtypes(grads, params)
    assert_trees_close(loss, ref_loss, dtype=compute)
    assert_trees_close(grads, ref_grads, dtype=compute, grad=True)


@pytest.mark.parametrize("log2_scale", [0, 7, 15, 24])
def test_unscaled_with_the_scale_used_exactly(log2_scale):
    # A power-of-two scale in float32 is exact: the gradients must be bit-equal
    # to unscaled ones. With period=1 `adjust` would double the scale: unscaling
    # with the adjusted scale (the MPX bug) would halve them.
    params = _params()
    x, y = _batch()
    scale = mixprec.DynamicLossScale(2.0**log2_scale, period=1)
    _, ref = jax.value_and_grad(_loss)(params, x, y)
    _, grads, finite = mixprec.value_and_grad(_loss)(params, x, y, loss_scale=scale)
    assert bool(finite)
    jax.tree.map(np.testing.assert_array_equal, grads, ref)
    grown = scale.adjust(finite)
    assert float(grown.loss_scale) == 2.0 ** (log2_scale + 1)


def test_float16_loss_value_is_the_true_loss():
    # The scaled loss 4 * 2**14 = 65536 overflows float16 (max 65504), but the
    # backward pass (cotangents 2**14 * 2) fits: the returned loss must be the
    # true one (not the scaled value divided back) and the step finite.
    def f(w):
        return jnp.sum(w.astype(jnp.float16)) * jnp.float16(2.0)

    w = jnp.ones(2, jnp.float32)
    scale = mixprec.StaticLossScale(2.0**14)
    loss, grads, finite = mixprec.value_and_grad(f)(w, loss_scale=scale)
    assert loss.dtype == jnp.float16 and float(loss) == 4.0
    assert bool(finite)
    np.testing.assert_array_equal(grads, np.full(2, 2.0, np.float32))


def test_scaling_rescues_float16_underflow():
    # d/dw of 1e-8 * sum(w) in float16 is 1e-8: below float16's smallest
    # subnormal (6e-8), it flushes to zero unless the loss is scaled.
    def f(w):
        return (w.astype(jnp.float16) * jnp.float16(1e-3)).astype(jnp.float32).sum()

    def g(w):  # cotangent 1e-8 reaches the float16 multiply
        return f(w) * 1e-5

    w = jnp.ones(4, jnp.float32)
    _, unscaled, _ = mixprec.value_and_grad(g)(w, loss_scale=mixprec.NoOpLossScale())
    _, scaled, finite = mixprec.value_and_grad(g)(
        w, loss_scale=mixprec.StaticLossScale(2.0**15)
    )
    assert bool(finite)
    np.testing.assert_array_equal(unscaled, np.zeros(4, np.float32))
    np.testing.assert_allclose(scaled, np.full(4, 1e-8), rtol=2e-3)


def test_overflow_sets_flag_false():
    def f(w):
        return jnp.sum(w.astype(jnp.float16) * jnp.float16(1000.0)).astype(jnp.float32)

    w = jnp.ones(2)
    _, grads, finite = mixprec.value_and_grad(f)(
        w, loss_scale=mixprec.StaticLossScale(2.0**10)
    )
    assert not bool(finite)
    assert not np.all(np.isfinite(grads))


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_grads_have_the_parameters_dtype(param_dtype):
    params = {"a": jnp.ones(3, param_dtype), "n": jnp.ones(3, jnp.float32)}

    def f(p):
        return jnp.sum(p["a"].astype(jnp.float32) * p["n"])

    scale = mixprec.DynamicLossScale(2.0**15)
    _, grads, finite = mixprec.value_and_grad(f)(params, loss_scale=scale)
    assert bool(finite)
    assert grads["a"].dtype == param_dtype and grads["n"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(grads["a"], np.float32), np.ones(3))


def test_has_aux_and_argnums_tuple():
    def f(w, b, x):
        out = x @ w + b[None, :]
        return jnp.sum(out**2), {"out": out}

    w, b, x = jnp.ones((2, 3)), jnp.zeros(3), jnp.ones((1, 2))
    scale = mixprec.StaticLossScale(64.0)
    (loss, aux), grads, finite = mixprec.value_and_grad(
        f, has_aux=True, argnums=(0, 1)
    )(w, b, x, loss_scale=scale)
    (ref_loss, ref_aux), ref_grads = jax.value_and_grad(f, (0, 1), has_aux=True)(
        w, b, x
    )
    assert isinstance(grads, tuple) and len(grads) == 2
    np.testing.assert_array_equal(loss, ref_loss)
    np.testing.assert_array_equal(aux["out"], ref_aux["out"])
    jax.tree.map(np.testing.assert_array_equal, grads, ref_grads)
    assert bool(finite)


def test_grad_variants():
    def f(w):
        return jnp.sum(w**2), 7

    w = jnp.arange(3.0)
    scale = mixprec.StaticLossScale(2.0**8)
    grads, aux, finite = mixprec.grad(f, has_aux=True)(w, loss_scale=scale)
    np.testing.assert_array_equal(grads, 2 * w)
    assert aux == 7 and bool(finite)
    grads, finite = mixprec.grad(lambda w: jnp.sum(w**2))(w, loss_scale=scale)
    np.testing.assert_array_equal(grads, 2 * w)


def test_jit_with_scale_as_argument_does_not_recompile_on_new_values():
    traces = []

    def f(w):
        traces.append(1)
        return jnp.sum(w**2)

    step = jax.jit(mixprec.value_and_grad(f))
    scale = mixprec.DynamicLossScale(2.0**15)
    w = jnp.ones(2)
    for _ in range(3):
        _, _, finite = step(w, loss_scale=scale)
        scale = scale.adjust(finite)
    assert len(traces) == 1


def test_errors():
    f = mixprec.value_and_grad(lambda w: jnp.sum(w))
    with pytest.raises(TypeError, match="loss_scale"):
        f(jnp.ones(2))  # pyright: ignore[reportCallIssue]
    with pytest.raises(TypeError, match=r"expects a mixprec loss scale.*float"):
        f(jnp.ones(2), loss_scale=1024.0)
    with pytest.raises(ValueError, match="2 loss scales"):
        f(jnp.ones(2), loss_scale=[mixprec.NoOpLossScale(), mixprec.NoOpLossScale()])
    g = mixprec.value_and_grad(lambda w: w * 2)
    with pytest.raises(TypeError, match="scalar floating loss"):
        g(jnp.ones(2), loss_scale=mixprec.NoOpLossScale())
    h = mixprec.value_and_grad(lambda w: jnp.sum(w), has_aux=True)
    with pytest.raises(TypeError, match=r"pair `\(loss, aux\)`"):
        h(jnp.ones(2), loss_scale=mixprec.NoOpLossScale())
    with pytest.raises(TypeError, match="argnums"):
        mixprec.value_and_grad(lambda w: w, argnums="0")  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="argument 2"):
        mixprec.grad(lambda w: jnp.sum(w), argnums=2)(
            jnp.ones(2), loss_scale=mixprec.NoOpLossScale()
        )


def _recipe() -> str:
    import pathlib
    import re

    text = (pathlib.Path(__file__).parent.parent / "docs" / "training.md").read_text()
    section = text.split("## The recipe", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)  # pyright: ignore[reportOptionalMemberAccess]


@pytest.mark.standard_promotion  # the recipe is ordinary user code
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_docs_recipe_runs_and_learns(policy, capsys):
    code = _recipe().replace('"mixed_float16"', f'"{policy}"', 1)
    code = code.replace("range(100)", "range(30)")  # float16 is emulated on CPU
    ns: dict = {}
    with jax.numpy_rank_promotion("allow"):
        exec(compile(code, "docs/training.md", "exec"), ns)
        params0 = ns["init_params"](jax.random.key(0))
        first = float(ns["loss_fn"](params0, ns["x"], ns["y"]))
    print(capsys.readouterr().out)
    assert float(ns["loss"]) < 0.5 * first  # memorises the random batch
    assert ns["params"]["w1"].dtype == jnp.float32
    stats = ns["stats"]
    if policy == "mixed_float16":
        assert int(stats["num_skipped"]) < 10
    else:
        assert int(stats["num_skipped"]) == 0 and float(stats["loss_scale"]) == 1.0
