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
  float32 master weight stays float32. A dot written with ``precision=HIGH`` or
  ``HIGHEST`` (or under ``jax.default_matmul_precision("highest")``) runs in
  float32.
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
allow op that would be lowered runs in **float8** instead: operands scaled into
``float8_e4m3fn``, except an operand that is a gradient (a value of a backward
pass that derives from the loss's cotangent), which goes to ``float8_e5m2``;
float32 accumulation; the result in the low dtype as above. A product the
recipe's skip rules exclude (a dimension not a multiple of 16, or smaller than
``min_dim``) stays in the low dtype, and its decision says why.

The rule modules add what is not a choice of precision: constants cast down
saturate to the low dtype's finite range (``finfo(float32).min`` as a mask fill
must not become ``-inf``), and an operand broadcast into the result is cast after
it is broadcast, so that its gradient is summed in float32.
"""

from __future__ import annotations

import dataclasses
import enum
import functools as ft
from collections.abc import Sequence
from typing import Final

import jax.numpy as jnp
import numpy as np

from mixprec._src import float8 as f8
from mixprec._src.autocast.ops import FLOAT32_ONLY, NARROW_RANGE, OpClass


__all__ = ["Decision", "Precision", "decide"]

_F32: Final = np.dtype(np.float32)
_F16: Final = np.dtype(np.float16)
_BF16: Final = np.dtype("bfloat16")
_HALF: Final = frozenset({_F16, _BF16})


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
    float8: f8.Float8Recipe | None = None,
    float8_dims: tuple[tuple[str, int], ...] | None = None,
    float8_align: tuple[tuple[str, int], ...] = (),
    gradients: tuple[bool, ...] = (),
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
        float8: the policy's float8 recipe (allow ops only).
        float8_dims: ``(name, size)`` of the product's dimensions, for the
            recipe's skip rules.
        float8_align: ``(name, size)`` of the dimensions that must be
            multiples of 16.
        gradients: per operand, whether it is a gradient (goes to e5m2).

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

    allow_out = traced_out if backward and traced_out is not None else low

    def allow(reason: str) -> Decision:
        """An allow op that runs lowered: in float8 if the policy says so."""
        if float8 is None:
            return lowered(reason, allow_out)
        return _float8_decision(
            name,
            lowered(reason, allow_out),
            float8,
            float8_dims,
            float8_align,
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
        if backward and traced_out is not None:
            return allow(
                f"allow list: operands in {low}, float32 accumulation; a backward "
                f"pass keeps the gradient in {traced_out}"
            )
        return allow(f"allow list: lowered to {low}")
    if op_class == "deny":
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
    name: str,
    base: Decision,
    recipe: f8.Float8Recipe,
    dims: tuple[tuple[str, int], ...] | None,
    align: tuple[tuple[str, int], ...],
    gradients: tuple[bool, ...],
    out: np.dtype | None,
) -> Decision:
    """``base`` (the lowered decision of an allow op) moved to float8, or kept
    with the reason the recipe skips it."""
    skip = f8.skip_reason(recipe, dims, align)
    if skip is not None:
        kind, text = skip
        return dataclasses.replace(
            base,
            reason=f"{base.reason}; not float8 ({recipe}): {text}",
            float8=recipe,
            float8_skip=(kind, text),
        )
    formats = tuple(
        f8.E5M2 if i < len(gradients) and gradients[i] else f8.E4M3 for i in range(2)
    )
    names = " x ".join("e5m2 (gradient)" if f == f8.E5M2 else "e4m3" for f in formats)
    scaling = (
        "rowwise"
        if recipe.scaling == "rowwise" and name != "conv_general_dilated"
        else "tensorwise"
    )
    result = out if out is not None else base.dtype
    return Decision(
        Precision.FLOAT8,
        f8.E4M3,
        base.op_class,
        f"allow list: float8 ({scaling} current scaling), {names}, float32 "
        f"accumulation, result {result}",
        out_dtype=out,
        float8=recipe,
        operand_dtypes=formats,
    )
