"""Naming the matmul sites of a jaxpr, for precision plans.

A plan (:class:`mixprec.Plan`) gives each matmul-like product a policy by
its site: ``(layer, op, index)``, the layer path of its name stack (module
path and named scopes, JAX's transformation wrappers removed), its
primitive, and its occurrence among the forward products of that layer and
primitive in the jaxpr. :func:`name_sites` computes them once per jaxpr
walked, before the rewrite passes (a fused attention's products keep the
names they had), and the walk reads them where it gives an equation its
region (:meth:`~mixprec._src.autocast.interpreter.Walk.for_eqn`).

A product of a zero JAX made (the zero tangent a ``custom_jvp`` rule
calling ``jax.jvp`` gets for an input not differentiated: ``0 @ w`` in a
whole step, not in its loss) is no site and takes no index, so a whole step
has the sites of its loss. A product whose result is used nowhere (by
liveness from the jaxpr's outputs, into and out of bodies bound by
position) is in ``dead`` (:func:`is_unused`): XLA removes it, ``explain``
and ``diagnose`` do not list it; it keeps its name (the loss's last product
where ``jax.grad`` drops the loss value is still the site of its gradients).

Backward products follow their forward site. JAX's transpose of
``dot(x, w)`` is ``dot(g, w)`` and ``dot(x, g)``: each keeps a forward
operand as its residual, so a backward product is traced to the forward
products nearest to it that read the same value. A value is followed
through reshapes, transposes and converts, and across the boundary of a
higher-order equation, position by position: a body's invars are its
equation's operands and the equation's results are its body's outvars
(``jit``, ``checkpoint``, ``custom_jvp``/``custom_vjp`` calls and
``shard_map`` one to one; ``scan``: consts, carry, xs and carry, ys; a
``cond``'s branches: the operands after the index, a path keeping to one
branch per index, the one its transpose runs; ``while``: each body's
consts, then the carry). So the residual a forward ``scan`` stacks as ys
and its transpose reads as xs is followed from one body into the other.
Of the forward sites at the same distance, those of the backward
product's own layer (it keeps the name stack of the forward product it
transposes) are taken, else all, and of several those traced by its own
source lines where there are such (``h @ wq`` and ``h @ wk`` both read
``h``); a product still traced to several runs the widest of their
policies (``tanh(x @ w) @ w``: both read ``w``). One that reads a value
computed again (a checkpoint's recomputed forward, or a ``custom_vjp``
rule's: new variables) is traced to the forward sites that read the same
value, by value numbers (the same pure ops on the same variables); else to
the forward sites of its layer and primitive traced by the same source
lines; and only where none is found is it ``(layer, op, None)``: the
widest policy of the sites of its layer and primitive.

Examples:
    >>> import jax, jax.numpy as jnp
    >>> def f(x, w):
    ...     with jax.named_scope("mlp"):
    ...         return jnp.sum(jnp.tanh(x @ w) @ w)
    >>> closed = jax.make_jaxpr(jax.grad(f, 1))(jnp.ones((2, 2)), jnp.ones((2, 2)))
    >>> names = name_sites(closed.jaxpr)
    >>> for keys in sorted(set(names.values())):
    ...     print(keys)
    (('mlp', 'dot_general', 0),)
    (('mlp', 'dot_general', 0), ('mlp', 'dot_general', 1))
    (('mlp', 'dot_general', 1),)

    The backward products of a scanned layer, in the transposed ``scan``'s
    body, follow the forward product in the forward ``scan``'s body:

    >>> def g(x, ws):
    ...     with jax.named_scope("mlp"):
    ...         h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
    ...     return jnp.sum(h)
    >>> closed = jax.make_jaxpr(jax.grad(g, 1))(jnp.ones((2, 2)), jnp.ones((3, 2, 2)))
    >>> sorted(set(name_sites(closed.jaxpr).values()))
    [(('mlp', 'dot_general', 0),)]
"""

from __future__ import annotations

import functools as ft
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var

from mixprec._src import _compat
from mixprec._src.autocast import arg_paths, ops
from mixprec._src.numerics.record import layer_path


__all__ = ["SiteKey", "is_unused", "layer_of", "name_sites", "program_sites"]

#: ``(layer, op, index)``; ``index`` is ``None`` for a backward product not
#: traced back to a forward one.
SiteKey = tuple[str, str, int | None]

# Ops a residual may pass through between a forward product and the
# backward product that reads it.
_THROUGH = frozenset(
    ["transpose", "reshape", "convert_element_type", "copy", "copy_p", "squeeze"]
)


def layer_of(eqn: JaxprEqn, scope: str = "") -> str:
    """The layer path of ``eqn`` (after ``scope``, the name stack of the
    higher-order equations around its jaxpr; a checkpoint's recomputed
    forward is in the layer it recomputes)."""
    stack = _compat.eqn_name_stack(eqn.source_info)
    full = f"{scope}/{stack}" if scope and stack else scope or stack
    return _compat.without_rematerialized(layer_path(full))


def unnamed(layer: str) -> bool:
    """Whether a name-stack ``layer`` names no layer of the user's: none, or
    only Equinox's own class scopes (``eqx.nn.Linear``,
    ``eqx.nn.MLP/eqx.nn.Linear``: every linear of a model is one)."""
    return not layer or all(p.startswith("eqx.") for p in layer.split("/"))


def param_layer(eqn: JaxprEqn, layer: str, names: _Names) -> str:
    """The layer of the product ``eqn`` whose name stack gives ``layer``:
    ``layer``, unless it is :func:`unnamed` and an operand reaches (through
    reshapes, transposes, converts and bodies' boundaries) a leaf of the
    traced function's arguments with a path: then that path, its last key
    (the leaf's own: ``kernel``, ``weight``) dropped where it has more than
    one (``layers/0/linear/kernel``: ``layers/0/linear``). Of several, an
    ``nnx.Param`` first, then the longest path, then the later operand
    (``x @ w``); a product reading none keeps ``layer``."""
    if not names.args or not unnamed(layer):
        return layer
    best: tuple[bool, int, int] | None = None
    found = ""
    for pos, v in enumerate(eqn.invars):
        for u, _, _ in _upstream(v, names):
            hit = names.args.get(u)
            if hit is None:
                continue
            path, is_param = hit
            rank = (is_param, path.count("/"), pos)
            if best is None or rank > best:
                best, found = rank, path
            break
    if not found:
        return layer
    return found.rsplit("/", 1)[0] if "/" in found else found


def _is_product(eqn: JaxprEqn) -> bool:
    spec = ops.spec_for(eqn.primitive.name)
    return spec is not None and spec.product is not None


def _is_backward(eqn: JaxprEqn) -> bool:
    """Whether ``eqn`` is of a backward pass (a checkpoint's recomputed
    forward is: it repeats a forward site, it is not one)."""
    info = eqn.source_info
    return _compat.name_stack_transformed_by(
        info.name_stack, "transpose"
    ) or _compat.eqn_rematerialized(info)


_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Sites(dict):  # dict[int, tuple[SiteKey, ...]]
    """The names of one program's products by equation ``id`` (a body's
    first visit among them), and ``visits``: per body (by ``id``) reached
    again from another layer, the names of each later visit (and of the
    bodies in it)."""

    __slots__ = ("dead", "visits")

    def __init__(
        self,
        visits: dict[int, list[_Sites]] | None = None,
        dead: set[int] | None = None,
    ) -> None:
        super().__init__()
        self.visits: dict[int, list[_Sites]] = {} if visits is None else visits
        # the products (by equation id) whose results are never used: no site
        self.dead: set[int] = set() if dead is None else dead


def name_sites(
    jaxpr: Jaxpr,
    scope: str = "",
    backward: bool = False,
    outer: dict[int, tuple[SiteKey, ...]] | None = None,
) -> dict[int, tuple[SiteKey, ...]]:
    """Per product equation of ``jaxpr`` and of the bodies in its equations'
    parameters (by ``id``), the sites it belongs to: one for a forward
    product, those of the forward products it was traced back to for a
    backward one (``backward``: the whole jaxpr is a backward pass).

    The index counts a layer's products in program order across bodies: a
    product in a ``cond`` branch or a called function's body is not the
    same site as one of the same layer outside it. A body reached twice
    from the same layer (a ``scan`` body, for every iteration; one function
    called twice there) keeps the names of its first visit; one reached
    from another layer (a ``jax.jit`` function called in two named scopes)
    is named again there. ``outer``: the names the walk has for the jaxpr
    around this body; used when they (or those of a later visit) name this
    body's products in its layers (else the body is named on its own, from
    index 0).
    """
    if outer:
        hit = _inherited(jaxpr, scope, outer)
        if hit is not None:
            return hit
        for visit in getattr(outer, "visits", {}).get(id(jaxpr), ()):
            if _covered(jaxpr, scope, visit):
                return visit
    per_jaxpr = _cache.setdefault(jaxpr, {})
    hit = per_jaxpr.get((scope, backward))
    if hit is not None:
        return hit
    names = _Names()
    names.args = arg_paths.of(jaxpr) if not scope else {}
    _live(jaxpr, (True,) * len(jaxpr.outvars), names)
    out = _Sites(dead=names.dead)
    _name(jaxpr, scope, backward, names, out)
    per_jaxpr[(scope, backward)] = out
    return out


def is_unused(sites: dict[int, tuple[SiteKey, ...]], eqn: JaxprEqn) -> bool:
    """Whether :func:`name_sites` found that ``eqn``, a product, computes a
    result used nowhere (no site: XLA removes it from the program)."""
    return id(eqn) in getattr(sites, "dead", ())


def _inherited(
    jaxpr: Jaxpr, scope: str, outer: dict[int, tuple[SiteKey, ...]]
) -> dict[int, tuple[SiteKey, ...]] | None:
    """``outer`` if it names every product of ``jaxpr`` and of the bodies in
    it in the layer it has under ``scope``."""
    return outer if _covered(jaxpr, scope, outer) else None


def _covered(
    jaxpr: Jaxpr, scope: str, outer: dict[int, tuple[SiteKey, ...]]
) -> bool | None:
    """Whether ``outer`` names the products of ``jaxpr`` and of its bodies
    in their layers under ``scope``: ``None`` where one is not, ``False``
    where there are none. (Not where the names of a body reached from two
    layers are those of its first visit.)"""
    found = False
    for eqn in jaxpr.eqns:
        if not _is_product(eqn):
            subs = _sub_jaxprs(eqn)
            if subs:
                stack = _compat.eqn_name_stack(eqn.source_info)
                inner = f"{scope}/{stack}" if scope and stack else scope or stack
                for sub in subs:
                    hit = _covered(sub, inner, outer)
                    if hit is None:
                        return None
                    found = found or hit
            continue
        keys = outer.get(id(eqn))
        if not keys:
            if id(eqn) in getattr(outer, "dead", ()):
                found = True  # used nowhere: no site, as named there
                continue
            return None
        layer = layer_of(eqn, scope)
        if not unnamed(layer) and any(not _same_layer(k[0], layer) for k in keys):
            return None
        found = True
    return found


def _same_layer(a: str, b: str) -> bool:
    """Whether layer paths ``a`` and ``b`` are one, where a scope repeated
    at once counts once (the backward ``checkpoint`` of a call in scope
    ``s`` has the name stack ``transpose(jvp(s))/jvp(s)``: layer ``s/s``)."""
    return a == b or _once(a) == _once(b)


def _once(layer: str) -> str:
    parts = layer.split("/")
    return "/".join(p for i, p in enumerate(parts) if i == 0 or p != parts[i - 1])


# A path's branches taken: per ``cond`` index (the variable it was computed
# from), the branch. A path that would take two branches of one index is
# not followed: the forward ``cond`` ran the branch its transpose runs.
_Taken = tuple[tuple[Any, int], ...]
# A binding across a body's boundary, and the branch it enters (or None).
_Link = tuple[Any, "tuple[Any, int] | None"]


class _Names:
    """What naming one program gathers, across all of its bodies: the names
    so far, each layer's count, each variable's producer, the variables a
    body's variable is bound to across its equation, and per variable the
    forward sites that read it or a value it was reshaped, transposed,
    converted or passed into a body from (with the hops between and the
    branches taken)."""

    __slots__ = (
        "counts",
        "args",
        "bodies",
        "bodies_of",
        "dead",
        "holds",
        "forward",
        "frames",
        "links",
        "live",
        "numbered",
        "numbers",
        "producer",
        "read_by",
        "reads",
        "replay",
        "same",
        "stack",
        "used",
        "zeros",
        "visited",
    )

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}
        # the traced function's argument leaves with a path, by invar (of
        # the program's top jaxpr), and the name-stack layer of each forward
        # site named by one (`param_layer`)
        self.args: dict[Any, arg_paths.ArgPath] = {}
        self.stack: dict[SiteKey, str] = {}
        # per body, the layers (and passes) it was named from
        self.visited: dict[int, set[tuple[str, bool]]] = {}
        # per layer and op, its forward products (for those not traced back)
        self.forward: dict[tuple[str, str], list[tuple[SiteKey, JaxprEqn]]] = {}
        self.reads: list[tuple[SiteKey, JaxprEqn]] = []  # every forward product
        self.frames: dict[int, tuple[tuple[str, int], ...]] = {}
        self.producer: dict[Any, JaxprEqn] = {}
        self.links: dict[Any, list[_Link]] = {}
        self.read_by: dict[Any, list[tuple[SiteKey, int, _Taken]]] = {}
        # value numbers (for recomputed values), made when first needed:
        # per variable its number, per number the forward sites that read it,
        # and how many forward products are numbered so far
        self.numbers: dict[Any, Any] = {}
        self.same: dict[Any, list[SiteKey]] = {}
        self.numbered = 0
        # the products whose results are used (:func:`_live`), by id, and
        # those named none for it; per jaxpr and outvars used, the invars
        # used; per jaxpr, whether it holds a product; per equation, its bodies
        self.live: set[int] = set()
        self.dead: set[int] = set()
        self.zeros: dict[Any, bool] = {}
        self.used: dict[tuple[int, tuple[bool, ...]], tuple[bool, ...]] = {}
        self.holds: dict[int, bool] = {}
        self.bodies_of: dict[int, list[Jaxpr]] = {}
        # per forward body's products (`_again`), their names; and the names
        # the body being named takes in turn, where it repeats one
        self.bodies: dict[Any, list[SiteKey]] = {}
        self.replay: list[SiteKey] = []

    def subs(self, eqn: JaxprEqn) -> list[Jaxpr]:
        """The bodies in ``eqn``'s parameters (:func:`_sub_jaxprs`, once)."""
        hit = self.bodies_of.get(id(eqn))
        if hit is None:
            hit = self.bodies_of[id(eqn)] = _sub_jaxprs(eqn)
        return hit


def _name(jaxpr: Jaxpr, scope: str, backward: bool, names: _Names, out: _Sites) -> None:
    producer = names.producer
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            producer[v] = eqn
        if not _is_product(eqn):
            bodies = _bindings(eqn, names.subs(eqn))
            if bodies:
                branch = eqn.primitive.name == "cond"
                index = _root(eqn.invars[0], names) if branch else None
                for i, (sub, ins, outs) in enumerate(bodies):
                    tag = (index, i) if branch else None
                    _link(names.links, sub.invars, ins, tag)
                    _link(names.links, outs, sub.outvars, tag)
                stack = _compat.eqn_name_stack(eqn.source_info)
                inner = f"{scope}/{stack}" if scope and stack else scope or stack
                flag = backward or _is_backward(eqn)
                where = (_compat.without_rematerialized(layer_path(inner)), flag)
                for sub, _, _ in bodies:
                    seen = names.visited.setdefault(id(sub), set())
                    if where in seen:
                        continue
                    into = out
                    if seen:
                        into = _Sites(out.visits, out.dead)
                        out.visits.setdefault(id(sub), []).append(into)
                    seen.add(where)
                    again = _again(eqn, sub, inner, where, flag, names)
                    if again is not None and again[1] is not None:
                        names.replay = list(again[1])
                    _name(sub, inner, flag, names, into)
                    names.replay = []
                    if again is not None and again[1] is None:
                        names.bodies[again[0]] = [into[id(e)][0] for e in again[2]]
            continue
        if id(eqn) not in names.live:
            # used nowhere: XLA drops it, and explain does not list it; it
            # keeps its name (the loss's product whose result only the loss
            # value `jax.grad` drops reads, is still its backward's site)
            names.dead.add(id(eqn))
        if any(_zero(v, names) for v in eqn.invars):
            continue  # a zero JAX made (a zero tangent): no site, no index
        layer = layer_of(eqn, scope)
        op = eqn.primitive.name
        if not (backward or _is_backward(eqn)):
            site = param_layer(eqn, layer, names)
            if names.replay:  # a body that repeats one named before
                key: SiteKey = names.replay.pop(0)
            else:
                index = names.counts.get((site, op), 0)
                names.counts[(site, op)] = index + 1
                key = (site, op, index)
            if site != layer:
                names.stack[key] = layer
            out[id(eqn)] = (key,)
            names.forward.setdefault((layer, op), []).append((key, eqn))
            names.reads.append((key, eqn))
            for v in eqn.invars:
                for u, hops, taken in _upstream(v, names):
                    names.read_by.setdefault(u, []).append((key, hops, taken))
            continue
        found: list[SiteKey] = []
        for v in eqn.invars:
            # The forward sites nearest to this operand (fewest hops from a
            # variable both reached, on paths through the same branches),
            # those of its own layer first: a backward product keeps the
            # name stack of the forward one it transposes.
            best: tuple[int, int] | None = None
            near: list[SiteKey] = []
            for u, hops, taken in _upstream(v, names):
                for k, more, theirs in names.read_by.get(u, ()):
                    if k[1] != op:
                        continue
                    rank = (int(names.stack.get(k, k[0]) != layer), hops + more)
                    if best is not None and rank > best:
                        continue
                    if theirs and taken and _joined(taken, theirs) is None:
                        continue
                    if best is None or rank < best:
                        best, near = rank, []
                    if k not in near:
                        near.append(k)
            found += [k for k in near if k not in found]
        if not found:
            found = _recomputed(eqn, op, layer, names)
        forward = names.forward.get((layer, op), ())
        if len(found) > 1:
            # several read it (`h @ wq`, `h @ wk`): those of its lines, if any
            mine = [(k, e) for k, e in forward if k in found]
            found = _same_lines(eqn, mine, names) or found
        elif not found:
            found = _same_lines(eqn, forward, names)
        if not found:
            found = [(param_layer(eqn, layer, names), op, None)]
        out[id(eqn)] = tuple(found)


# Calls whose bodies stay bodies in the gradient of a loss (a custom_jvp or
# custom_vjp call's is replaced by its rules there).
_CALLS = frozenset(["jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint"])


def _again(
    eqn: JaxprEqn,
    sub: Jaxpr,
    scope: str,
    where: tuple[str, bool],
    backward: bool,
    names: _Names,
) -> tuple[Any, list[SiteKey] | None, list[JaxprEqn]] | None:
    """Whether ``sub``, a forward body of ``eqn``, repeats one named before
    from the same layer: ``(key, names, products)``, ``names`` those of the
    earlier body's products, ``None`` where it is the first; ``None`` where
    ``sub`` is not such a body.

    JAX gives two calls of one ``jax.jit`` function in a loss one body, but
    each call its own forward body in the gradient of the loss (the first
    call's input has no tangent). A body is known by its op (and function
    name) and its products (sites' layers, ops and source lines; none in a
    nested body), so the calls keep the one name per product the loss gives
    them. (A ``jax.checkpoint`` function called twice: the gradient runs
    each call's forward outside any body, as if written out, so its second
    call's products are sites the loss does not have.)"""
    if backward or _is_backward(eqn) or eqn.primitive.name not in _CALLS:
        return None
    for e in sub.eqns:
        for v in e.outvars:
            names.producer[v] = e
    # a `jax.jit` function's name (its products may have no source lines)
    called = eqn.params.get("name") if isinstance(eqn.params.get("name"), str) else None
    found = []
    for e in sub.eqns:
        if not _is_product(e):
            if any(_has_products(b, names) for b in names.subs(e)):
                return None
            continue
        if any(_zero(v, names) for v in e.invars):
            continue
        if _is_backward(e) or not (called or _frames(e, names)):
            return None
        found.append(e)
    if not found:
        return None
    key = (
        where,
        eqn.primitive.name,
        called,
        tuple(
            (
                param_layer(e, layer_of(e, scope), names),
                e.primitive.name,
                _frames(e, names),
            )
            for e in found
        ),
    )
    return key, names.bodies.get(key), found


# Ops whose result is their operands' and params' alone: a value computed
# again by the same ops from the same values (a checkpoint's recomputed
# forward) is the value the forward computed.
_PURE = frozenset(
    [
        *_THROUGH,
        *("abs", "add", "broadcast_in_dim", "cos", "div", "dot_general", "erf"),
        *("exp", "exp2", "expand_dims", "integer_pow", "log", "log1p", "logistic"),
        *("max", "min", "mul", "neg", "pow", "reduce_max", "reduce_precision"),
        *("reduce_sum", "rsqrt", "select_n", "sign", "sin", "slice", "sqrt"),
        *("square", "sub", "tan", "tanh"),
    ]
)


def _recomputed(eqn: JaxprEqn, op: str, layer: str, names: _Names) -> list[SiteKey]:
    """The forward sites that read a value ``eqn`` reads as computed again
    (the same ops from the same variables), those of ``layer`` first."""
    reads = names.reads
    for key, e in reads[names.numbered :]:
        for v in e.invars:
            hit = names.same.setdefault(_number(v, names), [])
            if key not in hit:
                hit.append(key)
    names.numbered = len(reads)
    found: list[SiteKey] = []
    for v in eqn.invars:
        found += [
            k
            for k in names.same.get(_number(v, names), ())
            if k[1] == op and k not in found
        ]
    mine = [k for k in found if names.stack.get(k, k[0]) == layer]
    return mine or found


def _number(v: Any, names: _Names) -> Any:
    """The value number of ``v``: equal for variables computed by the same
    pure ops from the same variables (followed across the bodies' bindings
    where they are one to one)."""
    numbers = names.numbers
    stack = [v]
    while stack:
        u = stack[-1]
        if type(u) is not Var or u in numbers:
            stack.pop()
            continue
        eqn = names.producer.get(u)
        if eqn is not None and eqn.primitive.name in _PURE:
            todo = [i for i in eqn.invars if type(i) is Var and i not in numbers]
            if todo:
                stack += todo
                continue
            params = tuple(sorted(eqn.params.items()))
            key = (
                eqn.primitive.name,
                params,
                tuple(
                    numbers[i] if type(i) is Var else ("literal", str(i))
                    for i in eqn.invars
                ),
                eqn.outvars.index(u),
            )
            try:
                hash(key)
            except TypeError:  # a param that is not hashable: a value apart
                key = ("var", id(u))
            numbers[u] = key
        else:
            bound = names.links.get(u, ())
            if len(bound) == 1 and bound[0][1] is None and type(bound[0][0]) is Var:
                up = bound[0][0]
                if up not in numbers:
                    stack.append(up)
                    continue
                numbers[u] = numbers[up]
            else:
                numbers[u] = ("var", id(u))
        stack.pop()
    return numbers[v] if type(v) is Var else ("literal", str(v))


def _same_lines(
    eqn: JaxprEqn, forward: Sequence[tuple[SiteKey, JaxprEqn]], names: _Names
) -> list[SiteKey]:
    """The sites among ``forward`` traced by the same user lines as ``eqn``
    (a backward product keeps the source of the forward one it transposes;
    a checkpoint's recomputed forward, that of the one it recomputes)."""
    if not forward:
        return []
    lines = _frames(eqn, names)
    if not lines:
        return []
    return [k for k, e in forward if _frames(e, names) == lines]


def _frames(eqn: JaxprEqn, names: _Names) -> tuple[tuple[str, int], ...]:
    hit = names.frames.get(id(eqn))
    if hit is None:
        hit = names.frames[id(eqn)] = _compat.eqn_frame_lines(eqn.source_info)
    return hit


def _link(
    links: dict[Any, list[_Link]],
    inner: Sequence[Any],
    outer: Sequence[Any],
    tag: tuple[Any, int] | None,
) -> None:
    """Binds each of ``inner`` to the variable at its position in ``outer``
    (a body's invars to its equation's operands, an equation's outvars to
    its body's outvars); ``tag``: the branch the binding enters."""
    for a, b in zip(inner, outer, strict=False):
        if type(a) is Var and type(b) is Var:
            links.setdefault(a, []).append((b, tag))


def _joined(taken: _Taken, more: _Taken) -> _Taken | None:
    """The branches of both paths, or ``None`` where they differ on one."""
    out = taken
    for index, branch in more:
        for i, b in out:
            if i is index:
                if b != branch:
                    return None
                break
        else:
            out = (*out, (index, branch))
    return out


# Hops followed from a variable back to where it came from.
_MAX_HOPS = 16


def _root(v: Any, names: _Names) -> Any:
    """Where ``v`` came from by one way only (a ``cond`` index passed into a
    body, or converted); a constant index (a ``Literal``), by its value."""
    if type(v) is not Var:
        return ("literal", str(v))
    for _ in range(_MAX_HOPS):
        eqn = names.producer.get(v)
        if eqn is not None and eqn.primitive.name in _THROUGH and eqn.invars:
            up = eqn.invars[0]
        else:
            bound = names.links.get(v, ())
            if len(bound) != 1:
                return v
            up = bound[0][0]
        if type(up) is not Var:
            return v
        v = up
    return v


def _upstream(v: Any, names: _Names) -> Iterator[tuple[Any, int, _Taken]]:
    """``v`` and the variables it was reshaped, transposed or converted from,
    or bound to across a body's boundary (a body's invar: its equation's
    operand; an equation's outvar: its body's outvar), each with the hops
    from ``v`` and the branches taken, nearest first."""
    if type(v) is not Var:
        return
    start: tuple[Any, _Taken] = (v, ())
    seen: set[tuple[Any, _Taken]] = {start}
    level = [start]
    for hops in range(_MAX_HOPS + 1):
        ahead: list[tuple[Any, _Taken]] = []
        for u, taken in level:
            yield u, hops, taken
            eqn = names.producer.get(u)
            if eqn is not None and eqn.primitive.name in _THROUGH and eqn.invars:
                ahead.append((eqn.invars[0], taken))
            for b, tag in names.links.get(u, ()):
                joined = taken if tag is None else _joined(taken, (tag,))
                if joined is not None:
                    ahead.append((b, joined))
        level = []
        for state in ahead:
            if type(state[0]) is Var and state not in seen:
                seen.add(state)
                level.append(state)
        if not level:
            return


# Ops whose result is zero where one operand is (``_ALL_ZERO``: where all are).
_ANY_ZERO = frozenset(["mul", "dot_general", "conv_general_dilated"])
_ALL_ZERO = frozenset(
    [
        *_THROUGH,
        *("add", "add_any", "sub", "neg", "broadcast_in_dim", "expand_dims"),
        *("slice", "dynamic_slice", "select_n", "reduce_sum", "concatenate"),
    ]
)


def _zero(v: Any, names: _Names) -> bool:
    """Whether ``v`` is all zeros by construction: a zero literal, or made
    from one (a broadcast, a product with a zero, a sum of zeros; into a
    body by a one to one binding): the zero tangent JAX makes where a
    ``custom_jvp`` rule needs one for an input not differentiated."""
    if type(v) is Literal:
        try:
            return bool(np.all(np.asarray(v.val) == 0))
        except (TypeError, ValueError):  # a value that is not an array of numbers
            return False
    hit = names.zeros.get(v)
    if hit is not None:
        return hit
    names.zeros[v] = False  # (while it is looked at)
    eqn = names.producer.get(v)
    found = False
    if eqn is None:
        bound = names.links.get(v, ())
        found = len(bound) == 1 and bound[0][1] is None and _zero(bound[0][0], names)
    elif eqn.primitive.name in _ANY_ZERO:
        found = any(_zero(u, names) for u in eqn.invars)
    elif eqn.primitive.name in _ALL_ZERO and eqn.invars:
        operands = eqn.invars[1:] if eqn.primitive.name == "select_n" else eqn.invars
        if eqn.primitive.name in ("dynamic_slice",):
            operands = eqn.invars[:1]
        found = all(_zero(u, names) for u in operands)
    names.zeros[v] = found
    return found


def _has_products(jaxpr: Jaxpr, names: _Names) -> bool:
    """Whether ``jaxpr`` or a body in it holds a product."""
    hit = names.holds.get(id(jaxpr))
    if hit is None:
        names.holds[id(jaxpr)] = False  # (while it is looked at)
        hit = any(
            _is_product(e) or any(_has_products(b, names) for b in names.subs(e))
            for e in jaxpr.eqns
        )
        names.holds[id(jaxpr)] = hit
    return hit


def _live(jaxpr: Jaxpr, wanted: tuple[bool, ...], names: _Names) -> tuple[bool, ...]:
    """Adds to ``names.live`` the ids of the products of ``jaxpr`` (and of
    its bodies) whose results reach one of its ``wanted`` outvars (or an
    effect); returns which of its invars do. Into a body by position, as
    :func:`_bindings` binds it (a ``scan``'s carry until no more of it is
    used; a ``custom_jvp``/``custom_vjp`` call's rules may read any of its
    operands, a ``while``'s or another body's carry are all taken as used)."""
    memo = names.used
    key = (id(jaxpr), wanted)
    hit = memo.get(key)
    if hit is not None:
        return hit
    live = names.live
    used = {
        v
        for v, w in zip(jaxpr.outvars, wanted, strict=True)
        if w and type(v) is not Literal
    }
    for eqn in reversed(jaxpr.eqns):
        outvars = eqn.outvars
        if eqn.effects:
            outs = (True,) * len(outvars)
        elif len(outvars) == 1:
            if outvars[0] not in used:
                continue
            outs = (True,)
        else:
            outs = tuple(o in used for o in outvars)
            if not any(outs):
                continue
        subs = names.subs(eqn)
        if not subs:
            if _is_product(eqn):
                live.add(id(eqn))
            used.update(v for v in eqn.invars if type(v) is not Literal)
            continue
        ins = _live_operands(eqn, outs, subs, names)
        used.update(
            v
            for v, u in zip(eqn.invars, ins, strict=True)
            if u and type(v) is not Literal
        )
    out = memo[key] = tuple(v in used for v in jaxpr.invars)
    return out


def _live_operands(
    eqn: JaxprEqn, outs: tuple[bool, ...], subs: list[Jaxpr], names: _Names
) -> tuple[bool, ...]:
    """Of a higher-order ``eqn`` whose ``outs`` are used, which operands are
    (its bodies, ``subs``: their products marked live)."""
    name = eqn.primitive.name
    n = len(eqn.invars)
    every = (True,) * n
    if name == "scan" and len(subs) == 1:
        body = subs[0]
        consts, carry = _compat.scan_layout(eqn.params)
        if len(body.invars) == n and len(body.outvars) == len(outs):
            want = outs
            while True:
                ins = _live(body, want, names)
                more = tuple(
                    w or ins[consts + i] if i < carry else w for i, w in enumerate(want)
                )
                if more == want:
                    return ins
                want = more
    if name == "cond":
        found: list[bool] = [True] + [False] * (n - 1)
        for sub in subs:
            if len(sub.invars) != n - 1 or len(sub.outvars) != len(outs):
                _live(sub, (True,) * len(sub.outvars), names)
                found = list(every)
                continue
            for i, u in enumerate(_live(sub, outs, names)):
                found[1 + i] = found[1 + i] or u
        return tuple(found)
    if name in _POSITIONAL and len(subs) == 1:
        sub = subs[0]
        if len(sub.invars) == n and len(sub.outvars) == len(outs):
            ins = _live(sub, outs, names)
            # a custom rule may read what the function does not
            return every if name.startswith("custom_") else ins
    for sub in subs:
        _live(sub, (True,) * len(sub.outvars), names)
    return every


# Higher-order primitives whose bodies' invars are their operands and whose
# outvars are their bodies' outvars, position by position (a ``scan``'s
# body reads consts, carry and one slice of each xs, and returns the carry
# and one slice of each ys, in its operands' and results' order).
_POSITIONAL = frozenset(
    [
        "jit",
        "pjit",
        "closed_call",
        "core_call",
        "remat2",
        "checkpoint",
        "custom_jvp_call",
        "custom_vjp_call",
        "scan",
        "shard_map",
    ]
)


def _bindings(
    eqn: JaxprEqn, subs: list[Jaxpr] | None = None
) -> list[tuple[Jaxpr, Sequence[Any], Sequence[Any]]]:
    """Per body in ``eqn``'s parameters: the body, the operands its invars
    are bound to and the outvars of ``eqn`` its outvars are bound to (empty
    where they are not bound by position)."""
    name = eqn.primitive.name
    if subs is None:
        subs = _sub_jaxprs(eqn)
    if not subs:
        return []
    if name == "cond":
        # operands: the branch index, then every branch's invars
        return [(sub, eqn.invars[1:], eqn.outvars) for sub in subs]
    if name == "while":
        cn, bn = _compat.while_layout(eqn.params)
        consts, carry = eqn.invars[: cn + bn], eqn.invars[cn + bn :]
        found = []
        for sub in subs:
            if sub is _open(eqn.params.get("cond_jaxpr")):
                found.append((sub, [*consts[:cn], *carry], ()))
            elif sub is _open(eqn.params.get("body_jaxpr")):
                found.append((sub, [*consts[cn:], *carry], eqn.outvars))
            else:
                found.append((sub, (), ()))
        return found
    if name not in _POSITIONAL:
        return [(sub, (), ()) for sub in subs]
    return [
        (
            sub,
            eqn.invars if len(sub.invars) == len(eqn.invars) else (),
            eqn.outvars if len(sub.outvars) == len(eqn.outvars) else (),
        )
        for sub in subs
    ]


def _open(x: Any) -> Any:
    return x.jaxpr if isinstance(x, ClosedJaxpr) else x


def _sub_jaxprs(eqn: JaxprEqn) -> list[Jaxpr]:
    found: list[Jaxpr] = []
    for value in eqn.params.values():
        if isinstance(value, ClosedJaxpr):
            found.append(value.jaxpr)
        elif isinstance(value, Jaxpr):
            found.append(value)
        elif isinstance(value, tuple | list):
            for x in value:
                if isinstance(x, ClosedJaxpr):
                    found.append(x.jaxpr)
                elif isinstance(x, Jaxpr):
                    found.append(x)
    return found


@ft.lru_cache(maxsize=256)
def _program_sites(jaxpr: Jaxpr, scope: str) -> frozenset[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for eqn in jaxpr.eqns:
        if _is_product(eqn):
            found.add((layer_of(eqn, scope), eqn.primitive.name))
        subs = list(_sub_jaxprs(eqn))
        if subs:
            stack = _compat.eqn_name_stack(eqn.source_info)
            inner = f"{scope}/{stack}" if scope and stack else scope or stack
            for sub in subs:
                found |= _program_sites(sub, inner)
    return frozenset(found)


def program_sites(jaxpr: Jaxpr, scope: str = "") -> frozenset[tuple[str, str]]:
    """``(layer, op)`` of every product of ``jaxpr`` and of the jaxprs in its
    equations' parameters (for checking a plan's rules against a program)."""
    if scope or not arg_paths.of(jaxpr):
        return _program_sites(jaxpr, scope)
    # Some are named by the parameters they read: as the naming has them.
    named = name_sites(jaxpr)
    # (every visit shares the first naming's table of visits)
    every = [named, *(v for vs in getattr(named, "visits", {}).values() for v in vs)]
    return frozenset((k[0], k[1]) for s in every for keys in s.values() for k in keys)
