"""The state of the compact optimizer wrapper, and converting between tiers.

No optax here: ``mixprec.orbax`` converts checkpoints with it.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import bits as bits_lib, codes


class CompactState(NamedTuple):
    """State of `compact_state`.

    Attributes:
      step: int32 number of updates so far; it keys the random bits.
      remainder: for ``weights="bfloat16-exact"``, a pytree like the params of
        uint16 arrays: the low 16 bits of each float32 master weight, whose top
        16 bits are the bfloat16 params. ``None`` for the other tiers.
      inner_state: the wrapped optimizer's state: each leaf known to be a
        moment stored in the moment tier, each parameter copy as the weights
        are (a ``Compressed`` node where not float32), every other leaf
        (counts, scalars, unknown states) as it is.
      num_missed: int32 count of weight elements that did not land on their
        rounded value (see `compact_state`); stays 0 in practice.
      codes_format: int32, the layout of the stored codes (``CODES_FORMAT``
        when the state was made); `mixprec.orbax.restore` refuses a
        checkpoint whose layout this version of mixprec does not decode.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import mixprec.optax
      >>> opt = mixprec.optax.compact_state(
      ...     optax.adam(1e-3), weights="float32", moments="int8", policy="float32")
      >>> state = opt.init({"w": jnp.zeros((4, 64))})
      >>> state.inner_state[0].mu["w"].codes.dtype, state.step
      (dtype('uint8'), Array(0, dtype=int32))
    """

    step: jax.Array
    remainder: Any
    inner_state: Any
    num_missed: jax.Array
    codes_format: jax.Array

    # `cast_tree` and `mixprec.orbax.restore(..., dtype=...)` leave the state
    # as it is: its dtypes are its format (a float16 block scale of a second
    # moment flushes to zero; float8 codes cast to float32 take 4x the bytes).
    # `mixprec.orbax.restore_compact` converts between tiers.
    _mixprec_keep_dtypes = True


def _is_state(x: Any) -> bool:
    return isinstance(x, CompactState)


def _is_compressed(x: Any) -> bool:
    return isinstance(x, codes.Compressed)


def unbox_compressed(tree: Any) -> Any:
    """``tree`` with every Flax NNX Variable that holds a ``Compressed`` replaced
    by that ``Compressed``.

    Under ``nnx.Optimizer`` the inner optimizer's ``init`` gets the params as
    Variables, so a moment is a Variable around an array; encoding the array
    leaves a Variable around a ``Compressed``, which ``nnx.Optimizer`` keeps as
    one Variable. NNX flattens a state into arrays and pytree nodes, and
    ``nnx.update`` writes the new ``Compressed``'s children into that one
    Variable as an ``nnx.State`` of its codes and scale (tier and dtype lost),
    which no later update decodes. Unboxed, each array of a ``Compressed`` is a
    Variable of its own, as each array of a plain optax state is, and updates
    write each in place. Flax is not imported here unless the caller has
    imported ``flax.nnx``.
    """
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return tree

    def is_variable(x: Any) -> bool:
        return isinstance(x, nnx.Variable)

    def unbox(x: Any) -> Any:
        if is_variable(x) and _is_compressed(x.get_value()):
            return x.get_value()
        return x

    return jax.tree.map(unbox, tree, is_leaf=is_variable)


def find_states(tree: Any) -> list[CompactState]:
    """Every `CompactState` in ``tree``."""
    return [s for s in jax.tree.leaves(tree, is_leaf=_is_state) if _is_state(s)]


def format_array() -> jax.Array:
    """``CODES_FORMAT`` as the int32 scalar a state holds."""
    return jnp.asarray(codes.CODES_FORMAT, jnp.int32)


def unreadable_formats(tree: Any) -> list[tuple[str, int]]:
    """``(path, format)`` of every `CompactState` in ``tree`` whose codes are
    stored in a layout other than ``CODES_FORMAT``.

    Examples:
        >>> state = CompactState(jnp.int32(0), None, (), jnp.int32(0), jnp.int32(7))
        >>> unreadable_formats({"opt": state})
        [("['opt']", 7)]
    """
    out = []
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_state)[0]
    for path, node in flat:
        if _is_state(node):
            v = node.codes_format
            if isinstance(v, jax.Array) and not v.is_fully_addressable:
                v = v.addressable_data(0)  # replicated: any process's copy
            value = int(np.asarray(v))
            if value != codes.CODES_FORMAT:
                out.append((jax.tree_util.keystr(path), value))
    return out


def convert(saved: Any, target: Any, *, seed: int = 0) -> Any:
    """Converts ``(params, opt_state)`` from one compact tier to another.

    ``saved`` and ``target`` are ``(params, opt_state)`` pairs whose optimizer
    states have the same structure except where ``target`` holds a
    `CompactState`: there ``saved`` holds a `CompactState` of any tier or the
    wrapped optimizer's own (float32) state. The float32 master weights and
    moments are rebuilt from ``saved`` and stored the way ``target`` stores
    them: weights split exactly (``"bfloat16-exact"``) or rounded to nearest
    (``"bfloat16-sr"``), moments rounded stochastically (keyed on ``seed`` and
    the saved step count, so the conversion is deterministic); counts are kept.

    Examples:
        >>> import jax.numpy as jnp
        >>> from mixprec._src.compact import codes
        >>> p32 = {"w": jnp.full((4, 32), 1 / 3)}
        >>> saved = (p32, (jnp.int32(5), {"w": jnp.full((4, 32), 0.25)}))
        >>> zeros = jnp.zeros((4, 32))
        >>> nu = codes.encode(zeros, "int8", zeros.astype(jnp.uint32), block=32)
        >>> rem = {"w": zeros.astype(jnp.uint16)}
        >>> tgt_state = CompactState(
        ...     jnp.int32(0), rem, (jnp.int32(0), {"w": nu}), jnp.int32(0),
        ...     format_array())
        >>> target = ({"w": jnp.zeros((4, 32), jnp.bfloat16)}, tgt_state)
        >>> params, state = convert(saved, target)
        >>> nu = codes.decode(state.inner_state[1]["w"])
        >>> params["w"].dtype, int(state.inner_state[0]), float(nu[0, 0])
        (dtype(bfloat16), 5, 0.25)
        >>> w32 = bits_lib.join_exact(params["w"], state.remainder["w"])
        >>> bool(jnp.all(w32 == p32["w"]))
        True
    """
    saved_params, saved_state = saved
    target_params, target_state = target
    saved_found = find_states(saved_state)
    if saved_found and saved_found[0].remainder is not None:
        master = jax.tree.map(
            bits_lib.join_exact, saved_params, saved_found[0].remainder
        )
    else:
        master = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), saved_params)

    target_found = find_states(target_state)
    exact = bool(target_found) and target_found[0].remainder is not None

    def weights(m: Any, t: Any) -> Any:
        if np.dtype(t.dtype) == np.float32:
            return m
        if exact:
            return bits_lib.split_exact(m)[0]
        return bits_lib.round_bfloat16_nearest(m).astype(t.dtype)

    params = jax.tree.map(weights, master, target_params)

    leaves, treedef = jax.tree.flatten(target_state, is_leaf=_is_state)
    sources = treedef.flatten_up_to(saved_state)
    out = []
    for t, s in zip(leaves, sources, strict=True):
        if not _is_state(t):
            out.append(jnp.asarray(s, t.dtype) if hasattr(t, "dtype") else s)
            continue
        if _is_state(s):
            count, inner, missed = s.step, s.inner_state, s.num_missed
        else:
            count, inner, missed = jnp.zeros([], jnp.int32), s, jnp.zeros([], jnp.int32)
        inner = jax.tree.map(codes.decode, inner, is_leaf=_is_compressed)
        t_leaves, t_def = jax.tree.flatten(t.inner_state, is_leaf=_is_compressed)
        s_leaves = t_def.flatten_up_to(inner)
        new = []
        for i, (tl, sl) in enumerate(zip(t_leaves, s_leaves, strict=True)):
            if _is_compressed(tl):
                sl = jnp.asarray(sl, jnp.float32)
                block = codes.stored_block(tl)
                rnd = bits_lib.random_bits(
                    bits_lib.global_index(sl.shape),
                    count,
                    bits_lib.stream_constant(seed, i, 3),
                )
                new.append(codes.encode(sl, tl.tier, rnd, block=block))
            elif hasattr(tl, "dtype"):
                new.append(jnp.asarray(sl).astype(tl.dtype))
            else:
                new.append(sl)
        remainder = None
        if t.remainder is not None:
            remainder = jax.tree.map(lambda m: bits_lib.split_exact(m)[1], master)
        out.append(
            CompactState(
                jnp.asarray(count, jnp.int32),
                remainder,
                jax.tree.unflatten(t_def, new),
                jnp.asarray(missed, jnp.int32),
                format_array(),
            )
        )
    return params, jax.tree.unflatten(treedef, out)
