"""Precision modes: how much of a function autocast lowers.

The seven modes of Ascend AMP's ``precision_mode`` (``low`` is the policy's
compute dtype, or the mode's own):

``must_keep_origin_dtype``
    Identity: every op runs at the precision it was written in.
``force_fp32``
    Every floating op runs in float32, also ops whose inputs are 16-bit.
``allow_fp32_to_fp16`` / ``allow_fp32_to_bf16``
    Only allow-list ops (matmuls, convolutions) run in float16 / bfloat16;
    every other floating op (deny and infer) runs in float32 and clear ops pass
    their input through.
``force_fp16``
    Every op that can run in 16-bit runs in float16 (the deny list is ignored),
    except ops flagged ``float32_only`` in the op table (FFT, decompositions,
    complex numbers), which stay float32.
``allow_mix_precision`` / ``allow_mix_precision_bf16``
    Automatic mixed precision with the lists (the default): allow ops low, deny
    ops float32, gray ops follow their operands (see
    :mod:`~mixprec._src.autocast.decide`).
"""

from __future__ import annotations

from typing import Final

import numpy as np
from jax.typing import DTypeLike

from mixprec._src._errors import format_choices, suggest


#: The seven precision modes, with a one-line summary each.
MODE_DOCS: Final[dict[str, str]] = {
    "must_keep_origin_dtype": "identity: every op keeps the precision it was "
    "written in",
    "force_fp32": "every floating op runs in float32 (16-bit inputs are upcast)",
    "allow_fp32_to_fp16": "only allow-list ops (matmul, conv) run in float16; "
    "every other op float32",
    "allow_fp32_to_bf16": "only allow-list ops (matmul, conv) run in bfloat16; "
    "every other op float32",
    "force_fp16": "every op that can run in 16-bit runs in float16 (deny list "
    "ignored); float32-only ops stay float32",
    "allow_mix_precision": "the lists: allow -> low (policy compute dtype), deny "
    "-> float32, infer -> follow the operands",
    "allow_mix_precision_bf16": "the lists with bfloat16: allow -> bfloat16, deny "
    "-> float32, infer -> follow the operands",
}
#: Valid values of ``mode``.
MODES: Final[tuple[str, ...]] = tuple(MODE_DOCS)

_F16: Final = np.dtype(np.float16)
_BF16: Final = np.dtype("bfloat16")
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
