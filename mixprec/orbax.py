"""Orbax integration: checkpoints of mixed-precision training state.

`save` writes any pytree of training state (parameters, optimizer state, the
loss scale, step counters) with orbax-checkpoint; `restore` reads it back into
the structure of a ``target``, casting each floating leaf on restore. So a
float32 checkpoint restores into float16/bfloat16 parameters and the reverse
(TF1's cast-on-restore), while integer leaves (step counts, loss-scale
counters) and PRNG keys stay what they are, and a loss scale's state is never
cast (2**16 is inf in float16). A value too large for the dtype it is restored
into is an error, not a silent inf.

A save never destroys the previous checkpoint before the new one is complete:
orbax writes into a temporary directory and renames it when done, and
``save(..., force=True)`` writes the replacement beside the old checkpoint and
swaps the two only then. A save killed midway leaves the previous checkpoint
restorable; `restore` detects what the unfinished save left behind.

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
import pathlib
import shutil
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.typing import DTypeLike

from ._src.casting import canonical_float_dtype, castable_mask
from ._src.compact import state as compact_state_lib


__all__ = ["restore", "restore_compact", "save"]


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


# Siblings of a checkpoint directory `d` that only an unfinished save leaves:
# `d.mixprec-new` (a replacement written by `save(..., force=True)`),
# `d.mixprec-old` (the previous checkpoint, while the two are swapped) and
# orbax's own temporary directories (`d.orbax-checkpoint-tmp...`).
_NEW, _OLD = ".mixprec-new", ".mixprec-old"
_ORBAX_TMP = ".orbax-checkpoint-tmp"


def _leftovers(path: pathlib.Path) -> list[pathlib.Path]:
    if not path.parent.is_dir():
        return []
    prefixes = tuple(path.name + s for s in (_NEW, _OLD, _ORBAX_TMP))
    return sorted(p for p in path.parent.iterdir() if p.name.startswith(prefixes))


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def save(directory: str | os.PathLike, state: Any, *, force: bool = False) -> None:
    """Saves a pytree of training state with orbax, and waits until it is written.

    The checkpoint appears at ``directory`` only once it is complete (orbax
    writes into a temporary directory and renames it). With ``force=True`` an
    existing checkpoint is replaced the same way: the new one is written beside
    it (``<directory>.mixprec-new``) and the two are swapped only when it is
    complete, so a save killed midway leaves the previous checkpoint in place.

    Args:
      directory: the checkpoint directory (created; must not exist unless
        ``force``).
      state: any pytree of arrays, e.g. ``{"params": ..., "opt_state": ...}``
        where ``opt_state`` holds a `mixprec.optax.LossScaledState`.
      force: replace an existing checkpoint (after the new one is written).

    Raises:
      ValueError: if ``directory`` exists and ``force`` is false.

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
    path = pathlib.Path(os.path.abspath(os.fspath(directory)))
    replace = path.exists()
    if replace and not force:
        raise ValueError(
            f"`mixprec.orbax.save(directory, ...)`: {str(path)!r} already exists. "
            "Pass `force=True` to replace it (the old checkpoint stays until the "
            "new one is complete), or save to a new directory."
        )
    primary = jax.process_index() == 0
    written = path.with_name(path.name + _NEW) if replace else path
    with ocp.StandardCheckpointer() as ckptr:
        # force: a complete `.mixprec-new` from an earlier interrupted save
        # is stale once this one starts.
        ckptr.save(written, _nest(flat), force=replace)
        ckptr.wait_until_finished()
    if primary:
        if replace:
            old = path.with_name(path.name + _OLD)
            if old.exists():
                shutil.rmtree(old)
            # The only moment without a checkpoint at `path`: between these two
            # renames. `restore` then names both directories.
            path.rename(old)
            written.rename(path)
        for leftover in _leftovers(path):
            shutil.rmtree(leftover, ignore_errors=True)
    _sync("mixprec.orbax.save")


def _check_leaf(leaf: Any, key: tuple[str, ...]) -> None:
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
        raise TypeError(
            "`mixprec.orbax.restore(directory, target)`: every leaf of `target` must "
            "be an array or `jax.ShapeDtypeStruct`, got "
            f"{type(leaf).__name__} at {_path(key)!r}."
        )


def _abstract(leaf: Any, dtype: Any) -> jax.ShapeDtypeStruct:
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.ShapeDtypeStruct(tuple(leaf.shape), dtype, sharding=sharding)


def _is_key(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jax.dtypes.prng_key))


def _is_float(dtype: Any) -> bool:
    return not _is_key(dtype) and bool(jnp.issubdtype(jnp.dtype(dtype), jnp.floating))


def _stored_shape(leaf: Any) -> tuple[int, ...]:
    """The shape ``leaf`` has in a checkpoint: a typed PRNG key array (from
    ``jax.random.key``, ``nnx.Rngs``) is stored as its key data, one more
    trailing axis of uint32 (2 for threefry)."""
    if _is_key(leaf.dtype):
        return tuple(jax.eval_shape(jax.random.key_data, leaf).shape)
    return tuple(leaf.shape)


def _narrow(
    x: jax.Array, dtype: np.dtype, saturate: bool
) -> tuple[jax.Array, tuple[int, float, tuple[int, ...]] | None]:
    """Casts ``x`` to ``dtype``; reports finite values that would become inf.

    Returns the cast array and ``None``, or (without ``saturate``) the number
    of overflowing values, the first one and its index.
    """
    if jnp.finfo(dtype).max >= jnp.finfo(x.dtype).max:
        return x.astype(dtype), None  # widening (or same range) never overflows
    y = x.astype(dtype)
    finite = jnp.isfinite(x)
    overflow = finite & ~jnp.isfinite(y)
    count = int(jnp.sum(overflow))
    if not count:
        return y, None
    if saturate:
        big = float(jnp.finfo(dtype).max)
        return jnp.where(finite, jnp.clip(x, -big, big), x).astype(dtype), None
    flat = int(jnp.argmax(overflow.reshape(-1)))
    index = tuple(int(i) for i in np.unravel_index(flat, x.shape))
    return y, (count, float(x.reshape(-1)[flat]), index)


def restore(
    directory: str | os.PathLike,
    target: Any,
    *,
    dtype: DTypeLike | None = None,
    saturate: bool = False,
) -> Any:
    """Restores a checkpoint written by `save` into the structure of ``target``.

    Each leaf comes back with the shape, sharding and dtype of the matching leaf
    of ``target`` (arrays or `jax.ShapeDtypeStruct`); floating leaves are cast on
    restore, so the checkpoint's dtypes need not match. Integer and boolean
    leaves must be stored as integers/booleans and stay so. Typed PRNG keys
    (``jax.random.key``, the state of an ``nnx.Rngs`` or ``nnx.Dropout``) are
    stored as their key data and come back as keys of ``target``'s key type,
    as plain orbax restores them. The state of a loss
    scale in ``target`` keeps its float32 dtype whatever ``dtype`` says (as
    `mixprec.cast_tree` does): a scale of 2**16 would be inf in float16. The
    state of `mixprec.optax.compact_state` keeps its dtypes too (its storage
    format; `restore_compact` changes tiers).

    A floating leaf is read in its saved dtype, then cast. A finite value that
    the new dtype cannot hold (above 65504 in float16) would become inf and
    stall training: that is an error naming the leaf and the value, unless
    ``saturate=True``.

    Args:
      directory: the checkpoint directory.
      target: a pytree with the structure to restore into; its static parts
        (loss-scale configuration, module fields) are kept.
      dtype: if given, every *floating* leaf is restored in this dtype instead
        of ``target``'s (e.g. restore float32 master weights as bfloat16),
        except the state of loss scales and of compact optimizer states.
      saturate: clip values too large for the dtype they are restored into to
        its largest finite value (keeping their sign) instead of raising.
        Values that were already inf or NaN in the checkpoint stay so.

    Returns:
      A pytree with ``target``'s structure.

    Raises:
      ValueError: if the checkpoint's paths differ from ``target``'s (every
        missing and unexpected path is listed), a shape differs, a value
        overflows the dtype it is restored into (every such leaf is listed
        with its first overflowing value), ``directory`` holds a checkpoint
        whose save did not finish, or a compact optimizer state in it stores
        its codes in a layout this version of mixprec does not decode.
      FileNotFoundError: if there is no checkpoint at ``directory``; the message
        names what an unfinished save left there, if anything.
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
    path = pathlib.Path(os.path.abspath(os.fspath(directory)))
    _check_complete(path)
    directory = str(path)
    flat_target, treedef = _flatten(target, "restore")
    flat_castable, _ = _flatten(castable_mask(target), "restore")
    for key, leaf in flat_target.items():
        _check_leaf(leaf, key)
    with ocp.StandardCheckpointer() as ckptr:
        meta = ckptr.metadata(directory)
        tree = getattr(meta, "item_metadata", meta)
        tree = getattr(tree, "tree", tree)
        flat_meta = _unnest(tree)
        _check_structure(flat_meta, flat_target, directory)
        wanted, read = {}, {}
        for key, leaf in flat_target.items():
            # (A PRNG key's dtype is no NumPy dtype: kept as it is.)
            want = leaf.dtype if _is_key(leaf.dtype) else jnp.dtype(leaf.dtype)
            if want_dtype is not None and _is_float(want) and flat_castable[key]:
                want = want_dtype
            wanted[key] = want
            saved = getattr(flat_meta[key], "dtype", None)
            # Floating leaves are read as saved and cast below, where an
            # overflow can be seen.
            read[key] = (
                jnp.dtype(saved) if saved is not None and _is_float(want) else want
            )
        abstract = {k: _abstract(flat_target[k], read[k]) for k in flat_target}
        restored = _unnest(ckptr.restore(directory, _nest(abstract)))
    out, overflows = [], []
    for key in flat_target:
        x = restored[key]
        if x.dtype != wanted[key]:
            x, overflow = _narrow(x, wanted[key], saturate)
            if overflow is not None:
                overflows.append((key, wanted[key], *overflow))
        out.append(x)
    if overflows:
        raise ValueError(_overflow_message(overflows, directory))
    tree = jax.tree_util.tree_unflatten(treedef, out)
    unreadable = compact_state_lib.unreadable_formats(tree)
    if unreadable:
        where = ", ".join(f"{path or '<root>'} (layout {v})" for path, v in unreadable)
        raise ValueError(
            f"`mixprec.orbax.restore`: the checkpoint at {directory!r} holds "
            f"compact optimizer state whose codes are stored in a layout this "
            f"mixprec does not decode: {where}; this version decodes layout "
            f"{compact_state_lib.codes.CODES_FORMAT}. Restore it with the mixprec "
            "that saved it (its `mixprec.optax.master_params` gives the float32 "
            "weights to start a new optimizer state from)."
        )
    return tree


def restore_compact(directory: str | os.PathLike, target: Any, *, saved: Any) -> Any:
    """Restores ``(params, opt_state)`` saved under one compact tier into another.

    For training state from `mixprec.optax.compact_state`: ``saved`` describes
    what the checkpoint holds (arrays or `jax.ShapeDtypeStruct`, e.g. from the
    old optimizer's ``init`` under ``jax.eval_shape``): a ``(params,
    opt_state)`` pair of any weights/moments tier, or plain float32 params with
    the wrapped optimizer's own state (a float32 checkpoint). ``target`` is the
    same pair from the new optimizer. The float32 master weights and moments
    are rebuilt from the checkpoint, then stored the way ``target`` stores them:

    * weights: ``"bfloat16-exact"`` splits each float32 weight exactly (no
      rounding); ``"bfloat16-sr"`` rounds to nearest; ``"float32"`` keeps the
      master weight (from ``"bfloat16-sr"`` that is the bfloat16 value);
    * moments: stochastic rounding keyed on the saved step count (the same
      checkpoint always converts to the same state); float32 keeps them;
    * counts (the optimizer's step, the wrapper's ``count``) are kept.

    A checkpoint of the same tier needs no conversion: `restore` it directly
    and training continues bit-identically.

    Args:
      directory: the checkpoint directory (written by `save` with the pair).
      target: ``(params, opt_state)`` of the new tier.
      saved: ``(params, opt_state)`` shaped like the checkpoint.

    Returns:
      ``(params, opt_state)`` in ``target``'s tier.

    Examples:
      >>> import tempfile, jax, jax.numpy as jnp, optax
      >>> import mixprec.optax, mixprec.orbax
      >>> adam = optax.adam(1e-3)
      >>> p32 = {"w": jnp.full((2, 64), 1 / 3)}
      >>> d = tempfile.mkdtemp() + "/ckpt"
      >>> mixprec.orbax.save(d, (p32, adam.init(p32)))
      >>> opt = mixprec.optax.compact_state(adam, weights="bfloat16-exact",
      ...                                   moments="int8", policy="p=bf16")
      >>> target = (mixprec.optax.compact_params(p32, "bfloat16-exact"), opt.init(p32))
      >>> params, state = mixprec.orbax.restore_compact(
      ...     d, target, saved=(p32, adam.init(p32)))
      >>> bool(jnp.all(mixprec.optax.master_params(params, state)["w"] == p32["w"]))
      True
    """
    restored = restore(directory, saved)
    return compact_state_lib.convert(restored, target)


def _overflow_message(overflows: list[Any], directory: str) -> str:
    lines = [
        f"`mixprec.orbax.restore`: restoring {directory!r} would turn finite "
        "values into inf:"
    ]
    for key, dtype, count, value, index in overflows:
        big = float(jnp.finfo(dtype).max)
        at = f" at index {index}" if index else ""
        lines.append(
            f"  {_path(key)!r}: {value!r}{at} does not fit in {dtype} (largest "
            f"{big:g}); {count} value(s) in this leaf."
        )
    lines.append(
        "Restore these leaves in a wider dtype (a float32 leaf in `target`, and no "
        "`dtype=`), or pass `saturate=True` to clip them to the largest finite "
        "value. Nothing was changed."
    )
    return "\n".join(lines)


def _check_complete(path: pathlib.Path) -> None:
    """Raises if ``path`` holds no finished checkpoint; warns about leftovers."""
    leftovers = _leftovers(path)
    names = [p.name for p in leftovers]
    if not path.exists():
        old, new = path.with_name(path.name + _OLD), path.with_name(path.name + _NEW)
        if old.exists():
            raise FileNotFoundError(
                f"`mixprec.orbax.restore`: no checkpoint at {str(path)!r}: a "
                "`save(..., force=True)` was interrupted while swapping the old "
                f"checkpoint for the new one. The previous checkpoint is "
                f"{str(old)!r}; the new one, {str(new)!r}, is complete if it "
                "exists. Restore from either path, or rename one to "
                f"{path.name!r}."
            )
        if leftovers:
            raise FileNotFoundError(
                f"`mixprec.orbax.restore`: no checkpoint at {str(path)!r}: its "
                f"save did not finish and left only partial data ({names}). "
                "Restore an earlier checkpoint; delete the partial data."
            )
        raise FileNotFoundError(
            f"`mixprec.orbax.restore`: no checkpoint at {str(path)!r}."
        )
    if not ocp.utils.is_checkpoint_finalized(path):
        raise ValueError(
            f"`mixprec.orbax.restore`: {str(path)!r} is an incomplete checkpoint "
            "(its save did not finish, or it is the temporary directory of a save "
            "in progress). Restore an earlier checkpoint."
        )
    if leftovers:
        warnings.warn(
            f"`mixprec.orbax.restore`: a later save into {str(path)!r} did not "
            f"finish and left {names} beside it; restoring the last complete "
            "checkpoint. The next `save(..., force=True)` to this path removes "
            "them.",
            stacklevel=3,
        )


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
        if any(k[-1:] == ("codes_format",) for k in target if k not in saved):
            lines.append(
                "The checkpoint's compact optimizer state has no `codes_format`: "
                "it was saved by a mixprec from before compact states recorded "
                "the layout of their codes, which may decode differently here. "
                "Restore it with the mixprec that saved it."
            )
        lines.append(
            "This usually occurs when the model or optimizer changed since the "
            "checkpoint was written; build `target` the way the saved state was built."
        )
        raise ValueError("\n".join(lines))
    for key, leaf in target.items():
        m = saved[key]
        shape = getattr(m, "shape", None)
        if shape is not None and tuple(shape) != _stored_shape(leaf):
            what = (
                f"{tuple(leaf.shape)} in `target`"
                if not _is_key(leaf.dtype)
                else f"{_stored_shape(leaf)} as the key data of `target`'s "
                f"{leaf.dtype} keys of shape {tuple(leaf.shape)}"
            )
            raise ValueError(
                f"`mixprec.orbax.restore`: {_path(key)!r} has shape {tuple(shape)} "
                f"in the checkpoint but {what}."
            )
        saved_dtype = getattr(m, "dtype", None)
        if saved_dtype is None or _is_key(leaf.dtype):
            # A PRNG key is stored as its (integer) key data; orbax rebuilds
            # the key from `target`'s key type.
            continue
        saved_float = jnp.issubdtype(jnp.dtype(saved_dtype), jnp.inexact)
        target_float = jnp.issubdtype(jnp.dtype(leaf.dtype), jnp.inexact)
        if saved_float != target_float:
            raise TypeError(
                f"`mixprec.orbax.restore`: {_path(key)!r} is {jnp.dtype(saved_dtype)} "
                f"in the checkpoint but {jnp.dtype(leaf.dtype)} in `target`; only "
                "floating leaves are cast on restore (integers stay integers)."
            )
