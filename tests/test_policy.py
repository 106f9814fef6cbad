"""Policies: parsing, normalisation, casting, the global policy and scopes."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mixprec
from mixprec import Policy, get_policy


F32, F16, BF16, F64 = (
    np.dtype(d) for d in ("float32", "float16", jnp.bfloat16, "float64")
)


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
        ("params=float32,compute=float16,output=float32", (F32, F16, F32)),
        ("c=bf16", (F32, BF16, BF16)),  # params default f32, output follows compute
        ("p=bf16", (BF16, BF16, BF16)),  # compute follows params
        ("p=f32,o=f16", (F32, F32, F16)),
        ("full", (F32, F32, F32)),
        ("f64", (F64, F64, F64)),
        ("bfloat16", (BF16, BF16, BF16)),
        ("mixed_float16", (F32, F16, F32)),
        ("mixed_bfloat16", (F32, BF16, F32)),
        ("float32", (F32, F32, F32)),
        ("float16", (F16, F16, F16)),
        (" P = F32 , C = BF16 ", (F32, BF16, BF16)),
    ],
)
def test_get_policy_grammar(spec, expected):
    policy = get_policy(spec)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == expected
    for field in ("param_dtype", "compute_dtype", "output_dtype"):
        assert isinstance(getattr(policy, field), np.dtype)


def test_half_resolves_to_half_dtype():
    assert get_policy("half") == Policy(*[mixprec.half_dtype()] * 3)
    assert get_policy("c=half").compute_dtype == mixprec.half_dtype()


@pytest.mark.parametrize(
    "spec,match",
    [
        ("p=f33", r"Unknown dtype 'f33'.*Valid names are"),
        ("x=f32", r"Unknown key 'x'.*Valid keys are 'c', 'compute'"),
        ("compte=bf16", r"Did you mean 'compute'"),
        ("mixed_bfloat61", r"Did you mean 'mixed_bfloat16'"),
        ("p=f32,p=bf16", r"param dtype is given twice"),
        ("p=f32=bf16", r"key=dtype"),
        ("int32", r"Unknown dtype 'int32'"),
    ],
)
def test_get_policy_errors_name_the_token(spec, match):
    with pytest.raises(ValueError, match=match):
        get_policy(spec)


def test_get_policy_type_error():
    with pytest.raises(TypeError, match=r"str or a mixprec.Policy"):
        get_policy(3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "dtype",
    [jnp.bfloat16, np.dtype(jnp.bfloat16), "bfloat16", "bf16", jnp.dtype("bfloat16")],
)
def test_policy_normalises_dtypes(dtype):
    a = Policy(jnp.float32, dtype, np.float32)
    b = Policy("float32", "bfloat16", "f32")
    assert a == b and hash(a) == hash(b)
    assert isinstance(a.compute_dtype, np.dtype)
    assert a.compute_dtype == jnp.bfloat16  # compares equal to the jnp type


@pytest.mark.parametrize("bad", [jnp.int32, "int8", np.bool_])
def test_policy_rejects_non_float(bad):
    with pytest.raises(ValueError, match=r"`compute_dtype` to be a floating dtype"):
        Policy(jnp.float32, bad, jnp.float32)


def test_policy_rejects_non_dtype():
    with pytest.raises(TypeError, match=r"`param_dtype` to be a floating dtype"):
        Policy(object(), jnp.float32, jnp.float32)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "policy",
    [
        Policy(np.dtype("float32"), jnp.bfloat16, "f16"),
        get_policy("mixed_bfloat16"),
        get_policy("f64"),
        Policy(jnp.float32, "float8_e4m3fn", jnp.float32),
    ],
)
def test_str_round_trips(policy):
    assert get_policy(str(policy)) == policy


def test_str_of_numpy_dtypes_jmp_bug():
    # JMP's str(Policy(np.dtype(...))) raises KeyError.
    assert str(
        Policy(np.dtype("float32"), np.dtype("float16"), np.dtype("float32"))
    ) == ("p=f32,c=f16,o=f32")


def test_policy_is_frozen_and_hashable():
    policy = get_policy("mixed_float16")
    with pytest.raises(AttributeError):
        policy.compute_dtype = F32  # type: ignore[misc]
    assert {policy: 1}[get_policy("p=f32,c=f16,o=f32")] == 1


def test_with_methods():
    policy = get_policy("float32")
    assert policy.with_param_dtype("bf16").param_dtype == BF16
    assert policy.with_compute_dtype(jnp.float16).compute_dtype == F16
    assert policy.with_output_dtype(np.float16).output_dtype == F16
    assert policy == get_policy("float32")  # unchanged


def _mixed_tree():
    key = jax.random.key(0)
    return {
        "w": jnp.ones((2, 3), jnp.float32),
        "b16": jnp.ones(3, jnp.bfloat16),
        "np": np.ones(2, np.float32),
        "step": jnp.array(3, jnp.int32),
        "mask": jnp.array([True, False]),
        "key": key,
        "raw_key": jax.random.PRNGKey(0),
        "lr": 0.1,
        "n": 2,
        "name": "layer",
        "none": None,
    }


@pytest.mark.parametrize(
    "method,attr",
    [
        ("cast_to_param", "param_dtype"),
        ("cast_to_compute", "compute_dtype"),
        ("cast_to_output", "output_dtype"),
    ],
)
def test_casts_only_floating_arrays(method, attr):
    policy = get_policy("p=bf16,c=f16,o=f32")
    tree = _mixed_tree()
    out = getattr(policy, method)(tree)
    want = getattr(policy, attr)
    assert out["w"].dtype == want and out["b16"].dtype == want
    assert isinstance(out["np"], np.ndarray) and out["np"].dtype == want
    np.testing.assert_array_equal(np.asarray(out["w"], np.float32), 1.0)
    assert out["step"].dtype == jnp.int32
    assert out["mask"].dtype == jnp.bool_
    assert out["key"] is tree["key"] and out["raw_key"] is tree["raw_key"]
    assert out["lr"] == 0.1 and isinstance(out["lr"], float)
    assert out["n"] == 2 and out["name"] == "layer" and out["none"] is None


def test_cast_is_identity_for_same_dtype():
    x = jnp.ones(3)
    assert get_policy("float32").cast_to_compute(x) is x
    jaxpr = jax.make_jaxpr(get_policy("float32").cast_to_compute)(x)
    assert not jaxpr.eqns


def test_cast_under_jit_and_grad():
    policy = get_policy("mixed_bfloat16")

    def loss(w):
        y = policy.cast_to_compute(w) * 2
        assert y.dtype == jnp.bfloat16
        return jnp.sum(policy.cast_to_output(y))

    g = jax.jit(jax.grad(loss))(jnp.ones(3))
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, 2.0)


def test_global_policy_and_scopes():
    assert mixprec.get_global_policy() == get_policy("float32")
    with mixprec.policy_scope("mixed_bfloat16") as outer:
        assert mixprec.get_global_policy() is outer
        with mixprec.policy_scope(get_policy("mixed_float16")):
            assert mixprec.get_global_policy() == get_policy("mixed_float16")
        assert mixprec.get_global_policy() is outer
    assert mixprec.get_global_policy() == get_policy("float32")


def test_scope_restores_on_error():
    with pytest.raises(RuntimeError):
        with mixprec.policy_scope("bf16"):
            raise RuntimeError
    assert mixprec.get_global_policy() == get_policy("float32")


def test_set_global_policy():
    try:
        mixprec.set_global_policy("mixed_float16")
        assert mixprec.get_global_policy() == get_policy("mixed_float16")
        with mixprec.policy_scope("f32"):
            assert mixprec.get_global_policy() == get_policy("f32")
    finally:
        mixprec.set_global_policy("float32")
    with pytest.raises(ValueError, match="Unknown dtype"):
        mixprec.set_global_policy("mixed_float61")


def test_scopes_are_per_thread():
    seen = {}
    barrier = threading.Barrier(2)

    def worker(name, spec):
        with mixprec.policy_scope(spec):
            barrier.wait()  # both threads are inside their scopes now
            seen[name] = mixprec.get_global_policy()
            barrier.wait()

    threads = [
        threading.Thread(target=worker, args=("a", "mixed_bfloat16")),
        threading.Thread(target=worker, args=("b", "mixed_float16")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"a": get_policy("mixed_bfloat16"), "b": get_policy("mixed_float16")}
    assert mixprec.get_global_policy() == get_policy("float32")


def test_global_policy_is_seen_by_other_threads():
    seen = []
    try:
        mixprec.set_global_policy("mixed_bfloat16")
        t = threading.Thread(target=lambda: seen.append(mixprec.get_global_policy()))
        t.start()
        t.join()
    finally:
        mixprec.set_global_policy("float32")
    assert seen == [get_policy("mixed_bfloat16")]


def test_env_var_policy(monkeypatch):
    import importlib

    from mixprec._src import _config

    monkeypatch.setenv("MIXPREC_POLICY", "mixed_bfloat16")
    try:
        importlib.reload(_config)
        assert mixprec.get_global_policy() == get_policy("mixed_bfloat16")
        monkeypatch.setenv("MIXPREC_POLICY", "mixed_bf16x")
        with pytest.raises(ValueError, match="MIXPREC_POLICY"):
            importlib.reload(_config)
    finally:
        mixprec.set_global_policy("float32")


# --- the communication policy ----------------------------------------------------


def test_communication_defaults():
    policy = get_policy("mixed_bfloat16")
    assert policy.gather_dtype is None
    assert policy.resolved_gather_dtype == jnp.bfloat16
    assert policy.reduce_dtype == jnp.float32
    # The default gather dtype follows the compute dtype.
    assert policy.with_compute_dtype("f16").resolved_gather_dtype == jnp.float16
    # JMP's positional constructor still works and gives the defaults.
    assert Policy(jnp.float32, jnp.bfloat16, jnp.float32) == policy


@pytest.mark.parametrize(
    "spec,gather,reduce",
    [
        ("p=f32,c=bf16,o=f32,r=bf16", "bfloat16", "bfloat16"),
        ("p=f32,c=bf16,o=f32,g=f32", "float32", "float32"),
        ("params=f32,compute=f16,gather=f32,reduce=f16", "float32", "float16"),
        ("p=f32,c=bf16,g=bf16", "bfloat16", "float32"),
    ],
)
def test_communication_grammar(spec, gather, reduce):
    policy = get_policy(spec)
    assert policy.resolved_gather_dtype == np.dtype(jnp.dtype(gather))
    assert policy.reduce_dtype == np.dtype(jnp.dtype(reduce))
    assert get_policy(str(policy)) == policy
    assert hash(get_policy(str(policy))) == hash(policy)


def test_communication_equality_and_with_methods():
    base = get_policy("mixed_bfloat16")
    # The compute dtype spelled out as gather dtype is the default.
    assert base.with_gather_dtype("bf16") == base
    assert str(base.with_gather_dtype("bf16")) == str(base)
    wide = base.with_gather_dtype(jnp.float32)
    assert wide != base and wide.gather_dtype == jnp.float32
    assert wide.with_gather_dtype(None) == base
    low = base.with_reduce_dtype("bf16")
    assert low != base and low.reduce_dtype == jnp.bfloat16
    assert low.with_reduce_dtype(np.float32) == base
    assert "reduce_dtype=dtype(bfloat16)" in repr(low)


@pytest.mark.parametrize("bad", ["int32", jnp.int8, "bool", "nonsense"])
def test_reduce_dtype_must_be_a_float(bad):
    with pytest.raises(
        ValueError, match=r"`Policy\(\.\.\., reduce_dtype=\.\.\.\)`.*bfloat16, float16"
    ):
        Policy("f32", "bf16", "f32", reduce_dtype=bad)


@pytest.mark.parametrize(
    "compute,gather,choices",
    [
        ("bf16", "f16", "bfloat16, float32, float64"),
        ("f32", "bf16", "float32, float64"),
        ("f16", "bf16", "float16, float32, float64"),
    ],
)
def test_gather_dtype_may_not_be_narrower(compute, gather, choices):
    with pytest.raises(ValueError, match=r"gather_dtype=\.\.\.\)`") as info:
        Policy("f32", compute, "f32", gather_dtype=gather)
    assert f"Valid choices are {choices} or None" in str(info.value)


def test_bad_communication_in_a_string_names_the_spec():
    with pytest.raises(ValueError, match=r"get_policy\('c=bf16,r=int8'\)"):
        get_policy("c=bf16,r=int8")
    with pytest.raises(ValueError, match=r"get_policy\('c=f32,g=bf16'\).*gather_dtype"):
        get_policy("c=f32,g=bf16")
