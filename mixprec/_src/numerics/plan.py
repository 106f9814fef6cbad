"""``mixprec.plan``: measure each matmul site under each candidate policy, and
choose per site the cheapest one that stays within tolerance.

For each forward matmul-like site of ``loss_fn`` (a ``dot_general``, a
convolution, a grouped matmul: the ops whose op-table entry has a
``Product``) and each candidate policy, it measures:

* the effect on the loss and on the gradients when that site *alone* runs
  at the candidate and everything else in float32 (its backward products
  follow it): ``loss_error = |L - L32| / |L32|``, ``grad_error`` the largest
  ``‖g - g32‖ / ‖g32‖`` over the gradient leaves. One site at a time isolates
  what each costs. All these runs are one compiled program in which each
  site's candidate is an argument (:class:`_Switch`);
* the op's own output error against float32 (``op_error``), its overflow,
  underflow and non-finite counts and, in float8, the operand values flushed
  to zero (``flushed`` of ``quantized``), with :func:`mixprec.diagnose`'s
  arithmetic (``numerics/diagnose.py``'s ``compare_output`` and
  ``_count_float8``) on the site's float32 operands: the same program's
  float32 run hands each site's operands and every candidate's result to
  the host. These are diagnose's numbers for that site alone at the
  candidate. (A loss that calls a ``jax.jit`` inside is measured with one
  program per measurement, and these numbers come from one ``diagnose`` run
  per candidate, every op at it.)

The effects of several sites add up, so the chosen sites are then run
together (the rest in float32); while that is over ``tolerance``, the site
with the largest own effect is raised to the next wider candidate that
passed alone (``Plan.combined`` records it).

A candidate is within tolerance at a site when its effect,
``max(loss_error, grad_error)``, is at most ``tolerance`` and the op neither
overflows nor turns non-finite. The chosen candidate is the cheapest within
tolerance, by the site's estimated time on the target platform: its FLOPs
over the throughput of the dtype the product runs in there (a float8 policy's
product that the recipe keeps in bfloat16 costs bfloat16's). float32 (the
reference) always passes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mixprec._src.plan import Plan, Site, policy_rank
from mixprec._src.policy import Policy, get_policy


__all__ = ["DEFAULT_TOLERANCE", "THROUGHPUT", "plan", "render_plan", "runs_as"]

#: The default tolerance on a site's effect (``max(loss_error, grad_error)``,
#: relative). Measured (``tests/test_plan.py``, ``benchmarks/bench_plan.py``):
#: one well-scaled product in float8 alone moves the loss by 1e-4 to 1e-3 and
#: its layer's weight gradient by 3-8% (e5m2 gradients have two mantissa
#: bits), bfloat16 by under 1%; a layer that reads activations 1e5-1e6 times
#: the rest moves the loss or gradients by 20% to over 100% in float8 (the
#: tensorwise scale flushes everything but the outliers). 0.15 sits between.
DEFAULT_TOLERANCE = 0.15

#: Dense matmul throughput per platform and dtype, FLOP/s, with sources.
#: ``h100``: float8 and bfloat16 measured on an H100 80GB (JAX 0.11.2,
#: 16384x4096x16384, 2026-11-25, ``docs/float8.md``); float32 is NVIDIA's
#: published dense TF32 figure for the H100 SXM (494.7 TFLOP/s, the datasheet
#: number, not measured); float16 taken equal to bfloat16 (NVIDIA lists equal
#: dense FP16 and BF16 rates; not measured here). ``cpu``: float32 and
#: bfloat16 (bf16 x bf16 -> f32) measured on the 2-core AMD EPYC with
#: avx512_bf16 this was written on (2048^3, median of 7, load 7.3,
#: 2026-12-01); XLA:CPU has no float8 GEMM (float8 is emulated through
#: bfloat16, so it costs bfloat16's) and no native float16 (float32's).
THROUGHPUT: dict[str, dict[str, float]] = {
    "h100": {
        "float8": 1144e12,
        "bfloat16": 659e12,
        "float16": 659e12,
        "float32": 494.7e12,
    },
    "cpu": {
        "float8": 142.8e9,
        "bfloat16": 142.8e9,
        "float16": 82.2e9,
        "float32": 82.2e9,
    },
}

_RUNS = ("float8", "bfloat16", "float16", "float32")


def runs_as(policy: Policy | str) -> str:
    """The dtype a product runs in under ``policy`` when nothing keeps it
    wider: ``"float8"``, ``"bfloat16"``, ``"float16"`` or ``"float32"``.

    Examples:
        >>> runs_as("mixed_float8"), runs_as("float32")
        ('float8', 'float32')
    """
    p = get_policy(policy)
    if p.float8 is not None:
        return "float8"
    name = str(np.dtype(p.compute_dtype))
    return name if name in _RUNS else "float32"


def _site_runs_as(site: Site, policy: str) -> str:
    m = site.measurements().get(policy, {})
    value = m.get("runs_as")
    return value if isinstance(value, str) and value in _RUNS else runs_as(policy)


def _throughput(platform: str) -> dict[str, float]:
    table = THROUGHPUT.get(platform)
    if table is None:
        raise ValueError(
            f"`mixprec.plan(..., platform=...)` must be one of "
            f"{sorted(THROUGHPUT)}, got {platform!r}."
        )
    return table


# ------------------------------------------------------------------ measuring


def _leaves(tree: Any) -> list[np.ndarray]:
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    if not np.isfinite(b).all():
        return math.inf
    den = float(np.linalg.norm(a))
    num = float(np.linalg.norm(b - a))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def _effects(
    ref: tuple[np.ndarray, list[np.ndarray]],
    got: tuple[np.ndarray, list[np.ndarray]],
) -> tuple[float, float]:
    (l32, g32), (lc, gc) = ref, got
    if not np.isfinite(lc).all():
        loss_error = math.inf
    else:
        den = max(float(np.abs(l32).max(initial=0.0)), 1e-30)
        loss_error = float(np.abs(lc - l32).max(initial=0.0)) / den
    grad_error = max((_rel(a, b) for a, b in zip(g32, gc, strict=True)), default=0.0)
    return loss_error, grad_error


def _value_and_grad(
    fn: Callable[..., Any], argnums: Any, loss_scale: float | None
) -> Callable[..., tuple[np.ndarray, list[np.ndarray]]]:
    scale = 1.0 if loss_scale is None else float(loss_scale)

    def scaled(*a: Any) -> Any:
        out = fn(*a)
        return jnp.asarray(out, jnp.float32) * scale

    step = jax.jit(jax.value_and_grad(scaled, argnums))

    def run(*args: Any) -> tuple[np.ndarray, list[np.ndarray]]:
        loss, grads = step(*args)
        return (
            np.asarray(loss, np.float64) / scale,
            [g / scale for g in _leaves(grads)],
        )

    return run


@dataclasses.dataclass
class _Found:
    """What one forward site is, gathered from the candidates' reports."""

    key: tuple[str, str, int]
    source: str = ""
    flops: int = 0
    runs: dict[str, str] = dataclasses.field(default_factory=dict)
    measured: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, eq=False)
class _Call:
    """One traced call of a measured site's product whose operands are the
    float32 reference stream's: what a recording run hands to the host
    (:meth:`_Switch.op_measurements`), in this order: the float operands
    (if ``float8``), then each computed result's outputs."""

    index: int  # the site's, into the switch's keys
    eqn: Any
    #: per measured candidate (an index into the switch's order): its
    #: decision and which computed result it reads
    branches: tuple[tuple[int, Any, int], ...]
    base: int  # the computed result the float32 candidate reads
    floats: tuple[int, ...] | None  # the float operands' positions (float8)
    n_out: int


class _Switch:
    """Runs each measured site under every candidate and selects one at run
    time, by ``sel[i]`` (an index into ``order``) for the ``i``-th site: one
    compiled program measures every "this site alone at that candidate"
    variant. The walk calls it for each equation (``interpreter._step``)
    under a :class:`_SwitchPlan`; it returns ``None`` for an equation that
    is not a measured site.

    Each candidate's formulation is the one autocast runs for the site under
    a plan that gives it that candidate (``Walk.for_eqn``'s site config), so
    the selected branch computes what the per-site program computes: the
    same casts, float8 recipe and scaling; its gradient flows through the
    selection to that branch alone. Candidates whose decisions for a product
    are equal (the same :class:`~mixprec._src.autocast.request.ProductRequest`,
    which is all the product's rule reads: a float8 policy's product that the
    recipe keeps in bfloat16, and the bfloat16 policy) share one branch. The
    rest of the program runs at the plan's base, float32, where no op takes a
    product's float32 result as its epilogue (that needs a 16-bit add), so
    the other branches' results are only dropped.

    Each forward product hands its operands and every candidate's result to
    the host (``jax.debug.callback``), which keeps them only while a run
    records: the reference run, every site at float32, so that each site's
    operands are the float32 stream's. :meth:`op_measurements` then measures
    them as ``diagnose`` measures an op. (The other runs hand them over too
    and the host drops them: a ``lax.cond`` on a flag would spare that, but
    JAX drops an effect inside a ``cond`` inside a ``scan`` when it
    differentiates: measured, JAX 0.10.2.)
    """

    #: Whether candidates that decide a product alike share its branch
    #: (``benchmarks/bench_plan_cost.py`` turns it off to measure what that
    #: saves; the results are the same either way).
    shares = True

    def __init__(
        self, keys: Sequence[tuple[str, str, int]], order: Sequence[Policy], base: int
    ) -> None:
        self.index = {k: i for i, k in enumerate(keys)}
        self.by_layer: dict[tuple[str, str], list[int]] = {}
        for k, i in self.index.items():
            self.by_layer.setdefault((k[0], k[1]), []).append(i)
        self.order = tuple(order)
        self.base = base
        self.sel: Any = None  # the int32 selector, while a program is traced
        self.recording = False  # whether the run under way keeps what it hands over
        self.calls: list[tuple[_Call, list[np.ndarray]]] = []  # what it kept
        # The branches of the fused ops being run around this equation.
        self._outer: list[int] = []

    def _indices(self, walk: Any, eqn: Any) -> list[int]:
        from mixprec._src.autocast import ops

        eqns: Sequence[Any] = (eqn,)
        spec = ops.spec_for(eqn.primitive.name)
        if spec is None:
            return []
        if ops.FUSION in spec.flags:
            fusion = eqn.params.get("fusion")
            if eqn.params.get("part") == "backward":
                fusion = getattr(fusion, "backward", None)
            eqns = tuple(getattr(fusion, "eqns", ()))
        elif spec.product is None:
            return []
        found: list[int] = []
        for e in eqns:
            for k in walk.sites.get(id(e), ()):
                hit = (
                    [self.index[k]]
                    if k in self.index
                    else self.by_layer.get((k[0], k[1]), [])
                    if k[2] is None
                    else []
                )
                found += [i for i in hit if i not in found]
        return found

    def __call__(
        self, walk: Any, eqn: Any, invals: Sequence[Any], inmarks: Sequence[int]
    ) -> tuple[list[Any], list[int]] | None:
        if self.sel is None:
            return None
        found = self._indices(walk, eqn)
        if not found:
            return None
        from mixprec._src.autocast import ops
        from mixprec._src.autocast.decide import decide_eqn
        from mixprec._src.autocast.interpreter import _eqn_context, run_eqn
        from mixprec._src.autocast.walk import _site_config

        # Several sites in one op (a fused attention): the widest of theirs,
        # as `Walk.for_eqn` gives it (`order` is narrowest first).
        sel = self.sel[found[0]]
        for i in found[1:]:
            sel = jnp.maximum(sel, self.sel[i])
        spec = ops.spec_for(eqn.primitive.name)
        product = spec is not None and ops.FUSION not in spec.flags
        walks = [
            walk
            if policy == walk.config.policy
            else walk._copy(config=_site_config(walk.config, policy))
            for policy in self.order
        ]
        # A product's candidates that decide it alike run it alike: each
        # runs the first such candidate's branch (`same`).
        decisions: list[Any] = [None] * len(walks)
        same = list(range(len(walks)))
        if product:
            for b, w in enumerate(walks):
                decisions[b] = decide_eqn(w, eqn, spec, invals, inmarks)
                if self.shares:
                    same[b] = next(
                        a for a in range(b + 1) if _alike(decisions[a], decisions[b])
                    )
        runs = sorted(set(same))
        wide = walk.facts.wide
        results = {}
        for u in runs:
            on = functools.reduce(
                jnp.logical_or, [sel == b for b in range(len(walks)) if same[b] == u]
            )
            gated = [_gate(x, on) if _is_float(x) else x for x in invals]
            self._outer.append(u)
            try:
                with _eqn_context(eqn):
                    results[u] = run_eqn(walks[u], eqn, gated, inmarks)
            finally:
                self._outer.pop()
            for v in eqn.outvars:
                wide.pop(v, None)
        base_outs, base_marks = results[same[self.base]]
        pick = sel
        if len(runs) < len(walks):
            table = np.asarray([runs.index(u) for u in same], np.int32)
            pick = jnp.asarray(table)[sel]
        outs = []
        for j, ref in enumerate(base_outs):
            dtype = jnp.result_type(ref)
            branches = [
                jax.lax.convert_element_type(results[u][0][j], dtype) for u in runs
            ]
            outs.append(jax.lax.select_n(pick, *branches))
        if (
            product
            and len(found) == 1
            and not walk.backward
            and all(o == self.base for o in self._outer)
        ):
            self._record(found[0], eqn, invals, decisions, same, runs, results)
        return outs, base_marks

    def _record(
        self,
        index: int,
        eqn: Any,
        invals: Sequence[Any],
        decisions: Sequence[Any],
        same: Sequence[int],
        runs: Sequence[int],
        results: Mapping[int, tuple[list[Any], list[int]]],
    ) -> None:
        """Hands this call's operands and results to the host, which keeps
        them while a run records (``self.recording``)."""
        from mixprec._src.autocast.decide import Precision

        measured = [
            b
            for b, policy in enumerate(self.order)
            if b != self.base and runs_as(policy) != "float32"
        ]
        if not measured:
            return
        float8 = any(decisions[b].precision is Precision.FLOAT8 for b in measured)
        floats = tuple(i for i, x in enumerate(invals) if _is_float(x))
        payload = [invals[i] for i in floats] if float8 else []
        for u in runs:
            payload += results[u][0]
        call = _Call(
            index=index,
            eqn=eqn,
            branches=tuple((b, decisions[b], runs.index(same[b])) for b in measured),
            base=runs.index(same[self.base]),
            floats=floats if float8 else None,
            n_out=len(results[same[self.base]][0]),
        )

        def keep(*arrays: Any) -> None:
            if self.recording:
                self.calls.append((call, [np.array(a) for a in arrays]))

        jax.debug.callback(keep, *[jax.lax.stop_gradient(x) for x in payload])

    def op_measurements(self) -> dict[tuple[int, int], dict[str, Any]]:
        """What a recording run handed over, measured as ``diagnose``
        measures an op (:func:`~mixprec._src.numerics.diagnose.compare_output`
        on each output, :func:`~mixprec._src.numerics.diagnose._count_float8`
        on a float8 product's operands), per (site, candidate): ``op_error``
        (the largest ``local_rel_error`` over the calls), ``overflow``,
        ``underflow``, ``nonfinite``, ``flushed`` and ``quantized`` (summed
        over the calls).

        The site's operands are the float32 stream's, so the stream at the
        site is its own run: ``nonfinite`` counts what ``overflow`` counts,
        and nothing is inherited from upstream. A call whose operands and
        results repeat bitwise another call of the same traced product is
        that call recomputed (``jax.checkpoint`` runs its forward again in
        the backward pass) and counts once."""
        from mixprec._src.autocast.decide import Precision
        from mixprec._src.numerics.diagnose import (
            _count_float8,
            add_call,
            compare_output,
        )

        out: dict[tuple[int, int], dict[str, Any]] = {}
        seen: set[tuple[int, bytes]] = set()
        for call, arrays in self.calls:
            digest = hashlib.blake2b(digest_size=16)
            for x in arrays:
                digest.update(x.tobytes())
            tag = (id(call), digest.digest())
            if tag in seen:
                continue
            seen.add(tag)
            operands: list[Any] = [None] * len(call.eqn.invars)
            if call.floats is not None:
                for i, x in zip(call.floats, arrays, strict=False):
                    operands[i] = x
                arrays = arrays[len(call.floats) :]
            n = call.n_out
            results = [arrays[u * n : (u + 1) * n] for u in range(len(arrays) // n)]
            for b, decision, u in call.branches:
                m = out.setdefault(
                    (call.index, b),
                    {"op_error": 0.0, "overflow": 0, "underflow": 0, "nonfinite": 0},
                )
                found: dict[str, Any] = {}
                for a, loc in zip(results[call.base], results[u], strict=True):
                    if not _is_float(a):
                        continue
                    a64, l64 = np.asarray(a, np.float64), np.asarray(loc, np.float64)
                    add_call(found, compare_output(a64, l64, l64))
                if decision.precision is Precision.FLOAT8:
                    found.update(_count_float8(call.eqn, decision, operands))
                m["op_error"] = max(m["op_error"], found.get("local_rel_error", 0.0))
                for name in (
                    "overflow",
                    "underflow",
                    "nonfinite",
                    "flushed",
                    "quantized",
                ):
                    m[name] = m.get(name, 0) + int(found.get(name, 0))
        return out


def _alike(a: Any, b: Any) -> bool:
    """Whether two decisions run a product alike: its rule reads only the
    request (``rules/products.py``)."""
    return a.precision == b.precision and (
        a is b or (a.request is not None and a.request == b.request)
    )


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


@jax.custom_vjp
def _gate(x: Any, on: Any) -> Any:
    """``x``; its cotangent passes only where ``on`` (a branch not selected
    gets a zero cotangent, so its backward's ``0 * inf`` of a float16
    overflow cannot reach the gradients as a NaN)."""
    del on
    return x


def _gate_fwd(x: Any, on: Any) -> tuple[Any, Any]:
    return x, on


def _gate_bwd(on: Any, ct: Any) -> tuple[Any, None]:
    return jnp.where(on, ct, jnp.zeros_like(ct)), None


_gate.defvjp(_gate_fwd, _gate_bwd)


def _per_site(
    loss_fn: Callable[..., Any],
    keys: Sequence[tuple[str, str, int]],
    float32: str,
    argnums: Any,
    loss_scale: float | None,
    mode: str,
) -> Callable[..., Any]:
    """What :func:`_switched` computes, one compiled program per choice
    (``record`` adds ``None``: these programs measure no op; ``diagnose``
    does)."""
    from mixprec._src.autocast.api import autocast

    def run(choice: Sequence[str], *args: Any, record: bool = False) -> Any:
        sites = tuple(
            Site(*k, policy=c)
            for k, c in zip(keys, choice, strict=True)
            if runs_as(c) != "float32"
        )
        fn = autocast(loss_fn, Plan(get_policy(float32), sites=sites), mode=mode)
        out = _value_and_grad(fn, argnums, loss_scale)(*args)
        return (*out, None) if record else out

    return run


class _SwitchPlan(Plan):
    """A float32 plan whose sites' policies :class:`_Switch` selects at run
    time. Compared by identity: its programs close over one trace's
    selector."""

    def __init__(self, base: Policy, switch: _Switch) -> None:
        super().__init__(base)
        object.__setattr__(self, "switch", switch)

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)


def _switched(
    loss_fn: Callable[..., Any],
    keys: Sequence[tuple[str, str, int]],
    names: Sequence[str],
    float32: str,
    argnums: Any,
    loss_scale: float | None,
    mode: str,
) -> Callable[..., Any]:
    """The loss and gradients of ``loss_fn`` with site ``keys[i]`` at
    ``names[choice[i]]``, compiled once for every ``choice``: ``run(choice,
    *args)``. ``run(choice, *args, record=True)`` (every site at float32)
    adds each site's op measurements under each candidate that does not run
    in float32, ``{(key, candidate): {"op_error": ..., ...}}``
    (:meth:`_Switch.op_measurements`)."""
    from mixprec._src.autocast.api import autocast

    order = sorted(
        dict.fromkeys(names), key=lambda c: (policy_rank(get_policy(c)), names.index(c))
    )
    base = get_policy(float32)
    switch = _Switch(keys, [get_policy(c) for c in order], order.index(float32))
    fn = autocast(loss_fn, _SwitchPlan(base, switch), mode=mode)
    scale = 1.0 if loss_scale is None else float(loss_scale)

    def scaled(*a: Any) -> Any:
        return jnp.asarray(fn(*a), jnp.float32) * scale

    def measure(sel: Any, *a: Any) -> Any:
        switch.sel = sel
        try:
            return jax.value_and_grad(scaled, argnums)(*a)
        finally:
            switch.sel = None

    step = jax.jit(measure)

    def run(choice: Sequence[str], *args: Any, record: bool = False) -> Any:
        sel = np.asarray([order.index(c) for c in choice], np.int32)
        switch.calls.clear()
        switch.recording = record
        try:
            loss, grads = step(sel, *args)
            out = (
                np.asarray(loss, np.float64) / scale,
                [g / scale for g in _leaves(grads)],
            )
            jax.effects_barrier()
        finally:
            switch.recording = False
        if not record:
            return out
        found = switch.op_measurements()
        switch.calls.clear()
        ops = {(keys[i], order[b]): m for (i, b), m in found.items()}
        return (*out, ops)

    return run


def _diagnosed(
    loss_fn: Callable[..., Any],
    args: tuple[Any, ...],
    names: Sequence[str],
    found: Mapping[tuple[str, str, int], _Found],
    mode: str,
) -> dict[tuple[tuple[str, str, int], str], dict[str, Any]]:
    """The op measurements :func:`_switched` records, from one ``diagnose``
    run per candidate instead (every op at the candidate, each compared on
    float32 inputs): for the per-site programs, which record none."""
    from mixprec._src.numerics.diagnose import diagnose

    ops: dict[tuple[tuple[str, str, int], str], dict[str, Any]] = {}
    for c in names:
        if runs_as(c) == "float32":
            continue
        diag = diagnose(
            loss_fn, *args, policy=Plan(get_policy(c)), mode=mode, refine=False
        )
        for op in diag.ops:
            if op.site is None or op.backward or op.site[2] is None:
                continue
            key = (op.site[0], op.site[1], int(op.site[2]))
            if key not in found:
                continue
            m = ops.setdefault((key, c), {})
            m["op_error"] = max(m.get("op_error", 0.0), op.local_rel_error)
            for name in ("overflow", "underflow", "nonfinite", "flushed", "quantized"):
                m[name] = m.get(name, 0) + int(getattr(op, name, 0) or 0)
    return ops


def _json_number(x: float) -> float | None:
    return None if not math.isfinite(x) else float(x)


def plan(
    loss_fn: Callable[..., Any],
    *args: Any,
    candidates: Sequence[str] = ("mixed_float8", "mixed_bfloat16", "float32"),
    tolerance: float = DEFAULT_TOLERANCE,
    platform: str = "h100",
    base: Policy | str | None = None,
    argnums: int | Sequence[int] = 0,
    loss_scale: float | None = None,
    mode: str = "allow_mix_precision",
) -> Plan:
    """Measure each matmul site of ``loss_fn`` under each candidate policy and
    choose, per site, the cheapest candidate within ``tolerance``.

    See the module docs for what is measured. The effect of a candidate at a
    site is measured with that site alone at the candidate and the rest of
    the program in float32. A site inside a ``lax.scan`` body is one site for
    all its iterations.

    Args:
        loss_fn: a function of ``*args`` returning a scalar loss.
        *args: example arguments (the parameters first, as for
            ``jax.grad``).
        candidates: the policies to choose from (policy strings). ``"float32"``
            is added if missing: a site no candidate suits stays float32.
        tolerance: the largest effect a site may have (relative, see
            :data:`DEFAULT_TOLERANCE` for the reasoning behind the default).
        platform: whose throughput prices the candidates (a key of
            :data:`THROUGHPUT`: ``"h100"``, ``"cpu"``).
        base: the policy of every op that is not a matmul site (default: the
            first candidate without float8, ``mixed_bfloat16`` for the default
            candidates).
        argnums: which arguments the gradients are taken with respect to.
        loss_scale: a loss scale for the gradient runs (float16 candidates):
            the loss is multiplied by it before differentiating and the
            gradients divided after.
        mode: the precision mode the candidates run in.

    Returns:
        A :class:`mixprec.Plan`; ``print(plan)`` shows one row per site and
        the estimated speed-up.

    Raises:
        ValueError: an unknown candidate policy or platform, or a
            non-positive ``tolerance``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import mixprec
        >>> def loss(w, x):
        ...     with jax.named_scope("hidden"):
        ...         h = jnp.tanh(x @ w["a"])
        ...     with jax.named_scope("out"):
        ...         return jnp.mean((h @ w["b"]) ** 2)
        >>> k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
        >>> w = {"a": jax.random.normal(k1, (256, 256)) / 16,
        ...      "b": jax.random.normal(k2, (256, 256)) / 16}
        >>> x = jax.random.normal(k3, (128, 256))
        >>> p = mixprec.plan(loss, w, x)
        >>> [(s.layer, s.policy) for s in p.sites]
        [('hidden', 'mixed_float8'), ('out', 'mixed_float8')]
    """
    from mixprec._src.numerics.explain import explain

    if not isinstance(tolerance, int | float) or not tolerance > 0:
        raise ValueError(
            f"`mixprec.plan(..., tolerance=...)` must be a positive number, got "
            f"{tolerance!r}."
        )
    table = _throughput(platform)
    names = [str(c) for c in candidates]
    for c in names:
        try:
            get_policy(c)
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"`mixprec.plan(..., candidates=...)`: unknown policy {c!r}: {e}"
            ) from None
    if not any(runs_as(c) == "float32" for c in names):
        names.append("float32")
    if base is None:
        first = next(c for c in names)
        base_policy = get_policy(first).with_float8(None)
    else:
        base_policy = get_policy(base)

    # The sites, and what each candidate runs them as.
    found: dict[tuple[str, str, int], _Found] = {}
    for c in names:
        empty = Plan(get_policy(c))
        report = explain(loss_fn, *args, policy=empty, mode=mode)
        for op in report.ops:
            if op.site is None or op.backward or op.site[2] is None:
                continue
            key = (op.site[0], op.site[1], int(op.site[2]))
            f = found.setdefault(key, _Found(key, source=op.call_site or op.source))
            if c == names[0]:
                f.flops += op.flops
            runs = {"float8": "float8", "low": str(op.dtype)}.get(op.decision)
            f.runs[c] = runs if runs in _RUNS else "float32"

    # The effect of each site alone at each candidate: one program, compiled
    # once, in which each site's candidate is an argument (`_Switch`); the
    # reference is the same program with every site at float32, and it also
    # hands each site's operands and candidates' results to the host, where
    # they are measured as `diagnose` measures an op.
    float32 = next(c for c in names if runs_as(c) == "float32")
    keys = list(found)
    alone = _switched(loss_fn, keys, names, float32, argnums, loss_scale, mode)
    try:
        loss32, grads32, ops = alone([float32] * len(keys), *args, record=True)
    except (TypeError, jax.errors.UnexpectedTracerError):
        # A body autocast re-traces as its own program (a `jax.jit` called
        # inside the loss) closes over the selector, which such a program
        # cannot take (JAX: "No constant handler for type: ...Tracer"): one
        # program per measurement instead.
        alone = _per_site(loss_fn, keys, float32, argnums, loss_scale, mode)
        loss32, grads32, ops = alone([float32] * len(keys), *args, record=True)
    ref = (loss32, grads32)
    missing = [
        c
        for c in names
        if runs_as(c) != "float32" and any((key, c) not in (ops or {}) for key in found)
    ]
    if missing:
        # The per-site programs record nothing; and a product the one
        # program never reaches with float32 operands (one that only runs
        # inside a fused op's 16-bit branch) is measured by `diagnose`.
        diagnosed = _diagnosed(loss_fn, args, missing, found, mode)
        ops = {**diagnosed, **(ops or {})}
    for (key, c), m in ops.items():
        found[key].measured.setdefault(c, {}).update(m)
    for pos, f in enumerate(found.values()):
        for c in names:
            m = f.measured.setdefault(c, {})
            m["runs_as"] = f.runs.get(c, runs_as(c))
            if m["runs_as"] == "float32":
                m.update(loss_error=0.0, grad_error=0.0, effect=0.0)
                continue
            # A candidate that runs this site as another candidate does (a
            # float8 policy's product its recipe keeps in bfloat16) runs the
            # same program: its measurement is that one's.
            same = next(
                (
                    o
                    for o in names[: names.index(c)] + names[names.index(c) + 1 :]
                    if f.measured.get(o, {}).get("runs_as") == m["runs_as"]
                    and "effect" in f.measured[o]
                ),
                None,
            )
            if same is not None:
                for name in ("loss_error", "grad_error", "effect"):
                    m[name] = f.measured[same][name]
                continue
            choice = [float32] * len(keys)
            choice[pos] = c
            loss_error, grad_error = _effects(ref, alone(choice, *args))
            m["loss_error"] = _json_number(loss_error)
            m["grad_error"] = _json_number(grad_error)
            m["effect"] = _json_number(max(loss_error, grad_error))

    def cost(f: _Found, c: str) -> tuple[Any, ...]:
        # The cheapest; among equally cheap ones, one that runs the site as
        # its name says (not a float8 policy whose recipe keeps it 16-bit),
        # then the widest (float16 costs float32's on a CPU: float32).
        return (
            f.flops / table[f.runs.get(c, runs_as(c))],
            f.runs.get(c, runs_as(c)) != runs_as(c),
            tuple(-r for r in policy_rank(get_policy(c))),
            names.index(c),
        )

    ok = {
        k: [c for c in names if _passes(f.measured.get(c, {}), tolerance)]
        for k, f in found.items()
    }
    choice = {k: min(ok[k], key=lambda c, f=f: cost(f, c)) for k, f in found.items()}
    combined = _combined(
        found, ok, choice, cost, lambda ch: _effects(ref, alone(ch, *args)), tolerance
    )
    sites = [
        Site(
            *key,
            policy=choice[key],
            chosen=choice[key],
            source=f.source,
            flops=f.flops,
            measured=tuple((c, tuple(sorted(f.measured[c].items()))) for c in names),
        )
        for key, f in found.items()
    ]
    return Plan(
        base_policy,
        sites=tuple(sites),
        platform=platform,
        tolerance=float(tolerance),
        candidates=tuple(names),
        combined=combined,
    )


def _combined(
    found: Mapping[tuple[str, str, int], _Found],
    ok: Mapping[tuple[str, str, int], list[str]],
    choice: dict[tuple[str, str, int], str],
    cost: Callable[[_Found, str], Any],
    measure: Callable[[list[str]], tuple[float, float]],
    tolerance: float,
) -> dict[str, Any]:
    """Checks the chosen sites together (the rest of the program in float32)
    and, while their effect exceeds ``tolerance``, raises the site whose own
    effect at its policy is the largest to the cheapest wider candidate that
    passed alone (float32 at the end). Edits ``choice``; returns what
    ``Plan.combined`` keeps."""
    keys = list(found)
    raised: list[list[Any]] = []

    def wider(k: tuple[str, str, int]) -> list[str]:
        rank = policy_rank(get_policy(choice[k]))
        return [c for c in ok[k] if policy_rank(get_policy(c)) > rank]

    def own(k: tuple[str, str, int]) -> float:
        e = found[k].measured.get(choice[k], {}).get("effect")
        return math.inf if e is None else float(e)

    first: float | None = None
    while True:
        loss_error, grad_error = measure([choice[k] for k in keys])
        effect = max(loss_error, grad_error)
        if first is None:
            first = effect
        passed = effect <= tolerance
        movable = [k for k in keys if wider(k)]
        if passed or not movable:
            break
        k = max(movable, key=lambda k: (own(k), found[k].flops))
        to = min(wider(k), key=lambda c: cost(found[k], c))
        raised.append([*k, choice[k], to])
        choice[k] = to
    return {
        "loss_error": _json_number(loss_error),
        "grad_error": _json_number(grad_error),
        "effect": _json_number(effect),
        "first_effect": _json_number(first),
        "passed": bool(passed),
        "raised": raised,
    }


def _passes(m: Mapping[str, Any], tolerance: float) -> bool:
    if m.get("runs_as") == "float32":
        return True
    effect = m.get("effect")
    if effect is None or not effect <= tolerance:
        return False
    return not (m.get("overflow") or m.get("nonfinite"))


# ------------------------------------------------------------------ showing


def flop_shares(p: Plan) -> dict[str, float]:
    """The share of the sites' FLOPs that runs in each dtype under ``p``."""
    total = sum(s.flops for s in p.sites)
    shares: dict[str, float] = {}
    for s in p.sites:
        runs = _site_runs_as(s, s.policy)
        shares[runs] = shares.get(runs, 0.0) + s.flops
    return {k: v / total for k, v in shares.items()} if total else {}


def speedup(p: Plan, platform: str | None = None) -> float | None:
    """The estimated speed-up of the sites' matmul time under ``p`` against
    all of them in bfloat16 on ``platform`` (the plan's by default); ``None``
    without FLOPs. Backward products follow their site, so the forward FLOPs
    weigh each site."""
    table = _throughput(platform or p.platform or "h100")
    plan_time = sum(s.flops / table[_site_runs_as(s, s.policy)] for s in p.sites)
    bf16_time = sum(s.flops / table["bfloat16"] for s in p.sites)
    if not plan_time:
        return None
    return bf16_time / plan_time


def _fmt(x: Any) -> str:
    if x is None:
        return "inf"
    if isinstance(x, float):
        return f"{x:.2g}"
    return str(x)


def _combined_line(c: Mapping[str, Any], tolerance: float | None) -> str:
    def num(name: str) -> str:
        return _fmt(c.get(name))

    text = (
        f"all sites together (the rest in float32): effect {num('effect')} "
        f"(loss {num('loss_error')}, gradients {num('grad_error')})"
    )
    raised = list(c.get("raised", ()))
    if raised:
        text += (
            f"; {num('first_effect')} as first chosen, over the tolerance, so "
            f"{len(raised)} site(s) were raised, largest own effect first (raised)"
        )
    if c.get("passed"):
        return text + f": within tolerance {_fmt(tolerance)}"
    return text + f": OVER the tolerance {_fmt(tolerance)} with every site at float32"


def render_plan(p: Plan) -> str:
    """The text ``print(plan)`` shows."""
    from mixprec._src.numerics.record import short_source
    from mixprec._src.numerics.render import fmt_flops, render_table

    cands = list(p.candidates)
    head = ["layer", "op", "#", "source", "FLOPs"]
    head += [f"effect {c}" for c in cands] + ["policy"]
    rows = []
    combined = dict(p.combined)
    raised = {tuple(r[:3]): r for r in combined.get("raised", ())}
    for s in p.sites:
        m = s.measurements()
        row = [
            s.layer or "-",
            s.op,
            str(s.index),
            short_source(s.source),
            fmt_flops(s.flops),
        ]
        for c in cands:
            mc = m.get(c)
            if mc is None:
                row.append("")
                continue
            text = _fmt(mc.get("effect"))
            if mc.get("runs_as") != runs_as(c):
                text += f" ({mc.get('runs_as')})"
            row.append(text)
        mark = " (by hand)" if s.overridden else "" if s.chosen else " (written)"
        if s.key in raised and not s.overridden:
            mark += " (raised)"
        row.append(s.policy + mark)
        rows.append(row)
    title = f"Plan: base {p.base}, {len(p.sites)} sites, {len(p.rules)} rules"
    if p.tolerance is not None:
        title += f", tolerance {p.tolerance:g}"
    lines = [title]
    if rows:
        lines = [render_table(title, head, rows, use_rich=False)]
    for i, r in enumerate(p.rules):
        ops = ",".join(r.ops) or "all products"
        lines.append(f"rule {i}: layers {r.layers!r} ops {ops} -> {r.policy}")
    if combined:
        lines.append(_combined_line(combined, p.tolerance))
    shares = flop_shares(p)
    if shares:
        lines.append(
            "FLOPs by dtype: "
            + ", ".join(f"{k} {v:.1%}" for k, v in sorted(shares.items()))
        )
    platform = p.platform or "h100"
    up = speedup(p, platform)
    if up is not None:
        lines.append(
            f"estimated speed-up of the sites' matmul time vs all-bfloat16 on "
            f"{platform}: {up:.2f}x (their FLOPs over the THROUGHPUT table)"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------ diagnose's plan


def _raised(policy: Policy) -> Policy:
    """One step wider: float8 -> its 16-bit compute dtype -> float32."""
    if policy.float8 is not None:
        return policy.with_float8(None)
    return Policy(policy.param_dtype, np.float32, policy.output_dtype)


def broken_sites(
    sites: Sequence[Any], tolerance: float
) -> set[tuple[str, str, int | None]]:
    """The plan sites (``OpDiagnosis.site``) of the products that broke in a
    diagnose run: those :func:`~mixprec._src.numerics.advice.problem_sites`
    names, and the float8 products (forward or backward) that overflow, turn
    non-finite, or flush more than ``tolerance`` of the values they quantize
    to zero."""
    from mixprec._src.numerics.advice import problem_sites

    found = {s.site for s in problem_sites(sites, tolerance) if s.site is not None}
    for s in sites:
        if s.site is None or s.decision != "float8":
            continue
        quantized = max(int(s.quantized or 0), 1)
        if s.overflow or s.nonfinite or s.flushed / quantized > tolerance:
            found.add(s.site)
    return found


def suggest_plan(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    sites: Sequence[Any],
    config: Any,
    *,
    tolerance: float,
    max_loop_steps: int,
    refine: bool,
    max_rounds: int = 3,
) -> tuple[Plan | None, bool | None]:
    """``diagnose``'s fix as a plan: every matmul site at the precision it ran
    in, the ones that broke one step wider (float8 -> 16-bit -> float32);
    with ``refine``, re-run and raised again until none breaks. Returns the
    plan (``None`` without matmul sites) and whether the last run was free of
    broken sites (``None``: not re-run)."""
    from mixprec._src.autocast.config import make_config
    from mixprec._src.numerics.diagnose import _evaluate

    given = config.plan
    base = config.policy if given is None else given.base
    keys = list(
        dict.fromkeys(  # in program order
            (s.site[0], s.site[1], int(s.site[2]))
            for s in sites
            if s.site is not None and s.site[2] is not None and not s.backward
        )
    )
    if not keys:
        return None, None

    def current(p: Plan | None, key: tuple[str, str, int]) -> Policy:
        return p.policy_for(*key) if p is not None else base

    policies = {k: current(given, k) for k in keys}
    seen: dict[tuple[str, str, int], tuple[str, int]] = {}
    for s in sites:
        if s.site is not None and s.site[2] is not None and not s.backward:
            key = (s.site[0], s.site[1], int(s.site[2]))
            source, flops = seen.get(key, (s.source, 0))
            seen[key] = (source, flops + int(s.flops))
    broken = broken_sites(sites, tolerance)
    verified: bool | None = None
    for round_ in range(max_rounds + 1):
        hit = {
            k
            for k in keys
            if (k in broken or (k[0], k[1], None) in broken)
            and runs_as(policies[k]) != "float32"
        }
        if not hit:
            verified = True  # the last run (the first, or a re-run) is clean
            break
        for k in hit:
            policies[k] = _raised(policies[k])
        if not refine or round_ == max_rounds:
            verified = False if refine else None
            break
        trial = _as_plan(base, keys, policies, given, seen)
        cfg = make_config(trial, mode=config.mode, lists=config.lists).resolved()
        ev, _, _ = _evaluate(fn, args, cfg, max_loop_steps)
        broken = broken_sites(list(ev.sites.values()), tolerance)
    return _as_plan(base, keys, policies, given, seen), verified


def _as_plan(
    base: Policy,
    keys: Sequence[tuple[str, str, int]],
    policies: Mapping[tuple[str, str, int], Policy],
    given: Plan | None,
    seen: Mapping[tuple[str, str, int], tuple[str, int]],
) -> Plan:
    sites = tuple(
        Site(
            *k,
            policy=str(policies[k]),
            chosen=str(policies[k]),
            source=seen.get(k, ("", 0))[0],
            flops=seen.get(k, ("", 0))[1],
        )
        for k in keys
    )
    rules = () if given is None else given.rules
    return Plan(base, sites=sites, rules=rules)
