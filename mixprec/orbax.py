"""Orbax integration: checkpoints of mixed-precision training state.

`save` writes any pytree of training state (parameters, optimizer state, the
loss scale, step counters) with orbax-checkpoint; `restore` reads it back into
the structure of a ``target``, casting each floating leaf on restore with
orbax's own restore-with-dtype support. So a float32 checkpoint restores into
float16/bfloat16 parameters and the reverse (seed 000's cast-on-restore), while
integer leaves (step counts, loss-scale counters) stay integers.

The tree is stored as nested dictionaries keyed by its key paths, so any pytree
(optax ``NamedTuple`` states, mixprec loss scales, Equinox modules, Flax NNX
states) round-trips without registering anything with orbax; static
configuration (a loss scale's period and factors, a module's static fields)
comes back from ``target``. Before reading, the checkpoint's structure is
compared with ``target``'s and every difference is reported by path.

This module imports orbax-checkpoint; ``import mixprec`` never imports it.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.typing import DTypeLike

from ._src.casting import canonical_float_dtype


__all__ = ["restore", "save"]


def _key_str(k: Any) -> str:
    if isinstance(k, jax.tree_util.DictKey):
        return str(k.key)
    if isinstance(k, jax.tree_util.GetAttrKey):
        return k.name
    if isinstance(k, jax.tree_util.SequenceKey):
        return str(k.idx)
    if isinstance(k, jax.tree_util.FlattenedIndexKey):
        return str(k.key)
    return str(k)


def _flatten(tree: Any, fn_name: str) -> tuple[dict[tuple[str, ...], Any], Any]:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    flat: dict[tuple[str, ...], Any] = {}
    for path, leaf in leaves:
        key = tuple(_key_str(k) for k in path)
        if key in flat:
            raise ValueError(
                f"`mixprec.orbax.{fn_name}`: two leaves share the path "
                f"{'/'.join(key)!r} once keys are turned into strings (e.g. a dict "
                "with both 1 and '1' as keys); rename one of them."
            )
        flat[key] = leaf
    return flat, treedef


def _nest(flat: dict[tuple[str, ...], Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        for k in key[:-1]:
            node = node.setdefault(k, {})
        node[key[-1] if key else "_"] = value
    return out


def _unnest(nested: Any, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    if isinstance(nested, dict):
        out: dict[tuple[str, ...], Any] = {}
        for k, v in nested.items():
            out.update(_unnest(v, (*prefix, str(k))))
        return out
    return {prefix: nested}


def _path(key: tuple[str, ...]) -> str:
    return "/".join(key) if key else "<root>"


def save(directory: str | os.PathLike, state: Any, *, force: bool = False) -> None:
    """Saves a pytree of training state with orbax, and waits until it is written.

    Args:
      directory: the checkpoint directory (created; must not exist unless
        ``force``).
      state: any pytree of arrays, e.g. ``{"params": ..., "opt_state": ...}``
        where ``opt_state`` holds a `mixprec.optax.LossScaledState`.
      force: overwrite an existing checkpoint.

    Examples:
      >>> import tempfile, jax.numpy as jnp
      >>> import mixprec, mixprec.orbax
      >>> state = {"w": jnp.ones(2), "scale": mixprec.DynamicLossScale(2.0**15)}
      >>> path = tempfile.mkdtemp() + "/ckpt"
      >>> mixprec.orbax.save(path, state)
      >>> mixprec.orbax.restore(path, state)["scale"].loss_scale
      Array(32768., dtype=float32)
    """
    flat, _ = _flatten(state, "save")
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.abspath(os.fspath(directory)), _nest(flat), force=force)
        ckptr.wait_until_finished()


def _abstract(leaf: Any, dtype: np.dtype | None, key: tuple[str, ...]) -> Any:
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
        raise TypeError(
            "`mixprec.orbax.restore(directory, target)`: every leaf of `target` must "
            "be an array or `jax.ShapeDtypeStruct`, got "
            f"{type(leaf).__name__} at {_path(key)!r}."
        )
    want = jnp.dtype(leaf.dtype)
    if dtype is not None and jnp.issubdtype(want, jnp.floating):
        want = dtype
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.ShapeDtypeStruct(tuple(leaf.shape), want, sharding=sharding)


def restore(
    directory: str | os.PathLike,
    target: Any,
    *,
    dtype: DTypeLike | None = None,
) -> Any:
    """Restores a checkpoint written by `save` into the structure of ``target``.

    Each leaf comes back with the shape, sharding and dtype of the matching leaf
    of ``target`` (arrays or `jax.ShapeDtypeStruct`); floating leaves are cast on
    restore, so the checkpoint's dtypes need not match. Integer and boolean
    leaves must be stored as integers/booleans and stay so.

    Args:
      directory: the checkpoint directory.
      target: a pytree with the structure to restore into; its static parts
        (loss-scale configuration, module fields) are kept.
      dtype: if given, every *floating* leaf is restored in this dtype instead
        of ``target``'s (e.g. restore float32 master weights as bfloat16).

    Returns:
      A pytree with ``target``'s structure.

    Raises:
      ValueError: if the checkpoint's paths differ from ``target``'s (every
        missing and unexpected path is listed) or a shape differs.
      TypeError: if a leaf changes kind (integer vs floating) or a target leaf is
        not an array.

    Examples:
      >>> import tempfile, jax.numpy as jnp
      >>> import mixprec.orbax
      >>> path = tempfile.mkdtemp() + "/ckpt"
      >>> mixprec.orbax.save(path, {"w": jnp.ones(2), "step": jnp.int32(7)})
      >>> out = mixprec.orbax.restore(path, {"w": jnp.ones(2), "step": jnp.int32(0)},
      ...                             dtype=jnp.bfloat16)
      >>> out["w"].dtype, out["step"].dtype, int(out["step"])
      (dtype(bfloat16), dtype('int32'), 7)
    """
    want_dtype = None if dtype is None else canonical_float_dtype(dtype)
    directory = os.path.abspath(os.fspath(directory))
    flat_target, treedef = _flatten(target, "restore")
    with ocp.StandardCheckpointer() as ckptr:
        meta = ckptr.metadata(directory)
        tree = getattr(meta, "item_metadata", meta)
        tree = getattr(tree, "tree", tree)
        flat_meta = _unnest(tree)
        _check_structure(flat_meta, flat_target, directory)
        abstract = {k: _abstract(v, want_dtype, k) for k, v in flat_target.items()}
        restored = ckptr.restore(directory, _nest(abstract))
    flat = _unnest(restored)
    return jax.tree_util.tree_unflatten(treedef, [flat[k] for k in flat_target])


def _check_structure(
    saved: dict[tuple[str, ...], Any],
    target: dict[tuple[str, ...], Any],
    directory: str,
) -> None:
    missing = [_path(k) for k in target if k not in saved]
    extra = [_path(k) for k in saved if k not in target]
    if missing or extra:
        lines = [
            f"`mixprec.orbax.restore`: the checkpoint at {directory!r} does not match "
            "the structure of `target`."
        ]
        if missing:
            lines.append(f"  in `target` but not in the checkpoint: {missing}")
        if extra:
            lines.append(f"  in the checkpoint but not in `target`: {extra}")
        lines.append(
            "This usually occurs when the model or optimizer changed since the "
            "checkpoint was written; build `target` the way the saved state was built."
        )
        raise ValueError("\n".join(lines))
    for key, leaf in target.items():
        m = saved[key]
        shape = getattr(m, "shape", None)
        if (
            shape is not None
            and hasattr(leaf, "shape")
            and tuple(shape) != tuple(leaf.shape)
        ):
            raise ValueError(
                f"`mixprec.orbax.restore`: {_path(key)!r} has shape {tuple(shape)} "
                f"in the checkpoint but {tuple(leaf.shape)} in `target`."
            )
        saved_dtype = getattr(m, "dtype", None)
        if saved_dtype is None or not hasattr(leaf, "dtype"):
            continue
        saved_float = jnp.issubdtype(jnp.dtype(saved_dtype), jnp.inexact)
        target_float = jnp.issubdtype(jnp.dtype(leaf.dtype), jnp.inexact)
        if saved_float != target_float:
            raise TypeError(
                f"`mixprec.orbax.restore`: {_path(key)!r} is {jnp.dtype(saved_dtype)} "
                f"in the checkpoint but {jnp.dtype(leaf.dtype)} in `target`; only "
                "floating leaves are cast on restore (integers stay integers)."
            )
