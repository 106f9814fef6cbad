"""The op of a recognised RMSNorm: its rule.

The rewrite pass (:func:`.pattern.rewrite`) puts one equation of
:data:`.pattern.RMS_NORM_P` in place of a written-out RMSNorm with its scale;
:func:`~mixprec._src.autocast.decide.decide_fusion` decides it from the
scopes of the equations it replaced (each must compute in the same 16-bit
dtype); this rule runs it:

* **not fused** (the decision is ``HIGHER_ORDER``: a ``float32_scope``
  around any of its equations, a policy that computes in float32, a
  non-mixed mode, a float8 recipe): the equations it replaced run in its
  place, each decided and reported on its own, as without the rewrite;
* **fused**: on every platform, as one formulation: its input and scale
  rounded to the compute dtype (as an allow-list op's operands), the mean
  square and its ``rsqrt`` in float32 from that 16-bit input (widened inside
  the reduction), ``x·r·scale`` in float32, rounded once to the compute
  dtype.

There is no RMSNorm kernel behind it: XLA fuses these few ops itself. What
the fusion buys is one decision for the whole norm (its statistics are always
float32, whatever the lists say of its ``mul`` and ``reduce_sum``; its result
is in the compute dtype, ready for the matmul that reads it), one row in
``explain`` with its reason, and its FLOPs counted once.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mixprec._src.autocast import interpreter as itp
from mixprec._src.autocast.decide import HIGHER_ORDER
from mixprec._src.autocast.fusions.norm.pattern import Match
from mixprec._src.autocast.operands import CastContext


__all__ = ["fused", "norm_rule"]


def fused(m: Match, x: Any, scale: Any, low: Any) -> Any:
    """The RMSNorm of ``m`` on ``x`` and ``scale``: float32 statistics, the
    result rounded once to ``low``."""
    x32 = jnp.asarray(x, jnp.float32)
    ms = jnp.mean(jax.lax.square(x32), axis=m.axes, keepdims=True)
    r = jax.lax.rsqrt(ms + np.float32(m.eps))
    return (x32 * r * jnp.asarray(scale, jnp.float32)).astype(low)


def norm_rule(ctx: CastContext, *invals: Any, **params: Any) -> list[Any]:
    """The rule of :data:`.pattern.RMS_NORM_P` (its entry: :mod:`.entry`)."""
    m: Match = params["fusion"]
    if ctx.decision is HIGHER_ORDER:
        # Not fused: the equations it replaced, in its place.
        outs, marks = itp.run_inline(
            ctx.walk, m.eqns, ctx.eqn.invars, invals, ctx.marks, m.outvars
        )
        ctx.out_marks[:] = marks
        return outs
    low = np.dtype(ctx.decision.dtype)
    x, scale = (itp.cast(v, low) for v in invals)
    ctx.out_marks[:] = [0]
    return [fused(m, x, scale, low)]
