"""Tests for `mixprec.orbax` with real orbax-checkpoint in a temporary directory."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
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


def test_restore_of_a_missing_checkpoint_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at .*nothing'\.$"):
        mpk.restore(tmp_path / "nothing", {"x": jnp.zeros(1)})


def test_replace_refuses_without_force_and_keeps_the_old(tmp_path):
    mpk.save(tmp_path / "c", {"x": jnp.zeros(2)})
    with pytest.raises(ValueError, match=r"already exists.*force=True"):
        mpk.save(tmp_path / "c", {"x": jnp.ones(2)})
    mpk.save(tmp_path / "c", {"x": jnp.ones(2)}, force=True)
    out = mpk.restore(tmp_path / "c", {"x": jnp.zeros(2)})
    np.testing.assert_array_equal(out["x"], [1.0, 1.0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no leftovers


# ---- a save killed midway -----------------------------------------------------

_CHILD = """
import sys, time
import jax, jax.numpy as jnp
import mixprec.orbax as mpk

path, force = sys.argv[1], sys.argv[2] == "force"


def pause(event, duration, **kwargs):
    # orbax's commit thread reports this once the data is written and before
    # the temporary directory is renamed into place.
    if event == "/jax/checkpoint/write/async/commit_duration_sec":
        print("PAUSED", flush=True)
        time.sleep(600)


jax.monitoring.register_event_duration_secs_listener(pause)
mpk.save(path, {"w": jnp.full((64, 64), 2.0), "step": jnp.int32(2)}, force=force)
print("DONE", flush=True)
"""


def _kill_mid_save(tmp_path, path, force):
    import os
    import signal
    import subprocess
    import sys
    import threading

    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    proc = subprocess.Popen(
        [sys.executable, str(script), str(path), "force" if force else "new"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    timer = threading.Timer(120, proc.kill)  # bounded whatever happens
    timer.start()
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line == "PAUSED", (
            f"the child did not pause mid-save (got {line!r}); orbax no longer "
            "reports the commit event this test waits for"
        )
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def _v1():
    return {"w": jnp.full((64, 64), 1.0), "step": jnp.int32(1)}


def test_save_killed_while_replacing_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    mpk.save(path, _v1())
    _kill_mid_save(tmp_path, path, force=True)
    # orbax's own `force` deletes the old checkpoint before writing: nothing
    # would be left. The previous checkpoint is intact and restores ...
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith("ckpt.")]
    assert leftovers, "the killed save left its partial data"
    with pytest.warns(
        UserWarning, match=r"did not finish and left \['ckpt\.mixprec-new"
    ):
        out = mpk.restore(path, _v1())
    np.testing.assert_array_equal(out["w"], _v1()["w"])
    assert int(out["step"]) == 1
    # ... the partial one is detected, never read as a checkpoint ...
    for partial in leftovers:
        with pytest.raises((ValueError, FileNotFoundError), match="incomplete|did not"):
            mpk.restore(partial, _v1())
    # ... and the next save replaces the checkpoint and clears the leftovers.
    mpk.save(path, {"w": jnp.full((64, 64), 3.0), "step": jnp.int32(3)}, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["child.py", "ckpt"]
    assert int(mpk.restore(path, _v1())["step"]) == 3


def test_save_killed_before_its_first_commit_is_detected(tmp_path):
    mpk.save(tmp_path / "step1", _v1())
    _kill_mid_save(tmp_path, tmp_path / "step2", force=False)
    with pytest.raises(FileNotFoundError, match=r"save did not finish.*step2\.orbax"):
        mpk.restore(tmp_path / "step2", _v1())
    assert int(mpk.restore(tmp_path / "step1", _v1())["step"]) == 1


def test_swap_interrupted_between_renames_names_both(tmp_path):
    # The one moment `save(..., force=True)` leaves no checkpoint at the path:
    # between renaming the old one away and the new one into place.
    path = tmp_path / "ckpt"
    mpk.save(path, _v1())
    mpk.save(tmp_path / "ckpt.mixprec-new", {**_v1(), "step": jnp.int32(2)})
    path.rename(tmp_path / "ckpt.mixprec-old")
    with pytest.raises(FileNotFoundError, match=r"(?s)swapping.*ckpt\.mixprec-old"):
        mpk.restore(path, _v1())
    assert int(mpk.restore(tmp_path / "ckpt.mixprec-old", _v1())["step"]) == 1
    assert int(mpk.restore(tmp_path / "ckpt.mixprec-new", _v1())["step"]) == 2


# --- Typed PRNG keys (jax.random.key, nnx.Rngs, Dropout) -----------------------
#
# The rule: typed PRNG key leaves round-trip as plain orbax round-trips them
# (stored as their key data, rebuilt with `target`'s key type), with and
# without dtype conversion of the floating leaves.


def _key_state(impl, seed):
    key = jax.random.key(seed, impl=impl)
    return {
        "key": key,
        "keys": jax.random.split(jax.random.fold_in(key, 1), 3),
        "w": jax.random.normal(jax.random.fold_in(key, 2), (4, 3)),
        "count": jnp.uint32(seed),
    }


def _key_bits(x):
    return np.asarray(jax.random.key_data(x)).tolist()


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
@pytest.mark.parametrize("abstract", [False, True])
def test_typed_prng_keys_round_trip(tmp_path, impl, dtype, abstract):
    state = _key_state(impl, 7)
    mpk.save(tmp_path / "ckpt", state)
    target = _key_state(impl, 0)
    if abstract:
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            target,
        )
    out = mpk.restore(tmp_path / "ckpt", target, dtype=dtype)
    # What plain orbax gives for the same checkpoint and target.
    with ocp.StandardCheckpointer() as ckptr:
        plain = ckptr.restore(tmp_path / "ckpt", _key_state(impl, 0))
    for name in ("key", "keys"):
        assert out[name].dtype == state[name].dtype == plain[name].dtype
        assert out[name].shape == state[name].shape
        assert jax.random.key_impl(out[name]) == jax.random.key_impl(state[name])
        assert _key_bits(out[name]) == _key_bits(state[name]) == _key_bits(plain[name])
    # The restored key draws what the saved one draws.
    np.testing.assert_array_equal(
        jax.random.normal(out["key"], (5,)), jax.random.normal(state["key"], (5,))
    )
    assert out["w"].dtype == jnp.dtype(dtype or jnp.float32)
    np.testing.assert_array_equal(out["w"], state["w"].astype(out["w"].dtype))
    assert out["count"].dtype == jnp.uint32 and int(out["count"]) == 7


def test_a_key_of_another_implementation_is_a_shape_error(tmp_path):
    mpk.save(tmp_path / "ckpt", {"key": jax.random.key(0)})  # threefry: 2 words
    with pytest.raises(ValueError, match=r"'key' has shape \(2,\) in the checkpoint"):
        mpk.restore(tmp_path / "ckpt", {"key": jax.random.key(0, impl="rbg")})


@pytest.mark.standard_promotion  # Flax's BatchNorm
@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
def test_nnx_model_with_dropout_and_rngs_round_trips(tmp_path, dtype):
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 8, rngs=rngs)
            self.bn = nnx.BatchNorm(8, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.rngs = rngs

        def __call__(self, x):
            noise = jax.random.normal(self.rngs.noise(), x.shape)
            return self.drop(self.bn(self.lin(x + noise)))

    x = jnp.ones((6, 4))
    model = Net(nnx.Rngs(0, dropout=1, noise=2))
    model(x)  # moves the counters and the batch statistics
    mpk.save(tmp_path / "ckpt", nnx.state(model))
    fresh = Net(nnx.Rngs(5, dropout=6, noise=7))
    restored = mpk.restore(tmp_path / "ckpt", nnx.state(fresh), dtype=dtype)
    nnx.update(fresh, restored)
    want = nnx.to_pure_dict(nnx.state(model))
    got = nnx.to_pure_dict(nnx.state(fresh))
    for path, leaf in jax.tree_util.tree_leaves_with_path(got):
        ref = functools.reduce(lambda t, k: t[k.key], path, want)
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            assert _key_bits(leaf) == _key_bits(ref)
        elif jnp.issubdtype(leaf.dtype, jnp.floating):
            assert leaf.dtype == jnp.dtype(dtype or jnp.float32)
            np.testing.assert_array_equal(leaf, jnp.asarray(ref).astype(leaf.dtype))
        else:
            assert leaf.dtype == ref.dtype
            np.testing.assert_array_equal(leaf, ref)
    if dtype is None:  # the restored model draws the same noise and masks
        np.testing.assert_array_equal(fresh(x), model(x))
