"""The rules of the op table that need code: matmul-like products, control
flow, calls, and the defaults; and the entries and rules of the registered
fusions (:mod:`mixprec._src.autocast.fusions`). Importing this package
attaches every rule to its entry in :mod:`mixprec._src.autocast.ops`."""

from mixprec._src.autocast import fusions, ops
from mixprec._src.autocast.rules import (
    calls,
    control_flow,
    default,
    products,
)


__all__ = ["calls", "control_flow", "default", "products"]

for _fusion in fusions.registered():
    ops.def_fusion(_fusion.name, _fusion.reason, _fusion.rule)
