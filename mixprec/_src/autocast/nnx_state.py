"""Flax NNX objects as arguments of an autocast function: state in, state out.

NNX objects (modules, ``nnx.Optimizer``, metrics, ``nnx.Rngs``) are updated in
place: ``optimizer.update(model, grads)``, batch-norm statistics, RNG counters.
autocast traces its function to a jaxpr, and tracing hands the function copies
of its pytree arguments, so those updates would land on the copies and be lost
without a word (as under a plain ``jax.jit``). Instead autocast does what
``nnx.jit`` does: it splits the NNX objects among the arguments into a graph
definition and their state, runs the function on objects merged from that
state, and writes the state they end with back into the caller's objects.

Variables shared between arguments (a model and an optimizer that refers to
its parameters) stay shared: all NNX objects of a call are split together.
Flax is not imported here unless the caller has imported ``flax.nnx``.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import jax


def _nnx() -> Any:
    return sys.modules.get("flax.nnx")


@dataclasses.dataclass(frozen=True)
class StatefulCall:
    """A call whose arguments hold NNX objects, split into state and the rest.

    Attributes:
        nodes: the caller's NNX objects, in argument order (updated in place by
            :meth:`write_back`).
        state: their state (``nnx.State``), the dynamic input of the call.
        others: the argument leaves that are not NNX objects.
        key: what the pure function depends on besides its inputs (the graph
            definition and where the objects sit among the arguments).
    """

    nodes: list[Any]
    state: Any
    others: list[Any]
    key: tuple[Any, ...]

    def write_back(self, new_state: Any) -> None:
        """Writes the state the objects ended with into the caller's objects."""
        _nnx().update(self.nodes, new_state)


def is_node(x: Any) -> bool:
    """Whether ``x`` is an NNX object (``False`` when ``flax.nnx`` was never
    imported)."""
    nnx = _nnx()
    return nnx is not None and nnx.graph.is_graph_node(x)


def call_node(node: Any, *args: Any, **kwargs: Any) -> Any:
    """``node(*args, **kwargs)``: an NNX module given to autocast as the
    function is split and written back like an argument."""
    return node(*args, **kwargs)


def split_args(args: tuple, kwargs: dict) -> StatefulCall | None:
    """The NNX objects among ``args``/``kwargs`` and their state, or None when
    there are none (or ``flax.nnx`` was never imported)."""
    nnx = _nnx()
    if nnx is None:
        return None
    is_node = nnx.graph.is_graph_node
    leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_node)
    where = tuple(i for i, leaf in enumerate(leaves) if is_node(leaf))
    if not where:
        return None
    nodes = [leaves[i] for i in where]
    graphdef, state = nnx.split(nodes)
    positions = set(where)
    others = [leaf for i, leaf in enumerate(leaves) if i not in positions]
    return StatefulCall(nodes, state, others, (graphdef, treedef, where))


def prepare(
    fn: Callable[..., Any], args: tuple, kwargs: dict
) -> tuple[Callable[..., Any], StatefulCall] | None:
    """The function to make pure and the split call, when NNX objects are among
    the arguments or are ``fn`` itself; None otherwise."""
    if is_node(fn):
        stateful = split_args((fn, *args), kwargs)
        return None if stateful is None else (call_node, stateful)
    stateful = split_args(args, kwargs)
    return None if stateful is None else (fn, stateful)


def make_pure(
    fn: Callable[..., Any], key: tuple[Any, ...], name: str
) -> Callable[..., Any]:
    """``pure(state, others) -> (out, new_state)``: ``fn`` on NNX objects merged
    from ``state``, returning the state they end with (``name`` names ``fn`` in
    errors)."""
    graphdef, treedef, where = key

    def pure(state: Any, others: list[Any]) -> tuple[Any, Any]:
        nnx = _nnx()
        nodes = iter(nnx.merge(graphdef, state))
        rest = iter(others)
        positions = set(where)
        leaves = [
            next(nodes) if i in positions else next(rest)
            for i in range(treedef.num_leaves)
        ]
        args, kwargs = jax.tree.unflatten(treedef, leaves)
        out = fn(*args, **kwargs)
        merged = [leaves[i] for i in where]
        new_graphdef, new_state = nnx.split(merged)
        if new_graphdef != graphdef:
            raise ValueError(
                f"`autocast({name})` was given NNX objects and `{name}` changed "
                "their structure (added or removed a submodule or a variable, "
                "or changed a static attribute). autocast writes the state of "
                "the objects back after the call, which needs the same "
                "structure: create submodules and variables before calling "
                "the autocast function."
            )
        return out, new_state

    pure.__name__ = name
    return pure


def as_pure(
    fn: Callable[..., Any], args: tuple, kwargs: dict
) -> tuple[Any, ...] | None:
    """``(pure, pure_args)`` that compute what ``fn(*args, **kwargs)`` does to
    the NNX objects among them (or ``fn`` itself) without writing anything back
    (``mixprec.explain``, ``mixprec.diagnose``); None without NNX objects."""
    prepared = prepare(fn, args, kwargs)
    if prepared is None:
        return None
    target, stateful = prepared
    name = getattr(fn, "__name__", type(fn).__name__)
    pure = make_pure(target, stateful.key, name)
    return pure, (stateful.state, stateful.others)
