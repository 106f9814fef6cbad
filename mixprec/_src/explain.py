"""Precision reports: which op ran in which dtype under autocast, and why.

``mixprec.explain(fn, *args, policy=...)`` traces ``fn`` through the autocast
interpreter without running it and returns a :class:`PrecisionReport`: one row per
primitive (including those inside ``jit``, ``scan``, ``while_loop``, ``cond``,
``checkpoint``, ``custom_jvp`` and ``custom_vjp``) with its user source line, the path
through higher-order primitives, the input and output dtypes, the decision
(``"low"``, ``"float32"`` or ``"original"``) with its reason, and its FLOPs; plus the
share of FLOPs that runs in low precision and a tensor-core alignment lint.

This module also holds the pieces shared with :mod:`mixprec._src.diagnose`: source
locations, FLOP counts, the jaxpr walk, the alignment lint and table rendering.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core, source_info_util

from .autocast.interpreter import EqnRecord
from .autocast.op_lists import COMPOSITES
from .casting import cast_tree


__all__ = ["AlignmentIssue", "ExplainedOp", "PrecisionReport", "explain"]

# Source info should point at user code, not at mixprec's own frames (the
# interpreter registers the same directory; registering twice is harmless).
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
source_info_util.register_exclusion(_PKG_DIR)

# --------------------------------------------------------------------------------------
# Source locations, paths and FLOPs of jaxpr equations.
# --------------------------------------------------------------------------------------

_SUMMARY_RE = re.compile(r"^(?P<file>.*?):(?P<line>\d+)(?::\d+)? \((?P<fn>.*)\)$")
_SOURCE_RE = re.compile(r"^(?P<file>.*?):(?P<line>\d+)(?: \((?P<fn>.*)\))?$")


def eqn_source(eqn: jex_core.JaxprEqn) -> str:
    """``"file.py:LINE (function)"`` of the user code behind ``eqn`` (or ``""``)."""
    summary = source_info_util.summarize(eqn.source_info)
    match = _SUMMARY_RE.match(summary)
    if match is None:
        return summary
    return f"{match['file']}:{match['line']} ({match['fn']})"


def parse_source(source: str) -> tuple[str, int | None, str]:
    """Split ``"file.py:LINE (function)"`` into ``(file, line, function)``."""
    match = _SOURCE_RE.match(source)
    if match is None:
        return source, None, ""
    return match["file"], int(match["line"]), match["fn"] or ""


def short_source(source: str) -> str:
    """``source`` with the directory dropped: ``"model.py:12 (mlp)"``."""
    file, line, fn = parse_source(source)
    if line is None:
        return source
    text = f"{os.path.basename(file)}:{line}"
    return f"{text} ({fn})" if fn else text


def is_backward(eqn: jex_core.JaxprEqn) -> bool:
    """Whether ``eqn`` belongs to a backward pass (JAX names it ``transpose(...)``)."""
    return "transpose(" in str(eqn.source_info.name_stack)


def _size(shape: Sequence[int]) -> int:
    return int(math.prod(int(d) for d in shape))


def _shape(v: Any) -> tuple[int, ...]:
    aval = getattr(v, "aval", None)
    return tuple(int(d) for d in getattr(aval, "shape", ()))


# Data movement and dtype plumbing: no arithmetic.
_ZERO_FLOP = frozenset(
    {
        "reshape",
        "broadcast_in_dim",
        "transpose",
        "squeeze",
        "expand_dims",
        "slice",
        "dynamic_slice",
        "dynamic_update_slice",
        "gather",
        "concatenate",
        "pad",
        "rev",
        "select_n",
        "convert_element_type",
        "bitcast_convert_type",
        "copy",
        "copy_p",
        "iota",
        "stop_gradient",
        "sharding_constraint",
        "device_put",
        "optimization_barrier",
        "pjit",
        "jit",
        "closed_call",
        "core_call",
        "remat2",
        "checkpoint",
        "scan",
        "while",
        "cond",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "shard_map",
        "random_bits",
        "random_seed",
        "random_wrap",
        "random_unwrap",
        "threefry2x32",
    }
)


def dot_dims(eqn: jex_core.JaxprEqn) -> dict[str, int] | None:
    """``{"M", "N", "K", "batch"}`` sizes of a ``dot_general`` (``None`` otherwise)."""
    if eqn.primitive.name != "dot_general":
        return None
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = _shape(eqn.invars[0]), _shape(eqn.invars[1])
    k = _size([lhs[i] for i in lc])
    batch = _size([lhs[i] for i in lb])
    m = _size([d for i, d in enumerate(lhs) if i not in set(lc) | set(lb)])
    n = _size([d for i, d in enumerate(rhs) if i not in set(rc) | set(rb)])
    return {"M": m, "N": n, "K": k, "batch": batch}


def conv_dims(eqn: jex_core.JaxprEqn) -> dict[str, int] | None:
    """Input/output channels and kernel size of a ``conv_general_dilated``."""
    if eqn.primitive.name != "conv_general_dilated":
        return None
    dn = eqn.params["dimension_numbers"]
    rhs = _shape(eqn.invars[1])
    rhs_spec = tuple(dn.rhs_spec)
    out_c, in_c = rhs[rhs_spec[0]], rhs[rhs_spec[1]]
    window = _size([rhs[i] for i in rhs_spec[2:]])
    return {"C_in": int(in_c), "C_out": int(out_c), "window": window}


def eqn_flops(eqn: jex_core.JaxprEqn) -> int:
    """Floating-point operations of one equation (sub-jaxprs excluded).

    ``dot_general``: ``2·batch·M·N·K``; convolutions: ``2·out·C_in/groups·window``;
    reductions: one per input element; data movement: zero; everything else: one per
    output element.
    """
    name = eqn.primitive.name
    out_size = sum(_size(_shape(v)) for v in eqn.outvars)
    if name == "dot_general":
        dims = dot_dims(eqn)
        assert dims is not None
        return 2 * out_size * dims["K"]
    if name == "conv_general_dilated":
        dims = conv_dims(eqn)
        assert dims is not None
        # The kernel's input-feature dimension is already C_in / groups.
        return 2 * out_size * dims["C_in"] * dims["window"]
    if name in _ZERO_FLOP:
        return 0
    if name.startswith(("reduce_", "cum", "arg")):
        return sum(_size(_shape(v)) for v in eqn.invars)
    return out_size


def hop_name(eqn: jex_core.JaxprEqn) -> str:
    """The user-visible name of a nested ``jit``/``custom_jvp``/``custom_vjp``."""
    name = eqn.params.get("name")
    if name:
        return str(name)
    for key in ("call_jaxpr", "jaxpr", "fun_jaxpr"):
        j = eqn.params.get(key)
        j = getattr(j, "jaxpr", j)
        info = getattr(j, "debug_info", None)
        func_name = getattr(info, "func_name", None)
        if func_name:
            return str(func_name).split(" ")[0]
    return ""


def sub_jaxprs(
    eqn: jex_core.JaxprEqn,
) -> list[tuple[str, jex_core.Jaxpr, Sequence[Any]]]:
    """``(label, jaxpr, consts)`` of the sub-jaxprs of a higher-order equation."""
    name = eqn.primitive.name
    out: list[tuple[str, jex_core.Jaxpr, Sequence[Any]]] = []

    def add(label: str, j: Any) -> None:
        if isinstance(j, jex_core.ClosedJaxpr):
            out.append((label, j.jaxpr, j.consts))
        elif isinstance(j, jex_core.Jaxpr):
            out.append((label, j, ()))

    params = eqn.params
    if name == "scan":
        add("scan/body", params["jaxpr"])
    elif name == "while":
        add("while/cond", params["cond_jaxpr"])
        add("while/body", params["body_jaxpr"])
    elif name == "cond":
        for i, branch in enumerate(params["branches"]):
            add(f"cond/branch{i}", branch)
    elif name in ("jit", "pjit"):
        add(f"jit({hop_name(eqn)})", params["jaxpr"])
    elif name in ("closed_call", "core_call"):
        add("call", params["call_jaxpr"])
    elif name in ("remat2", "checkpoint"):
        add("checkpoint", params["jaxpr"])
    elif name == "custom_jvp_call":
        add(f"custom_jvp({hop_name(eqn)})", params["call_jaxpr"])
    elif name in ("custom_vjp_call", "custom_vjp_call_jaxpr"):
        add(
            f"custom_vjp({hop_name(eqn)})",
            params.get("call_jaxpr", params.get("fun_jaxpr")),
        )
    else:
        for key, value in params.items():
            values = value if isinstance(value, (tuple, list)) else (value,)
            for j in values:
                add(f"{name}/{key}", j)
    return out


def iter_eqns(
    jaxpr: jex_core.Jaxpr, path: str = ""
) -> Iterator[tuple[jex_core.JaxprEqn, str]]:
    """Every equation of ``jaxpr`` and of its sub-jaxprs, depth first, with paths."""
    for eqn in jaxpr.eqns:
        yield eqn, path
        for label, sub, _ in sub_jaxprs(eqn):
            yield from iter_eqns(sub, f"{path}/{label}" if path else label)


# --------------------------------------------------------------------------------------
# Tensor-core alignment lint.
# --------------------------------------------------------------------------------------


def alignment_multiple(dtype: Any) -> int | None:
    """8 for 16-bit floats, 16 for 8-bit types, ``None`` for wider dtypes."""
    if dtype is None:
        return None
    bits = np.dtype(dtype).itemsize * 8
    return {16: 8, 8: 16}.get(bits)


@dataclasses.dataclass(frozen=True)
class AlignmentIssue:
    """A matmul or convolution whose dimensions do not suit tensor cores.

    NVIDIA tensor cores need the matrix dimensions of 16-bit matmuls to be multiples
    of 8 (multiples of 16 for 8-bit types); otherwise cuBLAS/cuDNN pick slower
    kernels or pad internally (Keras mixed-precision guide, "multiples of 8").

    Attributes:
      primitive: ``"dot_general"`` or ``"conv_general_dilated"``.
      source: user source location ``"file.py:LINE (function)"``.
      path: nesting through higher-order primitives.
      dtype: the dtype the op runs in.
      multiple: the required multiple (8 or 16).
      dims: every relevant dimension, e.g. ``{"M": 64, "N": 10, "K": 784}``.
      misaligned: the names of the dimensions that are not multiples.

    Examples:
      >>> issue = AlignmentIssue("dot_general", "m.py:3 (f)", "", "float16", 8,
      ...                        {"M": 32, "N": 10, "K": 64}, ("N",))
      >>> print(issue.message())
      dot_general at m.py:3 (f) [float16]: N=10 not a multiple of 8 (pad N to 16)
    """

    primitive: str
    source: str
    path: str
    dtype: str
    multiple: int
    dims: Mapping[str, int]
    misaligned: tuple[str, ...]

    def message(self) -> str:
        """One line naming the op, its line, and what to pad."""
        bad = ", ".join(f"{d}={self.dims[d]}" for d in self.misaligned)
        pads = ", ".join(
            f"{d} to {-(-self.dims[d] // self.multiple) * self.multiple}"
            for d in self.misaligned
        )
        where = short_source(self.source) or "<unknown>"
        verb = "not a multiple" if len(self.misaligned) == 1 else "not multiples"
        return (
            f"{self.primitive} at {where} [{self.dtype}]: {bad} {verb} of "
            f"{self.multiple} (pad {pads})"
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        d = dataclasses.asdict(self)
        d["dims"] = dict(self.dims)
        d["misaligned"] = list(self.misaligned)
        d["message"] = self.message()
        return d


def lint_eqn(
    eqn: jex_core.JaxprEqn, dtype: Any, *, source: str | None = None, path: str = ""
) -> AlignmentIssue | None:
    """The alignment issue of one dot/conv equation run in ``dtype``, if any."""
    multiple = alignment_multiple(dtype)
    if multiple is None:
        return None
    dims = dot_dims(eqn) or conv_dims(eqn)
    if dims is None:
        return None
    checked = ("M", "N", "K") if "K" in dims else ("C_in", "C_out")
    bad = tuple(d for d in checked if dims[d] % multiple)
    if not bad:
        return None
    return AlignmentIssue(
        primitive=eqn.primitive.name,
        source=eqn_source(eqn) if source is None else source,
        path=path,
        dtype=str(np.dtype(dtype)),
        multiple=multiple,
        dims={k: v for k, v in dims.items() if k != "window"},
        misaligned=bad,
    )


# --------------------------------------------------------------------------------------
# Table rendering (rich when installed, plain text otherwise).
# --------------------------------------------------------------------------------------


def have_rich() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def render_table(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    use_rich: bool | None = None,
    width: int | None = None,
    styles: Sequence[str | None] | None = None,
    caption: str | None = None,
) -> str:
    """Render rows as a rich table (if available and wanted) or aligned plain text."""
    if use_rich is None:
        use_rich = have_rich()
    if use_rich:
        table = rich_table(title, columns, rows, styles=styles, caption=caption)
        from rich.console import Console

        buf = io.StringIO()
        console = Console(
            file=buf, width=width or 160, force_terminal=False, color_system=None
        )
        console.print(table)
        return buf.getvalue().rstrip("\n")
    max_cell = 48
    cells = [[_clip(str(c), max_cell) for c in row] for row in rows]
    widths = [len(c) for c in columns]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    lines = [title] if title else []
    lines.append("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    lines.append("  ".join("-" * w for w in widths))
    for row in cells:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    if caption:
        lines.append(caption)
    return "\n".join(line.rstrip() for line in lines)


def rich_table(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    styles: Sequence[str | None] | None = None,
    caption: str | None = None,
) -> Any:
    """A ``rich.table.Table`` (requires rich)."""
    from rich.table import Table

    table = Table(title=title or None, caption=caption, show_lines=False)
    for col in columns:
        numeric = col in _NUMERIC_COLUMNS
        table.add_column(col, justify="right" if numeric else "left", overflow="fold")
    for i, row in enumerate(rows):
        style = styles[i] if styles is not None else None
        table.add_row(*[str(c) for c in row], style=style)
    return table


_NUMERIC_COLUMNS = frozenset(
    {"#", "flops", "overflow", "underflow", "nonfinite", "rel err", "calls", "elems"}
)


def fmt_flops(n: int | float) -> str:
    """``1234567 -> "1.2M"``."""
    n = float(n)
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{int(n)}"


def fmt_dtypes(dtypes: Sequence[str]) -> str:
    """``("float32", "bfloat16") -> "f32,bf16"``."""
    return ",".join(_SHORT_DTYPES.get(d, d) for d in dtypes)


_SHORT_DTYPES = {
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "float64": "f64",
    "int32": "i32",
    "int64": "i64",
    "int8": "i8",
    "uint8": "u8",
    "uint32": "u32",
    "bool": "bool",
    "float8_e4m3fn": "f8e4m3",
    "float8_e5m2": "f8e5m2",
    "key<fry>": "key",
}


# --------------------------------------------------------------------------------------
# The precision report.
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExplainedOp(EqnRecord):
    """One primitive (or recognised composite) as autocast runs it.

    The fields of the interpreter's record (``primitive``, ``source``,
    ``path``, ``in_dtypes``, ``out_dtypes``, ``in_shapes``, ``out_shapes``,
    ``op_class``, ``decision`` (``"low"``, ``"float32"`` or ``"original"``),
    ``dtype``, ``reason``, ``flops``), plus:

    Attributes:
      index: position in evaluation order.
    """

    index: int

    @property
    def line(self) -> int | None:
        """The user source line number, or ``None``."""
        return parse_source(self.source)[1]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        d = dataclasses.asdict(self)
        for key in ("in_dtypes", "out_dtypes"):
            d[key] = list(d[key])
        for key in ("in_shapes", "out_shapes"):
            d[key] = [list(s) for s in d[key]]
        d["line"] = self.line
        return d


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """What autocast does to every op of a function, and why.

    Returned by :func:`mixprec.explain`. ``str(report)`` is a plain-text table;
    ``report.table()`` renders with rich when it is installed; ``report.to_dict()``
    and ``report.to_json()`` give a machine-readable form.

    Attributes:
      ops: one :class:`ExplainedOp` per primitive, in evaluation order.
      policy: the policy, as a string (``"p=f32,c=f16,o=f32"``).
      mode: the precision mode.
      low_dtype: the low-precision dtype of the context.
      alignment: tensor-core alignment issues of low-precision dots/convs.

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
    """

    ops: tuple[ExplainedOp, ...]
    policy: str
    mode: str
    low_dtype: str
    alignment: tuple[AlignmentIssue, ...] = ()

    @property
    def total_flops(self) -> int:
        """FLOPs of all ops (each loop body counted once)."""
        return sum(op.flops for op in self.ops)

    @property
    def low_precision_flops(self) -> int:
        """FLOPs of the ops that run in the low dtype."""
        return sum(op.flops for op in self.ops if op.decision == "low")

    @property
    def low_precision_flop_fraction(self) -> float:
        """Share of FLOPs in low precision (0.0 when the function has no FLOPs)."""
        total = self.total_flops
        return self.low_precision_flops / total if total else 0.0

    def counts(self) -> dict[str, int]:
        """How many ops got each decision."""
        out: dict[str, int] = {}
        for op in self.ops:
            out[op.decision] = out.get(op.decision, 0) + 1
        return out

    def find(self, primitive: str) -> list[ExplainedOp]:
        """The ops with this primitive (or composite) name."""
        return [op for op in self.ops if op.primitive == primitive]

    def summary(self) -> str:
        """One line: policy, mode, op counts and the low-precision FLOP share."""
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(self.counts().items()))
        return (
            f"policy {self.policy}, mode {self.mode}: {len(self.ops)} ops ({counts}); "
            f"{100 * self.low_precision_flop_fraction:.1f}% of "
            f"{fmt_flops(self.total_flops)} FLOPs in {self.low_dtype}"
        )

    _COLUMNS = ("#", "op", "source", "path", "in", "out", "decision", "reason", "flops")

    def _rows(self, max_rows: int | None) -> list[list[str]]:
        ops = self.ops if max_rows is None else self.ops[:max_rows]
        return [
            [
                str(op.index),
                op.primitive,
                short_source(op.source),
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
          width: console width for rich (default 160).

        Returns:
          The rendered table, followed by the summary and any alignment issues.
        """
        rows = self._rows(max_rows)
        hidden = len(self.ops) - len(rows)
        caption = self.summary()
        if hidden:
            caption = f"({hidden} more ops not shown) " + caption
        styles = [
            "bold" if op.decision == "low" else None for op in self.ops[: len(rows)]
        ]
        text = render_table(
            "mixprec.explain",
            self._COLUMNS,
            rows,
            use_rich=use_rich,
            width=width,
            styles=styles,
            caption=caption,
        )
        if self.alignment:
            text += "\nTensor-core alignment:\n" + "\n".join(
                "  " + issue.message() for issue in self.alignment
            )
        return text

    def __str__(self) -> str:
        return self.table(use_rich=False)

    def __rich__(self) -> Any:
        return rich_table(
            "mixprec.explain",
            self._COLUMNS,
            self._rows(None),
            caption=self.summary(),
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
            "counts": self.counts(),
            "ops": [op.to_dict() for op in self.ops],
            "alignment": [issue.to_dict() for issue in self.alignment],
        }

    def to_json(self, *, indent: int | None = 2) -> str:
        """The report as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)


def _dtype_str(d: Any) -> str:
    return str(np.dtype(d)) if d is not None else ""


def _hop_sources(jaxpr: jex_core.Jaxpr, path: str = "") -> dict[str, str]:
    """``{body path: source of the higher-order equation that owns it}``.

    Paths shared by two different equations (two scans at one level) map to
    ``""``: the fallback is only used where it is unambiguous.
    """
    out: dict[str, str] = {}
    for eqn in jaxpr.eqns:
        subs = sub_jaxprs(eqn)
        if not subs:
            continue
        source = eqn_source(eqn)
        for label, sub, _ in subs:
            full = f"{path}/{label}" if path else label
            if full in out and out[full] != source:
                out[full] = ""
            else:
                out.setdefault(full, source)
            for k, v in _hop_sources(sub, full).items():
                if k in out and out[k] != v:
                    out[k] = ""
                else:
                    out.setdefault(k, v)
    return out


def _fallback_source(path: str, hop_sources: Mapping[str, str]) -> str:
    """The source of the innermost enclosing equation of ``path`` that has one."""
    parts = path.split("/") if path else []
    while parts:
        source = hop_sources.get("/".join(parts), "")
        if source:
            return source
        parts.pop()
    return ""


def _as_explained(index: int, record: EqnRecord) -> ExplainedOp:
    fields = {f.name: getattr(record, f.name) for f in dataclasses.fields(EqnRecord)}
    return ExplainedOp(**fields, index=index)


def float32_args(args: Sequence[Any]) -> tuple[Any, ...]:
    """Cast floating array leaves to float32 (the reference precision)."""
    return tuple(cast_tree(tuple(args), np.float32))


def _lint_records(
    closed: jex_core.ClosedJaxpr, ops: Sequence[ExplainedOp], fallback: Any
) -> tuple[AlignmentIssue, ...]:
    """Alignment issues of the dots/convs in ``closed`` that run in 16/8-bit."""
    by_key: dict[tuple[str, str, tuple[tuple[int, ...], ...]], ExplainedOp] = {}
    for op in ops:
        if op.primitive in ("dot_general", "conv_general_dilated"):
            by_key.setdefault((op.primitive, op.source, op.in_shapes), op)
    issues = []
    for eqn, path in iter_eqns(closed.jaxpr):
        name = eqn.primitive.name
        if name not in ("dot_general", "conv_general_dilated"):
            continue
        source = eqn_source(eqn)
        key = (name, source, tuple(_shape(v) for v in eqn.invars))
        op = by_key.get(key)
        if op is not None:
            dtype = op.dtype if op.decision == "low" else None
        else:
            dtype = fallback if not by_key else None
        issue = lint_eqn(eqn, dtype, source=source, path=path)
        if issue is not None:
            issues.append(issue)
    return tuple(issues)


def explain(
    fn: Callable[..., Any],
    *args: Any,
    policy: Any = None,
    mode: str = "allow_mix_precision",
    mixlist: Any = None,
) -> PrecisionReport:
    """Report which dtype autocast runs each op of ``fn`` in, and why.

    ``fn`` is traced (not run) with ``args`` through the autocast interpreter, the
    same code path as :func:`mixprec.autocast`, so the report shows exactly what
    ``mixprec.autocast(fn, policy, mode=mode, mixlist=mixlist)`` would do.

    Args:
      fn: the function to explain (a model apply, a loss, a train step...).
      *args: example arguments (arrays or ``jax.ShapeDtypeStruct``); floating
        arrays are taken as float32.
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
    from .autocast import interpreter

    args = float32_args(args)
    ctx = interpreter.make_context(policy, mode=mode, mixlist=mixlist)
    records = interpreter.trace_records(
        fn, *args, policy=policy, mode=mode, mixlist=mixlist
    )
    ops = tuple(_as_explained(i, r) for i, r in enumerate(records))
    closed = jax.make_jaxpr(fn)(*args)
    # Ops without a user frame (jnp.sin passed to cond, the body of jnp.var) take
    # the source of the higher-order equation around them. Composite rows carry no
    # FLOPs of their own: their bodies are listed (and counted) too.
    hop_sources = _hop_sources(closed.jaxpr)
    ops = tuple(
        dataclasses.replace(
            op,
            source=op.source or _fallback_source(op.path, hop_sources),
            flops=0 if op.primitive in COMPOSITES else op.flops,
        )
        for op in ops
    )
    low = np.dtype(ctx.low_dtype)
    alignment = _lint_records(closed, ops, low)
    return PrecisionReport(
        ops=ops,
        policy=str(ctx.policy),
        mode=str(ctx.mode),
        low_dtype=str(low),
        alignment=alignment,
    )
