"""The rules of the op table that need code: matmul-like products, control
flow, calls, fused attention, and the defaults. Importing this package
attaches every rule to its entry in :mod:`mixprec._src.autocast.ops`."""

from mixprec._src.autocast.fusions.attention import rule as attention
from mixprec._src.autocast.rules import (
    calls,
    control_flow,
    default,
    products,
)


__all__ = ["attention", "calls", "control_flow", "default", "products"]
