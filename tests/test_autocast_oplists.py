"""Tests for the autocast op lists, precision modes and modify_mixlist (seed 003).

Pure Python plus `jax.make_jaxpr` (tracing only, no compilation).
"""

import dataclasses
import json
import pathlib

import jax
import jax.extend.core.primitives as prims
import jax.numpy as jnp
import numpy as np
import pytest

from mixprec._src.autocast import mixlist as mixlist_lib, modes, op_lists
from mixprec._src.autocast.mixlist import modify_mixlist
from mixprec._src.autocast.modes import MODES, Decision, decide, validate_mode
from mixprec._src.autocast.op_lists import (
    ALLOW,
    CLEAR,
    COMPOSITES,
    DENY,
    FULL_PRECISION_ONLY,
    HIGHER_ORDER,
    INFER,
    KNOWN_NAMES,
    OPAQUE,
    REASONS,
    OpLists,
    composite_for,
    default_op_lists,
)


F32 = np.dtype(np.float32)
F16 = np.dtype(np.float16)
BF16 = np.dtype(jnp.bfloat16)
F64 = np.dtype(np.float64)
I32 = np.dtype(np.int32)
BOOL = np.dtype(bool)
REPO = pathlib.Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------- coverage


def _module_primitive_names() -> set[str]:
    names = set()
    for attr in dir(prims):
        if attr.endswith("_p"):
            names.add(getattr(prims, attr).name)
    return names


def test_module_has_primitives():
    # Guards the coverage test below against iterating an empty module.
    assert len(_module_primitive_names()) > 150


@pytest.mark.parametrize("name", sorted(_module_primitive_names()))
def test_every_primitive_is_classified_once(name):
    memberships = [
        cls
        for cls, members in [
            ("allow", ALLOW),
            ("deny", DENY),
            ("infer", INFER),
            ("clear", CLEAR),
            ("higher-order", HIGHER_ORDER),
        ]
        if name in members
    ]
    assert len(memberships) == 1, (name, memberships)
    assert REASONS[name]


def test_lists_are_disjoint_and_reasoned():
    groups = [ALLOW, DENY, INFER, CLEAR, HIGHER_ORDER]
    for i, a in enumerate(groups):
        for b in groups[i + 1 :]:
            assert not a & b
    assert set(REASONS) == set(KNOWN_NAMES)
    assert all(REASONS[n].strip() for n in KNOWN_NAMES)
    assert COMPOSITES <= DENY
    assert FULL_PRECISION_ONLY <= DENY
    assert OPAQUE <= CLEAR


@pytest.mark.parametrize(
    "name, expected",
    [
        # DESIGN.md starting classes.
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
                "shift_left",
                "random_bits",
                "threefry2x32",
                "sharding_constraint",
                "convert_element_type",
            ]
        ],
        *[(c, "deny") for c in ["softmax", "log_softmax", "logsumexp", "layer_norm"]],
        ("rms_norm", "deny"),
        ("cross_entropy", "deny"),
        ("var", "deny"),
        ("std", "deny"),
        ("mean", "deny"),
    ],
)
def test_default_classes(name, expected):
    assert default_op_lists().classify(name) == expected


def _walk_names(jaxpr, out: set[str]) -> None:
    for eqn in jaxpr.eqns:
        out.add(eqn.primitive.name)
        for sub in _subjaxprs(eqn):
            _walk_names(sub, out)


def _subjaxprs(eqn):
    for value in eqn.params.values():
        values = value if isinstance(value, tuple | list) else [value]
        for v in values:
            inner = getattr(v, "jaxpr", v)
            if hasattr(inner, "eqns"):
                yield inner


def _common_jaxpr_functions():
    @jax.custom_vjp
    def clip_grad(x):
        return x

    clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1.0, 1.0),))

    @jax.custom_jvp
    def safe_norm(x):
        return jnp.sqrt(jnp.sum(x * x))

    @safe_norm.defjvp
    def _(primals, tangents):
        (x,), (t,) = primals, tangents
        n = safe_norm(x)
        return n, jnp.sum(x * t) / jnp.maximum(n, 1e-6)

    def scan_fn(x):
        return jax.lax.scan(lambda c, xi: (c + jnp.tanh(xi), c), x[0], x)[0]

    def while_fn(x):
        return jax.lax.while_loop(
            lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2), (0, x)
        )

    def cond_fn(x):
        return jax.lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x)

    mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = jax.sharding.PartitionSpec("d")

    def shard_fn(x):
        f = jax.shard_map(
            lambda a: jax.lax.psum(a, "d"), mesh=mesh, in_specs=spec, out_specs=spec
        )
        return f(x)

    def constraint_fn(x):
        return jax.lax.with_sharding_constraint(
            x, jax.sharding.NamedSharding(mesh, spec)
        )

    def random_fn(x):
        key = jax.random.key(0)
        return (
            x
            + jax.random.normal(key, x.shape)
            + jax.random.uniform(jax.random.fold_in(key, 1), x.shape)
        )

    def mlp(x):
        w = jnp.ones((8, 8))
        h = jax.nn.gelu(x @ w + 1.0)
        h = jax.nn.relu(h) + jax.nn.silu(h)
        return jax.nn.log_softmax(h).mean() + jax.nn.logsumexp(h) + jnp.var(h)

    def conv(x):
        img = x.reshape(1, 1, 8, 8)
        y = jax.lax.conv_general_dilated(img, jnp.ones((2, 1, 3, 3)), (1, 1), "SAME")
        return jax.lax.reduce_window(
            y, -jnp.inf, jax.lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID"
        )

    return {
        "custom_vjp": clip_grad,
        "custom_jvp": safe_norm,
        "remat": jax.checkpoint(lambda x: jnp.sin(x) * 2),
        "jit": jax.jit(lambda x: x * 2),
        "scan": scan_fn,
        "while": while_fn,
        "cond": cond_fn,
        "shard_map": shard_fn,
        "sharding_constraint": constraint_fn,
        "random": random_fn,
        "mlp": mlp,
        "conv": conv,
        "grad_mlp": jax.grad(lambda x: mlp(x).sum()),
    }


@pytest.mark.parametrize("kind", sorted(_common_jaxpr_functions()))
def test_primitives_in_common_jaxprs_are_known(kind):
    fn = _common_jaxpr_functions()[kind]
    closed = jax.make_jaxpr(fn)(jnp.ones((8, 8), jnp.float32))
    names: set[str] = set()
    _walk_names(closed.jaxpr, names)
    assert names, kind
    assert names <= KNOWN_NAMES, names - KNOWN_NAMES


@pytest.mark.parametrize(
    "kind, hop",
    [
        ("custom_vjp", "custom_vjp_call"),
        ("custom_jvp", "custom_jvp_call"),
        ("remat", "remat2"),
        ("jit", "jit"),
        ("scan", "scan"),
        ("while", "while"),
        ("cond", "cond"),
        ("shard_map", "shard_map"),
    ],
)
def test_higher_order_names_match_jax(kind, hop):
    fn = _common_jaxpr_functions()[kind]
    closed = jax.make_jaxpr(fn)(jnp.ones((8, 8), jnp.float32))
    top = {e.primitive.name for e in closed.jaxpr.eqns}
    assert hop in top
    assert hop in HIGHER_ORDER
    assert default_op_lists().classify(hop) == "clear"


# ----------------------------------------------------------------- OpLists


def test_oplists_rejects_overlap_and_bad_types():
    with pytest.raises(ValueError, match="both `allow` and `deny`"):
        OpLists(allow={"exp"}, deny={"exp"})
    with pytest.raises(TypeError, match=r"`OpLists\(allow=...\)`"):
        OpLists(allow="exp")  # type: ignore[arg-type]


def test_oplists_is_frozen_hashable_and_normalises_to_frozensets():
    lists = OpLists(allow=["dot_general"], deny=("exp",))
    assert isinstance(lists.allow, frozenset) and isinstance(lists.deny, frozenset)
    assert hash(lists) == hash(OpLists(allow={"dot_general"}, deny={"exp"}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        lists.allow = frozenset()  # type: ignore[misc]


def test_classify_unknown_and_strict():
    lists = default_op_lists()
    assert lists.classify("my_custom_prim") == "infer"
    with pytest.raises(NotImplementedError, match="'my_custom_prim'"):
        lists.classify("my_custom_prim", strict=True)
    with pytest.raises(NotImplementedError, match="Did you mean 'dot_general'"):
        lists.classify("dot_generl", strict=True)
    assert lists.classify("scan", strict=True) == "clear"


def test_default_lists_match_constants():
    lists = default_op_lists()
    assert (lists.allow, lists.deny, lists.infer, lists.clear) == (
        ALLOW,
        DENY,
        INFER,
        CLEAR,
    )
    assert lists.as_dict()["allow"] == sorted(ALLOW)


# -------------------------------------------------------------- composites


@pytest.mark.parametrize(
    "name, expected",
    [
        ("_var", "var"),
        ("_std", "std"),
        ("log_softmax", "log_softmax"),
        ("softmax", "softmax"),
        ("_softmax", "softmax"),
        ("logsumexp", "logsumexp"),
        ("norm", "norm"),
        ("softplus", "softplus"),
        ("log_sigmoid", "log_sigmoid"),
        ("LayerNorm_0", "layer_norm"),
        ("Model/Block_1/LayerNorm_12", "layer_norm"),
        ("Model/RMSNorm_0", "rms_norm"),
        ("vmap(eqx.nn.LayerNorm)", "layer_norm"),
        ("jvp(vmap(eqx.nn.RMSNorm))", "rms_norm"),
        ("layer_norm", "layer_norm"),
        ("GroupNorm_0", "group_norm"),
        ("BatchNorm_0", "batch_norm"),
        ("softmax_cross_entropy", "cross_entropy"),
        ("softmax_cross_entropy_with_integer_labels", "cross_entropy"),
        ("sigmoid_binary_cross_entropy", "binary_cross_entropy"),
        # innermost recognised component wins
        ("loss/cross_entropy/log_softmax", "log_softmax"),
        ("LayerNorm_0/Dense_0", "layer_norm"),
        ("Dense_0", None),
        ("softmax_layer", None),
        ("my_var", None),
        ("", None),
        ("relu", None),
    ],
)
def test_composite_for_names(name, expected):
    assert composite_for(name) == expected
    if expected is not None:
        assert expected in COMPOSITES


def _nested_names(closed) -> list[str]:
    """Nested jit names and name-stack components, as the interpreter sees them."""
    found: list[str] = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            stack = str(eqn.source_info.name_stack)
            if stack:
                found.append(stack)
            if "name" in eqn.params and isinstance(eqn.params["name"], str):
                found.append(eqn.params["name"])
            for sub in _subjaxprs(eqn):
                walk(sub)

    walk(closed.jaxpr)
    return found


def _composites_in(fn, *args) -> set[str]:
    closed = jax.make_jaxpr(fn)(*args)
    return {c for n in _nested_names(closed) if (c := composite_for(n))}


X = jnp.ones((4, 8), jnp.float32)


@pytest.mark.parametrize(
    "fn, expected",
    [
        (jax.nn.log_softmax, {"log_softmax"}),
        (jnp.var, {"var"}),
        (jnp.std, {"std", "var"}),
        (jnp.linalg.norm, {"norm"}),
        (jax.nn.softplus, {"softplus"}),
        (jax.nn.standardize, {"standardize"}),
    ],
)
def test_composite_for_real_jaxprs(fn, expected):
    assert _composites_in(fn, X) == expected


@pytest.mark.parametrize(
    "fn", [jax.nn.softmax, jax.nn.logsumexp, jax.scipy.special.logsumexp, jnp.mean]
)
def test_inlined_composites_run_float32_by_primitive(fn):
    # On JAX 0.10.2 these are not wrapped in a named jit, so no composite is seen;
    # their exp / reduce_sum / log primitives are denied one by one instead.
    closed = jax.make_jaxpr(fn)(X)
    assert _composites_in(fn, X) == set()
    names = {e.primitive.name for e in closed.jaxpr.eqns}
    assert names & DENY


def test_composite_for_optax_losses():
    optax = pytest.importorskip("optax")
    labels = jnp.full((4, 8), 1 / 8, jnp.float32)
    assert _composites_in(optax.softmax_cross_entropy, X, labels) == {"log_softmax"}
    assert _composites_in(optax.sigmoid_binary_cross_entropy, X, labels) == {
        "log_sigmoid",
        "softplus",
    }


def test_composite_for_flax_linen_norms():
    nn = pytest.importorskip("flax.linen")

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(8)(x)
            return nn.RMSNorm()(nn.LayerNorm()(x))

    model = Model()
    params = jax.eval_shape(model.init, jax.random.key(0), X)
    closed = jax.make_jaxpr(model.apply)(params, X)
    by_prim = {}
    for eqn in closed.jaxpr.eqns:
        by_prim.setdefault(composite_for(str(eqn.source_info.name_stack)), set()).add(
            eqn.primitive.name
        )
    assert "dot_general" in by_prim[None]
    assert "rsqrt" in by_prim["layer_norm"] and "rsqrt" in by_prim["rms_norm"]


def test_composite_for_equinox_and_haiku_norms():
    eqx = pytest.importorskip("equinox")
    hk = pytest.importorskip("haiku")
    ln = eqx.nn.LayerNorm(8)
    assert "layer_norm" in _composites_in(jax.vmap(ln), X)
    rms = eqx.nn.RMSNorm(8)
    assert "rms_norm" in _composites_in(jax.vmap(rms), X)
    f = hk.transform(lambda x: hk.LayerNorm(-1, True, True)(x))
    params = jax.eval_shape(f.init, jax.random.key(0), X)
    assert "layer_norm" in _composites_in(lambda p, x: f.apply(p, None, x), params, X)


# ------------------------------------------------------------------- modes


def test_modes_are_the_seven_of_seed_003():
    assert set(MODES) == {
        "must_keep_origin_dtype",
        "force_fp32",
        "allow_fp32_to_fp16",
        "allow_fp32_to_bf16",
        "force_fp16",
        "allow_mix_precision",
        "allow_mix_precision_bf16",
    }


@pytest.mark.parametrize("mode", MODES)
def test_validate_mode_accepts(mode):
    assert validate_mode(mode) == mode


def test_validate_mode_rejects():
    with pytest.raises(ValueError, match="Did you mean 'allow_mix_precision'"):
        validate_mode("allow_mixed_precision")
    with pytest.raises(ValueError, match="'force_fp16'"):
        validate_mode("fp16")
    with pytest.raises(TypeError, match="`mode` must be a string"):
        validate_mode(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`mode` must be one of"):
        decide("add", [F32], mode="amp", lists=default_op_lists(), low_dtype=BF16)


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
    assert modes.effective_low_dtype(mode, low) == expected


def _d(name, dtypes, mode, low=BF16, lists=None, from_param=()):
    return decide(
        name,
        dtypes,
        mode=mode,
        lists=default_op_lists() if lists is None else lists,
        low_dtype=low,
        from_param=from_param,
    )


N = None
# (op, in dtypes) -> expected cast dtype per mode, with low_dtype=bf16 for the
# policy-driven modes. force_fp32 / force_fp16 take any 16-bit input; the other
# modes leave the "other" 16-bit type alone (bf16 under *_fp16). Columns:
# must_keep, force_fp32, to_fp16, to_bf16, force_fp16, mix, mix_bf16.
_MODE_TABLE = [
    ("dot_general", (F32, F32), (N, F32, F16, BF16, F16, BF16, BF16)),
    ("dot_general", (BF16, BF16), (N, F32, N, BF16, F16, BF16, BF16)),
    ("exp", (F32,), (N, F32, F32, F32, F16, F32, F32)),
    ("exp", (BF16,), (N, F32, N, F32, F16, F32, F32)),
    ("softmax", (BF16,), (N, F32, N, F32, F16, F32, F32)),
    ("add", (F32, F32), (N, F32, F32, F32, F16, F32, F32)),
    ("add", (BF16, BF16), (N, F32, N, F32, F16, BF16, BF16)),
    # A computed float32 input wins (the widest): residual streams stay float32.
    ("add", (BF16, F32), (N, F32, N, F32, F16, F32, F32)),
    ("tanh", (BF16,), (N, F32, N, F32, F16, BF16, BF16)),
    ("reshape", (BF16,), (N, N, N, N, N, N, N)),
    ("reshape", (F32,), (N, N, N, N, N, N, N)),
    ("fft", (F32,), (N, F32, F32, F32, F32, F32, F32)),
    ("cholesky", (BF16,), (N, F32, N, F32, F32, F32, F32)),
    ("jit", (F32, BF16), (N, N, N, N, N, N, N)),
    ("ffi_call", (F32,), (N, N, N, N, N, N, N)),
    ("iota", (), (N, N, N, N, N, N, N)),
    ("argmax", (I32,), (N, N, N, N, N, N, N)),
    ("add", (I32, I32), (N, N, N, N, N, N, N)),
    ("dot_general", (F64, F64), (N, N, N, N, N, N, N)),
    ("exp", (F64,), (N, N, N, N, N, N, N)),
]


@pytest.mark.parametrize("name, dtypes, expected", _MODE_TABLE)
def test_decide_mode_table(name, dtypes, expected):
    got = tuple(_d(name, dtypes, mode).dtype for mode in MODES)
    assert got == expected, dict(zip(MODES, got, strict=True))


def test_decide_f16_policy_under_allow_mix_precision():
    assert _d("dot_general", [F32, F32], "allow_mix_precision", low=F16).dtype == F16
    assert _d("add", [F16, F16], "allow_mix_precision", low=F16).dtype == F16
    assert _d("add", [F16, F32], "allow_mix_precision", low=F16).dtype == F32
    # A bf16 input under a float16 policy is user code in the other 16-bit type.
    assert _d("dot_general", [BF16, BF16], "allow_mix_precision", low=F16).dtype is None
    # force_fp32 upcasts any 16-bit input.
    assert _d("add", [F16, F32], "force_fp32", low=BF16).dtype == F32


def test_decide_float32_policy_lowers_nothing():
    for name in ["dot_general", "exp", "add"]:
        assert _d(name, [F32, F32], "allow_mix_precision", low=F32).dtype == F32


def test_decide_bias_add_follows_half_operand():
    # bf16 activation + float32 bias straight from a parameter: stays bf16.
    d = _d("add", [BF16, F32], "allow_mix_precision", from_param=[False, True])
    assert d.dtype == BF16 and d.op_class == "infer"
    # relu: max(bf16 activation, 0.0 literal).
    assert (
        _d("max", [BF16, F32], "allow_mix_precision", from_param=[0, 1]).dtype == BF16
    )
    # Two float32 parameters: no half operand to follow.
    assert _d("mul", [F32, F32], "allow_mix_precision", from_param=[1, 1]).dtype == F32
    # A float32 activation and a half parameter: the activation decides.
    assert _d("add", [F32, BF16], "allow_mix_precision", from_param=[0, 1]).dtype == F32
    # from_param shorter than in_dtypes: the rest count as activations.
    assert (
        _d("add", [F32, BF16], "allow_mix_precision", from_param=[True]).dtype == BF16
    )


def test_decide_clear_with_mixed_operands_takes_widest_activation():
    d = _d("concatenate", [BF16, F32], "allow_mix_precision")
    assert d.dtype == F32 and d.op_class == "clear"
    # pad(bf16 x, f32 literal padding value): the literal follows.
    assert (
        _d("pad", [BF16, F32], "allow_mix_precision", from_param=[0, 1]).dtype == BF16
    )
    assert _d("eq", [BF16, BF16], "allow_mix_precision").dtype is None


def test_decide_modified_lists():
    lists = modify_mixlist(None, {"white-list": {"to-remove": ["dot_general"]}})
    d = _d("dot_general", [F32, F32], "allow_mix_precision", lists=lists)
    assert d.op_class == "infer" and d.dtype == F32
    d = _d("dot_general", [BF16, BF16], "allow_mix_precision", lists=lists)
    assert d.dtype == BF16
    d = _d("dot_general", [BF16, F32], "allow_mix_precision", lists=lists)
    assert d.dtype == F32
    lists = modify_mixlist(None, {"black-list": {"to-add": ["tanh"]}})
    assert _d("tanh", [BF16], "allow_mix_precision", lists=lists).dtype == F32


def test_decide_unknown_primitive_is_gray():
    d = _d("my_custom_prim", [BF16], "allow_mix_precision")
    assert d == Decision("infer", BF16, d.reason)


def test_decide_is_pure_and_returns_hashable_decisions():
    a = _d("add", (BF16, F32), "allow_mix_precision", from_param=(False, True))
    b = _d("add", [BF16, F32], "allow_mix_precision", from_param=[False, True])
    assert a == b and hash(a) == hash(b)
    assert isinstance(a.reason, str) and a.reason
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.dtype = F32  # type: ignore[misc]


@pytest.mark.parametrize("mode", MODES)
def test_decide_accepts_dtype_likes(mode):
    d1 = _d("dot_general", [jnp.float32, "float32"], mode, low=jnp.bfloat16)
    d2 = _d("dot_general", [F32, F32], mode, low=BF16)
    assert d1 == d2
    assert d1.dtype is None or isinstance(d1.dtype, np.dtype)


@pytest.mark.parametrize("name", sorted(FULL_PRECISION_ONLY))
def test_force_fp16_keeps_ops_that_cannot_run_in_16bit(name):
    assert _d(name, [F32], "force_fp16").dtype == F32


@pytest.mark.parametrize("name", ["exp", "softmax", "reduce_sum", "log"])
def test_force_fp16_ignores_deny_list(name):
    assert _d(name, [F32], "force_fp16").dtype == F16


# ----------------------------------------------------------- modify_mixlist


def _cls(lists, name):
    return lists.classify(name)


def test_seed_example_add_to_black_moves_from_white():
    # "(正确示例)用户将该算子添加到黑名单中" — A (dot_general) is white by default.
    assert _cls(default_op_lists(), "dot_general") == "allow"
    lists = modify_mixlist(None, {"black-list": {"to-add": ["dot_general"]}})
    assert _cls(lists, "dot_general") == "deny"
    assert "dot_general" not in lists.allow


def test_seed_example_remove_from_white_and_add_to_black():
    spec = {
        "black-list": {"to-add": ["dot_general"]},
        "white-list": {"to-remove": ["dot_general"]},
    }
    assert _cls(modify_mixlist(None, spec), "dot_general") == "deny"


def test_seed_example_remove_from_white_only_leaves_gray():
    # "(错误示例)... 最终该算子在灰名单中,而不是黑名单"
    lists = modify_mixlist(None, {"white-list": {"to-remove": ["dot_general"]}})
    assert _cls(lists, "dot_general") == "infer"
    assert "dot_general" in lists.infer


def test_seed_example_remove_from_black_only_leaves_gray():
    lists = modify_mixlist(None, {"black-list": {"to-remove": ["exp"]}})
    assert _cls(lists, "exp") == "infer"


# The seed's ops_info.json, with its // comments, in JAX names: Yolo -> exp
# (black), Matmul -> dot_general, Cast -> convert_element_type, Conv2D ->
# conv_general_dilated, Bias -> add.
SEED_JSON = """
{ "black-list": { // 黑名单
    "to-remove": [ // 黑名单算子转换为灰名单算子
      "exp"
    ],
    "to-add": [ // 白名单或灰名单算子转换为黑名单算子
      "dot_general", "convert_element_type"
    ]
  },
  "white-list": { // 白名单
    "to-remove": [ // 白名单算子转换为灰名单算子
      "conv_general_dilated"
    ],
    "to-add": [ // 黑名单或灰名单算子转换为白名单算子
      "add"
    ]
  }
}
"""
SEED_EXPECTED = {
    "exp": "infer",
    "dot_general": "deny",
    "convert_element_type": "deny",
    "conv_general_dilated": "infer",
    "add": "allow",
}


def _check_seed(lists):
    for name, cls in SEED_EXPECTED.items():
        assert _cls(lists, name) == cls, name
    defaults = default_op_lists()
    for name in KNOWN_NAMES - set(SEED_EXPECTED) - HIGHER_ORDER:
        assert _cls(lists, name) == _cls(defaults, name), name


def test_seed_ops_info_json_string():
    _check_seed(modify_mixlist(None, SEED_JSON))


def test_seed_ops_info_json_file(tmp_path):
    path = tmp_path / "ops_info.json"
    path.write_text(SEED_JSON, encoding="utf-8")
    _check_seed(modify_mixlist(None, path))
    _check_seed(modify_mixlist(default_op_lists(), str(path)))


def test_seed_ops_info_dict():
    spec = json.loads(mixlist_lib._strip_line_comments(SEED_JSON))
    _check_seed(modify_mixlist(None, spec))


def test_comment_stripper_keeps_slashes_in_strings():
    text = '{"a": "x//y", "b": "q\\\\"} // trailing'
    assert json.loads(mixlist_lib._strip_line_comments(text)) == {
        "a": "x//y",
        "b": "q\\",
    }


def test_modify_does_not_mutate_input_and_is_composable():
    base = default_op_lists()
    lists = modify_mixlist(base, {"white-list": {"to-add": ["exp"]}})
    assert _cls(base, "exp") == "deny" and _cls(lists, "exp") == "allow"
    back = modify_mixlist(lists, {"black-list": {"to-add": ["exp"]}})
    assert back == base


def test_gray_and_clear_lists():
    lists = modify_mixlist(None, {"gray-list": {"to-add": ["exp", "reshape"]}})
    assert _cls(lists, "exp") == "infer" and _cls(lists, "reshape") == "infer"
    lists = modify_mixlist(None, {"clear-list": {"to-add": ["tanh"]}})
    assert _cls(lists, "tanh") == "clear"
    spec = {"gray-list": {"to-remove": ["tanh"]}, "white-list": {"to-add": ["tanh"]}}
    assert _cls(modify_mixlist(None, spec), "tanh") == "allow"
    lists = modify_mixlist(None, {"clear-list": {"to-remove": ["reshape"]}})
    assert _cls(lists, "reshape") == "infer"


def test_adding_to_own_list_is_a_no_op():
    lists = modify_mixlist(None, {"black-list": {"to-add": ["exp", "exp"]}})
    assert lists == default_op_lists()
    assert modify_mixlist(None, {}) == default_op_lists()


def test_custom_names_already_in_lists_are_accepted():
    lists = dataclasses.replace(default_op_lists(), infer=INFER | {"my_prim"})
    lists = modify_mixlist(lists, {"white-list": {"to-add": ["my_prim"]}})
    assert _cls(lists, "my_prim") == "allow"


@pytest.mark.parametrize(
    "spec, match",
    [
        (
            {"black-list": {"to-add": ["dot_genral"]}},
            "unknown op 'dot_genral'.*'dot_general'",
        ),
        ({"black-list": {"to-add": ["Matmul"]}}, "'dot_general' \\(the JAX primitive"),
        ({"white-list": {"to-add": ["Conv2D"]}}, "'conv_general_dilated'"),
        ({"blacklist": {"to-add": ["exp"]}}, "unknown key 'blacklist'.*'black-list'"),
        ({"black-list": {"to_add": ["exp"]}}, "unknown key 'to_add'.*'to-add'"),
        (
            {"black-list": {"to-add": ["exp"], "to-remove": ["exp"]}},
            "'exp' is both added to and removed from 'black-list'",
        ),
        (
            {"black-list": {"to-add": ["add"]}, "white-list": {"to-add": ["add"]}},
            "'add' is added to both",
        ),
        ({"white-list": {"to-remove": ["exp"]}}, "cannot remove 'exp'.*deny list"),
        ({"gray-list": {"to-remove": ["add"]}}, "not added to another list"),
        ({"black-list": {"to-add": "exp"}}, "must be a list of op names"),
        ({"black-list": ["exp"]}, "'black-list' must be an object"),
        ({"black-list": {"to-add": [3]}}, "must be strings"),
        ({"black-list": {"to-add": ["scan"]}}, "'scan'.*higher-order"),
        ({"black-list": {"to-add": ["ffi_call"]}}, "'ffi_call'.*opaque"),
        ('{"black-list": {"to-add": ["exp"]', "malformed JSON.*line 1"),
        ("{'black-list': {}}", "malformed JSON"),
        ("[1, 2]", "must be a JSON object"),
        ("no_such_file.json", "neither a JSON file nor JSON text"),
    ],
)
def test_modify_mixlist_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        modify_mixlist(None, spec)


def test_modify_mixlist_errors_for_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"black-list": {"to-add": ["exp",]}}\n')
    with pytest.raises(ValueError, match="malformed JSON in file .*bad.json"):
        modify_mixlist(None, bad)
    with pytest.raises(ValueError, match="neither a JSON file"):
        modify_mixlist(None, tmp_path / "missing.json")
    with pytest.raises(ValueError, match="neither a JSON file"):
        modify_mixlist(None, tmp_path)


def test_modify_mixlist_type_errors():
    with pytest.raises(TypeError, match=r"`modify_mixlist\(spec=...\)` must be"):
        modify_mixlist(None, 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"`modify_mixlist\(lists=...\)` must be"):
        modify_mixlist({"allow": []}, {})  # type: ignore[arg-type]


# ------------------------------------------------------------ docs table


def test_committed_op_table_is_up_to_date():
    committed = (REPO / "docs" / "op_table.md").read_text()
    assert committed == op_lists.render_op_table(), (
        "docs/op_table.md is stale; run `python tools/gen_op_table.py`."
    )


def test_op_table_lists_every_primitive_and_mode():
    table = op_lists.render_op_table()
    for name in _module_primitive_names() | COMPOSITES:
        assert f"| `{name}`" in table, name
    for mode in MODES:
        assert f"| `{mode}` |" in table


def test_op_table_check_cli(tmp_path):
    out = tmp_path / "op_table.md"
    assert op_lists._main(["--output", str(out), "--check"]) == 1
    assert op_lists._main(["--output", str(out)]) == 0
    assert op_lists._main(["--output", str(out), "--check"]) == 0
    out.write_text(out.read_text() + "edited\n")
    assert op_lists._main(["--output", str(out), "--check"]) == 1


def test_oplists_rejects_non_string_names_and_supports_replace():
    with pytest.raises(TypeError, match="must contain op names"):
        OpLists(allow=[1])  # type: ignore[list-item]
    lists = dataclasses.replace(default_op_lists(), allow=["dot_general"])
    assert lists.allow == frozenset({"dot_general"})
    assert lists.classify("conv_general_dilated") == "infer"


@pytest.mark.parametrize("mode", MODES)
def test_decide_ignores_prng_key_inputs(mode):
    key_dtype = jax.random.key(0).dtype
    d = _d("random_bits", [key_dtype], mode)
    assert d.dtype is None and d.op_class == "clear"
    d = _d("add", [key_dtype, F32], mode)  # only the float input counts
    assert d == _d("add", [F32], mode)


def test_modify_mixlist_rejects_duplicate_json_keys():
    text = '{"black-list": {"to-add": ["exp"]}, "black-list": {"to-add": ["log"]}}'
    with pytest.raises(ValueError, match="duplicate key 'black-list'"):
        modify_mixlist(None, text)


def test_oplists_repr_is_compact():
    text = repr(default_op_lists())
    assert text.startswith("OpLists(allow=['conv_general_dilated'")
    assert f"({len(DENY)} names)" in text
    assert len(text) < 600
