"""The pytree paths of a traced function's arguments, for naming plan sites.

Where no name stack names a product's layer (Flax NNX pushes no scope per
module; Equinox names only its own classes, ``eqx.nn.Linear``), a precision
plan names it by the parameter it reads
(:func:`~mixprec._src.autocast.sites.param_layer`). This module records,
while autocast traces a function
(:func:`~mixprec._src.autocast.api.trace_source`), the path of each array
leaf of its arguments as the user reads it: the keys inside the argument
(the argument's position or keyword dropped, so ``loss(model, x)`` and
``train_step(model, optimizer, x)`` give ``model``'s leaves the same
paths), and for an NNX object among them its Variables' attribute path
(``layers/0/linear/kernel``), marked when the Variable is an ``nnx.Param``.
The paths are kept per traced jaxpr, for its invars.

Examples:
    >>> import jax, jax.numpy as jnp
    >>> def loss(params, x):
    ...     return jnp.sum(x @ params["mlp"]["w"])
    >>> with collecting() as seen:
    ...     params, x = {"mlp": {"w": jnp.ones((2, 2))}}, jnp.ones((2, 2))
    ...     note((params, x), {})
    >>> sorted(path for path, _ in seen.values())
    ['', 'mlp/w']
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import jax


__all__ = ["ArgPath", "collecting", "note", "of", "register"]

#: ``(path, is_param)``: a leaf's keys inside its argument, ``/``-joined,
#: and whether it is the value of an ``nnx.Param``.
ArgPath = tuple[str, bool]

_seen: contextvars.ContextVar[dict[int, ArgPath] | None] = contextvars.ContextVar(
    "mixprec_arg_paths", default=None
)

_by_jaxpr: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def collecting() -> Iterator[dict[int, ArgPath]]:
    """Collects, by ``id``, the paths :func:`note` sees while it is open."""
    seen: dict[int, ArgPath] = {}
    token = _seen.set(seen)
    try:
        yield seen
    finally:
        _seen.reset(token)


def _key(k: Any) -> str:
    for name in ("key", "idx", "name"):
        if hasattr(k, name):
            return str(getattr(k, name))
    return str(k)


def note(args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """Records the path of each leaf of ``(args, kwargs)`` (and of each NNX
    object's Variables) where :func:`collecting` is open; a leaf already
    recorded keeps its first path."""
    seen = _seen.get()
    if seen is None:
        return
    from mixprec._src.autocast import nnx_state  # (it notes its own objects)

    def is_leaf(x: Any) -> bool:
        return isinstance(x, nnx_state.Flat) or nnx_state.is_node(x)

    flat, _ = jax.tree_util.tree_flatten_with_path((args, kwargs), is_leaf=is_leaf)
    for path, leaf in flat:
        if isinstance(leaf, nnx_state.Flat):
            continue  # an NNX object's leaves: noted where it is rebuilt
        # (args, kwargs), then the position or keyword: dropped
        keys = [_key(k) for k in path[2:]]
        if nnx_state.is_node(leaf):
            for sub, value, is_param in nnx_state.variables(leaf):
                seen.setdefault(id(value), ("/".join(keys + sub), is_param))
        else:
            seen.setdefault(id(leaf), ("/".join(keys), False))


def register(jaxpr: Any, paths: Sequence[ArgPath | None]) -> None:
    """Keeps ``paths`` (per invar of ``jaxpr``; ``None``: not an argument
    leaf) for naming ``jaxpr``'s sites."""
    if any(p is not None and p[0] for p in paths):
        _by_jaxpr[jaxpr] = dict(
            (v, p) for v, p in zip(jaxpr.invars, paths, strict=True) if p and p[0]
        )


def of(jaxpr: Any) -> dict[Any, ArgPath]:
    """Per invar of ``jaxpr`` that is an argument leaf with a path, the path."""
    return _by_jaxpr.get(jaxpr, {})
