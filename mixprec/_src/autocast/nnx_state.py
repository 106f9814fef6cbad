"""Flax NNX objects in and out of an autocast function, as ``nnx.jit`` has them.

NNX objects (modules, ``nnx.Optimizer``, metrics, ``nnx.Rngs``, Variables) are
updated in place: ``optimizer.update(model, grads)``, batch-norm statistics,
RNG counters, a Variable a module creates in ``__call__``. autocast traces its
function to a jaxpr, and tracing hands the function copies of its pytree
arguments, so those updates would land on the copies and be lost without a
word (as under a plain ``jax.jit``); NNX objects the function returns would
come back as copies with no Variable shared with the caller's objects.

Instead autocast does what ``nnx.jit`` does (in graph mode, Flax's default),
through Flax's own update-context protocol (``nnx.update_context``):

1. outside, the NNX objects among the arguments are flattened together into
   graph definitions and their leaves (shared Variables once);
2. inside the traced function, they are rebuilt from those leaves and the
   function runs on them;
3. the objects the arguments hold and the NNX objects the function returns
   are flattened again, each graph definition recording which of the caller's
   objects it is;
4. outside, the caller's objects are updated from the result (new Variables
   and submodules added, removed ones dropped, shared Variables kept shared),
   and returned objects that were the caller's come back as the very same
   Python objects; new ones are built.

The state written back or returned keeps the dtypes the function gives it
without autocast; only the function's other outputs are cast to the policy's
output dtype. Flax is not imported here unless the caller has imported
``flax.nnx``.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from mixprec._src import _compat
from mixprec._src.autocast import arg_paths


def _nnx() -> Any:
    return sys.modules.get("flax.nnx")


def is_loaded() -> bool:
    """Whether ``flax.nnx`` has been imported (else there are no NNX objects)."""
    return _nnx() is not None


# Types whose instances are never NNX objects: concrete arrays (Flax's own test
# costs microseconds per array: it asks whether it is an array ref).
_never_nodes: set[type] = {np.ndarray, int, float, complex, bool, str, type(None)}


def is_node(x: Any) -> bool:
    """Whether ``x`` is an NNX object or Variable (``False`` when ``flax.nnx``
    was never imported)."""
    kind = type(x)
    if kind in _never_nodes:
        return False
    nnx = _nnx()
    if nnx is None:
        return False
    if isinstance(x, nnx.Variable) or nnx.graph.is_graph_node(x):
        return True
    if isinstance(x, jax.Array) and not _compat.is_tracer(x):
        _never_nodes.add(kind)
    return False


def has_nodes(tree: Any) -> bool:
    """Whether the pytree ``tree`` holds an NNX object or Variable."""
    if _nnx() is None:
        return False
    return any(is_node(x) for x in jax.tree.leaves(tree, is_leaf=is_node))


def pure_values(tree: Any) -> Any:
    """``tree`` with every NNX Variable replaced by its value (an optimizer
    state held by ``nnx.Optimizer`` wraps its arrays in Variables)."""
    nnx = _nnx()
    if nnx is None:
        return tree
    return jax.tree.map(
        lambda x: x.get_value() if isinstance(x, nnx.Variable) else x,
        tree,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Flat:
    """One NNX object as a pytree: its graph definition (static) and leaves."""

    graphdef: Any = dataclasses.field(metadata=dict(static=True))
    leaves: list[Any]


Flat = _Flat


def variables(node: Any) -> list[tuple[list[str], Any, bool]]:
    """Per Variable of the NNX object ``node`` (each once): its attribute
    path, its value and whether it is an ``nnx.Param`` (for naming plan
    sites by the parameter a product reads)."""
    nnx = _nnx()
    found = []
    for path, x in nnx.graph.iter_graph(node):
        if isinstance(x, nnx.Variable):
            value = x.get_value()
            found.append(([str(k) for k in path], value, isinstance(x, nnx.Param)))
    return found


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where the ``index``-th NNX object sits in the function's output (a
    static leaf of the traced output)."""

    index: int


class _Tag:
    """The ``nnx.update_context`` tag of one autocast function."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"autocast({self.name})"


def _flatten(tree: Any, tag: _Tag | None) -> tuple[Any, list[_Flat]]:
    """``tree`` with its NNX objects replaced by slots, and those objects
    flattened together (one split context: shared Variables appear once)."""
    nnx = _nnx()
    flats: list[_Flat] = []

    nodes: set[int] = set()

    def is_leaf(x: Any) -> bool:
        if is_node(x):
            nodes.add(id(x))
            return True
        return False

    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_leaf)
    with nnx.split_context(tag) as ctx:
        for i, x in enumerate(leaves):
            if id(x) in nodes:
                graphdef, node_leaves = ctx.flatten(x, with_paths=False)
                flats.append(_Flat(graphdef, node_leaves))
                leaves[i] = _Slot(len(flats) - 1)
    return jax.tree.unflatten(treedef, leaves), flats


def _unflatten(
    skeleton: Any, flats: list[_Flat], tag: _Tag | None, *, inner: bool | None
) -> Any:
    """Inverse of `_flatten` (``inner``: the merge inside the traced function,
    or outside, onto the caller's objects)."""
    nnx = _nnx()
    with nnx.merge_context(tag, inner) as ctx:
        nodes = [ctx.unflatten(f.graphdef, f.leaves) for f in flats]
    return jax.tree.map(
        lambda x: nodes[x.index] if isinstance(x, _Slot) else x,
        skeleton,
        is_leaf=lambda x: isinstance(x, _Slot),
    )


def call_node(node: Any, *args: Any, **kwargs: Any) -> Any:
    """``node(*args, **kwargs)``: an NNX module given to autocast as the
    function is an argument like the others."""
    return node(*args, **kwargs)


def _pure(fn: Callable[..., Any], tag: _Tag | None, name: str) -> Callable[..., Any]:
    """``pure((skeleton, flats)) -> (out_skeleton, out_flats)``: ``fn`` on NNX
    objects rebuilt from ``flats``; the objects of the arguments and the NNX
    objects in the output, flattened (steps 2 and 3 of the module docstring).
    The output's flattened objects come last, so `api._build` can tell the
    state (kept in its traced dtypes) from the rest."""

    def pure(split: tuple[Any, list[_Flat]]) -> tuple[Any, list[_Flat]]:
        skeleton, flats = split
        args, kwargs = _unflatten(skeleton, flats, tag, inner=True)
        arg_paths.note(args, kwargs)
        out = fn(*args, **kwargs)
        leaves = jax.tree.leaves((args, kwargs), is_leaf=is_node)
        in_nodes = [x for x in leaves if is_node(x)]
        # The argument objects first (as nnx.jit does), then the output.
        (_, out_skeleton), out_flats = _flatten((in_nodes, out), tag)
        return out_skeleton, out_flats

    pure.__name__ = name
    return pure


class Stateful:
    """Runs a function whose arguments (or the function itself) hold NNX
    objects the way ``nnx.jit`` does (see the module docstring).

    One instance per autocast function: its pure function is the key of
    autocast's trace cache.
    """

    def __init__(self, fn: Callable[..., Any], name: str) -> None:
        self._fn_is_node = is_node(fn)
        self._fn = fn
        self._tag = _Tag(name)
        target = call_node if self._fn_is_node else fn
        self.pure = _pure(target, self._tag, name)

    def __call__(
        self,
        run: Callable[[Callable[..., Any], tuple[Any, ...]], Any],
        args: tuple,
        kwargs: dict,
    ) -> Any:
        """``fn(*args, **kwargs)`` with ``run(pure, pure_args)`` running the
        pure function (autocast's `_run`); writes the objects' state back and
        returns the output with its NNX objects rebuilt."""
        nnx = _nnx()
        if self._fn_is_node:
            args = (self._fn, *args)
        with nnx.update_context(self._tag):
            split = _flatten((args, kwargs), self._tag)
            out_skeleton, out_flats = run(self.pure, (split,))
            # Merged onto the caller's objects (the argument objects come
            # first in `out_flats`), updating them in place.
            return _unflatten(out_skeleton, out_flats, self._tag, inner=False)


def as_pure(
    fn: Callable[..., Any], args: tuple, kwargs: dict
) -> tuple[Any, ...] | None:
    """``(pure, pure_args)`` that compute what ``fn(*args, **kwargs)`` does to
    the NNX objects among them (or ``fn`` itself) without writing anything back
    (``mixprec.explain``, ``mixprec.diagnose``); None without NNX objects.

    ``pure_args`` is ``(leaves,)``, the list of the arguments' leaves and their
    objects' leaves (arrays, as ``jax.make_jaxpr`` takes them);
    ``pure(leaves)`` returns ``(out, state)``, with ``None`` in ``out`` where
    the function returned an NNX object and the objects' leaves in ``state``.
    """
    fn_is_node = is_node(fn)
    if not fn_is_node and not has_nodes((args, kwargs)):
        return None
    if fn_is_node:
        fn, args = call_node, (fn, *args)
    name = getattr(fn, "__name__", type(fn).__name__)
    leaves, treedef = jax.tree.flatten(_flatten((args, kwargs), None))
    slots = {i: x for i, x in enumerate(leaves) if isinstance(x, _Slot)}
    inner = _pure(fn, None, name)

    def pure(dyn: list[Any]) -> tuple[Any, list[_Flat]]:
        rest = iter(dyn)
        full = [slots[i] if i in slots else next(rest) for i in range(len(leaves))]
        out, flats = inner(jax.tree.unflatten(treedef, full))
        out = jax.tree.map(
            lambda x: None if isinstance(x, _Slot) else x,
            out,
            is_leaf=lambda x: isinstance(x, _Slot),
        )
        return out, flats

    pure.__name__ = name
    return pure, ([x for i, x in enumerate(leaves) if i not in slots],)


def value_and_grad(
    fun: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    *,
    argnums: tuple[int, ...],
    wrt: Any,
) -> tuple[Any, Any]:
    """``nnx.value_and_grad(fun, argnums=..., has_aux=True)(*args, **kwargs)``
    differentiating the ``wrt`` Variables (default ``nnx.Param``) of the NNX
    objects in ``args[argnums]`` (``mixprec.value_and_grad``).

    The rest of the objects' state (batch statistics, RNG counters) is not
    differentiated and is written back into them, as ``nnx.value_and_grad``
    does; so are the objects among the other arguments and ``kwargs``.
    """
    nnx = _nnx()
    n = len(args)
    argnums = tuple(a % n for a in argnums)
    graph = nnx.set_graph_mode.current_value()
    updates = nnx.set_graph_updates.current_value()
    if graph and updates:
        diff: tuple[Any, ...] = tuple(
            nnx.DiffState(a, nnx.Param if wrt is None else wrt) for a in argnums
        )
    elif wrt is None:
        diff = argnums  # tree mode: what nnx.value_and_grad does there
    else:
        raise ValueError(
            "`mixprec.value_and_grad(fn, wrt=...)` needs Flax NNX's graph mode "
            "with graph updates (the default; `nnx.set_graph_mode(True)`, "
            "`nnx.set_graph_updates(True)`), as `nnx.DiffState` does; got "
            f"graph={graph}, graph_updates={updates}."
        )

    def positional(*a: Any) -> Any:
        # Keyword arguments travel as one positional argument, so that NNX
        # objects among them are split and written back too.
        return fun(*a[:n], **a[n])

    return nnx.value_and_grad(positional, argnums=diff, has_aux=True)(*args, kwargs)
