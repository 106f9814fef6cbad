"""Tables for the numerics reports: rich when installed, aligned plain text
otherwise, and short forms of dtypes and FLOP counts."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any


__all__ = ["fmt_dtypes", "fmt_flops", "have_rich", "render_table", "rich_table"]


def have_rich() -> bool:
    """Whether rich is installed."""
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
