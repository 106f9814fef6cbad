"""Equinox integration: run an Equinox model under a mixed-precision policy.

Equinox modules are pytrees, so `mixprec.Policy.cast_to_compute` already casts
exactly their floating array leaves: integer buffers, PRNG keys, functions and
static fields are untouched. `MixedPrecision` packages the usual pattern as a
module: float32 master weights inside, a compute-dtype copy made on every call
(so gradients flow back to the float32 weights), inputs cast to the compute
dtype, outputs to the output dtype, and per-class overrides that keep modules
such as ``eqx.nn.LayerNorm`` or the output layer in float32 (Keras's per-layer
``dtype='float32'``). It is an ``eqx.Module``: ``eqx.filter_jit``,
``eqx.filter_grad``, ``eqx.partition`` and serialisation work as usual.

This module imports equinox; ``import mixprec`` never imports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax

from ._src.casting import cast_tree, is_floating_array
from ._src.policy import Policy, get_policy


__all__ = ["MixedPrecision"]


class _Cast(eqx.Module):
    """A submodule run under its own policy (made on the fly; never stored)."""

    module: Any
    policy: Policy = eqx.field(static=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self.policy.cast_to_compute((args, kwargs))
        return self.policy.cast_to_output(self.module(*args, **kwargs))


def _check_overrides(overrides: Any) -> tuple[tuple[type, Policy], ...]:
    if not isinstance(overrides, Mapping):
        raise TypeError(
            "`MixedPrecision(..., overrides=...)` must be a mapping from module "
            f"classes to policies, got {type(overrides).__name__}."
        )
    out = []
    for cls, pol in overrides.items():
        if not isinstance(cls, type):
            raise TypeError(
                "`MixedPrecision(..., overrides=...)` keys must be module classes "
                f"(e.g. `eqx.nn.LayerNorm`), got {cls!r}."
            )
        out.append((cls, get_policy(pol)))
    return tuple(out)


def _policy_for(x: Any, overrides: tuple[tuple[type, Policy], ...]) -> Policy | None:
    for cls, pol in overrides:
        if isinstance(x, cls):
            return pol
    return None


class MixedPrecision(eqx.Module):
    """An Equinox module run under a mixed-precision policy.

    Args:
      module: any callable Equinox module (or pytree with ``__call__``).
      policy: a `mixprec.Policy` or policy string, e.g. ``"mixed_bfloat16"``.
      overrides: module classes mapped to their own policy, e.g.
        ``{eqx.nn.LayerNorm: "float32"}``. An overridden submodule (first
        matching class wins) gets its parameters in that policy's dtypes and its
        inputs cast to that compute dtype; its output is cast to that policy's
        output dtype.

    On construction the floating parameters are cast to the param dtype. On each
    call a compute copy is made, the inputs are cast to the compute dtype and the
    output to the output dtype.

    Examples:
      >>> import equinox as eqx, jax, jax.numpy as jnp
      >>> import mixprec, mixprec.equinox
      >>> mlp = eqx.nn.MLP(3, 2, width_size=8, depth=1, key=jax.random.key(0))
      >>> model = mixprec.equinox.MixedPrecision(mlp, "mixed_bfloat16")
      >>> model.module.layers[0].weight.dtype, model(jnp.ones(3)).dtype
      (dtype('float32'), dtype('float32'))
      >>> grads = eqx.filter_grad(lambda m, x: m(x).sum())(model, jnp.ones(3))
      >>> grads.module.layers[0].weight.dtype
      dtype('float32')
    """

    module: Any
    policy: Policy = eqx.field(static=True)
    overrides: tuple[tuple[type, Policy], ...] = eqx.field(static=True)

    def __init__(
        self,
        module: Any,
        policy: Policy | str,
        *,
        overrides: Mapping[type, Policy | str] | None = None,
    ):
        self.policy = get_policy(policy)
        self.overrides = _check_overrides({} if overrides is None else overrides)
        self.module = self._map(module, "param")

    def _map(self, module: Any, which: str) -> Any:
        """Casts floating leaves per policy; wraps overridden submodules for calls."""
        overrides = self.overrides
        default = self.policy

        def is_override(x: Any) -> bool:
            return _policy_for(x, overrides) is not None

        def cast(x: Any) -> Any:
            pol = _policy_for(x, overrides)
            if pol is None:
                if not is_floating_array(x):
                    return x
                dtype = (
                    default.param_dtype if which == "param" else default.compute_dtype
                )
                return cast_tree(x, dtype)
            if which == "param":
                return pol.cast_to_param(x)
            return _Cast(pol.cast_to_compute(x), pol)

        # The root itself may be an overridden class.
        return jax.tree.map(cast, module, is_leaf=is_override)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the wrapped module in the compute dtype.

        Examples:
          >>> import equinox as eqx, jax, jax.numpy as jnp
          >>> import mixprec, mixprec.equinox
          >>> lin = eqx.nn.Linear(2, 2, key=jax.random.key(0))
          >>> mixprec.equinox.MixedPrecision(lin, "half")(jnp.ones(2)).dtype
          dtype('float16')
        """
        compute = self._map(self.module, "compute")
        args, kwargs = self.policy.cast_to_compute((args, kwargs))
        return self.policy.cast_to_output(compute(*args, **kwargs))
