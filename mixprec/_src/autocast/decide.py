"""The dtype rule: how autocast decides the precision of one equation.

:func:`decide` is the only place a precision is chosen. It is a pure function of
the op's class and flags, the mode, the low dtype, and per floating operand its
dtype and whether it *follows*; its answer is a :class:`Decision` value that the
rules carry out and the numerics tools report. Under the default mode
(``allow_mix_precision``):

* **Allow** ops (matmuls, convolutions) round their operands to the low dtype and
  accumulate in float32. The result is in the low dtype, except in a backward
  pass (the equations JAX names ``transpose(...)``), where it keeps the dtype it
  was traced with, as the gradients of an autocast loss do; so the gradient of a
  float32 master weight stays float32. The gradient of an operand that the
  forward product received in the low dtype (an activation) is in the low
  dtype, as the derivative of an autocast product gives it: a whole training
  step under autocast runs the backward GEMMs of an autocast loss. A dot
  written with ``precision=HIGH`` or ``HIGHEST`` (or under
  ``jax.default_matmul_precision("highest")``) runs in float32.
* **Deny** ops run in float32. Ops flagged ``narrow_range`` (``square``,
  ``integer_pow``, ``reciprocal``) are denied only under float16; under
  bfloat16, which has float32's range, they are gray.
* **Gray** ops run in the widest dtype of their *anchor* operands. An operand
  *follows* (is not an anchor) when it is broadcast into the result (a bias, a
  norm scale, a scalar) or is a weak-typed Python scalar; every other operand
  anchors the op. So ``bf16 activation + f32 bias`` stays bf16, while ``bf16
  update + f32 weight`` and ``f32 residual + bf16 branch`` run in float32: a
  float32 value with the shape of the result (a residual stream, a master
  weight, optimizer state) is never rounded. Two kinds of broadcast operand
  anchor all the same: a *statistic* (a reduction, or computed from reductions
  and constants: a mean, ``1/sqrt(var + eps)``), so that ``x - mean`` and the
  rest of a norm run in float32; and, in a backward pass under float16, any
  broadcast cotangent (the gradient of a sum or a mean), which is the gradient
  signal and often lies below float16's normal range. The interpreter works
  out which operands follow (:mod:`~mixprec._src.autocast.interpreter`).
* **Clear** ops run at the dtype they receive; operands that differ are unified
  to the widest anchor.
* Only float32 work is lowered: an op with float64 operands, float8 operands, or
  operands in the other 16-bit type (float16 code under a bfloat16 policy) runs
  as written.

Under a policy with a :class:`~mixprec.Float8Recipe` (``"mixed_float8"``), an
allow op that would be lowered runs in **float8** instead: each operand scaled
into the recipe's format for its role (``float8_e4m3fn`` under the default
recipe), a gradient (a value of a backward pass that derives from the loss's
cotangent) into the recipe's gradient format (``float8_e5m2`` by default);
float32 accumulation; the result in the low dtype as above. A product the
recipe's skip rules exclude (a dimension not a multiple of 16, or smaller than
``min_dim``) stays in the low dtype, and its decision says why.

A constant whose value is known when the jaxpr is walked and that the low dtype
cannot hold (beyond its largest value, or non-zero and so small it becomes 0)
keeps its op in float32 (:func:`misfit`), so the result is float32's and an
overflow stays inf; except in a fill op (``where``, ``max``, ``min``,
``clamp``), where the rule modules saturate it to the low dtype's finite range
(``finfo(float32).min`` as a mask fill must not become ``-inf``). A value
*made from* such a constant in a forward pass (mark ``BIG``) is treated as the
constant: a select between constants (``select(mask > 0, 0, finfo.min)``), a
product with one (``(1 - mask) * -1e9``), and views, slices and sums of those
(a mask bias, computed from the data's padding mask, so its value is never
known). An op that would cast it down keeps float32 instead (the additive bias
``scores + bias`` runs in float32, as PyTorch autocast promotes it: a bias
saturated to float16's ``-65504`` overflows to ``-inf`` again once a score
below -16 is added to it), and a fill op or the fused attention's bias
saturates it. The rule modules also cast an operand broadcast into the result
after it is broadcast, so that its gradient is summed in float32.

Besides :func:`decide` (one equation, from the facts), this module holds every
other dtype choice autocast makes, so that each is made in one place:

* :func:`decide_eqn`: the facts of one equation of a walk (its region, its
  operands' marks, dtypes and shapes) turned into a :func:`decide` call;
* :func:`product_request`: how a matmul-like equation runs (its low, out and
  reduce dtypes, float8 recipe and formats, platform), the one argument of its
  formulation;
* :func:`decide_epilogue`: a bias add run as the epilogue of the CPU matmul
  before it;
* :func:`out_marks`: the marks an equation's results carry (see below);
* :func:`carry_dtypes` and :func:`branch_dtypes`: the types of loop carries
  and of ``cond`` results;
* :data:`HIGHER_ORDER`: the decision of a higher-order equation (none: its
  body is decided equation by equation).

Per value the interpreter keeps six marks, computed by :func:`out_marks`:
``FOLLOWS`` (broadcast into its consumers: a bias, a scale, a scalar),
``STAT`` (a statistic: computed from a reduction, like a mean or a variance; it
is never a follower, even broadcast), ``CONST`` (computed from constants only;
one the low dtype cannot hold keeps its op in float32) and ``GRAD`` (a
gradient: computed in a backward pass from the loss's cotangent). The first two
decide which operands anchor a gray op; ``CONST`` makes a fill op's constants
saturate; ``GRAD`` sends a float8 matmul's gradient
operand to ``float8_e5m2``; ``INPUT`` (an input of the transformed function,
never a result of an equation) lets a matmul keep a float32 operand for its
backward pass without a copy; ``BIG`` (made from a constant beyond the low
dtype's range, above) keeps the ops it feeds in float32, or saturates.
"""

from __future__ import annotations

import dataclasses
import enum
import functools as ft
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import JaxprEqn, Literal

from mixprec._src import _compat, float8 as f8
from mixprec._src.autocast import fusions, ops
from mixprec._src.autocast.avals import aval_shape, float_dtype, same_shape, size
from mixprec._src.autocast.ops import (
    CROSS_DEVICE_SUM,
    FLOAT32_ONLY,
    NARROW_RANGE,
    OpClass,
)
from mixprec._src.autocast.request import ProductRequest


__all__ = [
    "BIG",
    "CONST",
    "FOLLOWS",
    "GRAD",
    "HIGHER_ORDER",
    "INPUT",
    "STAT",
    "Decision",
    "Precision",
    "branch_dtypes",
    "carry_dtypes",
    "decide",
    "decide_fusion",
    "decide_epilogue",
    "decide_eqn",
    "out_marks",
    "product_request",
    "decided_as",
    "runs_as_traced",
]

#: The value is broadcast into its consumers (bias, scale, scalar): it follows.
FOLLOWS: Final = 1
#: The value is computed from literals and constants only.
CONST: Final = 2
#: The value is a statistic: a reduction, or computed from reductions and
#: constants only (a mean, a variance, 1/sqrt(var + eps), a max).
STAT: Final = 4
#: The value is a gradient: computed in a backward pass from the cotangent
#: that starts it (a constant such as the ``1.0`` of ``jax.grad``).
GRAD: Final = 8
#: The value is an input of the transformed function (a parameter, the data, a
#: closed-over constant): alive for the whole call, so a product may keep it
#: for the backward pass as it is instead of keeping a 16-bit copy.
INPUT: Final = 16
#: The value is made, in a forward pass, from a constant the low dtype cannot
#: hold: a select between constants, a product with one, views and sums of
#: those (a mask bias: ``select(mask > 0, 0, finfo(float32).min)``,
#: ``(1 - mask) * -1e9`` under float16). It is treated as that constant.
BIG: Final = 32

_F32: Final = np.dtype(np.float32)
_F16: Final = np.dtype(np.float16)
_BF16: Final = np.dtype("bfloat16")
_HALF: Final = frozenset({_F16, _BF16})
_FORMAT_NAMES: Final = {v: k for k, v in f8.FORMAT_NAMES.items()}


class Precision(enum.Enum):
    """What an equation's floating operands are cast to."""

    #: Rounded to the low dtype (the policy's compute dtype).
    LOW = "low"
    #: Cast to float32.
    FLOAT32 = "float32"
    #: Left as they arrive (unified to the widest when they differ).
    RECEIVED = "received"
    #: Cast back to the dtypes they were traced with: the op runs as written.
    ORIGINAL = "original"
    #: Scaled into float8 (formats per operand in :attr:`Decision.operand_dtypes`).
    FLOAT8 = "float8"


@dataclasses.dataclass(frozen=True)
class Decision:
    """How one equation runs under autocast.

    Attributes:
        precision: what the floating operands are cast to.
        dtype: the dtype they are cast to (``None`` for
            :attr:`Precision.ORIGINAL`, and for :attr:`Precision.RECEIVED` when
            the operands agree).
        op_class: the op's class in the lists (``None`` for a higher-order
            primitive).
        reason: why, for reports (list, mode, operands).
        out_dtype: the dtype the result is rounded to after the op, or ``None``
            for the dtype the op computes in. Allow ops accumulate in float32
            and return the low dtype (or, in a backward pass, the traced dtype).
        float8: the :class:`~mixprec.Float8Recipe` of a float8 product, and of
            an allow op the recipe's skip rules kept in the low dtype.
        operand_dtypes: for :attr:`Precision.FLOAT8`, the format of each
            operand (``float8_e4m3fn``, or ``float8_e5m2`` for a gradient).
        float8_skip: why the recipe kept this allow op out of float8, as
            ``(kind, text)`` with kind ``"alignment"``, ``"size"`` or
            ``"symbolic"`` (``None`` otherwise).
        float8_gradients: for :attr:`Precision.FLOAT8`, which operands are
            gradients (they take the recipe's gradient format and scales).
        request: for a matmul-like op decided low or float8, how it runs
            (:func:`product_request`, made with the decision: the product's
            rule reads it and decides nothing).

    Examples:
        >>> d = Decision(Precision.LOW, np.dtype("bfloat16"), "allow", "allow list")
        >>> d.label, d.dtype
        ('low', dtype(bfloat16))
    """

    precision: Precision
    dtype: np.dtype | None
    op_class: OpClass | None
    reason: str
    out_dtype: np.dtype | None = None
    float8: f8.Float8Recipe | None = None
    operand_dtypes: tuple[np.dtype, ...] | None = None
    float8_skip: tuple[str, str] | None = None
    float8_gradients: tuple[bool, ...] | None = None
    request: ProductRequest | None = dataclasses.field(
        default=None, compare=False, repr=False
    )

    @property
    def label(self) -> str:
        """``"low"``, ``"float32"``, ``"received"``, ``"original"`` or ``"float8"``."""
        return self.precision.value


def _is_float(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype == _BF16 or dtype.name.startswith("float8")


def _widest(dtypes: Sequence[np.dtype]) -> np.dtype:
    """The widest dtype; two different 16-bit types make float32."""
    best = dtypes[0]
    for d in dtypes[1:]:
        if d.itemsize > best.itemsize:
            best = d
        elif d.itemsize == best.itemsize and d != best:
            best = np.dtype(np.float32) if d.itemsize < 4 else best
    return best


@ft.lru_cache(maxsize=64)
def has_float32_range(dtype: np.dtype) -> bool:
    """Whether ``dtype`` reaches float32's largest values (bfloat16 does).

    Examples:
        >>> has_float32_range(np.dtype("bfloat16")), has_float32_range(np.float16)
        (True, False)
    """
    return float(jnp.finfo(dtype).max) >= float(np.finfo(np.float32).max) / 2


@ft.lru_cache(maxsize=65536)
def decide(
    name: str,
    operands: tuple[tuple[np.dtype | None, bool], ...],
    *,
    op_class: OpClass,
    mode: str,
    low: np.dtype,
    flags: frozenset[str] = frozenset(),
    backward: bool = False,
    high_precision: bool = False,
    traced_out: np.dtype | None = None,
    low_cotangent: bool = False,
    float8: f8.Float8Recipe | None = None,
    float8_dims: tuple[tuple[str, int], ...] | None = None,
    float8_align: tuple[tuple[str, int], ...] = (),
    float8_contracting: tuple[tuple[int, ...], ...] = ((), ()),
    gradients: tuple[bool, ...] = (),
    reduce: np.dtype | None = None,
) -> Decision:
    """Decides the precision of one equation (see the module docstring).

    Args:
        name: the op's name (for reasons).
        operands: per operand ``(dtype, follows)``; ``dtype`` is ``None`` for a
            non-floating operand; ``follows`` says the operand is broadcast into
            the result or weak-typed, so it does not anchor a gray op.
        op_class: the op's class in the lists in effect.
        mode: the precision mode (already validated).
        low: the low dtype the mode lowers to.
        flags: the op's flags in the op table.
        backward: the equation belongs to a backward pass.
        high_precision: a dot that asks for ``HIGH``/``HIGHEST`` precision.
        traced_out: the dtype the op's result was traced with (allow ops in a
            backward pass return it).
        low_cotangent: an allow op of a backward pass that computes the
            gradient of an operand its forward op received in a 16-bit dtype
            (an activation): its result stays in the low dtype, as the
            derivative of an autocast product gives it.
        float8: the policy's float8 recipe (allow ops only).
        float8_dims: ``(name, size)`` of the product's dimensions, for the
            recipe's skip rules.
        float8_align: ``(name, size)`` of the dimensions that must be
            multiples of 16.
        float8_contracting: per operand, its contracted axes (a matmul's; a
            convolution has none): what a rowwise scale is taken over.
        gradients: per operand, whether it is a gradient (it takes the
            recipe's gradient format and scales).
        reduce: the policy's reduce dtype: a cross-device sum runs in it.

    Returns:
        The :class:`Decision`.

    Examples:
        >>> f32, bf16 = np.dtype(np.float32), np.dtype("bfloat16")
        >>> kw = dict(mode="allow_mix_precision", low=bf16)
        >>> decide("dot_general", ((f32, False), (f32, False)), op_class="allow",
        ...        **kw).label
        'low'
        >>> decide("add", ((bf16, False), (f32, True)), op_class="infer",
        ...        **kw).dtype  # a float32 bias follows the activation
        dtype(bfloat16)
        >>> decide("sub", ((f32, False), (bf16, False)), op_class="infer",
        ...        **kw).dtype  # a float32 weight is never rounded
        dtype('float32')
        >>> d = decide("dot_general", ((f32, False), (bf16, False)),
        ...            op_class="allow", float8=f8.Float8Recipe(),
        ...            float8_dims=(("M", 256), ("N", 512), ("K", 1024)),
        ...            gradients=(False, True), **kw)
        >>> d.label, [str(t) for t in d.operand_dtypes], d.out_dtype
        ('float8', ['float8_e4m3fn', 'float8_e5m2'], dtype(bfloat16))
    """
    floats = [(d, f) for d, f in operands if d is not None and _is_float(d)]
    if not floats:
        return Decision(Precision.RECEIVED, None, op_class, "no floating operands")
    if mode == "must_keep_origin_dtype":
        return Decision(Precision.ORIGINAL, None, op_class, f"{mode}: as written")

    received = {d for d, _ in floats}
    anchors = [d for d, f in floats if not f] or [d for d, _ in floats]
    forced = mode in ("force_fp32", "force_fp16")
    eligible = {_F32, low} | (_HALF if forced else set())
    if not received <= eligible:
        other = ", ".join(sorted(str(d) for d in received - eligible))
        return Decision(
            Precision.ORIGINAL,
            None,
            op_class,
            f"not a float32 op (operands in {other}): runs as written",
        )

    if op_class == "clear":
        if len(received) == 1:
            return Decision(
                Precision.RECEIVED,
                None,
                "clear",
                "clear: runs at the dtype it receives",
            )
        target = _widest(anchors)
        return Decision(
            Precision.RECEIVED,
            target,
            "clear",
            f"clear: operands unified to the widest ({target})",
        )

    def lowered(reason: str, out: np.dtype | None = None) -> Decision:
        if low == _F32:
            return Decision(Precision.FLOAT32, _F32, op_class, reason, out)
        return Decision(Precision.LOW, low, op_class, reason, out)

    def float32(reason: str) -> Decision:
        return Decision(Precision.FLOAT32, _F32, op_class, reason)

    keeps_traced = backward and traced_out is not None and not low_cotangent
    allow_out = traced_out if keeps_traced else low

    def allow(reason: str) -> Decision:
        """An allow op that runs lowered: in float8 if the policy says so."""
        if float8 is None:
            return lowered(reason, allow_out)
        return _float8_decision(
            lowered(reason, allow_out),
            float8,
            float8_dims,
            float8_align,
            float8_contracting,
            gradients,
            allow_out,
        )

    if mode == "force_fp32":
        return float32(f"{mode}: every op in float32")
    if mode == "force_fp16":
        if FLOAT32_ONLY in flags:
            return float32(f"{mode}: no 16-bit kernel; kept float32")
        if op_class == "allow" and not high_precision:
            return allow(f"{mode}: every op that can runs in {low}")
        out = allow_out if op_class == "allow" else None
        return lowered(f"{mode}: every op that can runs in {low}", out)
    if mode in ("allow_fp32_to_fp16", "allow_fp32_to_bf16"):
        if op_class == "allow":
            return allow(f"{mode}: allow list, lowered to {low}")
        return float32(f"{mode}: only allow-list ops are lowered")

    # allow_mix_precision / allow_mix_precision_bf16
    if op_class == "allow":
        if high_precision:
            return float32("allow list, but precision=HIGH/HIGHEST asked for float32")
        if backward and low_cotangent:
            return allow(
                f"allow list: operands in {low}, float32 accumulation; the "
                f"gradient of a {low} activation stays {low}"
            )
        if backward and traced_out is not None:
            return allow(
                f"allow list: operands in {low}, float32 accumulation; a backward "
                f"pass keeps the gradient in {traced_out}"
            )
        return allow(f"allow list: lowered to {low}")
    if op_class == "deny":
        if CROSS_DEVICE_SUM in flags and reduce is not None and reduce != _F32:
            back = _widest(anchors)
            return Decision(
                Precision.LOW,
                reduce,
                op_class,
                f"cross-device sum: in the policy's reduce dtype {reduce}, "
                f"the result back in {back}",
                out_dtype=back if back != reduce else None,
            )
        if NARROW_RANGE not in flags or not has_float32_range(low):
            return float32("deny list: float32")
        if all(d == low for d in anchors):
            return lowered(
                f"deny list only for float16's range; {low} has float32's range: "
                f"follows its {low} operands"
            )
        return float32("deny list only for float16's range; float32 operand")
    # infer
    if low != _F32 and all(d == low for d in anchors):
        why = "its operands are" if len(floats) > 1 else "its operand is"
        return lowered(f"infer list: {why} {low}")
    if len(floats) > 1 and len(received) > 1:
        return float32(
            "infer list: a float32 operand of the result's shape is never rounded"
        )
    return float32("infer list: float32 operands")


def _float8_decision(
    base: Decision,
    recipe: f8.Float8Recipe,
    dims: tuple[tuple[str, int], ...] | None,
    align: tuple[tuple[str, int], ...],
    contracting: tuple[tuple[int, ...], ...],
    gradients: tuple[bool, ...],
    out: np.dtype | None,
) -> Decision:
    """``base`` (the lowered decision of an allow op) moved to float8, or kept
    with the reason the recipe skips it. Each operand's format and scales are
    the recipe's for its role (a gradient or not): read, never named here."""
    skip = f8.skip_reason(recipe, dims, align)
    if skip is not None:
        kind, text = skip
        return dataclasses.replace(
            base,
            reason=f"{base.reason}; not float8 ({recipe}): {text}",
            float8=recipe,
            float8_skip=(kind, text),
        )
    roles = tuple(i < len(gradients) and gradients[i] for i in range(2))
    formats = tuple(recipe.format(gradient=g) for g in roles)
    names = " x ".join(
        _FORMAT_NAMES[f] + (" (gradient)" if g else "")
        for f, g in zip(formats, roles, strict=True)
    )
    # What each operand's scales cover here (a convolution's operands, with no
    # contracted axes, take one scale under every recipe).
    scales = [
        "tensorwise"
        if recipe.scale_axes(contracting[i] if i < len(contracting) else (), gradient=g)
        is None
        else "rowwise"
        for i, g in enumerate(roles)
    ]
    scaling = scales[0] if scales[0] == scales[1] else " / ".join(scales)
    result = out if out is not None else base.dtype
    return Decision(
        Precision.FLOAT8,
        recipe.format(),
        base.op_class,
        f"allow list: float8 ({scaling} current scaling), {names}, float32 "
        f"accumulation, result {result}",
        out_dtype=out,
        float8=recipe,
        operand_dtypes=formats,
        float8_gradients=roles,
    )


#: The decision of a higher-order equation: none of its own.
HIGHER_ORDER: Final = Decision(
    Precision.RECEIVED,
    None,
    None,
    "higher-order primitive: its body is decided equation by equation",
)


# ------------------------------------------------------------------ marks


def literal_mark() -> int:
    """The marks of a literal: a constant that follows."""
    return CONST | FOLLOWS


def _scaled_seed(eqn: JaxprEqn, marks: Sequence[int]) -> bool:
    """Whether ``eqn`` (in a backward pass) scales the constant cotangent
    a backward pass starts from by an argument of the function: the loss
    scale of ``mixprec.value_and_grad(..., loss_scale=opt_state)`` in a
    whole train step (``1.0 * scale``). Scalars only: an argument array
    times a constant (a weight recomputed under ``jax.checkpoint``) is
    not a gradient."""
    return (
        bool(marks)
        and any(m & CONST for m in marks)
        and all(m & (CONST | INPUT) for m in marks)
        and all(getattr(v.aval, "shape", None) == () for v in eqn.invars)
        and all(getattr(v.aval, "shape", None) == () for v in eqn.outvars)
    )


def out_marks(
    spec: ops.OpSpec | None,
    eqn: JaxprEqn,
    marks: Sequence[int],
    n: int,
    backward: bool = False,
    region: Region | None = None,
) -> list[int]:
    """The marks of the ``n`` results of ``eqn``, given its operands' marks;
    ``region`` (the walk) knows the constants' values, for ``BIG``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> eqn = jax.make_jaxpr(jnp.sum)(jnp.ones(3)).eqns[0]
        >>> out_marks(ops.spec_for("reduce_sum"), eqn, [0], 1) == [STAT]
        True
    """
    every = any_ = 0
    if marks:
        every = -1
        for m in marks:
            every &= m
            any_ |= m
    const = CONST if not marks or every & CONST else 0
    grad = 0
    if backward and (any_ & GRAD or (marks and const) or _scaled_seed(eqn, marks)):
        # A backward pass starts from a constant cotangent (`jax.grad`'s 1.0);
        # what it computes from that is a gradient, residuals are not.
        grad = GRAD
    flags = spec.flags if spec is not None else frozenset()
    if not backward and region is not None and any_ & (BIG | CONST):
        const |= _big(spec, eqn, marks, region)
    if ops.STATISTIC in flags or (
        any_ & STAT and all(m & (STAT | CONST) for m in marks)
    ):
        # A statistic, broadcast or not: never a follower.
        return [STAT | const | grad] * n
    follows = 0
    if spec is not None and eqn.invars:
        if eqn.primitive.name == "broadcast_in_dim":
            src = aval_shape(eqn.invars[0])
            if size(src) != size(aval_shape(eqn.outvars[0])):
                follows = FOLLOWS
            else:  # only size-1 dimensions added: a reshape
                follows = marks[0] & FOLLOWS
        elif ops.VIEW in flags:
            follows = marks[0] & FOLLOWS
    if not eqn.invars and spec is not None and spec.op_class == "clear":
        const = CONST  # iota and friends
    return [const | follows | grad] * n


@ft.lru_cache(maxsize=16)
def _largest(dtype: np.dtype) -> float:
    return float(jnp.finfo(dtype).max)


def _big(
    spec: ops.OpSpec | None, eqn: JaxprEqn, marks: Sequence[int], region: Region
) -> int:
    """``BIG`` if ``eqn`` makes its floating result from a constant beyond the
    low dtype's range or from a ``BIG`` value, moving or combining it with an
    op that keeps its magnitude (:data:`~mixprec._src.autocast.ops.KEEPS_MAGNITUDE`,
    or a clear op); else 0."""
    if spec is None or not any(m & (BIG | CONST) for m in marks):
        return 0
    if ops.KEEPS_MAGNITUDE not in spec.flags and spec.op_class != "clear":
        return 0
    if not eqn.outvars or float_dtype(eqn.outvars[0].aval) is None:
        return 0
    low = np.dtype(region.config.low_dtype)
    if low.itemsize >= 4:
        return 0
    largest = _largest(low)
    for v, m in zip(eqn.invars, marks, strict=True):
        if m & BIG:
            return BIG
        if m & CONST and float_dtype(v.aval) is not None:
            magnitudes = region.constant_range(v)
            if magnitudes is not None and magnitudes[0] > largest:
                return BIG
    return 0


def follows(
    var: Any,
    mark: int,
    out_shape: Sequence[Any],
    broadcast_follows: bool = True,
) -> bool:
    """Whether an operand follows the others in a gray op (does not anchor it):
    a weak-typed scalar always; an operand broadcast into the result (a bias, a
    scale) unless it is a statistic or ``broadcast_follows`` is False."""
    aval = var.aval
    if getattr(aval, "weak_type", False):
        return True
    if mark & STAT or not broadcast_follows:
        return False
    if mark & FOLLOWS:
        return True
    return not same_shape(getattr(aval, "shape", ()), out_shape)


# ------------------------------------------------------------------ one equation


class Region(Protocol):
    """Where an equation is: what :func:`decide_eqn` needs of the walk."""

    config: Any  # CastConfig
    float32: bool
    composite: str
    backward: bool
    facts: Any  # facts.Facts: what the walk learnt of the jaxpr's values

    def producer(self, var: Any) -> JaxprEqn | None:
        """The equation that computed ``var`` in the jaxpr being walked."""
        ...

    def constant_range(self, var: Any) -> tuple[float, float] | None:
        """``(largest finite, smallest non-zero)`` magnitude of a constant
        whose value is known, or ``None``."""
        ...

    def for_eqn(self, eqn: JaxprEqn) -> Region:
        """Where ``eqn`` is, from here: in its own region (``float32_scope``,
        ``precision_scope``, a nested autocast) and pass."""
        ...


def misfit(magnitudes: tuple[float, float], low: np.dtype) -> str | None:
    """Why a constant with these ``(largest finite, smallest non-zero)``
    magnitudes does not fit ``low``, or ``None`` if it does: beyond its
    largest finite value (it would become inf), or non-zero and below half
    its smallest subnormal (it would become 0).

    Examples:
        >>> f16 = np.dtype(np.float16)
        >>> print(misfit((1e5, 1e5), f16))
        beyond float16's largest value (1e+05 > 65504)
        >>> misfit((1e-8, 1e-8), f16), misfit((1.0, 1e-3), f16)
        ("below float16's smallest (1e-08 becomes 0)", None)
    """
    largest, smallest = magnitudes
    info = jnp.finfo(low)
    if largest > float(info.max):
        return f"beyond {low}'s largest value ({largest:.3g} > {float(info.max):g})"
    if smallest < float(info.smallest_subnormal) / 2:
        return f"below {low}'s smallest ({smallest:.3g} becomes 0)"
    return None


def _misfit_constant(
    region: Region,
    eqn: JaxprEqn,
    flags: frozenset[str],
    invals: Sequence[Any],
    marks: Sequence[int],
    target: np.dtype,
) -> str | None:
    """Why a constant operand of ``eqn``, or a value made from one (``BIG``),
    cannot be cast to ``target`` (``None`` if each can, or ``eqn`` is a fill
    op, whose constants saturate). A ``BIG`` value that arrives in a dtype no
    wider than ``target`` (a fill's result, saturated already) is cast as
    usual."""
    if ops.FILL in flags:
        return None
    for v, x, m in zip(eqn.invars, invals, marks, strict=True):
        dtype = float_dtype(v.aval)
        if dtype is None or dtype.itemsize <= target.itemsize:
            continue
        if m & BIG:
            received = float_dtype(x)
            if received is None or received.itemsize <= target.itemsize:
                continue
            return (
                f"an operand is made from a constant beyond {target}'s range (a "
                "mask bias such as select(mask, 0, finfo(float32).min) or "
                "(1 - mask) * -1e9)"
            )
        if not m & CONST:
            continue
        magnitudes = region.constant_range(v)
        why = None if magnitudes is None else misfit(magnitudes, target)
        if why is not None:
            return why
    return None


#: How many equations deep :func:`same_value` compares two operands.
SAME_VALUE_DEPTH: Final = 6


def _params_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for k, v in a.items():
        w = b[k]
        if v is w:
            continue
        try:
            if not bool(v == w):
                return False
        except Exception:  # noqa: BLE001  (arrays, jaxprs: not comparable)
            return False
    return True


def same_value(
    a: Any,
    b: Any,
    producer: Callable[[Any], JaxprEqn | None],
    depth: int = SAME_VALUE_DEPTH,
) -> bool:
    """Whether two operands are the same value: the same variable, equal
    literals, or the same output of two structurally identical equations (the
    same primitive without effects, equal params, and operands
    that are the same value, up to ``depth`` equations back). JAX does not
    merge repeated subexpressions in a jaxpr, so ``(x @ w) * (x @ w)`` is two
    dots; it is still a value times itself. Calls compare equal only when
    their bodies are the same object: ``jax.nn.relu(h) * jax.nn.relu(h)``
    traces two ``custom_jvp`` bodies and is not recognised.

    ``producer(var)`` returns the equation that computed ``var`` in the jaxpr
    being walked (``None`` for an input).

    Examples:
        >>> import jax
        >>> jaxpr = jax.make_jaxpr(lambda x, w: (x @ w) * (x @ w))(
        ...     np.ones((2, 2), np.float32), np.ones((2, 2), np.float32)).jaxpr
        >>> made = {v: e for e in jaxpr.eqns for v in e.outvars}
        >>> mul = jaxpr.eqns[-1]
        >>> same_value(*mul.invars, made.get)
        True
    """
    if a is b:
        return True
    if isinstance(a, Literal) or isinstance(b, Literal):
        if not (isinstance(a, Literal) and isinstance(b, Literal)):
            return False
        va, vb = np.asarray(a.val), np.asarray(b.val)
        return va.dtype == vb.dtype and bool(np.array_equal(va, vb))
    if depth <= 0:
        return False
    ea, eb = producer(a), producer(b)
    if ea is None or eb is None or ea.primitive is not eb.primitive:
        return False
    if ea.effects or eb.effects or len(ea.invars) != len(eb.invars):
        return False
    if ea.outvars.index(a) != eb.outvars.index(b):
        return False
    if not _params_equal(ea.params, eb.params):
        return False
    return all(
        same_value(x, y, producer, depth - 1)
        for x, y in zip(ea.invars, eb.invars, strict=True)
    )


def _is_square(eqn: JaxprEqn, producer: Callable[[Any], JaxprEqn | None]) -> bool:
    a, b = eqn.invars
    if isinstance(a, Literal) or isinstance(b, Literal):
        return False
    return same_value(a, b, producer)


def decided_as(
    eqn: JaxprEqn,
    spec: ops.OpSpec | None,
    producer: Callable[[Any], JaxprEqn | None],
) -> tuple[str, ops.OpSpec | None]:
    """The name and op-table entry ``eqn`` is decided as: its own, except that
    a ``mul`` of a value by itself is a ``square`` (denied under float16 for
    its range)."""
    name = eqn.primitive.name
    if name == "mul" and _is_square(eqn, producer):
        return "square", ops.spec_for("square")
    return name, spec


# Ops decided by their own entry, not by their operands' dtypes.
_OWN_DECISION: Final = frozenset([ops.FUSION, ops.OPAQUE])


def runs_as_traced(
    region: Region, eqn: JaxprEqn, spec: ops.OpSpec | None, invals: Sequence[Any]
) -> bool:
    """Whether :func:`decide_eqn` would keep ``eqn`` as it was traced, known
    without deciding it: an op of the default rule, outside composites,
    decided by its operands' dtypes (not a fusion or an opaque op), whose
    floating operands all arrive in float32 as traced (none a product's wide
    result an epilogue may take), where :func:`decide` keeps such an op as
    traced (:func:`keeps_float32`, asked once per op and setting). What a
    whole train step's float32 optimizer update and most of its backward pass
    are made of: the walk's fast lane."""
    if region.composite or ops.rule_for(spec) is not None:
        return False
    if spec is not None and spec.flags & _OWN_DECISION:
        return False
    cfg = region.config
    n_floats = 0
    wide = region.facts.wide
    for v, x in zip(eqn.invars, invals, strict=True):
        dt = float_dtype(x)
        if dt is None:
            continue
        if dt != _F32 or (wide and type(v) is not Literal and v in wide):
            return False
        n_floats += 1
    name, spec = decided_as(eqn, spec, region.producer)
    try:
        op_class = cfg.lists.classify(name, strict=cfg.strict and spec is None)
    except NotImplementedError:
        return False  # in no list under `strict`: `decide_eqn` raises for it
    return keeps_float32(
        name,
        n_floats,
        op_class=op_class,
        mode=cfg.mode,
        low=np.dtype(cfg.low_dtype),
        flags=spec.flags if spec is not None else frozenset(),
        backward=region.backward,
        reduce=cfg.policy.reduce_dtype,
    )


def _asks_high_precision(eqn: JaxprEqn) -> bool:
    precision = eqn.params.get("precision")
    if precision is None:
        return False
    items = precision if isinstance(precision, tuple | list) else (precision,)
    high = (lax.Precision.HIGH, lax.Precision.HIGHEST)
    return any(p in high for p in items)


def _raise_unclassified(cfg: Any, eqn: JaxprEqn) -> None:
    name = eqn.primitive.name
    try:
        cfg.lists.classify(name, strict=True)
    except NotImplementedError:
        where = _compat.eqn_source_summary(eqn.source_info) or "unknown location"
        raise NotImplementedError(
            f"No cast rule for primitive '{name}' (at {where}) and it is in no op "
            "list, so `autocast(..., strict=True)` cannot decide its precision. "
            "Register a rule with `mixprec.register_rule(primitive, rule)` or add "
            "it to a list with `mixlist={'gray-list': {'to-add': "
            f"['{name}']}}}}`."
        ) from None


def _float8_args(
    cfg: Any,
    eqn: JaxprEqn,
    spec: ops.OpSpec | None,
    op_class: str,
    marks: Sequence[int],
    out_shape: Sequence[Any],
) -> dict[str, Any]:
    """The float8 arguments of :func:`decide` for ``eqn`` (none without a recipe,
    or for an op without a float8 formulation)."""
    recipe = cfg.policy.float8
    product = None if spec is None else spec.product
    if recipe is None or op_class != "allow" or product is None or not product.float8:
        return {}
    dims = product.dims([aval_shape(v) for v in eqn.invars], out_shape, eqn.params)
    return {
        "float8": recipe,
        "float8_dims": dims.sizes,
        "float8_align": dims.align,
        "float8_contracting": dims.contracting,
        "gradients": tuple(bool(m & GRAD) for m in marks),
    }


def _reduce_dtype(
    reduce: np.dtype | None,
    operands: Sequence[Any],
    marks: Sequence[int],
    out: np.dtype,
    backward: bool,
) -> tuple[np.dtype | None, bool]:
    """The policy's gradient reduction dtype where it applies to a product,
    and whether the product computes a gradient (then its GEMM writes its
    result in it).

    Under a partitioner the all-reduce (or reduce-scatter) of a gradient
    lands on the GEMM that computes it, in the dtype that GEMM writes:

    * a product of the backward pass whose result is a float32 gradient (a
      train step under autocast: the weight gradient ``x^T g``);
    * the backward products of a product that reads a float32 input of the
      function (a parameter), when the loss under autocast is differentiated
      outside: they write the parameter's gradient in it.
    """
    if (backward or any(m & GRAD for m in marks)) and np.dtype(out) == _F32:
        return reduce, True
    for x, m in zip(operands, marks, strict=True):
        if m & INPUT and not m & CONST and float_dtype(x) == _F32:
            return reduce, False
    return None, False


def product_request(
    decision: Decision,
    config: Any,
    operands: Sequence[Any],
    marks: Sequence[int],
    *,
    backward: bool,
) -> ProductRequest | None:
    """How a matmul-like equation decided ``decision`` runs: the one argument
    of its formulation (:class:`~mixprec._src.autocast.request.ProductRequest`),
    or ``None`` to run it through the default rule (decided float32 or as
    written, a non-floating operand, a dtype wider than 16 bits).

    Args:
        decision: the equation's :class:`Decision`.
        config: the transform's ``CastConfig`` (policy, platform, CPU
            formulation, ``custom_vjp_dots``).
        operands: the values the equation receives (its first two are the
            product's operands).
        marks: their marks (``INPUT``, ``CONST``, ``GRAD``).
        backward: the equation belongs to a backward pass.

    Examples:
        >>> from mixprec._src.autocast.config import make_config
        >>> cfg = make_config("mixed_bfloat16")
        >>> d = Decision(Precision.LOW, _BF16, "allow", "allow list")
        >>> x = np.ones((2, 2), np.float32)
        >>> r = product_request(d, cfg, (x, x), (INPUT, 0), backward=False)
        >>> r.low_dtype, r.out_dtype, r.live, r.reduce_dtype
        (dtype(bfloat16), dtype(bfloat16), (True, False), dtype('float32'))
    """
    vals, pair = tuple(operands[:2]), tuple(marks[:2])
    live = (bool(pair[0] & INPUT), bool(pair[1] & INPUT))
    common: dict[str, Any] = dict(
        live=live,
        custom_vjp=bool(config.custom_vjp_dots),
        platform=config.platform,
        cpu_bf16=config.cpu_bf16,
    )
    if decision.precision is Precision.FLOAT8:
        recipe, formats = decision.float8, decision.operand_dtypes
        grads = decision.float8_gradients
        if (
            recipe is None
            or formats is None
            or grads is None
            or len(formats) != 2
            or len(grads) != 2
        ):
            raise ValueError(
                f"`product_request(decision=...)`: a float8 decision needs its "
                f"recipe, two operand formats and roles, got {decision!r}."
            )
        low = np.dtype(config.low_dtype)
        return ProductRequest(
            low_dtype=low,
            out_dtype=np.dtype(decision.out_dtype or low),
            recipe=recipe,
            formats=(np.dtype(formats[0]), np.dtype(formats[1])),
            gradients=(bool(grads[0]), bool(grads[1])),
            **common,
        )
    low = decision.dtype
    if (
        decision.precision is not Precision.LOW
        or low is None
        or low.itemsize > 2
        or any(float_dtype(x) is None for x in vals)
    ):
        return None
    out = np.dtype(decision.out_dtype or low)
    policy = config.policy
    reduce, gradient = _reduce_dtype(policy.reduce_dtype, vals, pair, out, backward)
    # A parameter is rounded once per walk for every product that reads it,
    # unless the policy gathers it wider (each product rounds after the
    # gather) or the custom_vjp formulation takes it in float32 (to return
    # its gradient from the GEMM in float32).
    shares = policy.gather_dtype is None and not config.custom_vjp_dots
    shared = tuple(
        shares
        and bool(m & INPUT)
        and not m & CONST
        and (dt := float_dtype(x)) is not None
        and dt.itemsize >= low.itemsize
        for x, m in zip(vals, pair, strict=True)
    )
    return ProductRequest(
        low_dtype=low,
        out_dtype=out,
        reduce_dtype=reduce,
        gradient=gradient,
        shared=(shared[0], shared[1]),
        **common,
    )


def decide_eqn(
    region: Region,
    eqn: JaxprEqn,
    spec: ops.OpSpec | None,
    invals: Sequence[Any],
    marks: Sequence[int],
) -> Decision:
    """The precision of a first-order equation with these operands, where the
    walk is (:class:`Region`): the facts gathered, then :func:`decide`.

    Raises:
        NotImplementedError: under ``strict``, for an op in no list and
            without a rule.
    """
    d = _decide_eqn(region, eqn, spec, invals, marks)
    if (
        spec is not None
        and spec.product is not None
        and d.precision in (Precision.LOW, Precision.FLOAT8)
    ):
        request = product_request(
            d, region.config, invals, marks, backward=region.backward
        )
        d = dataclasses.replace(d, request=request)
    return d


def _decide_eqn(
    region: Region,
    eqn: JaxprEqn,
    spec: ops.OpSpec | None,
    invals: Sequence[Any],
    marks: Sequence[int],
) -> Decision:
    name = eqn.primitive.name
    cfg = region.config
    if spec is not None and ops.FUSION in spec.flags:
        return decide_fusion(region, eqn, spec, invals)
    if region.float32:
        return Decision(
            Precision.ORIGINAL,
            None,
            cfg.lists.classify(name),
            "inside mixprec.float32_scope(): as written",
        )
    if spec is None and name not in cfg.lists.names():
        if cfg.strict:
            _raise_unclassified(cfg, eqn)
        return Decision(
            Precision.ORIGINAL,
            None,
            "infer",
            "in no op list and no rule: runs as written",
        )
    if spec is not None and ops.OPAQUE in spec.flags:
        return Decision(Precision.ORIGINAL, None, "clear", spec.reason)
    name, spec = decided_as(eqn, spec, region.producer)
    lookup = region.composite or name
    op_class = cfg.lists.classify(lookup)
    flags = spec.flags if spec is not None and not region.composite else frozenset()
    out_aval: Any = eqn.outvars[0].aval if eqn.outvars else None
    out_shape = getattr(out_aval, "shape", ())
    # In a backward pass under float16, a broadcast cotangent (the gradient of
    # a sum or a mean) is the gradient signal, often below float16's normal
    # range: it anchors instead of following.
    broadcast_follows = not (region.backward and not has_float32_range(cfg.low_dtype))
    product = spec is not None and spec.product is not None
    operands = tuple(
        (
            _seen_dtype(v, x, cfg.low_dtype) if product else float_dtype(x),
            follows(v, m, out_shape, broadcast_follows),
        )
        for v, x, m in zip(eqn.invars, invals, marks, strict=True)
    )
    d = decide(
        lookup,
        operands,
        op_class=op_class,
        mode=cfg.mode,
        low=cfg.low_dtype,
        flags=flags,
        backward=region.backward,
        high_precision=_asks_high_precision(eqn),
        traced_out=float_dtype(out_aval) if op_class == "allow" else None,
        low_cotangent=op_class == "allow" and _low_cotangent(region, eqn),
        reduce=cfg.policy.reduce_dtype,
        **_float8_args(cfg, eqn, spec, op_class, marks, out_shape),
    )
    if (
        d.precision in (Precision.LOW, Precision.RECEIVED)
        and d.dtype is not None
        and d.dtype.itemsize < 4
    ):
        op_flags = spec.flags if spec is not None else frozenset()
        why = _misfit_constant(region, eqn, op_flags, invals, marks, d.dtype)
        if why is not None:
            d = Decision(
                Precision.FLOAT32,
                _F32,
                d.op_class,
                f"a constant operand does not fit: {why}; runs in float32",
            )
    if region.composite:
        return dataclasses.replace(
            d, reason=f"inside {region.composite} (a JAX composite): {d.reason}"
        )
    if name == "square" and eqn.primitive.name == "mul":
        what = (
            "a value by itself"
            if eqn.invars[0] is eqn.invars[1]
            else "a value by itself (computed twice by the same equations)"
        )
        return dataclasses.replace(d, reason=f"mul of {what}: {d.reason}")
    return d


def _seen_dtype(var: Any, value: Any, low: np.dtype) -> np.dtype | None:
    """The dtype :func:`decide` takes a product's operand to be in: the one
    it arrives in, except a value traced as float32 that arrives in a 16-bit
    dtype other than ``low``. Only autocast lowers a float32 value, so such
    a value was lowered under another policy (a plan's site, a
    ``precision_scope``): it is the float32 value the program wrote, and a
    product here takes it as one (a plan's float16 site reading an
    activation of its bfloat16 base runs in float16, not as written in
    float32). A product's every decision casts each operand to its dtype;
    other ops keep deciding on what they receive.
    """
    dtype = float_dtype(value)
    if (
        dtype is not None
        and dtype != low
        and dtype.itemsize == 2
        and float_dtype(var.aval) == _F32
    ):
        return _F32
    return dtype


@ft.lru_cache(maxsize=4096)
def keeps_float32(
    name: str,
    n_floats: int,
    *,
    op_class: OpClass,
    mode: str,
    low: np.dtype,
    flags: frozenset[str],
    backward: bool,
    reduce: np.dtype | None,
) -> bool:
    """Whether :func:`decide` runs an op outside the allow list whose
    ``n_floats`` floating operands are all float32 as it was traced (no
    operand cast, no result rounded): asked once per op and setting, so the
    walk can record such an op without deciding it again.

    Examples:
        >>> bf16 = np.dtype("bfloat16")
        >>> kw = dict(op_class="deny", mode="allow_mix_precision", low=bf16,
        ...           backward=False, reduce=None)
        >>> keeps_float32("exp", 1, flags=frozenset(), **kw)
        True
        >>> keeps_float32("psum", 1, flags=frozenset([CROSS_DEVICE_SUM]),
        ...               **{**kw, "reduce": bf16})  # summed in the reduce dtype
        False
    """
    if op_class == "allow":
        return False
    d = decide(
        name,
        ((_F32, False),) * n_floats,
        op_class=op_class,
        mode=mode,
        low=low,
        flags=flags,
        backward=backward,
        reduce=reduce,
    )
    return d.out_dtype is None and d.dtype in (None, _F32)


def _low_cotangent(region: Region, eqn: JaxprEqn) -> bool:
    """Whether a backward product computes the gradient of an operand that its
    forward product received in a 16-bit dtype (an activation).

    Of its operands, one is a residual: an operand of a forward product, whose
    partner there is the operand this computes the gradient of
    (:func:`~mixprec._src.autocast.interpreter._note_partners`); the other is
    a cotangent, computed in the backward pass.
    """
    if not region.backward or len(eqn.invars) < 2:
        return False
    partners = region.facts.partners
    known = [
        partners[v]
        for v in eqn.invars[:2]
        if not isinstance(v, Literal) and v in partners
    ]
    return len(known) == 1 and known[0] in _HALF


def decide_fusion(
    region: Region, eqn: JaxprEqn, spec: ops.OpSpec, invals: Sequence[Any]
) -> Decision:
    """Whether the op of a fusion (:data:`~mixprec._src.autocast.ops.FUSION`:
    one equation in place of several, declared by a
    :class:`~mixprec._src.autocast.fusions.Fusion`) runs fused, and in which
    dtype; :data:`HIGHER_ORDER` where it does not: its ops then run in its
    place, each decided on its own.

    A fusion's decision is the decisions of the equations it replaces that
    its entry says decide it (``Fusion.decided_by``: the attention's matmuls,
    every equation of a norm), each made where that equation is (its own
    ``float32_scope``, ``precision_scope`` or nested autocast; the fused
    equation itself sits in the scopes all of them share): it is fused where
    each of them would run in the low dtype, the same 16-bit dtype for all of
    them: a product (a matmul) as it is decided on its own (so not under
    ``float32_scope``, ``force_fp32``, a policy of another low dtype, a
    product asking for ``HIGHEST`` precision or a mix list that keeps
    ``dot_general`` out of the allow list), another equation by its scope
    (not under ``float32_scope``, nor a policy or mode that computes in
    float32). The mode must be a mixed one (``allow_mix_precision``), the
    policy without a float8 recipe (whose products have their own
    formulation), its floating operands float32 or that dtype, and its own
    entry in the allow list. It is then fused in that dtype. The backward
    pass of a fused op is fused where its forward pass was, in the same
    dtype.
    """
    entry = fusions.entry_for(spec.name)
    assert entry is not None, spec.name
    cfg = region.config
    fusion = eqn.params["fusion"]
    if eqn.params["part"] == "backward":
        forward = region.facts.fused.get(fusion)
        if forward is None:
            return HIGHER_ORDER
        return _fused(entry.fused_reason(fusion, forward[2], "backward"), forward[2])
    if (
        region.composite
        or cfg.mode not in _MIXED_MODES
        or cfg.policy.float8 is not None
        or cfg.lists.classify(spec.name) != "allow"
    ):
        return HIGHER_ORDER
    lows = set()
    for inner in fusion.eqns:
        if not entry.decided_by(inner):
            continue
        inner_region = region.for_eqn(inner)
        inner_spec = ops.spec_for(inner.primitive.name)
        if inner_spec is not None and inner_spec.product is not None:
            avals = [v.aval for v in inner.invars]
            d = decide_eqn(inner_region, inner, inner_spec, avals, [0] * len(avals))
            if d.precision is not Precision.LOW or d.dtype not in _HALF:
                return HIGHER_ORDER
            lows.add(np.dtype(d.dtype))
            continue
        inner_cfg = inner_region.config
        low = np.dtype(inner_cfg.low_dtype)
        if (
            inner_region.float32
            or inner_region.composite
            or inner_cfg.mode not in _MIXED_MODES
            or low not in _HALF
        ):
            return HIGHER_ORDER
        lows.add(low)
    if len(lows) != 1:
        return HIGHER_ORDER
    (low,) = lows
    if any(d is not None and d not in (_F32, low) for d in map(float_dtype, invals)):
        return HIGHER_ORDER
    return _fused(entry.fused_reason(fusion, low, "forward"), low)


_MIXED_MODES: Final = frozenset({"allow_mix_precision", "allow_mix_precision_bf16"})


def _fused(reason: str, low: np.dtype) -> Decision:
    """The decision of a fused op's forward or backward pass."""
    return Decision(Precision.LOW, low, "allow", reason)


def decide_epilogue(
    eqn: JaxprEqn,
    spec: ops.OpSpec | None,
    decision: Decision,
    invals: Sequence[Any],
    marks: Sequence[int],
    products: Sequence[bool],
) -> tuple[Decision, int] | None:
    """A bias add run on the float32 product of the CPU matmul that feeds it.

    ``dot(x, w) + b`` would otherwise round the dot's float32 product to the low
    dtype, round ``b`` too, add, and round again. Adding in float32 and rounding
    once is what a GEMM epilogue does (cuBLAS, oneDNN): the same dtype, at least
    as accurate, and XLA:CPU fuses the add into the rounding. ``products`` says
    per operand whether it is such a product (the interpreter keeps them).

    Returns ``(decision, operand)``: the epilogue's decision and which operand to
    replace by the float32 product; ``None`` when ``eqn`` is not such an add.
    """
    if (
        spec is None
        or ops.EPILOGUE not in spec.flags
        or decision.precision is not Precision.LOW
        or len(invals) != 2
        or sum(products) != 1
    ):
        return None
    i = list(products).index(True)
    other = 1 - i
    out_shape = aval_shape(eqn.outvars[0])
    if float_dtype(invals[other]) is None or not follows(
        eqn.invars[other], marks[other], out_shape
    ):
        return None
    epilogue = Decision(
        Precision.FLOAT32,
        _F32,
        decision.op_class,
        f"{decision.reason}; the epilogue of the dot before it: added in float32 to "
        f"its float32 product, rounded once to {decision.dtype}",
        out_dtype=decision.dtype,
    )
    return epilogue, i


# ------------------------------------------------------------------ loops, branches


def _widest_pair(a: np.dtype, b: np.dtype) -> np.dtype:
    """The wider of two floating dtypes (float16 vs bfloat16: float32)."""
    if a == b:
        return a
    if a.itemsize != b.itemsize:
        return a if a.itemsize > b.itemsize else b
    return np.dtype(np.float32) if a.itemsize < 4 else a


def carry_dtypes(received: Sequence[Any], traced: Sequence[Any]) -> list[Any]:
    """Per loop carry: the wider of the received and the traced floating dtype
    (``None`` for a carry that is not floating). A float32 RNN state stays
    float32 across iterations; the body's results are cast back to it.

    Examples:
        >>> import jax.numpy as jnp
        >>> carry_dtypes([jnp.ones(2, jnp.bfloat16)], [jnp.ones(2)])
        [dtype('float32')]
    """
    out = []
    for x, a in zip(received, traced, strict=True):
        dx, da = float_dtype(x), float_dtype(a)
        out.append(None if dx is None or da is None else _widest_pair(dx, da))
    return out


def branch_dtypes(per_branch: Sequence[Sequence[Any]]) -> list[Any]:
    """Per ``cond`` result: the widest floating dtype any branch gives
    (``None`` for results that are not floating), so that the branches agree.

    Examples:
        >>> branch_dtypes([[np.dtype("bfloat16")], [np.dtype("float32")]])
        [dtype('float32')]
    """
    target: list[Any] = []
    for column in zip(*per_branch, strict=True):
        if column[0] is None:
            target.append(None)
            continue
        d = column[0]
        for other in column[1:]:
            d = _widest_pair(d, other)
        target.append(d)
    return target
