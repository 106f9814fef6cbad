"""The demo's figure, one row per workload: loss curves, each mixed precision's
loss minus float32's (with float32's seed spread), and the loss-scale trace.

Uses matplotlib's non-interactive Agg backend (no display needed), selected
without touching the global backend of a user's session.
"""

from __future__ import annotations

import pathlib
import textwrap
from collections.abc import Sequence
from typing import Any

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


def _label(r: RunResult) -> str:
    if r.mechanism in ("float32", r.precision):
        return r.precision
    return f"{r.precision} ({r.mechanism})"


def loss_differences(
    group: Sequence[RunResult], window: int
) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """Each mixed precision's smoothed training loss minus float32's (same seed,
    same batches), and float32's own seed band: for each step, the lowest and
    highest of (float32 with another seed) minus (float32 with the run's seed),
    zero included, or ``None`` without other seeds.

    Examples:
      >>> f32 = RunResult("lm", "float32", "float32", 3, losses=[2.0, 1.0, 0.5])
      >>> f32.seed_losses = {1: [2.1, 1.2, 0.4]}
      >>> bf16 = RunResult("lm", "mixed_bfloat16", "autocast", 3,
      ...                  losses=[2.0, 1.1, 0.6])
      >>> diffs, band = loss_differences([f32, bf16], 1)
      >>> np.round(diffs["mixed_bfloat16 (autocast)"], 2).tolist()
      [0.0, 0.1, 0.1]
      >>> np.round(band, 2).tolist()
      [[0.0, 0.0, -0.1], [0.1, 0.2, 0.0]]
    """
    base = next((r for r in group if r.precision == "float32"), None)
    if base is None or not base.losses:
        return {}, None
    ref = smooth(base.losses, window)
    diffs = {}
    for r in group:
        if r is base or len(r.losses) != len(base.losses):
            continue
        diffs[_label(r)] = smooth(r.losses, window) - ref
    others = [
        smooth(v, window) - ref
        for v in base.seed_losses.values()
        if len(v) == len(base.losses)
    ]
    if not others:
        return diffs, None
    stack = np.stack([np.zeros_like(ref), *others])
    return diffs, np.stack([np.nanmin(stack, axis=0), np.nanmax(stack, axis=0)])


def make_figure(results: Sequence[RunResult], *, titles: dict[str, str]) -> Any:
    """The demo's figure (a matplotlib ``Figure``, not shown or saved).

    One row per workload. Left: training loss per step for each precision (a
    moving average over ~2% of the run; the raw per-step loss faint behind it).
    Middle: each mixed precision's smoothed loss minus float32's, where the
    precisions that lie on top of each other on the left are told apart, with
    float32's own seed-to-seed band shaded (when float32 ran several seeds): a
    difference inside the band is no bigger than a change of seed. Right: the
    loss scale per step (log2), with the back-offs marked.
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
    fig = Figure(figsize=(17, 4.2 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, 3, squeeze=False)
    for (name, group), (ax_loss, ax_diff, ax_scale) in zip(groups, axes, strict=False):
        window = max(1, max(len(r.losses) for r in group) // 50)
        for i, r in enumerate(group):
            color = _COLORS.get(r.precision)
            label = _label(r)
            steps = np.arange(1, len(r.losses) + 1)
            ax_loss.plot(
                steps,
                r.losses,
                color=color,
                alpha=0.2,
                linewidth=0.8,
                label="per-step loss (faint, each precision's colour)"
                if i == 0
                else None,
            )
            ax_loss.plot(
                steps,
                smooth(r.losses, window),
                color=color,
                linestyle=_STYLES.get(r.precision, "-"),
                linewidth=1.6,
                label=f"{label} (moving average, {window} steps)",
            )
            if r.loss_scaling == "NoOpLossScale" or not r.loss_scales:
                continue  # float32 / bfloat16: no loss scaling to show
            scales = np.log2(np.maximum(np.asarray(r.loss_scales, np.float64), 1e-30))
            ax_scale.step(steps, scales, where="post", color=color, label=label)
            drops = np.nonzero(np.diff(scales) < 0)[0] + 2
            if len(drops):
                ax_scale.plot(
                    drops,
                    scales[drops - 1],
                    "v",
                    color=color,
                    markersize=4,
                    label=f"{label}: backed off, step skipped",
                )
        title = textwrap.fill(titles.get(name, ""), 70)
        ax_loss.set_title(f"{name}: training loss\n{title}", fontsize=8)
        ax_loss.set_xlabel("step")
        ax_loss.set_ylabel("cross-entropy (nats)")
        ax_loss.legend(fontsize=7)
        ax_loss.grid(alpha=0.3)
        # A wider window for the differences: per-step noise would hide them.
        _draw_differences(ax_diff, name, group, max(window, len(group[0].losses) // 15))
        ax_scale.set_title(f"{name}: dynamic loss scale", fontsize=9)
        ax_scale.set_xlabel("step")
        ax_scale.set_ylabel("log2(loss scale)")
        ax_scale.yaxis.set_major_locator(MaxNLocator(integer=True))
        if ax_scale.lines:
            ax_scale.legend(fontsize=7)
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
    return fig


def save_figure(
    results: Sequence[RunResult], path: pathlib.Path, *, titles: dict[str, str]
) -> pathlib.Path:
    """Writes :func:`make_figure` as a PNG and returns its path."""
    fig = make_figure(results, titles=titles)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def _draw_differences(
    ax: Any, name: str, group: Sequence[RunResult], window: int
) -> None:
    diffs, band = loss_differences(group, window)
    base = next((r for r in group if r.precision == "float32"), None)
    if base is None or (not diffs and band is None):
        ax.text(
            0.5,
            0.5,
            "needs a float32 run and a mixed one\n(-p float32,...)",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
        ax.set_axis_off()
        return
    steps = np.arange(1, len(base.losses) + 1)
    if band is not None:
        seeds = ", ".join(str(s) for s in sorted(base.seed_losses))
        ax.fill_between(
            steps,
            band[0],
            band[1],
            color=_COLORS["float32"],
            alpha=0.18,
            linewidth=0,
            label=f"float32 seed spread (seeds {seeds} minus seed {base.seed})",
        )
    ax.axhline(0.0, color=_COLORS["float32"], linewidth=1.0, label="float32 (zero)")
    for r in group:
        label = _label(r)
        if label in diffs:
            ax.plot(
                steps,
                diffs[label],
                color=_COLORS.get(r.precision),
                linestyle=_STYLES.get(r.precision, "-"),
                linewidth=1.4,
                label=f"{label} minus float32",
            )
    ax.set_title(
        f"{name}: training loss minus float32's (moving averages over {window} "
        "steps;\nsame seed and batches; shaded: float32 with other seeds)",
        fontsize=8,
    )
    ax.set_xlabel("step")
    ax.set_ylabel("difference (nats)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
