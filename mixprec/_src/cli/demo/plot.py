"""The demo's figure: loss curves and loss-scale traces, one row per workload.

Uses matplotlib's non-interactive Agg backend (no display needed), selected
without touching the global backend of a user's session.
"""

from __future__ import annotations

import pathlib
import textwrap
from collections.abc import Sequence

import numpy as np

from ...workloads.train import RunResult
from .report import group_by_workload


_STYLES = {
    "float32": "-",
    "mixed_bfloat16": "--",
    "mixed_float16": ":",
    "mixed_float8": "-.",
}
_COLORS = {
    "float32": "tab:blue",
    "mixed_bfloat16": "tab:green",
    "mixed_float16": "tab:red",
    "mixed_float8": "tab:purple",
}


def smooth(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing moving average that ignores non-finite values.

    Examples:
      >>> smooth([1.0, 3.0, float("nan"), 5.0], 2).tolist()
      [1.0, 2.0, 3.0, 5.0]
    """
    x = np.asarray(values, dtype=np.float64)
    ok = np.isfinite(x)
    csum = np.concatenate([[0.0], np.cumsum(np.where(ok, x, 0.0))])
    ccount = np.concatenate([[0], np.cumsum(ok)])
    idx = np.arange(1, len(x) + 1)
    lo = np.maximum(idx - window, 0)
    count = ccount[idx] - ccount[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(
            count > 0, (csum[idx] - csum[lo]) / np.maximum(count, 1), np.nan
        )


def save_figure(
    results: Sequence[RunResult], path: pathlib.Path, *, titles: dict[str, str]
) -> pathlib.Path:
    """Writes the PNG and returns its path.

    Left: training loss per step (a moving average over ~2% of the run) for each
    precision. Right: the loss scale per step (log2), with skipped steps marked.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:  # pragma: no cover - exercised without the extra
        raise ImportError(
            "`mixprec demo` requires `matplotlib` for its plot; install with "
            "`pip install 'mixprec[cli]'` or pass `--no-plot`."
        ) from e

    groups = [
        (name, [r for r in group if not r.error])
        for name, group in group_by_workload(results).items()
    ]
    groups = [(name, g) for name, g in groups if g]
    nrows = max(len(groups), 1)
    fig = Figure(figsize=(12, 3.6 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, 2, squeeze=False)
    for (name, group), (ax_loss, ax_scale) in zip(groups, axes, strict=False):
        for r in group:
            color = _COLORS.get(r.precision)
            label = (
                r.precision
                if r.mechanism in ("float32", r.precision)
                else (f"{r.precision} ({r.mechanism})")
            )
            steps = np.arange(1, len(r.losses) + 1)
            window = max(1, len(r.losses) // 50)
            ax_loss.plot(steps, r.losses, color=color, alpha=0.2, linewidth=0.8)
            ax_loss.plot(
                steps,
                smooth(r.losses, window),
                color=color,
                linestyle=_STYLES.get(r.precision, "-"),
                linewidth=1.6,
                label=label,
            )
            if r.loss_scaling == "NoOpLossScale" or not r.loss_scales:
                continue  # float32 / bfloat16: no loss scaling to show
            scales = np.log2(np.maximum(np.asarray(r.loss_scales, np.float64), 1e-30))
            ax_scale.step(steps, scales, where="post", color=color, label=label)
            drops = np.nonzero(np.diff(scales) < 0)[0] + 2
            if len(drops):
                ax_scale.plot(drops, scales[drops - 1], "v", color=color, markersize=4)
        title = textwrap.fill(titles.get(name, ""), 90)
        ax_loss.set_title(f"{name}: training loss\n{title}", fontsize=8)
        ax_loss.set_xlabel("step")
        ax_loss.set_ylabel("cross-entropy (nats)")
        ax_loss.legend(fontsize=8)
        ax_loss.grid(alpha=0.3)
        ax_scale.set_title(
            f"{name}: dynamic loss scale (v = backed off, step skipped)", fontsize=9
        )
        ax_scale.set_xlabel("step")
        ax_scale.set_ylabel("log2(loss scale)")
        ax_scale.yaxis.set_major_locator(MaxNLocator(integer=True))
        if ax_scale.lines:
            ax_scale.legend(fontsize=8)
        else:
            ax_scale.text(
                0.5,
                0.5,
                "no loss scaling in these runs\n(float32 and bfloat16 need none)",
                ha="center",
                va="center",
                transform=ax_scale.transAxes,
            )
        ax_scale.grid(alpha=0.3)
    if not groups:
        axes[0][0].text(0.5, 0.5, "no successful runs", ha="center", va="center")
    fig.suptitle("mixprec demo: float32 vs mixed precision", fontsize=12)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
