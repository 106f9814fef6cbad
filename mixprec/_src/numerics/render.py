"""Tables for the numerics reports: rich when installed, aligned plain text
otherwise, and short forms of dtypes and FLOP counts."""

from __future__ import annotations

import io
import shutil
import textwrap
from collections.abc import Collection, Sequence
from typing import Any


__all__ = [
    "drop_empty_columns",
    "fmt_dtypes",
    "fmt_flops",
    "have_rich",
    "render_table",
    "rich_table",
    "terminal_width",
]


def have_rich() -> bool:
    """Whether rich is installed."""
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def terminal_width(*, use_rich: bool = False) -> int:
    """The width to fit a table to: rich's console width when rich renders,
    else ``shutil.get_terminal_size()`` (both read ``COLUMNS`` and the
    terminal, 80 when there is none)."""
    if use_rich:
        from rich.console import Console

        return Console().width
    return shutil.get_terminal_size().columns


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


_GAP = 2  # spaces between columns
_MAX_CELL = 48  # the widest a cell that is not wrapped gets
_COMFORTABLE = 64  # a wrapped column this wide reads well
_MIN_WRAPPED = 32  # narrower than this, a wrapped column goes below its row
_MIN_SHRUNK = 16  # a column shrunk to fit is cut no shorter than this


def render_table(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    use_rich: bool | None = None,
    width: int | None = None,
    styles: Sequence[str | None] | None = None,
    caption: str | None = None,
    wrap: Collection[str] = (),
    shrink: Collection[str] = (),
) -> str:
    """Render rows as a rich table (if available and wanted) or aligned plain text.

    Columns named in ``wrap`` (long text such as a reason) are wrapped, never
    cut; those in ``shrink`` (source lines, paths) are cut with "…" as far as
    fitting the table to ``width`` needs. Either kind is left out when empty in
    every row. Without them, the table is as wide as its cells (each at most
    48 characters). ``width`` defaults to :func:`terminal_width`.

    In plain text, when the wrapped columns would get fewer than 32 characters
    beside the others, they go below each row, indented, as ``name: text``
    lines as wide as the table may be; then, if the row is still too wide, so
    do the shrunk columns. A rich table too narrow for that many characters
    in its wrapped columns is rendered in plain text instead.
    """
    if use_rich is None:
        use_rich = have_rich()
    columns, rows = drop_empty_columns(columns, rows, {*wrap, *shrink})
    if width is None and (wrap or shrink):
        width = terminal_width(use_rich=use_rich)
    if use_rich and wrap and width is not None:
        # A rich table gives each column a border and two spaces; where the
        # wrapped columns would not get their least width in it, the plain
        # layout (with those columns under each row) reads better.
        least = sum(
            _MIN_WRAPPED
            if c in wrap
            else min(_MIN_SHRUNK, len(c))
            if c in shrink
            else max([len(c), *(len(row[i]) for row in rows)])
            for i, c in enumerate(columns)
        )
        use_rich = least + 3 * len(columns) + 1 <= width
    if use_rich:
        table = rich_table(
            title,
            columns,
            rows,
            styles=styles,
            caption=caption,
            wrap=wrap,
            shrink=shrink,
        )
        from rich.console import Console

        buf = io.StringIO()
        console = Console(
            file=buf, width=width or 160, force_terminal=False, color_system=None
        )
        console.print(table)
        return buf.getvalue().rstrip("\n")
    lines = [title] if title else []
    lines += _plain_lines(columns, rows, width, wrap, shrink)
    if caption:
        lines.append(caption)
    return "\n".join(line.rstrip() for line in lines)


def drop_empty_columns(
    columns: Sequence[str], rows: Sequence[Sequence[str]], droppable: Collection[str]
) -> tuple[list[str], list[list[str]]]:
    """The columns and rows without the ``droppable`` columns that are empty
    in every row."""
    keep = [
        i
        for i, c in enumerate(columns)
        if c not in droppable or any(str(row[i]) for row in rows)
    ]
    return [columns[i] for i in keep], [[str(row[i]) for i in keep] for row in rows]


def _plain_lines(
    columns: Sequence[str],
    rows: Sequence[Sequence[str]],
    width: int | None,
    wrap: Collection[str],
    shrink: Collection[str],
) -> list[str]:
    """The header, rule and rows of a plain-text table (see `render_table`)."""
    natural = [
        max([len(c), *(len(row[i]) for row in rows)]) for i, c in enumerate(columns)
    ]
    wrapped = [i for i, c in enumerate(columns) if c in wrap]
    shrunk = [i for i, c in enumerate(columns) if c in shrink and c not in wrap]
    widths = [n if i in wrapped else min(n, _MAX_CELL) for i, n in enumerate(natural)]
    below: list[int] = []  # columns shown under their row, in column order

    def row_width(shown: Sequence[int]) -> int:
        return sum(widths[i] for i in shown) + _GAP * (len(shown) - 1)

    def cut_to(shown: Sequence[int], width: int) -> bool:
        # Cut the shrinkable columns, the widest first, until the row fits.
        while row_width(shown) > width:
            widest = max(shrunk, key=lambda i: widths[i], default=None)
            if widest is None or widths[widest] <= _MIN_SHRUNK:
                return False
            widths[widest] -= 1
        return True

    everything = range(len(columns))
    if width is not None and row_width(everything) > width:
        # The wrapped columns get room for a readable line if cutting the
        # others allows it, else at least their least width, else go below.
        for i in wrapped:
            widths[i] = min(natural[i], _COMFORTABLE)
        if not cut_to(everything, width):
            for i in wrapped:
                widths[i] = min(natural[i], _MIN_WRAPPED)
        if row_width(everything) > width:
            below = list(wrapped)
            for i in shrunk:
                widths[i] = min(natural[i], _MAX_CELL)
            if not cut_to([i for i in everything if i not in below], width):
                below = sorted([*below, *shrunk])
        else:
            # The wrapped columns take what the others leave.
            spare = width - row_width(range(len(columns)))
            for i in wrapped:
                grow = min(spare, natural[i] - widths[i])
                widths[i] += grow
                spare -= grow
    shown = [i for i in range(len(columns)) if i not in below]

    def cell_lines(i: int, text: str) -> list[str]:
        if i in wrapped and i not in below:
            return textwrap.wrap(text, widths[i], break_on_hyphens=False) or [""]
        return [_clip(text, widths[i])]

    lines = [
        (" " * _GAP).join(columns[i].ljust(widths[i]) for i in shown),
        (" " * _GAP).join("-" * widths[i] for i in shown),
    ]
    indent = " " * (2 * _GAP)
    for row in rows:
        cells = {i: cell_lines(i, row[i]) for i in shown}
        for k in range(max(len(c) for c in cells.values())):
            lines.append(
                (" " * _GAP).join(
                    (cells[i][k] if k < len(cells[i]) else "").ljust(widths[i])
                    for i in shown
                )
            )
        for i in below:
            if row[i]:
                lines += textwrap.wrap(
                    f"{columns[i]}: {row[i]}",
                    max(width or 0, len(indent) + _MIN_WRAPPED),
                    initial_indent=indent,
                    subsequent_indent=indent + " " * (len(columns[i]) + 2),
                    break_on_hyphens=False,
                )
    return lines


def rich_table(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    styles: Sequence[str | None] | None = None,
    caption: str | None = None,
    wrap: Collection[str] = (),
    shrink: Collection[str] = (),
) -> Any:
    """A ``rich.table.Table`` (requires rich), which rich fits to its console.

    With ``wrap`` or ``shrink`` named (as for `render_table`), rich narrows
    those columns first: the ``wrap`` columns wrap their text and keep room
    for a few words, the ``shrink`` columns wrap at spaces and cut longer
    words with "…"; the other columns keep their text on one line. Without
    them, every column folds its text when the table is too wide.
    """
    from rich.table import Table

    table = Table(title=title or None, caption=caption, show_lines=False)
    for col in columns:
        numeric = col in _NUMERIC_COLUMNS
        options: dict[str, Any] = {"overflow": "fold"}
        if col in wrap:
            pass
        elif col in shrink:
            options["overflow"] = "ellipsis"
        elif wrap or shrink:
            options["no_wrap"] = True
        table.add_column(col, justify="right" if numeric else "left", **options)
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
