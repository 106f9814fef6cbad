"""Casting pytrees: only floating-point arrays change dtype.

Integers, booleans, PRNG keys, Python scalars and non-array leaves pass through
untouched, so a policy can be applied to whole model states (params, batch-norm
counters, RNG keys) without special-casing them.
"""

from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike


T = TypeVar("T")


def is_floating_array(x: Any) -> bool:
    """Whether ``x`` is a JAX or NumPy array (or tracer) of a floating dtype.

    Python scalars are not arrays and return ``False``; so do PRNG keys, whose
    dtype is a key type rather than a float.

    Examples:
        >>> import jax.numpy as jnp
        >>> is_floating_array(jnp.ones(3))
        True
        >>> is_floating_array(jnp.arange(3))
        False
        >>> is_floating_array(1.0)
        False
    """
    if not isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return False
    return bool(jnp.issubdtype(x.dtype, jnp.floating))


def canonical_float_dtype(dtype: DTypeLike, *, argname: str = "dtype") -> np.dtype:
    """Normalises ``dtype`` to an ``np.dtype`` and checks that it is floating.

    Examples:
        >>> canonical_float_dtype("bfloat16")
        dtype(bfloat16)
        >>> canonical_float_dtype(jnp.float32) == canonical_float_dtype("float32")
        True
    """
    try:
        out = np.dtype(jnp.dtype(dtype))
    except TypeError as e:
        raise TypeError(
            f"Expected `{argname}` to be a floating dtype (e.g. jnp.float32, "
            f"'bfloat16'), got {dtype!r} instead."
        ) from e
    if not jnp.issubdtype(out, jnp.floating):
        raise ValueError(
            f"Expected `{argname}` to be a floating dtype (e.g. jnp.float32, "
            f"'bfloat16'), got {out} instead."
        )
    return out


def cast_tree(tree: T, dtype: DTypeLike) -> T:
    """Casts every floating-point array leaf of ``tree`` to ``dtype``.

    Leaves that already have ``dtype`` are returned as they are (no copy, no
    ``convert_element_type`` in the jaxpr). NumPy leaves stay NumPy arrays.
    Loss scales inside ``tree`` are left alone (their state stays float32),
    and so is the state of ``mixprec.optax.compact_state`` (its dtypes are
    its storage format).

    Args:
        tree: any pytree.
        dtype: the floating dtype to cast to.

    Returns:
        A pytree with the structure of ``tree``.

    Raises:
        ValueError: if ``dtype`` is not a floating dtype.

    Examples:
        >>> import jax.numpy as jnp
        >>> tree = {"w": jnp.ones(2), "step": jnp.array(3), "lr": 0.1}
        >>> out = cast_tree(tree, jnp.bfloat16)
        >>> out["w"].dtype, out["step"].dtype, out["lr"]
        (dtype(bfloat16), dtype('int32'), 0.1)
    """
    dtype = canonical_float_dtype(dtype)

    def cast(x):
        if is_floating_array(x) and x.dtype != dtype:
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree, is_leaf=_keeps_dtypes)


def _keeps_dtypes(x: Any) -> bool:
    # Loss scales keep float32 state whatever the policy: 2**16 is inf in
    # float16. They are treated as opaque leaves and never cast.
    return getattr(type(x), "_mixprec_keep_dtypes", False)


def castable_mask(tree: Any) -> Any:
    """``tree`` with each leaf replaced by whether `cast_tree` may cast it.

    ``False`` for every leaf inside a loss scale or a compact optimizer state,
    ``True`` elsewhere: the rule
    `cast_tree` follows, for code that casts leaf by leaf (a checkpoint
    restore) rather than through `cast_tree`.

    Examples:
        >>> from mixprec._src.loss_scale import DynamicLossScale
        >>> mask = castable_mask({"w": jnp.ones(2), "ls": DynamicLossScale(2.0**16)})
        >>> mask["w"], jax.tree.leaves(mask["ls"])
        (True, [False, False])
    """
    return jax.tree.map(
        lambda x: jax.tree.map(lambda _: False, x) if _keeps_dtypes(x) else True,
        tree,
        is_leaf=_keeps_dtypes,
    )


def half_dtype() -> np.dtype:
    """The 16-bit float of the default backend: bfloat16 on TPU, float16 elsewhere.

    This matches JMP's ``half_dtype``. Prefer naming a dtype (or the
    ``mixed_bfloat16`` policy) explicitly: on CPU, float16 is emulated.

    Examples:
        >>> half_dtype() in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
        True
    """
    if jax.default_backend() == "tpu":
        return np.dtype(jnp.bfloat16)
    return np.dtype(jnp.float16)


def cast_to_half(tree: T) -> T:
    """Casts floating leaves of ``tree`` to :func:`half_dtype` (JMP).

    Examples:
        >>> import jax
        >>> cast_to_half(jnp.ones(2)).dtype == half_dtype()
        True
    """
    return cast_tree(tree, half_dtype())


def cast_to_full(tree: T) -> T:
    """Casts floating leaves of ``tree`` to float32 (JMP).

    Examples:
        >>> cast_to_full(jnp.ones(2, jnp.bfloat16)).dtype
        dtype('float32')
    """
    return cast_tree(tree, jnp.float32)
