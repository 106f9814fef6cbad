"""Loss scaling: keep small float16 gradients from flushing to zero.

The loss is multiplied by a scale before differentiation and the gradients
are divided by the same scale afterwards. :class:`DynamicLossScale` adapts the
scale: it backs off when gradients overflow and grows again after a run of
finite steps.

All loss scales are registered dataclass pytrees. Their configuration (period,
factors, bounds, and a static scale's value, as in JMP) is static metadata, so
it survives ``jit``, ``tree_map``, ``lax.scan`` and checkpoint round trips; the
leaves are only a dynamic scale and its counters. (JMP hand-writes its
flattening and loses ``min_loss_scale``.)
"""

import abc
import dataclasses
import math
import warnings
from typing import Any, ClassVar, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from ._errors import AssertTypeError, AssertValueError
from .casting import is_floating_array


T = TypeVar("T")
_F32_MAX = float(np.finfo(np.float32).max)
# The lowest a dynamic scale backs off to, whatever `min_loss_scale` says: a
# scale of 0 never grows back (0 * growth = 0) and makes every gradient NaN.
_F32_TINY = float(np.finfo(np.float32).tiny)


def _is_host_value(x: Any) -> bool:
    # Values we can check without touching a device. Device arrays and tracers
    # (e.g. from `adjust`, which constructs a new state) are not checked, so
    # that no training step forces a device sync.
    return isinstance(x, (int, float, np.ndarray, np.generic)) and not isinstance(
        x, bool
    )


def _is_integer(x: Any) -> bool:
    if isinstance(x, bool):
        return False
    if isinstance(x, int):
        return True
    dtype = getattr(x, "dtype", None)
    return dtype is not None and bool(jnp.issubdtype(dtype, jnp.integer))


def _warn_if_not_floating(x: Any, *, argname: str, cls: str) -> None:
    # JMP warns here, in the same words; its tests look for them.
    if _is_integer(x):
        got = getattr(x, "dtype", type(x).__name__)
        warnings.warn(
            f"Expected floating type for {argname}, got {got}. `{cls}` stores it "
            f"as float32; pass a float (e.g. `{argname}=2.0**15`) to silence this.",
            stacklevel=4,  # the caller of the dataclass __init__
        )


def _as_scale(x: Any, *, argname: str, cls: str) -> Any:
    """Validates a host value and stores every real value as float32."""
    if isinstance(x, bool) or getattr(x, "dtype", None) == np.bool_:
        raise TypeError(f"`{cls}({argname}=...)` must be a number, got {x!r}.")
    if _is_host_value(x):
        arr = np.asarray(x)
        if arr.shape != ():
            raise ValueError(
                f"`{cls}({argname}=...)` must be a scalar, got shape {arr.shape}."
            )
        value = float(arr)
        if not math.isfinite(value) or value <= 0 or value > _F32_MAX:
            raise ValueError(
                f"`{cls}({argname}=...)` must be a finite number > 0 (and finite "
                f"as a float32), got {value}."
            )
        return jnp.asarray(value, jnp.float32)
    if isinstance(x, jax.Array) and x.dtype != jnp.float32:
        # A float16 scale of 2**16 would already be inf: keep scales in float32.
        return x.astype(jnp.float32)
    return x


def _as_counter(x: Any, *, argname: str, cls: str) -> Any:
    if _is_host_value(x):
        arr = np.asarray(x)
        if arr.shape != () or not np.issubdtype(arr.dtype, np.integer) or arr < 0:
            raise ValueError(
                f"`{cls}({argname}=...)` must be a non-negative integer scalar, "
                f"got {x!r}."
            )
        return jnp.asarray(arr, jnp.int32)
    return x


def _check_finite_flag(grads_finite: ArrayLike, cls: str) -> jax.Array:
    shape = np.shape(grads_finite)
    if shape != ():
        raise AssertValueError(  # JMP asserts here
            f"`{cls}.adjust(grads_finite)` must be a scalar boolean (e.g. from "
            f"`mixprec.all_finite(grads)`), got shape {shape}."
        )
    flag = jnp.asarray(grads_finite)
    if flag.dtype != jnp.bool_:
        raise TypeError(
            f"`{cls}.adjust(grads_finite)` must be a boolean, got dtype "
            f"{flag.dtype}. Use `mixprec.all_finite(grads)`."
        )
    return flag


def _mul_keep_dtype(tree: T, factor: ArrayLike) -> T:
    """Multiplies floating leaves by ``factor`` and keeps each leaf's dtype.

    The product is formed in float32 (or wider), then rounded back once, so a
    float16 gradient stays float16 (JMP returns float32) and a float32 scale of
    2**16 does not overflow on the way.
    """

    def mul(x):
        if not is_floating_array(x):
            return x
        wide = _wide(x.dtype)
        return (x.astype(wide) * jnp.asarray(factor, wide)).astype(x.dtype)

    return jax.tree.map(mul, tree)


def _div_keep_dtype(tree: T, divisor: ArrayLike) -> T:
    def div(x):
        if not is_floating_array(x):
            return x
        wide = _wide(x.dtype)
        return (x.astype(wide) / jnp.asarray(divisor, wide)).astype(x.dtype)

    return jax.tree.map(div, tree)


def _wide(dtype: Any) -> np.dtype:
    # Explicit, so that it also works under jax_numpy_dtype_promotion="strict".
    dtype = np.dtype(dtype)
    return dtype if dtype.itemsize >= 4 else np.dtype(np.float32)


def _register_state(cls: type[T]) -> type[T]:
    """Registers a frozen dataclass as a pytree, like ``register_dataclass``.

    Fields marked ``metadata=dict(static=True)`` are static, the rest are
    leaves; both lists come from ``dataclasses.fields``, so a new field can
    never be silently dropped (JMP's hand-kept list loses ``min_loss_scale``).
    Unlike ``register_dataclass``, unflattening does not call ``__init__``:
    validation runs when users construct a state, never on ``tree_map`` or
    ``jit`` outputs (which may hold tracers, sentinels or device arrays).
    """
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    data = tuple(f.name for f in fields if not f.metadata.get("static", False))
    meta = tuple(f.name for f in fields if f.metadata.get("static", False))

    def flatten_with_keys(obj):
        children = tuple((jax.tree_util.GetAttrKey(n), getattr(obj, n)) for n in data)
        return children, tuple(getattr(obj, n) for n in meta)

    def flatten(obj):
        return tuple(getattr(obj, n) for n in data), tuple(
            getattr(obj, n) for n in meta
        )

    def unflatten(aux, children):
        obj = object.__new__(cls)
        for name, value in zip(meta, aux, strict=True):
            object.__setattr__(obj, name, value)
        for name, value in zip(data, children, strict=True):
            object.__setattr__(obj, name, value)
        return obj

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    return cls


class LossScale(abc.ABC):
    """The interface every loss scale implements.

    ``scale`` multiplies a pytree (the loss) by the current scale, ``unscale``
    divides one (the gradients) by it, and ``adjust`` returns the state for the
    next step given whether this step's gradients were finite. Methods never
    mutate: they return new instances.

    Examples:
        >>> isinstance(DynamicLossScale(2.0**15), LossScale)
        True
    """

    # `cast_tree` (and so every Policy.cast_to_*) leaves loss scales alone.
    _mixprec_keep_dtypes: ClassVar[bool] = True

    # The current scale: a float32 scalar array once constructed (a field or
    # a property); annotated ArrayLike so that `StaticLossScale(2.0**15)`
    # type-checks in user code.
    loss_scale: ArrayLike

    def scale(self, tree: T) -> T:
        """Multiplies the floating leaves of ``tree`` by the scale, keeping dtypes.

        Examples:
            >>> StaticLossScale(8.0).scale(jnp.float16(2.0))
            Array(16., dtype=float16)
        """
        return _mul_keep_dtype(tree, self.loss_scale)

    def unscale(self, tree: T) -> T:
        """Divides the floating leaves of ``tree`` by the scale, keeping dtypes.

        Examples:
            >>> StaticLossScale(8.0).unscale({"w": jnp.ones(2, jnp.float16)})
            {'w': Array([0.125, 0.125], dtype=float16)}
        """
        return _div_keep_dtype(tree, self.loss_scale)

    @abc.abstractmethod
    def adjust(self, grads_finite: ArrayLike) -> "LossScale":
        """Returns the loss scale for the next step."""


@_register_state
@dataclasses.dataclass(frozen=True)
class NoOpLossScale(LossScale):
    """A loss scale that does nothing: the scale is always 1.

    Use it for float32 and bfloat16 training, whose exponent range does not
    need scaling, so the same training step serves every precision.

    Examples:
        >>> ls = NoOpLossScale()
        >>> ls.scale(jnp.float32(3.0)), ls.loss_scale
        (Array(3., dtype=float32), Array(1., dtype=float32))
        >>> ls.adjust(jnp.array(False)) is ls
        True
    """

    @property
    def loss_scale(self) -> jax.Array:  # pyright: ignore[reportIncompatibleVariableOverride]
        return jnp.ones((), jnp.float32)

    def scale(self, tree: T) -> T:
        return tree

    def unscale(self, tree: T) -> T:
        return tree

    def adjust(self, grads_finite: ArrayLike) -> "NoOpLossScale":
        """Returns ``self``: a no-op scale never changes.

        Examples:
            >>> NoOpLossScale().adjust(True)
            NoOpLossScale()
        """
        _check_finite_flag(grads_finite, "NoOpLossScale")
        return self


@_register_state
@dataclasses.dataclass(frozen=True)
class StaticLossScale(LossScale):
    """A fixed loss scale.

    The scale is static configuration, as in JMP: it is pytree metadata, not a
    leaf, so a ``StaticLossScale`` has no leaves, ``jit`` bakes the scale into
    the compiled step (a different scale compiles a new step), and a checkpoint
    restores it from the ``target`` it is restored into.

    Args:
        loss_scale: the scale, a concrete finite number >= 0, stored as a
            float32 NumPy scalar. 0 is accepted as JMP accepts it (its tests
            build ``StaticLossScale(0)`` as a placeholder), but such a scale
            cannot ``unscale``.

    Raises:
        ValueError: if the scale is negative, not finite or not a scalar.
        TypeError: if the scale is not a number, or is traced (built inside
            ``jit`` from a traced value).

    Examples:
        >>> ls = StaticLossScale(2.0**10)
        >>> ls.unscale(ls.scale(jnp.float32(0.5)))
        Array(0.5, dtype=float32)
        >>> ls.loss_scale, jax.tree.leaves(ls)
        (np.float32(1024.0), [])
    """

    loss_scale: ArrayLike = dataclasses.field(metadata=dict(static=True))

    def __post_init__(self):
        object.__setattr__(self, "loss_scale", _as_static_scale(self.loss_scale))

    def unscale(self, tree: T) -> T:
        """Divides the floating leaves of ``tree`` by the scale, keeping dtypes.

        Raises:
            ValueError: if the scale is 0.

        Examples:
            >>> StaticLossScale(4.0).unscale({"g": jnp.ones(2, jnp.bfloat16)})
            {'g': Array([0.25, 0.25], dtype=bfloat16)}
        """
        if self.loss_scale == 0:
            raise ValueError(
                "`StaticLossScale(0).unscale(tree)`: cannot divide by a loss scale "
                "of 0. A zero scale is accepted only as a placeholder; train with "
                "a scale > 0."
            )
        return super().unscale(tree)

    def adjust(self, grads_finite: ArrayLike) -> "StaticLossScale":
        """Returns ``self``: a static scale never changes.

        Examples:
            >>> ls = StaticLossScale(4.0)
            >>> ls.adjust(jnp.array(False)) is ls
            True
        """
        _check_finite_flag(grads_finite, "StaticLossScale")
        return self


def _as_static_scale(x: Any) -> np.float32:
    """Validates a static scale and returns it as a hashable float32 scalar."""
    call = "`StaticLossScale(loss_scale=...)`"
    try:
        arr = np.asarray(x)
    except jax.errors.TracerArrayConversionError:
        raise TypeError(
            f"{call} must be a concrete number, got a traced value. The scale of a "
            "`StaticLossScale` is static configuration (not a pytree leaf), so "
            "build it outside `jit`; a scale that changes inside `jit` is a "
            "`DynamicLossScale`."
        ) from None
    real = jnp.issubdtype(arr.dtype, jnp.floating) or jnp.issubdtype(
        arr.dtype, jnp.integer
    )
    if not real:
        raise TypeError(f"{call} must be a real number, got {x!r}.")
    if arr.shape != ():
        raise ValueError(f"{call} must be a scalar, got shape {arr.shape}.")
    value = float(arr)
    if not math.isfinite(value) or value < 0 or value > _F32_MAX:
        raise ValueError(
            f"{call} must be a finite number >= 0 (and finite as a float32), got "
            f"{value}."
        )
    return np.float32(value)


def _static(default: Any) -> Any:
    return dataclasses.field(default=default, metadata=dict(static=True))


@_register_state
@dataclasses.dataclass(frozen=True)
class DynamicLossScale(LossScale):
    """A loss scale that adapts to the gradients, as in JMP, Keras and PyTorch.

    After ``period`` consecutive steps with finite gradients the scale is
    multiplied by the growth factor (but never to infinity, nor above
    ``max_loss_scale``); after a step with non-finite gradients it is
    multiplied by the backoff factor (but never below ``min_loss_scale``) and
    the run of finite steps starts again. With ``nonfinite_before_backoff=N``
    (TF1's ``decr_every_n_nan_or_inf``) the scale backs off only on every N-th
    non-finite step, counted since the last change of scale. With
    ``consecutive_nonfinite=True`` as well, only N non-finite steps *in a row*
    back off: a shorter run (a spurious inf from one bad batch) is skipped by
    the optimizer and otherwise ignored, neither backing off nor restarting the
    count towards the next growth. A scale that is really too large overflows
    on every step and still backs off after N of them.

    The pytree leaves are ``[loss_scale, counter]`` (JMP's layout), plus the
    non-finite counter when ``nonfinite_before_backoff > 1``; every other field
    is static metadata and survives ``jit``, ``tree_map`` and unflattening.

    Args:
        loss_scale: the initial scale, a finite number > 0. Stored as float32
            whatever the compute dtype (a float16 scale is accepted; an
            integer one too, with JMP's warning).
        counter: finite steps towards the next growth (``0 <= counter < period``).
        period: finite steps between two growths (``>= 1``; an integral float
            such as ``5.0`` is accepted, as in JMP).
        factor: JMP's single factor: grow by ``factor``, back off by
            ``1 / factor`` (``> 1``).
        min_loss_scale: the scale never backs off below this (``>= 0``). 0
            means no floor, as in JMP, except that the scale stops at the
            smallest normal float32 (a scale of 0 could never grow back).
        growth_factor: overrides the growth multiplier (``> 1``; PyTorch's
            ``growth_factor``).
        backoff_factor: overrides the backoff multiplier (``0 < b < 1``;
            PyTorch's ``backoff_factor``).
        max_loss_scale: the scale never grows above this (default: the largest
            float32).
        nonfinite_before_backoff: back off on every N-th non-finite step.
        consecutive_nonfinite: count only non-finite steps in a row towards
            ``nonfinite_before_backoff``, and let a shorter run leave the
            growth count alone (needs ``nonfinite_before_backoff > 1``).
        nonfinite_counter: non-finite steps counted towards the next backoff
            (since the last change of scale, or in a row with
            ``consecutive_nonfinite``); ``None`` unless
            ``nonfinite_before_backoff > 1``.

    Examples:
        >>> ls = DynamicLossScale(2.0**15, period=2)
        >>> ls = ls.adjust(jnp.array(True)).adjust(jnp.array(True))
        >>> ls.loss_scale
        Array(65536., dtype=float32)
        >>> ls.adjust(jnp.array(False)).loss_scale
        Array(32768., dtype=float32)
        >>> len(jax.tree.leaves(ls))
        2
    """

    loss_scale: ArrayLike
    counter: ArrayLike = dataclasses.field(
        default_factory=lambda: np.zeros((), np.int32)
    )
    period: int = _static(2000)
    factor: float = _static(2.0)
    min_loss_scale: float = _static(1.0)
    growth_factor: float | None = _static(None)
    backoff_factor: float | None = _static(None)
    max_loss_scale: float | None = _static(None)
    nonfinite_before_backoff: int = _static(1)
    nonfinite_counter: ArrayLike | None = None
    consecutive_nonfinite: bool = _static(False)

    def __post_init__(self):
        cls = "DynamicLossScale"
        set_ = _setter(self)
        _warn_if_not_floating(self.loss_scale, argname="loss_scale", cls=cls)
        _warn_if_not_floating(self.min_loss_scale, argname="min_loss_scale", cls=cls)
        set_("loss_scale", _as_scale(self.loss_scale, argname="loss_scale", cls=cls))
        set_("counter", _as_counter(self.counter, argname="counter", cls=cls))
        # Static fields are Python values: always checked, and normalised so
        # that equal configurations hash equally (jit caches on them).
        floor = self.min_loss_scale
        if not isinstance(floor, bool) and isinstance(
            floor, (int, np.ndarray, np.generic, jax.Array)
        ):
            set_("min_loss_scale", float(np.asarray(self.min_loss_scale)))
        if isinstance(self.period, (float, np.number)) and float(self.period) % 1 == 0:
            set_("period", int(self.period))  # JMP accepts `period=5.0`
        _check_number(self.period, "period", cls, integer=True, minimum=1)
        _check_number(self.factor, "factor", cls, greater_than=1)
        # 0 means no floor (JMP allows it); `adjust` still stops at the
        # smallest normal float32.
        _check_number(self.min_loss_scale, "min_loss_scale", cls, minimum=0)
        if self.growth_factor is not None:
            _check_number(self.growth_factor, "growth_factor", cls, greater_than=1)
        if self.backoff_factor is not None:
            _check_number(self.backoff_factor, "backoff_factor", cls, greater_than=0)
            if self.backoff_factor >= 1:
                raise ValueError(
                    f"`{cls}(backoff_factor=...)` must be in (0, 1), got "
                    f"{self.backoff_factor}."
                )
        if self.max_loss_scale is not None:
            _check_number(self.max_loss_scale, "max_loss_scale", cls, greater_than=0)
            if self.max_loss_scale < self.min_loss_scale:
                raise ValueError(
                    f"`{cls}`: `max_loss_scale` ({self.max_loss_scale}) must be >= "
                    f"`min_loss_scale` ({self.min_loss_scale})."
                )
        _check_number(
            self.nonfinite_before_backoff,
            "nonfinite_before_backoff",
            cls,
            integer=True,
            minimum=1,
        )
        if not isinstance(self.consecutive_nonfinite, bool):
            raise TypeError(
                f"`{cls}(consecutive_nonfinite=...)` must be a bool, got "
                f"{self.consecutive_nonfinite!r}."
            )
        if self.consecutive_nonfinite and self.nonfinite_before_backoff == 1:
            raise ValueError(
                f"`{cls}(consecutive_nonfinite=True)` needs "
                "`nonfinite_before_backoff > 1` (with 1, every non-finite step "
                "backs off), e.g. `nonfinite_before_backoff=2`."
            )
        if self.nonfinite_before_backoff > 1 and self.nonfinite_counter is None:
            set_("nonfinite_counter", np.zeros((), np.int32))
        if self.nonfinite_before_backoff == 1 and self.nonfinite_counter is not None:
            raise ValueError(
                f"`{cls}(nonfinite_counter=...)` is only used with "
                "`nonfinite_before_backoff > 1`."
            )
        if self.nonfinite_counter is not None:
            set_(
                "nonfinite_counter",
                _as_counter(
                    self.nonfinite_counter, argname="nonfinite_counter", cls=cls
                ),
            )

    @property
    def growth(self) -> float:
        """The growth multiplier in effect.

        Examples:
            >>> DynamicLossScale(1.0, factor=4).growth
            4.0
        """
        return float(self.factor if self.growth_factor is None else self.growth_factor)

    @property
    def backoff(self) -> float:
        """The backoff multiplier in effect (``1 / factor`` by default).

        Examples:
            >>> DynamicLossScale(1.0).backoff
            0.5
        """
        if self.backoff_factor is None:
            return 1.0 / float(self.factor)
        return float(self.backoff_factor)

    def adjust(self, grads_finite: ArrayLike) -> "DynamicLossScale":
        """Returns the loss scale for the next step.

        Args:
            grads_finite: a scalar boolean, usually ``mixprec.all_finite(grads)``.

        Returns:
            A new ``DynamicLossScale`` with the same configuration.

        Raises:
            ValueError: if ``grads_finite`` is not a scalar.
            TypeError: if ``grads_finite`` is not a boolean.

        Examples:
            >>> ls = DynamicLossScale(8.0, min_loss_scale=4.0)
            >>> ls.adjust(False).adjust(False).loss_scale
            Array(4., dtype=float32)
        """
        finite = _check_finite_flag(grads_finite, "DynamicLossScale")
        scale = jnp.asarray(self.loss_scale, jnp.float32)
        counter = jnp.asarray(self.counter, jnp.int32)

        grown = scale * jnp.float32(self.growth)
        upper = _F32_MAX if self.max_loss_scale is None else self.max_loss_scale
        grown = jnp.where(jnp.isfinite(grown), jnp.minimum(grown, upper), scale)
        grow_now = counter == self.period - 1
        after_finite = jnp.where(grow_now, grown, scale)
        backed_off = jnp.maximum(
            scale * jnp.float32(self.backoff),
            jnp.float32(max(self.min_loss_scale, _F32_TINY)),
        )

        nonfinite_counter = self.nonfinite_counter
        # Bounded by `period`, so the counter cannot overflow.
        after_nonfinite_counter = jnp.zeros((), jnp.int32)
        if nonfinite_counter is None:
            after_nonfinite = backed_off
        else:
            bad = jnp.asarray(nonfinite_counter, jnp.int32) + 1
            backoff_now = bad >= self.nonfinite_before_backoff
            after_nonfinite = jnp.where(backoff_now, backed_off, scale)
            if self.consecutive_nonfinite:
                # A finite step ends the run; a run too short to back off is
                # ignored, so the growth count carries on past it.
                reset = jnp.logical_or(finite, backoff_now)
                after_nonfinite_counter = jnp.where(backoff_now, 0, counter)
            else:
                # TF1: reset when the scale changes in either direction.
                reset = jnp.where(finite, grow_now, backoff_now)
            counted = jnp.where(finite, bad - 1, bad)
            nonfinite_counter = jnp.where(reset, 0, counted).astype(jnp.int32)

        new_scale = jnp.where(finite, after_finite, after_nonfinite)
        new_counter = jnp.where(
            finite, (counter + 1) % self.period, after_nonfinite_counter
        )
        return dataclasses.replace(
            self,
            loss_scale=new_scale,
            counter=new_counter.astype(jnp.int32),
            nonfinite_counter=nonfinite_counter,
        )


def _setter(obj: Any):
    def set_(name: str, value: Any) -> None:
        object.__setattr__(obj, name, value)

    return set_


def _check_number(
    value: Any,
    argname: str,
    cls: str,
    *,
    integer: bool = False,
    minimum: float | None = None,
    greater_than: float | None = None,
) -> None:
    ok_type = (int, np.integer) if integer else (int, float, np.integer, np.floating)
    if isinstance(value, bool) or not isinstance(value, ok_type):
        kind = "an integer" if integer else "a number"
        raise TypeError(f"`{cls}({argname}=...)` must be {kind}, got {value!r}.")
    if not math.isfinite(value):
        raise ValueError(f"`{cls}({argname}=...)` must be finite, got {value}.")
    if minimum is not None and value < minimum:
        raise ValueError(f"`{cls}({argname}=...)` must be >= {minimum}, got {value}.")
    if greater_than is not None and value <= greater_than:
        raise ValueError(
            f"`{cls}({argname}=...)` must be > {greater_than}, got {value}."
        )


def all_finite(tree: Any, axis_name: Any = None) -> jax.Array:
    """Whether every floating value in ``tree`` is finite, as a bool scalar.

    Non-floating leaves (integers, booleans) are always finite and skipped.
    An empty tree is finite.

    Args:
        tree: a pytree of arrays, e.g. gradients.
        axis_name: a mapped axis name (``shard_map``, ``pmap``, ``vmap``) or a
            tuple of them. If given, the result is reduced over that axis so
            that every device takes the same decision. With ``jit`` over
            sharded global arrays no axis name is needed: the reduction is
            already global.

    Returns:
        A ``bool`` scalar array.

    Examples:
        >>> all_finite({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf])})
        Array(False, dtype=bool)
        >>> all_finite([])
        Array(True, dtype=bool)
    """
    flags = [
        jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if is_floating_array(x)
    ]
    finite = jnp.all(jnp.stack(flags)) if flags else jnp.array(True)
    if axis_name is not None:
        # Every participant must see the same flag, or devices diverge.
        finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)
    return finite


def select_tree(pred: ArrayLike, a: T, b: T) -> T:
    """Picks the whole pytree ``a`` where ``pred`` is true, else ``b``.

    Use it to keep the old parameters when a step's gradients were not finite.

    Args:
        pred: a scalar boolean.
        a: the pytree to take when ``pred`` is true.
        b: a pytree with the same structure, shapes and dtypes as ``a``.

    Raises:
        ValueError: if ``pred`` is not a scalar or the structures differ.
        TypeError: if ``pred`` is not a boolean.

        Both errors about ``pred`` are also an ``AssertionError`` and say
        "expected boolean scalar", as JMP's ``assert`` did, so code written
        for JMP that catches them keeps working.

    Examples:
        >>> select_tree(jnp.array(False), {"w": jnp.ones(2)}, {"w": jnp.zeros(2)})
        {'w': Array([0., 0.], dtype=float32)}
    """
    if np.shape(pred) != ():
        raise AssertValueError(
            f"`select_tree(pred, a, b)`: expected boolean scalar `pred` (e.g. "
            f"`mixprec.all_finite(grads)`), got shape {np.shape(pred)}."
        )
    pred = jnp.asarray(pred)
    if pred.dtype != jnp.bool_:
        raise AssertTypeError(
            f"`select_tree(pred, a, b)`: expected boolean scalar `pred` (e.g. "
            f"`mixprec.all_finite(grads)`), got dtype {pred.dtype}."
        )
    a_def, b_def = jax.tree.structure(a), jax.tree.structure(b)
    if a_def != b_def:
        raise ValueError(
            f"`select_tree(pred, a, b)`: `a` and `b` must have the same tree "
            f"structure, got {a_def} and {b_def}."
        )
    return jax.tree.map(lambda x, y: jax.lax.select(pred, x, y), a, b)
