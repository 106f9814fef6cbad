"""The rules of the op table that need code: dots and convolutions, control
flow, calls, and the defaults. Importing this package attaches every rule to
its entry in :mod:`mixprec._src.autocast.ops`."""

from mixprec._src.autocast.rules import calls, control_flow, default, dots


__all__ = ["calls", "control_flow", "default", "dots"]
