"""Tests for `mixprec.optax.loss_scaled`."""

from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_dtypes, assert_trees_close

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
    # The default scale ignores one non-finite step and backs off on the second
    # in a row.
    assert float(_st(new_state).loss_scale.loss_scale) == 2.0**15
    _, twice = opt.update(bad_grads, new_state, params)
    assert float(_st(twice).loss_scale.loss_scale) == 2.0**14
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


# ---- time at the floor, and the warning hook ------------------------------------


def test_num_steps_at_floor_counts_the_current_stretch():
    opt = mpo.loss_scaled(
        optax.sgd(0.1), mixprec.DynamicLossScale(4.0, period=2, min_loss_scale=1.0)
    )
    params = {"w": jnp.ones(2)}
    good, bad = {"w": jnp.ones(2)}, {"w": jnp.array([1.0, jnp.nan])}
    state = opt.init(params)
    assert int(mpo.loss_scale_stats(state)["num_steps_at_floor"]) == 0
    update = jax.jit(opt.update)
    seen = []
    #        4->2  2->1  floor floor grow: 2  back: 1  floor
    for g in (bad, bad, bad, good, good, bad, good):
        _, state = update(g, state, params)
        stats = mpo.loss_scale_stats(state)
        assert stats["num_steps_at_floor"].dtype == jnp.int32
        seen.append((float(stats["loss_scale"]), int(stats["num_steps_at_floor"])))
    assert seen == [(2, 0), (1, 1), (1, 2), (1, 3), (2, 0), (1, 1), (1, 2)]
    # A static scale has no floor to sit at.
    static = mpo.loss_scaled(optax.sgd(0.1), mixprec.StaticLossScale(1.0))
    _, s = static.update(bad, static.init(params), params)
    assert int(mpo.loss_scale_stats(s)["num_steps_at_floor"]) == 0


def test_floor_warning_is_opt_in_and_fires_once_per_stretch():
    ls = mixprec.DynamicLossScale(2.0, min_loss_scale=1.0)
    params = {"w": jnp.ones(2)}
    bad = {"w": jnp.array([1.0, jnp.inf])}

    def run(opt, n):
        def body(state, _):
            _, state = opt.update(bad, state, params)
            return state, None

        state, _ = jax.jit(lambda s: jax.lax.scan(body, s, length=n))(opt.init(params))
        jax.effects_barrier()
        return state

    quiet = mpo.loss_scaled(optax.sgd(0.1), ls)
    assert "debug_callback" not in str(
        jax.make_jaxpr(quiet.update)(bad, quiet.init(params), params)
    )
    run(quiet, 10)  # filterwarnings=error: any warning would fail here

    loud = mpo.loss_scaled(optax.sgd(0.1), ls, warn_at_floor_after=4)
    with pytest.warns(mpo.LossScaleFloorWarning) as record:
        state = run(loud, 10)  # 2 -> 1 on the first step: 10 steps at the floor
    assert int(mpo.loss_scale_stats(state)["num_steps_at_floor"]) == 10
    messages = [str(w.message) for w in record]
    assert len(messages) == 2, messages
    assert "floor (1) for 4 steps" in messages[0]
    assert "for 8 steps" in messages[1]
    assert "consecutive_nonfinite=True" in messages[0]


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_warn_at_floor_after_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=r"warn_at_floor_after=.*positive integer"):
        mpo.loss_scaled(optax.sgd(0.1), warn_at_floor_after=bad)


# ---- gradient accumulation: both orders, with injected faults ---------------


def _micro_batches(n):
    keys = jax.random.split(jax.random.key(7), n)
    return [jax.random.normal(k, (4, 2)) for k in keys]


@pytest.mark.standard_promotion  # optax.adam's bias correction
def test_accumulation_inside_the_wrapper_skips_bad_micro_batches():
    # loss_scaled(MultiSteps(adam, 4)): each micro-batch is checked before it is
    # accumulated, a bad one is skipped (MultiSteps never sees it), and the run
    # equals MultiSteps(adam, 4) fed only the good micro-batches.
    k, n, faults = 4, 40, {5, 6, 17}  # 5 and 6 in a row: the scale backs off
    opt = mpo.loss_scaled(optax.MultiSteps(optax.adam(5e-2), k))
    ref = optax.MultiSteps(optax.adam(5e-2), k)
    params = ref_params = _params()
    state, ref_state = opt.init(params), ref.init(params)

    @jax.jit
    def step(params, state, x, inject):
        _, grads, _ = mixprec.value_and_grad(_loss)(params, x, loss_scale=state)
        grads = jax.tree.map(lambda g: jnp.where(inject, jnp.nan, g), grads)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    @jax.jit
    def ref_step(params, state, x):
        updates, state = ref.update(jax.grad(_loss)(params, x), state, params)
        return optax.apply_updates(params, updates), state

    finite = jax.jit(mixprec.all_finite)
    for i, x in enumerate(_micro_batches(n)):
        params, state = step(params, state, x, jnp.array(i in faults))
        assert bool(finite((params, state))), f"micro-step {i}"
        if i not in faults:
            ref_params, ref_state = ref_step(ref_params, ref_state, x)
    st_ = _st(state)
    assert int(st_.num_skipped) == len(faults)
    inner = cast(optax.MultiStepsState, st_.inner_state)
    assert int(inner.gradient_step) == (n - len(faults)) // k
    assert float(st_.loss_scale.loss_scale) == 2.0**14  # one backoff (5, 6)
    # f32 and power-of-two scales: the only difference is optax's
    # `apply_if_finite` cond, fused differently (a few ulp).
    assert_trees_close(params, ref_params, dtype=jnp.float32)
    assert_tree_dtypes(params, ref_params)
    assert float(_loss(params, X)) < 0.5 * float(_loss(_params(), X))


@pytest.mark.standard_promotion
def test_accumulation_around_the_wrapper_fails_at_the_first_step():
    opt = optax.MultiSteps(mpo.loss_scaled(optax.adam(1e-2)), 4)
    params = _params()
    state = opt.init(params)
    right = r"loss_scaled\(optax\.MultiSteps\(inner, every_k_schedule=k\), loss_scale\)"
    with pytest.raises(ValueError, match=r"(?s)`optax\.MultiSteps` around.*" + right):
        mixprec.value_and_grad(_loss)(params, X, loss_scale=state)
    with pytest.raises(ValueError, match=right):
        mpo.loss_scale_stats(state)
    with pytest.raises(ValueError, match=right):
        mpo.current_loss_scale(state)


@pytest.mark.standard_promotion
def test_why_accumulation_around_the_wrapper_is_refused():
    # With plain `jax.grad` nothing can refuse the state. One non-finite
    # micro-batch then makes optax.MultiSteps' accumulator NaN for good (it is
    # cleared by multiplying by zero): every later step is skipped and the
    # parameters never move again. If optax changes this, this order may be
    # allowed.
    opt = optax.MultiSteps(mpo.loss_scaled(optax.adam(1e-2)), 4)

    @jax.jit
    def step(params, state, x, inject):
        grads = jax.grad(_loss)(params, x)
        grads = jax.tree.map(lambda g: jnp.where(inject, jnp.inf, g), grads)
        updates, state = opt.update(grads, state, params)
        acc_finite = mixprec.all_finite(state.acc_grads)
        return optax.apply_updates(params, updates), state, acc_finite

    params = _params()
    state = opt.init(params)
    frozen = None
    for i, x in enumerate(_micro_batches(24)):
        params, state, acc_finite = step(params, state, x, jnp.array(i == 5))
        if i == 5:
            frozen = params
        assert bool(acc_finite) == (i < 5), f"micro-step {i}"
    _tree_equal(params, frozen)


@pytest.mark.standard_promotion
def test_multisteps_object_or_its_transformation_are_the_same():
    params = _params()
    a = mpo.loss_scaled(optax.MultiSteps(optax.sgd(0.1), 2))
    b = mpo.loss_scaled(optax.MultiSteps(optax.sgd(0.1), 2).gradient_transformation())
    sa, sb = a.init(params), b.init(params)
    for x in _micro_batches(4):
        g = jax.grad(_loss)(params, x)
        ua, sa = a.update(g, sa, params)
        ub, sb = b.update(g, sb, params)
        _tree_equal(ua, ub)


def test_loss_scale_stats_print_as_numbers_and_work_under_jit():
    opt = mpo.loss_scaled(optax.sgd(0.1), mixprec.DynamicLossScale(2.0**15))
    state = opt.init(_params())
    stats = mpo.loss_scale_stats(state)
    assert repr(stats) == (
        "{'loss_scale': 32768.0, 'num_skipped': 0, 'num_consecutive_skipped': 0, "
        "'last_finite': True, 'num_steps_at_floor': 0}"
    )
    assert str(stats) == repr(stats) and "Array" not in f"{stats}"
    # The values stay arrays, with their dtypes.
    assert stats["loss_scale"].dtype == jnp.float32
    assert stats["num_skipped"].dtype == jnp.int32
    assert stats["last_finite"].dtype == jnp.bool_
    seen = []

    @jax.jit
    def step(state):
        inside = mpo.loss_scale_stats(state)
        seen.append(repr(inside))  # traced: the values are not numbers yet
        return inside, inside["loss_scale"] * 2

    out, doubled = step(state)
    assert "Tracer" in seen[0] and "float32[]" in seen[0]
    assert float(doubled) == 65536.0
    assert repr(out) == repr(stats)  # a pytree: returned from jit, still readable
    assert type(out) is type(stats) and len(jax.tree.leaves(out)) == 5
    host = jax.device_get(out)
    assert repr(host) == repr(stats) and isinstance(host["num_skipped"], np.ndarray)
