"""Loss scales: the dynamic state machine, dtypes, pytrees, jit/scan, errors."""

import dataclasses

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mixprec
from mixprec import DynamicLossScale, NoOpLossScale, StaticLossScale


hypothesis.settings.register_profile(
    "mixprec", derandomize=True, database=None, deadline=None, max_examples=30
)
hypothesis.settings.load_profile("mixprec")

F32_MAX = float(np.finfo(np.float32).max)


def reference_run(
    flags,
    *,
    init,
    period,
    growth,
    backoff,
    min_scale,
    max_scale,
    n_bad,
    consecutive=False,
):
    """A plain-Python model of DynamicLossScale, in float32 arithmetic."""
    scale, counter, bad = np.float32(init), 0, 0
    trace = []
    for finite in flags:
        if finite:
            if counter == period - 1:
                with np.errstate(over="ignore"):
                    grown = np.float32(scale * np.float32(growth))
                if np.isfinite(grown):
                    scale = min(grown, np.float32(max_scale))
                bad = 0
            counter = (counter + 1) % period
            if consecutive:
                bad = 0  # a finite step ends the run of non-finite ones
        else:
            bad += 1
            if bad >= n_bad:
                scale = max(
                    np.float32(scale * np.float32(backoff)), np.float32(min_scale)
                )
                bad = 0
                counter = 0
            elif not consecutive:
                counter = 0  # TF1: any non-finite step restarts the growth count
        trace.append((float(scale), counter))
    return trace


configs = st.fixed_dictionaries(
    {
        "init": st.sampled_from([1.0, 2.0**4, 2.0**15, 2.0**100, 3e38]),
        "period": st.integers(1, 5),
        "factor": st.sampled_from([2, 3, 4.0]),
        "growth_factor": st.sampled_from([None, 1.5, 8.0]),
        "backoff_factor": st.sampled_from([None, 0.25, 0.9]),
        "min_loss_scale": st.sampled_from([1.0, 0.5, 2.0**3]),
        "max_loss_scale": st.sampled_from([None, 2.0**20]),
        "nonfinite_before_backoff": st.integers(1, 3),
        "consecutive_nonfinite": st.booleans(),
    }
)


def _reference_args(cfg):
    growth = cfg["growth_factor"] or cfg["factor"]
    backoff = cfg["backoff_factor"] or 1 / cfg["factor"]
    max_scale = cfg["max_loss_scale"] if cfg["max_loss_scale"] is not None else F32_MAX
    return dict(
        init=cfg["init"],
        period=cfg["period"],
        growth=growth,
        backoff=backoff,
        min_scale=cfg["min_loss_scale"],
        max_scale=max_scale,
        n_bad=cfg["nonfinite_before_backoff"],
        consecutive=cfg["consecutive_nonfinite"],
    )


def _make(cfg):
    cfg = dict(cfg)
    if cfg["nonfinite_before_backoff"] == 1:
        cfg["consecutive_nonfinite"] = False  # only meaningful with N > 1
    if cfg["max_loss_scale"] is not None and cfg["max_loss_scale"] < cfg["init"]:
        cfg["max_loss_scale"] = None
    init = cfg.pop("init")
    return DynamicLossScale(init, **cfg), cfg | {"init": init}


@hypothesis.given(configs, st.lists(st.booleans(), min_size=1, max_size=120))
def test_state_machine_matches_reference_eager_and_jit(cfg, flags):
    ls, cfg = _make(cfg)
    expected = reference_run(flags, **_reference_args(cfg))
    adjust = jax.jit(lambda s, f: s.adjust(f))
    eager = jit_state = ls
    for finite, (want_scale, want_counter) in zip(flags, expected, strict=True):
        eager = eager.adjust(jnp.array(finite))
        jit_state = adjust(jit_state, jnp.array(finite))
        for state in (eager, jit_state):
            assert state.loss_scale.dtype == jnp.float32
            assert state.counter.dtype == jnp.int32
            assert float(state.loss_scale) == want_scale
            assert int(state.counter) == want_counter
            assert np.isfinite(float(state.loss_scale))
            assert float(state.loss_scale) >= cfg["min_loss_scale"] or (
                float(state.loss_scale) == cfg["init"]
            )
    # Static configuration survives every round trip.
    for field in (
        "period",
        "factor",
        "min_loss_scale",
        "max_loss_scale",
        "growth_factor",
        "nonfinite_before_backoff",
        "consecutive_nonfinite",
    ):
        assert getattr(jit_state, field) == getattr(ls, field)


@hypothesis.given(configs, st.lists(st.booleans(), min_size=1, max_size=300))
def test_state_machine_under_scan(cfg, flags):
    ls, cfg = _make(cfg)
    expected = reference_run(flags, **_reference_args(cfg))

    def step(state, finite):
        new = state.adjust(finite)
        return new, (new.loss_scale, new.counter)

    final, (scales, counters) = jax.jit(lambda s, f: jax.lax.scan(step, s, f))(
        ls, jnp.array(flags)
    )
    np.testing.assert_array_equal(np.asarray(scales), [s for s, _ in expected])
    np.testing.assert_array_equal(np.asarray(counters), [c for _, c in expected])
    assert type(final) is DynamicLossScale and final.period == ls.period


def test_long_random_sequence_against_reference():
    rng = np.random.default_rng(0)
    flags = (rng.random(5000) > 0.01).tolist()
    flags[1000:1010] = [False] * 10  # a burst
    ls = DynamicLossScale(2.0**15, period=50, min_loss_scale=1.0)
    expected = reference_run(
        flags,
        init=2.0**15,
        period=50,
        growth=2,
        backoff=0.5,
        min_scale=1.0,
        max_scale=F32_MAX,
        n_bad=1,
    )

    def step(state, finite):
        new = state.adjust(finite)
        return new, new.loss_scale

    _, scales = jax.jit(lambda s, f: jax.lax.scan(step, s, f))(ls, jnp.array(flags))
    np.testing.assert_array_equal(np.asarray(scales), [s for s, _ in expected])
    assert float(scales[1009]) < float(scales[999])  # the burst backed off


def test_never_grows_to_inf():
    ls = DynamicLossScale(np.float32(F32_MAX) / 2, period=1)
    for _ in range(5):
        ls = ls.adjust(jnp.array(True))
        assert np.isfinite(float(ls.loss_scale))
    # One growth fits below the float32 maximum; the next would overflow and is
    # refused, leaving the scale where it was.
    assert float(ls.loss_scale) == float(np.float32(F32_MAX) / 2 * 2)


def test_max_loss_scale_caps_growth():
    ls = DynamicLossScale(2.0**10, period=1, max_loss_scale=2.0**12)
    for _ in range(5):
        ls = ls.adjust(True)
    assert float(ls.loss_scale) == 2.0**12


def test_separate_growth_and_backoff():
    ls = DynamicLossScale(100.0, period=1, growth_factor=3.0, backoff_factor=0.1)
    assert float(ls.adjust(True).loss_scale) == 300.0
    assert float(ls.adjust(False).loss_scale) == pytest.approx(10.0)


def test_nonfinite_before_backoff_tf1():
    ls = DynamicLossScale(64.0, nonfinite_before_backoff=2)
    assert len(jax.tree.leaves(ls)) == 3
    one = ls.adjust(False)
    assert float(one.loss_scale) == 64.0 and int(one.nonfinite_counter) == 1
    two = one.adjust(False)
    assert float(two.loss_scale) == 32.0 and int(two.nonfinite_counter) == 0


def test_consecutive_nonfinite_ignores_isolated_faults():
    ls = DynamicLossScale(
        64.0, period=3, nonfinite_before_backoff=2, consecutive_nonfinite=True
    )
    # JMP's leaves plus the non-finite counter, as with TF1's rule.
    leaves = jax.tree.leaves(ls)
    assert [x.dtype for x in leaves] == [jnp.float32, jnp.int32, jnp.int32]
    # finite, inf, finite, finite: the isolated inf neither backs off nor
    # restarts the growth count, so the third finite step grows the scale.
    s = ls
    for finite in (True, False, True):
        s = s.adjust(jnp.array(finite))
        assert float(s.loss_scale) == 64.0
    assert int(s.counter) == 2 and int(s.nonfinite_counter) == 0
    s = s.adjust(jnp.array(True))
    assert float(s.loss_scale) == 128.0
    # Two in a row back off, and restart the growth count.
    s = s.adjust(jnp.array(True)).adjust(jnp.array(False))
    assert float(s.loss_scale) == 128.0 and int(s.counter) == 1
    s = s.adjust(jnp.array(False))
    assert float(s.loss_scale) == 64.0 and int(s.counter) == 0
    # TF1's rule counts non-finite steps since the last change of scale: two
    # isolated ones back off.
    tf1 = DynamicLossScale(64.0, period=100, nonfinite_before_backoff=2)
    for finite in (False, True, True, False):
        tf1 = tf1.adjust(jnp.array(finite))
    assert float(tf1.loss_scale) == 32.0


def test_pytree_leaves_are_jmp_layout_and_config_survives():
    ls = DynamicLossScale(
        jnp.float32(2**15),
        period=7,
        factor=4,
        min_loss_scale=0.5,
        max_loss_scale=2.0**20,
    )
    leaves, treedef = jax.tree.flatten(ls)
    assert [leaf.dtype for leaf in leaves] == [jnp.float32, jnp.int32]
    rebuilt = jax.tree.unflatten(treedef, leaves)
    mapped = jax.tree.map(lambda x: x, ls)
    through_jit = jax.jit(lambda s: s)(ls)
    for other in (rebuilt, mapped, through_jit):
        assert (
            other.period,
            other.factor,
            other.min_loss_scale,
            other.max_loss_scale,
        ) == (7, 4, 0.5, 2.0**20)
    # JMP bug: min_loss_scale is reset to 1.0 after tree_map; ours is kept.
    assert mapped.adjust(False).adjust(False).min_loss_scale == 0.5


def test_zero_floor_stops_at_the_smallest_normal_float32_and_grows_back():
    # JMP lets a floor of 0 take the scale to 0, where it stays (0 * 2 = 0).
    tiny = float(np.finfo(np.float32).tiny)
    ls = DynamicLossScale(1.0, period=1, min_loss_scale=0.0)
    adjust = jax.jit(lambda s, f: s.adjust(f))
    for _ in range(200):
        ls = adjust(ls, jnp.array(False))
    assert float(ls.loss_scale) == tiny
    ls = adjust(ls, jnp.array(True))
    assert float(ls.loss_scale) == 2 * tiny


def test_min_loss_scale_enforced_after_jit():
    ls = jax.jit(lambda s: s)(DynamicLossScale(1.0, min_loss_scale=0.25))
    for _ in range(6):
        ls = ls.adjust(False)
    assert float(ls.loss_scale) == 0.25


@pytest.mark.parametrize("leaf_dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize(
    "ls", [StaticLossScale(2.0**15), DynamicLossScale(2.0**15), NoOpLossScale()]
)
def test_scale_unscale_keep_leaf_dtypes(ls, leaf_dtype):
    tree = {"g": jnp.array([1.0, 0.5], leaf_dtype), "step": jnp.array(3)}
    scaled = ls.scale(tree)
    assert scaled["g"].dtype == leaf_dtype  # JMP returns float32 here
    assert scaled["step"].dtype == jnp.int32 and int(scaled["step"]) == 3
    back = ls.unscale(scaled)
    assert back["g"].dtype == leaf_dtype
    np.testing.assert_array_equal(np.asarray(back["g"], np.float32), [1.0, 0.5])


def test_unscale_f16_gradients_above_f16_range_scale():
    # A float32 scale of 2**16 is inf in float16; unscaling must not go through it.
    ls = StaticLossScale(2.0**16)
    grads = jnp.array([2.0**10], jnp.float16)
    out = ls.unscale(grads)
    assert out.dtype == jnp.float16
    assert float(out[0]) == 2.0**-6


def test_float16_loss_scale_works():
    # JMP crashes in adjust with a float16 scale.
    ls = DynamicLossScale(jnp.float16(1024.0), period=1)
    assert ls.loss_scale.dtype == jnp.float32
    ls = ls.adjust(jnp.array(True))
    assert float(ls.loss_scale) == 2048.0 and ls.loss_scale.dtype == jnp.float32


def test_static_loss_scale_is_static_float32():
    # As in JMP the scale is static configuration: no leaves, part of the treedef.
    ls = StaticLossScale(jnp.float16(8.0))
    assert type(ls.loss_scale) is np.float32 and ls.loss_scale == 8.0
    assert jax.tree.leaves(ls) == []
    assert ls.adjust(jnp.array(False)) is ls
    assert hash(ls) == hash(StaticLossScale(8)) and ls == StaticLossScale(8.0)
    assert jax.tree.structure(ls) != jax.tree.structure(StaticLossScale(4.0))
    scale = jax.jit(lambda s, x: s.scale(x))
    out = scale(ls, jnp.ones(2, jnp.float16))
    assert out.dtype == jnp.float16
    np.testing.assert_array_equal(out, 8.0)
    # A different scale is a different static value: the jitted step sees it.
    np.testing.assert_array_equal(scale(StaticLossScale(0.5), jnp.ones(2)), 0.5)
    assert jax.jit(lambda s: s)(ls) == ls


def test_static_loss_scale_of_zero_is_a_placeholder():
    # JMP's own tests build `StaticLossScale(0)`; it cannot unscale.
    ls = StaticLossScale(0)
    assert jax.tree.leaves(ls) == [] and ls.loss_scale == 0.0
    np.testing.assert_array_equal(ls.scale(jnp.ones(2)), [0.0, 0.0])
    with pytest.raises(ValueError, match=r"StaticLossScale\(0\).unscale.*scale > 0"):
        ls.unscale(jnp.ones(2))


def test_static_loss_scale_rejects_traced_scale():
    with pytest.raises(TypeError, match="concrete number.*DynamicLossScale"):
        jax.jit(lambda s: StaticLossScale(s).scale(jnp.ones(2)))(jnp.float32(2.0))


def test_noop_has_no_leaves_and_scale_one():
    ls = NoOpLossScale()
    assert jax.tree.leaves(ls) == []
    assert float(ls.loss_scale) == 1.0
    x = jnp.ones(2, jnp.float16)
    assert ls.scale(x) is x and ls.unscale(x) is x


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(loss_scale=-1.0), ValueError, r"loss_scale=.*finite number > 0"),
        (dict(loss_scale=0.0), ValueError, r"finite number > 0"),
        (dict(loss_scale=float("inf")), ValueError, r"finite number > 0"),
        (dict(loss_scale=np.float32("nan")), ValueError, r"finite number > 0"),
        (dict(loss_scale=np.ones(2)), ValueError, r"must be a scalar"),
        (dict(loss_scale=1.0, period=0), ValueError, r"period=.*>= 1"),
        (dict(loss_scale=1.0, period=2.5), TypeError, r"period=.*integer"),
        (dict(loss_scale=1.0, factor=1), ValueError, r"factor=.*> 1"),
        (dict(loss_scale=1.0, factor=0.5), ValueError, r"factor=.*> 1"),
        (dict(loss_scale=1.0, min_loss_scale=-1.0), ValueError, r"min_loss_scale"),
        (dict(loss_scale=1.0, period=float("inf")), TypeError, r"period=.*integer"),
        (dict(loss_scale=True), TypeError, r"loss_scale=.*number"),
        (dict(loss_scale=1e39), ValueError, r"finite as a float32"),
        (dict(loss_scale=1.0, growth_factor=1.0), ValueError, r"growth_factor"),
        (
            dict(loss_scale=1.0, backoff_factor=1.5),
            ValueError,
            r"backoff_factor.*\(0, 1\)",
        ),
        (dict(loss_scale=4.0, max_loss_scale=0.5), ValueError, r"max_loss_scale"),
        (dict(loss_scale=1.0, counter=-1), ValueError, r"counter"),
        (
            dict(loss_scale=1.0, nonfinite_before_backoff=0),
            ValueError,
            r"nonfinite_before",
        ),
        (
            dict(loss_scale=1.0, consecutive_nonfinite=True),
            ValueError,
            r"consecutive_nonfinite=True.*needs `nonfinite_before_backoff > 1`",
        ),
        (
            dict(loss_scale=1.0, nonfinite_before_backoff=2, consecutive_nonfinite=1),
            TypeError,
            r"consecutive_nonfinite=.*must be a bool",
        ),
    ],
)
def test_dynamic_bad_input(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        DynamicLossScale(**kwargs)


@pytest.mark.parametrize(
    "bad,exc",
    [
        (-2.0, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        (1e39, ValueError),  # inf as a float32
        (np.ones(2), ValueError),
        (True, TypeError),
        ("2.0", TypeError),
        (1j, TypeError),
    ],
)
def test_static_bad_input(bad, exc):
    with pytest.raises(exc, match=r"`StaticLossScale\(loss_scale=...\)` must be"):
        StaticLossScale(bad)


@pytest.mark.parametrize(
    "ls", [NoOpLossScale(), StaticLossScale(2.0), DynamicLossScale(2.0)]
)
def test_adjust_rejects_non_scalar_and_non_bool(ls):
    with pytest.raises(ValueError, match=r"adjust\(grads_finite\)` must be a scalar"):
        ls.adjust(jnp.array([True, False]))
    with pytest.raises(TypeError, match="must be a boolean"):
        ls.adjust(jnp.array(1.0))


def test_adjust_under_jit_with_traced_flag_and_vmap():
    ls = DynamicLossScale(8.0, period=1)
    out = jax.vmap(lambda f: ls.adjust(f).loss_scale)(jnp.array([True, False]))
    np.testing.assert_array_equal(out, [16.0, 4.0])


def test_replace_keeps_type():
    ls = dataclasses.replace(DynamicLossScale(2.0), period=3)
    assert ls.period == 3 and isinstance(ls, mixprec.LossScale)


# ---- all_finite / select_tree ------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
def test_all_finite(dtype, bad):
    good = {"a": jnp.ones(3, dtype), "i": jnp.arange(3), "b": jnp.array(True)}
    assert bool(mixprec.all_finite(good))
    broken = dict(good, a=good["a"].at[1].set(bad))
    out = jax.jit(mixprec.all_finite)(broken)
    assert out.dtype == jnp.bool_ and out.shape == () and not bool(out)


def test_all_finite_empty_and_int_only():
    assert bool(mixprec.all_finite({}))
    assert bool(mixprec.all_finite({"step": jnp.array(1)}))


def test_all_finite_axis_name_agrees_across_devices():
    n = jax.device_count()
    assert n == 8, "conftest asks for 8 CPU devices"
    x = jnp.ones((n, 4)).at[3, 2].set(jnp.inf)
    mesh = jax.make_mesh((n,), ("data",))
    spec = jax.sharding.PartitionSpec("data")

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=spec, out_specs=spec)
    def per_device(shard):
        local = mixprec.all_finite(shard)
        agreed = mixprec.all_finite(shard, axis_name="data")
        return jnp.stack([local, agreed])[None]

    x = jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
    out = np.asarray(per_device(x))
    assert out[:, 0].tolist() == [i != 3 for i in range(n)]  # local views differ
    assert out[:, 1].tolist() == [False] * n  # the agreed flag does not


def test_all_finite_axis_name_under_vmap():
    x = jnp.ones((4, 3)).at[2, 0].set(jnp.nan)
    out = jax.vmap(lambda r: mixprec.all_finite(r, axis_name="b"), axis_name="b")(x)
    assert out.tolist() == [False] * 4


def test_select_tree():
    a = {"w": jnp.ones(2, jnp.bfloat16), "n": jnp.array(1)}
    b = {"w": jnp.zeros(2, jnp.bfloat16), "n": jnp.array(2)}
    out = jax.jit(mixprec.select_tree)(jnp.array(True), a, b)
    assert out["w"].dtype == jnp.bfloat16 and out["w"].tolist() == [1, 1]
    out = mixprec.select_tree(jnp.array(False), a, b)
    assert int(out["n"]) == 2


def test_select_tree_errors():
    a = {"w": jnp.ones(2)}
    with pytest.raises(ValueError, match="scalar"):
        mixprec.select_tree(jnp.array([True, False]), a, a)
    with pytest.raises(TypeError, match="boolean"):
        mixprec.select_tree(jnp.array(1), a, a)
    with pytest.raises(ValueError, match="same tree structure"):
        mixprec.select_tree(jnp.array(True), a, {"v": jnp.ones(2)})


@pytest.mark.parametrize(
    "ls",
    [
        DynamicLossScale(2.0**15, min_loss_scale=0.5),
        DynamicLossScale(4.0, nonfinite_before_backoff=3),
        StaticLossScale(2.0),
    ],
)
def test_tree_map_to_non_arrays_round_trips(ls):
    # Unflattening never validates: orbax and tree utilities put zeros, None
    # or ShapeDtypeStructs in the leaves.
    zeros = jax.tree.map(lambda x: 0, ls)
    assert jax.tree.leaves(zeros) == [0] * len(jax.tree.leaves(ls))
    shapes = jax.eval_shape(lambda s: s, ls)
    assert type(shapes) is type(ls)
    assert [x.dtype for x in jax.tree.leaves(shapes)] == [
        x.dtype for x in jax.tree.leaves(ls)
    ]
    back = jax.tree.map(lambda _, x: x, zeros, ls)
    assert back == ls or jax.tree.leaves(back) == jax.tree.leaves(ls)
