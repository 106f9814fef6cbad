"""Haiku integration: mixprec policies in `hk.mixed_precision`.

A `mixprec.Policy` is a drop-in for a ``jmp.Policy``, so Haiku's own API works
unchanged: ``hk.mixed_precision.set_policy(hk.Linear, mixprec.get_policy("half"))``.
The helpers here only add what mixprec adds: policies given by name
(``"mixed_bfloat16"``, ``"p=f32,c=bf16,o=f32"``) and the Keras habit of keeping
some module classes (norms, the output layer) in float32.

This module imports haiku; ``import mixprec`` never imports it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import haiku as hk

from ._src.policy import Policy, get_policy, plan_hint


__all__ = ["push_policy", "set_policy"]


def _policy(policy: Policy | str, fn_name: str) -> Policy:
    if not isinstance(policy, (Policy, str)):
        raise TypeError(
            f"`mixprec.haiku.{fn_name}(cls, policy)` must be a `mixprec.Policy` or a "
            f"policy string such as 'mixed_bfloat16', got {type(policy).__name__}."
            f"{plan_hint(policy)}"
        )
    return get_policy(policy)


def _check_cls(cls: type, fn_name: str) -> None:
    if not (isinstance(cls, type) and issubclass(cls, hk.Module)):
        raise TypeError(
            f"`mixprec.haiku.{fn_name}(cls, ...)` must be a subclass of `hk.Module`, "
            f"got {cls!r}."
        )


def set_policy(
    cls: type[hk.Module],
    policy: Policy | str,
    *,
    float32: Sequence[type[hk.Module]] = (),
) -> None:
    """Sets a mixed-precision policy for a Haiku module class.

    Equivalent to ``hk.mixed_precision.set_policy(cls, mixprec.get_policy(policy))``
    and, for each class in ``float32``, a policy that keeps that module in float32
    (params, compute and output float32), Keras's per-layer ``dtype='float32'``.
    Haiku applies a class's policy to its instances: casts their inputs to the
    compute dtype, creates parameters in the param dtype, casts them to the compute
    dtype when read, and casts outputs to the output dtype.

    Args:
      cls: the module class, e.g. ``hk.Linear`` or your model class.
      policy: a `mixprec.Policy` or a policy string.
      float32: module classes to keep in float32 (e.g. ``hk.LayerNorm``).

    Raises:
      TypeError: if ``cls`` is not a Haiku module class or ``policy`` not a policy.

    Examples:
      >>> import haiku as hk, jax, jax.numpy as jnp
      >>> import mixprec, mixprec.haiku
      >>> mixprec.haiku.set_policy(hk.Linear, "p=f32,c=bf16,o=f32")
      >>> f = hk.transform(lambda x: hk.Linear(2)(x))
      >>> params = f.init(jax.random.key(0), jnp.ones((1, 3)))
      >>> params["linear"]["w"].dtype, f.apply(params, None, jnp.ones((1, 3))).dtype
      (dtype('float32'), dtype('float32'))
      >>> hk.mixed_precision.clear_policy(hk.Linear)
    """
    _check_cls(cls, "set_policy")
    # Haiku annotates `jmp.Policy`; it only calls `cast_to_*` and reads
    # `param_dtype`, which a mixprec Policy provides (tested).
    hk.mixed_precision.set_policy(cls, _policy(policy, "set_policy"))  # pyright: ignore[reportArgumentType]
    for keep in float32:
        _check_cls(keep, "set_policy")
        hk.mixed_precision.set_policy(keep, get_policy("float32"))  # pyright: ignore[reportArgumentType]


@contextlib.contextmanager
def push_policy(cls: type[hk.Module], policy: Policy | str) -> Iterator[Policy]:
    """Uses a policy for a Haiku module class inside a ``with`` block.

    Args:
      cls: the module class.
      policy: a `mixprec.Policy` or a policy string.

    Yields:
      The policy in effect.

    Examples:
      >>> import haiku as hk, jax, jax.numpy as jnp
      >>> import mixprec, mixprec.haiku
      >>> f = hk.transform(lambda x: hk.Linear(2)(x))
      >>> with mixprec.haiku.push_policy(hk.Linear, "half") as p:
      ...     params = f.init(jax.random.key(0), jnp.ones((1, 3)))
      >>> p.param_dtype, params["linear"]["w"].dtype
      (dtype('float16'), dtype('float16'))
    """
    _check_cls(cls, "push_policy")
    p = _policy(policy, "push_policy")
    with hk.mixed_precision.push_policy(cls, p):  # pyright: ignore[reportArgumentType]
        yield p
