"""Tests for `mixprec.optax.loss_scaled`."""

from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mixprec
import mixprec.optax as mpo


def _st(state) -> mpo.LossScaledState:
    """The typed view of an optimizer state (optax types `update` loosely)."""
    assert isinstance(state, mpo.LossScaledState)
    return state


def _params():
    return {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.zeros(3)}


def _loss(params, x):
    h = x @ params["w"] + params["b"][None, :]
    return jnp.mean(h**2) + jnp.sum(params["w"] ** 2)


X = jnp.arange(8.0).reshape(4, 2) / 8


def _tree_equal(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.standard_promotion  # optax.adam's bias correction mixes int and float
@pytest.mark.parametrize("name", ["sgd_momentum", "adam"])
def test_finite_steps_equal_the_inner_optimizer(name):
    # f32 + power-of-two scales are exact (the gradients are bit-equal, see
    # test_training), and period=1 grows the scale on every step: unscaling with
    # the grown scale would halve every update. The reference is the unscaled
    # inner optimizer inside optax's own `apply_if_finite` (the update runs in a
    # `lax.cond` that XLA fuses differently from eager ops, 1 ulp apart).
    inner = optax.sgd(0.1, momentum=0.9) if name == "sgd_momentum" else optax.adam(1e-2)
    opt = mpo.loss_scaled(inner, mixprec.DynamicLossScale(2.0**4, period=1))
    ref = optax.apply_if_finite(inner, max_consecutive_errors=10)
    params_a = params_b = _params()
    state_a, state_b = opt.init(params_a), ref.init(params_b)

    def step_a(params, state):
        _, grads, _ = mixprec.value_and_grad(_loss)(params, X, loss_scale=state)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def step_b(params, state):
        grads = jax.grad(_loss)(params, X)
        updates, state = ref.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(5):
        params_a, state_a = step_a(params_a, state_a)
        params_b, state_b = step_b(params_b, state_b)
    _tree_equal(
        (params_a, _st(state_a).inner_state),
        (params_b, cast(optax.ApplyIfFiniteState, state_b).inner_state),
    )
    assert float(mpo.current_loss_scale(state_a).loss_scale) == 2.0**9
    assert int(_st(state_a).num_skipped) == 0 and bool(_st(state_a).last_finite)


@pytest.mark.standard_promotion
@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
def test_nonfinite_step_changes_neither_params_nor_inner_state(bad):
    opt = mpo.loss_scaled(optax.adam(1e-2))
    params = _params()
    state = opt.init(params)
    grads = jax.grad(_loss)(params, X)
    _, state = opt.update(grads, state, params)  # non-trivial moments
    bad_grads = {"w": grads["w"].at[1, 2].set(bad), "b": grads["b"]}
    updates, new_state = jax.jit(opt.update)(bad_grads, state, params)
    _tree_equal(updates, jax.tree.map(jnp.zeros_like, params))
    _tree_equal(optax.apply_updates(params, updates), params)
    _tree_equal(_st(new_state).inner_state, _st(state).inner_state)
    assert int(_st(new_state).num_skipped) == 1
    assert int(_st(new_state).num_consecutive_skipped) == 1
    assert not bool(_st(new_state).last_finite)
    assert float(_st(new_state).loss_scale.loss_scale) == 2.0**14
    # The next finite step applies and resets the run of skips.
    _, after = opt.update(grads, new_state, params)
    assert (
        int(_st(after).num_skipped) == 1
        and int(_st(after).num_consecutive_skipped) == 0
    )
    assert bool(_st(after).last_finite)


def test_never_gives_up_on_a_long_run_of_bad_steps():
    # optax.apply_if_finite applies the update after `max_consecutive_errors`;
    # the wrapper must not.
    opt = mpo.loss_scaled(optax.sgd(0.1), mixprec.DynamicLossScale(2.0**15))
    params = _params()
    bad = jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), params)

    def body(carry, _):
        params, state = carry
        updates, state = opt.update(bad, state, params)
        return (optax.apply_updates(params, updates), state), None

    (out, state), _ = jax.lax.scan(body, (params, opt.init(params)), length=300)
    _tree_equal(out, params)
    assert int(_st(state).num_skipped) == 300
    assert int(_st(state).num_consecutive_skipped) == 300
    assert float(_st(state).loss_scale.loss_scale) == 1.0  # min_loss_scale


def test_in_a_chain_with_opt_state_as_loss_scale():
    opt = optax.chain(
        optax.clip_by_global_norm(1.0),
        mpo.loss_scaled(optax.sgd(0.1), mixprec.StaticLossScale(2.0**10)),
    )
    params = _params()
    state = opt.init(params)
    (loss, grads, finite) = mixprec.value_and_grad(_loss)(params, X, loss_scale=state)
    assert bool(finite)
    updates, state = opt.update(grads, state, params)
    ref = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
    ref_updates, _ = ref.update(jax.grad(_loss)(params, X), ref.init(params), params)
    _tree_equal(updates, ref_updates)
    stats = mpo.loss_scale_stats(state)
    assert float(stats["loss_scale"]) == 1024.0 and int(stats["num_skipped"]) == 0


def test_extra_args_are_forwarded():
    seen = {}

    def init(params):
        del params
        return optax.EmptyState()

    def update(updates, state, params=None, *, value=None, **extra):
        del params, extra
        seen["value"] = value
        return updates, state

    inner = optax.GradientTransformationExtraArgs(init, update)
    opt = mpo.loss_scaled(inner)
    state = opt.init(_params())
    opt.update(_params(), state, value=jnp.float32(3.0))
    assert float(seen["value"]) == 3.0


def test_noop_scale_and_skipping_without_scaling():
    opt = mpo.loss_scaled(optax.sgd(1.0), mixprec.NoOpLossScale())
    params = {"w": jnp.ones(2)}
    state = opt.init(params)
    updates, state = opt.update({"w": jnp.array([jnp.nan, 1.0])}, state, params)
    _tree_equal(updates, {"w": jnp.zeros(2)})
    assert int(_st(state).num_skipped) == 1
    assert float(mpo.current_loss_scale(state).loss_scale) == 1.0


def test_errors():
    with pytest.raises(TypeError, match=r"loss_scale=.*got float"):
        mpo.loss_scaled(optax.sgd(0.1), 2.0**15)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="GradientTransformation"):
        mpo.loss_scaled(lambda g: g)  # pyright: ignore[reportArgumentType]
    opt = mpo.loss_scaled(optax.sgd(0.1))
    with pytest.raises(TypeError, match="LossScaledState"):
        opt.update({"w": jnp.ones(2)}, optax.EmptyState())
    with pytest.raises(ValueError, match="found 0"):
        mpo.current_loss_scale(optax.sgd(0.1).init(jnp.ones(2)))
    two = optax.chain(mpo.loss_scaled(optax.sgd(0.1)), mpo.loss_scaled(optax.sgd(0.1)))
    with pytest.raises(ValueError, match="found 2"):
        mpo.loss_scale_stats(two.init(jnp.ones(2)))
