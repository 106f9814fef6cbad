"""Numerics diagnosis: which op breaks in half precision, and what to do about it.

``mixprec.diagnose(fn, *args, policy=...)`` runs ``fn`` twice side by side, equation
by equation: once exactly as written in float32 (the reference stream) and once
through the autocast interpreter (the mixed stream, the same ``apply_eqn`` that
:func:`mixprec.autocast` uses). Higher-order primitives are entered with concrete
values: ``jit``, ``checkpoint``, ``custom_jvp`` and ``custom_vjp`` are evaluated
inline (their primal), ``scan`` and ``while_loop`` step by step, ``cond`` on the
branch it takes.

For every op it measures, on the op's outputs:

* **overflow**: finite float32 values that become ``inf``/``nan`` when the op runs
  as autocast runs it, fed with the *exact* (float32-stream) inputs cast to the
  dtypes the mixed stream has. Feeding exact inputs attributes each problem to the
  op that causes it rather than to every op downstream of it.
* **underflow**: non-zero float32 values that flush to zero in the same local run.
* **cast overflow / underflow**: input values that overflow or flush to zero when
  the op casts its float32 inputs down to the low dtype.
* **nonfinite**: non-finite values of the mixed stream where float32 is finite
  (propagated problems included); the first op where this happens is reported.
* **relative error** of the mixed stream against float32 (``‖b-a‖/‖a‖`` over the
  positions where both are finite), and of the local run.

It ends with advice: the ops to move to the black list, as a ``modify_mixlist`` dict
ready for ``mixprec.autocast(..., mixlist=...)``; a suggested initial loss scale
from the gradient magnitudes seen (backward-pass equations are the ones JAX names
``transpose(...)``); and the tensor-core alignment lint of low-precision dots/convs.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core, source_info_util

from ._compat import is_tracer
from .autocast import interpreter
from .autocast.modes import decide
from .autocast.op_lists import composite_for
from .autocast.rules import dtype_of
from .explain import (
    AlignmentIssue,
    eqn_flops,
    eqn_source,
    float32_args,
    fmt_dtypes,
    hop_name,
    is_backward,
    lint_eqn,
    parse_source,
    render_table,
    rich_table,
    short_source,
    sub_jaxprs,
)


__all__ = ["DiagnosisReport", "OpDiagnosis", "diagnose"]

_F32 = np.dtype(np.float32)
_FLOAT16_MAX = 65504.0
_FLOAT16_TINY = 2.0**-14  # smallest normal float16 (6.1e-5)
_MAX_LOSS_SCALE = 2.0**24

# Higher-order primitives entered with concrete values.
_INLINE = frozenset(
    {
        "jit",
        "pjit",
        "closed_call",
        "core_call",
        "remat2",
        "checkpoint",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
    }
)
_LOOPS = frozenset({"scan", "while", "cond"})


# --------------------------------------------------------------------------------------
# Results.
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OpDiagnosis:
    """Float32 vs mixed precision numerics of one op (summed over loop iterations).

    Attributes:
      index: position in evaluation order (first evaluation).
      primitive: primitive name, or composite name when autocast treats a nested
        function as one op (``"softmax"``).
      source: user source ``"file.py:LINE (function)"``, or ``""``.
      path: nesting through higher-order primitives (``"jit(f)/scan/body"``).
      backward: the op belongs to a backward pass (``transpose(...)``).
      f32_dtypes: output dtypes in the float32 run.
      in_dtypes: the dtypes the op runs with in the mixed run (after its casts).
      out_dtypes: output dtypes in the mixed run.
      decision: ``"low"``, ``"float32"`` or ``"original"``.
      dtype: the dtype autocast casts the op's floating inputs to (or ``None``).
      op_class: the op's list class.
      reason: why autocast decided so.
      calls: how many times the op ran (loop bodies run many times).
      elements: floating output elements, summed over calls.
      overflow: finite float32 outputs that become inf/nan in this op's own
        low-precision run (exact inputs).
      underflow: non-zero float32 outputs that become zero in that run.
      cast_overflow: inputs that overflow when cast to the op's low dtype.
      cast_underflow: non-zero inputs that flush to zero when cast.
      nonfinite: non-finite outputs of the mixed stream where float32 is finite.
      rel_error: largest relative error of the mixed stream vs float32.
      local_rel_error: largest relative error of the op's own low-precision run.
      max_abs: largest finite float32 output magnitude.
      min_abs: smallest non-zero float32 output magnitude (``inf`` if none).
      flops: FLOPs of one call.
    """

    index: int
    primitive: str
    source: str
    path: str
    backward: bool
    f32_dtypes: tuple[str, ...]
    in_dtypes: tuple[str, ...]
    out_dtypes: tuple[str, ...]
    decision: str
    dtype: str | None
    op_class: str
    reason: str
    calls: int
    elements: int
    overflow: int
    underflow: int
    cast_overflow: int
    cast_underflow: int
    nonfinite: int
    rel_error: float
    local_rel_error: float
    max_abs: float
    min_abs: float
    flops: int

    @property
    def line(self) -> int | None:
        """The user source line number, or ``None``."""
        return parse_source(self.source)[1]

    @property
    def problems(self) -> tuple[str, ...]:
        """Names of the problems seen (``"overflow"``, ``"underflow"``, ...)."""
        names = ("overflow", "underflow", "cast_overflow", "cast_underflow")
        found = tuple(n for n in names if getattr(self, n))
        if self.nonfinite and not found:
            found += ("nonfinite",)
        return found

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (``inf`` becomes ``None``)."""
        d = dataclasses.asdict(self)
        for key in ("f32_dtypes", "in_dtypes", "out_dtypes"):
            d[key] = list(d[key])
        for key in ("rel_error", "local_rel_error", "max_abs", "min_abs"):
            d[key] = _json_float(d[key])
        d["line"] = self.line
        d["problems"] = list(self.problems)
        return d


def _json_float(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


@dataclasses.dataclass(frozen=True)
class DiagnosisReport:
    """Where half precision breaks a function, and what to change.

    Returned by :func:`mixprec.diagnose`. ``str(report)`` gives the summary, the
    table of ops with problems and the advice; ``report.table(only_problems=False)``
    shows every op; ``report.to_dict()``/``report.to_json()`` the machine form.

    Attributes:
      ops: one :class:`OpDiagnosis` per op site, in evaluation order.
      policy: the policy, as a string.
      mode: the precision mode.
      low_dtype: the low-precision dtype.
      mixlist: the ``modify_mixlist`` spec the run used (as a dict), if any.
      loss_scale: the loss scale the gradient was diagnosed at (``None`` if ``fn``
        was diagnosed as given).
      first_nonfinite: index into ``ops`` of the first op whose mixed output has a
        non-finite value where float32 is finite, or ``None``.
      first_f32_nonfinite: index of the first op whose float32 output is already
        non-finite (the function misbehaves in float32 too), or ``None``.
      output_rel_error: relative error of each output leaf against float32.
      output_nonfinite: non-finite values of each mixed output leaf where the
        float32 output is finite.
      to_black_list: op names the advice moves to the black list.
      suggested_mixlist: ``mixlist`` (user spec plus advice) to pass back to
        autocast; ``{}`` when nothing needs to change and no spec was given.
      advice_verified: whether a re-run with ``suggested_mixlist`` is free of
        the problems that led to it (``None``: nothing suggested, or not
        checked).
      suggested_loss_scale: a power of two, or ``None`` when no backward pass was
        seen or the low dtype does not need loss scaling (bfloat16).
      gradient_range: ``(smallest, largest)`` non-zero magnitude of the
        backward-pass values, unscaled, or ``None``.
      alignment: tensor-core alignment issues of low-precision dots/convs.
      notes: anything the reader should know (diverging branches, capped loops).

    Examples:
      >>> import jax.numpy as jnp
      >>> import mixprec
      >>> def f(w, x):
      ...     h = x @ w
      ...     return h * h          # (1e-5) ** 2 = 1e-10 flushes to 0 in float16
      >>> report = mixprec.diagnose(f, jnp.eye(8), jnp.full((8, 8), 1e-5),
      ...                           policy="mixed_float16")
      >>> [(op.primitive, op.underflow) for op in report.problems]
      [('mul', 64)]
      >>> report.to_dict()["suggested_mixlist"]
      {'black-list': {'to-add': ['mul']}}
    """

    ops: tuple[OpDiagnosis, ...]
    policy: str
    mode: str
    low_dtype: str
    mixlist: Mapping[str, Any] | None
    loss_scale: float | None
    first_nonfinite: int | None
    first_f32_nonfinite: int | None
    output_rel_error: tuple[float, ...]
    output_nonfinite: tuple[int, ...]
    to_black_list: tuple[str, ...]
    suggested_mixlist: Mapping[str, Any]
    advice_verified: bool | None
    suggested_loss_scale: float | None
    gradient_range: tuple[float, float] | None
    alignment: tuple[AlignmentIssue, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def problems(self) -> tuple[OpDiagnosis, ...]:
        """The ops with overflow, underflow or non-finite values."""
        return tuple(op for op in self.ops if op.problems)

    @property
    def ok(self) -> bool:
        """No overflow, underflow or non-finite value anywhere."""
        return not self.problems

    @property
    def first_nonfinite_op(self) -> OpDiagnosis | None:
        """The op where the first NaN/inf of the mixed run appears."""
        return None if self.first_nonfinite is None else self.ops[self.first_nonfinite]

    def find(self, primitive: str) -> list[OpDiagnosis]:
        """The ops with this primitive (or composite) name."""
        return [op for op in self.ops if op.primitive == primitive]

    def summary(self) -> str:
        """A few lines: what was run, what went wrong first."""
        n_over = sum(op.overflow + op.cast_overflow for op in self.ops)
        n_under = sum(op.underflow + op.cast_underflow for op in self.ops)
        lines = [
            f"policy {self.policy}, mode {self.mode}: {len(self.ops)} ops, "
            f"{len(self.problems)} with problems "
            f"(overflow {n_over}, underflow {n_under})"
        ]
        if self.loss_scale is not None:
            lines.append(f"gradient diagnosed at loss scale {self.loss_scale:g}")
        op = self.first_nonfinite_op
        if op is not None:
            lines.append(
                f"first NaN/inf: {op.primitive} at {op.source or '<unknown>'}"
                + (f" [{op.path}]" if op.path else "")
            )
        if self.first_f32_nonfinite is not None:
            ref = self.ops[self.first_f32_nonfinite]
            lines.append(
                f"note: float32 itself is non-finite from {ref.primitive} at "
                f"{ref.source or '<unknown>'}"
            )
        if self.output_rel_error:
            errs = ", ".join(f"{e:.2e}" for e in self.output_rel_error)
            lines.append(f"output relative error vs float32: {errs}")
        return "\n".join(lines)

    def advice(self) -> str:
        """What to change: black-list ops (as a mixlist), loss scale, alignment."""
        lines = []
        if self.to_black_list:
            lines.append(
                "Run in float32 (move to the black list): "
                + ", ".join(self.to_black_list)
            )
            lines.append(
                "  mixprec.autocast(fn, policy, mixlist="
                + json.dumps(dict(self.suggested_mixlist))
                + ")"
            )
            if self.advice_verified is not None:
                left = "no problem left" if self.advice_verified else "problems remain"
                lines.append(f"  (re-run with this mixlist: {left})")
        if self.suggested_loss_scale is not None:
            text = f"Suggested initial loss scale: {self.suggested_loss_scale:g}"
            exp = math.log2(self.suggested_loss_scale)
            if exp == int(exp):
                text += f" (2**{int(exp)})"
            if self.gradient_range is not None:
                lo, hi = self.gradient_range
                text += f"; gradient magnitudes seen {lo:.2e} .. {hi:.2e}"
            lines.append(text)
        if self.alignment:
            lines.append("Tensor-core alignment:")
            lines.extend("  " + issue.message() for issue in self.alignment)
        lines.extend(f"Note: {n}" for n in self.notes)
        return "\n".join(lines) if lines else "No problems found."

    _COLUMNS = (
        "#",
        "op",
        "source",
        "path",
        "in",
        "out",
        "calls",
        "overflow",
        "underflow",
        "nonfinite",
        "rel err",
        "note",
    )

    def _rows(self, ops: Sequence[OpDiagnosis]) -> list[list[str]]:
        rows = []
        for op in ops:
            note = []
            if op.index == self.first_nonfinite:
                note.append("first NaN/inf")
            if op.cast_overflow or op.cast_underflow:
                note.append(f"cast: {op.cast_overflow} inf, {op.cast_underflow} zero")
            if op.backward:
                note.append("backward")
            rows.append(
                [
                    str(op.index),
                    op.primitive,
                    short_source(op.source),
                    op.path,
                    fmt_dtypes(op.in_dtypes),
                    fmt_dtypes(op.out_dtypes),
                    str(op.calls),
                    str(op.overflow),
                    str(op.underflow),
                    str(op.nonfinite),
                    f"{op.rel_error:.1e}",
                    "; ".join(note),
                ]
            )
        return rows

    def table(
        self,
        *,
        only_problems: bool = True,
        use_rich: bool | None = None,
        max_rows: int | None = None,
        width: int | None = None,
    ) -> str:
        """The ops as a table.

        Args:
          only_problems: show only ops with overflow/underflow/non-finite values.
          use_rich: render with rich; default: when rich is installed.
          max_rows: show at most this many rows.
          width: console width for rich (default 160).

        Returns:
          The rendered table.
        """
        ops = self.problems if only_problems else self.ops
        shown = ops if max_rows is None else ops[:max_rows]
        caption = None
        if len(shown) < len(ops):
            caption = f"({len(ops) - len(shown)} more not shown)"
        styles = [
            "bold red" if op.index == self.first_nonfinite else None for op in shown
        ]
        title = "mixprec.diagnose" + (" (ops with problems)" if only_problems else "")
        if not shown:
            return title + ": no op overflows, underflows or turns non-finite."
        return render_table(
            title,
            self._COLUMNS,
            self._rows(shown),
            use_rich=use_rich,
            width=width,
            styles=styles,
            caption=caption,
        )

    def __str__(self) -> str:
        return "\n".join(
            [self.summary(), self.table(use_rich=False), "Advice:", self.advice()]
        )

    def __rich__(self) -> Any:
        return rich_table(
            "mixprec.diagnose", self._COLUMNS, self._rows(self.ops), caption=None
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of the whole report."""
        return {
            "policy": self.policy,
            "mode": self.mode,
            "low_dtype": self.low_dtype,
            "mixlist": None if self.mixlist is None else dict(self.mixlist),
            "loss_scale": self.loss_scale,
            "first_nonfinite": self.first_nonfinite,
            "first_f32_nonfinite": self.first_f32_nonfinite,
            "output_rel_error": [_json_float(e) for e in self.output_rel_error],
            "output_nonfinite": list(self.output_nonfinite),
            "to_black_list": list(self.to_black_list),
            "suggested_mixlist": dict(self.suggested_mixlist),
            "advice_verified": self.advice_verified,
            "suggested_loss_scale": self.suggested_loss_scale,
            "gradient_range": None
            if self.gradient_range is None
            else list(self.gradient_range),
            "alignment": [issue.to_dict() for issue in self.alignment],
            "notes": list(self.notes),
            "ops": [op.to_dict() for op in self.ops],
        }

    def to_json(self, *, indent: int | None = 2) -> str:
        """The report as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)


# --------------------------------------------------------------------------------------
# Array statistics (host side, float64).
# --------------------------------------------------------------------------------------


def _is_float(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    try:
        return bool(jnp.issubdtype(dtype, jnp.floating))
    except TypeError:  # extended dtypes (PRNG keys)
        return False


def _f64(x: Any) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def _cast(x: Any, dtype: Any) -> Any:
    """``x`` cast to ``dtype`` if both are floating (no warnings on overflow)."""
    if not _is_float(x) or dtype is None or np.dtype(x.dtype) == np.dtype(dtype):
        return x
    return jnp.asarray(x).astype(dtype)


def _rel_error(a: np.ndarray, b: np.ndarray) -> float:
    both = np.isfinite(a) & np.isfinite(b)
    if not both.any():
        return 0.0
    num = float(np.linalg.norm((b - a)[both]))
    den = float(np.linalg.norm(a[both]))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


@dataclasses.dataclass
class _Site:
    """Mutable accumulator for one op site (one eqn at one path)."""

    index: int
    eqn: Any
    primitive: str
    source: str
    path: str
    backward: bool
    flops: int
    f32_dtypes: tuple[str, ...] = ()
    in_dtypes: tuple[str, ...] = ()
    out_dtypes: tuple[str, ...] = ()
    decision: str = "original"
    dtype: str | None = None
    op_class: str = ""
    reason: str = ""
    calls: int = 0
    elements: int = 0
    overflow: int = 0
    underflow: int = 0
    cast_overflow: int = 0
    cast_underflow: int = 0
    nonfinite: int = 0
    rel_error: float = 0.0
    local_rel_error: float = 0.0
    max_abs: float = 0.0
    min_abs: float = math.inf

    def freeze(self) -> OpDiagnosis:
        fields = {f.name for f in dataclasses.fields(OpDiagnosis)}
        return OpDiagnosis(**{k: v for k, v in vars(self).items() if k in fields})


# --------------------------------------------------------------------------------------
# The dual-stream evaluator.
# --------------------------------------------------------------------------------------


def _read(env: dict[Any, Any], v: Any) -> Any:
    if isinstance(v, jex_core.Literal):
        return v.val
    return env[v]


def _write(env: dict[Any, Any], vs: Sequence[Any], vals: Sequence[Any]) -> None:
    for v, val in zip(vs, vals, strict=True):
        if not isinstance(v, jex_core.DropVar):
            env[v] = val


def _bind(eqn: jex_core.JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """Run ``eqn`` exactly as written (the float32 stream)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns: Sequence[Any] = ()
    if isinstance(params, tuple):  # older JAX: (subfuns, params)
        subfuns, params = params
    with (
        source_info_util.user_context(
            eqn.source_info.traceback, name_stack=eqn.source_info.name_stack
        ),
        eqn.ctx.manager,
    ):
        out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


_Parent = tuple[str, bool]  # (source, backward) of the enclosing equation


class _Dual:
    """Evaluates a jaxpr in float32 and under autocast side by side."""

    def __init__(self, interp: Any, *, max_loop_steps: int) -> None:
        self.interp = interp
        self.max_loop_steps = max_loop_steps
        self.sites: dict[tuple[int, str], _Site] = {}
        self.first_nonfinite: _Site | None = None
        self.first_f32_nonfinite: _Site | None = None
        self.notes: list[str] = []
        # Exponent histogram of backward-pass float32 values (frexp exponents).
        self.grad_hist = np.zeros(2200, np.int64)
        self.grad_max = 0.0

    # -- the mixed stream goes through the interpreter --------------------------
    def apply(
        self,
        ctx: Any,
        eqn: jex_core.JaxprEqn,
        invals: Sequence[Any],
        from_param: Sequence[bool],
    ) -> list[Any]:
        out = self.interp.apply_eqn(ctx, eqn, list(invals), from_param=list(from_param))
        return list(out)

    def decide(
        self,
        ctx: Any,
        eqn: jex_core.JaxprEqn,
        name: str,
        invals: Sequence[Any],
        from_param: Sequence[bool],
    ) -> tuple[str, str | None, str, str]:
        """``(decision, dtype, op_class, reason)`` for ``eqn`` on ``invals``."""
        in_dtypes = [dtype_of(x) for x in invals]
        rctx = self.interp.region_context(ctx, eqn)
        if name != eqn.primitive.name:  # a composite run as a whole
            d = decide(
                name,
                in_dtypes,
                mode=rctx.mode,
                lists=rctx.lists,
                low_dtype=rctx.low_dtype,
                from_param=from_param,
            )
        else:
            d = self.interp.decide_eqn(ctx, eqn, in_dtypes, from_param)
        dtype = None if d.dtype is None else np.dtype(d.dtype)
        low = np.dtype(rctx.low_dtype)
        if dtype is None:
            label = "original"
        elif dtype == low and low != _F32:
            label = "low"
        elif dtype == _F32:
            label = "float32"
        else:
            label = "original"
        return label, None if dtype is None else str(dtype), d.op_class, d.reason

    def composite(self, ctx: Any, eqn: jex_core.JaxprEqn) -> str | None:
        """The composite a nested ``jit`` stands for (autocast runs it whole)."""
        if eqn.primitive.name not in ("jit", "pjit"):
            return None
        if self.interp.region_context(ctx, eqn).region == "float32":
            return None
        return composite_for(hop_name(eqn))

    # -- evaluation ---------------------------------------------------------------
    def run(
        self,
        ctx: Any,
        jaxpr: jex_core.Jaxpr,
        consts: Sequence[Any],
        args32: Sequence[Any],
        argsmix: Sequence[Any],
        from_param: Sequence[bool],
        path: str,
        parent: _Parent = ("", False),
    ) -> tuple[list[Any], list[Any]]:
        """Evaluates ``jaxpr`` in both streams. ``parent`` is the source and the
        backward flag of the enclosing higher-order equation: ops without a user
        frame take its source, ops in a transposed body are backward ops."""
        env32: dict[Any, Any] = {}
        envmix: dict[Any, Any] = {}
        fp: dict[Any, bool] = {}
        _write(env32, jaxpr.constvars, consts)
        _write(envmix, jaxpr.constvars, consts)
        _write(fp, jaxpr.constvars, [True] * len(jaxpr.constvars))
        _write(env32, jaxpr.invars, args32)
        _write(envmix, jaxpr.invars, argsmix)
        _write(fp, jaxpr.invars, list(from_param))
        for eqn in jaxpr.eqns:
            in32 = [_read(env32, v) for v in eqn.invars]
            inmix = [_read(envmix, v) for v in eqn.invars]
            in_fp = [
                True if isinstance(v, jex_core.Literal) else fp.get(v, False)
                for v in eqn.invars
            ]
            name = eqn.primitive.name
            composite = self.composite(ctx, eqn)
            out_fp = False
            here: _Parent = (
                eqn_source(eqn) or parent[0],
                parent[1] or is_backward(eqn),
            )
            if composite is None and name in _INLINE and sub_jaxprs(eqn):
                label, sub, sub_consts = sub_jaxprs(eqn)[0]
                sctx = self.interp.sub_context(
                    self.interp.region_context(ctx, eqn), label
                )
                out32, outmix = self.run(
                    sctx,
                    sub,
                    sub_consts,
                    in32,
                    inmix,
                    in_fp,
                    _join(path, label),
                    here,
                )
            elif name in _LOOPS:
                loop = getattr(self, f"_{name}")
                out32, outmix = loop(ctx, eqn, in32, inmix, in_fp, path, here)
            else:
                out32 = _bind(eqn, in32)
                outmix = self.apply(ctx, eqn, inmix, in_fp)
                site = self.site(eqn, path, composite or name, here)
                out_fp = self.record(ctx, eqn, site, in32, inmix, in_fp, out32, outmix)
            _write(env32, eqn.outvars, out32)
            _write(envmix, eqn.outvars, outmix)
            _write(fp, eqn.outvars, [out_fp] * len(eqn.outvars))
        out32 = [_read(env32, v) for v in jaxpr.outvars]
        outmix = [_read(envmix, v) for v in jaxpr.outvars]
        return out32, outmix

    def _body_ctx(self, ctx: Any, eqn: jex_core.JaxprEqn, label: str) -> Any:
        return self.interp.sub_context(self.interp.region_context(ctx, eqn), label)

    def _scan(
        self,
        ctx: Any,
        eqn: jex_core.JaxprEqn,
        in32: list[Any],
        inmix: list[Any],
        in_fp: list[bool],
        path: str,
        here: _Parent,
    ) -> tuple[list[Any], list[Any]]:
        p = eqn.params
        nc, ncarry, length = p["num_consts"], p["num_carry"], p["length"]
        label, body, body_consts = sub_jaxprs(eqn)[0]
        sctx = self._body_ctx(ctx, eqn, label)
        c32, cmix = in32[:nc], inmix[:nc]
        carry32, carrymix = in32[nc : nc + ncarry], inmix[nc : nc + ncarry]
        carry_dtypes = _carry_dtypes(carrymix, eqn.invars[nc : nc + ncarry])
        carrymix = _cast_all(carrymix, carry_dtypes)
        xs32, xsmix = in32[nc + ncarry :], inmix[nc + ncarry :]
        body_fp = [*in_fp[:nc], *([False] * (len(in32) - nc))]
        ys32: list[list[Any]] = []
        ysmix: list[list[Any]] = []
        steps = range(length - 1, -1, -1) if p["reverse"] else range(length)
        for i in steps:
            o32, omix = self.run(
                sctx,
                body,
                body_consts,
                [*c32, *carry32, *[x[i] for x in xs32]],
                [*cmix, *carrymix, *[x[i] for x in xsmix]],
                body_fp,
                _join(path, label),
                here,
            )
            carry32 = o32[:ncarry]
            # Loop carries keep one dtype across iterations.
            carrymix = _cast_all(omix[:ncarry], carry_dtypes)
            ys32.append(o32[ncarry:])
            ysmix.append(omix[ncarry:])
        if p["reverse"]:
            ys32.reverse()
            ysmix.reverse()
        out_avals = [v.aval for v in eqn.outvars[ncarry:]]
        return (
            [*carry32, *_stack(ys32, out_avals)],
            [*carrymix, *_stack(ysmix, out_avals)],
        )

    def _while(
        self,
        ctx: Any,
        eqn: jex_core.JaxprEqn,
        in32: list[Any],
        inmix: list[Any],
        in_fp: list[bool],
        path: str,
        here: _Parent,
    ) -> tuple[list[Any], list[Any]]:
        p = eqn.params
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        (clabel, cj, cconsts), (blabel, bj, bconsts) = sub_jaxprs(eqn)
        cctx = self._body_ctx(ctx, eqn, clabel)
        bctx = self._body_ctx(ctx, eqn, blabel)
        cc32, ccmix = in32[:cn], inmix[:cn]
        bc32, bcmix = in32[cn : cn + bn], inmix[cn : cn + bn]
        carry32, carrymix = in32[cn + bn :], inmix[cn + bn :]
        ncarry = len(carry32)
        cond_fp = [True] * cn + [False] * ncarry
        body_fp = [True] * bn + [False] * ncarry
        carry_dtypes = _carry_dtypes(carrymix, eqn.invars[cn + bn :])
        carrymix = _cast_all(carrymix, carry_dtypes)
        where = here[0] or "<unknown>"
        steps = 0
        while True:
            (p32,), (pmix,) = self.run(
                cctx,
                cj,
                cconsts,
                [*cc32, *carry32],
                [*ccmix, *carrymix],
                cond_fp,
                _join(path, clabel),
                here,
            )
            go32, gomix = bool(p32), bool(pmix)
            if go32 != gomix or (go32 and steps >= self.max_loop_steps):
                if go32 != gomix:
                    self.notes.append(
                        f"while_loop at {where}: the mixed run "
                        f"{'stops' if go32 else 'continues'} after {steps} "
                        "iterations where float32 does not; later iterations are "
                        "not compared."
                    )
                else:
                    self.notes.append(
                        f"while_loop at {where}: compared the first {steps} "
                        "iterations only (max_loop_steps)."
                    )
                # Finish each stream on its own from where it is.
                if go32:
                    carry32 = _bind(eqn, [*cc32, *bc32, *carry32])
                if gomix:
                    carrymix = self.apply(ctx, eqn, [*ccmix, *bcmix, *carrymix], in_fp)
                return carry32, carrymix
            if not go32:
                return carry32, carrymix
            carry32, omix = self.run(
                bctx,
                bj,
                bconsts,
                [*bc32, *carry32],
                [*bcmix, *carrymix],
                body_fp,
                _join(path, blabel),
                here,
            )
            carrymix = _cast_all(omix, carry_dtypes)
            steps += 1

    def _cond(
        self,
        ctx: Any,
        eqn: jex_core.JaxprEqn,
        in32: list[Any],
        inmix: list[Any],
        in_fp: list[bool],
        path: str,
        here: _Parent,
    ) -> tuple[list[Any], list[Any]]:
        branches = sub_jaxprs(eqn)
        n = len(branches)
        i32 = min(max(int(in32[0]), 0), n - 1)
        imix = min(max(int(inmix[0]), 0), n - 1)
        if i32 != imix:
            self.notes.append(
                f"cond at {here[0] or '<unknown>'}: the mixed run takes "
                f"branch {imix}, float32 takes branch {i32}; not compared."
            )
            return _bind(eqn, in32), self.apply(ctx, eqn, inmix, in_fp)
        label, branch, consts = branches[i32]
        out32, _ = self.run(
            self._body_ctx(ctx, eqn, label),
            branch,
            consts,
            in32[1:],
            inmix[1:],
            in_fp[1:],
            _join(path, label),
            here,
        )
        # Autocast casts every branch's outputs to a common dtype; take the mixed
        # outputs from the cond rule itself.
        return out32, self.apply(ctx, eqn, inmix, in_fp)

    # -- statistics -----------------------------------------------------------------
    def site(
        self, eqn: jex_core.JaxprEqn, path: str, name: str, here: _Parent
    ) -> _Site:
        key = (id(eqn), path)
        site = self.sites.get(key)
        if site is None:
            site = _Site(
                index=len(self.sites),
                eqn=eqn,
                primitive=name,
                source=here[0],
                path=path,
                backward=here[1],
                flops=eqn_flops(eqn),
            )
            self.sites[key] = site
        return site

    def record(
        self,
        ctx: Any,
        eqn: jex_core.JaxprEqn,
        site: _Site,
        in32: list[Any],
        inmix: list[Any],
        in_fp: list[bool],
        out32: list[Any],
        outmix: list[Any],
    ) -> bool:
        """Accumulates the statistics of one op call; returns its ``from_param``."""
        first_call = site.calls == 0
        site.calls += 1
        decision, dtype, op_class, reason = self.decide(
            ctx, eqn, site.primitive, inmix, in_fp
        )
        out_fp = op_class in ("clear", "infer") and all(in_fp)
        if first_call:
            site.f32_dtypes = tuple(_dtype_name(x) for x in out32)
            site.in_dtypes = tuple(
                dtype if (dtype is not None and _is_float(x)) else _dtype_name(x)
                for x in inmix
            )
            site.out_dtypes = tuple(_dtype_name(x) for x in outmix)
            site.decision, site.dtype = decision, dtype
            site.op_class, site.reason = op_class, reason
        if not any(_is_float(x) for x in out32):
            return out_fp

        # The op's own low-precision run on exact inputs (skipped when it would be
        # the float32 computation again).
        same = all(
            _dtype_name(a) == _dtype_name(b) for a, b in zip(in32, inmix, strict=True)
        ) and all(
            _dtype_name(a) == _dtype_name(b) for a, b in zip(out32, outmix, strict=True)
        )
        # Inputs that the mixed stream already holds in a narrower dtype are cast
        # to it; if that cast overflows or flushes, the problem was inherited from
        # upstream (already counted there), not caused here.
        inherited_over = inherited_under = False
        if same and decision != "low":
            local = out32
        else:
            local_in = []
            for a, b in zip(in32, inmix, strict=True):
                if not (_is_float(a) and _is_float(b)):
                    local_in.append(a)
                    continue
                c = _cast(a, b.dtype)
                if c is not a:
                    a64, c64 = _f64(a), _f64(c)
                    fa = np.isfinite(a64)
                    inherited_over |= bool((fa & ~np.isfinite(c64)).any())
                    inherited_under |= bool((fa & (a64 != 0) & (c64 == 0)).any())
                local_in.append(c)
            local = self.apply(ctx, eqn, local_in, in_fp)

        # Input casts into the op's low dtype.
        if decision == "low" and dtype is not None:
            for a, b in zip(in32, inmix, strict=True):
                if not (_is_float(a) and _is_float(b)):
                    continue
                if np.dtype(b.dtype).itemsize <= np.dtype(dtype).itemsize:
                    continue  # already low: the cast happened upstream
                a64 = _f64(a)
                c64 = _f64(_cast(a, dtype))
                fa = np.isfinite(a64)
                site.cast_overflow += int(np.count_nonzero(fa & ~np.isfinite(c64)))
                site.cast_underflow += int(
                    np.count_nonzero(fa & (a64 != 0) & (c64 == 0))
                )

        inputs_finite32 = all(
            bool(np.isfinite(_f64(x)).all()) for x in in32 if _is_float(x)
        )
        for a, b, loc in zip(out32, outmix, local, strict=True):
            if not _is_float(a):
                continue
            a64, b64, l64 = _f64(a), _f64(b), _f64(loc)
            if a64.shape != b64.shape or a64.shape != l64.shape:
                continue
            fa = np.isfinite(a64)
            site.elements += a64.size
            if not inherited_over:
                site.overflow += int(np.count_nonzero(fa & ~np.isfinite(l64)))
            if not inherited_under:
                site.underflow += int(np.count_nonzero(fa & (a64 != 0) & (l64 == 0)))
            bad = int(np.count_nonzero(fa & ~np.isfinite(b64)))
            site.nonfinite += bad
            if bad and self.first_nonfinite is None:
                self.first_nonfinite = site
            if not fa.all() and inputs_finite32 and self.first_f32_nonfinite is None:
                self.first_f32_nonfinite = site
            site.rel_error = max(site.rel_error, _rel_error(a64, b64))
            site.local_rel_error = max(site.local_rel_error, _rel_error(a64, l64))
            mags = np.abs(a64[fa & (a64 != 0)])
            if mags.size:
                site.max_abs = max(site.max_abs, float(mags.max()))
                site.min_abs = min(site.min_abs, float(mags.min()))
                # Gradient magnitudes that are held in 16 bits (loss-scale advice).
                if site.backward and _is_float(b) and b.dtype.itemsize < 4:
                    self.grad_max = max(self.grad_max, float(mags.max()))
                    _, exps = np.frexp(mags)
                    self.grad_hist += np.bincount(
                        np.clip(exps + 1100, 0, 2199), minlength=2200
                    )
        return out_fp


def _carry_dtypes(received: Sequence[Any], invars: Sequence[Any]) -> list[Any]:
    """Per loop carry: the wider of the received and the original dtype (as the
    autocast loop rules do), or ``None`` for non-floating carries."""
    out: list[Any] = []
    for x, v in zip(received, invars, strict=True):
        aval_dtype = getattr(getattr(v, "aval", None), "dtype", None)
        if _is_float(x) and aval_dtype is not None and _is_float(v.aval):
            out.append(np.dtype(jnp.promote_types(x.dtype, aval_dtype)))
        else:
            out.append(None)
    return out


def _cast_all(vals: Sequence[Any], dtypes: Sequence[Any]) -> list[Any]:
    return [_cast(x, d) for x, d in zip(vals, dtypes, strict=True)]


def _index(site: _Site | None) -> int | None:
    return None if site is None else site.index


def _join(path: str, label: str) -> str:
    return f"{path}/{label}" if path else label


def _dtype_name(x: Any) -> str:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return type(x).__name__
    return str(dtype)


def _stack(rows: list[list[Any]], avals: Sequence[Any]) -> list[Any]:
    if not rows:
        return [jnp.zeros((0, *a.shape), a.dtype) for a in avals]
    return [jnp.stack(list(col)) for col in zip(*rows, strict=True)]


# --------------------------------------------------------------------------------------
# Advice.
# --------------------------------------------------------------------------------------


def _mixlist_dict(mixlist: Any) -> dict[str, Any] | None:
    """The user's ``modify_mixlist`` spec as a dict (file path, JSON text or dict)."""
    if mixlist is None:
        return None
    if isinstance(mixlist, Mapping):
        return copy.deepcopy(dict(mixlist))
    if isinstance(mixlist, (str, os.PathLike)):
        text = os.fspath(mixlist)
        if os.path.exists(text):
            with open(text, encoding="utf-8") as f:
                text = f.read()
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"`diagnose(..., mixlist=...)` must be a dict, a JSON string or a "
                f"path to a JSON file; could not parse {mixlist!r}: {e}"
            ) from None
        if not isinstance(spec, dict):
            raise TypeError(
                "`diagnose(..., mixlist=...)` JSON must be an object, got "
                f"{type(spec).__name__}."
            )
        return spec
    if hasattr(mixlist, "classify"):  # an OpLists instance: nothing to merge into
        return None
    raise TypeError(
        "`diagnose(..., mixlist=...)` must be a dict, a JSON string or a path, got "
        f"{type(mixlist).__name__}."
    )


def merge_black_list(spec: Mapping[str, Any] | None, ops: Sequence[str]) -> dict:
    """``spec`` (a ``modify_mixlist`` dict) with ``ops`` moved to the black list.

    Conflicting entries of ``spec`` (an op removed from the black list, or added to
    the white or gray list) are dropped so that the result is valid.

    Examples:
      >>> merge_black_list({"black-list": {"to-remove": ["exp"]}}, ["exp"])
      {'black-list': {'to-add': ['exp']}}
    """
    out: dict[str, Any] = copy.deepcopy(dict(spec)) if spec else {}
    if not ops:
        return out
    ops = list(dict.fromkeys(ops))
    for key in ("white-list", "gray-list"):
        entry = out.get(key)
        if isinstance(entry, dict) and isinstance(entry.get("to-add"), list):
            entry["to-add"] = [o for o in entry["to-add"] if o not in ops]
            if not entry["to-add"]:
                del entry["to-add"]
            if not entry:
                del out[key]
    black = out.setdefault("black-list", {})
    if isinstance(black.get("to-remove"), list):
        black["to-remove"] = [o for o in black["to-remove"] if o not in ops]
        if not black["to-remove"]:
            del black["to-remove"]
    added = list(black.get("to-add", []))
    black["to-add"] = added + [o for o in ops if o not in added]
    return out


def _advise_black_list(sites: Sequence[_Site], tolerance: float) -> tuple[str, ...]:
    """Forward ops that run low and overflow, or whose underflow costs accuracy."""
    names: list[str] = []
    for s in sites:
        if s.backward or s.decision != "low":
            continue
        over = s.overflow + s.cast_overflow
        under = s.underflow + s.cast_underflow
        if over or (under and s.local_rel_error >= tolerance):
            names.append(s.primitive)
    return tuple(dict.fromkeys(names))


def _suggest_loss_scale(
    ev: _Dual, low_dtype: np.dtype, loss_scale: float | None, saw_backward: bool
) -> tuple[float | None, tuple[float, float] | None]:
    total = int(ev.grad_hist.sum())
    if not saw_backward or total == 0:
        return None, None
    scale0 = 1.0 if loss_scale is None else float(loss_scale)
    exps = np.arange(ev.grad_hist.size) - 1100  # |g| in [2**(e-1), 2**e)
    nonzero = np.nonzero(ev.grad_hist)[0]
    lo = 2.0 ** float(exps[nonzero[0]] - 1) / scale0
    hi = ev.grad_max / scale0
    if low_dtype != np.dtype(np.float16):
        return None, (lo, hi)
    # The 1st percentile of the magnitudes should land in float16's normal range,
    # and the largest must stay below its maximum with one bit of headroom.
    cdf = np.cumsum(ev.grad_hist) / total
    q_exp = float(exps[int(np.searchsorted(cdf, 0.01))] - 1)
    q = 2.0**q_exp / scale0
    needed = 2.0 ** math.ceil(math.log2(_FLOAT16_TINY / q))
    upper = 2.0 ** math.floor(math.log2(_FLOAT16_MAX / hi / 2.0)) if hi else math.inf
    scale = min(max(needed, 1.0), upper, _MAX_LOSS_SCALE)
    return float(max(scale, 1.0)), (lo, hi)


# --------------------------------------------------------------------------------------
# Entry point.
# --------------------------------------------------------------------------------------


def _evaluate(
    fn: Callable[..., Any], args: tuple[Any, ...], ctx: Any, max_loop_steps: int
) -> tuple[_Dual, list[Any], list[Any]]:
    closed = jax.make_jaxpr(fn)(*args)
    flat = jax.tree.leaves(args)
    ev = _Dual(interpreter, max_loop_steps=max_loop_steps)
    out32, outmix = ev.run(
        ctx, closed.jaxpr, closed.consts, flat, flat, [True] * len(flat), ""
    )
    return ev, out32, outmix


def _refine_advice(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    sites: Sequence[_Site],
    *,
    policy: Any,
    mode: str,
    user_spec: dict[str, Any] | None,
    tolerance: float,
    max_loop_steps: int,
    max_rounds: int,
) -> tuple[tuple[str, ...], bool | None, list[str]]:
    """Black-lists the earliest problem op, re-runs, and repeats until clean.

    Fixing an op often fixes the ops downstream of it (a gray op that ran low only
    because its input did), so ops are added one at a time in evaluation order.
    Returns ``(ops, verified, notes)``; ``verified`` says whether a run with the
    suggested mixlist is free of problems (``None`` if nothing was suggested).
    """
    chosen: list[str] = []
    rejected: set[str] = set()
    notes: list[str] = []
    candidates = _advise_black_list(sites, tolerance)
    for _ in range(max_rounds):
        new = [c for c in candidates if c not in chosen and c not in rejected]
        if not new:
            break
        op = new[0]
        spec = merge_black_list(user_spec, [*chosen, op])
        try:
            ctx = interpreter.make_context(policy, mode=mode, mixlist=spec)
        except ValueError as e:
            notes.append(f"cannot black-list {op!r}: {e}")
            rejected.add(op)
            continue
        chosen.append(op)
        ev, _, _ = _evaluate(fn, args, ctx, max_loop_steps)
        candidates = _advise_black_list(list(ev.sites.values()), tolerance)
    if not chosen:
        return (), None, notes
    remaining = [c for c in candidates if c not in rejected]
    return tuple(chosen), not remaining, notes


def diagnose(
    fn: Callable[..., Any],
    *args: Any,
    policy: Any = None,
    mode: str = "allow_mix_precision",
    mixlist: Any = None,
    loss_scale: float | None = None,
    argnums: int | Sequence[int] = 0,
    max_loop_steps: int = 10_000,
    tolerance: float = 1e-2,
    refine: bool = True,
) -> DiagnosisReport:
    r"""Run ``fn`` in float32 and under autocast side by side and find what breaks.

    Every op is evaluated twice with concrete values (float32 as written, and the
    way :func:`mixprec.autocast` runs it); see the module docs for what is
    measured. Problems are attributed to the op that causes them and to its user
    source line.

    Gradients: pass a gradient function (``diagnose(jax.grad(loss), params,
    batch)``) to see where gradients underflow without loss scaling, or pass the
    loss itself with ``loss_scale=S`` to diagnose ``jax.grad(lambda *a: loss(*a) *
    S, argnums)``, the gradient at loss scale ``S`` (outputs stay scaled by ``S``).
    Either way the report suggests an initial loss scale from the backward-pass
    magnitudes it saw (backward equations are the ones JAX names ``transpose``).

    Advice: forward ops that run in the low dtype and overflow (or whose
    underflow costs more than ``tolerance`` relative error) are moved to the black
    list one at a time, earliest first, re-running the diagnosis each time, until
    no problem is left (``refine=True``). ``report.suggested_mixlist`` is the
    result and ``report.advice_verified`` says whether it removed every problem.

    Args:
      fn: the function to diagnose (called once per stream, with ``args``).
      *args: example arguments; floating arrays are taken as float32.
      policy: a :class:`mixprec.Policy` or policy string; default: the global one.
      mode: the precision mode (see :func:`mixprec.autocast`).
      mixlist: a ``modify_mixlist`` spec (dict, JSON string or path).
      loss_scale: if given, ``fn`` is a scalar loss and its gradient w.r.t.
        ``argnums`` is diagnosed at this loss scale.
      argnums: which arguments to differentiate when ``loss_scale`` is given.
      max_loop_steps: compare at most this many ``while_loop`` iterations.
      tolerance: the relative error (of an op's own low-precision run against
        float32) that an underflow must cause before the advice black-lists the
        op; any overflow always counts.
      refine: verify the advice by re-running with it (see above); with
        ``False`` every problem op of the first run is suggested at once.

    Returns:
      A :class:`DiagnosisReport`.

    Raises:
      ValueError: for a non-positive or non-finite ``loss_scale``.
      TypeError: if ``args`` hold tracers or ``jax.ShapeDtypeStruct``\ s.

    Examples:
      >>> import jax.numpy as jnp
      >>> import mixprec
      >>> def f(w, x):
      ...     h = x @ w                # float16 under mixed_float16
      ...     return jnp.square(h)     # 256.0 ** 2 = 65536 overflows float16
      >>> w = jnp.eye(8)
      >>> x = jnp.full((8, 8), 256.0)
      >>> report = mixprec.diagnose(f, w, x, policy="mixed_float16")
      >>> op = report.first_nonfinite_op
      >>> op.primitive, op.overflow, op.line  # line 3 of `f`: jnp.square
      ('square', 64, 3)
      >>> report.suggested_mixlist
      {'black-list': {'to-add': ['square']}}
      >>> report.advice_verified
      True
      >>> fixed = mixprec.autocast(f, "mixed_float16",
      ...                          mixlist=report.suggested_mixlist)(w, x)
      >>> fixed.dtype, float(fixed[0, 0])
      (dtype('float32'), 65536.0)
    """
    if loss_scale is not None:
        scale: float | None = float(loss_scale)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(
                "`diagnose(..., loss_scale=...)` must be a positive finite number, "
                f"got {loss_scale!r}."
            )
        loss_fn = fn
        factor = scale

        def scaled_loss(*a: Any) -> Any:
            return loss_fn(*a) * factor

        fn_to_run: Callable[..., Any] = jax.grad(scaled_loss, argnums=argnums)
    else:
        scale = None
        fn_to_run = fn
    for leaf in jax.tree.leaves(args):
        if is_tracer(leaf) or isinstance(leaf, jax.ShapeDtypeStruct):
            raise TypeError(
                "`diagnose(fn, *args)` runs `fn` on concrete values, got "
                f"{type(leaf).__name__} among `args`. Call it outside `jax.jit`/"
                "`jax.grad` with real arrays (use `mixprec.explain` for shapes only)."
            )
    user_spec = _mixlist_dict(mixlist)
    ctx = interpreter.make_context(policy, mode=mode, mixlist=mixlist)
    low = np.dtype(ctx.low_dtype)
    args = float32_args(args)
    ev, out32, outmix = _evaluate(fn_to_run, args, ctx, max_loop_steps)

    sites = list(ev.sites.values())
    ops = tuple(s.freeze() for s in sites)
    out_err = []
    out_bad = []
    for a, b in zip(out32, outmix, strict=True):
        if _is_float(a) and _is_float(b):
            a64, b64 = _f64(a), _f64(b)
            out_err.append(_rel_error(a64, b64))
            out_bad.append(int(np.count_nonzero(np.isfinite(a64) & ~np.isfinite(b64))))
    notes = list(dict.fromkeys(ev.notes))
    if refine:
        to_black, verified, more = _refine_advice(
            fn_to_run,
            args,
            sites,
            policy=policy,
            mode=mode,
            user_spec=user_spec,
            tolerance=tolerance,
            max_loop_steps=max_loop_steps,
            max_rounds=8,
        )
        notes.extend(more)
    else:
        to_black, verified = _advise_black_list(sites, tolerance), None
    suggested = merge_black_list(user_spec, to_black)
    saw_backward = any(s.backward for s in sites)
    loss_scale_hint, grad_range = _suggest_loss_scale(ev, low, scale, saw_backward)
    alignment = []
    for s in sites:
        if s.decision == "low":
            issue = lint_eqn(s.eqn, s.dtype, source=s.source, path=s.path)
            if issue is not None:
                alignment.append(issue)
    if low == _F32:
        notes.append(
            f"policy {ctx.policy} computes in float32: nothing runs in low "
            "precision (pass e.g. policy='mixed_float16')."
        )
    if mode == "force_fp16" and (to_black or _advise_black_list(sites, tolerance)):
        notes.append(
            "mode 'force_fp16' lowers every op regardless of the lists; use "
            "'allow_mix_precision' for a mixlist to take effect."
        )
    return DiagnosisReport(
        ops=ops,
        policy=str(ctx.policy),
        mode=str(ctx.mode),
        low_dtype=str(low),
        mixlist=user_spec,
        loss_scale=scale,
        first_nonfinite=_index(ev.first_nonfinite),
        first_f32_nonfinite=_index(ev.first_f32_nonfinite),
        output_rel_error=tuple(out_err),
        output_nonfinite=tuple(out_bad),
        to_black_list=to_black,
        suggested_mixlist=suggested,
        advice_verified=verified,
        suggested_loss_scale=loss_scale_hint,
        gradient_range=grad_range,
        alignment=tuple(alignment),
        notes=tuple(notes),
    )
