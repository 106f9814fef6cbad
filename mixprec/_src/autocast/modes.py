"""Precision modes (seed 003, Ascend ``precision_mode``) and the per-op decision.

The interpreter calls :func:`decide` once per primitive or composite. It is a pure
function of the op's name, the dtypes its inputs arrive in, the mode, the op lists
and the low dtype. It returns a :class:`Decision`: the op's class, the floating
dtype to cast the op's floating inputs to (``None``: run at the dtypes received),
and a reason for reports.

The seven modes (``low`` is the policy's compute dtype, or the mode's own):

``must_keep_origin_dtype``
    Identity: every op runs at the precision it was written in. (Ascend: an op
    that only exists in float16 then fails; in JAX every op exists in float32.)
``force_fp32``
    Every floating op runs in float32, also ops whose inputs are 16-bit.
``allow_fp32_to_fp16`` / ``allow_fp32_to_bf16``
    Keep the original precision, except allow-list ops (matmuls, convolutions:
    on Ascend "the ops that do not support float32") which run in float16 /
    bfloat16. Every other floating op (deny and infer) runs in float32; clear ops
    pass their input through.
``force_fp16``
    Every op that can run in 16-bit runs in float16 (the deny list is ignored),
    except :data:`~mixprec._src.autocast.op_lists.FULL_PRECISION_ONLY` ops, which
    cannot run in 16-bit (FFT, complex, linear-algebra decompositions and
    solves: no 16-bit kernels or complex dtypes in JAX); they stay float32.
    16-bit inputs of either type are forced to float16 too.
``allow_mix_precision`` / ``allow_mix_precision_bf16``
    Automatic mixed precision with the lists: allow ops run low (the policy's
    compute dtype, float16 on Ascend; bfloat16 for the ``_bf16`` mode), deny ops
    float32, infer (gray) ops follow their upstream op: low if their floating
    inputs arrive low, float32 if any computed input is float32 (the widest
    wins, so a float32 residual stream stays float32). A float32 input that
    comes straight from a parameter, constant or literal (``from_param``) does
    not count: it follows the half operand, so ``bf16 activation + f32 bias``
    stays bf16.

Rules shared by all modes:

* Opaque kernels and host callbacks (:data:`~mixprec._src.autocast.op_lists.OPAQUE`:
  ``ffi_call``, ``pallas_call``, ``pure_callback``, ...) get ``dtype=None`` and
  must be run by the interpreter at the original jaxpr's input dtypes.
* Clear ops (and higher-order primitives, whose bodies are decided op by op) run
  at the dtypes they receive (``dtype=None``). If upstream decisions gave them
  floating operands of different dtypes, they take the widest dtype among the
  operands that are not ``from_param`` (parameters/literals follow).
* Ops with no floating input are not cast (``dtype=None``).
* Only float32 ops are converted (seed 003: "针对全网中float32数据类型的算子").
  An op is touched only if every floating input is float32 or the low dtype
  (``force_fp32`` and ``force_fp16`` also accept float16/bfloat16); float64,
  8-bit floats or the *other* 16-bit type (float16 code under a bfloat16 policy)
  leave the op at its received dtypes. A 16-bit input in the low dtype cannot be
  told apart from one autocast lowered upstream, so it is treated as lowered:
  deny ops upcast it, as PyTorch autocast does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Final

import numpy as np
from jax.typing import DTypeLike

from mixprec._src._errors import format_choices, suggest
from mixprec._src.autocast.op_lists import (
    FULL_PRECISION_ONLY,
    HIGHER_ORDER,
    OPAQUE,
    OpClass,
    OpLists,
)


#: The seven precision modes of seed 003, with a one-line summary each.
MODE_DOCS: Final[dict[str, str]] = {
    "must_keep_origin_dtype": "identity: every op keeps the precision it was "
    "written in",
    "force_fp32": "every floating op runs in float32 (16-bit inputs are upcast)",
    "allow_fp32_to_fp16": "only allow-list ops (matmul, conv) run in float16; "
    "every other op float32",
    "allow_fp32_to_bf16": "only allow-list ops (matmul, conv) run in bfloat16; "
    "every other op float32",
    "force_fp16": "every op that can run in 16-bit runs in float16 (deny list "
    "ignored); FULL_PRECISION_ONLY ops stay float32",
    "allow_mix_precision": "the lists: allow -> low (policy compute dtype), deny "
    "-> float32, infer -> follow upstream",
    "allow_mix_precision_bf16": "the lists with bfloat16: allow -> bfloat16, deny "
    "-> float32, infer -> follow upstream",
}
#: Valid values of ``mode``.
MODES: Final[tuple[str, ...]] = tuple(MODE_DOCS)

_F32: Final = np.dtype(np.float32)
_F16: Final = np.dtype(np.float16)
_BF16: Final = np.dtype("bfloat16")
_HALF: Final = frozenset({_F16, _BF16})
# Low dtype each mode forces; None: the caller's (the policy's compute dtype).
_FORCED_LOW: Final[dict[str, np.dtype | None]] = {
    "must_keep_origin_dtype": None,
    "force_fp32": None,
    "allow_fp32_to_fp16": _F16,
    "allow_fp32_to_bf16": _BF16,
    "force_fp16": _F16,
    "allow_mix_precision": None,
    "allow_mix_precision_bf16": _BF16,
}


@dataclasses.dataclass(frozen=True)
class Decision:
    """How one op runs under autocast.

    Attributes:
        op_class: the op's class in the lists (``"clear"`` for higher-order
            primitives).
        dtype: the floating dtype the op's floating inputs are cast to, or
            ``None`` to run at the dtypes received.
        reason: why, for reports (mode, list, upstream dtype).

    Examples:
        >>> d = Decision("allow", np.dtype("bfloat16"), "allow list")
        >>> d.dtype
        dtype(bfloat16)
    """

    op_class: OpClass
    dtype: np.dtype | None
    reason: str


def validate_mode(mode: str) -> str:
    """Returns ``mode`` if it is one of :data:`MODES`, else raises.

    Args:
        mode: a precision mode name.

    Returns:
        ``mode`` unchanged.

    Raises:
        TypeError: ``mode`` is not a string.
        ValueError: unknown mode (the message lists the valid ones and close
            matches).

    Examples:
        >>> validate_mode("allow_mix_precision")
        'allow_mix_precision'
        >>> validate_mode("allow_mixed_precision")
        Traceback (most recent call last):
        ...
        ValueError: `mode` must be one of ... Did you mean 'allow_mix_precision'...
    """
    if not isinstance(mode, str):
        raise TypeError(
            f"`mode` must be a string, got {type(mode).__name__} instead. Valid "
            f"modes: {format_choices(MODES)}."
        )
    if mode not in MODE_DOCS:
        raise ValueError(
            f"`mode` must be one of {format_choices(MODES)}, got {mode!r} instead."
            + suggest(mode, MODES)
        )
    return mode


def effective_low_dtype(mode: str, low_dtype: DTypeLike) -> np.dtype:
    """Returns the low dtype ``mode`` lowers to: forced by ``*_fp16`` / ``*_bf16``
    modes, else ``low_dtype`` (the policy's compute dtype).

    Examples:
        >>> effective_low_dtype("allow_mix_precision_bf16", np.float16)
        dtype(bfloat16)
        >>> effective_low_dtype("allow_mix_precision", np.float16)
        dtype('float16')
    """
    forced = _FORCED_LOW[validate_mode(mode)]
    return forced if forced is not None else np.dtype(low_dtype)


def _as_dtype(dtype: object) -> np.dtype | None:
    if isinstance(dtype, np.dtype):
        return dtype
    try:
        return np.dtype(dtype)  # type: ignore[arg-type]
    except TypeError:  # extended dtypes (PRNG keys) are not floating
        return None


def _is_float(dtype: np.dtype | None) -> bool:
    if dtype is None:
        return False
    return dtype.kind == "f" or dtype == _BF16 or dtype.name.startswith("float8")


def _widest(dtypes: Sequence[np.dtype]) -> np.dtype:
    # float32 beats the 16-bit types; between f16 and bf16 keep the first seen.
    best = dtypes[0]
    for d in dtypes[1:]:
        if d.itemsize > best.itemsize:
            best = d
    return best


def decide(
    name: str,
    in_dtypes: Sequence[DTypeLike],
    *,
    mode: str,
    lists: OpLists,
    low_dtype: DTypeLike,
    from_param: Sequence[bool] = (),
) -> Decision:
    """Decides the precision of one op (a primitive or composite) under ``mode``.

    Pure and cheap: the interpreter calls it once per equation.

    Args:
        name: the primitive name (``prim.name``) or composite name.
        in_dtypes: the dtypes the op's inputs arrive in (after upstream decisions).
        mode: one of :data:`MODES`.
        lists: the op lists (``default_op_lists()`` or a modified copy).
        low_dtype: the policy's compute dtype; ``*_fp16`` / ``*_bf16`` modes force
            their own (see :func:`effective_low_dtype`).
        from_param: ``from_param[i]`` is True if input ``i`` comes straight from a
            parameter, constant or literal; such float32 inputs follow the half
            operand in gray and clear ops. Shorter than ``in_dtypes``: the rest are
            False.

    Returns:
        The :class:`Decision`.

    Raises:
        ValueError: unknown ``mode``.

    Examples:
        >>> from mixprec._src.autocast.op_lists import default_op_lists
        >>> lists, f32, bf16 = default_op_lists(), np.float32, np.dtype("bfloat16")
        >>> kw = dict(mode="allow_mix_precision", lists=lists, low_dtype=bf16)
        >>> decide("dot_general", [f32, f32], **kw).dtype
        dtype(bfloat16)
        >>> decide("exp", [bf16], **kw).dtype
        dtype('float32')
        >>> decide("add", [bf16, f32], from_param=[False, True], **kw).dtype
        dtype(bfloat16)
        >>> decide("add", [f32, f32], **kw).dtype
        dtype('float32')
        >>> print(decide("reshape", [bf16], **kw).dtype)
        None
    """
    low = effective_low_dtype(mode, low_dtype)
    if name in HIGHER_ORDER:
        return Decision(
            "clear", None, "higher-order primitive: its body is decided op by op"
        )
    if name in OPAQUE:
        return Decision(
            "clear", None, "opaque kernel/callback: runs at its original dtypes"
        )
    op_class = lists.classify(name)
    dtypes = [_as_dtype(d) for d in in_dtypes]
    params = list(from_param)[: len(dtypes)]
    params += [False] * (len(dtypes) - len(params))
    floats: list[tuple[np.dtype, bool]] = [
        (d, p)
        for d, p in zip(dtypes, params, strict=True)
        if d is not None and _is_float(d)
    ]
    if not floats:
        return Decision(op_class, None, "no floating inputs")
    if mode == "must_keep_origin_dtype":
        return Decision(op_class, None, f"{mode}: original precision")

    float_dtypes = {d for d, _ in floats}
    forced_mode = mode in ("force_fp32", "force_fp16")
    eligible = {_F32, low} | (_HALF if forced_mode else set())
    if not float_dtypes <= eligible:
        other = ", ".join(sorted(str(d) for d in float_dtypes - eligible))
        return Decision(
            op_class,
            None,
            f"{mode}: not a float32 op (inputs in {other}); kept as written",
        )

    if op_class == "clear":
        if len(float_dtypes) == 1:
            return Decision("clear", None, "clear: runs at the dtype it receives")
        ops = [d for d, p in floats if not p] or [d for d, _ in floats]
        target = _widest(ops)
        return Decision(
            "clear",
            target,
            f"clear: mixed operand dtypes unified to the widest ({target})",
        )

    list_reason = f"{op_class} list"
    if mode == "force_fp32":
        return Decision(op_class, _F32, f"{mode}: every op in float32")
    if mode == "force_fp16":
        if name in FULL_PRECISION_ONLY:
            return Decision(
                op_class, _F32, f"{mode}: cannot run in 16-bit; kept float32"
            )
        return Decision(op_class, low, f"{mode}: every op that can runs in {low}")
    if mode in ("allow_fp32_to_fp16", "allow_fp32_to_bf16"):
        if op_class == "allow":
            return Decision("allow", low, f"{mode}: {list_reason}, lowered to {low}")
        return Decision(
            op_class, _F32, f"{mode}: only allow-list ops are lowered; float32"
        )
    # allow_mix_precision / allow_mix_precision_bf16
    if op_class == "allow":
        return Decision("allow", low, f"{list_reason}: lowered to {low}")
    if op_class == "deny":
        return Decision("deny", _F32, f"{list_reason}: float32")
    # Gray ops follow their upstream op. With several inputs the widest
    # computed input wins, so a float32 residual stream stays float32 (as in
    # PyTorch autocast); float32 parameters and literals follow the half
    # operand instead, so a bias add does not promote the activation.
    ops = [d for d, p in floats if not p] or [d for d, _ in floats]
    if low != _F32 and all(d == low for d in ops):
        return Decision("infer", low, f"infer list: follows its {low} input")
    return Decision("infer", _F32, "infer list: a float32 input (not a parameter) wins")
