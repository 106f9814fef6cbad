"""Default op lists for autocast: which JAX primitive runs in which precision.

Every primitive name is in exactly one of four classes (the Ascend seed's
white / black / gray lists plus TensorFlow AMP's "clear" list):

* ``allow`` (white): numerically safe and faster in 16-bit; run in the low dtype.
  Matrix multiplies and convolutions (PyTorch autocast ``lower_precision_fp``,
  TensorFlow AMP allow list, Apex O1 ``FP16_FUNCS``).
* ``deny`` (black): needs float32 range or precision; run in float32. Exponentials,
  logarithms, powers, long reductions, cumulative sums, special functions, linear
  algebra (PyTorch autocast ``fp32`` list, TensorFlow AMP deny list, Apex
  ``FP32_FUNCS``), and the composites softmax, norms and losses.
* ``infer`` (gray): follow the upstream op: low precision if an input arrives in
  the low dtype, else float32. Elementwise arithmetic and activations (TensorFlow
  AMP infer list; PyTorch autocast runs these at their input dtype, and
  ``promote`` ops at the widest input dtype).
* ``clear``: dtype-transparent. Data movement, comparisons, max/min reductions,
  integer and bit ops, random bits, collectives (TensorFlow AMP clear list).

Higher-order primitives (``jit``, ``scan``, ``while``, ``cond``, ``custom_jvp_call``,
``shard_map``, ...) are not classified by precision: the interpreter recurses into
their bodies. They are listed in :data:`HIGHER_ORDER` and :meth:`OpLists.classify`
reports them as ``"clear"``.

Composite ops (softmax, layer norm, cross-entropy, ...) are not primitives in JAX.
They are recognised by name with :func:`composite_for` (a nested ``jit`` name, a
``jax.named_scope``, or a Flax/Equinox/Haiku module scope in the equation's name
stack) and are denied by default.

Run ``python tools/gen_op_table.py`` to regenerate ``docs/op_table.md``.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import sys
from collections.abc import Iterable
from typing import Literal

from mixprec._src._errors import suggest


OpClass = Literal["allow", "deny", "infer", "clear"]
OP_CLASSES: tuple[OpClass, ...] = ("allow", "deny", "infer", "clear")

# Sources named in the reasons.
_PT = "PyTorch autocast"
_TF = "TF AMP"
_APEX = "Apex O1"

# One row per name: (class, reason). Built by the helpers below so that each
# family of primitives shares one documented reason.
_TABLE: dict[str, tuple[OpClass, str]] = {}
_HIGHER_ORDER: dict[str, str] = {}


def _def(cls: OpClass, names: Iterable[str], reason: str) -> None:
    for name in names:
        if name in _TABLE or name in _HIGHER_ORDER:
            raise RuntimeError(f"op_lists: {name!r} classified twice")
        _TABLE[name] = (cls, reason)


def _def_hop(names: Iterable[str], reason: str) -> None:
    for name in names:
        if name in _TABLE or name in _HIGHER_ORDER:
            raise RuntimeError(f"op_lists: {name!r} classified twice")
        _HIGHER_ORDER[name] = reason


# --------------------------------------------------------------------- allow
_def(
    "allow",
    ["dot_general"],
    f"matmul/einsum: {_PT} lower_precision_fp (matmul, mm, bmm, linear, einsum), "
    f"{_TF} allow (MatMul, BatchMatMulV2, Einsum), {_APEX} FP16_FUNCS (matmul, mm, "
    "addmm, linear); tensor cores and AVX512-BF16 accumulate in float32",
)
_def(
    "allow",
    ["conv_general_dilated"],
    f"convolution: {_PT} lower_precision_fp (conv1d/2d/3d, conv_transpose*), "
    f"{_TF} allow (Conv2D, Conv3D and their backprops), {_APEX} FP16_FUNCS "
    "(conv*, conv_transpose*)",
)
_def(
    "allow",
    ["ragged_dot_general"],
    f"grouped (MoE) matmul: a batch of matmuls ({_PT} lower_precision_fp: bmm, "
    f"baddbmm; {_TF} allow: BatchMatMulV2)",
)

# ---------------------------------------------------------------------- deny
_def(
    "deny",
    ["exp", "exp2", "expm1"],
    f"exponential overflows 16-bit range (exp(12) > float16 max): {_PT} fp32 "
    f"(exp, expm1), {_TF} deny (Exp, Expm1), {_APEX} FP32_FUNCS (exp, expm1)",
)
_def(
    "deny",
    ["log", "log1p"],
    f"logarithm of small values / near 1 loses precision: {_PT} fp32 (log, "
    f"log1p, log2, log10), {_APEX} FP32_FUNCS (log, log2, log10); {_TF} has "
    "Log/Log1p in infer, two of three say float32",
)
_def(
    "deny",
    ["pow", "integer_pow"],
    f"powers overflow/underflow 16-bit range: {_PT} fp32 (pow), {_TF} deny (Pow), "
    f"{_APEX} FP32_FUNCS (pow)",
)
_def(
    "deny",
    ["rsqrt"],
    f"reciprocal square root of small variances (norms): {_PT} fp32 (rsqrt), "
    f"{_APEX} FP32_FUNCS (rsqrt)",
)
_def(
    "deny",
    ["reciprocal"],
    f"1/x overflows float16 for |x| < 2^-16: {_PT} fp32 (reciprocal), {_APEX} "
    f"FP32_FUNCS (reciprocal); {_TF} has Reciprocal/Inv in infer",
)
_def(
    "deny",
    ["reduce_sum"],
    f"long accumulation loses precision: {_PT} fp32 (sum), {_TF} deny (Sum, "
    f"Mean, L2Loss), {_APEX} FP32_FUNCS (sum)",
)
_def(
    "deny",
    ["reduce_prod"],
    f"long product over/underflows: {_PT} fp32 (prod), {_APEX} FP32_FUNCS (prod); "
    f"{_TF} has Prod in infer",
)
_def(
    "deny",
    ["cumsum", "cumprod", "cumlogsumexp"],
    f"cumulative accumulation: {_PT} fp32 (cumsum, cumprod, logsumexp), {_APEX} "
    "FP32_FUNCS (cumsum, cumprod); cumlogsumexp is exp + sum + log",
)
_def(
    "deny",
    ["acos", "asin", "cosh", "sinh", "tan"],
    f"steep or large-valued trigonometric/hyperbolic function: {_PT} fp32 (acos, "
    f"asin, cosh, sinh, tan), {_APEX} FP32_FUNCS (same)",
)
_def(
    "deny",
    ["acosh", "asinh", "atanh"],
    "inverse hyperbolic functions are logarithms (log(x + sqrt(x^2 +- 1)), "
    f"log((1+x)/(1-x))/2): deny like log ({_PT} fp32, {_APEX} FP32_FUNCS); none "
    "of the three lists them",
)
_def(
    "deny",
    ["erf_inv"],
    f"inverse error function diverges at +-1: {_PT} fp32 (erfinv), {_APEX} "
    "FP32_FUNCS (erfinv)",
)
_def(
    "deny",
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
    ],
    "special function (or gamma sampler) evaluated with series/recurrences of "
    f"exp, log and pow: float32 like those; not in {_PT}'s or {_APEX}'s 16-bit "
    f"lists, and {_TF} leaves unlisted ops in float32",
)
_def(
    "deny",
    ["fft"],
    f"FFT: {_PT} CPU fp32 (fft_fft, fft_rfft, ...); complex results have no 16-bit "
    "dtype in JAX: cannot run in 16-bit",
)
_def(
    "deny",
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
    "linalg_inv); LAPACK/cuSOLVER have no 16-bit kernels: cannot run in 16-bit",
)
_def(
    "deny",
    ["complex"],
    "builds complex64 from two float32 arrays; JAX has no 16-bit complex dtype: "
    "cannot run in 16-bit",
)

# --------------------------------------------------------------------- infer
_def(
    "infer",
    ["add", "add_any", "sub", "mul"],
    f"elementwise arithmetic: {_TF} infer (Add, AddV2, AddN, BiasAdd, Sub, Mul); "
    f"{_APEX} CASTS (add, mul); {_PT} runs it at the input dtype. A float32 "
    "parameter or literal operand follows the half one (bias add)",
)
_def(
    "infer",
    ["div", "rem"],
    f"division: {_TF} infer (RealDiv, FloorDiv), {_APEX} CASTS (div); {_PT} "
    "runs it at the input dtype",
)
_def(
    "infer",
    ["max", "min"],
    f"elementwise max/min (relu, clipping): {_TF} clear (Maximum, Minimum, Relu); "
    "gray here (DESIGN.md) so a float32 literal, e.g. relu's 0, follows the half "
    "operand",
)
_def(
    "infer",
    ["clamp"],
    f"clip: {_TF} clear (ClipByValue); gray so float32 bounds follow the operand",
)
_def(
    "infer",
    ["select_n"],
    f"where/select: {_TF} clear (Select, SelectV2); gray here (DESIGN.md) so a "
    "float32 literal branch, e.g. jnp.where(x > 0, x, 0.), follows the half one",
)
_def(
    "infer",
    ["atan2"],
    f"two-operand elementwise: {_PT} promote (atan2), {_APEX} CASTS (atan2)",
)
_def(
    "infer",
    ["tanh", "logistic"],
    f"bounded activation: {_TF} infer (Tanh, Sigmoid and their grads); {_PT} "
    "runs it at the input dtype",
)
_def(
    "infer",
    ["sqrt"],
    f"square root: {_TF} infer (Sqrt); {_PT} runs it at the input dtype",
)
_def(
    "infer",
    ["square", "cbrt"],
    f"elementwise like mul / sqrt; not listed by {_PT}, {_TF} or {_APEX} (PyTorch "
    "runs them at the input dtype)",
)
_def(
    "infer",
    ["erf", "erfc"],
    f"error function (GELU): {_TF} infer (Erf, Erfc); {_PT} runs it at the input dtype",
)
_def(
    "infer",
    ["sin", "cos", "atan"],
    f"bounded trigonometric function: {_PT} runs it at the input dtype (its fp32 "
    "list has only tan, asin, acos)",
)
_def(
    "infer",
    ["reduce_window_sum"],
    f"average pooling (a short windowed sum): {_TF} infer (AvgPool, AvgPool3D); "
    f"{_PT} runs avg_pool2d at the input dtype",
)
_def(
    "infer",
    ["scatter-add", "scatter-sub", "scatter-mul"],
    f"scatter with arithmetic: {_PT} promote (scatter_add, index_put)",
)

# --------------------------------------------------------------------- clear
_def(
    "clear",
    [
        "reshape",
        "squeeze",
        "broadcast_in_dim",
        "broadcast_to",
        "transpose",
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
        "copy",
        "iota",
        "stack",
        "unstack",
    ],
    f"data movement, no arithmetic: {_TF} clear (Reshape, Squeeze, ExpandDims, "
    "BroadcastTo, Transpose, ReverseV2, Slice, StridedSlice, GatherV2, ConcatV2, "
    f"Pack, Pad, Split, Tile, Identity, Fill); {_APEX} SEQUENCE_CASTS (cat, "
    "stack) take the widest dtype when operands differ, as here",
)
_def(
    "clear",
    ["convert_element_type", "bitcast_convert_type", "reduce_precision"],
    "explicit dtype conversion written by the user: kept exactly as written "
    "(move it to a list with modify_mixlist, as the seed does with 'Cast')",
)
_def(
    "clear",
    ["abs", "neg", "sign", "floor", "ceil", "round", "nextafter", "is_finite"],
    f"exact in any float format (sign/magnitude/rounding/classification): {_TF} "
    "clear (Abs, Neg, Sign, Floor, Ceil, Round, IsFinite)",
)
_def(
    "clear",
    ["real", "imag", "conj"],
    "complex parts: exact; complex values are never lowered",
)
_def(
    "clear",
    ["eq", "ne", "lt", "le", "gt", "ge", "eq_to", "le_to", "lt_to"],
    f"comparison: boolean output, exact in any float format: {_TF} clear "
    f"(Equal, NotEqual, Less, Greater, ...); {_APEX} CASTS (eq, lt, ...: widest "
    "dtype when operands differ, as here)",
)
_def(
    "clear",
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
    ],
    f"max/min selection (and max-pool gradients): exact in any float format; "
    f"{_TF} clear (Max, Min, ArgMax, ArgMin, MaxPool, MaxPoolGrad)",
)
_def(
    "clear",
    ["sort", "top_k", "approx_top_k"],
    f"sorting/selection: exact in any float format; {_TF} clear (TopK, TopKV2)",
)
_def(
    "clear",
    [
        "reduce",
        "reduce_window",
        "select_and_scatter",
        "reduce_and",
        "reduce_or",
        "reduce_xor",
    ],
    "generic/boolean reductions: the reducer is typed to the operand dtype; run "
    "at the dtype received",
)
_def(
    "clear",
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
_def(
    "clear",
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
_def(
    "clear",
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
    ],
    "identity-like, sharding, token or metadata op: no arithmetic",
)
_def(
    "deny",
    ["psum", "psum_invariant", "unreduced_psum", "reduce_scatter"],
    "cross-device sum: accumulates like reduce_sum, so float32 (a bf16 pmean of "
    "1.2 over 8 devices gave 1.203); gradient all-reduces in the backward pass "
    "are JAX's transposes and are not affected",
)
_def(
    "clear",
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
    ],
    "collective that moves or selects values without arithmetic: communicates "
    "the dtype it receives",
)
_def(
    "clear",
    [
        "get",
        "swap",
        "addupdate",
        "new_ref",
        "empty_ref",
        "free_ref",
        "accum_grad_in_ref",
        "run_state",
    ],
    "mutable-ref (state) op: the ref's dtype is fixed by its allocation",
)

_def(
    "clear",
    [
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
    ],
    "asynchronous collective / replication-type cast: like the synchronous "
    "collectives, communicates the dtype it receives",
)
_def(
    "clear",
    [
        "new_box",
        "box_get",
        "box_set",
        "new_log",
        "log_extend",
        "log_read",
        "create_linear",
    ],
    "mutable box / log / linearity bookkeeping: no arithmetic",
)
_def(
    "clear",
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
    "Pallas kernel-body primitive: autocast never enters a pallas_call kernel "
    "(see OPAQUE)",
)

# Opaque kernels and host callbacks: compiled for (or written against) exact
# input dtypes, so they must run at the dtypes of the original jaxpr. They are
# "clear" (never lowered or raised by a list or a mode); the interpreter casts
# their inputs back to the equation's original input avals.
_OPAQUE_REASON = (
    "opaque kernel or host callback, compiled/written for exact input dtypes: "
    "runs at the original jaxpr's dtypes (inputs are cast back)"
)
_def(
    "clear",
    [
        "ffi_call",
        "pallas_call",
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
    ],
    _OPAQUE_REASON,
)

# ------------------------------------------------------------- higher-order
_def_hop(
    [
        "jit",
        "pjit",  # the name of jit's primitive in older JAX releases
        "closed_call",
        "call",
        "remat2",
        "remat_opt",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_jvp_call_jaxpr",
        "custom_linear_solve",
        "custom_vmap_call",
        "linear_call",
        "cond",
        "while",
        "scan",
        "shard_map",
        "custom_partitioning",
        "composite",
        "eval_jaxpr",
        "core_map",
        "jaxpr_call",
        "mpmd_map",
        "call_hi_primitive",
        "call_hi_primitive_linearized",
    ],
    "higher-order primitive: the interpreter transforms its body equation by "
    "equation and rebinds it",
)

# Composites: recognised by name (see composite_for); all denied by default.
_COMPOSITE_REASONS: dict[str, str] = {
    "softmax": f"exp + sum + div: {_PT} fp32 (softmax), {_APEX} FP32_FUNCS "
    f"(softmax, softmin); {_TF} has Softmax in infer",
    "log_softmax": f"exp + sum + log: {_PT} fp32 (log_softmax), {_APEX} FP32_FUNCS "
    f"(log_softmax); {_TF} has LogSoftmax in infer",
    "logsumexp": f"exp + sum + log: {_PT} fp32 (logsumexp)",
    "log_sigmoid": "-softplus(-x), the core of sigmoid cross-entropy: "
    f"{_PT} fp32 (softplus, binary_cross_entropy_with_logits)",
    "softplus": f"log(1 + exp(x)): {_PT} fp32 (softplus), {_APEX} FP32_FUNCS "
    f"(softplus); {_TF} has Softplus in infer",
    "layer_norm": f"mean/variance + rsqrt: {_PT} fp32 (layer_norm, "
    f"native_layer_norm), {_APEX} FP32_FUNCS (layer_norm)",
    "rms_norm": f"mean of squares + rsqrt, a layer norm without centring: "
    f"float32 like layer_norm ({_PT} fp32, {_APEX} FP32_FUNCS)",
    "group_norm": f"mean/variance + rsqrt: {_PT} fp32 (group_norm), {_APEX} "
    "FP32_FUNCS (group_norm)",
    "batch_norm": f"batch statistics: {_TF} FusedBatchNormV3 (infer) and cuDNN "
    f"under {_PT}/{_APEX} keep the statistics in float32; in JAX they are plain "
    "reductions, so the composite runs in float32",
    "standardize": "jax.nn.standardize: mean/variance + rsqrt, a layer norm "
    f"without scale ({_APEX} FP32_FUNCS: normalize)",
    "norm": f"vector/matrix norm: {_PT} fp32 (linalg_vector_norm, frobenius_norm, "
    f"dist, cdist), {_APEX} FP32_FUNCS (norm, dist, normalize)",
    "mean": f"long reduction: {_TF} deny (Mean); ({_APEX} dropped mean from "
    "FP32_FUNCS since torch accumulates it in float32, which is what deny does "
    "here)",
    "var": f"variance, cancellation-prone: {_APEX} FP32_FUNCS (var)",
    "std": f"standard deviation: {_APEX} FP32_FUNCS (std)",
    "cross_entropy": f"log_softmax + sum: {_PT} fp32 (cross_entropy_loss on CPU, "
    f"nll_loss, log_softmax), {_TF} deny (SoftmaxCrossEntropyWithLogits, "
    f"SparseSoftmaxCrossEntropyWithLogits), {_APEX} FP32_FUNCS (cross_entropy, "
    "nll_loss)",
    "binary_cross_entropy": f"log_sigmoid + mean: {_PT} fp32 "
    f"(binary_cross_entropy_with_logits), {_APEX} FP32_FUNCS (same)",
    "kl_divergence": f"log + sum: {_PT} fp32 (kl_div), {_APEX} FP32_FUNCS (kl_div)",
    "mse_loss": f"squared error + mean: {_PT} fp32 (mse_loss, l1_loss, "
    f"huber_loss, smooth_l1_loss), {_TF} deny (L2Loss), {_APEX} FP32_FUNCS "
    "(mse_loss)",
}
for _name, _reason in _COMPOSITE_REASONS.items():
    _def("deny", [_name], "composite: " + _reason)

#: Composite op names recognised by :func:`composite_for` (all in :data:`DENY`).
COMPOSITES: frozenset[str] = frozenset(_COMPOSITE_REASONS)
#: Higher-order primitive names; the interpreter recurses into their bodies.
HIGHER_ORDER: frozenset[str] = frozenset(_HIGHER_ORDER)
#: Default allow (white) list: run in the low dtype.
ALLOW: frozenset[str] = frozenset(n for n, (c, _) in _TABLE.items() if c == "allow")
#: Default deny (black) list: run in float32.
DENY: frozenset[str] = frozenset(n for n, (c, _) in _TABLE.items() if c == "deny")
#: Default infer (gray) list: follow the upstream op.
INFER: frozenset[str] = frozenset(n for n, (c, _) in _TABLE.items() if c == "infer")
#: Default clear list: dtype-transparent.
CLEAR: frozenset[str] = frozenset(n for n, (c, _) in _TABLE.items() if c == "clear")
#: Why each name is in its class (sources: PyTorch autocast, TF AMP, Apex O1).
REASONS: dict[str, str] = {n: r for n, (_, r) in _TABLE.items()} | dict(_HIGHER_ORDER)

#: Ops that cannot run in 16-bit (no 16-bit kernels or dtype, or host code);
#: ``force_fp16`` keeps them in float32.
FULL_PRECISION_ONLY: frozenset[str] = frozenset(
    n for n, (_, r) in _TABLE.items() if "cannot run in 16-bit" in r
)

#: Opaque kernels and host callbacks (class "clear"): the interpreter must run
#: them at the original jaxpr's input dtypes, never at lowered ones.
OPAQUE: frozenset[str] = frozenset(
    n for n, (_, r) in _TABLE.items() if r == _OPAQUE_REASON
)

#: Every name autocast knows: the four classes plus the higher-order primitives.
KNOWN_NAMES: frozenset[str] = frozenset(_TABLE) | HIGHER_ORDER


@dataclasses.dataclass(frozen=True, init=False)
class OpLists:
    """The allow / deny / infer / clear lists autocast uses (immutable).

    Names are JAX primitive names (``prim.name``: ``"dot_general"``, ``"exp"``,
    ``"add"``) or composite names (``"softmax"``, ``"layer_norm"``). A name is in at
    most one list. Edit a copy with :func:`mixprec.modify_mixlist` or
    :func:`dataclasses.replace`.

    Args:
        allow: run in the low dtype (white list).
        deny: run in float32 (black list).
        infer: follow the upstream op (gray list).
        clear: dtype-transparent.

    Examples:
        >>> lists = default_op_lists()
        >>> lists.classify("dot_general"), lists.classify("exp")
        ('allow', 'deny')
        >>> lists.classify("add"), lists.classify("reshape")
        ('infer', 'clear')
        >>> lists.classify("softmax")
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

    def __repr__(self) -> str:
        parts = []
        for field in OP_CLASSES:
            names = sorted(getattr(self, field))
            shown = ", ".join(repr(n) for n in names[:4])
            more = f", ... ({len(names)} names)" if len(names) > 4 else ""
            parts.append(f"{field}=[{shown}{more}]")
        return f"OpLists({', '.join(parts)})"

    def classify(self, name: str, *, strict: bool = False) -> OpClass:
        """Returns the class of the op called ``name``.

        Higher-order primitives report ``"clear"`` (their bodies are classified
        op by op). Unknown names are ``"infer"`` (follow the upstream op) unless
        ``strict``.

        Args:
            name: a primitive name (``prim.name``) or a composite name.
            strict: raise for a name in no list instead of returning ``"infer"``.

        Returns:
            ``"allow"``, ``"deny"``, ``"infer"`` or ``"clear"``.

        Raises:
            NotImplementedError: ``strict`` and ``name`` is in no list.

        Examples:
            >>> default_op_lists().classify("conv_general_dilated")
            'allow'
            >>> default_op_lists().classify("scan")
            'clear'
            >>> default_op_lists().classify("my_custom_op")
            'infer'
        """
        if name in self.allow:
            return "allow"
        if name in self.deny:
            return "deny"
        if name in self.infer:
            return "infer"
        if name in self.clear or name in HIGHER_ORDER:
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
            >>> "exp" in default_op_lists().names()
            True
        """
        return self.allow | self.deny | self.infer | self.clear

    def as_dict(self) -> dict[str, list[str]]:
        """Returns ``{"allow": [...], "deny": [...], ...}`` with sorted names.

        Examples:
            >>> default_op_lists().as_dict()["allow"][:2]
            ['conv_general_dilated', 'dot_general']
        """
        return {c: sorted(getattr(self, c)) for c in OP_CLASSES}


def default_op_lists() -> OpLists:
    """Returns the default lists (:data:`ALLOW`, :data:`DENY`, :data:`INFER`,
    :data:`CLEAR`).

    Examples:
        >>> lists = default_op_lists()
        >>> lists.allow == ALLOW and "softmax" in lists.deny
        True
    """
    return _DEFAULT


_DEFAULT = OpLists(allow=ALLOW, deny=DENY, infer=INFER, clear=CLEAR)


# ---------------------------------------------------------------- composites
# How composites show up in jaxprs (checked with jax.make_jaxpr on JAX 0.10.2):
#   * a nested `jit` equation whose params["name"] is the Python function name:
#     jax.nn.log_softmax -> "log_softmax" (also inside optax.softmax_cross_entropy),
#     jnp.var -> "_var", jnp.std -> "_std" (containing "_var"),
#     jnp.linalg.norm -> "norm", jax.nn.softplus -> "softplus",
#     jax.nn.log_sigmoid -> "log_sigmoid" (in optax.sigmoid_binary_cross_entropy),
#     jax.nn.standardize -> "standardize".
#   * NOT wrapped (inlined primitives, no name): jax.nn.softmax,
#     jax.nn.logsumexp / jax.scipy.special.logsumexp, jnp.mean,
#     optax.softmax_cross_entropy_with_integer_labels, flax LayerNorm/RMSNorm,
#     equinox LayerNorm/RMSNorm, haiku LayerNorm. Their primitives are classified
#     one by one (exp, reduce_sum, log, rsqrt are denied, so they run in float32).
#   * a component of the equation's name stack (`eqn.source_info.name_stack`):
#     flax linen module paths ("Model/LayerNorm_0", "RMSNorm_0"), equinox
#     ("vmap(eqx.nn.LayerNorm)"), haiku module names ("layer_norm"), and any
#     user `jax.named_scope("softmax")`. nnx modules leave no name stack.
#   * custom_jvp_call has no function name in its params on 0.10.2 (jax.nn.relu's
#     wraps a jit named "relu"); its inner jit name is what is matched.
# Matching normalises a name: strips transform wrappers ("vmap(...)",
# "jvp(...)"), dotted module paths ("eqx.nn."), leading underscores and trailing
# "_<n>" instance numbers, converts CamelCase to snake_case, then looks it up in
# _ALIASES. Only exact matches count, so "softmax_layer" is not a softmax.
_ALIASES: dict[str, str] = {
    "softmax": "softmax",
    "softmin": "softmax",
    "log_softmax": "log_softmax",
    "logsumexp": "logsumexp",
    "log_sum_exp": "logsumexp",
    "reduce_logsumexp": "logsumexp",
    "log_sigmoid": "log_sigmoid",
    "softplus": "softplus",
    "layer_norm": "layer_norm",
    "layernorm": "layer_norm",
    "rms_norm": "rms_norm",
    "rmsnorm": "rms_norm",
    "group_norm": "group_norm",
    "groupnorm": "group_norm",
    "batch_norm": "batch_norm",
    "batchnorm": "batch_norm",
    "standardize": "standardize",
    "normalize": "standardize",
    "norm": "norm",
    "vector_norm": "norm",
    "matrix_norm": "norm",
    "mean": "mean",
    "var": "var",
    "variance": "var",
    "nanvar": "var",
    "std": "std",
    "nanstd": "std",
    "cross_entropy": "cross_entropy",
    "softmax_cross_entropy": "cross_entropy",
    "softmax_cross_entropy_with_integer_labels": "cross_entropy",
    "safe_softmax_cross_entropy": "cross_entropy",
    "sparse_softmax_cross_entropy": "cross_entropy",
    "poly_loss_cross_entropy": "cross_entropy",
    "nll_loss": "cross_entropy",
    "binary_cross_entropy": "binary_cross_entropy",
    "sigmoid_binary_cross_entropy": "binary_cross_entropy",
    "binary_cross_entropy_with_logits": "binary_cross_entropy",
    "kl_divergence": "kl_divergence",
    "kl_div": "kl_divergence",
    "mse_loss": "mse_loss",
    "l2_loss": "mse_loss",
    "squared_error": "mse_loss",
    "mean_squared_error": "mse_loss",
}
_WRAPPER = re.compile(r"^[A-Za-z_][\w]*\((.*)\)$")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
_INSTANCE = re.compile(r"_\d+$")


def _normalise(component: str) -> str:
    name = component.strip()
    while (m := _WRAPPER.match(name)) is not None:
        name = m.group(1).strip()
    name = name.rsplit(".", 1)[-1]
    name = _INSTANCE.sub("", name).lstrip("_")
    return _CAMEL.sub("_", name).lower()


def composite_for(name: str) -> str | None:
    """Maps a nested function or scope name seen in a jaxpr to a composite op.

    ``name`` is the ``name`` param of a nested ``jit`` equation (``"log_softmax"``,
    ``"_var"``), a custom_jvp function name, or a name stack such as
    ``"Model/LayerNorm_0"`` (Flax linen), ``"vmap(eqx.nn.RMSNorm)"`` (Equinox),
    ``"layer_norm"`` (Haiku) or a user ``jax.named_scope``. For a ``/``-separated
    name stack the innermost recognised component wins.

    Args:
        name: the name to look up.

    Returns:
        The composite name (a member of :data:`COMPOSITES`), or ``None``.

    Examples:
        >>> composite_for("_var"), composite_for("log_softmax")
        ('var', 'log_softmax')
        >>> composite_for("Transformer/Block_0/LayerNorm_1")
        'layer_norm'
        >>> composite_for("vmap(eqx.nn.RMSNorm)")
        'rms_norm'
        >>> composite_for("Dense_0") is None
        True
    """
    for component in reversed(name.split("/")):
        if not component:
            continue
        found = _ALIASES.get(_normalise(component))
        if found is not None:
            return found
    return None


def class_table(lists: OpLists | None = None) -> list[tuple[str, str, str]]:
    """Returns ``(name, class, reason)`` for every known name, sorted by name.

    Higher-order primitives have class ``"higher-order"``.

    Examples:
        >>> ("exp", "deny") in [(n, c) for n, c, _ in class_table()]
        True
    """
    lists = _DEFAULT if lists is None else lists
    rows = []
    for name in sorted(KNOWN_NAMES | lists.names()):
        if name in HIGHER_ORDER:
            cls = "higher-order"
        else:
            cls = lists.classify(name)
        rows.append((name, cls, REASONS.get(name, "user list")))
    return rows


# docs/op_table.md in a source checkout (mixprec/_src/autocast/ -> repo root).
_TABLE_PATH = pathlib.Path(__file__).resolve().parents[3] / "docs" / "op_table.md"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_op_table() -> str:
    """Returns the Markdown of ``docs/op_table.md``: every primitive and composite
    with its class and reason, and the precision modes.

    The committed file is checked against this in the tests; regenerate it with
    ``python tools/gen_op_table.py``.

    Examples:
        >>> "| `dot_general` | allow |" in render_op_table()
        True
    """
    from mixprec._src.autocast.modes import MODE_DOCS

    classes = {
        "allow": "run in the low dtype (white list)",
        "deny": "run in float32 (black list)",
        "infer": "follow the upstream op: low if an input arrives low, else "
        "float32 (gray list)",
        "clear": "dtype-transparent: run at the dtype received",
        "higher-order": "the interpreter transforms the body op by op",
    }
    lines = [
        "# Autocast op table",
        "",
        "<!-- Generated by `python tools/gen_op_table.py`; do not edit. -->",
        "",
        "Every JAX primitive (`jax.extend.core.primitives` and the other primitives "
        "that appear in common jaxprs) and every composite op autocast recognises, "
        "with its default class and why. Sources: PyTorch autocast "
        "(`lower_precision_fp` / `fp32` / `promote` lists), TensorFlow AMP "
        "(`auto_mixed_precision_lists.h` allow / deny / infer / clear) and Apex O1 "
        "(`FP16_FUNCS` / `FP32_FUNCS` / `CASTS`). Change the lists with "
        "`mixprec.modify_mixlist` (seed 003's `modify_mixlist` JSON).",
        "",
        "## Classes",
        "",
        "| class | meaning | count |",
        "|---|---|---|",
    ]
    rows = class_table()
    for cls, meaning in classes.items():
        count = sum(1 for _, c, _ in rows if c == cls)
        lines.append(f"| {cls} | {meaning} | {count} |")
    lines += [
        "",
        "Composites (all deny by default) are recognised by the name of a nested "
        "`jit`, a `jax.named_scope`, or a Flax / Equinox / Haiku module scope "
        "(see `composite_for`): "
        + ", ".join(f"`{c}`" for c in sorted(COMPOSITES))
        + ".",
        "",
        "Names matched (after stripping transform wrappers such as `vmap(...)`, "
        "module paths such as `eqx.nn.`, leading underscores and `_<n>` instance "
        "suffixes, and converting CamelCase to snake_case): "
        + "; ".join(
            f"`{c}` <- "
            + ", ".join(f"`{a}`" for a in sorted(_ALIASES) if _ALIASES[a] == c)
            for c in sorted(COMPOSITES)
        )
        + ". On JAX 0.10.2, `jax.nn.log_softmax` (`log_softmax`), `jnp.var` "
        "(`_var`), `jnp.std` (`_std`), `jnp.linalg.norm` (`norm`), "
        "`jax.nn.softplus`, `jax.nn.log_sigmoid` and `jax.nn.standardize` appear "
        "as named nested `jit`s; `jax.nn.softmax`, `logsumexp`, `jnp.mean` and "
        "the Flax/Equinox/Haiku norms are inlined (their `exp`, `reduce_sum`, "
        "`log`, `rsqrt` are denied one by one), and the norms are found through "
        "the module name in the equation's name stack.",
        "",
        "Ops that cannot run in 16-bit (kept float32 even by `force_fp16`): "
        + ", ".join(f"`{c}`" for c in sorted(FULL_PRECISION_ONLY))
        + ".",
        "",
        "Opaque kernels and host callbacks (always run at the original jaxpr's "
        "dtypes; not editable with `modify_mixlist`): "
        + ", ".join(f"`{c}`" for c in sorted(OPAQUE))
        + ".",
        "",
        "## Precision modes (seed 003)",
        "",
        "| mode | behaviour |",
        "|---|---|",
    ]
    for mode, doc in MODE_DOCS.items():
        lines.append(f"| `{mode}` | {_cell(doc)} |")
    lines += [
        "",
        "In every mode, clear ops run at the dtype they receive, ops without "
        "floating inputs are not cast, and only float32 ops are converted "
        "(float64 and explicit code in the other 16-bit type are kept).",
        "",
        "## Every op",
        "",
        "| op | class | reason / source |",
        "|---|---|---|",
    ]
    for name, cls, reason in rows:
        kind = " (composite)" if name in COMPOSITES else ""
        lines.append(f"| `{name}`{kind} | {cls} | {_cell(reason)} |")
    return "\n".join(lines) + "\n"


def _main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python tools/gen_op_table.py",
        description="Write (or --check) docs/op_table.md.",
    )
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--output", default=str(_TABLE_PATH))
    args = parser.parse_args(argv)
    path = pathlib.Path(args.output)
    text = render_op_table()
    if args.check:
        if not path.exists() or path.read_text() != text:
            print(f"{path} is out of date; run `{parser.prog}`.", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
