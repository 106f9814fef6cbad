"""The fused RMSNorm's op-table entry, declared as one
:class:`~mixprec._src.autocast.fusions.Fusion` (registered by its line in
:data:`~mixprec._src.autocast.fusions.REGISTERED`)."""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.extend.core import JaxprEqn

from mixprec._src.autocast.fusions import Fusion
from mixprec._src.autocast.fusions.norm import pattern, rule


__all__ = ["FUSION"]


def _flops(eqn: JaxprEqn) -> int:
    return int(eqn.params["flops"])


def _every_eqn(eqn: JaxprEqn) -> bool:
    del eqn
    return True


def _fused_reason(match: Any, low: np.dtype, part: str) -> str:
    del part
    return (
        f"RMSNorm ({match.pattern}): one op, its mean square and rsqrt in "
        f"float32, its result rounded once to {low}"
    )


FUSION = Fusion(
    primitive=pattern.RMS_NORM_P,
    reason="a written-out RMSNorm with its scale (x·rsqrt(mean(x²) + eps)·scale), "
    "recognised and proven by a rewrite pass: one op whose statistics run in "
    "float32 and whose result is in the low dtype, where none of its ops is in a "
    "float32 scope (XLA fuses its ops on every platform)",
    passes=(pattern.rewrite,),
    rule=rule.norm_rule,
    flops=_flops,
    decided_by=_every_eqn,
    fused_reason=_fused_reason,
)
