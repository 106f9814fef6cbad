"""The op table and the dtype rule: coverage, composites, and ``decide`` as
properties (the rule stated in ``mixprec._src.autocast.decide``)."""

import functools as ft
import importlib.util
import itertools
import pathlib

import hypothesis.strategies as st
import jax
import jax.extend.core.primitives as prims
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import BF16, F16, F32, assert_trees_close, iter_eqns
from hypothesis import given, settings
from jax import lax

import mixprec
from mixprec._src import _compat
from mixprec._src.autocast import ops
from mixprec._src.autocast.decide import Precision, decide, has_float32_range
from mixprec._src.autocast.modes import MODES, effective_low_dtype, validate_mode
from mixprec._src.autocast.ops import OpLists, default_op_lists


F64 = np.dtype(np.float64)
REPO = pathlib.Path(__file__).resolve().parents[1]
HALF = (BF16, F16)
_PROFILE = settings(derandomize=True, database=None, deadline=None, max_examples=200)


def _gen_op_table():
    spec = importlib.util.spec_from_file_location(
        "gen_op_table", REPO / "tools" / "gen_op_table.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------- coverage


# The parts of JAX whose primitives a traced function can contain: the ones a
# user calls, and what they import (AD, sharding, callbacks, control flow).
_JAX_MODULES = (
    "jax.lax",
    "jax.numpy",
    "jax.numpy.fft",
    "jax.nn",
    "jax.random",
    "jax.scipy.special",
    "jax.scipy.linalg",
    "jax.scipy.signal",
    "jax.ad_checkpoint",
    "jax.experimental.shard_map",
    "jax.experimental.custom_partitioning",
    "jax.experimental.compute_on",
    "jax.experimental.multihost_utils",
    "jax.experimental.checkify",
    "jax.experimental.sparse",
    "jax.experimental.layout",
    "jax.experimental.buffer_callback",
    "jax.experimental.pallas",
)


@ft.cache
def _registered() -> dict[str, str]:
    return _compat.registered_primitives(_JAX_MODULES)


def _is_kernel_language(module: str) -> bool:
    return module.startswith(ops.KERNEL_LANGUAGE_MODULES)


def _user_level_primitives() -> list[str]:
    return sorted(
        name
        for name, module in _registered().items()
        if not _is_kernel_language(module) or ops.spec_for(name) is not None
    )


def test_installed_jax_registers_primitives():
    # Guards the coverage test below against iterating an empty set, and
    # checks that the enumeration sees the modules that matter.
    names = set(_user_level_primitives())
    assert len(names) > 250
    assert {"dot_general", "scan", "pjit" if "pjit" in names else "jit"} <= names
    assert {getattr(prims, a).name for a in dir(prims) if a.endswith("_p")} <= set(
        _registered()
    )


@pytest.mark.parametrize("name", _user_level_primitives())
def test_every_primitive_has_one_table_entry_with_a_reason(name):
    spec = ops.spec_for(name)
    assert spec is not None, (
        f"{name} (defined in {_registered()[name]}) is not in the op table"
    )
    assert spec.reason.strip()
    assert spec.flags <= ops.FLAGS


def test_kernel_language_primitives_only_appear_inside_opaque_kernels():
    # Pallas/Mosaic kernel-body primitives have no entries of their own: the
    # calls that hold them are opaque, so autocast never walks a kernel body.
    kernel = [n for n, m in _registered().items() if _is_kernel_language(m)]
    assert kernel, "the enumeration should see Pallas's primitives"
    for call in ("pallas_call", "core_map"):
        spec = ops.spec_for(call)
        assert spec is not None and ops.OPAQUE in spec.flags, call


def test_unknown_primitive_runs_as_written_or_raises_under_strict():
    # The default for a primitive the table does not know.
    from jax.extend.core import Primitive

    twice_p = Primitive("mixprec_test_twice")
    twice_p.def_impl(lambda x: 2 * x)
    twice_p.def_abstract_eval(lambda x: x)

    def f(x, w):
        return twice_p.bind(x @ w)

    x, w = jnp.ones((4, 8)), jnp.ones((8, 8))
    jaxpr = jax.make_jaxpr(mixprec.autocast(f, "mixed_bfloat16"))(x, w)
    ran = [e for e in jaxpr.eqns if e.primitive is twice_p]
    assert [str(e.invars[0].aval.dtype) for e in ran] == ["float32"]
    with pytest.raises(NotImplementedError, match="mixprec_test_twice"):
        mixprec.autocast(f, "mixed_bfloat16", strict=True)(x, w)


def test_table_entries_are_consistent():
    for spec in ops.all_specs():
        if spec.is_higher_order:
            assert not spec.flags and not spec.composite, spec.name
        if spec.composite:
            assert spec.op_class == "deny", spec.name
        if ops.NARROW_RANGE in spec.flags or ops.FLOAT32_ONLY in spec.flags:
            assert spec.op_class == "deny", spec.name
        if ops.OPAQUE in spec.flags:
            assert spec.op_class == "clear", spec.name
        if ops.FUSION in spec.flags:  # its rule runs it fused or as its ops
            assert spec.op_class == "allow" and spec.rule is not None, spec.name
    fusions = {s.name for s in ops.all_specs() if ops.FUSION in s.flags}
    assert fusions == {"dot_product_attention", "rms_norm"}
    assert ops.COMPOSITES == {s.name for s in ops.all_specs() if s.composite}


def test_every_higher_order_primitive_has_a_rule():
    # Its own, or the default one that decides every jaxpr parameter's body.
    own = {"jit", "pjit", "scan", "while", "cond", "custom_jvp_call", "custom_vjp_call"}
    for spec in ops.all_specs():
        if spec.is_higher_order:
            rule = ops.higher_order_rule(spec.name)
            assert callable(rule), spec.name
            if spec.name in own:
                assert rule is spec.rule, spec.name


def _subjaxprs(eqn):
    for value in eqn.params.values():
        values = value if isinstance(value, tuple | list) else [value]
        if hasattr(value, "_fields"):  # custom_linear_solve's NamedTuple
            values = list(value)
        for v in values:
            inner = getattr(v, "jaxpr", v)
            if hasattr(inner, "eqns"):
                yield inner


def test_every_primitive_with_a_jaxpr_parameter_is_higher_order():
    # Higher-order primitives found in real jaxprs, whatever module defines them.
    found = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if any(True for _ in _subjaxprs(eqn)):
                found.add(eqn.primitive.name)
            for sub in _subjaxprs(eqn):
                walk(sub)

    for fn, args in _common_programs().values():
        walk(jax.make_jaxpr(fn)(*args).jaxpr)
    assert {"jit", "scan", "while", "cond", "custom_linear_solve"} <= found
    for name in found:
        assert ops.spec_for(name).is_higher_order, name


def _common_programs():
    x = jnp.linspace(-1.0, 1.0, 64, dtype=jnp.float32).reshape(8, 8)
    a = jnp.eye(8) * 2.0 + 0.1

    @jax.custom_vjp
    def clip_grad(x):
        return x

    clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1.0, 1.0),))

    def solve(a, b):
        return lax.custom_linear_solve(
            lambda v: a @ v, b, lambda mv, r: r / jnp.diag(a), symmetric=True
        )

    def reduce_custom(x):
        return lax.reduce(x @ x, 0.0, lambda u, v: u + jnp.abs(v), (1,))

    def pool(x):
        img = (x @ x).reshape(1, 1, 8, 8)
        return lax.reduce_window(
            img, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID"
        )

    def mlp(x):
        h = jax.nn.gelu(x @ x + 1.0)
        return jax.nn.log_softmax(h).mean() + jax.nn.logsumexp(h) + jnp.var(h)

    return {
        "custom_vjp": (lambda x: clip_grad(x @ x), (x,)),
        "remat": (jax.checkpoint(lambda x: jnp.sin(x @ x) * 2), (x,)),
        "scan": (
            lambda x: lax.scan(lambda c, r: (c + jnp.tanh(r @ x), c), x[0], x)[0],
            (x,),
        ),
        "while": (
            lambda x: lax.while_loop(
                lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] @ x), (0, x)
            )[1],
            (x,),
        ),
        "cond": (lambda x: lax.cond(x.sum() > 0, lambda y: y @ y, jnp.cos, x), (x,)),
        "solve": (solve, (a, x[0])),
        "reduce": (reduce_custom, (x,)),
        "pool": (pool, (x,)),
        "grad_pool": (jax.grad(lambda x: pool(x).sum()), (x,)),
        "mlp": (mlp, (x,)),
        "grad_mlp": (jax.grad(lambda x: mlp(x).sum()), (x,)),
    }


@pytest.mark.parametrize("kind", sorted(_common_programs()))
def test_programs_run_and_their_dots_are_lowered(kind):
    # Every higher-order primitive is entered (by its rule or the default
    # higher-order rule): the dots inside its body run in the low dtype.
    fn, args = _common_programs()[kind]
    g = mixprec.autocast(fn, "mixed_bfloat16")
    names = {e.primitive.name for e in iter_eqns(jax.make_jaxpr(g)(*args))}
    assert all(ops.spec_for(n) is not None for n in names), names
    dots = mixprec.explain(fn, *args, policy="mixed_bfloat16").find("dot_general")
    assert dots and all(op.in_dtypes == ("bfloat16",) * 2 for op in dots), dots
    assert_trees_close(jax.jit(g)(*args), fn(*args), dtype=BF16, grad=True)


def test_custom_linear_solve_bodies_are_lowered():
    a = jnp.eye(4) * 2.0
    b = jnp.ones(4)

    def solve(a, b):
        return lax.custom_linear_solve(
            lambda v: a @ v, b, lambda mv, r: r / jnp.diag(a), symmetric=True
        )

    jaxpr = jax.make_jaxpr(mixprec.autocast(solve, "mixed_bfloat16"))(a, b)
    [eqn] = [e for e in jaxpr.eqns if e.primitive.name == "custom_linear_solve"]
    matvec = eqn.params["jaxprs"].matvec
    assert any(
        str(v.aval.dtype) == "bfloat16" for e in iter_eqns(matvec) for v in e.outvars
    )
    # The equation keeps its traced types at its boundary.
    assert [str(v.aval.dtype) for v in eqn.outvars] == ["float32"]
    np.testing.assert_allclose(mixprec.autocast(solve, "mixed_bfloat16")(a, b), b / 2)


# --------------------------------------------------------------- composites


X = jnp.ones((4, 8), jnp.float32)


@pytest.mark.parametrize(
    "fn, expected",
    [
        (jax.nn.log_softmax, "log_softmax"),
        (jnp.var, "var"),
        (jnp.std, "std"),
        (jnp.linalg.norm, "norm"),
        (jax.nn.softplus, "softplus"),
        (jax.nn.standardize, "standardize"),
    ],
)
def test_composites_are_what_jax_emits(fn, expected):
    top = jax.make_jaxpr(fn)(X).jaxpr.eqns
    found = {
        ops.composite_for_function(e.params.get("jaxpr", e.params.get("call_jaxpr")))
        for e in top
        if e.primitive.name in ("jit", "custom_jvp_call")
    }
    assert expected in found


@pytest.mark.parametrize("name", ["norm", "_var", "log_softmax", "softplus", "mean"])
def test_user_functions_named_like_composites_are_not_composites(name):
    def body(x):
        return x * 2.0

    body.__name__ = body.__qualname__ = name
    eqn = jax.make_jaxpr(jax.jit(body))(X).eqns[0]
    assert eqn.params["name"] == name
    assert ops.composite_for_function(eqn.params["jaxpr"]) is None


@pytest.mark.parametrize(
    "fn", [jax.nn.softmax, jax.nn.logsumexp, jax.scipy.special.logsumexp, jnp.mean]
)
def test_inlined_functions_run_float32_by_primitive(fn):
    # Not wrapped in a named jit on JAX 0.10.2: no composite, but their exp /
    # reduce_sum / log are denied one by one, so the statistics are float32.
    report = mixprec.explain(lambda x: fn(x @ x.T), X, policy="mixed_bfloat16")
    denied = [op for op in report.ops if op.primitive in ("exp", "reduce_sum", "log")]
    assert denied and all(op.out_dtypes == ("float32",) for op in denied)


def test_flax_layers_named_like_composites_run_their_matmuls_low():
    nn = pytest.importorskip("flax.linen")

    class VAEHead(nn.Module):
        @nn.compact
        def __call__(self, x):
            names = ["mean", "std", "variance", "norm", "softmax", "log_softmax"]
            return sum(nn.Dense(8, name=n)(x) for n in names)

    model = VAEHead()
    params = model.init(jax.random.key(0), X)
    report = mixprec.explain(model.apply, params, X, policy="mixed_bfloat16")
    dots = report.find("dot_general")
    assert len(dots) == 6 and all(op.decision == "low" for op in dots), dots


def test_haiku_linear_named_softmax_runs_low():
    hk = pytest.importorskip("haiku")
    f = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(8, name="softmax")(x)))
    params = f.init(jax.random.key(0), X)
    report = mixprec.explain(f.apply, params, X, policy="mixed_float16")
    assert [op.decision for op in report.find("dot_general")] == ["low"]


# ------------------------------------------------------------ OpLists class


@pytest.mark.parametrize(
    "name, expected",
    [
        ("dot_general", "allow"),
        ("conv_general_dilated", "allow"),
        *[
            (n, "deny")
            for n in [
                "exp",
                "expm1",
                "log",
                "log1p",
                "pow",
                "rsqrt",
                "reduce_sum",
                "reduce_prod",
                "cumsum",
                "cumlogsumexp",
                "erf_inv",
                "square",
                "integer_pow",
                "reciprocal",
            ]
        ],
        *[
            (n, "infer")
            for n in ["add", "sub", "mul", "div", "max", "tanh", "logistic", "sqrt"]
        ],
        ("select_n", "infer"),
        *[
            (n, "clear")
            for n in [
                "reshape",
                "transpose",
                "broadcast_in_dim",
                "slice",
                "gather",
                "concatenate",
                "eq",
                "lt",
                "reduce_max",
                "and",
                "random_bits",
                "sharding_constraint",
                "convert_element_type",
            ]
        ],
        *[(c, "deny") for c in ["log_softmax", "var", "std", "norm", "softplus"]],
    ],
)
def test_default_classes(name, expected):
    assert default_op_lists().classify(name) == expected


def test_classify_higher_order_unknown_and_strict():
    lists = default_op_lists()
    assert lists.classify("scan") == "clear"
    assert lists.classify("my_custom_prim") == "infer"
    with pytest.raises(NotImplementedError, match="'my_custom_prim'"):
        lists.classify("my_custom_prim", strict=True)
    with pytest.raises(NotImplementedError, match="Did you mean 'dot_general'"):
        lists.classify("dot_generl", strict=True)


# ---------------------------------------------------------------- modes


def test_modes_are_ascends_seven():
    assert set(MODES) == {
        "must_keep_origin_dtype",
        "force_fp32",
        "allow_fp32_to_fp16",
        "allow_fp32_to_bf16",
        "force_fp16",
        "allow_mix_precision",
        "allow_mix_precision_bf16",
    }


def test_validate_mode():
    for mode in MODES:
        assert validate_mode(mode) == mode
    with pytest.raises(ValueError, match="Did you mean 'allow_mix_precision'"):
        validate_mode("allow_mixed_precision")
    with pytest.raises(TypeError, match="`mode` must be a string"):
        validate_mode(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "mode, low, expected",
    [
        ("allow_mix_precision", BF16, BF16),
        ("allow_mix_precision", F16, F16),
        ("allow_mix_precision_bf16", F16, BF16),
        ("allow_fp32_to_fp16", BF16, F16),
        ("allow_fp32_to_bf16", F16, BF16),
        ("force_fp16", BF16, F16),
        ("force_fp32", BF16, BF16),
    ],
)
def test_effective_low_dtype(mode, low, expected):
    assert effective_low_dtype(mode, low) == expected


# ------------------------------------------------------------ the dtype rule


def _d(name, dtypes, mode="allow_mix_precision", low=BF16, follows=(), **kw):
    spec = ops.spec_for(name)
    operands = tuple(
        (None if d is None else np.dtype(d), bool(f))
        for d, f in itertools.zip_longest(dtypes, follows, fillvalue=False)
    )
    return decide(
        name,
        operands,
        op_class=default_op_lists().classify(name),
        mode=mode,
        low=effective_low_dtype(mode, low),
        flags=spec.flags if spec is not None else frozenset(),
        **kw,
    )


N = None
# What the floating operands are cast to, per mode (low dtype bfloat16 for the
# policy-driven modes). Columns: must_keep, force_fp32, to_fp16, to_bf16,
# force_fp16, mix, mix_bf16. N: left as they are.
_MODE_TABLE = [
    ("dot_general", (F32, F32), (N, F32, F16, BF16, F16, BF16, BF16)),
    ("dot_general", (BF16, BF16), (N, F32, N, BF16, F16, BF16, BF16)),
    ("exp", (F32,), (N, F32, F32, F32, F16, F32, F32)),
    ("exp", (BF16,), (N, F32, N, F32, F16, F32, F32)),
    ("add", (F32, F32), (N, F32, F32, F32, F16, F32, F32)),
    ("add", (BF16, BF16), (N, F32, N, F32, F16, BF16, BF16)),
    # A float32 operand of the result's shape: never rounded.
    ("add", (BF16, F32), (N, F32, N, F32, F16, F32, F32)),
    ("tanh", (BF16,), (N, F32, N, F32, F16, BF16, BF16)),
    ("reshape", (BF16,), (N, N, N, N, N, N, N)),  # clear: as received
    ("fft", (F32,), (N, F32, F32, F32, F32, F32, F32)),
    ("cholesky", (BF16,), (N, F32, N, F32, F32, F32, F32)),
    ("add", (np.int32, np.int32), (N, N, N, N, N, N, N)),
    ("dot_general", (F64, F64), (N, N, N, N, N, N, N)),
    ("exp", (F64,), (N, N, N, N, N, N, N)),
]


@pytest.mark.parametrize("name, dtypes, expected", _MODE_TABLE)
def test_decide_mode_table(name, dtypes, expected):
    dts = [None if np.dtype(d).kind == "i" else d for d in dtypes]
    got = tuple(_d(name, dts, mode).dtype for mode in MODES)
    assert got == expected, dict(zip(MODES, got, strict=True))


def test_bias_scalar_and_scale_follow_the_half_operand():
    # bf16 activation + float32 bias broadcast into it: stays bf16.
    d = _d("add", [BF16, F32], follows=[False, True])
    assert (d.precision, d.dtype) == (Precision.LOW, BF16)
    # relu: max(bf16 activation, 0.0 literal).
    assert _d("max", [BF16, F32], follows=[0, 1]).dtype == BF16
    # Two float32 operands: nothing to follow.
    assert _d("mul", [F32, F32], follows=[0, 1]).dtype == F32
    # A float32 master weight minus a bf16 update: float32.
    assert _d("sub", [F32, BF16]).dtype == F32


def test_narrow_range_ops_are_denied_only_under_float16():
    for name in ("square", "integer_pow", "reciprocal"):
        assert _d(name, [F16], low=F16).precision is Precision.FLOAT32
        assert _d(name, [BF16], low=BF16).dtype == BF16
        assert _d(name, [F32], low=BF16).dtype == F32
    assert has_float32_range(BF16) and not has_float32_range(F16)


def test_high_precision_dots_stay_float32_and_backward_keeps_the_traced_dtype():
    d = _d("dot_general", [F32, F32], high_precision=True)
    assert (d.precision, d.dtype) == (Precision.FLOAT32, F32)
    assert "HIGHEST" in d.reason
    d = _d("dot_general", [F32, F32], backward=True, traced_out=F32)
    assert (d.precision, d.dtype, d.out_dtype) == (Precision.LOW, BF16, F32)
    assert _d("dot_general", [F32, F32]).out_dtype == BF16


def test_backward_gemm_of_an_activation_gradient_stays_in_the_low_dtype():
    for low in (BF16, F16):
        d = _d("dot_general", [F32, F32], low=low, backward=True, traced_out=F32,
               low_cotangent=True)  # fmt: skip
        assert (d.precision, d.dtype, d.out_dtype) == (Precision.LOW, low, low)
        assert "activation" in d.reason
        # Only in a backward pass, and never for a high-precision dot.
        fwd = _d("dot_general", [F32, F32], low=low, low_cotangent=True)
        assert fwd == _d("dot_general", [F32, F32], low=low)
        high = _d("dot_general", [F32, F32], low=low, backward=True,
                  traced_out=F32, low_cotangent=True, high_precision=True)  # fmt: skip
        assert (high.precision, high.out_dtype) == (Precision.FLOAT32, None)


def test_other_half_type_and_float8_run_as_written():
    assert _d("dot_general", [BF16, BF16], low=F16).precision is Precision.ORIGINAL
    f8 = np.dtype(jnp.float8_e4m3fn)
    assert _d("dot_general", [f8, f8]).precision is Precision.ORIGINAL


_FLOATS = st.sampled_from([F32, BF16, F16, F64, None])
_OPERANDS = st.lists(st.tuples(_FLOATS, st.booleans()), min_size=1, max_size=3)
_MIX_MODES = st.sampled_from(["allow_mix_precision", "allow_mix_precision_bf16"])


def _anchors(operands):
    floats = [(d, f) for d, f in operands if d is not None]
    return [d for d, f in floats if not f] or [d for d, _ in floats]


@_PROFILE
@given(
    name=st.sampled_from(["add", "sub", "mul", "max", "tanh", "select_n", "div"]),
    operands=_OPERANDS,
    mode=_MIX_MODES,
    low=st.sampled_from(HALF),
)
def test_gray_ops_never_round_a_float32_anchor(name, operands, mode, low):
    d = _d(
        name,
        [o[0] for o in operands],
        mode=mode,
        low=low,
        follows=[o[1] for o in operands],
    )
    low = effective_low_dtype(mode, low)
    floats = {o[0] for o in operands if o[0] is not None}
    if not floats:
        assert d.precision is Precision.RECEIVED and d.dtype is None
        return
    if not floats <= {F32, low}:
        assert d.precision is Precision.ORIGINAL  # float64 or the other 16-bit
        return
    anchors = _anchors([o for o in operands if o[0] is not None])
    if F32 in anchors:
        assert (d.precision, d.dtype) == (Precision.FLOAT32, F32), d
    else:
        assert (d.precision, d.dtype) == (Precision.LOW, low), d


@_PROFILE
@given(operands=_OPERANDS, mode=_MIX_MODES, low=st.sampled_from(HALF))
def test_deny_ops_run_in_float32(operands, mode, low):
    d = _d("exp", [o[0] for o in operands], mode=mode, low=low)
    floats = {o[0] for o in operands if o[0] is not None}
    if floats and floats <= {F32, effective_low_dtype(mode, low)}:
        assert (d.precision, d.dtype, d.op_class) == (Precision.FLOAT32, F32, "deny")


@_PROFILE
@given(
    operands=st.lists(st.sampled_from([F32, BF16, F16]), min_size=2, max_size=2),
    low=st.sampled_from(HALF),
    backward=st.booleans(),
)
def test_allow_ops_round_to_low_and_accumulate_in_float32(operands, low, backward):
    d = _d("dot_general", operands, low=low, backward=backward, traced_out=F32)
    if not set(operands) <= {F32, low}:
        assert d.precision is Precision.ORIGINAL
        return
    assert (d.precision, d.dtype) == (Precision.LOW, low)
    assert d.out_dtype == (F32 if backward else low)


@pytest.mark.parametrize("mode", MODES)
def test_decide_is_hashable_and_ignores_prng_keys(mode):
    a = _d("add", [BF16, F32], mode, follows=[False, True])
    b = _d("add", (BF16, F32), mode, follows=(False, True))
    assert a == b and hash(a) == hash(b) and a.reason
    d = _d("random_bits", [None], mode)
    assert d.dtype is None and d.op_class == "clear"


def test_oplists_type_errors():
    with pytest.raises(TypeError, match=r"`OpLists\(allow=...\)`"):
        OpLists(allow="exp")  # type: ignore[arg-type]


# -------------------------------------------------------------- docs table


def test_committed_op_table_is_up_to_date():
    committed = (REPO / "docs" / "op_table.md").read_text()
    assert committed == _gen_op_table().render_op_table(), (
        "docs/op_table.md is stale; run `python tools/gen_op_table.py`."
    )


def test_op_table_lists_every_op_and_mode():
    table = _gen_op_table().render_op_table()
    for spec in ops.all_specs():
        assert f"| `{spec.name}`" in table, spec.name
    for mode in MODES:
        assert f"| `{mode}` |" in table


def test_op_table_check_cli(tmp_path):
    gen = _gen_op_table()
    out = tmp_path / "op_table.md"
    assert gen.main(["--output", str(out), "--check"]) == 1
    assert gen.main(["--output", str(out)]) == 0
    assert gen.main(["--output", str(out), "--check"]) == 0
    out.write_text(out.read_text() + "edited\n")
    assert gen.main(["--output", str(out), "--check"]) == 1


def test_every_fusion_entry_is_complete():
    """Each registered fusion is one complete entry: a folder with its pattern,
    rule and entry; its primitive in the op table (allow, flag fusion) with the
    entry's reason and rule; its passes run by the pass list; every field
    callable."""
    from mixprec._src.autocast import fusions

    root = REPO / "mixprec" / "_src" / "autocast" / "fusions"
    entries = fusions.registered()
    assert [e.name for e in entries] == ["dot_product_attention", "rms_norm"]
    assert len(fusions.REGISTERED) == len(entries)
    for folder, entry in zip(fusions.REGISTERED, entries, strict=True):
        assert isinstance(entry, fusions.Fusion)
        for name in ("__init__.py", "pattern.py", "rule.py", "entry.py"):
            assert (root / folder / name).is_file(), (folder, name)
        spec = ops.spec_for(entry.name)
        assert spec is not None, entry.name
        assert spec.op_class == "allow" and ops.FUSION in spec.flags
        assert spec.reason == entry.reason and entry.reason
        assert spec.rule is entry.rule
        assert entry.passes and all(p in fusions.passes() for p in entry.passes)
        for fn in (entry.rule, entry.flops, entry.decided_by, entry.fused_reason):
            assert callable(fn)
        assert entry.unfused_notes(jax.make_jaxpr(jnp.sin)(1.0).jaxpr, (), ()) == []
        assert fusions.entry_for(entry.name) is entry
    # No other primitive carries the fusion flag.
    flagged = {s.name for s in ops.all_specs() if ops.FUSION in s.flags}
    assert flagged == {e.name for e in entries}
