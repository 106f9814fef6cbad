"""The behaviours JMP's own test suite checks, checked on mixprec.

JMP's `policy_test.py` and `loss_scale_test.py` pass against mixprec with only
their import rewritten (`import mixprec as jmp`); these are mixprec's own tests
of the same behaviours, so the promise holds without JMP's files or absl. They
also pin what mixprec adds on top: dtypes kept, NumPy leaves kept NumPy, `jit`.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mixprec


HALF = [np.float16, jnp.float16, jnp.bfloat16]
FULL = [np.float32, jnp.float32]
DTYPES = HALF + FULL
DTYPE_IDS = ["np.f16", "jnp.f16", "jnp.bf16", "np.f32", "jnp.f32"]
NAMES = {np.dtype("float16"): "float16", np.dtype("float32"): "float32"}
NAMES[np.dtype(jnp.bfloat16)] = "bfloat16"


def _name(dtype) -> str:
    return NAMES[np.dtype(dtype)]


# ---- policies ------------------------------------------------------------------


@pytest.mark.parametrize("array_module", [np, jnp], ids=["numpy", "jax"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("which", ["param", "compute", "output"])
def test_policy_casts_to_each_dtype(which, dtype, array_module):
    policy = mixprec.Policy(dtype, dtype, dtype)
    assert getattr(policy, f"{which}_dtype") == dtype
    tree = {"a": array_module.ones([]), "i": array_module.arange(2)}
    out = getattr(policy, f"cast_to_{which}")(tree)
    assert out["a"].dtype == dtype and float(out["a"]) == 1.0
    assert type(out["a"]) is type(array_module.ones([], dtype))  # NumPy stays NumPy
    assert out["i"] is tree["i"]  # integers untouched


@pytest.mark.parametrize("array_module", [np, jnp], ids=["numpy", "jax"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_with_output_dtype(dtype, array_module):
    full = mixprec.Policy(array_module.float32, array_module.float32, jnp.float32)
    policy = full.with_output_dtype(dtype)
    assert policy.output_dtype == dtype
    assert (policy.param_dtype, policy.compute_dtype) == (jnp.float32, jnp.float32)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, jnp.bfloat16])
def test_get_policy_of_one_dtype_name_sets_all_three(dtype):
    policy = mixprec.get_policy(_name(dtype))
    assert policy.param_dtype == policy.compute_dtype == policy.output_dtype == dtype


def test_get_policy_almost_a_dtype_name():
    # JMP's message starts "Unknown dtype"; mixprec's also suggests and lists.
    with pytest.raises(ValueError, match=r"Unknown dtype 'compute_float16'\.") as e:
        mixprec.get_policy("compute_float16")
    assert "Valid names are" in str(e.value)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("output", [None, "full"])
def test_get_policy_compute_only(dtype, output):
    spec = f"c={_name(dtype)}" + ("" if output is None else f",o={output}")
    policy = mixprec.get_policy(spec)
    assert policy.param_dtype == jnp.float32
    assert policy.compute_dtype == dtype
    assert policy.output_dtype == (dtype if output is None else jnp.float32)


def test_half_dtype_follows_the_platform():
    platform = jax.local_devices()[0].platform
    expected = jnp.bfloat16 if platform == "tpu" else jnp.float16
    assert mixprec.half_dtype() == expected
    assert mixprec.get_policy("half") == mixprec.Policy(*[expected] * 3)


def _mixed_tree(float_dtype):
    return dict(
        o=object(),
        h=jnp.ones([], float_dtype),
        f=jnp.ones([], jnp.float32),
        i=jnp.ones([], jnp.int16),
    )


def test_cast_to_full():
    tree = _mixed_tree(mixprec.half_dtype())
    out = mixprec.cast_to_full(tree)
    assert out["o"] is tree["o"] and out["i"] is tree["i"]
    assert out["h"].dtype == out["f"].dtype == jnp.float32
    assert out["f"] is tree["f"]  # already float32: no copy
    assert float(out["h"]) == 1.0


def test_cast_to_half():
    half = mixprec.half_dtype()
    tree = _mixed_tree(half)
    out = mixprec.cast_to_half(tree)
    assert out["o"] is tree["o"] and out["i"] is tree["i"]
    assert out["h"] is tree["h"]
    assert out["f"].dtype == half and float(out["f"]) == 1.0


@pytest.mark.parametrize(
    "dtype",
    [*DTYPES, np.dtype("float16"), np.dtype("float32"), jnp.float64, "bfloat16"],
)
def test_str_writes_the_first_name_of_dtype_to_names(dtype):
    # JMP's `str(Policy(np.dtype(...)))` raised KeyError; every form works here.
    policy = mixprec.Policy(dtype, dtype, dtype)
    pieces = str(policy).split(",")
    assert [p.split("=")[0] for p in pieces] == ["p", "c", "o"]
    first = mixprec.dtype_to_names[dtype][0]
    assert [p.split("=")[1] for p in pieces] == [first] * 3
    assert mixprec.get_policy(str(policy)) == policy


def test_dtype_to_names_is_keyed_by_any_dtype_form():
    names = mixprec.dtype_to_names
    assert names[np.float32] == names[jnp.float32] == names[np.dtype("float32")]
    assert names["float32"] == ("f32", "full", "float32")
    assert set(names) == {np.dtype(d) for d in ("bfloat16", "f2", "f4", "f8")}
    for dtype, aliases in names.items():
        for alias in aliases:  # every name parses back to its dtype
            assert mixprec.get_policy(alias).compute_dtype == dtype
    assert np.int8 not in names and "not a dtype" not in names
    with pytest.raises(KeyError):
        names[np.int8]


# ---- loss scales ---------------------------------------------------------------


def test_noop_loss_scale_returns_its_input():
    ls = mixprec.NoOpLossScale()
    tree = {"a": jnp.ones([])}
    assert ls.scale(tree) is tree and ls.unscale(tree) is tree


@pytest.mark.parametrize(
    "make", [mixprec.StaticLossScale, mixprec.DynamicLossScale], ids=["static", "dyn"]
)
@pytest.mark.parametrize("scale", [2, 3, 4])
def test_scale_and_unscale_by_a_constant(make, scale):
    # JMP passes integer scales to StaticLossScale (no warning there); the
    # dynamic scale warns on integers, so it gets floats, as in JMP's suite.
    ls = make(scale if make is mixprec.StaticLossScale else float(scale))
    tree = {"a": jnp.array(1.0), "h": jnp.array(1.0, jnp.bfloat16)}
    scaled = jax.jit(ls.scale)(tree)
    assert scaled["a"].dtype == jnp.float32 and float(scaled["a"]) == scale
    assert scaled["h"].dtype == jnp.bfloat16 and float(scaled["h"]) == scale
    back = ls.unscale(scaled)
    assert back["a"].dtype == jnp.float32 and float(back["a"]) == 1.0
    assert back["h"].dtype == jnp.bfloat16 and float(back["h"]) == 1.0


@pytest.mark.parametrize(
    "make",
    [mixprec.NoOpLossScale, lambda: mixprec.StaticLossScale(0)],
    ids=["noop", "static0"],
)
def test_static_loss_scales_have_no_leaves(make):
    ls = make()
    assert jax.tree.leaves(ls) == []
    assert jax.tree.map(lambda x: x, ls) == ls


def test_float_dynamic_loss_scale_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mixprec.DynamicLossScale(2.0**15)
        mixprec.DynamicLossScale(jnp.float32(2.0**15), min_loss_scale=jnp.float32(2))


def test_dynamic_loss_scale_leaves_are_scale_and_counter():
    scale, counter = jnp.ones([]), jnp.zeros([], jnp.int32)
    ls = mixprec.DynamicLossScale(scale, counter, 2000, 2)
    leaves = jax.tree.leaves(ls)
    assert len(leaves) == 2 and leaves[0] is scale and leaves[1] is counter
    assert jax.tree.map(lambda x: x, ls) == ls


@pytest.mark.parametrize("period,factor", [(20, 2), (30, 3)])
def test_dynamic_grows_after_period_finite_steps(period, factor):
    ls = mixprec.DynamicLossScale(jnp.float32(10), jnp.int32(0), period, factor)
    adjust = jax.jit(lambda s: s.adjust(jnp.bool_(True)))
    for i in range(1, period):
        ls = adjust(ls)
        assert float(ls.loss_scale) == 10.0 and int(ls.counter) == i
        assert (ls.period, ls.factor) == (period, factor)
    ls = adjust(ls)  # the counter wraps and the scale grows
    assert float(ls.loss_scale) == 10.0 * factor and int(ls.counter) == 0
    assert ls.loss_scale.dtype == jnp.float32 and ls.counter.dtype == jnp.int32


@pytest.mark.parametrize(
    "period,factor,floor",
    [(20, 2, None), (30, 3, None), (20, 2, 0.3125), (30, 3, 0.37), (5.0, 2.0, 0.0)],
)
def test_dynamic_backs_off_on_non_finite_down_to_the_floor(period, factor, floor):
    init = np.float32(10)
    kwargs = {} if floor is None else {"min_loss_scale": jnp.asarray(floor)}
    ls = mixprec.DynamicLossScale(
        jnp.asarray(init), jnp.int32(3), period, factor, **kwargs
    )
    expected_floor = 1.0 if floor is None else float(np.float32(floor))
    assert ls.period == period and type(ls.period) is int  # 5.0 becomes 5
    assert ls.min_loss_scale == expected_floor
    adjust = jax.jit(lambda s: s.adjust(jnp.bool_(False)))
    for i in range(100):
        ls = adjust(ls)
        want = max(expected_floor, float(init) / float(factor) ** (i + 1))
        np.testing.assert_allclose(float(ls.loss_scale), want, rtol=1e-5)
        assert int(ls.counter) == 0
        assert (ls.period, ls.factor, ls.min_loss_scale) == (
            period,
            factor,
            expected_floor,
        )


@pytest.mark.parametrize("argname", ["loss_scale", "min_loss_scale"])
@pytest.mark.parametrize(
    "value", [jnp.asarray(1, jnp.int32), np.int32(1), 1], ids=["jax", "numpy", "py"]
)
def test_integer_scale_warns_like_jmp(argname, value):
    kwargs = {"loss_scale": 2.0, argname: value}
    with pytest.warns(UserWarning, match=f"Expected floating type for {argname}"):
        ls = mixprec.DynamicLossScale(**kwargs)
    # ... and is used as a float (JMP keeps the integer).
    assert ls.loss_scale.dtype == jnp.float32
    assert type(ls.min_loss_scale) is float


@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
def test_all_finite(bad):
    for tree in (None, {}, {"a": jnp.ones([]), "b": jnp.ones([])}):
        out = mixprec.all_finite(tree)
        assert out.dtype == jnp.bool_ and out.shape == () and bool(out)
    for tree in (
        {"a": jnp.array(bad)},
        {"a": jnp.ones([]), "b": jnp.array(bad)},
        {"a": jnp.array(bad), "b": jnp.ones([])},
    ):
        assert not bool(jax.jit(mixprec.all_finite)(tree))


def test_select_tree():
    a = {"a": jnp.ones([]), "b": jnp.zeros([])}
    b = {"a": jnp.zeros([]), "b": jnp.ones([])}
    assert mixprec.select_tree(jnp.bool_(True), None, None) is None
    assert mixprec.select_tree(jnp.bool_(False), None, None) is None
    for pred, want in ((True, a), (False, b)):
        out = jax.jit(mixprec.select_tree)(jnp.bool_(pred), a, b)
        assert jax.tree.map(lambda x, y: bool(x == y), out, want) == {
            "a": True,
            "b": True,
        }


@pytest.mark.parametrize(
    "pred,also",
    [(jnp.ones([1], jnp.bool_), ValueError), (jnp.ones([]), TypeError)],
    ids=["non-scalar", "non-bool"],
)
def test_select_tree_bad_predicate_is_an_assertion_error_too(pred, also):
    # Code written for JMP catches AssertionError; new code catches the clear type.
    for exc in (AssertionError, also):
        with pytest.raises(exc, match="expected boolean scalar `pred`"):
            mixprec.select_tree(pred, None, None)
