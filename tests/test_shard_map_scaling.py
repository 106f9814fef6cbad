"""Loss scaling inside `jax.shard_map` under JAX's default replication check.

`check_vma=True` (the default) proves from types that an output declared
replicated (`P()`) is the same on every device. The loss-scale state must pass
it: `loss_scaled(..., axis_name=...)` reduces the finite verdict over the axis,
so the scale, the skip counters and the flag are replicated even where the
gradients are sharded (each device holding a different part).
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close
from jax.sharding import NamedSharding, PartitionSpec as P

import mixprec
import mixprec.optax as mpo


pytestmark = pytest.mark.standard_promotion  # optax's momentum update

N_DEV = 8
POLICIES = ["mixed_bfloat16", "mixed_float16"]


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < N_DEV:
        pytest.skip("needs 8 devices")
    return jax.make_mesh((N_DEV,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def _replicas_identical(arr):
    shards = [np.asarray(s.data) for s in arr.addressable_shards]
    assert len(shards) == N_DEV
    for s in shards[1:]:
        np.testing.assert_array_equal(s, shards[0])


def _inputs():
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = {
        "w1": jax.random.normal(k1, (16, 8 * N_DEV)) * 0.3,
        "w2": jax.random.normal(k2, (8 * N_DEV, 8)) * 0.3,
        "b": jnp.zeros(8),
    }
    x = jax.random.normal(k3, (32, 16))
    y = jnp.tanh(x @ jax.random.normal(k4, (16, 8)))
    return params, x, y


def _loss(params, x, y):
    """The whole model on one device (the float32 reference)."""
    out = jax.nn.gelu(x @ params["w1"]) @ params["w2"] + params["b"][None, :]
    return jnp.mean((out - y) ** 2)


def _tp_loss(params, x, y):
    """The same model tensor-parallel: w1 by columns, w2 by rows, one psum."""
    partial = jax.nn.gelu(x @ params["w1"]) @ params["w2"]
    out = jax.lax.psum(partial, "data") + params["b"][None, :]
    return jnp.mean((out - y) ** 2)


# w1 and w2 sharded (their gradients are too, and never reduced), b replicated.
PARAM_SPECS = {"w1": P(None, "data"), "w2": P("data", None), "b": P()}


def _tp_step(mesh, policy, opt):
    mixed = mixprec.autocast(_tp_loss, policy)

    def step(params, opt_state, x, y, bad_dev):
        _, grads, _ = mixprec.value_and_grad(mixed)(params, x, y, loss_scale=opt_state)
        # An inf in one device's shard of w1's gradient only.
        me = jax.lax.axis_index("data")
        grads["w1"] = jnp.where(me == bad_dev, jnp.inf, grads["w1"])
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, grads

    state_specs = jax.tree.map(lambda _: P(), opt.init(_inputs()[0]))
    state_specs = state_specs._replace(
        inner_state=(optax.TraceState(trace=PARAM_SPECS), optax.EmptyState())
    )
    return jax.jit(
        jax.shard_map(  # check_vma: the default, True
            step,
            mesh=mesh,
            in_specs=(PARAM_SPECS, state_specs, P(), P(), P()),
            out_specs=(PARAM_SPECS, state_specs, PARAM_SPECS),
        )
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_sharded_gradients_train_under_the_default_check(mesh, policy):
    # Backs off after two non-finite steps in a row (`loss_scaled`'s default
    # rule, from a smaller scale): its counter is state that must be replicated.
    scale = mixprec.DynamicLossScale(
        2.0**10, nonfinite_before_backoff=2, consecutive_nonfinite=True
    )
    opt = mpo.loss_scaled(optax.sgd(0.1, momentum=0.9), scale, axis_name="data")
    step = _tp_step(mesh, policy, opt)
    params, x, y = _inputs()

    def replicated(state):
        leaves = jax.tree.leaves(state.loss_scale)
        leaves += [state.num_skipped, state.num_consecutive_skipped, state.last_finite]
        for leaf in leaves:
            _replicas_identical(leaf)
        return mpo.loss_scale_stats(state)

    # A shard of device 3, then of device 5, is not finite: every device skips
    # both steps, and the second backs the scale off.
    p1, s1, _ = step(params, opt.init(params), x, y, jnp.int32(3))
    jax.tree.map(np.testing.assert_array_equal, p1, params)
    st = replicated(s1)
    assert (bool(st["last_finite"]), int(st["num_skipped"])) == (False, 1)
    assert float(st["loss_scale"]) == 1024.0
    p1, s1, _ = step(p1, s1, x, y, jnp.int32(5))
    jax.tree.map(np.testing.assert_array_equal, p1, params)
    st = replicated(s1)
    assert (int(st["num_skipped"]), float(st["loss_scale"])) == (2, 512.0)

    # Then a finite step: the gradients are the single-device float32 ones.
    p2, s2, grads = step(p1, s1, x, y, jnp.int32(-1))
    ref = jax.grad(_loss)(params, x, y)
    assert_trees_close(
        grads, ref, dtype=jnp.dtype(policy.removeprefix("mixed_")), grad=True
    )
    for name, g in grads.items():
        assert g.dtype == jnp.float32
        spec = NamedSharding(mesh, PARAM_SPECS[name])
        assert g.sharding.is_equivalent_to(spec, g.ndim)
    st = replicated(s2)
    assert bool(st["last_finite"]) and int(st["num_skipped"]) == 2
    assert float(st["loss_scale"]) == 512.0
    assert not bool(jnp.array_equal(p2["w1"], params["w1"]))
    _replicas_identical(p2["b"])


def _dp_loss(params, x, y):
    """Data parallel: this device's rows, averaged over the devices. Under the
    replication check JAX sums the gradient of a replicated parameter over the
    devices itself, so it is the global batch's gradient."""
    return jax.lax.pmean(_loss(params, x, y), "data")


@pytest.mark.parametrize("axis_name", [None, "data"])
@pytest.mark.parametrize("policy", POLICIES)
def test_data_parallel_trains_under_the_default_check(mesh, policy, axis_name):
    opt = mpo.loss_scaled(
        optax.sgd(0.1), mixprec.DynamicLossScale(2.0**10), axis_name=axis_name
    )
    mixed = mixprec.autocast(_dp_loss, policy)

    def step(params, opt_state, x, y, bad_dev):
        # An inf in one device's rows: its loss, then every device's
        # (replicated) gradients, are not finite.
        me = jax.lax.axis_index("data")
        x = jnp.where(me == bad_dev, jnp.inf, x)
        _, grads, _ = mixprec.value_and_grad(mixed)(params, x, y, loss_scale=opt_state)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, grads

    step = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(), P(), P("data"), P("data"), P()),
            out_specs=(P(), P(), P()),
        )
    )
    params, x, y = _inputs()
    p1, s1, _ = step(params, opt.init(params), x, y, jnp.int32(3))
    jax.tree.map(np.testing.assert_array_equal, p1, params)
    st = mpo.loss_scale_stats(s1)
    assert (bool(st["last_finite"]), float(st["loss_scale"])) == (False, 512.0)
    _replicas_identical(s1.loss_scale.loss_scale)

    p2, s2, grads = step(p1, s1, x, y, jnp.int32(-1))
    ref = jax.grad(_loss)(params, x, y)
    assert_trees_close(
        grads, ref, dtype=jnp.dtype(policy.removeprefix("mixed_")), grad=True
    )
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
    assert bool(mpo.loss_scale_stats(s2)["last_finite"])
    for leaf in jax.tree.leaves(p2) + [s2.loss_scale.loss_scale, s2.num_skipped]:
        _replicas_identical(leaf)


def test_autocast_own_ops_vary_like_their_operand(mesh):
    # autocast's own ops (saturations) are traced once, outside any shard_map:
    # bound in a body on a varying value, their constants and a nested jit
    # (`jnp.where`'s) must vary with it, or the check (and the transpose of
    # the jit, under grad) refuses them.
    from mixprec._src.autocast import operands

    own = jax.make_jaxpr(lambda x: jnp.where(x > 1.0, 1.0, x))(
        jax.ShapeDtypeStruct((4,), jnp.float32)
    )
    walk = types.SimpleNamespace(observer=None)

    def f(x):
        return jnp.sum(operands.run_own(walk, None, own, x * 2.0, reason=""))  # pyright: ignore[reportArgumentType]

    g = jax.jit(
        jax.shard_map(jax.grad(f), mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    )
    x = jnp.linspace(0.0, 1.0, 4 * N_DEV)
    np.testing.assert_array_equal(g(x), np.where(2 * np.asarray(x) > 1, 0.0, 2.0))
