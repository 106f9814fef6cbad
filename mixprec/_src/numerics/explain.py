"""Precision reports: which op ran in which dtype under autocast, and why.

``mixprec.explain(fn, *args, policy=...)`` builds the autocast transform of ``fn``
with a :class:`~mixprec._src.numerics.record.Recorder` observing the walk: the
records are taken from the very walk that traces the jaxpr ``mixprec.autocast``
runs, so the report cannot disagree with it. One row per equation (including
those inside ``jit``, ``scan``, ``while_loop``, ``cond``, ``checkpoint``,
``custom_jvp`` and ``custom_vjp``) with its user source line, the path through
higher-order primitives, the dtypes it runs in, the decision with its reason,
and its FLOPs; plus the share of FLOPs that runs in low precision and a
tensor-core alignment lint. Under a float8 policy it also says which matmuls and
convolutions ran in float8, with which recipe and share of FLOPs, and why the
others stayed 16-bit.
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
from collections.abc import Callable
from typing import Any

import numpy as np

from mixprec._src.autocast import api, fusions
from mixprec._src.autocast.config import make_config
from mixprec._src.numerics.record import (
    AlignmentIssue,
    OpRecord,
    Recorder,
    lint_product,
    short_source,
)
from mixprec._src.numerics.render import (
    drop_empty_columns,
    fmt_dtypes,
    fmt_flops,
    have_rich,
    render_table,
    rich_table,
    terminal_width,
)


__all__ = ["PrecisionReport", "explain"]


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """What autocast does to every op of a function, and why.

    Returned by :func:`mixprec.explain`. ``str(report)`` is a plain-text table;
    ``report.table()`` renders with rich when it is installed; ``report.to_dict()``
    and ``report.to_json()`` give a machine-readable form.

    Attributes:
      ops: one :class:`~mixprec._src.numerics.record.OpRecord` per equation, in
        evaluation order (bodies of higher-order primitives inline, with their
        ``path``).
      policy: the policy, as a string (``"p=f32,c=f16,o=f32"``).
      mode: the precision mode.
      low_dtype: the low-precision dtype of the context.
      alignment: tensor-core alignment issues of low-precision dots/convs.
      notes: anything the reader should know (the backend; an attention a
        whole step cannot fuse).
      jaxpr: the transformed jaxpr: exactly what ``mixprec.autocast`` runs (the
        records were taken while it was traced).
      source_jaxpr: the jaxpr of ``fn`` it was built from; each record's
        ``eqn`` is one of its equations (or of a body inside it).
      float8: the policy's float8 recipe (``"tensorwise"``, ...), or ``None``.

    Examples:
      >>> import jax.numpy as jnp
      >>> import mixprec
      >>> report = mixprec.explain(lambda w, x: jnp.exp(x @ w), jnp.ones((16, 10)),
      ...                          jnp.ones((8, 16)), policy="mixed_float16")
      >>> [(op.primitive, op.decision, op.out_dtypes) for op in report.ops]
      [('dot_general', 'low', ('float16',)), ('exp', 'float32', ('float32',))]
      >>> print(report.alignment[0].message())
      dot_general at ... [float16]: N=10 not a multiple of 8 (pad N to 16)
      >>> import json; json.loads(report.to_json())["counts"]
      {'low': 1, 'float32': 1}

      Under ``"mixed_float8"``, which products ran in float8 and why the
      others did not:

      >>> report = mixprec.explain(lambda w, x: x @ w @ w[:, :10],
      ...     jnp.ones((256, 256)), jnp.ones((128, 256)), policy="mixed_float8")
      >>> [op.decision for op in report.find("dot_general")]
      ['float8', 'low']
      >>> print(report.float8_summary())  # doctest: +NORMALIZE_WHITESPACE
      float8 (tensorwise): 1 of 2 matmuls/convolutions, 96.2% of FLOPs; kept in
      bfloat16: dot_general at ...: N=10 not a multiple of 16
    """

    ops: tuple[OpRecord, ...]
    policy: str
    mode: str
    low_dtype: str
    alignment: tuple[AlignmentIssue, ...] = ()
    notes: tuple[str, ...] = ()
    jaxpr: Any = dataclasses.field(default=None, compare=False, repr=False)
    source_jaxpr: Any = dataclasses.field(default=None, compare=False, repr=False)
    float8: str | None = None

    @property
    def total_flops(self) -> int:
        """FLOPs of all ops (each loop body counted once)."""
        return sum(op.flops for op in self.ops)

    @property
    def low_precision_flops(self) -> int:
        """FLOPs of the ops that run in the low dtype (or in float8)."""
        return sum(op.flops for op in self.ops if op.decision in ("low", "float8"))

    @property
    def low_precision_flop_fraction(self) -> float:
        """Share of FLOPs in low precision (0.0 when the function has no FLOPs)."""
        total = self.total_flops
        return self.low_precision_flops / total if total else 0.0

    @property
    def float8_flops(self) -> int:
        """FLOPs of the matmuls and convolutions that run in float8."""
        return sum(op.flops for op in self.ops if op.decision == "float8")

    @property
    def float8_flop_fraction(self) -> float:
        """Share of FLOPs in float8 (0.0 when the function has no FLOPs)."""
        total = self.total_flops
        return self.float8_flops / total if total else 0.0

    def float8_summary(self) -> str:
        """Under a float8 policy: how many products ran in float8, their share of
        FLOPs, and each product the recipe kept 16-bit with the reason
        (``""`` without a float8 recipe)."""
        if self.float8 is None:
            return ""
        ran = [op for op in self.ops if op.decision == "float8"]
        kept = [op for op in self.ops if op.float8_skip is not None]
        text = (
            f"float8 ({self.float8}): {len(ran)} of {len(ran) + len(kept)} "
            f"matmuls/convolutions, {100 * self.float8_flop_fraction:.1f}% of FLOPs"
        )
        if kept:
            text += f"; kept in {self.low_dtype}: " + "; ".join(
                f"{op.primitive} at {short_source(op.source) or '<unknown>'}"
                + (" (backward)" if op.backward else "")
                + f": {op.float8_skip_reason}"
                for op in kept
            )
        return text

    def counts(self) -> dict[str, int]:
        """How many ops got each decision."""
        out: dict[str, int] = {}
        for op in self.ops:
            out[op.decision] = out.get(op.decision, 0) + 1
        return out

    def find(self, primitive: str) -> list[OpRecord]:
        """The ops with this primitive name."""
        return [op for op in self.ops if op.primitive == primitive]

    def summary(self) -> str:
        """One line: policy, mode, op counts and the low-precision FLOP share."""
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(self.counts().items()))
        where = self.low_dtype
        if self.float8 is not None:
            where = (
                f"{self.low_dtype} or float8 ({100 * self.float8_flop_fraction:.1f}%"
                f" in float8, {self.float8})"
            )
        return (
            f"policy {self.policy}, mode {self.mode}: {len(self.ops)} ops ({counts}); "
            f"{100 * self.low_precision_flop_fraction:.1f}% of "
            f"{fmt_flops(self.total_flops)} FLOPs in {where}"
        )

    _COLUMNS = (
        "#",
        "op",
        "source",
        "layer",
        "path",
        "ran with",
        "result",
        "decision",
        "reason",
        "flops",
    )
    # Wrapped (never cut) and shrunk (cut with "…") to fit the width.
    _WRAP = ("reason",)
    _SHRINK = ("source", "layer", "path")
    _LEGEND = (
        "ran with: the dtypes of the operands the op computed with, after "
        "autocast's casts (the reason says how they arrived); result: the dtypes "
        "of its results."
    )

    def _rows(self, max_rows: int | None) -> list[list[str]]:
        ops = self.ops if max_rows is None else self.ops[:max_rows]
        return [
            [
                str(op.index),
                op.primitive,
                short_source(op.source),
                op.where,
                op.path,
                fmt_dtypes(op.in_dtypes),
                fmt_dtypes(op.out_dtypes),
                op.decision,
                op.reason,
                fmt_flops(op.flops),
            ]
            for op in ops
        ]

    def table(
        self,
        *,
        use_rich: bool | None = None,
        max_rows: int | None = None,
        width: int | None = None,
    ) -> str:
        """The report as a table.

        Args:
          use_rich: render with rich (box drawing); default: when rich is installed.
          max_rows: show at most this many ops.
          width: the width to fit the table to (default: the terminal's, from
            ``shutil.get_terminal_size()``, or rich's console width when rich
            renders; 80 columns when there is no terminal). The reason column
            wraps; in plain text, when it would be too narrow beside the other
            columns, it goes below each row, and so do the source, layer and
            path columns if the row still does not fit.

        Returns:
          The rendered table, followed by the summary, what the dtype columns
          mean, and any alignment issues.

        Examples:
          >>> import jax.numpy as jnp
          >>> import mixprec
          >>> report = mixprec.explain(lambda w, x: jnp.exp(x @ w + 1.0),
          ...     jnp.ones((16, 10)), jnp.ones((8, 16)), policy="mixed_float16")
          >>> print(report.table(use_rich=False, width=64))  # doctest: +ELLIPSIS
          mixprec.explain
          #  op           ran with  result  decision  flops
          -  -----------  --------  ------  --------  -----
          0  dot_general  f16,f16   f16     low       2.6k
              source: <doctest ...>:1 (<lambda>)
              reason: allow list: lowered to float16
          ...
        """
        if width is None:
            width = terminal_width(
                use_rich=have_rich() if use_rich is None else use_rich
            )
        rows = self._rows(max_rows)
        hidden = len(self.ops) - len(rows)
        caption = self.summary()
        if hidden:
            caption = f"({hidden} more ops not shown) " + caption
        styles = [
            "bold" if op.decision in ("low", "float8") else None
            for op in self.ops[: len(rows)]
        ]
        text = render_table(
            "mixprec.explain",
            self._COLUMNS,
            rows,
            use_rich=use_rich,
            width=width,
            styles=styles,
            caption=caption,
            wrap=self._WRAP,
            shrink=self._SHRINK,
        )
        text += "\n" + textwrap.fill(self._LEGEND, max(width, 40))
        if self.float8 is not None:
            text += "\n" + self.float8_summary()
        if self.alignment:
            text += "\nTensor-core alignment:\n" + "\n".join(
                "  " + issue.message() for issue in self.alignment
            )
        text += "".join(f"\nNote: {n}" for n in self.notes)
        return text

    def __str__(self) -> str:
        return self.table(use_rich=False)

    def __rich__(self) -> Any:
        columns, rows = drop_empty_columns(
            self._COLUMNS, self._rows(None), {*self._WRAP, *self._SHRINK}
        )
        return rich_table(
            "mixprec.explain",
            columns,
            rows,
            caption=self.summary() + "\n" + self._LEGEND,
            wrap=self._WRAP,
            shrink=self._SHRINK,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of the whole report."""
        return {
            "policy": self.policy,
            "mode": self.mode,
            "low_dtype": self.low_dtype,
            "total_flops": self.total_flops,
            "low_precision_flops": self.low_precision_flops,
            "low_precision_flop_fraction": self.low_precision_flop_fraction,
            "float8": self.float8,
            "float8_flops": self.float8_flops,
            "float8_flop_fraction": self.float8_flop_fraction,
            "counts": self.counts(),
            "ops": [op.to_dict() for op in self.ops],
            "alignment": [issue.to_dict() for issue in self.alignment],
            "notes": list(self.notes),
        }

    def to_json(self, *, indent: int | None = 2) -> str:
        """The report as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)


def explain(
    fn: Callable[..., Any],
    *args: Any,
    policy: Any = None,
    mode: str = "allow_mix_precision",
    mixlist: Any = None,
) -> PrecisionReport:
    """Report which dtype autocast runs each op of ``fn`` in, and why.

    ``fn`` is transformed (traced, not run) with ``args`` exactly as
    :func:`mixprec.autocast` would transform it, while a recorder watches each
    decision; the report is what ``mixprec.autocast(fn, policy, mode=mode,
    mixlist=mixlist)`` runs, and ``report.jaxpr`` is its jaxpr.

    Args:
      fn: the function to explain (a model apply, a loss, a train step...).
      *args: example arguments (arrays or ``jax.ShapeDtypeStruct``), with the
        dtypes autocast will see (float32 is what it lowers; float64 under
        ``jax_enable_x64`` runs as written).
      policy: a :class:`mixprec.Policy` or policy string; default: the global one.
      mode: the precision mode (see :func:`mixprec.autocast`).
      mixlist: a ``modify_mixlist`` spec (dict, JSON string or path).

    Returns:
      A :class:`PrecisionReport`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import mixprec
      >>> def mlp(w, x):
      ...     return jnp.tanh(x @ w)
      >>> report = mixprec.explain(mlp, jnp.ones((8, 8)), jnp.ones((4, 8)),
      ...                          policy="mixed_bfloat16")
      >>> [op.decision for op in report.find("dot_general")]
      ['low']
      >>> report.low_precision_flop_fraction > 0.5
      True
      >>> report.to_dict()["policy"]
      'p=f32,c=bf16,o=f32'
    """
    config = make_config(policy, mode=mode, mixlist=mixlist).resolved()
    recorder = Recorder()
    jaxpr, source = api.trace_transformed(fn, config, args, {}, observer=recorder)
    ops = tuple(recorder.records)
    alignment = tuple(
        issue
        for op in ops
        if op.eqn is not None
        for issue in [
            lint_product(
                op.eqn,
                op.decision,
                op.dtype,
                op.float8_skip,
                source=op.source,
                path=op.path,
            )
        ]
        if issue is not None
    )
    return PrecisionReport(
        ops=ops,
        policy=str(config.policy),
        mode=str(config.mode),
        low_dtype=str(np.dtype(config.low_dtype)),
        alignment=alignment,
        notes=tuple(
            dict.fromkeys([*recorder.notes, *fusions.traced_notes(config, source)])
        ),
        jaxpr=jaxpr,
        source_jaxpr=source,
        float8=None if config.policy.float8 is None else str(config.policy.float8),
    )
