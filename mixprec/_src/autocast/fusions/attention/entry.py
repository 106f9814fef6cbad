"""The fused attention's op-table entry: its primitive, pass, rule, FLOPs,
decision and notes, declared as one :class:`~mixprec._src.autocast.fusions.Fusion`
(registered by its line in :data:`~mixprec._src.autocast.fusions.REGISTERED`)."""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.extend.core import JaxprEqn

from mixprec._src.autocast import ops
from mixprec._src.autocast.fusions import Fusion
from mixprec._src.autocast.fusions.attention import notes, pattern, rule, scan_pair


__all__ = ["FUSION"]


def _flops(eqn: JaxprEqn) -> int:
    # Its matmuls (twice the forward's for the backward pass), set by the pass.
    return int(eqn.params["flops"])


def _is_product(eqn: JaxprEqn) -> bool:
    spec = ops.spec_for(eqn.primitive.name)
    return spec is not None and spec.product is not None


def _fused_reason(match: Any, low: np.dtype, part: str) -> str:
    what = "attention" if part == "forward" else "attention's gradient"
    return (
        f"{what} ({match.pattern}): one fused kernel in {low} where the "
        "platform has one (cuDNN on a GPU), softmax statistics in float32 inside "
        "it; elsewhere its ops run one by one"
    )


FUSION = Fusion(
    primitive=pattern.ATTENTION_P,
    reason="a written-out attention (q·kᵀ, scale, masks and biases, softmax, ·v), "
    "recognised and proven by a rewrite pass: one fused kernel where its "
    "matmuls would run in the low dtype (cuDNN's flash attention on a GPU; "
    "PyTorch's scaled_dot_product_attention under autocast)",
    # (A forward/backward pair of lax.scan bodies first: its pass puts the
    # attention's residuals in place of the weights between the two.)
    passes=(scan_pair.rewrite, pattern.rewrite),
    rule=rule.attention_rule,
    flops=_flops,
    decided_by=_is_product,
    fused_reason=_fused_reason,
    unfused_notes=notes.unfused_attention_notes,
)
