"""Formulations per platform, chosen when a computation is lowered.

What runs fast (and what runs at all) differs between XLA's backends: XLA:CPU
has bfloat16 GEMMs only in one layout and only on some CPUs, and no float8
GEMM; cuBLASLt takes float8 operands directly. autocast therefore writes a
product once per platform and lets JAX pick when it lowers the computation
(``lax.platform_dependent``), not when Python traces it: the same traced
function, jitted on a GPU or exported for ``cuda`` from a CPU host
(``jax.export(..., platforms=["cuda"])``), gets the GPU formulation, and a
multi-platform export (``platforms=["cpu", "cuda"]``) carries each. A host's
CPU features only ever shape the CPU branch.

:func:`per_platform` is the one hook: a formulation is a default function and
optional overrides for ``"cpu"``, ``"cuda"``, ``"rocm"`` or ``"tpu"``. A
configuration may pin a platform (``CastConfig.platform``), which calls that
platform's function directly (tests, and users who know where they run).
"""

from __future__ import annotations

import enum
import functools as ft
import weakref
from collections.abc import Callable
from typing import Any, Final

import jax
import numpy as np
from jax import lax
from jax.sharding import Sharding

from mixprec._src import _compat


__all__ = ["PLATFORMS", "canonical_platform", "per_platform"]

#: The platforms a formulation may override.
PLATFORMS: Final = ("cpu", "cuda", "rocm", "tpu")
# `jax.default_backend()` says "gpu" for CUDA and ROCm alike.
_ALIASES: Final = {"gpu": "cuda"}


def canonical_platform(platform: str | None) -> str | None:
    """A platform name as :func:`per_platform` takes it (``"gpu"``: ``"cuda"``).

    Raises:
        ValueError: an unknown platform.

    Examples:
        >>> canonical_platform("gpu"), canonical_platform(None)
        ('cuda', None)
    """
    if platform is None:
        return None
    name = _ALIASES.get(platform.lower(), platform.lower())
    if name not in PLATFORMS:
        raise ValueError(
            f"`platform` must be one of {', '.join(repr(p) for p in PLATFORMS)} "
            f"(or 'gpu' for 'cuda'), got {platform!r}."
        )
    return name


def per_platform(
    args: tuple[Any, ...],
    *,
    platform: str | None,
    default: Callable[..., Any],
    **overrides: Callable[..., Any],
) -> Any:
    """``fn(*args)`` for the function of the platform the computation runs on.

    Args:
        args: the operands (pytrees of arrays).
        platform: a pinned platform, or ``None`` for the one the computation is
            lowered for (every function is traced; each lowering keeps one). A
            module-level function, or a ``functools.partial`` of one with
            plain-data arguments (numbers, strings, dtypes, enums, shardings,
            tuples of them), is traced once per operand types and shared by
            every call (the products of every layer of a model).
        default: the function for platforms without an override.
        **overrides: functions for ``cpu``, ``cuda``, ``rocm`` or ``tpu``.

    Returns:
        What the chosen function returns (every function must return the same
        types).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> f = lambda x: per_platform(
        ...     (x,), platform=None, default=lambda x: x + 1, cpu=lambda x: x * 2)
        >>> jax.jit(f)(jnp.float32(3))  # lowered for this CPU
        Array(6., dtype=float32)
        >>> per_platform((3,), platform="cuda", default=lambda x: x + 1,
        ...              cpu=lambda x: x * 2)
        4
    """
    unknown = set(overrides) - set(PLATFORMS)
    if unknown:
        raise ValueError(
            f"`per_platform` overrides must be among {', '.join(PLATFORMS)}, got "
            f"{', '.join(sorted(unknown))}."
        )
    pinned = canonical_platform(platform)
    if pinned is not None:
        return overrides.get(pinned, default)(*args)
    if not overrides:
        return default(*args)
    default = _interned(default, args)
    overrides = {name: _interned(fn, args) for name, fn in overrides.items()}
    staged = _staged_call(args, default, overrides)
    if staged is not None:
        return staged
    return lax.platform_dependent(*args, default=default, **overrides)


# The call `lax.platform_dependent` stages (a `platform_index` and a `cond`
# over the traced branches), traced once per formulation, operand types and
# tracing context, and called as one nested `jit` of it. JAX lowers each
# `cond` anew (it rebuilds the branches of every `cond` when it prunes dead
# code before lowering, and its lowering cache is keyed on their identity),
# about 0.6 ms each; a nested `jit` of one jaxpr is lowered once per module
# and called (XLA inlines the calls), differentiated from cached jaxprs, and
# a call skips the branch bookkeeping.
_STAGED: dict[Any, tuple[Any, Any]] = {}


def _staged_call(
    args: tuple[Any, ...], default: Callable[..., Any], overrides: dict[str, Any]
) -> Any:
    """``lax.platform_dependent(*args, ...)`` through a nested ``jit`` of its
    traced call, or ``None`` (nothing done) where it cannot be: a branch that
    is not interned (a closure may hold traced values), or operands that are
    not traced (JAX then runs the platform's branch directly)."""
    branches = (default, *overrides.values())
    if any(fn not in _INTERNED_FNS for fn in branches):
        return None
    leaves, tree = jax.tree.flatten(args)
    if not any(_compat.is_tracer(x) for x in leaves):
        return None
    avals = tuple(_compat.get_aval(x) for x in leaves)
    key = (
        default,
        tuple(sorted(overrides.items())),
        tree,
        avals,
        _compat.tracing_context(),
    )
    found = _STAGED.get(key)
    if found is None:
        out_trees: list[Any] = []

        def call(*flat: Any) -> list[Any]:
            out = lax.platform_dependent(
                *jax.tree.unflatten(tree, flat), default=default, **overrides
            )
            out_leaves, out_tree = jax.tree.flatten(out)
            out_trees.append(out_tree)
            return out_leaves

        closed = _compat.trace_without_name_stack(call, avals, name="per_platform")
        run = jax.jit(_compat.jaxpr_as_fun(closed))
        if len(_STAGED) >= _INTERN_LIMIT:
            _STAGED.clear()
        found = _STAGED[key] = (run, out_trees[0])
    run, out_tree = found
    return jax.tree.unflatten(out_tree, run(*leaves))


# One object per formulation (module-level function, static arguments, operand
# structure). JAX caches the jaxpr it traces for a branch by the branch's
# identity and the operands' types: the products of every layer of a model
# share one trace per formulation instead of tracing each branch once per
# product. The object also carries the debug info JAX would build for it as a
# branch (from its signature, on every call otherwise). A closure, or a static
# argument that is not plain data, is passed as it is (never kept here: it may
# hold traced values).
_INTERNED: dict[Any, Callable[..., Any]] = {}
_INTERNED_FNS: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()
_INTERN_LIMIT: Final = 4096
_DATA: Final = (type(None), bool, int, float, str, np.dtype, enum.Enum, Sharding)


def _data_key(value: Any) -> Any:
    """``value`` with the type of every part (``1`` and ``True`` are equal, and
    hash alike, but are not the same argument); ``None`` if it is not plain
    data."""
    if isinstance(value, tuple):
        parts = tuple(_data_key(v) for v in value)
        return None if None in parts else (type(value), parts)
    return (type(value), value) if isinstance(value, _DATA) else None


def _interned(fn: Callable[..., Any], args: tuple[Any, ...]) -> Callable[..., Any]:
    if isinstance(fn, ft.partial):
        if type(fn) is not ft.partial:  # a subclass may call differently
            return fn
        func, static, keywords = fn.func, fn.args, fn.keywords
    else:
        func, static, keywords = fn, (), {}
    # (A closure, a lambda or a function defined in a function: made anew
    # per call, it would never be found again.)
    if getattr(func, "__closure__", None) is not None or "<" in getattr(
        func, "__qualname__", "<"
    ):
        return fn
    static_key = _data_key((static, tuple(sorted(keywords.items()))))
    if static_key is None:
        return fn
    key = (func, static_key, jax.tree.structure(args))
    found = _INTERNED.get(key)
    if found is None:
        if len(_INTERNED) >= _INTERN_LIMIT:
            _INTERNED.clear()
        found = ft.partial(func, *static, **keywords)
        _compat.keep_branch_debug_info(found, args)
        _INTERNED[key] = found
        _INTERNED_FNS.add(found)
    return found
