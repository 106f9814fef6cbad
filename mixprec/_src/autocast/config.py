"""The configuration of one autocast transform (hashable: it keys the caches)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from mixprec._src.autocast import capability
from mixprec._src.autocast.mixlist import modify_mixlist
from mixprec._src.autocast.modes import effective_low_dtype, validate_mode
from mixprec._src.autocast.ops import OpLists, default_op_lists
from mixprec._src.autocast.platforms import canonical_platform
from mixprec._src.plan import Plan
from mixprec._src.policy import Policy, get_global_policy, get_policy


__all__ = ["CastConfig", "make_config"]


@dataclasses.dataclass(frozen=True)
class CastConfig:
    """What one :func:`mixprec.autocast` transform was asked to do.

    Attributes:
        policy: the :class:`mixprec.Policy` in effect (with its float8 recipe,
            if any: allow-list products then run in float8).
        mode: the precision mode (see ``mixprec._src.autocast.modes``).
        lists: the :class:`~mixprec.OpLists` (allow / deny / infer / clear).
        low_dtype: the dtype allow-list ops run in (the policy's compute dtype,
            or the one the mode forces).
        strict: raise ``NotImplementedError`` for an op in no list.
        platform: ``None`` (default): dots and convolutions are formulated for
            each platform and JAX keeps the one a computation is lowered for
            (:mod:`~mixprec._src.autocast.platforms`); or one pinned platform
            (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``).
        custom_vjp_dots: formulate low-precision dots with a ``custom_vjp``
            whose backward dots are formulated the same way (for a call under
            reverse-mode AD; ``jax.jvp`` cannot go through one).
        cpu_bf16: how bfloat16 dots run on CPU: ``"native"`` (bfloat16
            GEMMs) or ``"emulated"`` (float32 GEMMs on rounded operands);
            ``None`` until :meth:`resolved` reads this CPU's capability
            (:func:`~mixprec._src.autocast.capability.cpu_bf16`) when the
            transformed function is called, so that making a configuration
            initialises no JAX backend.
        plan: a :class:`mixprec.Plan` giving matmul sites their own
            policies (``policy`` is then its base), or ``None``; resolved
            per equation by the walk, where regions are
            (:mod:`~mixprec._src.autocast.sites`).

    Examples:
        >>> cfg = make_config("mixed_bfloat16")
        >>> cfg.low_dtype, cfg.mode
        (dtype(bfloat16), 'allow_mix_precision')
    """

    policy: Policy
    mode: str
    lists: OpLists
    low_dtype: np.dtype
    strict: bool = False
    platform: str | None = None
    custom_vjp_dots: bool = False
    cpu_bf16: str | None = None
    plan: Plan | None = None

    def with_policy(self, policy: Policy) -> CastConfig:
        """This configuration under another policy (and its low dtype)."""
        low = effective_low_dtype(self.mode, policy.compute_dtype)
        return dataclasses.replace(
            self, policy=policy, low_dtype=low, cpu_bf16=None
        ).resolved()

    def resolved(self, *, probe: bool = True) -> CastConfig:
        """This configuration with the CPU's bfloat16 formulation filled in
        (when a CPU lowering would use one): part of what a transformed
        function is cached under. With ``probe=False`` it is filled in only
        if no JAX backend is needed to tell (CPU features, an override,
        ``MIXPREC_CPU_BF16``); otherwise left for the first call.

        Examples:
            >>> cfg = make_config("mixed_bfloat16")
            >>> cfg.resolved().cpu_bf16 in ("native", "emulated")
            True
            >>> make_config("mixed_float16").resolved().cpu_bf16 is None
            True
        """
        if (
            self.cpu_bf16 is not None
            or self.platform not in (None, "cpu")
            or np.dtype(self.low_dtype) != np.dtype(jnp.bfloat16)
        ):
            return self
        cap = capability.cpu_bf16() if probe else capability.cpu_bf16_without_probe()
        if cap is None:
            return self
        return dataclasses.replace(self, cpu_bf16=cap.formulation)


def make_config(
    policy: Policy | Plan | str | None = None,
    *,
    mode: str = "allow_mix_precision",
    mixlist: Any = None,
    strict: bool = False,
    custom_vjp_dots: bool = False,
    lists: OpLists | None = None,
    platform: str | None = None,
) -> CastConfig:
    """Builds the :class:`CastConfig` that :func:`mixprec.autocast` would use.

    Args:
        policy: a policy or policy string; None means the global policy;
            a :class:`mixprec.Plan` (its base policy, and its sites).
        mode: the precision mode.
        mixlist: a ``modify_mixlist`` spec (dict, JSON string or path) applied
            to the lists, an :class:`~mixprec.OpLists` to use as they are, or None.
        strict: raise for primitives in no list.
        custom_vjp_dots: formulate CPU dots with a ``custom_vjp``.
        lists: start from these lists instead of the defaults.
        platform: pin the formulation of one platform (default: each
            platform's, chosen when the computation is lowered).

    Returns:
        The configuration.

    Raises:
        TypeError: ``strict`` or ``custom_vjp_dots`` is not a bool.
        ValueError: unknown ``mode`` or policy, or a bad ``mixlist``.

    Examples:
        >>> make_config("mixed_float16", mode="allow_mix_precision_bf16").low_dtype
        dtype(bfloat16)
    """
    for name, value in (("strict", strict), ("custom_vjp_dots", custom_vjp_dots)):
        if not isinstance(value, bool | np.bool_):
            raise TypeError(
                f"`autocast(..., {name}=...)` must be True or False, got "
                f"{value!r} ({type(value).__name__}) instead."
            )
    plan = policy if isinstance(policy, Plan) else None
    if isinstance(policy, Plan):
        policy = policy.base
    pol = get_global_policy() if policy is None else get_policy(policy)
    validate_mode(mode)
    base = default_op_lists() if lists is None else lists
    if mixlist is not None:
        base = (
            mixlist if isinstance(mixlist, OpLists) else modify_mixlist(base, mixlist)
        )
    low = effective_low_dtype(mode, pol.compute_dtype)
    return CastConfig(
        policy=pol,
        mode=mode,
        lists=base,
        low_dtype=low,
        strict=bool(strict),
        platform=canonical_platform(platform),
        custom_vjp_dots=bool(custom_vjp_dots),
        plan=plan,
    ).resolved(probe=False)
