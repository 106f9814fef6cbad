"""Tests for `mixprec.orbax` with real orbax-checkpoint in a temporary directory."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_dtypes

import mixprec
import mixprec.optax as mpo
import mixprec.orbax as mpk


OPT = mpo.loss_scaled(
    optax.sgd(0.05, momentum=0.9), mixprec.DynamicLossScale(2.0**15, period=3)
)


def _data():
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (64, 8))
    return x, x @ jax.random.normal(kw, (8, 2))


def _init():
    params = {"w": jnp.zeros((8, 2)), "b": jnp.zeros(2)}
    return {"params": params, "opt": OPT.init(params), "step": jnp.int32(0)}


def _loss(params, x, y):
    pred = x.astype(jnp.float16) @ params["w"].astype(jnp.float16)
    pred = pred.astype(jnp.float32) + params["b"][None, :]
    return jnp.mean((pred - y) ** 2)


@jax.jit
def _train(state, n_bad):
    x, y = _data()

    def step(state, i):
        _, grads, _ = mixprec.value_and_grad(_loss)(
            state["params"], x, y, loss_scale=state["opt"]
        )
        grads = jax.tree.map(lambda g: jnp.where(i % 5 == n_bad, jnp.inf, g), grads)
        updates, opt = OPT.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt, "step": state["step"] + 1}, None

    return jax.lax.scan(step, state, jnp.arange(10) + state["step"])[0]


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.mark.standard_promotion  # optax's momentum update
def test_resume_is_bit_identical(tmp_path):
    straight = _train(_train(_init(), 3), 3)
    half = _train(_init(), 3)
    mpk.save(tmp_path / "ckpt", half)
    restored = mpk.restore(tmp_path / "ckpt", _init())
    assert isinstance(restored["opt"].loss_scale, mixprec.DynamicLossScale)
    assert restored["opt"].loss_scale.period == 3  # static config from target
    assert _bits(restored) == _bits(half)
    resumed = _train(restored, 3)
    assert _bits(resumed) == _bits(straight)
    # 4 injected (steps 3, 8, 13, 18) plus the float16 overflows at the start.
    assert int(resumed["opt"].num_skipped) >= 4
    assert jax.tree.structure(resumed) == jax.tree.structure(straight)


@pytest.mark.parametrize("low", [jnp.float16, jnp.bfloat16])
def test_cast_on_restore_both_ways_and_ints_stay_ints(tmp_path, low):
    state = {
        "w": jax.random.normal(jax.random.key(1), (4, 3)),
        "count": jnp.arange(3, dtype=jnp.int32),
        "scale": mixprec.DynamicLossScale(2.0**15),
    }
    mpk.save(tmp_path / "f32", state)
    low_target = mixprec.cast_tree(state, low)
    out = mpk.restore(tmp_path / "f32", low_target)
    assert out["w"].dtype == low and out["count"].dtype == jnp.int32
    assert out["scale"].loss_scale.dtype == jnp.float32  # target says f32
    np.testing.assert_array_equal(out["w"], state["w"].astype(low))
    np.testing.assert_array_equal(out["count"], state["count"])
    out2 = mpk.restore(tmp_path / "f32", state, dtype=low)
    assert_tree_dtypes(out2["w"], low)
    assert out2["count"].dtype == jnp.int32
    # The reverse: a low-precision checkpoint into float32 parameters.
    mpk.save(tmp_path / "low", out)
    back = mpk.restore(tmp_path / "low", state)
    assert back["w"].dtype == jnp.float32
    np.testing.assert_array_equal(back["w"], out["w"].astype(jnp.float32))


def test_structure_mismatch_names_the_paths(tmp_path):
    state = {"params": {"w": jnp.ones(2), "b": jnp.ones(2)}, "step": jnp.int32(1)}
    mpk.save(tmp_path / "c", state)
    wrong = {"params": {"w": jnp.ones(2), "kernel": jnp.ones(2)}, "step": jnp.int32(0)}
    with pytest.raises(
        ValueError,
        match=r"(?s)not in the checkpoint: \['params/kernel'\].*"
        r"not in `target`: \['params/b'\]",
    ):
        mpk.restore(tmp_path / "c", wrong)
    with pytest.raises(ValueError, match=r"'params/w' has shape \(2,\).*\(3,\)"):
        mpk.restore(
            tmp_path / "c", {**state, "params": {"w": jnp.ones(3), "b": jnp.ones(2)}}
        )
    with pytest.raises(
        TypeError, match="'step' is int32 in the checkpoint but float32"
    ):
        mpk.restore(tmp_path / "c", {**state, "step": jnp.float32(0)})


def test_sharded_target_restores_sharded(tmp_path):
    mesh = jax.make_mesh((8,), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    x = jax.device_put(jnp.arange(16.0), sharding)
    mpk.save(tmp_path / "s", {"x": x})
    out = mpk.restore(tmp_path / "s", {"x": x}, dtype=jnp.bfloat16)
    assert out["x"].sharding == sharding and out["x"].dtype == jnp.bfloat16
