"""Configuration read once from the environment, validated at import.

``MIXPREC_POLICY``: the initial global policy, any string that
:func:`mixprec.get_policy` accepts (e.g. ``mixed_bfloat16``). Unset means
float32 everywhere.
"""

import os

from .policy import get_policy, set_global_policy


def _load() -> None:
    spec = os.environ.get("MIXPREC_POLICY")
    if spec is None or not spec.strip():
        return
    try:
        set_global_policy(get_policy(spec))
    except ValueError as e:
        raise ValueError(f"Invalid environment variable MIXPREC_POLICY: {e}") from None


_load()
