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


def _cpu_bf16_from_env() -> str:
    value = os.environ.get("MIXPREC_CPU_BF16", "").strip().lower() or "auto"
    if value not in CPU_BF16_CHOICES:
        raise ValueError(
            "Invalid environment variable MIXPREC_CPU_BF16: expected one of "
            f"{', '.join(CPU_BF16_CHOICES)}, got {os.environ['MIXPREC_CPU_BF16']!r}."
        )
    return value


def _load_policy() -> None:
    spec = os.environ.get("MIXPREC_POLICY")
    if spec is None or not spec.strip():
        return
    try:
        set_global_policy(get_policy(spec))
    except ValueError as e:
        raise ValueError(f"Invalid environment variable MIXPREC_POLICY: {e}") from None


# Each is set before the next is read, so that an invalid value (which raises)
# leaves the others as the environment says.
cpu_bf16 = _cpu_bf16_from_env()
_load_policy()
