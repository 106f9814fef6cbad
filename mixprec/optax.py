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

Gradient accumulation goes *inside* the wrapper,
``loss_scaled(optax.MultiSteps(inner, k))``, so that every micro-batch is
checked before it is accumulated; the other order is refused (see
`loss_scaled`).

`compact_state` stores any optimizer's training state in fewer bytes (bfloat16
master weights with stochastic rounding or an exact 16-bit remainder; 8-bit
block-wise moments), down to about 6 bytes per parameter with AdamW; it goes
inside `loss_scaled`.

This module imports optax; ``import mixprec`` never imports it.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ._src import _compat, training
from ._src.autocast import nnx_state
from ._src.casting import is_floating_array
from ._src.compact.optimizer import (
    CompactState as CompactState,
    compact_params as compact_params,
    compact_state as compact_state,
    decode_compact_state as decode_compact_state,
    master_params as master_params,
)
from ._src.compact.report import (
    CompactStateReport as CompactStateReport,
    describe_compact_state as describe_compact_state,
)
from ._src.loss_scale import DynamicLossScale, LossScale, all_finite


__all__ = [
    "CompactState",
    "CompactStateReport",
    "LossScaleFloorWarning",
    "LossScaledState",
    "compact_params",
    "compact_state",
    "current_loss_scale",
    "decode_compact_state",
    "describe_compact_state",
    "loss_scale_stats",
    "loss_scaled",
    "master_params",
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
      num_steps_at_floor: int32 count of the steps in a row (up to this one)
        after which the loss scale sat at its floor (a `DynamicLossScale`'s
        ``min_loss_scale``); 0 when it is above it, always 0 for other scales.

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
    num_steps_at_floor: jax.Array


class LossScaleFloorWarning(RuntimeWarning):
    """The loss scale has sat at its floor for many steps (see `loss_scaled`).

    float16 gradients smaller than about 6e-8 then flush to zero again. Turned
    on with ``loss_scaled(..., warn_at_floor_after=n)``; filter it like any
    warning.

    Examples:
      >>> import warnings
      >>> import mixprec.optax
      >>> warnings.simplefilter("error", mixprec.optax.LossScaleFloorWarning)
      >>> issubclass(mixprec.optax.LossScaleFloorWarning, RuntimeWarning)
      True
      >>> warnings.resetwarnings()
    """


def _at_floor(loss_scale: LossScale) -> jax.Array:
    if isinstance(loss_scale, DynamicLossScale):
        scale = jnp.asarray(loss_scale.loss_scale, jnp.float32)
        return scale <= jnp.float32(loss_scale.min_loss_scale)
    return jnp.zeros((), jnp.bool_)


def _warn_at_floor(steps: Any, scale: Any) -> None:
    warnings.warn(
        f"The loss scale has sat at its floor ({float(scale):g}) for {int(steps)} "
        "steps: float16 gradients below ~6e-8 flush to zero again. Usually "
        "spurious non-finite steps keep pushing it down; see 'choosing loss-scale "
        "settings' in docs/training.md (`nonfinite_before_backoff=2, "
        "consecutive_nonfinite=True`, a shorter `period`), or train in bfloat16.",
        LossScaleFloorWarning,
        stacklevel=2,
    )


def _poison(tree: Any, finite: jax.Array) -> Any:
    """Makes every floating leaf NaN where ``finite`` is false (a global verdict)."""

    def f(x: Any) -> Any:
        if not is_floating_array(x):
            return x
        return jnp.where(finite, x, jnp.array(jnp.nan, x.dtype))

    return jax.tree.map(f, tree)


def loss_scaled(
    inner: optax.GradientTransformation | optax.MultiSteps,
    loss_scale: LossScale | None = None,
    *,
    axis_name: Any = None,
    warn_at_floor_after: int | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optimizer so that it skips non-finite steps and adapts a loss scale.

    Takes **unscaled** gradients, as returned by `mixprec.value_and_grad`. On each
    update it checks that every gradient is finite. If so, the inner optimizer runs
    as usual; if not, the updates are zeros and the inner state is kept, so
    neither the parameters nor the optimizer's moments see the bad step. In both
    cases the loss scale is adjusted (``loss_scale.adjust(finite)``) and the skip
    counters are updated.

    The default scale backs off only after two non-finite steps in a row: one
    spurious inf (a bad batch) is skipped without lowering the scale, while a
    scale that is really too large overflows on every step and still backs off.
    On a float16 soak with 1% spurious non-finite steps, backing off on every
    one (JMP's and Keras's rule, still ``DynamicLossScale``'s own default) left
    the scale at its floor of 1 from step ~2,000 on; see "choosing loss-scale
    settings" in docs/training.md for the measurements.

    Gradient accumulation: pass ``optax.MultiSteps(opt, k)`` as ``inner``, so
    that each micro-batch is checked and a bad one is skipped before it is
    accumulated. The reverse, ``optax.MultiSteps(loss_scaled(opt), k)``, lets
    one non-finite micro-batch turn MultiSteps' accumulator into NaN for good;
    `mixprec.value_and_grad`, `current_loss_scale` and `loss_scale_stats`
    refuse that state.

    Args:
      inner: the optimizer to wrap (an ``optax.MultiSteps`` too).
      loss_scale: the initial loss scale. Defaults to
        ``DynamicLossScale(2.0**15, nonfinite_before_backoff=2,
        consecutive_nonfinite=True)`` (Keras's initial scale and period).
      axis_name: the mapped axis (``shard_map``/``pmap``) over which the gradients
        are *sharded and not yet reduced* (each device holding a different part,
        e.g. sharded parameters). The finite verdict is then reduced over it so
        that every device skips together, and the state stays replicated
        (``shard_map``'s default ``check_vma`` accepts it as a ``P()``
        output). Not needed with ``jit`` over global arrays, nor for gradients
        already reduced (a ``lax.pmean``, or replicated parameters under
        ``check_vma``, whose gradients JAX sums over the devices itself): a
        non-finite value then reaches every device anyway.
      warn_at_floor_after: if given, issue a `LossScaleFloorWarning` (through
        ``jax.debug.callback``, so also under ``jit``) once the scale has sat at
        its floor for this many steps in a row, and again after each further
        stretch as long.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a
      `LossScaledState` and whose ``update(grads, state, params=None, **extra)``
      forwards extra arguments to ``inner``.

    Raises:
      TypeError: if ``loss_scale`` is not a mixprec loss scale or ``inner`` not
        an optimizer.
      ValueError: if ``warn_at_floor_after`` is not a positive integer.

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

      A non-finite step is skipped; a second one in a row backs the scale off:

      >>> bad = {"w": jnp.array([1.0, jnp.inf])}
      >>> updates, state = opt.update(bad, state, params)
      >>> updates["w"], state.num_skipped, state.loss_scale.loss_scale
      (Array([0., 0.], dtype=float32), Array(1, dtype=int32),
       Array(32768., dtype=float32))
      >>> updates, state = opt.update(bad, state, params)
      >>> state.num_skipped, state.loss_scale.loss_scale
      (Array(2, dtype=int32), Array(16384., dtype=float32))
    """
    if loss_scale is None:
        loss_scale = DynamicLossScale(
            jnp.asarray(2.0**15, jnp.float32),
            nonfinite_before_backoff=2,
            consecutive_nonfinite=True,
        )
    if not isinstance(loss_scale, LossScale):
        raise TypeError(
            "`mixprec.optax.loss_scaled(inner, loss_scale=...)` must be a mixprec "
            "loss scale (`NoOpLossScale()`, `StaticLossScale(s)`, "
            f"`DynamicLossScale(s)`), got {type(loss_scale).__name__} instead."
        )
    if isinstance(inner, optax.MultiSteps):
        inner = inner.gradient_transformation()
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(
            "`mixprec.optax.loss_scaled(inner, ...)` must be an optax "
            f"GradientTransformation, got {type(inner).__name__} instead."
        )
    if warn_at_floor_after is not None and (
        isinstance(warn_at_floor_after, bool)
        or not isinstance(warn_at_floor_after, int)
        or warn_at_floor_after < 1
    ):
        raise ValueError(
            "`mixprec.optax.loss_scaled(..., warn_at_floor_after=...)` must be a "
            f"positive integer (a number of steps) or None, got "
            f"{warn_at_floor_after!r}."
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
            num_steps_at_floor=jnp.asarray(_at_floor(initial_scale), jnp.int32),
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
        updates = _as_inner_returns(
            inner, updates, state.inner_state, params, extra_args
        )
        s = optax.ApplyIfFiniteState(
            notfinite_count=state.num_consecutive_skipped,
            last_finite=state.last_finite,
            total_notfinite=state.num_skipped,
            inner_state=state.inner_state,
        )
        new_updates, new_s = guarded.update(updates, s, params, **extra_args)
        s = cast(optax.ApplyIfFiniteState, new_s)
        if axis_name is not None:
            # `apply_if_finite` counts from its own check of this device's
            # (poisoned) updates: the global verdict's value, but in
            # `shard_map` typed as varying over the axis wherever the updates
            # are (sharded parameters), which `check_vma` refuses for a
            # replicated output. Count from the global verdict, replicated.
            s = s._replace(
                notfinite_count=jnp.where(
                    finite,
                    jnp.zeros([], jnp.int32),
                    optax.safe_increment(state.num_consecutive_skipped),
                ),
                last_finite=finite,
                total_notfinite=jnp.where(
                    finite,
                    state.num_skipped,
                    optax.safe_increment(state.num_skipped),
                ),
            )
        loss_scale = state.loss_scale.adjust(finite)
        at_floor = jnp.where(
            _at_floor(loss_scale),
            optax.safe_increment(jnp.asarray(state.num_steps_at_floor, jnp.int32)),
            0,
        ).astype(jnp.int32)
        if warn_at_floor_after is not None:
            # Once per stretch of `warn_at_floor_after` steps at the floor.
            jax.lax.cond(
                (at_floor > 0) & (at_floor % warn_at_floor_after == 0),
                lambda: jax.debug.callback(
                    _warn_at_floor, at_floor, loss_scale.loss_scale
                ),
                lambda: None,
            )
        return new_updates, LossScaledState(
            inner_state=s.inner_state,
            loss_scale=loss_scale,
            num_skipped=s.total_notfinite,
            num_consecutive_skipped=s.notfinite_count,
            last_finite=s.last_finite,
            num_steps_at_floor=at_floor,
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


def _as_inner_returns(
    inner: optax.GradientTransformation,
    grads: Any,
    inner_state: Any,
    params: Any,
    extra_args: dict[str, Any],
) -> Any:
    """The gradients widened to the dtypes of the updates ``inner`` returns.

    `optax.apply_if_finite` returns zeros like its input when it skips, so its
    two branches agree only where the inner optimizer keeps the gradients'
    dtypes. `compact_state` with bfloat16 weights returns float32 updates for
    bfloat16 gradients (a float32 step lands where a bfloat16 one may not); it
    reads the gradients as float32, so widening them first changes nothing it
    computes. Only lossless widenings are made.
    """
    out, _ = jax.eval_shape(
        functools.partial(inner.update, **extra_args), grads, inner_state, params
    )
    g_flat, g_def = jax.tree.flatten(grads)
    try:
        o_flat = g_def.flatten_up_to(out)
    except ValueError:  # an inner that returns another structure: leave it
        return grads

    def widen(g: Any, o: Any) -> Any:
        if not (hasattr(g, "dtype") and hasattr(o, "dtype")) or g.dtype == o.dtype:
            return g
        if jnp.issubdtype(g.dtype, jnp.floating) and jnp.promote_types(
            g.dtype, o.dtype
        ) == np.dtype(o.dtype):
            return jnp.asarray(g, o.dtype)
        return g

    return jax.tree.unflatten(
        g_def, [widen(g, o) for g, o in zip(g_flat, o_flat, strict=True)]
    )


def _find_states(state: Any) -> list[LossScaledState]:
    return [
        s
        for s in jax.tree.leaves(
            state, is_leaf=lambda x: isinstance(x, LossScaledState)
        )
        if isinstance(s, LossScaledState)
    ]


def _is_multisteps(x: Any) -> bool:
    return isinstance(x, optax.MultiStepsState)


def _check_no_multisteps_around(state: Any, call: str) -> None:
    """Refuses ``optax.MultiSteps(loss_scaled(...))``: it cannot train.

    MultiSteps would accumulate gradients the wrapper has not checked. One
    non-finite micro-batch makes the accumulator NaN, and MultiSteps clears it
    by multiplying by zero, which keeps it NaN: every later step is skipped.
    """
    for node in jax.tree.leaves(state, is_leaf=_is_multisteps):
        if _is_multisteps(node) and _find_states(node.inner_opt_state):
            raise ValueError(
                f"`{call}`: the optimizer state has `optax.MultiSteps` around "
                "`mixprec.optax.loss_scaled`. MultiSteps then accumulates "
                "gradients the wrapper has not checked: one non-finite micro-batch "
                "turns its accumulator into NaN for good (clearing it multiplies "
                "by zero) and every later step is skipped. Put the accumulation "
                "inside the wrapper, which then skips a bad micro-batch before it "
                "is accumulated:\n"
                "    opt = mixprec.optax.loss_scaled("
                "optax.MultiSteps(inner, every_k_schedule=k), loss_scale)"
            )


# `mixprec.value_and_grad(..., loss_scale=opt_state)` runs this check too.
training.register_state_check(_check_no_multisteps_around)


def _the_state(state: Any, fn_name: str) -> LossScaledState:
    # An `nnx.Optimizer` holds its state in Variables: read their values.
    state = nnx_state.pure_values(state)
    _check_no_multisteps_around(state, f"mixprec.optax.{fn_name}(state)")
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


class _LossScaleStats(dict):
    """What `loss_scale_stats` returns: a dict of arrays (a pytree, so it goes
    in and out of ``jax.jit``) whose repr shows their values as plain numbers
    once they are concrete, e.g. ``{'loss_scale': 32768.0, ...}``."""

    def __repr__(self) -> str:
        if not all(map(_readable, self.values())):
            return super().__repr__()  # traced, or spread over other processes
        return repr({k: np.asarray(v).item() for k, v in self.items()})


def _readable(x: Any) -> bool:
    if _compat.is_tracer(x):
        return False
    return not isinstance(x, jax.Array) or x.is_fully_addressable


jax.tree_util.register_pytree_with_keys(
    _LossScaleStats,
    lambda d: ([(jax.tree_util.DictKey(k), v) for k, v in d.items()], tuple(d)),
    lambda keys, values: _LossScaleStats(zip(keys, values, strict=True)),
    lambda d: (list(d.values()), tuple(d)),
)


def loss_scale_stats(state: Any) -> dict[str, jax.Array]:
    """Numbers to log: the current scale, the skip counters, time at the floor.

    Works inside ``jax.jit`` as outside it. The values are arrays (logged or
    returned from a jitted step as they are); the dict prints them as plain
    numbers once they are concrete, and ``float(stats["loss_scale"])`` or
    ``jax.device_get(stats)`` reads them on the host.

    Args:
      state: an optimizer state holding exactly one `LossScaledState`.

    Returns:
      A dict (a pytree) with ``loss_scale`` (float32), ``num_skipped`` and
      ``num_consecutive_skipped`` (int32), ``last_finite`` (bool) and
      ``num_steps_at_floor`` (int32: steps in a row the scale has sat at its
      floor, ``min_loss_scale``; a large number means float16 gradients are
      flushing to zero again), each a scalar array.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import mixprec, mixprec.optax
      >>> opt = mixprec.optax.loss_scaled(optax.sgd(0.1), mixprec.StaticLossScale(8.0))
      >>> stats = mixprec.optax.loss_scale_stats(opt.init(jnp.zeros(2)))
      >>> stats  # doctest: +NORMALIZE_WHITESPACE
      {'loss_scale': 8.0, 'num_skipped': 0, 'num_consecutive_skipped': 0,
       'last_finite': True, 'num_steps_at_floor': 0}
      >>> stats["loss_scale"]
      Array(8., dtype=float32)
      >>> jax.jit(mixprec.optax.loss_scale_stats)(opt.init(jnp.zeros(2)))["num_skipped"]
      Array(0, dtype=int32)
    """
    s = _the_state(state, "loss_scale_stats")
    return _LossScaleStats(
        loss_scale=jnp.asarray(s.loss_scale.loss_scale),
        num_skipped=s.num_skipped,
        num_consecutive_skipped=s.num_consecutive_skipped,
        last_finite=s.last_finite,
        num_steps_at_floor=s.num_steps_at_floor,
    )
