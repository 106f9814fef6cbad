"""``mixprec.autocast``: run any JAX function in mixed precision.

How a call works:

1. The arguments are flattened. Array leaves (``jax.Array``, NumPy arrays,
   tracers) are traced; every other leaf (Python scalars, strings, ``None``,
   modules' static config) is static and part of the cache key.
2. ``fn`` is traced to a jaxpr at the abstract values of the array leaves.
3. The jaxpr is re-interpreted equation by equation
   (:mod:`~mixprec._src.autocast.interpreter`) and the result traced into a new
   jaxpr, whose floating outputs are cast to ``policy.output_dtype``.
4. Steps 2-3 are cached per (function, argument types and tree, static leaves,
   configuration, region). Called eagerly, the transformed jaxpr runs through a
   ``jax.jit(..., inline=True)``, so a second call neither re-traces nor
   re-compiles; inside ``jit`` it is evaluated in place.

Inside ``jit``, the first call of a function at given types is walked straight
into the caller's trace instead (step 3 without a jaxpr of its own, nothing
cached): a function traced once, as a jitted step is, costs one walk and no
copy, and under ``grad`` its equations are differentiated as they are walked,
not traced once more from a copy. A second call at the same types builds and
caches the transformed jaxpr, so that a function called many times in one
trace (a block autocast per layer) is walked twice, not once per call.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools as ft
import gc
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from jax.extend import source_info_util as siu
from jax.extend.core import jaxpr_as_fun

from mixprec._src import _compat
from mixprec._src.autocast import arg_paths, interpreter, nnx_state, regions, rules
from mixprec._src.autocast.config import CastConfig, make_config
from mixprec._src.autocast.ops import OpLists
from mixprec._src.autocast.walk import Observer, Walk
from mixprec._src.plan import Plan
from mixprec._src.policy import Policy, get_global_policy


del rules  # imported for its registrations

__all__ = ["autocast"]

F = TypeVar("F", bound=Callable[..., Any])

# The configuration of the autocast whose function is being traced (stage 2).
_active: contextvars.ContextVar[CastConfig | None] = contextvars.ContextVar(
    "mixprec_autocast_active", default=None
)


def _is_dynamic(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic) or _compat.is_tracer(x)


@dataclasses.dataclass
class _Entry:
    call: Callable[..., Any]  # jitted: for calls that are not staged out
    run: Callable[..., Any]  # the transformed jaxpr as a function: inline under jit
    consts: list[Any]
    out_tree: Any
    out_static: dict[int, Any]
    n_out: int
    transformed: Any
    source: Any  # the traced jaxpr that `transformed` was built from


class _Cache:
    """Per-function cache of transformed jaxprs (weak on the function)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._weak: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.misses = 0

    def get(self, fn: Any, key: Any) -> _Entry | None:
        try:
            table = self._weak.get(fn)
        except TypeError:
            return None
        return None if table is None else table.get(key)

    def first_sight(self, fn: Any, key: Any) -> bool:
        """Whether ``(fn, key)`` was not seen before (now it has been); always
        true where it cannot be cached (no key, ``fn`` not weakly
        referenceable)."""
        if key is None:
            return True
        with self._lock:
            try:
                seen = self._seen.setdefault(fn, set())
            except TypeError:
                return True
            if key in seen:
                return False
            seen.add(key)
            return True

    def put(self, fn: Any, key: Any, entry: _Entry) -> None:
        with self._lock:
            try:
                table = self._weak.setdefault(fn, {})
            except TypeError:  # not weak-referenceable: do not cache
                return
            table[key] = entry


_cache = _Cache()


def _current_region() -> str:
    return str(siu.current_name_stack())


def _config_key() -> tuple[Any, ...]:
    """What a trace depends on besides the function and its arguments: the
    configuration, and the tracing context, whose mesh and named axes (their
    sizes: `axis_size`, the divisor of a `pmean`) a jaxpr traced inside one
    ``shard_map`` or ``vmap`` holds; argument types alone (a NumPy argument's
    names no mesh) would replay it inside another."""
    return (
        jax.config.jax_enable_x64,  # type: ignore[attr-defined]
        jax.config.jax_numpy_dtype_promotion,  # type: ignore[attr-defined]
        jax.config.jax_default_matmul_precision,  # type: ignore[attr-defined]
        _compat.tracing_context(),
    )


def _static_key(statics: list[tuple[int, Any]]) -> Any:
    try:
        key = tuple((i, type(v), v) for i, v in statics)
        hash(key)
        return key
    except TypeError:
        return None


def _aval(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        return _compat.shaped_array(x.shape, x.dtype)
    return _compat.get_aval(x)


def _float_or_none(dtype: Any) -> np.dtype | None:
    if dtype is None or not jax.numpy.issubdtype(dtype, np.floating):
        return None
    return np.dtype(dtype)


def _cast_output(x: Any, dtype: np.dtype) -> Any:
    return interpreter.cast(x, dtype)


@dataclasses.dataclass
class Source:
    """A function traced at the abstract values of its array arguments: what
    autocast, ``explain`` and ``diagnose`` all walk.

    Attributes:
        closed: the jaxpr as traced.
        jaxpr: the same jaxpr with its constants as leading inputs.
        consts: the values of those constants.
        in_avals: the abstract values of the dynamic (array) arguments.
        out_tree: the output's tree structure.
        out_static: output leaves that are not arrays, by leaf index.
        n_out: the number of output leaves.
        is_state: per dynamic output, whether it is state written back into
            the caller's objects (it keeps the dtype ``fn`` gives it).
    """

    closed: Any
    jaxpr: Any
    consts: list[Any]
    in_avals: list[Any]
    out_tree: Any
    out_static: dict[int, Any]
    n_out: int
    is_state: list[bool]

    def in_marks(self) -> list[int]:
        """The marks of the walk's inputs: the constants, then the arguments."""
        const = interpreter.CONST | interpreter.INPUT
        return [const] * len(self.consts) + [interpreter.INPUT] * len(self.in_avals)


def trace_source(
    fn: Callable[..., Any],
    config: CastConfig,
    leaves: list[Any],
    treedef: Any,
    dyn_idx: list[int],
    state_out: bool = False,
) -> Source:
    """Traces ``fn`` on the leaves ``dyn_idx`` of ``(args, kwargs)`` (the
    others are static). With ``state_out``, ``fn`` returns ``(result,
    state)``."""
    out_info: dict[str, Any] = {}

    def flat_fn(*dyn: Any) -> list[Any]:
        full = list(leaves)
        for i, x in zip(dyn_idx, dyn, strict=True):
            full[i] = x
        args, kwargs = jax.tree.unflatten(treedef, full)
        token = _active.set(config)
        try:
            with arg_paths.collecting() as seen:
                out = fn(*args, **kwargs)
                # (after the call: an NNX object's Variables are noted where
                # it is rebuilt, and keep those paths)
                arg_paths.note(args, kwargs)
        finally:
            _active.reset(token)
        out_info["paths"] = [seen.get(id(x)) for x in dyn]
        out_leaves, out_tree = jax.tree.flatten(out)
        out_info["tree"] = out_tree
        out_info["static"] = {
            i: x for i, x in enumerate(out_leaves) if not _is_dynamic(x)
        }
        out_info["n"] = len(out_leaves)
        # With state_out, `out` is (result, state); the state's leaves come last.
        first_state = len(out_leaves)
        if state_out:
            first_state -= len(jax.tree.leaves(out[1]))
        dyn_out = [i for i, x in enumerate(out_leaves) if _is_dynamic(x)]
        out_info["is_state"] = [i >= first_state for i in dyn_out]
        return [out_leaves[i] for i in dyn_out]

    in_avals = [_aval(leaves[i]) for i in dyn_idx]
    name = getattr(fn, "__name__", type(fn).__name__)
    with _collector_paused():
        closed = _compat.trace_to_closed_jaxpr(flat_fn, in_avals, name=name)
    jaxpr = _compat.convert_constvars_jaxpr(closed.jaxpr)
    # Plan sites with no layer path are named by the argument leaf they read.
    arg_paths.register(jaxpr, [None] * len(closed.consts) + out_info["paths"])
    return Source(
        closed=closed,
        jaxpr=jaxpr,
        consts=list(closed.consts),
        in_avals=in_avals,
        out_tree=out_info["tree"],
        out_static=out_info["static"],
        n_out=out_info["n"],
        is_state=out_info["is_state"],
    )


def region_walk(config: CastConfig, observer: Observer | None = None) -> Walk:
    """The walk for a call made here: inside the regions (``float32_scope``
    and co) around the call."""
    stack = _current_region()
    found = regions.parse_name_stack(stack) if stack else None
    return Walk(config, observer=observer).in_region(found)


def _build(
    fn: Callable[..., Any],
    config: CastConfig,
    leaves: list[Any],
    treedef: Any,
    dyn_idx: list[int],
    observer: Observer | None = None,
    state_out: bool = False,
) -> _Entry:
    """Traces ``fn``, walks its jaxpr and traces the result. With ``state_out``,
    ``fn`` returns ``(result, state)`` and the state keeps its traced dtypes."""
    source = trace_source(fn, config, leaves, treedef, dyn_idx, state_out)
    consts = source.consts

    def interp(*vals: Any) -> list[Any]:
        return _walk(source, config, vals, observer)

    name = getattr(fn, "__name__", type(fn).__name__)
    const_avals = [_compat.get_aval(c) for c in consts]
    transformed = _compat.trace_to_closed_jaxpr(
        interp, const_avals + source.in_avals, name=name
    )
    run = jaxpr_as_fun(transformed)

    def autocast_call(*args: Any) -> Any:
        return run(*args)

    autocast_call.__name__ = f"autocast_{name}"
    call = jax.jit(autocast_call, inline=True)
    return _Entry(
        call=call,
        run=run,
        consts=consts,
        out_tree=source.out_tree,
        out_static=source.out_static,
        n_out=source.n_out,
        transformed=transformed,
        source=source.closed,
    )


def _walk(
    source: Source,
    config: CastConfig,
    vals: Sequence[Any],
    observer: Observer | None = None,
) -> list[Any]:
    """Walks ``source`` on ``vals`` (its constants, then its arguments) in the
    current trace; returns its dynamic outputs in their output dtypes."""
    jaxpr = source.jaxpr
    walk = region_walk(config, observer)
    out_dtype = config.policy.output_dtype
    with _collector_paused():
        outs, _ = interpreter.eval_jaxpr(
            walk, jaxpr, [], vals, source.in_marks(), source.consts
        )
    # State written back into the caller's objects keeps the dtype the function
    # gives it without autocast; everything else gets the policy's output dtype.
    # (None: not a float, e.g. an RNG key of an `nnx.Rngs`; left as it is.)
    out_dtypes = [
        (_float_or_none(getattr(v.aval, "dtype", None)) if is_state else out_dtype)
        for v, is_state in zip(jaxpr.outvars, source.is_state, strict=True)
    ]
    return [
        o if d is None else _cast_output(o, d)
        for o, d in zip(outs, out_dtypes, strict=True)
    ]


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused (where it runs) while a
    function is traced and walked.

    Both allocate a program's worth of objects that live on (equations,
    tracers, tables), so the collector keeps running collections of its older
    generations, each traversing the whole heap, and finds little: measured,
    about a sixth of a whole step's walk, and 0.58 s of a 24-layer GPT step's
    3.96 s under autocast. It collects as usual once the trace or the walk is
    done (an error included); memory freed by reference counting is freed as
    it goes.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _split(args: tuple, kwargs: dict) -> tuple[list[Any], Any, list[int], Any]:
    leaves, treedef = jax.tree.flatten((args, kwargs))
    dyn_idx = [i for i, x in enumerate(leaves) if _is_dynamic(x)]
    statics = [(i, x) for i, x in enumerate(leaves) if not _is_dynamic(x)]
    return leaves, treedef, dyn_idx, _static_key(statics)


def _run(
    fn: Callable[..., Any],
    config: CastConfig,
    args: tuple,
    kwargs: dict,
    *,
    state_out: bool = False,
) -> Any:
    leaves, treedef, dyn_idx, skey = _split(args, kwargs)
    dyn = [leaves[i] for i in dyn_idx]
    region_stack = _current_region()
    region_key = regions.parse_name_stack(region_stack) if region_stack else None
    del region_stack
    key = None
    entry = None
    if skey is not None:
        avals = tuple(_compat.get_aval(x) for x in dyn)
        key = (treedef, tuple(dyn_idx), skey, avals, config, region_key, _config_key())
        entry = _cache.get(fn, key)
    staging = _compat.is_staging()
    if entry is None:
        _cache.misses += 1
        if staging and _cache.first_sight(fn, key):
            source = trace_source(fn, config, leaves, treedef, dyn_idx, state_out)
            consts = _compat.as_staged(source.consts)
            return _unflatten(source, iter(_walk(source, config, [*consts, *dyn])))
        entry = _build(fn, config, leaves, treedef, dyn_idx, state_out=state_out)
        if key is not None and not any(_compat.is_tracer(c) for c in entry.consts):
            _cache.put(fn, key, entry)
    if staging:
        # Being staged out (inside jit): run the transformed jaxpr inline. A
        # nested jit would be linearized and partially evaluated as a whole
        # under `grad`, which took more trace time than the step itself.
        # Eagerly (also under an eager grad or vmap) the jitted call is faster.
        outs = iter(_compat.eval_closed_jaxpr(entry.transformed, *entry.consts, *dyn))
    else:
        outs = iter(entry.call(*entry.consts, *dyn))
    return _unflatten(entry, outs)


def _unflatten(built: _Entry | Source, outs: Iterator[Any]) -> Any:
    """The call's result: the static output leaves of ``built``, the dynamic
    ones from ``outs``."""
    out_leaves = [
        built.out_static[i] if i in built.out_static else next(outs)
        for i in range(built.n_out)
    ]
    return jax.tree.unflatten(built.out_tree, out_leaves)


@dataclasses.dataclass
class Call:
    """A call of ``fn`` split as autocast traces it: ``leaves`` of ``(args,
    kwargs)`` with ``treedef``, of which ``dyn_idx`` are traced and the others
    static. ``state_out``: ``fn`` returns ``(result, state)`` (NNX objects)."""

    fn: Callable[..., Any]
    leaves: list[Any]
    treedef: Any
    dyn_idx: list[int]
    state_out: bool

    def source(self, config: CastConfig) -> Source:
        """The call traced (see :func:`trace_source`)."""
        return trace_source(
            self.fn, config, self.leaves, self.treedef, self.dyn_idx, self.state_out
        )


def split_call(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Call:
    """How ``explain`` and ``diagnose`` see a call, as autocast would trace it.

    NNX objects among the arguments (or ``fn`` itself) become the pure function
    over their state that autocast runs (nothing is written back); array leaves
    and ``jax.ShapeDtypeStruct``\\ s are traced, every other leaf is static.
    """
    pure = nnx_state.as_pure(fn, args, kwargs)
    if pure is not None:
        (fn, args), kwargs = pure, {}
    leaves, treedef = jax.tree.flatten((args, kwargs))
    dyn_idx = [
        i
        for i, x in enumerate(leaves)
        if _is_dynamic(x) or isinstance(x, jax.ShapeDtypeStruct)
    ]
    return Call(fn, leaves, treedef, dyn_idx, state_out=pure is not None)


def trace_transformed(
    fn: Callable[..., Any],
    config: CastConfig,
    args: tuple,
    kwargs: dict,
    *,
    observer: Observer | None = None,
) -> Any:
    """Builds (without caching or running) the transformed jaxpr of ``fn``.

    Arguments may be ``jax.ShapeDtypeStruct``\\ s. ``observer`` sees every
    decision of the walk that builds it (``mixprec.explain``). Returns the
    transformed closed jaxpr and the traced one it was built from (whose
    equations the observer saw).
    """
    call = split_call(fn, args, kwargs)
    entry = _build(
        call.fn,
        config,
        call.leaves,
        call.treedef,
        call.dyn_idx,
        observer=observer,
        state_out=call.state_out,
    )
    return entry.transformed, entry.source


def autocast(
    fn: F,
    policy: Policy | Plan | str | None = None,
    *,
    mode: str = "allow_mix_precision",
    mixlist: Mapping[str, Any] | str | os.PathLike | OpLists | None = None,
    strict: bool = False,
    forward_mode_ad: bool | None = None,
) -> F:
    """Transforms ``fn`` to run in mixed precision, driven by op lists and a mode.

    The returned function has the signature and output structure of ``fn``. It
    traces ``fn`` to a jaxpr and re-runs it equation by equation, deciding each
    one's precision once:

    * allow-list ops (matmuls, convolutions) round their operands to the
      policy's compute dtype and accumulate in float32; a dot written with
      ``precision=HIGHEST`` stays float32;
    * deny-list ops (``exp``, ``log``, reductions, ``log_softmax``, ``jnp.var``,
      norms) run in float32;
    * gray ops (``add``, ``mul``, ``tanh``, ``where``...) run in the widest dtype
      of their operands, except that an operand broadcast into the result (a
      bias, a norm scale, a scalar) follows the others. So activations stay
      16-bit while a float32 value the shape of the result (a residual stream,
      a master weight, optimizer state) is never rounded: wrapping a whole
      train step computes the weight update in float32;
    * higher-order primitives (nested ``jit``, ``scan``, ``while_loop``,
      ``cond``, ``checkpoint``, ``custom_jvp``/``custom_vjp``, ``shard_map``,
      and any other primitive with a jaxpr parameter) are entered and rebuilt.

    Floating outputs come back in ``policy.output_dtype``; integers, booleans and
    PRNG keys are untouched. Parameters are not cast up front: each op casts
    what it reads, and gradients come back in the parameters' dtype. The full
    rule is in ``docs/autocast.md``.

    It composes with ``jax.jit``, ``jax.grad``, ``jax.value_and_grad``,
    ``jax.jvp``, ``jax.vmap``, ``jax.checkpoint``, ``jax.export`` and itself (a
    nested autocast with its own configuration wins inside). A second call with
    the same argument types does not re-trace.

    Flax NNX objects go in and out as under ``nnx.jit``: those among the
    arguments (modules, ``nnx.Optimizer``, metrics, ``nnx.Rngs``) may be
    updated in place by ``fn``, Variables and submodules added or removed
    included, and what they end as is written back into them; NNX objects
    ``fn`` returns are the caller's own objects when ``fn`` returns those, new
    ones otherwise, with Variables shared as inside ``fn``. Their state keeps
    the dtypes ``fn`` gives it without autocast.

    Array arguments (``jax.Array``, NumPy arrays, tracers) are traced; every
    other leaf of the arguments (Python numbers, strings, ``None``, static
    config) is treated as static, like ``equinox.filter_jit``: a new value
    re-traces.

    Notes:
        * With ``policy=None`` the global policy is read when the wrapped
          function is called; under an outer ``jax.jit`` that is when the outer
          function is traced (JAX caches the trace, as for any global state).
        * Use :func:`mixprec.float32_scope` for parts that must stay float32;
          ``x.astype(jnp.float32)`` on a float32 value leaves no trace. Your own
          scope and layer names (``"norm"``, ``"mean"``) change nothing.
        * A primitive in no op list and without a rule runs at the dtypes it was
          traced with; ``strict=True`` raises instead.
        * Loop carries keep the wider of their traced and received dtypes, so a
          float32 RNN state stays float32 across ``scan`` iterations.

    Args:
        fn: the function to transform.
        policy: a :class:`mixprec.Policy` or a string for
            :func:`mixprec.get_policy` (``"mixed_bfloat16"``,
            ``"p=f32,c=bf16,o=f32"``). None: the global policy at call time.
            A :class:`mixprec.Plan`: a policy per matmul site (its base
            policy for the rest; see ``docs/plans.md``).
        mode: the precision mode: ``"allow_mix_precision"`` (default),
            ``"allow_mix_precision_bf16"``, ``"allow_fp32_to_fp16"``,
            ``"allow_fp32_to_bf16"``, ``"force_fp16"``, ``"force_fp32"``,
            ``"must_keep_origin_dtype"``.
        mixlist: edits to the default op lists: a dict, a JSON string or a path
            to a JSON file (see :func:`mixprec.modify_mixlist`), or the
            :class:`mixprec.OpLists` to use.
        strict: raise ``NotImplementedError`` (naming the primitive and the user
            source line) for a primitive that is in no op list and has no rule,
            instead of running it as written.
        forward_mode_ad: how low-precision dots are formulated on CPU. ``None``
            (default): decided per call. Under reverse-mode AD (``jax.grad``,
            ``jax.vjp``) each dot is a ``custom_vjp`` whose backward dots are
            low precision too (XLA:CPU would run JAX's own transposes, which
            take a float32 cotangent, in float32); elsewhere, and under
            ``jax.jvp``/``jax.jacfwd`` (which cannot differentiate a
            ``custom_vjp``), plain dots. A whole train step wrapped in
            autocast already holds its backward dots, so it needs none.
            ``True``: never use a ``custom_vjp``. ``False``: always.

    Returns:
        The transformed function.

    Raises:
        TypeError: ``fn`` is not callable, or ``strict``/``forward_mode_ad`` is
            not a bool.
        ValueError: unknown ``mode`` or policy, or a bad ``mixlist``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import mixprec
        >>> def mlp(w, x):
        ...     return jax.nn.relu(x @ w).sum()
        >>> f = mixprec.autocast(mlp, "mixed_bfloat16")
        >>> w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
        >>> f(w, x), f(w, x).dtype
        (Array(24., dtype=float32), dtype('float32'))
        >>> jax.grad(f)(w, x).dtype
        dtype('float32')
        >>> jax.jvp(f, (w, x), (w, x))[1].dtype
        dtype('float32')
        >>> jax.jit(jax.vmap(f, in_axes=(None, 0)))(w, x[:, None]).shape
        (2,)
    """
    if not callable(fn):
        raise TypeError(
            f"`autocast(fn, ...)` expects a callable, got {type(fn).__name__} instead."
        )
    if forward_mode_ad is not None and not isinstance(forward_mode_ad, bool):
        raise TypeError(
            "`autocast(..., forward_mode_ad=...)` must be None, True or False, got "
            f"{forward_mode_ad!r} ({type(forward_mode_ad).__name__}) instead."
        )
    make = ft.partial(make_config, mode=mode, strict=strict, mixlist=mixlist)
    fixed = None if policy is None else make(policy)
    if policy is None:
        make(get_global_policy())  # validate the arguments now

    stateful: nnx_state.Stateful | None = None  # built at the first NNX call
    name = getattr(fn, "__name__", type(fn).__name__)

    @ft.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        config = fixed if fixed is not None else _config_for(make, get_global_policy())
        config = (
            config.resolved()
        )  # what the CPU branch needs, if creation could not tell
        ad = _compat.ad_mode()
        if forward_mode_ad is None:
            vjp_dots = ad == "reverse"
        else:
            vjp_dots = not forward_mode_ad
            if vjp_dots and ad == "forward":
                raise TypeError(
                    "`autocast(..., forward_mode_ad=False)` formulates every dot "
                    "with a `jax.custom_vjp`, which forward-mode AD (`jax.jvp`, "
                    "`jax.jacfwd`) cannot differentiate. Pass "
                    "`forward_mode_ad=None` (the default: decided per call) or "
                    "`True`."
                )
        if vjp_dots != config.custom_vjp_dots:
            config = dataclasses.replace(config, custom_vjp_dots=vjp_dots)
        active = _active.get()
        if active is not None:
            # Nested inside another autocast being traced: let the outer
            # interpreter run our ops, in a region with our configuration.
            if active == config:
                return fn(*args, **kwargs)
            with jax.named_scope(regions.context_marker(config)):
                return fn(*args, **kwargs)
        # Flax NNX objects (among the arguments, `fn` itself, or returned) go
        # in and out as under nnx.jit: updated in place, returned as the
        # caller's objects (nnx_state).
        if not nnx_state.is_loaded():
            return _run(fn, config, args, kwargs)
        nonlocal stateful
        if stateful is None:
            stateful = nnx_state.Stateful(fn, name)
        return stateful(
            lambda pure, pure_args: _run(pure, config, pure_args, {}, state_out=True),
            args,
            kwargs,
        )

    wrapped.__mixprec_autocast__ = True  # type: ignore[attr-defined]
    return wrapped  # type: ignore[return-value]


_config_memo: dict[Any, CastConfig] = {}


def _config_for(make: Callable[..., CastConfig], policy: Policy) -> CastConfig:
    key = (make, policy)
    config = _config_memo.get(key)
    if config is None:
        config = make(policy)
        if len(_config_memo) < 1024:
            _config_memo[key] = config
    return config
