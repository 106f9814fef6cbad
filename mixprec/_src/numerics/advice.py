"""What ``mixprec.diagnose`` advises: a ``float32_scope`` around the line of an
offending op, ops for the black list (the last resort), a loss scale.

Pure functions of what the diagnosis measured, so each can be tested on its own.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from mixprec._src.numerics.record import parse_source, short_source


__all__ = [
    "GradientHistogram",
    "ScopeFix",
    "advise_black_list",
    "problem_sites",
    "merge_black_list",
    "suggest_loss_scale",
]

_FLOAT16_MAX = 65504.0
_FLOAT16_TINY = 2.0**-14  # smallest normal float16 (6.1e-5)
_MAX_LOSS_SCALE = 2.0**24
_EXP_OFFSET = 1100


class _SiteStats(Protocol):
    """What the advice reads of an op's diagnosis (read-only)."""

    @property
    def index(self) -> int: ...

    @property
    def primitive(self) -> str: ...

    @property
    def source(self) -> str: ...

    @property
    def layer(self) -> str: ...

    @property
    def call_site(self) -> str: ...

    @property
    def backward(self) -> bool: ...

    @property
    def decision(self) -> str: ...

    @property
    def overflow(self) -> int: ...

    @property
    def underflow(self) -> int: ...

    @property
    def cast_overflow(self) -> int: ...

    @property
    def cast_underflow(self) -> int: ...

    @property
    def local_rel_error(self) -> float: ...


def merge_black_list(spec: Mapping[str, Any] | None, ops: Sequence[str]) -> dict:
    """``spec`` (a ``modify_mixlist`` dict) with ``ops`` moved to the black list.

    Conflicting entries of ``spec`` (an op removed from the black list, or added
    to the white or gray list) are dropped so that the result is valid.

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


def problem_sites(sites: Sequence[_SiteStats], tolerance: float) -> list[Any]:
    """Forward ops that run low and overflow, or whose underflow costs more than
    ``tolerance`` relative error in their own low-precision run."""
    found = []
    for s in sites:
        if s.backward or s.decision != "low":
            continue
        over = s.overflow + s.cast_overflow
        under = s.underflow + s.cast_underflow
        if over or (under and s.local_rel_error >= tolerance):
            found.append(s)
    return found


def advise_black_list(sites: Sequence[_SiteStats], tolerance: float) -> tuple[str, ...]:
    """The primitives of :func:`problem_sites`, each once."""
    return tuple(dict.fromkeys(s.primitive for s in problem_sites(sites, tolerance)))


@dataclasses.dataclass(frozen=True)
class ScopeFix:
    """Wrap one line of the user's code in ``mixprec.float32_scope()``.

    Attributes:
      line: the user source line, ``"file.py:LINE (function)"``: the op's own
        line, or the user's line that called the layer it is in.
      primitive: the offending op.
      layer: its layer (:attr:`OpRecord.layer`), or ``""``.
      problem: ``"overflow"`` or ``"underflow"``.
      index: the op's index in the report.

    Examples:
      >>> fix = ScopeFix("/a/model.py:12 (f)", "mul", "Net/Dense_0", "overflow", 3)
      >>> print(fix.message())  # doctest: +NORMALIZE_WHITESPACE
      mul in Net/Dense_0 at model.py:12 (f) overflows: wrap line 12 of
      model.py in `with mixprec.float32_scope():`
    """

    line: str
    primitive: str
    layer: str
    problem: str
    index: int

    def message(self) -> str:
        """One line: the op, where it is, and the edit."""
        file, number, _ = parse_source(self.line)
        where = f" in {self.layer}" if self.layer else ""
        verb = "overflows" if self.problem == "overflow" else "underflows"
        return (
            f"{self.primitive}{where} at {short_source(self.line)} {verb}: wrap line "
            f"{number} of {os.path.basename(file)} in "
            "`with mixprec.float32_scope():`"
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        d = dataclasses.asdict(self)
        d["message"] = self.message()
        return d


def scope_fix(site: _SiteStats) -> ScopeFix | None:
    """The ``float32_scope`` fix of a problem site, or ``None`` when its user
    line is unknown."""
    line = site.call_site or site.source
    if parse_source(line)[1] is None:
        return None
    over = getattr(site, "overflow", 0) + getattr(site, "cast_overflow", 0)
    return ScopeFix(
        line=line,
        primitive=site.primitive,
        layer=site.layer,
        problem="overflow" if over else "underflow",
        index=site.index,
    )


class GradientHistogram:
    """A histogram of the binary exponents of backward-pass magnitudes."""

    def __init__(self) -> None:
        self.counts = np.zeros(2 * _EXP_OFFSET, np.int64)
        self.largest = 0.0

    def add(self, magnitudes: np.ndarray) -> None:
        """Adds non-zero finite magnitudes."""
        if not magnitudes.size:
            return
        self.largest = max(self.largest, float(magnitudes.max()))
        _, exps = np.frexp(magnitudes)
        self.counts += np.bincount(
            np.clip(exps + _EXP_OFFSET, 0, self.counts.size - 1),
            minlength=self.counts.size,
        )


def suggest_loss_scale(
    hist: GradientHistogram, low_dtype: np.dtype, loss_scale: float | None
) -> tuple[float | None, tuple[float, float] | None]:
    """An initial loss scale (a power of two) for float16, and the range of
    gradient magnitudes seen, unscaled.

    The 1st percentile of the magnitudes should land in float16's normal range,
    and the largest must stay below its maximum with one bit of headroom.
    bfloat16 (float32's range) needs no loss scale: the scale is None.
    """
    total = int(hist.counts.sum())
    if total == 0:
        return None, None
    scale0 = 1.0 if loss_scale is None else float(loss_scale)
    exps = np.arange(hist.counts.size) - _EXP_OFFSET  # |g| in [2**(e-1), 2**e)
    nonzero = np.nonzero(hist.counts)[0]
    lo = 2.0 ** float(exps[nonzero[0]] - 1) / scale0
    hi = hist.largest / scale0
    if np.dtype(low_dtype) != np.dtype(np.float16):
        return None, (lo, hi)
    cdf = np.cumsum(hist.counts) / total
    q_exp = float(exps[int(np.searchsorted(cdf, 0.01))] - 1)
    q = 2.0**q_exp / scale0
    needed = 2.0 ** math.ceil(math.log2(_FLOAT16_TINY / q))
    upper = 2.0 ** math.floor(math.log2(_FLOAT16_MAX / hi / 2.0)) if hi else math.inf
    scale = min(max(needed, 1.0), upper, _MAX_LOSS_SCALE)
    return float(max(scale, 1.0)), (lo, hi)
