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


# ---- restoring into float16 ---------------------------------------------------


def _f16_loss(params, x, y):
    pred = x.astype(jnp.float16) @ params["w"].astype(jnp.float16)
    return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


@pytest.mark.standard_promotion  # optax's momentum update
@pytest.mark.parametrize("low", [jnp.float16, jnp.bfloat16])
def test_restore_whole_state_into_low_precision_keeps_the_loss_scale(tmp_path, low):
    # TF1's recipe: a float32 checkpoint restored into a low-precision model.
    # 65536 is inf in float16: the scale and its counters must not be cast.
    opt = mpo.loss_scaled(
        optax.sgd(0.01, momentum=0.9), mixprec.DynamicLossScale(2.0**16, period=3)
    )
    x, y = _data()
    y = y / 64  # small residuals: 2**16 times the loss fits float16's backward
    params = {"w": jnp.zeros((8, 2))}
    state = {"params": params, "opt": opt.init(params), "step": jnp.int32(5)}
    mpk.save(tmp_path / "c", state)
    out = mpk.restore(tmp_path / "c", state, dtype=low)
    ls = out["opt"].loss_scale
    assert ls.loss_scale.dtype == jnp.float32 and float(ls.loss_scale) == 2.0**16
    assert ls.counter.dtype == jnp.int32 and ls.period == 3
    assert out["opt"].num_skipped.dtype == jnp.int32
    assert out["step"].dtype == jnp.int32 and int(out["step"]) == 5
    assert_tree_dtypes(out["params"], low)
    assert_tree_dtypes(out["opt"].inner_state, low)
    # And it trains: no step is skipped, the scale stays finite.
    p, s = out["params"], out["opt"]
    loss0 = float(_f16_loss(p, x, y))
    for _ in range(4):
        _, g, _ = mixprec.value_and_grad(_f16_loss)(p, x, y, loss_scale=s)
        u, s = opt.update(g, s, p)
        p = optax.apply_updates(p, u)
    assert int(s.num_skipped) == 0 and float(s.loss_scale.loss_scale) == 2.0**17
    assert float(_f16_loss(p, x, y)) < loss0


def test_restore_overflow_names_the_path_and_value(tmp_path):
    state = {
        "params": {"w": jnp.array([1.0, 70144.0, -1e6, jnp.inf]), "b": jnp.ones(2)},
        "scale": mixprec.DynamicLossScale(2.0**16),
    }
    mpk.save(tmp_path / "c", state)
    msg = (
        r"(?s)'params/w': 70144\.0 at index \(1,\) does not fit in float16 "
        r"\(largest 65504\); 2 value\(s\).*saturate=True"
    )
    with pytest.raises(ValueError, match=msg):
        mpk.restore(tmp_path / "c", state, dtype=jnp.float16)
    # The same through a float16 target instead of `dtype=`.
    with pytest.raises(ValueError, match=msg):
        mpk.restore(tmp_path / "c", mixprec.cast_tree(state, jnp.float16))
    # Nothing changed: the checkpoint restores as saved into float32.
    back = mpk.restore(tmp_path / "c", state)
    np.testing.assert_array_equal(back["params"]["w"], state["params"]["w"])
    # Saturating is explicit; an inf that was saved stays inf.
    out = mpk.restore(tmp_path / "c", state, dtype=jnp.float16, saturate=True)
    assert out["params"]["w"].dtype == jnp.float16
    np.testing.assert_array_equal(
        out["params"]["w"], np.array([1.0, 65504.0, -65504.0, np.inf], np.float16)
    )
    assert float(out["scale"].loss_scale) == 2.0**16
    # bfloat16 has float32's exponent range: the same values fit ...
    out = mpk.restore(tmp_path / "c", state, dtype=jnp.bfloat16)
    assert float(out["params"]["w"][1]) == 70144.0
    # ... up to rounding at the very top.
    mpk.save(tmp_path / "top", {"x": jnp.array([np.finfo(np.float32).max])})
    with pytest.raises(ValueError, match=r"'x': 3\.40282\d*e\+38 .*bfloat16"):
        mpk.restore(tmp_path / "top", {"x": jnp.zeros(1)}, dtype=jnp.bfloat16)
