"""Configuration read once from the environment, validated at import.

``MIXPREC_POLICY``: the initial global policy, any string that
:func:`mixprec.get_policy` accepts (e.g. ``mixed_bfloat16``). Unset means
float32 everywhere.

``MIXPREC_CPU_BF16``: how autocast formulates bfloat16 dots on a CPU.
``auto`` (default, or unset): decided by whether the CPU has native bfloat16
matmul units (see ``mixprec._src.autocast.capability``); ``native``: always
bfloat16 GEMMs; ``emulated``: always float32 GEMMs on bfloat16-rounded
operands.
"""

import os

from .policy import get_policy, set_global_policy


CPU_BF16_CHOICES = ("auto", "native", "emulated")

# The value of MIXPREC_CPU_BF16 (validated), set by `_load`.
cpu_bf16 = "auto"


def _load() -> None:
    global cpu_bf16
    spec = os.environ.get("MIXPREC_POLICY")
    if spec is not None and spec.strip():
        try:
            set_global_policy(get_policy(spec))
        except ValueError as e:
            raise ValueError(
                f"Invalid environment variable MIXPREC_POLICY: {e}"
            ) from None
    value = os.environ.get("MIXPREC_CPU_BF16", "").strip().lower() or "auto"
    if value not in CPU_BF16_CHOICES:
        raise ValueError(
            "Invalid environment variable MIXPREC_CPU_BF16: expected one of "
            f"{', '.join(CPU_BF16_CHOICES)}, got {os.environ['MIXPREC_CPU_BF16']!r}."
        )
    cpu_bf16 = value


_load()
