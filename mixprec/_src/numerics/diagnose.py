"""Numerics diagnosis: which op breaks in half precision, and what to do about it.

``mixprec.diagnose(fn, *args, policy=...)`` runs the autocast walk on concrete
values: the function autocast would trace (same front door, same statics), the
walk ``mixprec.autocast`` uses, with the same decisions and rules. Its observer
(:class:`_Comparer`) keeps the float32 reference of every variable beside the
walk (each op also run exactly as written) and asks the walk to step loops and
take branches on concrete values (the stepping path of
:mod:`~mixprec._src.autocast.rules.control_flow`), so that every iteration can
be compared. Each op is reported as an :class:`OpDiagnosis`: the record
``mixprec.explain`` gives (:class:`~mixprec._src.numerics.record.OpRecord`)
with the measurements added.

For every op it measures, on the op's outputs:

* **overflow**: finite float32 values that become ``inf``/``nan`` when the op runs
  as autocast runs it, fed with the *exact* (float32-stream) inputs cast to the
  dtypes the autocast stream has. Feeding exact inputs attributes each problem to
  the op that causes it rather than to every op downstream of it.
* **underflow**: non-zero float32 values that flush to zero in the same local run.
* **cast overflow / underflow**: input values that overflow or flush to zero when
  the op casts its float32 inputs down to the low dtype.
* **nonfinite**: non-finite values of the autocast stream where float32 is finite
  (propagated problems included); the first op where this happens is reported.
* **relative error** of the autocast stream against float32 (``‖b-a‖/‖a‖`` over
  the positions where both are finite; ``inf`` when the autocast value is
  non-finite where float32 is finite), and of the local run.
* **float8** (matmuls and convolutions a float8 policy runs in float8): of the
  operand values the op quantizes, how many saturate at the format's largest
  value and how many non-zero values flush to zero after scaling. Flushing is
  what float8's range costs; it is reported, not advised against.

It ends with advice (:mod:`~mixprec._src.numerics.advice`): the ops to move to
the black list, as a ``modify_mixlist`` dict ready for ``mixprec.autocast(...,
mixlist=...)``; a suggested initial loss scale from the gradient magnitudes seen
(backward-pass equations are the ones JAX names ``transpose(...)``); and the
tensor-core alignment lint of low-precision dots/convs.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from mixprec._src import float8 as f8
from mixprec._src._compat import is_tracer
from mixprec._src.autocast import api, fusions, interpreter as itp
from mixprec._src.autocast.config import make_config
from mixprec._src.autocast.mixlist import load_spec
from mixprec._src.autocast.ops import OpLists
from mixprec._src.autocast.sites import is_unused
from mixprec._src.autocast.walk import Walk
from mixprec._src.numerics import plan as plan_advice
from mixprec._src.numerics.advice import (
    GradientHistogram,
    ScopeFix,
    advise_black_list,
    merge_black_list,
    problem_sites,
    scope_fix,
    suggest_loss_scale,
)
from mixprec._src.numerics.record import (
    AlignmentIssue,
    OpRecord,
    dtype_name,
    eqn_flops,
    lint_product,
    parse_source,
    product_dims,
    short_source,
)
from mixprec._src.numerics.render import fmt_dtypes, render_table, rich_table


__all__ = ["DiagnosisReport", "OpDiagnosis", "diagnose", "merge_black_list"]

_F32 = np.dtype(np.float32)


@dataclasses.dataclass(frozen=True)
class OpDiagnosis(OpRecord):
    """An op's record (:class:`~mixprec._src.numerics.record.OpRecord`, the
    type ``mixprec.explain`` reports) with the float32 vs mixed precision
    measurements of ``diagnose`` (summed over loop iterations).

    The record's fields are those of the op's first evaluation, in the mixed
    run: ``in_dtypes``/``out_dtypes`` the dtypes it ran with and gave;
    ``flops`` are those of one call; ``float8`` is the recipe of an op that ran
    in float8 (``None`` for one the recipe kept in the low dtype, see
    ``float8_skip``). ``primitive`` is the composite's name when autocast
    treats a nested function as one op (``"softmax"``).

    Attributes:
      f32_dtypes: output dtypes in the float32 run.
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
      quantized: operand values the op scaled into float8 (summed over calls).
      saturated: of those, values beyond the format's range after scaling
        (clipped to its largest value; current scaling leaves none).
      flushed: non-zero values that became zero after scaling.

    Examples:
      >>> import jax.numpy as jnp
      >>> import mixprec
      >>> def f(w, x):
      ...     return (x @ w) * (x @ w.T)  # 1e-5 * 1e-5 flushes to 0 in float16
      >>> report = mixprec.diagnose(f, jnp.eye(4), jnp.full((4, 4), 1e-5),
      ...                           policy="mixed_float16", refine=False)
      >>> [op] = report.find("mul")
      >>> op.decision, op.in_dtypes, op.calls, op.elements, op.underflow
      ('low', ('float16', 'float16'), 1, 16, 16)
    """

    f32_dtypes: tuple[str, ...] = ()
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
    quantized: int = 0
    saturated: int = 0
    flushed: int = 0

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
        d = super().to_dict()
        d["f32_dtypes"] = list(d["f32_dtypes"])
        for key in ("rel_error", "local_rel_error", "max_abs", "min_abs"):
            d[key] = _json_float(d[key])
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
      to_black_list: the primitives of the problem ops, for the black list:
        the last resort, since it moves every op of those primitives to
        float32 (see ``black_list_reach``).
      suggested_mixlist: ``mixlist`` (user spec plus ``to_black_list``) to
        pass back to autocast; ``{}`` when nothing needs to change and no spec
        was given.
      advice_verified: whether a re-run with ``suggested_mixlist`` is free of
        the problems that led to it (``None``: nothing suggested, or not
        checked).
      black_list_reach: per primitive of ``to_black_list``, how many other ops
        (ones without a problem) that mixlist also moves out of the low dtype.
      scope_fixes: the narrowest fix: the user lines to wrap in
        ``mixprec.float32_scope()``, one per offending op (its own line, or the
        user's line that called its layer).
      scope_verified: whether a re-run with those lines treated as inside
        ``float32_scope`` is free of the problems (``None``: no line to
        suggest, or not checked).
      suggested_plan: the fix as a :class:`mixprec.Plan`: every matmul site
        kept at the precision it ran in, the ones that broke raised one step
        (float8 -> 16-bit -> float32), re-run and raised again until none
        breaks (``None`` without matmul sites).
      plan_verified: whether the last re-run with ``suggested_plan`` had no
        broken matmul site (``None``: not checked).
      suggested_loss_scale: a power of two, or ``None`` when no backward pass was
        seen or the low dtype does not need loss scaling (bfloat16).
      gradient_range: ``(smallest, largest)`` non-zero magnitude of the
        backward-pass values, unscaled, or ``None``.
      alignment: tensor-core alignment issues of low-precision dots/convs.
      notes: anything the reader should know (diverging branches, capped loops,
        an attention a whole step cannot fuse).

    Examples:
      >>> import jax.numpy as jnp
      >>> import mixprec
      >>> def f(w, x):
      ...     h, g = x @ w, x @ w.T
      ...     return h * g          # 1e-5 * 1e-5 = 1e-10 flushes to 0 in float16
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
    black_list_reach: Mapping[str, int] = dataclasses.field(default_factory=dict)
    scope_fixes: tuple[ScopeFix, ...] = ()
    scope_verified: bool | None = None
    suggested_plan: Any = None
    plan_verified: bool | None = None

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
        f8_ops = [op for op in self.ops if op.float8 is not None]
        if f8_ops:
            n = sum(op.quantized for op in f8_ops)
            flushed = sum(op.flushed for op in f8_ops)
            lines.append(
                f"float8: {len(f8_ops)} op{'s' if len(f8_ops) != 1 else ''} "
                f"quantized {n} values; "
                f"{sum(op.saturated for op in f8_ops)} saturated, {flushed} "
                f"({100 * flushed / max(n, 1):.2f}%) flushed to zero after scaling"
            )
        return "\n".join(lines)

    def advice(self) -> str:
        """What to change: the offending ops' lines in ``float32_scope``, else the
        black list (as a mixlist), a loss scale, alignment."""
        lines = []
        for fix in self.scope_fixes:
            lines.append(fix.message())
        if self.scope_fixes:
            if self.scope_verified:
                lines.append(
                    "  (checked: a re-run with "
                    + ("this line" if len(self.scope_fixes) == 1 else "these lines")
                    + " inside float32_scope leaves no problem)"
                )
            elif self.scope_verified is False:
                lines.append(
                    "  (a re-run with these lines inside float32_scope still has "
                    "problems)"
                )
            else:
                lines.append(
                    "  (not checked: it would run "
                    + ", ".join(
                        f"{f.primitive} at {short_source(f.line)}"
                        for f in self.scope_fixes
                    )
                    + " in float32)"
                )
        if self.to_black_list:
            reach = [
                f"{n} other {p} op{'s' if n != 1 else ''}"
                for p, n in self.black_list_reach.items()
            ]
            head = "Black list" if not self.scope_fixes else "Last resort, black list"
            lines.append(
                f"{head} (every op of the primitive runs in float32; also moves "
                + (", ".join(reach) if reach else "no other op")
                + "): "
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
        "layer",
        "path",
        "ran with",
        "result",
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
            if op.float8 is not None:
                note.append(
                    f"float8: {op.saturated} saturated, {op.flushed} flushed of "
                    f"{op.quantized}"
                )
            if op.backward:
                note.append("backward")
            rows.append(
                [
                    str(op.index),
                    op.primitive,
                    short_source(op.source),
                    op.where,
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
          width: the width to fit the table to (default: the terminal's, or
            rich's console width when rich renders); the note column wraps.

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
            wrap=("note",),
            shrink=("source", "layer", "path"),
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
            "black_list_reach": dict(self.black_list_reach),
            "scope_fixes": [fix.to_dict() for fix in self.scope_fixes],
            "scope_verified": self.scope_verified,
            "suggested_plan": None
            if self.suggested_plan is None
            else self.suggested_plan.to_dict(),
            "plan_verified": self.plan_verified,
            "alignment": [issue.to_dict() for issue in self.alignment],
            "notes": list(self.notes),
            "ops": [op.to_dict() for op in self.ops],
        }

    def to_json(self, *, indent: int | None = 2) -> str:
        """The report as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)


# --------------------------------------------------------------------------------------
# Comparing the two streams.
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
    """``‖b-a‖/‖a‖`` where both are finite; ``inf`` if ``b`` is non-finite
    anywhere ``a`` is finite (an overflow is not a small error)."""
    fa, fb = np.isfinite(a), np.isfinite(b)
    if (fa & ~fb).any():
        return math.inf
    both = fa & fb
    if not both.any():
        return 0.0
    num = float(np.linalg.norm(b[both] - a[both]))
    den = float(np.linalg.norm(a[both]))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


#: The measurements of one call of an op that keep their largest value over
#: the op's calls (the others add up).
LARGEST = frozenset({"rel_error", "local_rel_error"})


def compare_output(
    a64: np.ndarray,
    b64: np.ndarray,
    l64: np.ndarray,
    *,
    inherited_over: bool = False,
    inherited_under: bool = False,
) -> dict[str, Any]:
    """What one call of an op measures on one of its outputs (float64 arrays
    of one shape): ``a64`` the op as written on float32 inputs, ``b64`` the
    value the autocast stream has, ``l64`` the op's own run on the float32
    inputs cast to the stream's dtypes (``local``).

    ``elements``; ``overflow``: finite float32 values that ``l64`` has as
    inf/nan (left out when that cast of the inputs overflowed:
    ``inherited_over``, counted upstream); ``underflow``: non-zero float32
    values that ``l64`` has as zero (likewise ``inherited_under``);
    ``nonfinite``: finite float32 values that ``b64`` has as inf/nan;
    ``rel_error`` and ``local_rel_error``: :func:`_rel_error` of ``b64`` and
    ``l64``. Over the op's calls, the names in :data:`LARGEST` keep their
    largest value and the others add up (:func:`add_call`). ``diagnose``
    and ``mixprec.plan`` both measure with it.

    Examples:
        >>> a = np.array([1.0, 1e5, 1e-9])
        >>> m = compare_output(a, a, np.array([1.0, np.inf, 0.0]))
        >>> m["overflow"], m["underflow"], m["nonfinite"], m["local_rel_error"]
        (1, 1, 0, inf)
    """
    fa = np.isfinite(a64)
    found: dict[str, Any] = {"elements": int(a64.size)}
    if not inherited_over:
        found["overflow"] = int(np.count_nonzero(fa & ~np.isfinite(l64)))
    if not inherited_under:
        found["underflow"] = int(np.count_nonzero(fa & (a64 != 0) & (l64 == 0)))
    found["nonfinite"] = int(np.count_nonzero(fa & ~np.isfinite(b64)))
    found["rel_error"] = _rel_error(a64, b64)
    found["local_rel_error"] = _rel_error(a64, l64)
    return found


def add_call(into: dict[str, Any], call: Mapping[str, Any]) -> None:
    """Adds one call's measurements (:func:`compare_output`,
    :func:`_count_float8`) to ``into``: the names in :data:`LARGEST` keep
    the largest, the others add up."""
    for name, x in call.items():
        if name in LARGEST:
            into[name] = max(into.get(name, 0.0), x)
        else:
            into[name] = into.get(name, 0) + x


class _Comparer:
    """The observer of a diagnose walk.

    The walk runs the autocast stream on concrete values; the comparer keeps
    the float32 stream beside it, in ``ref`` (jaxpr variable -> value): each
    equation is also run exactly as written on the reference values of its
    operands. It ``steps``: the walk runs every higher-order equation through
    the stepping path of :mod:`~mixprec._src.autocast.rules.control_flow`
    (loops stepped and branches taken on concrete values, call bodies walked in
    place, this reference carried beside), so that every iteration is
    compared. Measurements accumulate per op site (equation and path), in one
    :class:`OpDiagnosis` each.

    It compares op by op, so the walk runs no fusion for it (``fuses``): on
    the CPU that ``diagnose`` runs on, a fused formulation is those same ops.
    """

    fuses = False
    steps = True

    def __init__(self, *, max_loop_steps: int) -> None:
        self.max_loop_steps = max_loop_steps
        self.sites: dict[tuple[int, str], OpDiagnosis] = {}
        self.first_nonfinite: int | None = None
        self.first_f32_nonfinite: int | None = None
        self.notes: list[str] = []
        self.grads = GradientHistogram()
        self.ref: dict[Any, Any] = {}
        self.source: Any = None  # the traced function walked (api.Source)

    # -- the reference stream -------------------------------------------------
    def seed(self, variables: Sequence[Any], values: Sequence[Any]) -> None:
        """Sets the reference values of the inputs of a jaxpr about to be walked."""
        for v, x in zip(variables, values, strict=True):
            if type(v) is not Literal:
                self.ref[v] = x

    def read(self, variables: Sequence[Any]) -> list[Any]:
        """The reference values of ``variables`` (literals: their value)."""
        return [v.val if type(v) is Literal else self.ref[v] for v in variables]

    # -- what the walk reports ------------------------------------------------
    def on_note(self, walk: Walk, eqn: Any, text: str) -> None:
        del walk, eqn
        self.notes.append(text)

    def on_own(
        self,
        walk: Walk,
        eqn: Any,
        decision: Any,
        ran_with: Sequence[Any],
        invals: Sequence[Any],
        outs: Sequence[Any],
    ) -> None:
        # An op autocast adds (a clamp) has no float32 counterpart: it is
        # listed, compared with itself.
        self._compare(walk, eqn, decision, ran_with, invals, invals, outs, outs, None)

    def on_eqn(
        self,
        walk: Walk,
        eqn: Any,
        decision: Any,
        ran_with: Sequence[Any],
        invals: Sequence[Any],
        outs: Sequence[Any],
        rerun: Callable[[Sequence[Any]], list[Any]] | None,
    ) -> None:
        if rerun is None:  # a higher-order equation the walk ran as a whole
            name = eqn.primitive.name
            self.on_note(
                walk,
                eqn,
                "shard_map: compared as a whole (its collectives need the mesh)"
                if name == "shard_map"
                else f"{name}: compared as a whole, not op by op",
            )
        in32 = self.read(eqn.invars)
        out32 = itp.bind_as_written(eqn, in32)
        self.seed(eqn.outvars, out32)
        if is_unused(walk.sites, eqn):
            return  # a product whose result is used nowhere does not run
        self._compare(walk, eqn, decision, ran_with, in32, invals, out32, outs, rerun)

    # -- comparing ------------------------------------------------------------
    def _site(
        self,
        walk: Walk,
        eqn: Any,
        decision: Any,
        ran_with: Sequence[Any],
        out32: Sequence[Any],
        outmix: Sequence[Any],
    ) -> OpDiagnosis:
        """The op site of ``eqn`` at the walk's path (made at its first call)."""
        site = self.sites.get((id(eqn), walk.path))
        if site is not None:
            return site
        site = OpDiagnosis.observed(
            walk,
            eqn,
            decision,
            ran_with,
            outmix,
            index=len(self.sites),
            flops=eqn_flops(eqn),
            f32_dtypes=tuple(dtype_name(x) for x in out32),
        )
        if site.decision != "float8":  # kept 16-bit by the recipe: float8_skip
            site = dataclasses.replace(site, float8=None)
        return site

    def _note_float8_inf(
        self,
        walk: Walk,
        eqn: Any,
        site: OpDiagnosis,
        inmix: Sequence[Any],
        outmix: Sequence[Any],
    ) -> None:
        """Says why a float8 product is all NaN when an operand holds an inf:
        the operand's amax is inf, so its scale is 0 and every quantized value
        inf * 0 (tensorwise: the whole tensor; rowwise: its rows/columns)."""
        if not any(_is_float(x) and bool(np.isinf(_f64(x)).any()) for x in inmix):
            return
        if not all(_is_float(o) and bool(np.isnan(_f64(o)).all()) for o in outmix):
            return
        where = site.source or "<unknown>"
        self.on_note(
            walk,
            eqn,
            f"{site.primitive} at {where} ran in float8 with an inf in an operand: "
            "its amax is inf, so every output is NaN (deliberate: a tensorwise "
            "scale is taken over the whole tensor; see docs/float8.md). Find the "
            "inf upstream.",
        )

    def _compare(
        self,
        walk: Walk,
        eqn: Any,
        decision: Any,
        ran_with: Sequence[Any],
        in32: Sequence[Any],
        inmix: Sequence[Any],
        out32: Sequence[Any],
        outmix: Sequence[Any],
        rerun: Callable[[Sequence[Any]], list[Any]] | None,
    ) -> None:
        """Adds one call of ``eqn`` to its site's measurements."""
        site = self._site(walk, eqn, decision, ran_with, out32, outmix)
        found = self._measure(
            walk, eqn, site, decision, in32, inmix, out32, outmix, rerun
        )
        self.sites[(id(eqn), walk.path)] = dataclasses.replace(
            site, calls=site.calls + 1, **found
        )

    def _measure(
        self,
        walk: Walk,
        eqn: Any,
        site: OpDiagnosis,
        decision: Any,
        in32: Sequence[Any],
        inmix: Sequence[Any],
        out32: Sequence[Any],
        outmix: Sequence[Any],
        rerun: Callable[[Sequence[Any]], list[Any]] | None,
    ) -> dict[str, Any]:
        """The measurements of ``site`` after one more call (the fields of
        :class:`OpDiagnosis` that change)."""
        found: dict[str, Any] = {}

        def add(name: str, n: int) -> None:
            found[name] = found.get(name, getattr(site, name)) + n

        def keep(name: str, x: float, pick: Callable[[float, float], float]) -> None:
            found[name] = pick(found.get(name, getattr(site, name)), x)

        if not any(_is_float(x) for x in out32):
            return found
        same = all(
            dtype_name(a) == dtype_name(b) for a, b in zip(in32, inmix, strict=True)
        ) and all(
            dtype_name(a) == dtype_name(b) for a, b in zip(out32, outmix, strict=True)
        )
        # The op's own run on exact inputs, cast to the dtypes the autocast
        # stream has. If that cast overflows or flushes, the problem was
        # inherited from upstream (already counted there), not caused here.
        inherited_over = inherited_under = False
        if rerun is None or (same and site.decision != "low"):
            local = outmix if rerun is None else out32
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
            local = rerun(local_in)

        if site.decision == "float8":
            for name, n in _count_float8(eqn, decision, inmix).items():
                add(name, n)
            self._note_float8_inf(walk, eqn, site, inmix, outmix)
        if site.decision == "low" and site.dtype is not None:
            for a, b in zip(in32, inmix, strict=True):
                if not (_is_float(a) and _is_float(b)):
                    continue
                if np.dtype(b.dtype).itemsize <= np.dtype(site.dtype).itemsize:
                    continue  # already low: the cast happened upstream
                a64 = _f64(a)
                c64 = _f64(_cast(a, site.dtype))
                fa = np.isfinite(a64)
                add("cast_overflow", int(np.count_nonzero(fa & ~np.isfinite(c64))))
                add(
                    "cast_underflow",
                    int(np.count_nonzero(fa & (a64 != 0) & (c64 == 0))),
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
            call = compare_output(
                a64,
                b64,
                l64,
                inherited_over=inherited_over,
                inherited_under=inherited_under,
            )
            for name, x in call.items():
                if name in LARGEST:
                    keep(name, x, max)
                else:
                    add(name, x)
            bad = call["nonfinite"]
            if bad and self.first_nonfinite is None:
                self.first_nonfinite = site.index
            if not fa.all() and inputs_finite32 and self.first_f32_nonfinite is None:
                self.first_f32_nonfinite = site.index
            mags = np.abs(a64[fa & (a64 != 0)])
            if mags.size:
                keep("max_abs", float(mags.max()), max)
                keep("min_abs", float(mags.min()), min)
                # Backward-pass values are linear in the loss's cotangent, so a
                # loss scale multiplies every one of them (the loss-scale
                # advice). Those kept in float32 reach 16 bits at the next dot.
                if site.backward:
                    self.grads.add(mags)
        return found


def _count_float8(eqn: Any, decision: Any, inmix: Sequence[Any]) -> dict[str, int]:
    """Saturated and flushed values of the operands a float8 op quantizes, with
    the scales the recipe takes (over the contraction for rowwise dots)."""
    counts = {"saturated": 0, "flushed": 0, "quantized": 0}
    formats = decision.operand_dtypes or ()
    gradients = decision.float8_gradients or (False,) * len(formats)
    recipe = decision.float8
    dims = product_dims(eqn)
    contract = dims.contracting if dims is not None else ((), ())
    for i, (x, fmt) in enumerate(zip(inmix, formats, strict=False)):
        if fmt is None or not _is_float(x):
            continue
        axes = (
            recipe.scale_axes(contract[i], gradient=gradients[i])
            if recipe is not None
            else None
        )
        saturated, flushed, n = f8.quantization_counts(x, fmt, axes)
        counts["saturated"] += saturated
        counts["flushed"] += flushed
        counts["quantized"] += n
    return counts


# --------------------------------------------------------------------------------------
# Entry point.
# --------------------------------------------------------------------------------------


def _mixlist_dict(mixlist: Any) -> dict[str, Any] | None:
    """The user's ``modify_mixlist`` spec as a dict, read by the same loader as
    autocast's (``//`` comments and all)."""
    if mixlist is None or isinstance(mixlist, OpLists):
        return None
    spec = load_spec(mixlist)
    if not isinstance(spec, Mapping):
        raise TypeError(
            "`diagnose(..., mixlist=...)` JSON must be an object, got "
            f"{type(spec).__name__}."
        )
    return copy.deepcopy(dict(spec))


def _widen_16bit(args: tuple[Any, ...]) -> tuple[Any, ...]:
    def widen(x: Any) -> Any:
        if _is_float(x) and np.dtype(x.dtype).itemsize < 4:
            return jnp.asarray(x, jnp.float32)
        return x

    return tuple(jax.tree.map(widen, args))


def _evaluate(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    config: Any,
    max_loop_steps: int,
    float32_lines: frozenset[tuple[str, int]] = frozenset(),
) -> tuple[_Comparer, list[Any], list[Any]]:
    """Walks ``fn`` on ``args`` as autocast traces it, with a comparer; the
    user source ``float32_lines`` as if each were inside ``float32_scope``.

    Returns the comparer, and the float32 and autocast values of the outputs.
    """
    call = api.split_call(fn, args, {})
    source = call.source(config)
    values = [*source.consts, *(call.leaves[i] for i in call.dyn_idx)]
    comparer = _Comparer(max_loop_steps=max_loop_steps)
    walk = api.region_walk(config, comparer)
    if float32_lines:
        walk = walk.with_float32_lines(float32_lines)
    comparer.source = source
    comparer.seed(source.jaxpr.invars, values)
    outs, _ = itp.eval_jaxpr(
        walk, source.jaxpr, (), values, source.in_marks(), source.consts
    )
    return comparer, comparer.read(source.jaxpr.outvars), outs


def _refine_advice(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    sites: Sequence[OpDiagnosis],
    *,
    policy: Any,
    mode: str,
    user_spec: dict[str, Any] | None,
    tolerance: float,
    max_loop_steps: int,
    max_rounds: int,
) -> tuple[tuple[str, ...], bool | None, list[str]]:
    """Black-lists the earliest problem op, re-runs, and repeats until clean.

    Fixing an op often fixes the ops downstream of it (a gray op that ran low
    only because its operand did), so ops are added one at a time in evaluation
    order. Returns ``(ops, verified, notes)``; ``verified`` says whether a run
    with the suggested mixlist is free of problems (``None`` if nothing was
    suggested).
    """
    chosen: list[str] = []
    rejected: set[str] = set()
    notes: list[str] = []
    candidates = advise_black_list(sites, tolerance)
    for _ in range(max_rounds):
        new = [c for c in candidates if c not in chosen and c not in rejected]
        if not new:
            break
        op = new[0]
        spec = merge_black_list(user_spec, [*chosen, op])
        try:
            config = make_config(policy, mode=mode, mixlist=spec).resolved()
        except ValueError as e:
            notes.append(f"cannot black-list {op!r}: {e}")
            rejected.add(op)
            continue
        chosen.append(op)
        comparer, _, _ = _evaluate(fn, args, config, max_loop_steps)
        candidates = advise_black_list(list(comparer.sites.values()), tolerance)
    if not chosen:
        return (), None, notes
    remaining = [c for c in candidates if c not in rejected]
    return tuple(chosen), not remaining, notes


def _line_key(line: str) -> tuple[str, int]:
    file, number, _ = parse_source(line)
    return file, int(number or 0)


def _refine_scopes(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    sites: Sequence[OpDiagnosis],
    *,
    config: Any,
    tolerance: float,
    max_loop_steps: int,
    max_rounds: int,
) -> tuple[tuple[ScopeFix, ...], bool | None]:
    """Puts the line of the earliest problem op in a ``float32_scope``
    (simulated: the walk treats every equation traced while that line ran as
    inside one), re-runs, and repeats until clean.

    Returns ``(fixes, verified)``: ``verified`` says whether the last run was
    free of problems (``None`` if no fix could be placed: no user line known).
    """
    fixes: list[ScopeFix] = []
    candidates = problem_sites(sites, tolerance)
    for _ in range(max_rounds):
        placed = {_line_key(f.line) for f in fixes}
        new = [
            fix
            for site in candidates
            if (fix := scope_fix(site)) is not None
            and _line_key(fix.line) not in placed
        ]
        if not new:
            break
        fixes.append(new[0])
        lines = frozenset(_line_key(f.line) for f in fixes)
        comparer, _, _ = _evaluate(fn, args, config, max_loop_steps, lines)
        candidates = problem_sites(list(comparer.sites.values()), tolerance)
    if not fixes:
        return (), None
    return tuple(fixes), not candidates


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
      *args: example arguments (concrete arrays). 16-bit floating arrays are
        widened to float32, the reference precision; float64 (under
        ``jax_enable_x64``) is kept, and autocast runs it as written.
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
      ...     h, g = x @ w, x @ w.T    # float16 under mixed_float16
      ...     return h * g             # 256.0 * 256.0 = 65536 overflows float16
      >>> w = jnp.eye(8)
      >>> x = jnp.full((8, 8), 256.0)
      >>> report = mixprec.diagnose(f, w, x, policy="mixed_float16")
      >>> op = report.first_nonfinite_op
      >>> op.primitive, op.overflow, op.line  # line 3 of `f`: h * g
      ('mul', 64, 3)
      >>> report.suggested_mixlist
      {'black-list': {'to-add': ['mul']}}
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
    config = make_config(policy, mode=mode, mixlist=mixlist).resolved()
    low = np.dtype(config.low_dtype)
    args = _widen_16bit(args)
    with np.errstate(invalid="ignore", over="ignore"):  # inf and NaN are data here
        ev, out32, outmix = _evaluate(fn_to_run, args, config, max_loop_steps)

    sites = list(ev.sites.values())
    ops = tuple(sites)
    out_err = []
    out_bad = []
    for a, b in zip(out32, outmix, strict=True):
        if _is_float(a) and _is_float(b):
            a64, b64 = _f64(a), _f64(b)
            out_err.append(_rel_error(a64, b64))
            out_bad.append(int(np.count_nonzero(np.isfinite(a64) & ~np.isfinite(b64))))
    notes = list(dict.fromkeys(ev.notes))
    if loss_scale is None:
        # (With a loss scale, diagnose differentiates the loss itself, as
        # `jax.grad(autocast(loss))` would: the note's advice is what it did.)
        notes.extend(fusions.traced_notes(config, ev.source))
    fixes: tuple[ScopeFix, ...] = ()
    scope_ok: bool | None = None
    if refine:
        fixes, scope_ok = _refine_scopes(
            fn_to_run,
            args,
            sites,
            config=config,
            tolerance=tolerance,
            max_loop_steps=max_loop_steps,
            max_rounds=8,
        )
    else:
        fixes = tuple(
            fix for s in problem_sites(sites, tolerance) if (fix := scope_fix(s))
        )
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
        to_black, verified = advise_black_list(sites, tolerance), None
    suggested = merge_black_list(user_spec, to_black)
    targets = {s.index for s in problem_sites(sites, tolerance)}
    reach = {
        p: sum(
            1
            for s in sites
            if s.primitive == p and s.decision == "low" and s.index not in targets
        )
        for p in to_black
    }
    loss_scale_hint, grad_range = suggest_loss_scale(ev.grads, low, scale)
    suggested_plan, plan_ok = plan_advice.suggest_plan(
        fn_to_run,
        args,
        sites,
        config,
        tolerance=tolerance,
        max_loop_steps=max_loop_steps,
        refine=refine,
    )
    alignment = []
    for s in sites:
        issue = lint_product(
            s.eqn, s.decision, s.dtype, s.float8_skip, source=s.source, path=s.path
        )
        if issue is not None:
            alignment.append(issue)
    if low == _F32:
        notes.append(
            f"policy {config.policy} computes in float32: nothing runs in low "
            "precision (pass e.g. policy='mixed_float16')."
        )
    if mode == "force_fp16" and (to_black or advise_black_list(sites, tolerance)):
        notes.append(
            "mode 'force_fp16' lowers every op regardless of the lists; use "
            "'allow_mix_precision' for a mixlist to take effect."
        )
    return DiagnosisReport(
        ops=ops,
        policy=str(config.policy),
        mode=str(config.mode),
        low_dtype=str(low),
        mixlist=user_spec,
        loss_scale=scale,
        first_nonfinite=ev.first_nonfinite,
        first_f32_nonfinite=ev.first_f32_nonfinite,
        output_rel_error=tuple(out_err),
        output_nonfinite=tuple(out_bad),
        to_black_list=to_black,
        suggested_mixlist=suggested,
        advice_verified=verified,
        suggested_loss_scale=loss_scale_hint,
        gradient_range=grad_range,
        alignment=tuple(alignment),
        notes=tuple(notes),
        black_list_reach=reach,
        scope_fixes=fixes,
        scope_verified=scope_ok,
        suggested_plan=suggested_plan,
        plan_verified=plan_ok,
    )
