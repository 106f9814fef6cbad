"""Loss-scaled gradients: `value_and_grad` and `grad`.

The loss is scaled in float32 (a float16 loss times 2**15 overflows float16), the
gradients are unscaled in float32 with the *same* scale that multiplied the loss
(MPX divides by the adjusted scale and halves the gradients on a growth step),
then cast to the dtype of the differentiated argument's leaves, so float32 master
weights get float32 gradients. The finite flag is computed on the gradients that
are returned.

Flax NNX objects among the arguments are handled as ``nnx.value_and_grad``
handles them: only their ``nnx.Param`` state (or what ``wrt`` selects) is
differentiated, and the rest (batch statistics, RNG counters, metrics) is
updated in place. Flax is not imported unless the caller has imported it.
"""

from __future__ import annotations

import functools as ft
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .autocast import nnx_state
from .casting import is_floating_array
from .loss_scale import LossScale, all_finite


__all__ = ["grad", "value_and_grad"]

# Checks of an optimizer state passed as `loss_scale=`, registered by the
# integrations (mixprec.optax refuses `optax.MultiSteps(loss_scaled(...))`), so
# that this module imports none of them. Each gets the state and the call to
# name, and raises if the state cannot train correctly.
_state_checks: list[Callable[[Any, str], None]] = []


def register_state_check(check: Callable[[Any, str], None]) -> None:
    """Adds a check run on every optimizer state passed as ``loss_scale=``."""
    if check not in _state_checks:
        _state_checks.append(check)


def _find_loss_scale(obj: Any, *, fn_name: str) -> LossScale:
    """Returns ``obj`` if it is a loss scale, else the one loss scale inside it.

    Accepting a pytree that holds exactly one loss scale (an optimizer state from
    `mixprec.optax.loss_scaled`) means the scale used for the gradients is always
    the one the optimizer then adjusts.
    """
    if isinstance(obj, LossScale):
        return obj
    # The state of an `nnx.Optimizer` holds its arrays in Variables.
    obj = nnx_state.pure_values(obj)
    for check in _state_checks:
        check(obj, f"{fn_name}(...)(*args, loss_scale=opt_state)")
    found = [
        leaf
        for leaf in jax.tree.leaves(obj, is_leaf=lambda x: isinstance(x, LossScale))
        if isinstance(leaf, LossScale)
    ]
    if len(found) == 1:
        return found[0]
    if not found:
        raise TypeError(
            f"`{fn_name}(...)(*args, loss_scale=...)` expects a mixprec loss scale "
            "(`NoOpLossScale()`, `StaticLossScale(s)`, `DynamicLossScale(s)`) or an "
            "optimizer state that holds one (from `mixprec.optax.loss_scaled`), got "
            f"{type(obj).__name__} instead. Use `loss_scale=mixprec.NoOpLossScale()` "
            "for no scaling."
        )
    raise ValueError(
        f"`{fn_name}(...)(*args, loss_scale=...)` got a pytree holding {len(found)} "
        "loss scales; pass the one to use explicitly, e.g. "
        "`loss_scale=mixprec.optax.current_loss_scale(opt_state)`."
    )


def _as_tuple(argnums: int | Sequence[int], *, fn_name: str) -> tuple[int, ...]:
    if isinstance(argnums, int):
        return (argnums,)
    if isinstance(argnums, Sequence) and all(isinstance(a, int) for a in argnums):
        return tuple(argnums)
    raise TypeError(
        f"`{fn_name}(fn, argnums=...)` must be an int or a sequence of ints, got "
        f"{argnums!r} instead."
    )


def _upcast(x: Any) -> Any:
    """float16/bfloat16 leaves to float32 (for exact unscaling); others untouched."""
    if is_floating_array(x) and jnp.finfo(x.dtype).bits < 32:
        return x.astype(jnp.float32)
    return x


def _cast_like(g: Any, p: Any) -> Any:
    if is_floating_array(g) and is_floating_array(p) and g.dtype != p.dtype:
        return g.astype(p.dtype)
    return g


def _loss_scaled_value_and_grad(
    fun: Callable[..., Any],
    *,
    argnums: int | Sequence[int],
    has_aux: bool,
    wrt: Any,
    fn_name: str,
) -> Callable[..., tuple[Any, Any, jax.Array]]:
    argnums_t = _as_tuple(argnums, fn_name=fn_name)

    @ft.wraps(fun)
    def wrapped(*args: Any, loss_scale: Any, **kwargs: Any):
        scale = _find_loss_scale(loss_scale, fn_name=fn_name)
        for a in argnums_t:
            if a >= len(args) or a < -len(args):
                raise ValueError(
                    f"`{fn_name}(fn, argnums={argnums!r})` differentiates positional "
                    f"argument {a}, but the wrapped function was called with "
                    f"{len(args)} positional argument(s)."
                )
        nnx_args = nnx_state.has_nodes((args, kwargs))
        if wrt is not None and not nnx_state.has_nodes([args[a] for a in argnums_t]):
            raise ValueError(
                f"`{fn_name}(fn, wrt=...)` selects the Variables of Flax NNX "
                "objects to differentiate, but the differentiated argument(s) "
                f"(argnums={argnums!r}) hold no NNX object. Leave `wrt` unset, "
                "or pass the NNX model there."
            )

        def scaled_fun(*args: Any, **kwargs: Any):
            out = fun(*args, **kwargs)
            if has_aux:
                if not (isinstance(out, tuple) and len(out) == 2):
                    raise TypeError(
                        f"`{fn_name}(fn, has_aux=True)` expects `fn` to return a "
                        f"pair `(loss, aux)`, got {type(out).__name__} instead."
                    )
                loss, aux = out
            else:
                loss, aux = out, None
            loss = jnp.asarray(loss)
            if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
                raise TypeError(
                    f"`{fn_name}(fn)` expects `fn` to return a scalar floating loss"
                    f"{' (as the first element of `(loss, aux)`)' if has_aux else ''}"
                    f", got shape {loss.shape} and dtype {loss.dtype} instead."
                )
            # Scale in float32: a float16 loss times 2**15 can overflow float16.
            scaled = scale.scale(loss.astype(jnp.float32))
            return scaled, (loss, aux)

        if nnx_args:
            # As nnx.value_and_grad: Params differentiated, the rest of the
            # objects' state written back (batch statistics, RNG counters).
            (_, (loss, aux)), grads = nnx_state.value_and_grad(
                scaled_fun, args, kwargs, argnums=argnums_t, wrt=wrt
            )
        else:
            vg = jax.value_and_grad(scaled_fun, argnums=argnums_t, has_aux=True)
            (_, (loss, aux)), grads = vg(*args, **kwargs)
        # Unscale in float32 with the scale that multiplied the loss, then cast
        # each gradient leaf back to its dtype (JAX gives a gradient the dtype
        # of its parameter).
        unscaled = scale.unscale(jax.tree.map(_upcast, grads))
        grads = jax.tree.map(_cast_like, unscaled, grads)
        finite = all_finite(grads)
        if isinstance(argnums, int):
            grads = grads[0]
        value = (loss, aux) if has_aux else loss
        return value, grads, finite

    return wrapped


def value_and_grad(
    fun: Callable[..., Any],
    *,
    has_aux: bool = False,
    argnums: int | Sequence[int] = 0,
    wrt: Any = None,
) -> Callable[..., tuple[Any, Any, jax.Array]]:
    """Loss-scaled `jax.value_and_grad` that returns true gradients and a finite flag.

    The returned function takes the same arguments as ``fun`` plus a keyword-only
    ``loss_scale``. It multiplies the loss by the scale (in float32), differentiates,
    divides the gradients by the *same* scale (in float32), casts them to the dtype
    of the differentiated argument's leaves (float32 master weights get float32
    gradients) and checks that they are finite.

    The caller decides what to do with the flag: skip the step and adjust the scale,
    ``loss_scale = loss_scale.adjust(grads_finite)``, or let
    `mixprec.optax.loss_scaled` do both.

    Flax NNX objects (modules, ``nnx.Rngs``, metrics) among the arguments are
    handled as ``nnx.value_and_grad`` handles them: of an NNX object in a
    differentiated argument only the ``nnx.Param`` Variables (or those ``wrt``
    selects) are differentiated, and their gradients come back as an
    ``nnx.State``, ready for ``nnx.Optimizer.update``. The rest of the
    objects' state (batch statistics, ``Dropout``'s RNG counters) is not
    differentiated and is written back into the objects, as ``fun`` leaves
    it.

    Args:
      fun: a function returning a scalar floating loss, or ``(loss, aux)`` when
        ``has_aux`` is true.
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      argnums: which positional argument(s) to differentiate.
      wrt: which Variables of the NNX objects in the differentiated arguments
        to differentiate: a Flax NNX filter (a Variable type such as
        ``nnx.Param``, ``nnx.LoRAParam``, a path regex, ``nnx.All(...)``), as
        ``nnx.Optimizer(..., wrt=...)`` and ``nnx.DiffState`` take it. None:
        ``nnx.Param``. Only for NNX objects.

    Returns:
      ``wrapped(*args, loss_scale, **kwargs) -> (value, grads, grads_finite)`` where
      ``value`` is the unscaled ``loss`` (or ``(loss, aux)``), ``grads`` has the
      structure of ``args[argnums]`` (a tuple of those if ``argnums`` is a
      sequence; an ``nnx.State`` of the differentiated Variables for an NNX
      object) and ``grads_finite`` is a boolean scalar array. ``loss_scale`` is a
      mixprec loss scale, or a pytree that holds exactly one (such as the state of
      a `mixprec.optax.loss_scaled` optimizer, also inside an ``nnx.Optimizer``:
      ``loss_scale=optimizer.opt_state``): then the scale used is always the one
      the optimizer adjusts.

    Raises:
      TypeError: if ``loss_scale`` holds no loss scale, or ``fun`` does not return
        a scalar floating loss.
      ValueError: if ``argnums`` names an argument the call does not have, or
        ``wrt`` is given and the differentiated arguments hold no NNX object.

    Examples:
      >>> import jax.numpy as jnp
      >>> import mixprec
      >>> def loss_fn(w, x):
      ...     y = x.astype(jnp.float16) @ w.astype(jnp.float16)
      ...     return jnp.sum(y.astype(jnp.float32) ** 2)
      >>> w = jnp.ones((2,), jnp.float32)
      >>> x = jnp.array([[1.0, 2.0]], jnp.float32)
      >>> scale = mixprec.DynamicLossScale(2.0**10)
      >>> loss, grads, finite = mixprec.value_and_grad(loss_fn)(w, x, loss_scale=scale)
      >>> loss, grads, finite
      (Array(9., dtype=float32), Array([ 6., 12.], dtype=float32),
       Array(True, dtype=bool))

      Too large a scale overflows the float16 backward pass; the flag says so and
      the dynamic scale backs off:

      >>> big = mixprec.DynamicLossScale(2.0**15)
      >>> _, grads, finite = mixprec.value_and_grad(loss_fn)(w, x, loss_scale=big)
      >>> finite, big.adjust(finite).loss_scale
      (Array(False, dtype=bool), Array(16384., dtype=float32))

      A Flax NNX model with batch norm and dropout: the Params get gradients,
      the batch statistics and the dropout RNG counter move in place:

      >>> from flax import nnx
      >>> model = nnx.Sequential(
      ...     nnx.Linear(2, 4, rngs=nnx.Rngs(0)),
      ...     nnx.BatchNorm(4, rngs=nnx.Rngs(0)),
      ...     nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1)),
      ... )
      >>> mse = lambda model, x: jnp.mean(model(x) ** 2)
      >>> loss, grads, finite = mixprec.value_and_grad(
      ...     mixprec.autocast(mse, "mixed_float16")
      ... )(model, x, loss_scale=scale)
      >>> sorted(grads["layers"][1]), grads["layers"][0]["kernel"][...].dtype
      (['bias', 'scale'], dtype('float32'))
      >>> int(model.layers[2].rngs.count[...]), bool(finite)
      (1, True)
    """
    return _loss_scaled_value_and_grad(
        fun,
        argnums=argnums,
        has_aux=has_aux,
        wrt=wrt,
        fn_name="mixprec.value_and_grad",
    )


def grad(
    fun: Callable[..., Any],
    *,
    has_aux: bool = False,
    argnums: int | Sequence[int] = 0,
    wrt: Any = None,
) -> Callable[..., tuple[Any, ...]]:
    """Loss-scaled `jax.grad`: like `value_and_grad` without the loss.

    Flax NNX objects are handled as by `value_and_grad` (and ``nnx.grad``):
    their ``nnx.Param`` state (or what ``wrt`` selects) is differentiated, the
    rest written back into them.

    Args:
      fun: a function returning a scalar floating loss, or ``(loss, aux)`` when
        ``has_aux`` is true.
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      argnums: which positional argument(s) to differentiate.
      wrt: a Flax NNX filter of the Variables to differentiate (see
        `value_and_grad`); None: ``nnx.Param``.

    Returns:
      ``wrapped(*args, loss_scale, **kwargs)`` returning ``(grads, grads_finite)``,
      or ``(grads, aux, grads_finite)`` when ``has_aux`` is true: what `jax.grad`
      returns with the finite flag appended. Gradients are unscaled with the scale
      that was used and cast to the dtype of the differentiated argument's leaves.

    Examples:
      >>> import jax.numpy as jnp
      >>> import mixprec
      >>> f = lambda w: jnp.sum(w.astype(jnp.bfloat16).astype(jnp.float32) ** 2)
      >>> scale = mixprec.StaticLossScale(jnp.float32(1024))
      >>> grads, finite = mixprec.grad(f)(jnp.ones(3), loss_scale=scale)
      >>> grads, finite
      (Array([2., 2., 2.], dtype=float32), Array(True, dtype=bool))
    """
    vg = _loss_scaled_value_and_grad(
        fun, argnums=argnums, has_aux=has_aux, wrt=wrt, fn_name="mixprec.grad"
    )

    @ft.wraps(fun)
    def wrapped(*args: Any, loss_scale: Any, **kwargs: Any) -> tuple[Any, ...]:
        value, grads, finite = vg(*args, loss_scale=loss_scale, **kwargs)
        if has_aux:
            return grads, value[1], finite
        return grads, finite

    return wrapped
