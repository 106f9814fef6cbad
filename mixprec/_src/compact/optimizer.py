"""The optax wrapper that stores any optimizer's training state compactly.

Imported by ``mixprec.optax`` only (it imports optax).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from .. import policy as policy_lib
from .._errors import format_choices, suggest
from . import bits as bits_lib, codes, fields as fields_lib, state as state_lib
from .state import CompactState


WEIGHT_TIERS = ("float32", "bfloat16-exact", "bfloat16-sr")
MOMENT_TIERS = codes.MOMENT_TIERS
_WEIGHT_DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16-exact": np.dtype(jnp.bfloat16),
    "bfloat16-sr": np.dtype(jnp.bfloat16),
}
# Random streams: the weights' rounding, the state's rounding, the state at init.
_WEIGHTS, _STATE, _INIT = 0, 1, 2


def is_compressed(x: Any) -> bool:
    """Whether ``x`` is a compressed optimizer-state leaf."""
    return isinstance(x, codes.Compressed)


def _check_tier(value: Any, choices: tuple[str, ...], arg: str) -> str:
    if not isinstance(value, str) or value not in choices:
        hint = suggest(value, choices) if isinstance(value, str) else ""
        raise ValueError(
            f"`mixprec.optax.compact_state(..., {arg}=...)` must be one of "
            f"{format_choices(choices)}, got {value!r} instead.{hint}"
        )
    return value


def _is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _check_params(params: Any, weights: str, call: str, *, allow_f32: bool) -> None:
    want = _WEIGHT_DTYPES[weights]
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = jax.tree_util.keystr(path) or "params"
        if not _is_float(leaf):
            dtype = getattr(leaf, "dtype", type(leaf).__name__)
            raise TypeError(
                f"`{call}`: every weight must be a floating-point array; "
                f"`params{jax.tree_util.keystr(path)}` is {dtype}. Keep integer "
                "or boolean leaves out of the optimized params (optax.masked or a "
                "separate tree)."
            )
        dtype = np.dtype(leaf.dtype)
        if dtype != want and not (allow_f32 and dtype == np.float32):
            # One way bfloat16 weights come back float32: a whole train step
            # under `mixprec.autocast`, which returns floating outputs in the
            # policy's output dtype.
            hint = (
                " If a train step wrapped in `mixprec.autocast` returned them, "
                "wrap the loss function instead: autocast returns floating "
                "outputs in the policy's output dtype."
                if dtype == np.float32
                else ""
            )
            raise TypeError(
                f"`{call}`: `weights={weights!r}` stores {want.name} weights, but "
                f"`{name}` is {dtype.name}. Cast the params with "
                f"`mixprec.optax.compact_params(params, weights={weights!r})`."
                f"{hint}"
            )


def _shard_layout(
    spec: Any, shape: tuple[int, ...]
) -> tuple[list[Any], list[int]] | tuple[None, None]:
    """Offsets of this shard and the global shape, inside ``shard_map``."""
    if spec is None:
        return None, None
    offsets: list[Any] = []
    gshape: list[int] = []
    for d, n in enumerate(shape):
        names = spec[d] if d < len(spec) else None
        if names is None:
            offsets.append(0)
            gshape.append(n)
            continue
        names = tuple(names) if isinstance(names, (tuple, list)) else (names,)
        size = 1
        for name in names:
            size *= int(lax.axis_size(name))
        offsets.append(lax.axis_index(names) * n)
        gshape.append(n * size)
    return offsets, gshape


def _index(x: Any, spec: Any) -> jax.Array | None:
    """The global indices of ``x``'s elements inside ``shard_map``; ``None``
    for a whole array (the kernels below then compute them)."""
    if spec is None:
        return None
    offsets, gshape = _shard_layout(spec, tuple(x.shape))
    return bits_lib.global_index(x.shape, offsets, gshape)


# The per-leaf work, each a `jax.jit` of its own: a model's leaves repeat a few
# shapes (one per layer), so each shape is traced once, not once per leaf (JAX
# traces some 300 operations per leaf here; XLA inlines the calls).


def _bits(
    x: jax.Array, index: jax.Array | None, step: jax.Array, constant: jax.Array
) -> jax.Array:
    if index is None:
        index = bits_lib.global_index(x.shape)
    return bits_lib.random_bits(index, step, constant)


@functools.partial(jax.jit, static_argnames=("tier", "block"))
def _encode_leaves(
    xs: tuple[jax.Array, ...],
    indices: tuple[jax.Array | None, ...],
    step: jax.Array,
    constants: tuple[jax.Array, ...],
    *,
    tier: str,
    block: int,
) -> list[Any]:
    """The state leaves of one parameter (its moments), encoded together."""
    randoms = [
        _bits(x, index, step, c)
        for x, index, c in zip(xs, indices, constants, strict=True)
    ]
    return codes.encode_many(xs, tier, randoms, block=block)


_decode_leaf = jax.jit(codes.decode)


@functools.partial(jax.jit, static_argnames=("exact", "update_dtype"))
def _land_leaf(
    p: jax.Array,
    new32: jax.Array,
    index: jax.Array | None,
    step: jax.Array,
    constant: jax.Array,
    *,
    exact: bool,
    update_dtype: Any,
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """(update, remainder or None, elements missed) of one weight leaf."""
    lo = None
    if exact:
        target, lo = bits_lib.split_exact(new32)
    else:
        target = bits_lib.round_bfloat16_stochastic(
            new32, _bits(p, index, step, constant)
        )
    update, landed = bits_lib.landing_update(p, target, update_dtype)
    return update, lo, _count(~landed)


def _count(mask: jax.Array) -> jax.Array:
    """``jnp.sum(mask)`` as int32, first in runs of 32 elements.

    XLA:CPU rewrites a longer sum into a reduce-window over an int32 copy of the
    mask (4 bytes per element written and read back, a third of the landing's
    cost); a sum of 32 it computes in the kernel that makes the mask. The runs'
    sums are uint32 so that the simplifier does not merge the two sums again.
    Runs split the last axis only, so that a leaf sharded on another axis is
    not resharded.
    """
    if mask.ndim == 0 or mask.shape[-1] % 32:
        return jnp.sum(mask, dtype=jnp.int32)
    runs = jnp.sum(
        mask.reshape(*mask.shape[:-1], mask.shape[-1] // 32, 32),
        axis=-1,
        dtype=jnp.int32,
    )
    return jnp.sum(runs.astype(jnp.uint32)).astype(jnp.int32)


def _constant(seed: int, leaf: int, stream: int) -> jax.Array:
    return jnp.asarray(bits_lib.stream_constant(seed, leaf, stream), jnp.uint32)


def compact_params(params: Any, weights: str = "bfloat16-sr") -> Any:
    """The params a model reads under ``weights``, from float32 params.

    ``"bfloat16-exact"`` keeps the top 16 bits of each float32 weight (the
    optimizer's state keeps the other 16, from ``init`` with the same float32
    params); ``"bfloat16-sr"`` rounds to nearest; ``"float32"`` leaves them.

    Args:
      params: a pytree of floating-point arrays.
      weights: one of ``"float32"``, ``"bfloat16-exact"``, ``"bfloat16-sr"``.

    Returns:
      The params in the tier's dtype.

    Examples:
      >>> import jax.numpy as jnp
      >>> import mixprec.optax
      >>> p = {"w": jnp.array([1 / 3], jnp.float32)}
      >>> mixprec.optax.compact_params(p, "bfloat16-exact")["w"]
      Array([0.332031], dtype=bfloat16)
      >>> mixprec.optax.compact_params(p, "bfloat16-sr")["w"]
      Array([0.333984], dtype=bfloat16)
    """
    _check_tier(weights, WEIGHT_TIERS, "weights")
    _check_params(params, "float32", "mixprec.optax.compact_params", allow_f32=True)
    if weights == "float32":
        return jax.tree.map(lambda p: p.astype(jnp.float32), params)
    if weights == "bfloat16-exact":
        return jax.tree.map(
            lambda p: bits_lib.split_exact(p.astype(jnp.float32))[0], params
        )
    return jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)


def master_params(params: Any, state: Any) -> Any:
    """The float32 master weights: bfloat16 params joined with their remainders.

    For ``weights="bfloat16-exact"`` this is bit for bit the float32 weights
    plain float32 training reaches; for the other tiers it is the params cast to
    float32.

    Args:
      params: the params the model reads.
      state: an optimizer state holding one `CompactState` (directly or inside
        other optax states).

    Returns:
      The params as float32.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import mixprec.optax
      >>> p32 = {"w": jnp.array([1 / 3], jnp.float32)}
      >>> opt = mixprec.optax.compact_state(optax.sgd(0.1), weights="bfloat16-exact",
      ...                                   moments="float32", policy="p=bf16,c=bf16")
      >>> state = opt.init(p32)
      >>> p = mixprec.optax.compact_params(p32, "bfloat16-exact")
      >>> bool(mixprec.optax.master_params(p, state)["w"] == p32["w"])
      True
    """
    found = [
        s
        for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, CompactState))
        if isinstance(s, CompactState)
    ]
    if len(found) != 1:
        raise ValueError(
            "`mixprec.optax.master_params(params, state)` expects an optimizer "
            "state holding exactly one `CompactState` (from "
            f"`mixprec.optax.compact_state`), found {len(found)}."
        )
    if found[0].remainder is None:
        return jax.tree.map(lambda p: p.astype(jnp.float32), params)
    return jax.tree.map(bits_lib.join_exact, params, found[0].remainder)


def _decode_inner(inner_state: Any) -> Any:
    return jax.tree.map(
        lambda c: _decode_leaf(c) if is_compressed(c) else c,
        inner_state,
        is_leaf=is_compressed,
    )


def decode_compact_state(state: Any) -> Any:
    """The inner optimizer's own state, decoded from a compact state.

    Every compressed leaf comes back in its own dtype (float32), every other
    leaf as it is stored: the state the inner optimizer's ``update`` is given,
    and the one that optax helpers reading an optimizer's state expect, such
    as ``optax.contrib.schedule_free_eval_params``. Works under ``jax.jit``.

    Args:
      state: a `CompactState`, or an optimizer state holding exactly one
        (e.g. inside `loss_scaled`'s state).

    Returns:
      The inner optimizer's state (``state.inner_state``, decoded).

    Raises:
      ValueError: if ``state`` holds no `CompactState`, or more than one.

    Examples:
      Schedule-free models are evaluated at other weights than they train at;
      optax computes them from the optimizer's state:

      >>> import jax.numpy as jnp, optax
      >>> import mixprec.optax
      >>> opt = mixprec.optax.compact_state(
      ...     optax.contrib.schedule_free_adamw(1e-2), weights="bfloat16-sr",
      ...     moments="int8", policy="p=bf16,c=bf16")
      >>> params = {"w": jnp.ones((4, 64), jnp.bfloat16)}
      >>> state = opt.init(params)
      >>> grads = {"w": jnp.ones((4, 64), jnp.bfloat16)}
      >>> updates, state = opt.update(grads, state, params)
      >>> params = optax.apply_updates(params, updates)
      >>> inner = mixprec.optax.decode_compact_state(state)
      >>> inner.z["w"].dtype
      dtype('float32')
      >>> master = mixprec.optax.master_params(params, state)
      >>> eval_params = optax.contrib.schedule_free_eval_params(inner, master)
      >>> eval_params["w"].dtype, eval_params["w"].shape
      (dtype('float32'), (4, 64))
    """
    found = state_lib.find_states(state)
    if len(found) != 1:
        raise ValueError(
            "`mixprec.optax.decode_compact_state(state)` expects a `CompactState` "
            "(from `mixprec.optax.compact_state`) or an optimizer state holding "
            f"exactly one, found {len(found)}."
        )
    return _decode_inner(found[0].inner_state)


def _path_key(path: Any) -> tuple[str, ...]:
    return tuple(str(k) for k in path)


def _param_suffix(key: tuple[str, ...], known: Any) -> tuple[str, ...] | None:
    """The longest non-empty suffix of a state leaf's path key that is in
    ``known`` (parameters' path keys): ``('[0]', '.mu', "['w']")`` names the
    parameter ``("['w']",)``; ``None`` if there is none."""
    return next((key[k:] for k in range(len(key)) if key[k:] in known), None)


def compact_state(
    inner: optax.GradientTransformation,
    *,
    weights: str = "bfloat16-sr",
    moments: str = "int8",
    block_size: int = 256,
    seed: int = 0,
    policy: policy_lib.Policy | str | None = None,
    shard_specs: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """Stores the training state of any optax optimizer in fewer bytes.

    The inner optimizer runs in float32 on float32 gradients, float32 master
    weights and its float32 state, all rebuilt for the update; what is *kept*
    between steps is compact:

    * ``weights`` (the params the model reads and the optimizer's share of
      them): ``"float32"``; ``"bfloat16-exact"``: bfloat16 params plus the low
      16 bits of each float32 master weight in this state, bit-identical to
      float32 training (2 + 2 bytes); ``"bfloat16-sr"``: bfloat16 params
      updated with stochastic rounding (2 bytes), unbiased, so updates smaller
      than half a bfloat16 ulp still move the weights on average.
    * ``moments`` (each inner state leaf known to be a gradient statistic:
      Adam's ``mu`` and ``nu``, momentum's ``trace``, and the other fields
      of optax state types listed as moments in mixprec's table):
      ``"float32"``; ``"bfloat16-sr"``; ``"int8"``: blocks of ``block_size``
      along the last axis, a float32 absmax per block and a non-linear 8-bit
      code (a small float of ``x / absmax``, with more exponent range for
      non-negative blocks such as Adam's second moment); ``"float8"``:
      ``float8_e4m3fn`` with a per-block scale. All of them round
      stochastically.

    Copies of the parameters in the inner state (``optax.contrib``'s
    mechanize ``x0``, prodigy ``params0``, schedule-free ``z``, SAM's
    ``cache``) are stored as the weights are: ``"bfloat16-sr"`` under
    ``weights="bfloat16-sr"`` (rounded to nearest at ``init``, as
    `compact_params` rounds the weights), float32 otherwise. Every other
    leaf (counts, scalars, ``optax.MultiSteps``' accumulated gradients,
    adafactor's factored statistics, a state type mixprec does not know) is
    kept as it is. `describe_compact_state` lists how each leaf is stored
    and why; `decode_compact_state` gives back the inner optimizer's plain
    state.

    With AdamW and bfloat16 gradients: float32 / float32 is 16 bytes per
    parameter, ``"bfloat16-exact"`` / float32 14, ``"bfloat16-sr"`` /
    ``"bfloat16-sr"`` 8, ``"bfloat16-sr"`` / ``"int8"`` about 6.

    The returned updates work with ``optax.apply_updates`` unchanged: for the
    bfloat16 tiers they are float32, and ``(p + u).astype(p.dtype)`` lands
    exactly on the rounded new weight (it misses only where the new weight is
    more than about 2**16 times smaller than the old one: about 23 of 426
    million element updates in 1000 steps of the demo's char transformer).
    Under strict dtype promotion
    (``jax.numpy_dtype_promotion("strict")``, where bfloat16 + float32 raises)
    they are bfloat16 instead, and a new weight closer to zero than about the
    size of its step cannot be reached: bfloat16 numbers near the step are too
    far apart, and the weight lands within half an ulp of ``u`` instead (about
    0.35% of element updates on the char transformer). For ``"bfloat16-sr"``
    that error is 1/256 of the step; for ``"bfloat16-exact"`` it ends the
    bit-exactness of that weight. ``CompactState.num_missed`` counts the
    elements that missed.

    Random bits come from a counter hash of (``seed``, step, leaf, global
    element index): a few integer ops per element, and the same bits however
    the params are sharded. Under ``jit`` with sharded arrays nothing is
    needed; inside ``shard_map``, pass the params' ``shard_specs``.

    Compose it inside `loss_scaled` (``loss_scaled(compact_state(opt))``) and
    inside or outside ``optax.MultiSteps``.

    Args:
      inner: the optimizer whose state to store (e.g. ``optax.adamw(...)``).
      weights: ``"float32"``, ``"bfloat16-exact"`` or ``"bfloat16-sr"``.
      moments: ``"float32"``, ``"bfloat16-sr"``, ``"int8"`` or ``"float8"``.
      block_size: elements per scale for ``"int8"`` / ``"float8"``; a last
        axis it does not divide uses their common divisor (at least 32) or
        whole rows.
      seed: seeds the random bits.
      policy: the mixed-precision policy the model trains under (a
        ``mixprec.Policy`` or a string); its ``param_dtype`` must be the
        weights' dtype. Defaults to the global policy.
      shard_specs: inside ``shard_map`` only: a pytree like the params of
        ``PartitionSpec`` (the params' ``in_specs``), so that each shard finds
        its global element indices.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a
      `CompactState`; ``update(grads, state, params, **extra)`` needs
      ``params`` for the bfloat16 tiers and forwards ``extra`` to ``inner``.

    Raises:
      ValueError: for an unknown tier, a bad ``block_size``, or a ``policy``
        whose param dtype contradicts ``weights``.
      TypeError: for params that are not floating point or not in the
        weights' dtype, or an ``inner`` that is not an optax optimizer.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import mixprec.optax
      >>> opt = mixprec.optax.compact_state(
      ...     optax.adamw(1e-3), weights="bfloat16-sr", moments="int8",
      ...     policy="p=bf16,c=bf16,o=f32")
      >>> params = {"w": jnp.ones((8, 256), jnp.bfloat16)}
      >>> state = opt.init(params)
      >>> grads = {"w": jnp.full((8, 256), 0.5, jnp.bfloat16)}
      >>> updates, state = opt.update(grads, state, params)
      >>> params = optax.apply_updates(params, updates)
      >>> params["w"].dtype, state.inner_state[0].nu["w"].codes.dtype
      (dtype(bfloat16), dtype('uint8'))
    """
    weights = _check_tier(weights, WEIGHT_TIERS, "weights")
    moments = _check_tier(moments, MOMENT_TIERS, "moments")
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, int)
        or block_size < 1
    ):
        raise ValueError(
            "`mixprec.optax.compact_state(..., block_size=...)` must be a positive "
            f"integer, got {block_size!r}."
        )
    if isinstance(inner, optax.MultiSteps):
        inner = inner.gradient_transformation()
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(
            "`mixprec.optax.compact_state(inner, ...)` must be an optax "
            f"GradientTransformation, got {type(inner).__name__} instead."
        )
    pol = (
        policy_lib.get_global_policy()
        if policy is None
        else policy_lib.get_policy(policy)
    )
    want = _WEIGHT_DTYPES[weights]
    if np.dtype(pol.param_dtype) != want:
        source = "the global policy" if policy is None else "`policy`"
        raise ValueError(
            f"`mixprec.optax.compact_state(..., weights={weights!r})` stores "
            f"{want.name} weights, but {source} ({pol}) keeps params in "
            f"{np.dtype(pol.param_dtype).name}. Pass a policy whose params are "
            f"{want.name} (e.g. `policy='p={'f32' if want == np.float32 else 'bf16'},"
            f"c=bf16,o=f32'`, or `mixprec.set_global_policy(...)`), or choose "
            f"`weights=` from {format_choices(WEIGHT_TIERS)} to match it."
        )
    bf16_weights = weights != "float32"

    def layout(params: Any) -> tuple[set[tuple[int, ...]], dict[Any, Any]]:
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        shapes = {tuple(p.shape) for _, p in flat if np.ndim(p) >= 1}
        specs: dict[Any, Any] = {}
        if shard_specs is not None:
            spec_leaves = jax.tree.leaves(
                shard_specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec)
            )
            for (path, p), spec in zip(flat, spec_leaves, strict=True):
                specs[_path_key(path)] = spec
                specs.setdefault(tuple(p.shape), spec)
        return shapes, specs

    def spec_for(path: Any, shape: tuple[int, ...], specs: dict[Any, Any]) -> Any:
        if not specs:
            return None
        suffix = _param_suffix(_path_key(path), specs)
        return specs[suffix] if suffix is not None else specs.get(shape)

    # A state leaf is stored by what it is (`fields.py`): a known moment in the
    # moment tier, a parameter copy as the weights are (a bfloat16-exact
    # weight is its float32 master, so its copy stays float32), anything else
    # as it is.
    tiers = {
        fields_lib.MOMENT: moments,
        fields_lib.COPY: "bfloat16-sr" if weights == "bfloat16-sr" else "float32",
    }

    def encode_state(tree: Any, params: Any, count: jax.Array, stream: int) -> Any:
        if all(t == "float32" for t in tiers.values()):
            return tree
        _, specs = layout(params)
        plans = fields_lib.plan(tree, params)
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        out = [x for _, x in flat]
        # The leaves of one parameter (Adam's two moments: paths ending in the
        # parameter's) are encoded together, their block statistics in one
        # pass; each keeps its own random stream, so the codes are the same.
        groups: dict[Any, list[int]] = {}
        for i, ((_, x), leaf_plan) in enumerate(zip(flat, plans, strict=True)):
            tier = tiers.get(leaf_plan.kind, "float32")
            if tier != "float32":
                owner = leaf_plan.owner
                groups.setdefault(
                    (i if owner is None else owner, tuple(x.shape), tier), []
                ).append(i)
        for (_, _, tier), members in groups.items():
            if (
                tier == "bfloat16-sr"
                and stream == _INIT
                and all(plans[i].kind == fields_lib.COPY for i in members)
            ):
                # Rounded as `compact_params` rounds the weights, so that a copy
                # of the initial weights is the weights the model starts from.
                for i in members:
                    x = out[i]
                    out[i] = codes.Compressed(
                        x.astype(jnp.bfloat16),
                        None,
                        tier,
                        np.dtype(x.dtype),
                    )
                continue
            xs = tuple(out[i] for i in members)
            encoded = _encode_leaves(
                xs,
                tuple(
                    _index(out[i], spec_for(flat[i][0], tuple(out[i].shape), specs))
                    for i in members
                ),
                count,
                tuple(_constant(seed, i, stream) for i in members),
                tier=tier,
                block=block_size,
            )
            for i, x in zip(members, encoded, strict=True):
                out[i] = x
        return state_lib.unbox_compressed(jax.tree.unflatten(treedef, out))

    def init_fn(params: Any) -> CompactState:
        _check_params(
            params,
            weights,
            "mixprec.optax.compact_state(...).init(params)",
            allow_f32=True,
        )
        p32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
        count = jnp.zeros([], jnp.int32)
        remainder = None
        if weights == "bfloat16-exact":
            remainder = jax.tree.map(
                lambda p: (
                    bits_lib.split_exact(p)[1]
                    if p.dtype == jnp.float32
                    else jnp.zeros(p.shape, jnp.uint16)
                ),
                params,
            )
        inner_state = encode_state(inner.init(p32), params, count, _INIT)
        return CompactState(
            count,
            remainder,
            inner_state,
            jnp.zeros([], jnp.int32),
            state_lib.format_array(),
        )

    def update_fn(
        updates: Any, state: CompactState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, CompactState]:
        if not isinstance(state, CompactState):
            raise TypeError(
                "`compact_state(...).update(grads, state, params)` expects the "
                "state from the same optimizer's `init`, a `CompactState`, got "
                f"{type(state).__name__} instead."
            )
        if bf16_weights and params is None:
            raise ValueError(
                f"`compact_state(..., weights={weights!r}).update(grads, state, "
                "params)` needs `params`: it rounds the new weights itself."
            )
        if params is not None:
            _check_params(
                params,
                weights,
                "compact_state(...).update(grads, state, params)",
                allow_f32=False,
            )
        grads = jax.tree.map(
            lambda g: g.astype(jnp.float32) if _is_float(g) else g, updates
        )
        if weights == "bfloat16-exact":
            p32 = jax.tree.map(bits_lib.join_exact, params, state.remainder)
        elif params is not None:
            p32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
        else:
            p32 = None
        inner32 = _decode_inner(state.inner_state)
        u32, new_inner = inner.update(grads, inner32, p32, **extra_args)
        count = state.step
        new_inner = encode_state(
            new_inner, params if params is not None else u32, count, _STATE
        )
        new_count = jnp.asarray(optax.safe_increment(count), jnp.int32)
        if not bf16_weights:
            return u32, CompactState(
                new_count, None, new_inner, state.num_missed, state.codes_format
            )

        p_flat, p_def = jax.tree.flatten(params)
        u_flat = p_def.flatten_up_to(u32)
        m_flat = p_def.flatten_up_to(p32)
        path_flat = [
            path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
        ]
        _, specs = layout(params)
        out_u, out_r = [], []
        missed = state.num_missed
        # A float32 update lands where a bfloat16 one may not (see above);
        # strict promotion refuses bfloat16 + float32 in `apply_updates`.
        promotion = jax.config.jax_numpy_dtype_promotion  # type: ignore[attr-defined]
        strict = promotion == "strict"
        update_dtype = jnp.bfloat16 if strict else jnp.float32
        for i, (p, u, m, path) in enumerate(
            zip(p_flat, u_flat, m_flat, path_flat, strict=True)
        ):
            new32 = m + u.astype(jnp.float32)  # what optax.apply_updates does
            spec = spec_for(path, tuple(p.shape), specs)
            step, lo, miss = _land_leaf(
                p,
                new32,
                _index(p, spec),
                count,
                _constant(seed, i, _WEIGHTS),
                exact=weights == "bfloat16-exact",
                update_dtype=update_dtype,
            )
            if lo is not None:
                out_r.append(lo)
            missed = missed + miss
            out_u.append(step)
        if specs:
            # Inside shard_map: each shard counted its own elements.
            names = sorted(
                {
                    n
                    for spec in specs.values()
                    for entry in spec
                    if entry is not None
                    for n in (entry if isinstance(entry, (tuple, list)) else (entry,))
                }
            )
            if names:
                missed = state.num_missed + lax.psum(missed - state.num_missed, names)
        remainder = jax.tree.unflatten(p_def, out_r) if out_r else None
        return jax.tree.unflatten(p_def, out_u), CompactState(
            new_count, remainder, new_inner, missed, state.codes_format
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


def state_bytes_per_param(params: Any, grads: Any, state: Any) -> float:
    """Bytes of weights + gradients + optimizer state per parameter, counted
    from the live pytrees.

    Examples:
      >>> import jax.numpy as jnp
      >>> p = {"w": jnp.zeros(4)}
      >>> state_bytes_per_param(p, p, (p, p))
      16.0
    """
    n = sum(int(np.size(x)) for x in jax.tree.leaves(params))
    total = sum(
        int(np.size(x)) * np.dtype(x.dtype).itemsize
        for x in jax.tree.leaves((params, grads, state))
        if hasattr(x, "dtype")
    )
    return total / n
