"""The op table: everything autocast knows about each op, in one place.

One entry (:class:`OpSpec`) per JAX primitive name or composite holds its class,
why it has that class, its flags, and the rule that runs it (if it needs its own):

* class ``allow`` (white): run on operands rounded to the low dtype, accumulate in
  float32 (matmuls, convolutions).
* class ``deny`` (black): run in float32 (exponentials, logarithms, powers, long
  reductions, special functions, linear algebra, the JAX composites below).
* class ``infer`` (gray): elementwise arithmetic and activations; they run in the
  widest dtype of their operands that are not broadcast into the result (see
  :mod:`~mixprec._src.autocast.decide` for the whole rule).
* class ``clear``: dtype-transparent data movement, comparisons, max/min
  selection, integer and bit ops, PRNG ops, collectives that move values.
* class ``None``: a higher-order primitive (``jit``, ``scan``, ``while``, ...);
  its body is decided equation by equation. Each has a rule, or is run by the
  default higher-order rule, which recurses into every jaxpr parameter.

Flags:

* :data:`OPAQUE`: compiled or written for exact input dtypes (kernels, host
  callbacks, bitcasts); always run at the dtypes it was traced with.
* :data:`FLOAT32_ONLY`: no 16-bit kernel or dtype exists (FFT, decompositions,
  complex numbers); ``force_fp16`` keeps it in float32.
* :data:`NARROW_RANGE`: denied only for its range, so only under a low dtype with
  a narrower range than float32 (float16: ``square`` of 256 overflows); under
  bfloat16, which has float32's range, it is gray.
* :data:`VIEW`: moves data without arithmetic and keeps a value's "broadcast"
  mark (reshape, transpose, convert).
* :data:`BROADCASTS`: an elementwise op whose operands broadcast implicitly
  (scalars, size-1 dimensions): an operand it broadcasts is cast after the
  broadcast, so its gradient is summed in the wider dtype.
* :data:`FLOAT8`: an allow op with a scaled float8 formulation: under a policy
  with a float8 recipe it runs in float8 (the others stay in the low dtype).
  Derived from the entry's :class:`Product` (set when it has a float8
  formulation).
* :data:`STATISTIC`: a reduction whose result is a statistic of its operand
  (a sum, a max); a value computed from statistics and constants only is one
  too, and it anchors gray ops instead of following (``x - mean``).
* :data:`EPILOGUE`: a bias add that may run on the float32 product of the
  CPU matmul before it (one rounding, as a GEMM epilogue does).
* :data:`FILL`: a constant operand is a fill or a bound (``where``, ``max``,
  ``min``, ``clamp``): ``finfo(float32).min`` as an attention-mask fill. Cast
  down, such a constant saturates to the low dtype's finite range, which keeps
  the result. Any other op with a constant the low dtype cannot hold (beyond
  its largest value, or so small it becomes 0) runs in float32.
* :data:`ADDITIVE`: adds its operands (``add``, ``sub``). In a forward pass,
  an operand it broadcasts into a 16-bit result (a bias) that holds values
  beyond the low dtype's range is a mask bias (``finfo(float32).min``,
  ``-1e9``, whatever its origin: an argument, or computed from one): those
  values become half the low dtype's largest value, with their sign
  (:func:`~mixprec._src.autocast.operands.saturate_mask`), so that they do not
  round to ``-inf`` and adding a score to them cannot overflow; values in
  range are kept bit for bit. (A mask bias made from known constants keeps its
  add in float32 instead: see :data:`KEEPS_MAGNITUDE`.)
* :data:`KEEPS_MAGNITUDE`: the result is as large as its largest operand
  (``add``, ``sub``, ``mul``, ``max``, ``min``, ``clamp``, ``select_n``; the
  clear ops move values and keep them too): a value such an op makes from a
  constant the low dtype cannot hold cannot be held either. A mask bias
  (``select(mask > 0, 0, finfo(float32).min)``, ``(1 - mask) * -1e9``) is
  such a value; autocast treats it as the constant it is made from
  (:data:`~mixprec._src.autocast.decide.BIG`).
* :data:`FUSION`: the op of a fusion, an equation a rewrite pass put in place
  of several (:mod:`~mixprec._src.autocast.rewrites`): fused where every op it
  replaces, each decided in its own region, would run in the same 16-bit
  dtype, else run as those ops.

Matmul-like ops (``dot_general``, ``conv_general_dilated``) carry a
:class:`Product` in their entry: their dimensions (for float8's skip rules,
alignment advice, FLOPs and rowwise scales), their 16-bit and float8
formulations (:mod:`~mixprec._src.autocast.dots`,
:mod:`~mixprec._src.autocast.float8_dots`, each written per platform) and how
a float8 recipe and a following bias add apply to them. One rule runs every op
that has one. Adding a matmul-like primitive is an entry here with its
``Product`` and its formulation functions.

Composites are nested functions that JAX itself emits as a named ``jit`` or
``custom_jvp`` (``jax.nn.log_softmax``, ``jnp.var``, ``jnp.linalg.norm``, ...).
They are recognised by the function's name *and* its defining file being inside
JAX (:func:`composite_for_function`), never by a user's scope or layer name: a
Flax ``Dense(name="mean")`` is a matmul. Every op inside a composite runs with
the composite's class (deny: float32).

Sources named in the reasons: PyTorch autocast (``lower_precision_fp`` / ``fp32``
/ ``promote``), TensorFlow AMP (``auto_mixed_precision_lists.h``: allow / deny /
infer / clear), Apex O1 (``FP16_FUNCS`` / ``FP32_FUNCS`` / ``CASTS``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable
from typing import Any, Final, Literal

import jax

from mixprec._src import _compat
from mixprec._src._errors import suggest
from mixprec._src.autocast import dots, float8_dots


__all__ = [
    "ADDITIVE",
    "BROADCASTS",
    "EPILOGUE",
    "FILL",
    "FLOAT8",
    "FUSION",
    "KEEPS_MAGNITUDE",
    "STATISTIC",
    "register_rule",
    "COMPOSITES",
    "FLOAT32_ONLY",
    "NARROW_RANGE",
    "OPAQUE",
    "OpClass",
    "OpLists",
    "OpSpec",
    "Product",
    "VIEW",
    "class_table",
    "composite_for_function",
    "default_op_lists",
    "spec_for",
]

OpClass = Literal["allow", "deny", "infer", "clear"]
OP_CLASSES: Final[tuple[OpClass, ...]] = ("allow", "deny", "infer", "clear")

OPAQUE: Final = "opaque"
FLOAT32_ONLY: Final = "float32_only"
NARROW_RANGE: Final = "narrow_range"
VIEW: Final = "view"
BROADCASTS: Final = "broadcasts"
FLOAT8: Final = "float8"
STATISTIC: Final = "statistic"
EPILOGUE: Final = "epilogue"
FILL: Final = "fill"
KEEPS_MAGNITUDE: Final = "keeps_magnitude"
ADDITIVE: Final = "additive"
#: A sum across devices: it runs in the policy's ``reduce_dtype``.
CROSS_DEVICE_SUM: Final = "cross_device_sum"
#: A fusion: an op a rewrite pass made of several (a registered
#: :class:`~mixprec._src.autocast.fusions.Fusion`: a written-out attention or
#: RMSNorm), fused where every op that decides it would run in the low dtype,
#: else run as those ops (see :func:`def_fusion`).
FUSION: Final = "fusion"
FLAGS: Final = frozenset(
    {
        OPAQUE,
        FLOAT32_ONLY,
        NARROW_RANGE,
        VIEW,
        BROADCASTS,
        FLOAT8,
        STATISTIC,
        EPILOGUE,
        FILL,
        KEEPS_MAGNITUDE,
        ADDITIVE,
        CROSS_DEVICE_SUM,
        FUSION,
    }
)


@dataclasses.dataclass(frozen=True)
class Product:
    """What autocast knows about a matmul-like op beyond its class.

    Attributes:
        dims: ``dims(in_shapes, out_shape, params) -> dots.ProductDims``: its
            sizes for float8's skip rules, alignment advice, FLOPs and the
            contracted axes a rowwise float8 scale is taken over (none: one
            scale per operand).
        low: its 16-bit formulation, ``low(request, lhs, rhs, *extra,
            **params)``: the equation's operands (``extra``: those after the
            first two, a ragged dot's group sizes) and params, and one
            :class:`~mixprec._src.autocast.request.ProductRequest` that
            ``decide.py`` filled in (dtypes, platform, CPU formulation, live
            operands); it returns the product in float32 (the caller rounds
            it).
        float8: its float8 formulation, called the same way (the request
            carries the recipe and each operand's format), in float32;
            ``None``: it stays in 16 bits under a float8 policy.
        epilogue: a bias add right after it runs on its float32 product.
        note: ``note(low_dtype, *, platform, cpu_bf16) -> str``: one sentence
            for reports on how each platform runs it in ``low_dtype``.
        float8_note: ``float8_note(low_dtype, *, platform) -> str``: the same
            under a float8 decision, including where it does not run in float8
            (a platform with no float8 kernel for it) and what runs instead.

    Examples:
        >>> product = spec_for("dot_general").product
        >>> product.dims([(8, 64), (64, 16)], (8, 16),
        ...              {"dimension_numbers": (((1,), (0,)), ((), ()))}).flops
        16384
    """

    dims: Callable[..., Any]
    low: Callable[..., Any]
    float8: Callable[..., Any] | None = None
    epilogue: bool = True
    note: Callable[..., str] | None = None
    float8_note: Callable[..., str] | None = None


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """Everything autocast knows about one op.

    Attributes:
        name: the primitive name (``prim.name``) or the composite name.
        op_class: ``"allow"``, ``"deny"``, ``"infer"``, ``"clear"``, or ``None``
            for a higher-order primitive.
        reason: why the op has its class (sources), for reports and the docs.
        flags: a subset of :data:`FLAGS`.
        rule: the rule that runs the op, or ``None`` for the default one (cast
            the floating operands as decided, bind the primitive again; for a
            higher-order primitive: recurse into its jaxpr parameters; for a
            matmul-like op: run its :class:`Product`'s formulation).
        composite: for a composite, the names of the JAX functions it matches.
        product: for a matmul-like op, its :class:`Product`.

    Examples:
        >>> spec = spec_for("integer_pow")
        >>> spec.op_class, NARROW_RANGE in spec.flags
        ('deny', True)
        >>> spec_for("scan").is_higher_order
        True
    """

    name: str
    op_class: OpClass | None
    reason: str
    flags: frozenset[str] = frozenset()
    rule: Callable[..., Any] | None = None
    composite: tuple[str, ...] = ()
    product: Product | None = None

    @property
    def is_higher_order(self) -> bool:
        """Whether the op is a higher-order primitive (its body is interpreted)."""
        return self.op_class is None


#: The table: op name -> spec. Filled below and by the rule modules.
_ops: dict[str, OpSpec] = {}

# Sources named in the reasons.
_PT = "PyTorch autocast"
_TF = "TF AMP"
_APEX = "Apex O1"


def _define(
    op_class: OpClass | None,
    names: Iterable[str],
    reason: str,
    *,
    flags: Iterable[str] = (),
    product: Product | None = None,
) -> None:
    flag_set = frozenset(flags)
    if product is not None and product.float8 is not None:
        flag_set |= {FLOAT8}
    assert flag_set <= FLAGS, flag_set - FLAGS
    for name in names:
        if name in _ops:
            raise RuntimeError(f"ops: {name!r} is classified twice")
        _ops[name] = OpSpec(name, op_class, reason, flag_set, product=product)


def def_allow(names: Iterable[str], reason: str, **kw: Any) -> None:
    """Adds allow-list ops to the table."""
    _define("allow", names, reason, **kw)


def def_deny(names: Iterable[str], reason: str, **kw: Any) -> None:
    """Adds deny-list ops to the table."""
    _define("deny", names, reason, **kw)


def def_infer(names: Iterable[str], reason: str, **kw: Any) -> None:
    """Adds gray (infer) ops to the table."""
    _define("infer", names, reason, **kw)


def def_clear(names: Iterable[str], reason: str, **kw: Any) -> None:
    """Adds clear ops to the table."""
    _define("clear", names, reason, **kw)


def add_flags(names: Iterable[str], *flags: str) -> None:
    """Adds ``flags`` to the entries of ``names`` (a role some ops of different
    classes share, such as :data:`STATISTIC`)."""
    new = frozenset(flags)
    assert new <= FLAGS, new - FLAGS
    for name in names:
        spec = _ops[name]
        _ops[name] = dataclasses.replace(spec, flags=spec.flags | new)


def def_fusion(name: str, reason: str, rule: Callable[..., Any]) -> None:
    """Adds the op of a fusion (the private primitive a rewrite pass puts in
    place of the ops it recognised) to the table, in the allow list, with its
    rule; called for each registered
    :class:`~mixprec._src.autocast.fusions.Fusion` when the rules are
    imported. It is decided from the ops it replaces
    (:func:`~mixprec._src.autocast.decide.decide_fusion`)."""
    _define("allow", [name], reason, flags=[FUSION])
    set_rule(name, rule)


def def_higher_order(names: Iterable[str], reason: str) -> None:
    """Adds higher-order primitives to the table (rules are set by the rule
    modules; those without run through the default higher-order rule)."""
    _define(None, names, reason)


def spec_for(name: str) -> OpSpec | None:
    """The table entry of the op called ``name``, or ``None``.

    Examples:
        >>> spec_for("dot_general").op_class
        'allow'
        >>> spec_for("no_such_op") is None
        True
    """
    return _ops.get(name)


def set_rule(name: str, rule: Callable[..., Any], *, override: bool = False) -> None:
    """Attaches ``rule`` to the op ``name`` (creating an entry for an op the
    table does not know: class ``infer``, so that lists and modes still apply).

    Raises:
        ValueError: ``name`` already has a rule and ``override`` is False.
    """
    spec = _ops.get(name)
    if spec is not None and spec.rule is not None and not override:
        raise ValueError(
            f"Primitive '{name}' already has a cast rule. Pass `override=True` "
            "to `mixprec.register_rule` to replace it."
        )
    if spec is None:
        spec = OpSpec(name, "infer", "registered with mixprec.register_rule")
    _ops[name] = dataclasses.replace(spec, rule=rule)


def register_rule(
    primitive: Any,
    rule: Callable[..., Any] | None = None,
    *,
    override: bool = False,
) -> Any:
    """Registers how autocast runs ``primitive``; usable as a decorator.

    The rule is called as ``rule(ctx, *invals, **params)`` with the values the
    equation receives (possibly already in a low dtype) and the equation's
    params; it returns the output (a list for primitives with several results).
    ``ctx.decision`` is the precision autocast decided for the equation from
    the op lists and the mode, and ``ctx.cast_operands(invals)`` applies it. A
    primitive the lists do not know is gray (``infer``) unless a mixlist says
    otherwise.

    Args:
        primitive: a ``jax.extend.core.Primitive``.
        rule: the rule. If omitted, returns a decorator.
        override: replace an existing rule instead of raising.

    Returns:
        ``rule`` (or a decorator that registers and returns its argument).

    Raises:
        TypeError: ``primitive`` is not a Primitive or ``rule`` not callable.
        ValueError: ``primitive`` already has a rule and ``override`` is False.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import mixprec
        >>> from jax.extend.core import Primitive
        >>> double_p = Primitive("double")
        >>> double_p.def_impl(lambda x: 2 * x)
        <function <lambda> ...>
        >>> double_p.def_abstract_eval(lambda x: x)
        <function <lambda> ...>
        >>> @mixprec.register_rule(double_p)
        ... def _double_rule(ctx, x):
        ...     return double_p.bind(x.astype(ctx.low_dtype))
        >>> f = mixprec.autocast(lambda x: double_p.bind(x), "p=f32,c=bf16,o=bf16")
        >>> jaxpr = jax.make_jaxpr(f)(jnp.ones(2))
        >>> [(e.primitive.name, str(e.outvars[0].aval.dtype)) for e in jaxpr.eqns]
        [('convert_element_type', 'bfloat16'), ('double', 'bfloat16')]
        >>> mixprec.register_rule(double_p, _double_rule)
        Traceback (most recent call last):
        ...
        ValueError: ...already has a cast rule...
    """
    from jax.extend.core import Primitive

    if not isinstance(primitive, Primitive):
        raise TypeError(
            "`register_rule(primitive, ...)` expects a jax.extend.core.Primitive, "
            f"got {type(primitive).__name__} instead."
        )

    def register(r: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(r):
            raise TypeError(
                f"`register_rule(..., rule=...)` must be callable, got "
                f"{type(r).__name__} instead."
            )
        set_rule(primitive.name, r, override=override)
        return r

    if rule is None:
        return register
    return register(rule)


_product_rule: list[Callable[..., Any]] = []


def set_product_rule(rule: Callable[..., Any]) -> None:
    """Sets the rule that runs every op with a :class:`Product` and no rule
    of its own."""
    _product_rule[:] = [rule]


def rule_for(spec: OpSpec | None) -> Callable[..., Any] | None:
    """The rule of a first-order op: its own, the product rule for a
    matmul-like op, or ``None`` for the default rule."""
    if spec is None:
        return None
    if spec.rule is not None:
        return spec.rule
    if spec.product is not None:
        return _product_rule[0]
    return None


_default_higher_order_rule: list[Callable[..., Any]] = []


def set_default_higher_order_rule(rule: Callable[..., Any]) -> None:
    """Sets the rule of every higher-order primitive without a rule of its own
    (and of unknown primitives with jaxpr parameters)."""
    _default_higher_order_rule[:] = [rule]


def higher_order_rule(name: str) -> Callable[..., Any]:
    """The rule that runs the higher-order primitive ``name``: its own, or the
    default one, which recurses into every jaxpr parameter.

    Examples:
        >>> higher_order_rule("scan").__name__
        '_scan_rule'
        >>> higher_order_rule("linear_call").__name__
        'default_higher_order_rule'
    """
    spec = _ops.get(name)
    if spec is not None and spec.rule is not None:
        return spec.rule
    return _default_higher_order_rule[0]


def all_specs() -> tuple[OpSpec, ...]:
    """Every entry of the table, sorted by name."""
    return tuple(_ops[n] for n in sorted(_ops))


# ----------------------------------------------------------------------- allow
def_allow(
    ["dot_general"],
    f"matmul/einsum: {_PT} lower_precision_fp (matmul, mm, bmm, linear, einsum), "
    f"{_TF} allow (MatMul, BatchMatMulV2, Einsum), {_APEX} FP16_FUNCS (matmul, mm, "
    "addmm, linear); tensor cores and AVX512-BF16 accumulate in float32",
    product=Product(
        dims=dots.dot_general_dims,
        low=dots.dot_general_product,
        float8=float8_dots.dot_general_product,
        note=dots.formulation_note,
        float8_note=float8_dots.dot_float8_note,
    ),
)
def_allow(
    ["conv_general_dilated"],
    f"convolution: {_PT} lower_precision_fp (conv1d/2d/3d, conv_transpose*), "
    f"{_TF} allow (Conv2D, Conv3D and their backprops), {_APEX} FP16_FUNCS "
    "(conv*, conv_transpose*)",
    product=Product(
        dims=dots.conv_dims,
        low=dots.conv_product,
        float8=float8_dots.conv_product,
        epilogue=False,
        note=dots.conv_note,
        float8_note=float8_dots.conv_float8_note,
    ),
)
def_allow(
    ["ragged_dot_general"],
    f"grouped (MoE) matmul: a batch of matmuls ({_PT} lower_precision_fp: bmm, "
    f"baddbmm; {_TF} allow: BatchMatMulV2)",
    product=Product(dims=dots.ragged_dot_dims, low=dots.ragged_dot_product),
)

# ------------------------------------------------------------------------ deny
def_deny(
    ["exp", "exp2", "expm1"],
    f"exponential overflows 16-bit range (exp(12) > float16 max) and turns the "
    f"input's absolute error into relative error: {_PT} fp32 (exp, expm1), {_TF} "
    f"deny (Exp, Expm1), {_APEX} FP32_FUNCS (exp, expm1)",
)
def_deny(
    ["log", "log1p", "log2"],
    f"logarithm of small values / near 1 loses precision: {_PT} fp32 (log, "
    f"log1p, log2, log10), {_APEX} FP32_FUNCS (log, log2, log10); {_TF} has "
    "Log/Log1p in infer, two of three say float32",
)
def_deny(
    ["pow"],
    f"general power: overflow and error amplification: {_PT} fp32 (pow), {_TF} "
    f"deny (Pow), {_APEX} FP32_FUNCS (pow)",
    flags=[BROADCASTS],
)
def_deny(
    ["integer_pow", "square", "one_minus_square"],
    "small integer powers (x**2, x**3 in GELU; 1 - x**2, tanh's derivative) "
    f"overflow float16 above 256 / 40 ({_PT} fp32: pow); their relative error "
    "is only n times the input's, so under bfloat16, which has float32's range, "
    "they run like mul",
    flags=[NARROW_RANGE],
)
def_deny(
    ["reciprocal"],
    f"1/x overflows float16 for |x| < 2^-16: {_PT} fp32 (reciprocal), {_APEX} "
    f"FP32_FUNCS (reciprocal); {_TF} has Reciprocal/Inv in infer; under bfloat16 "
    "(float32's range) it runs like div",
    flags=[NARROW_RANGE],
)
def_deny(
    ["rsqrt"],
    f"reciprocal square root of small variances (norms): {_PT} fp32 (rsqrt), "
    f"{_APEX} FP32_FUNCS (rsqrt)",
)
def_deny(
    ["reduce_sum"],
    f"long accumulation loses precision: {_PT} fp32 (sum), {_TF} deny (Sum, "
    f"Mean, L2Loss), {_APEX} FP32_FUNCS (sum)",
)
def_deny(
    ["reduce_window_sum"],
    "windowed sum (average pooling): a sum like reduce_sum, accumulated in float32 "
    "whatever the window (a 32x32 global pool is a 1024-term sum; 256 values of 400 "
    f"overflow float16); {_PT} runs avg_pool2d at the input dtype but its kernels "
    "accumulate in float32, which XLA's reduce_window does not; "
    f"{_TF} infer (AvgPool)",
)
def_deny(
    ["reduce_prod"],
    f"long product over/underflows: {_PT} fp32 (prod), {_APEX} FP32_FUNCS (prod); "
    f"{_TF} has Prod in infer",
)
def_deny(
    ["cumsum", "cumprod", "cumlogsumexp"],
    f"cumulative accumulation: {_PT} fp32 (cumsum, cumprod, logsumexp), {_APEX} "
    "FP32_FUNCS (cumsum, cumprod); cumlogsumexp is exp + sum + log",
)
def_deny(
    ["acos", "asin", "cosh", "sinh", "tan"],
    f"steep or large-valued trigonometric/hyperbolic function: {_PT} fp32 (acos, "
    f"asin, cosh, sinh, tan), {_APEX} FP32_FUNCS (same)",
)
def_deny(
    ["acosh", "asinh", "atanh"],
    "inverse hyperbolic functions are logarithms (log(x + sqrt(x^2 +- 1)), "
    f"log((1+x)/(1-x))/2): deny like log ({_PT} fp32, {_APEX} FP32_FUNCS); none "
    "of the three lists them",
)
def_deny(
    ["erf_inv"],
    f"inverse error function diverges at +-1: {_PT} fp32 (erfinv), {_APEX} "
    "FP32_FUNCS (erfinv)",
)
def_deny(
    [
        "lgamma",
        "digamma",
        "polygamma",
        "igamma",
        "igammac",
        "igamma_grad_a",
        "zeta",
        "bessel_i0e",
        "bessel_i1e",
        "regularized_incomplete_beta",
        "random_gamma",
        "random_gamma_grad",
    ],
    "special function (or gamma sampler) evaluated with series/recurrences of "
    f"exp, log and pow: float32 like those; not in {_PT}'s or {_APEX}'s 16-bit "
    f"lists, and {_TF} leaves unlisted ops in float32",
)
def_deny(
    ["polynomial"],
    "polynomial evaluation (Horner's rule, `lax.polynomial`): JAX's series "
    "approximations of special functions (erf, the chi-squared sampler) and "
    "`jnp.polyval`; float32 like those",
)
def_deny(
    ["fft"],
    f"FFT: {_PT} CPU fp32 (fft_fft, fft_rfft, ...); complex results have no 16-bit "
    "dtype in JAX",
    flags=[FLOAT32_ONLY],
)
def_deny(
    [
        "cholesky",
        "cholesky_update",
        "eig",
        "eigh",
        "lu",
        "lu_pivots_to_permutation",
        "qr",
        "geqrf",
        "geqp3",
        "ormqr",
        "householder_product",
        "svd",
        "schur",
        "hessenberg",
        "triangular_solve",
        "tridiagonal",
        "tridiagonal_solve",
        "symmetric_product",
    ],
    f"linear-algebra decomposition/solve: {_PT} CPU fp32 (linalg_cholesky, "
    "linalg_solve, linalg_svdvals, linalg_eigvals, linalg_householder_product, "
    "linalg_inv); LAPACK/cuSOLVER have no 16-bit kernels",
    flags=[FLOAT32_ONLY],
)
def_deny(
    ["complex"],
    "builds complex64 from two float32 arrays; JAX has no 16-bit complex dtype",
    flags=[FLOAT32_ONLY],
)
def_deny(
    ["psum", "psum_invariant", "unreduced_psum", "reduce_scatter"],
    "cross-device sum: runs in the policy's reduce_dtype, float32 by default (it "
    "accumulates like reduce_sum: a bf16 pmean of 1.2 over 8 devices gave 1.203); "
    "the result comes back in the dtype its operand arrived in",
    flags=[CROSS_DEVICE_SUM],
)

# ----------------------------------------------------------------------- infer
def_infer(
    ["add", "add_any", "sub", "mul"],
    f"elementwise arithmetic: {_TF} infer (Add, AddV2, AddN, BiasAdd, Sub, Mul); "
    f"{_APEX} CASTS (add, mul); {_PT} runs it at the input dtype, promoting to "
    "the widest",
    flags=[BROADCASTS],
)
def_infer(
    ["div", "rem"],
    f"division: {_TF} infer (RealDiv, FloorDiv), {_APEX} CASTS (div); {_PT} "
    "runs it at the input dtype",
    flags=[BROADCASTS],
)
def_infer(
    ["max", "min"],
    f"elementwise max/min (relu, clipping): {_TF} clear (Maximum, Minimum, Relu); "
    "gray here so that a float32 operand of the result's shape is not rounded",
    flags=[BROADCASTS],
)
def_infer(
    ["clamp"],
    f"clip: {_TF} clear (ClipByValue); gray so float32 bounds follow the operand",
    flags=[BROADCASTS],
)
def_infer(
    ["select_n"],
    f"where/select: {_TF} clear (Select, SelectV2); gray so that a float32 "
    "operand of the result's shape (a residual, a weight) is not rounded",
    flags=[BROADCASTS],
)
def_infer(
    ["atan2"],
    f"two-operand elementwise: {_PT} promote (atan2), {_APEX} CASTS (atan2)",
    flags=[BROADCASTS],
)
def_infer(
    ["tanh", "logistic"],
    f"bounded activation: {_TF} infer (Tanh, Sigmoid and their grads); {_PT} "
    "runs it at the input dtype",
)
def_infer(
    ["sqrt", "cbrt"],
    f"root: {_TF} infer (Sqrt); {_PT} runs it at the input dtype; the relative "
    "error shrinks",
)
def_infer(
    ["erf", "erfc"],
    f"error function (GELU): {_TF} infer (Erf, Erfc); {_PT} runs it at the input dtype",
)
def_infer(
    ["sin", "cos", "atan"],
    f"bounded trigonometric function: {_PT} runs it at the input dtype (its fp32 "
    "list has only tan, asin, acos)",
)
def_infer(
    ["scatter-add", "scatter-sub", "scatter-mul", "scatter_add", "scatter_sub"],
    f"scatter with arithmetic: {_PT} promote (scatter_add, index_put)",
)

# ----------------------------------------------------------------------- clear
def_clear(
    [
        "reshape",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "transpose",
        "copy",
        "copy_p",
    ],
    f"reshape/transpose: no arithmetic ({_TF} clear: Reshape, Squeeze, "
    "ExpandDims, BroadcastTo, Transpose, Identity)",
    flags=[VIEW],
)
def_clear(
    [
        "broadcast_to",
        "rev",
        "slice",
        "dynamic_slice",
        "dynamic_update_slice",
        "gather",
        "scatter",
        "concatenate",
        "pad",
        "split",
        "tile",
        "iota",
        "stack",
        "unstack",
    ],
    f"data movement, no arithmetic: {_TF} clear (ReverseV2, Slice, StridedSlice, "
    f"GatherV2, ConcatV2, Pack, Pad, Split, Tile, Fill); {_APEX} SEQUENCE_CASTS "
    "(cat, stack) take the widest dtype when operands differ, as here",
)
def_clear(
    ["convert_element_type"],
    "explicit dtype conversion written by the user: its target dtype is kept "
    "exactly as written",
    flags=[VIEW],
)
def_clear(
    ["bitcast_convert_type", "reduce_precision", "nextafter"],
    "reinterprets or rounds bit patterns of an exact dtype: runs at the dtype it "
    "was traced with",
    flags=[OPAQUE],
)
def_clear(
    ["abs", "neg", "sign", "floor", "ceil", "round", "is_finite"],
    f"exact in any float format (sign/magnitude/rounding/classification): {_TF} "
    "clear (Abs, Neg, Sign, Floor, Ceil, Round, IsFinite)",
)
def_clear(
    ["real", "imag", "conj"],
    "complex parts: exact; complex values are never lowered",
)
def_clear(
    ["eq", "ne", "lt", "le", "gt", "ge", "eq_to", "le_to", "lt_to"],
    f"comparison: boolean output, exact in any float format: {_TF} clear "
    f"(Equal, NotEqual, Less, Greater, ...); {_APEX} CASTS (eq, lt, ...: widest "
    "dtype when operands differ, as here)",
)
def_clear(
    [
        "reduce_max",
        "reduce_min",
        "argmax",
        "argmin",
        "cummax",
        "cummin",
        "reduce_window_max",
        "reduce_window_min",
        "select_and_gather_add",
        "select_and_scatter_add",
        "scatter-max",
        "scatter-min",
        "scatter_max",
        "scatter_min",
    ],
    f"max/min selection (and max-pool gradients): exact in any float format; "
    f"{_TF} clear (Max, Min, ArgMax, ArgMin, MaxPool, MaxPoolGrad)",
)
def_clear(
    ["sort", "top_k", "approx_top_k"],
    f"sorting/selection: exact in any float format; {_TF} clear (TopK, TopKV2)",
)
def_clear(
    ["reduce_and", "reduce_or", "reduce_xor"],
    "boolean reduction: no floating operands",
)
def_clear(
    [
        "and",
        "or",
        "xor",
        "not",
        "shift_left",
        "shift_right_arithmetic",
        "shift_right_logical",
        "clz",
        "population_count",
        "mulhi",
    ],
    "integer/bit op: no floating operands",
)
def_clear(
    [
        "random_bits",
        "random_seed",
        "random_split",
        "random_fold_in",
        "random_wrap",
        "random_unwrap",
        "random_clone",
        "threefry2x32",
        "threefry4x32",
        "philox2x32",
        "philox4x32",
        "rng_bit_generator",
        "rng_uniform",
        "iota_2x32_shape",
    ],
    "PRNG key/bit op: integer keys and bits, never cast",
)
def_clear(
    [
        "stop_gradient",
        "optimization_barrier",
        "device_put",
        "sharding_constraint",
        "reshard",
        "layout_constraint",
        "with_memory_space_constraint",
        "pvary",
        "pbroadcast",
        "pin",
        "unpin",
        "tie",
        "freeze",
        "stage",
        "name",
        "dce_sink",
        "shape_assertion",
        "check",
        "unreachable",
        "inspect_sharding",
        "zeros_like",
        "empty",
        "empty2",
        "create_token",
        "after_all",
        "dim_as_value",
        "dimension_size",
        "platform_index",
        "to_edtype",
        "from_edtype",
        "custom_lin",
        "mul_transpose",
        "xla_metadata_value",
        "relayout",
        "program_order",
    ],
    "identity-like, sharding, token or metadata op: no arithmetic",
)
def_clear(
    [
        "pmax",
        "pmin",
        "ppermute",
        "all_gather",
        "all_to_all",
        "ragged_all_to_all",
        "axis_index",
        "all_gather_invariant",
        "preduced",
        "psend",
        "precv",
        "all_gather_start",
        "all_gather_done",
        "all_gather_reduced",
        "all_gather_reduced_start",
        "all_to_all_start",
        "all_to_all_done",
        "pbroadcast_start",
        "pbroadcast_done",
        "ppermute_start",
        "ppermute_done",
        "psum_start",
        "psum_done",
        "psum_invariant_start",
        "reduce_scatter_start",
        "reduce_scatter_done",
        "unreduced_psum_start",
        "unreduced_reduce_scatter",
        "unreduced_reduce_scatter_start",
        "reduced_vary_cast_p",
        "vary_unreduced_cast_p",
        "reduced_vary_cast",
        "vary_unreduced_cast",
        "pbroadcast_dynamic",
        "unreduced_pmax",
        "unreduced_pmin",
        "host_local_array_to_global_array",
        "global_array_to_host_local_array",
    ],
    "collective that moves or selects values without arithmetic (or an "
    "asynchronous/replication-type cast): communicates the dtype it receives",
)
def_clear(
    [
        "get",
        "swap",
        "addupdate",
        "new_ref",
        "empty_ref",
        "free_ref",
        "accum_grad_in_ref",
        "new_box",
        "box_get",
        "box_set",
        "new_log",
        "log_extend",
        "log_read",
        "create_linear",
    ],
    "mutable ref / box / log op: the ref's dtype is fixed by its allocation",
)
def_clear(
    [
        "program_id",
        "num_programs",
        "masked_load",
        "masked_swap",
        "multiple_of",
        "run_scoped",
        "semaphore_read",
        "semaphore_signal",
        "semaphore_wait",
        "delay",
        "get_global",
    ],
    "Pallas kernel-body primitive: autocast never enters a pallas_call kernel",
)
def_clear(
    [
        "ffi_call",
        "pallas_call",
        "core_map",
        "tpu_custom_call",
        "call_exported",
        "cudnn_fusion",
        "dot_product_attention_fwd",
        "dot_product_attention_bwd",
        "dot_product_attention_fwd_wrapper",
        "dot_product_attention_bwd_wrapper",
        "dot_product_attention_fp8_fwd",
        "dot_product_attention_fp8_bwd",
        "dot_product_attention_fp8_fwd_wrapper",
        "dot_product_attention_fp8_bwd_wrapper",
        "scaled_dot",
        "scaled_matmul",
        "scaled_matmul_wrapper",
        "pure_callback",
        "io_callback",
        "debug_callback",
        "debug_print",
        "buffer_callback",
        "mosaic_gpu_p",
    ],
    "opaque kernel or host callback, compiled/written for exact input dtypes: "
    "runs at the dtypes it was traced with (inputs are cast back)",
    flags=[OPAQUE],
)

def_clear(
    [
        "bcoo_dot_general",
        "bcoo_dot_general_sampled",
        "bcoo_extract",
        "bcoo_fromdense",
        "bcoo_sort_indices",
        "bcoo_spdot_general",
        "bcoo_sum_duplicates",
        "bcoo_todense",
        "bcoo_transpose",
        "bcsr_dot_general",
        "bcsr_extract",
        "bcsr_fromdense",
        "bcsr_todense",
        "coo_fromdense",
        "coo_matmat",
        "coo_matvec",
        "coo_spmm",
        "coo_spmv",
        "coo_todense",
        "csr_fromdense",
        "csr_matmat",
        "csr_matvec",
        "csr_spmm",
        "csr_spmv",
        "csr_todense",
        "todense",
        "spsolve",
    ],
    "jax.experimental.sparse op: sparse kernels (cuSPARSE, scatter-based CPU "
    "code) are written for float32 data; runs at the dtypes it was traced with",
    flags=[OPAQUE],
)

#: Modules whose primitives exist only inside a kernel (Pallas, Mosaic): they
#: appear in the body of a ``pallas_call``/``core_map``, which autocast never
#: enters (``pallas_call`` is opaque), so they need no entry of their own; an
#: unknown primitive met anyway runs as written (``strict=True``: raises).
KERNEL_LANGUAGE_MODULES: Final[tuple[str, ...]] = (
    "jax._src.pallas",
    "jax.experimental.pallas",
    "jax._src.tpu_custom_call",
    "jax.experimental.mosaic",
)

# ----------------------------------------------------------------- roles
add_flags(
    [
        "reduce_sum",
        "reduce_max",
        "reduce_min",
        "reduce_prod",
        "psum",
        "psum_invariant",
        "pmax",
        "pmin",
    ],
    STATISTIC,
)
add_flags(["add", "sub"], EPILOGUE, ADDITIVE)
add_flags(["select_n", "max", "min", "clamp"], FILL)
add_flags(
    ["add", "add_any", "sub", "mul", "max", "min", "clamp", "select_n"],
    KEEPS_MAGNITUDE,
)

# ----------------------------------------------------------- higher-order
def_higher_order(
    [
        "jit",
        "pjit",  # jit's primitive in older JAX releases
        "closed_call",
        "core_call",
        "call",
        "remat2",
        "checkpoint",
        "remat_opt",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "custom_jvp_call_jaxpr",
        "custom_linear_solve",
        "custom_vmap_call",
        "custom_transpose_call",
        "linear_call",
        "cond",
        "while",
        "scan",
        "shard_map",
        "custom_partitioning",
        "composite",
        "eval_jaxpr",
        "jaxpr_call",
        "mpmd_map",
        "run_state",
        "reduce",
        "reduce_window",
        "select_and_scatter",
        "call_hi_primitive",
        "call_hi_primitive_linearized",
        "compute_on",
        "xla_metadata_call",
    ],
    "higher-order primitive: the interpreter decides its body equation by equation",
)

# ------------------------------------------------------------- composites
# Composites JAX emits as a named nested `jit` (or `custom_jvp`) defined in JAX's
# own source (checked with jax.make_jaxpr on JAX 0.10.2). Inlined functions
# (jax.nn.softmax, logsumexp, jnp.mean, the Flax/Equinox/Haiku norms, optax's
# integer-label cross-entropy) have no composite: their exp, reduce_sum, log and
# rsqrt are denied one by one, which keeps their statistics in float32.
_COMPOSITE_TABLE: dict[str, tuple[tuple[str, ...], str]] = {
    "log_softmax": (
        ("log_softmax",),
        f"jax.nn.log_softmax (also inside optax.softmax_cross_entropy): "
        f"x - max - log(sum(exp)): {_PT} fp32 (log_softmax), {_APEX} FP32_FUNCS",
    ),
    "softplus": (
        ("softplus",),
        f"jax.nn.softplus, log(1 + exp(x)): {_PT} fp32 (softplus), {_APEX} FP32_FUNCS",
    ),
    "log_sigmoid": (
        ("log_sigmoid",),
        "jax.nn.log_sigmoid (optax.sigmoid_binary_cross_entropy): -softplus(-x): "
        f"{_PT} fp32 (binary_cross_entropy_with_logits)",
    ),
    "logaddexp": (
        ("logaddexp",),
        "jnp.logaddexp: max + log1p(exp(-|a - b|)), exp + log like logsumexp "
        f"({_PT} fp32: logsumexp)",
    ),
    "standardize": (
        ("standardize",),
        "jax.nn.standardize: mean/variance + rsqrt, a layer norm without scale "
        f"({_APEX} FP32_FUNCS: normalize)",
    ),
    "norm": (
        ("norm",),
        f"jnp.linalg.norm / matrix_norm: {_PT} fp32 (linalg_vector_norm, "
        f"frobenius_norm), {_APEX} FP32_FUNCS (norm)",
    ),
    "var": (
        ("_var", "nanvar"),
        f"jnp.var / nanvar: cancellation-prone: {_APEX} FP32_FUNCS (var)",
    ),
    "std": (
        ("_std", "nanstd"),
        f"jnp.std / nanstd: {_APEX} FP32_FUNCS (std)",
    ),
    "cov": (
        ("cov", "corrcoef"),
        "jnp.cov / corrcoef: centred products and their means (variance-like)",
    ),
}
for _name, (_functions, _reason) in _COMPOSITE_TABLE.items():
    _ops[_name] = OpSpec(_name, "deny", "composite: " + _reason, composite=_functions)

#: Composite names (all deny by default).
COMPOSITES: Final[frozenset[str]] = frozenset(_COMPOSITE_TABLE)
_COMPOSITE_BY_FUNCTION: Final[dict[str, str]] = {
    f: c for c, (fs, _) in _COMPOSITE_TABLE.items() for f in fs
}
_JAX_DIR: Final = os.path.dirname(os.path.abspath(jax.__file__)) + os.sep


def composite_for_function(jaxpr: Any) -> str | None:
    """The composite a nested function stands for, if JAX itself emitted it.

    ``jaxpr`` is the body of a nested ``jit``/``custom_jvp``/``custom_vjp``
    equation. It is a composite when its function name is one of a composite's
    functions and the function is defined inside the installed JAX package:
    a user's own ``@jax.jit def norm(...)`` or a layer named ``"mean"`` is not.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> eqn = jax.make_jaxpr(jnp.var)(jnp.ones(3)).eqns[0]
        >>> composite_for_function(eqn.params["jaxpr"])
        'var'
        >>> @jax.jit
        ... def norm(x):
        ...     return x * 2.0
        >>> eqn = jax.make_jaxpr(norm)(jnp.ones(3)).eqns[0]
        >>> composite_for_function(eqn.params["jaxpr"]) is None
        True
    """
    found = _compat.jaxpr_function(jaxpr)
    if found is None:
        return None
    name, path = found
    comp = _COMPOSITE_BY_FUNCTION.get(name)
    if comp is None or not os.path.abspath(path).startswith(_JAX_DIR):
        return None
    return comp


# ------------------------------------------------------------------ op lists


@dataclasses.dataclass(frozen=True, init=False)
class OpLists:
    """The allow / deny / infer / clear lists autocast uses (immutable).

    Names are JAX primitive names (``prim.name``: ``"dot_general"``, ``"exp"``,
    ``"add"``) or composite names (``"log_softmax"``, ``"var"``). A name is in
    at most one list. The defaults come from the op table; edit a copy with
    :func:`mixprec.modify_mixlist`.

    Args:
        allow: run in the low dtype (white list).
        deny: run in float32 (black list).
        infer: follow the operands (gray list).
        clear: dtype-transparent.

    Examples:
        >>> import mixprec
        >>> lists = mixprec.default_op_lists()
        >>> lists.classify("dot_general"), lists.classify("exp")
        ('allow', 'deny')
        >>> lists.classify("add"), lists.classify("reshape")
        ('infer', 'clear')
        >>> lists.classify("log_softmax")
        'deny'
    """

    allow: frozenset[str]
    deny: frozenset[str]
    infer: frozenset[str]
    clear: frozenset[str]

    def __init__(
        self,
        allow: Iterable[str] = (),
        deny: Iterable[str] = (),
        infer: Iterable[str] = (),
        clear: Iterable[str] = (),
    ) -> None:
        seen: dict[str, str] = {}
        for field, value in zip(OP_CLASSES, (allow, deny, infer, clear), strict=True):
            if isinstance(value, str) or not isinstance(value, Iterable):
                raise TypeError(
                    f"`OpLists({field}=...)` must be a collection of op names, got "
                    f"{type(value).__name__} instead."
                )
            names = frozenset(value)
            for name in names:
                if not isinstance(name, str):
                    raise TypeError(
                        f"`OpLists({field}=...)` must contain op names (str), got "
                        f"{name!r} instead."
                    )
                if name in seen:
                    raise ValueError(
                        f"`OpLists`: op {name!r} is in both `{seen[name]}` and "
                        f"`{field}`; an op belongs to one list."
                    )
                seen[name] = field
            object.__setattr__(self, field, names)
        object.__setattr__(self, "_index", seen)

    def __repr__(self) -> str:
        parts = []
        for field in OP_CLASSES:
            names = sorted(getattr(self, field))
            shown = ", ".join(repr(n) for n in names[:4])
            more = f", ... ({len(names)} names)" if len(names) > 4 else ""
            parts.append(f"{field}=[{shown}{more}]")
        return f"OpLists({', '.join(parts)})"

    def __hash__(self) -> int:
        return hash((self.allow, self.deny, self.infer, self.clear))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, OpLists):
            return NotImplemented
        return (self.allow, self.deny, self.infer, self.clear) == (
            other.allow,
            other.deny,
            other.infer,
            other.clear,
        )

    def classify(self, name: str, *, strict: bool = False) -> OpClass:
        """Returns the class of the op called ``name``.

        Higher-order primitives report ``"clear"`` (their bodies are classified
        op by op). Unknown names are ``"infer"`` unless ``strict``.

        Args:
            name: a primitive name (``prim.name``) or a composite name.
            strict: raise for a name in no list instead of returning ``"infer"``.

        Returns:
            ``"allow"``, ``"deny"``, ``"infer"`` or ``"clear"``.

        Raises:
            NotImplementedError: ``strict`` and ``name`` is in no list.

        Examples:
            >>> import mixprec
            >>> mixprec.default_op_lists().classify("conv_general_dilated")
            'allow'
            >>> mixprec.default_op_lists().classify("scan")
            'clear'
            >>> mixprec.default_op_lists().classify("my_custom_op")
            'infer'
        """
        found = self._index.get(name)  # type: ignore[attr-defined]
        if found is not None:
            return found
        spec = _ops.get(name)
        if spec is not None and spec.is_higher_order:
            return "clear"
        if strict:
            raise NotImplementedError(
                f"No precision class for primitive {name!r}: it is in no op list."
                f"{suggest(name, self.names())} Add it with "
                "`mixprec.modify_mixlist(lists, {'white-list': {'to-add': "
                f"[{name!r}]}})` or register a rule with `mixprec.register_rule`."
            )
        return "infer"

    def names(self) -> frozenset[str]:
        """Returns every name in the four lists.

        Examples:
            >>> import mixprec
            >>> "exp" in mixprec.default_op_lists().names()
            True
        """
        return self.allow | self.deny | self.infer | self.clear

    def as_dict(self) -> dict[str, list[str]]:
        """Returns ``{"allow": [...], "deny": [...], ...}`` with sorted names.

        Examples:
            >>> import mixprec
            >>> mixprec.default_op_lists().as_dict()["allow"][:2]
            ['conv_general_dilated', 'dot_general']
        """
        return {c: sorted(getattr(self, c)) for c in OP_CLASSES}


_default_lists: list[tuple[int, OpLists]] = []


def _table_lists() -> OpLists:
    """The lists as the table classifies each op, made again only when the
    table has grown (a rule module defines a fusion's entry when imported)."""
    if not _default_lists or _default_lists[0][0] != len(_ops):
        lists = OpLists(
            **{
                c: [s.name for s in _ops.values() if s.op_class == c]  # type: ignore[misc]
                for c in OP_CLASSES
            }
        )
        _default_lists[:] = [(len(_ops), lists)]
    return _default_lists[0][1]


def default_op_lists() -> OpLists:
    """Returns the default op lists, as the op table classifies each op.

    Returns:
        The :class:`OpLists`.

    Examples:
        >>> import mixprec
        >>> lists = mixprec.default_op_lists()
        >>> "dot_general" in lists.allow and "log_softmax" in lists.deny
        True
    """
    return _table_lists()


def class_table() -> list[tuple[str, str, str, tuple[str, ...]]]:
    """``(name, class, reason, flags)`` for every op in the table, by name.

    Higher-order primitives have class ``"higher-order"``. The Markdown op table
    in the docs is generated from these rows (``tools/gen_op_table.py``).

    Examples:
        >>> rows = {name: (cls, flags) for name, cls, _, flags in class_table()}
        >>> rows["exp"], rows["square"], rows["scan"][0]
        (('deny', ()), ('deny', ('narrow_range',)), 'higher-order')
    """
    return [
        (
            s.name,
            "higher-order" if s.op_class is None else s.op_class,
            s.reason,
            tuple(sorted(s.flags)),
        )
        for s in all_specs()
    ]
