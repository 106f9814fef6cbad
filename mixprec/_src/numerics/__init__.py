"""Seeing and fixing numerics: ``explain`` (what ran in which dtype, and why)
and ``diagnose`` (where half precision overflows or underflows, and what to do),
both observers of the autocast interpreter's one walk."""
