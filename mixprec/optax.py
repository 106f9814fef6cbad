"""Optax integration: an optimizer wrapper that owns the loss scale.

`loss_scaled` is Keras's ``LossScaleOptimizer`` for optax. Its state holds the
loss scale; a step whose gradients are not finite changes neither the parameters
(the updates are zeros) nor the inner optimizer's state, backs the scale off and
is counted. The skipping is optax's own `optax.apply_if_finite`, set never to
give up.

**The wrapper takes true (unscaled) gradients**, the ones `mixprec.value_and_grad`
returns. Everything in an optax chain (clipping, weight decay, Adam's moments)
then sees real gradient values. Pass the optimizer state itself as the loss
scale, so the scale that multiplied the loss is always the one the optimizer
adjusts::

    vg = mixprec.value_and_grad(loss_fn)
    loss, grads, _ = vg(params, batch, loss_scale=opt_state)
    updates, opt_state = opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)

Grads that were never scaled (plain `jax.grad`) are still handled correctly (the
step is skipped if they are not finite), they just get no underflow protection.
The wrapper re-checks finiteness itself, so there is no flag to forget to pass.

This module imports optax; ``import mixprec`` never imports it.
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import optax

from ._src.casting import is_floating_array
from ._src.loss_scale import DynamicLossScale, LossScale, all_finite


__all__ = [
    "LossScaledState",
    "current_loss_scale",
    "loss_scale_stats",
    "loss_scaled",
]

# `apply_if_finite` accepts a non-finite update after this many consecutive
# rejections; a saturating int32 counter never exceeds it, so it never gives up.
_NEVER = int(jnp.iinfo(jnp.int32).max)


class LossScaledState(NamedTuple):
    """State of `loss_scaled`.

    Attributes:
      inner_state: the wrapped optimizer's state (unchanged by skipped steps).
      loss_scale: the loss scale to use for the next step.
      num_skipped: int32 count of skipped (non-finite) steps so far.
      num_consecutive_skipped: int32 count of non-finite steps since the last
        finite one.
      last_finite: whether the last step's gradients were finite.

    Examples:
      >>> import optax, jax.numpy as jnp
      >>> import mixprec, mixprec.optax
      >>> state = mixprec.optax.loss_scaled(optax.sgd(0.1)).init(jnp.zeros(2))
      >>> isinstance(state, mixprec.optax.LossScaledState), state.num_skipped
      (True, Array(0, dtype=int32))
    """

    inner_state: Any
    loss_scale: LossScale
    num_skipped: jax.Array
    num_consecutive_skipped: jax.Array
    last_finite: jax.Array


def _poison(tree: Any, finite: jax.Array) -> Any:
    """Makes every floating leaf NaN where ``finite`` is false (a global verdict)."""

    def f(x: Any) -> Any:
        if not is_floating_array(x):
            return x
        return jnp.where(finite, x, jnp.array(jnp.nan, x.dtype))

    return jax.tree.map(f, tree)


def loss_scaled(
    inner: optax.GradientTransformation,
    loss_scale: LossScale | None = None,
    *,
    axis_name: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optimizer so that it skips non-finite steps and adapts a loss scale.

    Takes **unscaled** gradients, as returned by `mixprec.value_and_grad`. On each
    update it checks that every gradient is finite. If so, the inner optimizer runs
    as usual; if not, the updates are zeros and the inner state is kept, so
    neither the parameters nor the optimizer's moments see the bad step. In both
    cases the loss scale is adjusted (``loss_scale.adjust(finite)``) and the skip
    counters are updated.

    Args:
      inner: the optimizer to wrap.
      loss_scale: the initial loss scale. Defaults to
        ``DynamicLossScale(2.0**15)`` (Keras's default).
      axis_name: the mapped axis (``shard_map``/``pmap``) over which the gradients
        are *sharded and not yet reduced* (each device holding a different part,
        e.g. sharded parameters). The finite verdict is then reduced over it so
        that every device skips together. Not needed with ``jit`` over global
        arrays, nor after a ``lax.pmean`` of the gradients (a non-finite value
        then reaches every device anyway).

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a
      `LossScaledState` and whose ``update(grads, state, params=None, **extra)``
      forwards extra arguments to ``inner``.

    Raises:
      TypeError: if ``loss_scale`` is not a mixprec loss scale.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import mixprec, mixprec.optax
      >>> opt = mixprec.optax.loss_scaled(optax.sgd(0.5))
      >>> params = {"w": jnp.ones(2)}
      >>> state = opt.init(params)
      >>> loss_fn = lambda p: jnp.sum(p["w"] ** 2)
      >>> _, grads, _ = mixprec.value_and_grad(loss_fn)(params, loss_scale=state)
      >>> updates, state = opt.update(grads, state, params)
      >>> optax.apply_updates(params, updates)["w"]
      Array([0., 0.], dtype=float32)

      A non-finite step is skipped and backs the scale off:

      >>> bad = {"w": jnp.array([1.0, jnp.inf])}
      >>> updates, state = opt.update(bad, state, params)
      >>> updates["w"], state.num_skipped
      (Array([0., 0.], dtype=float32), Array(1, dtype=int32))
      >>> state.loss_scale.loss_scale
      Array(16384., dtype=float32)
    """
    if loss_scale is None:
        loss_scale = DynamicLossScale(jnp.asarray(2.0**15, jnp.float32))
    if not isinstance(loss_scale, LossScale):
        raise TypeError(
            "`mixprec.optax.loss_scaled(inner, loss_scale=...)` must be a mixprec "
            "loss scale (`NoOpLossScale()`, `StaticLossScale(s)`, "
            f"`DynamicLossScale(s)`), got {type(loss_scale).__name__} instead."
        )
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(
            "`mixprec.optax.loss_scaled(inner, ...)` must be an optax "
            f"GradientTransformation, got {type(inner).__name__} instead."
        )
    guarded = optax.apply_if_finite(inner, max_consecutive_errors=_NEVER)
    initial_scale = loss_scale

    def init_fn(params: Any) -> LossScaledState:
        s = cast(optax.ApplyIfFiniteState, guarded.init(params))
        return LossScaledState(
            inner_state=s.inner_state,
            loss_scale=initial_scale,
            num_skipped=s.total_notfinite,
            num_consecutive_skipped=s.notfinite_count,
            last_finite=s.last_finite,
        )

    def update_fn(
        updates: Any,
        state: LossScaledState,
        params: Any = None,
        **extra_args: Any,
    ) -> tuple[Any, LossScaledState]:
        if not isinstance(state, LossScaledState):
            raise TypeError(
                "`loss_scaled(...).update(grads, state, ...)` expects the state "
                "from the same optimizer's `init`, a `LossScaledState`, got "
                f"{type(state).__name__} instead."
            )
        finite = all_finite(updates, axis_name=axis_name)
        if axis_name is not None:
            # One device's inf must make every device skip: give
            # `apply_if_finite` the global verdict.
            updates = _poison(updates, finite)
        s = optax.ApplyIfFiniteState(
            notfinite_count=state.num_consecutive_skipped,
            last_finite=state.last_finite,
            total_notfinite=state.num_skipped,
            inner_state=state.inner_state,
        )
        new_updates, new_s = guarded.update(updates, s, params, **extra_args)
        s = cast(optax.ApplyIfFiniteState, new_s)
        return new_updates, LossScaledState(
            inner_state=s.inner_state,
            loss_scale=state.loss_scale.adjust(finite),
            num_skipped=s.total_notfinite,
            num_consecutive_skipped=s.notfinite_count,
            last_finite=s.last_finite,
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


def _find_states(state: Any) -> list[LossScaledState]:
    return [
        s
        for s in jax.tree.leaves(
            state, is_leaf=lambda x: isinstance(x, LossScaledState)
        )
        if isinstance(s, LossScaledState)
    ]


def _the_state(state: Any, fn_name: str) -> LossScaledState:
    found = _find_states(state)
    if len(found) != 1:
        raise ValueError(
            f"`mixprec.optax.{fn_name}(state)` expects an optimizer state holding "
            f"exactly one `LossScaledState` (from `mixprec.optax.loss_scaled`), "
            f"found {len(found)}."
        )
    return found[0]


def current_loss_scale(state: Any) -> LossScale:
    """The loss scale to use for the next step, found in an optimizer state.

    Works on the state of `loss_scaled` itself or of any optax combinator around
    it (``optax.chain``, ``optax.MultiSteps`` ...).

    Args:
      state: an optimizer state holding exactly one `LossScaledState`.

    Returns:
      The loss scale object; ``.loss_scale`` is the float32 scale.

    Raises:
      ValueError: if ``state`` holds no `LossScaledState`, or several.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import mixprec, mixprec.optax
      >>> opt = optax.chain(optax.clip_by_global_norm(1.0),
      ...                   mixprec.optax.loss_scaled(optax.adam(1e-3)))
      >>> mixprec.optax.current_loss_scale(opt.init(jnp.zeros(3))).loss_scale
      Array(32768., dtype=float32)
    """
    return _the_state(state, "current_loss_scale").loss_scale


def loss_scale_stats(state: Any) -> dict[str, jax.Array]:
    """Numbers to log: the current scale and the skip counters.

    Args:
      state: an optimizer state holding exactly one `LossScaledState`.

    Returns:
      A dict with ``loss_scale`` (float32), ``num_skipped`` and
      ``num_consecutive_skipped`` (int32) and ``last_finite`` (bool).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import mixprec, mixprec.optax
      >>> opt = mixprec.optax.loss_scaled(optax.sgd(0.1), mixprec.StaticLossScale(8.0))
      >>> stats = mixprec.optax.loss_scale_stats(opt.init(jnp.zeros(2)))
      >>> {k: v.item() for k, v in stats.items()}  # doctest: +NORMALIZE_WHITESPACE
      {'loss_scale': 8.0, 'num_skipped': 0, 'num_consecutive_skipped': 0,
       'last_finite': True}
    """
    s = _the_state(state, "loss_scale_stats")
    return {
        "loss_scale": jnp.asarray(s.loss_scale.loss_scale),
        "num_skipped": s.num_skipped,
        "num_consecutive_skipped": s.num_consecutive_skipped,
        "last_finite": s.last_finite,
    }
