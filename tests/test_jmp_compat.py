"""`import mixprec as jmp` keeps JMP code working.

Where JMP behaves correctly, mixprec must behave the same (checked against the
real `jmp` package, which dm-haiku depends on). Where JMP has a known bug, the
test pins mixprec's fixed behaviour and says what JMP does.
"""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import iter_eqns

import mixprec


jmp_real = pytest.importorskip("jmp")
# JMP's own code relies on implicit promotion (bool * int32, float32 * float16).
pytestmark = pytest.mark.standard_promotion

JMP_NAMES = [
    "Policy",
    "get_policy",
    "half_dtype",
    "cast_to_full",
    "cast_to_half",
    "LossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "DynamicLossScale",
    "all_finite",
    "select_tree",
]


def test_same_public_names():
    assert set(JMP_NAMES) <= set(dir(mixprec))
    assert {n for n in dir(jmp_real) if not n.startswith("_")} == set(JMP_NAMES)


@pytest.mark.parametrize(
    "spec",
    [
        "full",
        "half",
        "f32",
        "bf16",
        "float16",
        "bfloat16",
        "f64",
        "p=f32,c=bf16,o=f32",
        "params=float32,compute=float16,output=float32",
        "c=bf16",
        "p=f16",
        "p=f32,o=bf16",
        "compute=half",
    ],
)
def test_get_policy_matches_jmp(spec):
    ours, theirs = mixprec.get_policy(spec), jmp_real.get_policy(spec)
    for field in ("param_dtype", "compute_dtype", "output_dtype"):
        assert getattr(ours, field) == jnp.dtype(getattr(theirs, field))


@pytest.mark.parametrize("spec", ["p=f33", "x=f32", "nope"])
def test_get_policy_errors_match_jmp_type(spec):
    with pytest.raises(ValueError):
        jmp_real.get_policy(spec)
    with pytest.raises(ValueError):
        mixprec.get_policy(spec)


def test_policy_fields_compare_like_jmp():
    policy = mixprec.Policy(
        param_dtype=jnp.float32, compute_dtype=jnp.float16, output_dtype=jnp.float32
    )
    assert policy.compute_dtype == jnp.float16 and policy.param_dtype == jnp.float32
    assert policy.with_output_dtype(jnp.float16).output_dtype == jnp.float16


def test_casting_matches_jmp():
    tree = {"w": jnp.ones(3), "i": jnp.arange(3), "h": jnp.ones(2, jnp.float16)}
    policy, theirs = (
        mixprec.get_policy("p=f32,c=bf16,o=f16"),
        jmp_real.get_policy("p=f32,c=bf16,o=f16"),
    )
    for method in ("cast_to_param", "cast_to_compute", "cast_to_output"):
        a, b = getattr(policy, method)(tree), getattr(theirs, method)(tree)
        assert jax.tree.map(lambda x: x.dtype, a) == jax.tree.map(lambda x: x.dtype, b)
    for fn in ("cast_to_full", "cast_to_half"):
        a, b = getattr(mixprec, fn)(tree), getattr(jmp_real, fn)(tree)
        assert jax.tree.map(lambda x: x.dtype, a) == jax.tree.map(lambda x: x.dtype, b)
    assert mixprec.half_dtype() == jnp.dtype(jmp_real.half_dtype())


def test_dynamic_loss_scale_trajectory_matches_jmp():
    rng = np.random.default_rng(1)
    flags = rng.random(400) > 0.1
    ours = mixprec.DynamicLossScale(jnp.float32(2**15), period=5)
    theirs = jmp_real.DynamicLossScale(jnp.float32(2**15), period=5)
    assert len(jax.tree.leaves(ours)) == len(jax.tree.leaves(theirs)) == 2
    for finite in flags:
        ours, theirs = ours.adjust(jnp.array(finite)), theirs.adjust(jnp.array(finite))
        assert float(ours.loss_scale) == float(theirs.loss_scale)
        assert int(ours.counter) == int(theirs.counter)
    grads = {"w": jnp.array([3.0, -1.5])}
    np.testing.assert_array_equal(ours.scale(grads)["w"], theirs.scale(grads)["w"])
    np.testing.assert_array_equal(ours.unscale(grads)["w"], theirs.unscale(grads)["w"])


def test_dynamic_loss_scale_positional_signature_like_jmp():
    ls = mixprec.DynamicLossScale(jnp.float32(4.0), jnp.int32(1), 3, 4, 0.5)
    assert (int(ls.counter), ls.period, ls.factor, ls.min_loss_scale) == (1, 3, 4, 0.5)


def test_all_finite_and_select_tree_match_jmp():
    trees = [
        {"a": jnp.ones(2)},
        {"a": jnp.array([1.0, jnp.nan])},
        {"a": jnp.ones(2), "b": jnp.array([jnp.inf])},
        [],
    ]
    for tree in trees:
        assert bool(mixprec.all_finite(tree)) == bool(jmp_real.all_finite(tree))
    a, b = {"x": jnp.ones(2)}, {"x": jnp.zeros(2)}
    for pred in (True, False):
        np.testing.assert_array_equal(
            mixprec.select_tree(jnp.array(pred), a, b)["x"],
            jmp_real.select_tree(jnp.array(pred), a, b)["x"],
        )


def test_str_names_agree_with_jmp():
    # `dtype_to_names` is not in JMP's top-level namespace; its tests import it
    # from `jmp._src.policy`.
    jmp_names = importlib.import_module("jmp._src.policy").dtype_to_names
    for dtype in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64):
        assert set(mixprec.dtype_to_names[dtype]) == set(jmp_names[dtype])
        policy = mixprec.Policy(dtype, dtype, dtype)
        # JMP parses mixprec's strings and the reverse.
        assert jnp.dtype(jmp_real.get_policy(str(policy)).compute_dtype) == dtype
        theirs = str(jmp_real.Policy(dtype, dtype, dtype))
        assert mixprec.get_policy(theirs) == policy


def test_static_loss_scale_leaves_like_jmp():
    for scale in (0, 2.0, jnp.float32(4.0)):
        ours, theirs = mixprec.StaticLossScale(scale), jmp_real.StaticLossScale(scale)
        assert jax.tree.leaves(ours) == jax.tree.leaves(theirs) == []
        x = jnp.array([1.5, -2.0])
        np.testing.assert_array_equal(ours.scale(x), theirs.scale(x))


def test_errors_jmp_code_catches():
    for lib in (jmp_real, mixprec):
        with pytest.raises(AssertionError, match="expected boolean scalar"):
            lib.select_tree(jnp.ones([2], jnp.bool_), None, None)
        with pytest.raises(AssertionError, match="expected boolean scalar"):
            lib.select_tree(jnp.ones([]), None, None)
        with pytest.raises(ValueError, match="Unknown dtype"):
            lib.get_policy("compute_float16")
        for argname in ("loss_scale", "min_loss_scale"):
            with pytest.warns(UserWarning, match=f"floating type for {argname}"):
                lib.DynamicLossScale(
                    **{"loss_scale": jnp.float32(2.0), argname: jnp.int32(1)}
                )


def test_integral_float_period_and_zero_floor_like_jmp():
    init, flags = jnp.float32(10), [True] * 7 + [False] * 3 + [True] * 5
    ours = mixprec.DynamicLossScale(init, jnp.int32(0), 5.0, 2.0, jnp.asarray(0.0))
    theirs = jmp_real.DynamicLossScale(init, jnp.int32(0), 5.0, 2.0, jnp.asarray(0.0))
    for finite in flags:
        ours, theirs = ours.adjust(jnp.array(finite)), theirs.adjust(jnp.array(finite))
        assert float(ours.loss_scale) == float(theirs.loss_scale)
        assert int(ours.counter) == int(theirs.counter)


# ---- JMP's bugs, fixed -------------------------------------------------------


def test_fixed_min_loss_scale_survives_tree_map():
    theirs = jax.tree.map(
        lambda x: x,
        jmp_real.DynamicLossScale(jnp.float32(2.0), min_loss_scale=jnp.float32(0.5)),
    )
    assert float(theirs.min_loss_scale) == 1.0  # JMP's bug
    ours = jax.tree.map(lambda x: x, mixprec.DynamicLossScale(2.0, min_loss_scale=0.5))
    assert ours.min_loss_scale == 0.5


def test_fixed_str_of_numpy_dtype_policy():
    with pytest.raises(KeyError):
        str(
            jmp_real.Policy(
                np.dtype("float32"), np.dtype("float16"), np.dtype("float32")
            )
        )
    assert str(
        mixprec.Policy(np.dtype("float32"), np.dtype("float16"), np.dtype("float32"))
    )


def test_fixed_float16_loss_scale_adjust():
    with pytest.raises(TypeError):
        jmp_real.DynamicLossScale(jnp.float16(2.0)).adjust(jnp.array(False))
    ours = mixprec.DynamicLossScale(jnp.float16(2.0)).adjust(jnp.array(False))
    assert float(ours.loss_scale) == 1.0


def test_fixed_scaling_keeps_float16_grads_float16():
    g = jnp.ones(2, jnp.float16)
    assert jmp_real.StaticLossScale(jnp.float32(4.0)).scale(g).dtype == jnp.float32
    assert mixprec.StaticLossScale(jnp.float32(4.0)).scale(g).dtype == jnp.float16


# ---- dm-haiku's mixed precision with a mixprec policy -----------------------


def test_haiku_set_policy_with_mixprec_policy():
    hk = pytest.importorskip("haiku")

    class Net(hk.Module):
        def __call__(self, x):
            h = hk.Linear(16)(x)
            assert h.dtype == jnp.float32  # the policy's output dtype
            return hk.Linear(4)(jax.nn.relu(h))

    policy = mixprec.get_policy("p=f32,c=bf16,o=f32")
    hk.mixed_precision.set_policy(hk.Linear, policy)
    hk.mixed_precision.set_policy(Net, policy)
    try:
        net = hk.without_apply_rng(hk.transform(lambda x: Net()(x)))
        x = jnp.linspace(-1, 1, 24, dtype=jnp.float32).reshape(3, 8)
        params = net.init(jax.random.key(0), x)
        assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
        out = jax.jit(net.apply)(params, x)
        assert out.dtype == jnp.float32
        # Inside, both matmuls ran on bfloat16 inputs and parameters.
        jaxpr = jax.make_jaxpr(net.apply)(params, x)
        dots = [e for e in iter_eqns(jaxpr) if e.primitive.name == "dot_general"]
        assert len(dots) == 2
        for eqn in dots:
            assert [v.aval.dtype for v in eqn.invars] == [jnp.bfloat16] * 2
        grads = jax.grad(lambda p: jnp.sum(net.apply(p, x)))(params)
        assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))

        (w1, b1), (w2, b2) = [(params[k]["w"], params[k]["b"]) for k in sorted(params)]
        ref = jax.nn.relu(x @ w1 + b1[None]) @ w2 + b2[None]
        np.testing.assert_allclose(out, ref, rtol=5e-2, atol=5e-2)
    finally:
        hk.mixed_precision.clear_policy(hk.Linear)
        hk.mixed_precision.clear_policy(Net)
