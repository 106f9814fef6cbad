"""Progress bars and result tables for ``mixprec demo`` (rich), plus markdown/JSON.

``rich`` is imported lazily by the functions that draw; the markdown and JSON
writers need only the standard library.
"""

from __future__ import annotations

import contextlib
import json
import math
import pathlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ...workloads.train import RunResult


MiB = 1024.0 * 1024.0

COLUMNS = (
    "precision",
    "eval loss",
    "vs float32",
    "accuracy",
    "ms/step",
    "speed-up",
    "XLA temp MiB",
    "saved-for-bwd MiB",
    "device peak MiB",
    "skipped",
    "loss scale",
)
_PEAK = COLUMNS.index("device peak MiB")


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / MiB:.1f}"


def _num(value: float, fmt: str) -> str:
    return "n/a" if value is None or not math.isfinite(value) else format(value, fmt)


def _percent(value: float) -> str:
    return "n/a" if not math.isfinite(value) else f"{value * 100:.1f}%"


def _scale(value: float | None, kind: str = "") -> str:
    if value is None:
        return "n/a"
    if kind == "NoOpLossScale":
        return "none"
    exp = math.log2(value)
    return f"2^{exp:.0f}" if exp.is_integer() else f"{value:.4g}"


def seed_range(base: RunResult | None) -> float | None:
    """The seed-to-seed range (max - min) of a run's eval losses, when it was
    trained with two seeds or more.

    Examples:
      >>> r = RunResult("lm", "float32", "float32", 9)
      >>> r.seed_eval_losses = {0: 2.10, 1: 2.14, 2: 2.11}
      >>> round(seed_range(r), 4), seed_range(RunResult("lm", "float32", "f", 9))
      (0.04, None)
    """
    if base is None:
        return None
    losses = [v for v in base.seed_eval_losses.values() if math.isfinite(v)]
    return max(losses) - min(losses) if len(losses) >= 2 else None


def versus(r: RunResult, base: RunResult | None) -> str:
    """The "vs float32" cell: the eval-loss difference, judged by the seed range.

    A difference smaller than float32's seed-to-seed range is *within seed
    range*: this run cannot tell the precisions apart.

    Examples:
      >>> base = RunResult("lm", "float32", "float32", 9, eval_loss=2.10)
      >>> base.seed_eval_losses = {0: 2.10, 1: 2.14, 2: 2.11}
      >>> versus(base, base)
      'seed range 0.0400'
      >>> versus(RunResult("lm", "mixed_bfloat16", "autocast", 9, eval_loss=2.12), base)
      '+0.0200 within seed range'
      >>> versus(RunResult("lm", "mixed_float16", "autocast", 9, eval_loss=2.30), base)
      '+0.2000 = 5.0x seed range'
    """
    spread = seed_range(base)
    if base is None or not math.isfinite(base.eval_loss):
        return "n/a"
    if r is base:
        if spread is None:
            return "-"
        return f"seed range {spread:.4f}"
    diff = r.eval_loss - base.eval_loss
    if not math.isfinite(diff):
        return "n/a"
    if spread is None:
        return f"{diff:+.4f}"
    if abs(diff) < spread:
        return f"{diff:+.4f} within seed range"
    times = abs(diff) / spread if spread > 0 else math.inf
    return f"{diff:+.4f} = {times:.1f}x seed range"


def seed_notes(results: Sequence[RunResult]) -> list[str]:
    """One line per workload whose float32 run was trained with several seeds:
    the eval losses per seed and what "within seed range" means.

    Examples:
      >>> base = RunResult("lm", "float32", "float32", 9, eval_loss=2.10)
      >>> base.seed_eval_losses = {0: 2.10, 1: 2.14}
      >>> print(seed_notes([base])[0])
      lm: float32 eval loss over seeds 0, 1: 2.1000, 2.1400 (range 0.0400). ...
    """
    notes = []
    for name, group in group_by_workload(results).items():
        base = next((r for r in group if r.precision == "float32"), None)
        spread = seed_range(base)
        if base is None or spread is None:
            continue
        seeds = sorted(base.seed_eval_losses)
        notes.append(
            f"{name}: float32 eval loss over seeds "
            f"{', '.join(map(str, seeds))}: "
            f"{', '.join(f'{base.seed_eval_losses[s]:.4f}' for s in seeds)} "
            f"(range {spread:.4f}). A mixed precision whose eval loss differs from "
            "float32's (same seed, same batches) by less than this range is "
            "within seed range: the precisions cannot be told apart by this run."
        )
    return notes


def rows(results: Sequence[RunResult]) -> list[list[str]]:
    """Table rows for the runs of one workload; speed-ups are against its float32 run.

    Examples:
      >>> r = RunResult("digits", "float32", "float32", 10, step_times_s=[0.01] * 10)
      >>> rows([r])[0][:6]
      ['float32', 'n/a', 'n/a', 'n/a', '10.00', '1.00x']
    """
    base = next((r for r in results if r.precision == "float32" and not r.error), None)
    out = []
    for r in results:
        name = r.precision
        if r.float8_flop_fraction is not None:
            name += f" ({r.float8_flop_fraction:.0%} fp8)"
        if r.error:
            out.append([name, *(["-"] * (len(COLUMNS) - 2)), f"skipped: {r.error}"])
            continue
        speed = speed_cell(r, base)
        out.append(
            [
                name,
                _num(r.eval_loss, ".4f"),
                versus(r, base),
                _percent(r.eval_accuracy),
                _num(r.median_step_s * 1e3, ".2f"),
                speed,
                _mib(r.memory.get("temp_bytes")),
                _mib(r.memory.get("residual_bytes")),
                _mib(r.memory.get("device_peak_bytes")),
                str(r.skipped_steps),
                _scale(r.final_loss_scale, r.loss_scaling),
            ]
        )
    return out


def speed_detail(r: RunResult, base: RunResult | None) -> dict[str, Any]:
    """A run's speed-up over float32 and its run-to-run noise, for the JSON.

    ``speedup_vs_float32`` is float32's median step time over this run's;
    ``speedup_round_range`` the lowest and highest ratio of the interleaved
    rounds (round against round); ``speedup_within_noise`` whether that range
    includes 1.0, so that the run cannot tell the two step times apart.

    Examples:
      >>> b = RunResult("lm", "float32", "float32", 9, round_times_s=[1.0, 1.2, 1.0])
      >>> r = RunResult("lm", "mixed_float16", "autocast", 9,
      ...               round_times_s=[0.9, 1.0, 1.1])
      >>> d = speed_detail(r, b)
      >>> round(d["speedup_vs_float32"], 2), d["speedup_within_noise"]
      (1.0, True)
    """
    from ...workloads import timing

    if base is None or r.error or not r.median_step_s > 0:
        return {
            "speedup_vs_float32": math.nan,
            "speedup_round_range": None,
            "speedup_within_noise": False,
        }
    spread = timing.round_ratios(base.round_times_s, r.round_times_s)
    return {
        "speedup_vs_float32": base.median_step_s / r.median_step_s,
        "speedup_round_range": None if spread is None else list(spread),
        "speedup_within_noise": r is not base and timing.within_noise(spread),
    }


def speed_cell(r: RunResult, base: RunResult | None) -> str:
    """The "speed-up" cell: ``"1.21x"``, or ``"1.21x within noise"`` when the
    interleaved rounds disagree on which of the two is faster.

    Examples:
      >>> b = RunResult("lm", "float32", "float32", 9, round_times_s=[1.0, 1.2, 1.0])
      >>> r = RunResult("lm", "mixed_float16", "autocast", 9,
      ...               round_times_s=[0.9, 1.0, 1.1])
      >>> speed_cell(b, b), speed_cell(r, b)
      ('1.00x', '1.00x within noise')
    """
    d = speed_detail(r, base)
    if not math.isfinite(d["speedup_vs_float32"]):
        return "n/a"
    cell = f"{d['speedup_vs_float32']:.2f}x"
    return cell + " within noise" if d["speedup_within_noise"] else cell


def _noise_text(r: RunResult, base: RunResult | None) -> str:
    d = speed_detail(r, base)
    spread = d["speedup_round_range"]
    if spread is None:
        return ""
    lo, hi = spread
    if d["speedup_within_noise"]:
        return (
            f"; within run-to-run noise: its interleaved rounds ranged from "
            f"{lo:.2f}x to {hi:.2f}x float32, so this run cannot tell the two "
            "step times apart"
        )
    return f" (interleaved rounds: {lo:.2f}x-{hi:.2f}x)"


def _columns(table: list[list[str]]) -> tuple[list[str], list[list[str]]]:
    """Drops the device-peak column when no run has one (CPU)."""
    if any(row[_PEAK] not in ("n/a", "-") for row in table):
        return list(COLUMNS), table
    keep = [i for i in range(len(COLUMNS)) if i != _PEAK]
    return [COLUMNS[i] for i in keep], [[row[i] for i in keep] for row in table]


def group_by_workload(results: Sequence[RunResult]) -> dict[str, list[RunResult]]:
    groups: dict[str, list[RunResult]] = {}
    for r in results:
        groups.setdefault(r.workload, []).append(r)
    return groups


def markdown(
    results: Sequence[RunResult], titles: dict[str, str], meta: dict[str, Any]
) -> str:
    """The tables as GitHub markdown, one per workload, with the run's metadata.

    Examples:
      >>> r = RunResult("digits", "float32", "float32", 10, step_times_s=[0.01] * 10)
      >>> print(markdown([r], {"digits": "MLP"}, {"device": "cpu"}).splitlines()[0])
      # mixprec demo
    """
    lines = ["# mixprec demo", ""]
    lines += [
        f"- {k}: {v}" for k, v in meta.items() if k not in ("why slower", "why faster")
    ]
    for name, group in group_by_workload(results).items():
        lines += ["", f"## {name}: {titles.get(name, '')}".rstrip(), ""]
        mechs = sorted({r.mechanism for r in group} - {"float32"})
        if mechs:
            lines += [f"mixed precision via: {', '.join(mechs)}", ""]
        cols, table = _columns(rows(group))
        lines.append("| " + " | ".join(cols) + " |")
        lines.append("|" + "---|" * len(cols))
        lines += ["| " + " | ".join(row) + " |" for row in table]
    spreads = seed_notes(results)
    if spreads:
        lines += [""] + [f"- {n}" for n in spreads]
    notes = list(meta.get("why slower", []))
    if notes:
        lines += ["", "Slower than float32, and why:", ""]
        lines += [f"- {n}" for n in notes]
    faster = list(meta.get("why faster", []))
    if faster:
        lines += ["", FASTER_HEADING, ""]
        lines += [f"- {n}" for n in faster]
    lines += ["", NOTES]
    return "\n".join(lines) + "\n"


def matmul_support(platform: str, cpu_bf16: Any = None) -> str:
    """One line for the run's metadata: which 16-bit matmuls are native here.

    Args:
      platform: JAX's backend (``"cpu"``, ``"gpu"``, ``"tpu"``).
      cpu_bf16: on CPU, the
        :class:`~mixprec._src.autocast.capability.Capability` of bfloat16.

    Examples:
      >>> from mixprec._src.autocast.capability import Capability
      >>> cap = Capability(False, "CPU features", "no AVX512BF16")
      >>> print(matmul_support("cpu", cap))
      bfloat16: no native bfloat16 matmul (no AVX512BF16; ...
    """
    if platform != "cpu":
        return f"{platform}: bfloat16 and float16 matmuls run natively"
    if cpu_bf16 is not None and cpu_bf16.native:
        bf16 = f"{cpu_bf16.describe()}: bfloat16 GEMMs"
    elif cpu_bf16 is not None:
        bf16 = (
            f"{cpu_bf16.describe()}: float32 GEMMs on bfloat16-rounded operands "
            "(memory saved, no speed-up expected)"
        )
    else:
        bf16 = "unknown"
    return (
        f"bfloat16: {bf16}; float16: no native CPU matmul in XLA (float32 GEMMs "
        "on float16-rounded operands: memory saved, no speed-up)"
    )


def _speed(r: RunResult, base: RunResult | None) -> float:
    if base is None or r.error or not r.median_step_s > 0:
        return math.nan
    return base.median_step_s / r.median_step_s


def speed_notes(
    results: Sequence[RunResult],
    *,
    platform: str,
    cpu_bf16: Any = None,
    load: float | None = None,
) -> list[str]:
    """Why each mixed-precision run that is slower than float32 is slower.

    A slowdown is never shown without a reason: the known causes on this
    backend (no native matmul in that dtype, hand-written casts that XLA:CPU
    upcasts), else what is left (small matrices, load from other processes).

    Args:
      results: the runs of one or more workloads.
      platform: JAX's backend.
      cpu_bf16: on CPU, the bfloat16 capability (see :func:`matmul_support`).
      load: the 1-minute load average while timing, if known.

    Returns:
      One line per slower run, ``"<workload> <precision>: 0.62x float32 - why"``.

    Examples:
      >>> r32 = RunResult("lm", "float32", "float32", 9, round_times_s=[0.01])
      >>> r16 = RunResult("lm", "mixed_float16", "autocast", 9, round_times_s=[0.02])
      >>> print(speed_notes([r32, r16], platform="cpu")[0])
      lm mixed_float16: 0.50x float32 - XLA:CPU has no float16 matmul...
    """
    notes = []
    for group in group_by_workload(results).values():
        base = next(
            (r for r in group if r.precision == "float32" and not r.error), None
        )
        for r in group:
            speed = _speed(r, base)
            if r.precision == "float32" or not math.isfinite(speed) or speed >= 1.0:
                continue
            why = _why_slower(r, platform, cpu_bf16, load)
            noise = _noise_text(r, base)
            if noise:
                why = why.rstrip(".") + noise + "."
            notes.append(f"{r.workload} {r.precision}: {speed:.2f}x float32 - {why}")
    return notes


FASTER_HEADING = "Faster than float32 with no native matmul in its dtype, and why:"


def faster_notes(results: Sequence[RunResult], *, platform: str) -> list[str]:
    """Why a float16 run is faster than float32 on a CPU, which has no float16
    matmul: its dots run as float32 GEMMs on float16-rounded operands, so a
    faster step is either noise or comes from the work outside the matmuls.

    Examples:
      >>> r32 = RunResult("lm", "float32", "float32", 9, round_times_s=[1.0, 1.1])
      >>> r16 = RunResult("lm", "mixed_float16", "autocast", 9,
      ...                 round_times_s=[0.8, 0.9])
      >>> print(faster_notes([r32, r16], platform="cpu")[0])
      lm mixed_float16: 1.24x float32, although XLA:CPU has no float16 matmul: ...
    """
    if platform != "cpu":
        return []
    notes = []
    for group in group_by_workload(results).values():
        base = next(
            (r for r in group if r.precision == "float32" and not r.error), None
        )
        for r in group:
            speed = _speed(r, base)
            if base is None or r.precision != "mixed_float16" or not speed > 1.0:
                continue
            saved, saved32 = (x.memory.get("residual_bytes") for x in (r, base))
            bytes_text = (
                f" ({_mib(saved)} MiB saved for the backward pass against "
                f"float32's {_mib(saved32)} MiB)"
                if saved is not None and saved32 is not None
                else ""
            )
            if speed_detail(r, base)["speedup_within_noise"]:
                cause = _noise_text(r, base).removeprefix("; ")
            else:
                cause = (
                    "the dots run as float32 GEMMs on float16-rounded operands, "
                    "so what is faster is the work around them: the activations "
                    "and the elementwise ops in float16, half the bytes to move"
                    f"{bytes_text}, or a change of load between rounds"
                    + _noise_text(r, base)
                )
            notes.append(
                f"{r.workload} {r.precision}: {speed:.2f}x float32, although "
                f"XLA:CPU has no float16 matmul: {cause}."
            )
    return notes


def _why_slower(r: RunResult, platform: str, cpu_bf16: Any, load: float | None) -> str:
    busy = (
        f"; the machine was busy (load average {load:.1f}), which makes "
        "step times noisy"
        if load is not None and load >= 1.0
        else ""
    )
    if platform != "cpu":
        return (
            "no known cause on this backend: small models do not keep the device "
            f"busy (try --size full){busy}"
        )
    if r.precision == "mixed_float8":
        return (
            "CPUs have no float8 arithmetic: float8 products are emulated "
            "(quantized operands multiplied in bfloat16 with float32 "
            "accumulation, scales applied after), so they are slower than "
            f"bfloat16 by design; the run is there for its accuracy{busy}."
        )
    if r.precision == "mixed_float16":
        return (
            "XLA:CPU has no float16 matmul: float16 dots run as float32 GEMMs on "
            "float16-rounded operands, so float16 cannot be faster than float32 "
            "on a CPU; what it saves is memory (saved-for-bwd), at the cost of "
            "the rounding passes and loss scaling. Use bfloat16 for speed on a "
            f"CPU with native bfloat16 matmuls{busy}."
        )
    if r.mechanism == "manual":
        return (
            "hand-written casting gives bfloat16 x bfloat16 -> bfloat16 dots, which "
            "XLA:CPU converts to float32 dots (docs/performance.md); the autocast "
            f"mechanism formulates them for the CPU{busy}."
        )
    if cpu_bf16 is not None and not cpu_bf16.native:
        return (
            f"this CPU has {cpu_bf16.describe()}, so the dots run as float32 "
            "GEMMs on bfloat16-rounded operands: no faster than float32 by "
            "design; the gap is the cost of rounding operands and activations, "
            f"bought for the memory saved (saved-for-bwd){busy}."
        )
    if cpu_bf16 is not None and cpu_bf16.forced:
        return (
            f"bfloat16 GEMMs were forced ({cpu_bf16.describe()}): on a CPU "
            "without AVX-512 BF16 or AMX-BF16 they are slower than float32 "
            "ones, and there the automatic choice is float32 GEMMs on "
            f"bfloat16-rounded operands{busy}."
        )
    return (
        "no known cause: bfloat16 matmuls are native here, but at these sizes "
        "the rounding passes can cost more than the GEMMs save (try --size "
        f"full){busy}."
    )


NOTES = (
    "vs float32: eval loss minus float32's (same seed and batches), and how it "
    "compares with float32's seed-to-seed range (--seeds): 'within seed range' "
    "means this run cannot tell the two apart. "
    "ms/step: median over 3 interleaved timing rounds (up to 10 steps of every "
    "precision per round, after training; compilation not counted). speed-up: "
    "float32's ms/step / this run's; 'within noise' when float32 was faster in "
    "some interleaved rounds and slower in others (results.json has each "
    "run's range of per-round ratios, `speedup_round_range`). "
    "XLA temp: temporary buffers of the compiled training step "
    "(`compiled.memory_analysis()`). saved-for-bwd: bytes the forward pass keeps "
    "for the backward pass. device peak (GPU only): the backend's peak bytes in "
    "use, a process-wide high-water mark. skipped: steps whose gradients were not "
    "finite (update skipped, loss scale backed off). loss scale: the final scale "
    "(dynamic for mixed_float16). mixed_float8 (N% fp8): matmuls in float8 "
    "(tensorwise current scaling) for N% of the forward pass's FLOPs; the rest "
    "as mixed_bfloat16. CPUs have no float8 arithmetic: it is emulated, slower "
    "than bfloat16, and shown for its accuracy."
)


def write_json(
    path: pathlib.Path, results: Sequence[RunResult], meta: dict[str, Any]
) -> None:
    runs = []
    for group in group_by_workload(results).values():
        base = next(
            (r for r in group if r.precision == "float32" and not r.error), None
        )
        runs += [{**r.to_dict(), **speed_detail(r, base)} for r in group]
    payload = {"meta": meta, "runs": runs}
    path.write_text(json.dumps(payload, indent=2, allow_nan=True) + "\n")


def print_tables(
    results: Sequence[RunResult], titles: dict[str, str], *, console: Any = None
) -> None:
    """Prints one rich table per workload."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    for name, group in group_by_workload(results).items():
        mechs = sorted({r.mechanism for r in group} - {"float32"})
        title = f"{name}: {titles.get(name, '')}"
        if mechs:
            title += f"\nmixed precision via: {', '.join(mechs)}"
        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
        cols, body = _columns(rows(group))
        for i, col in enumerate(cols):
            table.add_column(
                col,
                justify="left" if i == 0 else "right",
                no_wrap=i == 0 or col == "vs float32",
            )
        for row in body:
            table.add_row(*row)
        console.print(table)


class Progress:
    """Progress of the demo's runs on stderr: rich bars on a terminal, plain lines
    elsewhere, or nothing when ``enabled`` is false.

    Where stderr is not a terminal (a file, a pipe, a CI log) a bar would be
    drawn only when its run has finished, so plain lines are printed instead,
    each as it happens: one per phase (:meth:`phase`), one when a run starts,
    one every ``heartbeat_s`` seconds while it runs and one when it ends, each
    with the seconds since the start and, once a run has finished, an estimate
    of the time left extrapolated from the finished work (seconds per training
    step so far, times the steps left of ``total_steps``).

    Examples:
      >>> import io
      >>> out, now = io.StringIO(), iter([0.0, 0.0, 1.0, 2.0]).__next__
      >>> p = Progress(plain=True, stream=out, total_steps=4, clock=now)
      >>> with p.session():
      ...     on_step = p.task("digits float32", 2)
      ...     on_step(0, 2.5); on_step(1, 2.25)
      >>> print(out.getvalue(), end="")
      [    0 s] digits float32: 2 steps ...
      [    2 s] digits float32: done, 2 steps in 2 s, loss 2.2500;
      2 of 4 steps done, about 2 s left
    """

    def __init__(
        self,
        *,
        enabled: bool = True,
        console: Any = None,
        plain: bool | None = None,
        stream: Any = None,
        total_steps: int = 0,
        heartbeat_s: float = 30.0,
        clock: Callable[[], float] | None = None,
    ):
        import sys
        import time

        self.enabled = enabled
        self._console = console
        if plain is None:
            plain = console is None or not getattr(console, "is_terminal", False)
        self.plain = plain
        self._stream = stream if stream is not None else sys.stderr
        self.total_steps = total_steps
        self.done_steps = 0
        self._last_rate: float | None = None  # seconds per step, last run
        self.heartbeat_s = heartbeat_s
        self._clock = clock or time.perf_counter
        self._start = self._clock()
        self._progress: Any = None

    def elapsed(self) -> float:
        """Seconds since the progress started."""
        return self._clock() - self._start

    def eta(self, now: float | None = None) -> float | None:
        """Seconds left: the steps left times the seconds per step of the last
        finished run (its compilation included), which follows
        changes of load and of workload better than the average since the
        start; that average before any run has finished, ``None`` without
        ``total_steps``."""
        if not self.done_steps or not self.total_steps:
            return None
        now = self.elapsed() if now is None else now
        left = max(self.total_steps - self.done_steps, 0)
        rate = self._last_rate if self._last_rate is not None else now / self.done_steps
        return rate * left

    def _line(self, message: str, now: float | None = None) -> None:
        now = self.elapsed() if now is None else now
        print(f"[{now:5.0f} s] {message}", file=self._stream, flush=True)

    def phase(self, message: str) -> None:
        """One line for a phase of the demo (loading a workload, timing)."""
        if not self.enabled:
            return
        if self.plain:
            self._line(message)
        elif self._console is not None:
            self._console.print(message)

    @contextlib.contextmanager
    def session(self) -> Iterator[Progress]:
        if not self.enabled or self.plain:
            yield self
            return
        from rich import progress as rp

        self._progress = rp.Progress(
            rp.TextColumn("{task.description:<34}"),
            rp.BarColumn(),
            rp.MofNCompleteColumn(),
            rp.TextColumn("loss {task.fields[loss]:>7}"),
            rp.TimeElapsedColumn(),
            console=self._console,
        )
        with self._progress:
            yield self
        self._progress = None

    def task(self, description: str, total: int) -> Callable[[int, float], None]:
        """Starts a run of ``total`` steps; returns the ``on_step(step, loss)``
        callback that reports it."""
        if not self.enabled:
            return lambda step, loss: None
        if self.plain:
            return self._plain_task(description, total)
        if self._progress is None:
            return lambda step, loss: None
        progress = self._progress
        task_id = progress.add_task(description, total=total, loss="   -")

        def on_step(step: int, loss: float) -> None:
            progress.update(task_id, completed=step + 1, loss=f"{loss:.4f}")

        return on_step

    def _plain_task(self, description: str, total: int) -> Callable[[int, float], None]:
        start = self.elapsed()
        self._line(f"{description}: {total} steps ...", start)
        last = [start]

        def on_step(step: int, loss: float) -> None:
            now = self.elapsed()
            if step + 1 >= total:
                self.done_steps += total
                self._last_rate = (now - start) / max(total, 1)
                eta = self.eta(now)
                tail = (
                    f"; {self.done_steps} of {self.total_steps} steps done"
                    + ("" if eta is None else f", about {_duration(eta)} left")
                    if self.total_steps
                    else ""
                )
                self._line(
                    f"{description}: done, {total} steps in {_duration(now - start)}"
                    f", loss {loss:.4f}{tail}",
                    now,
                )
            elif now - last[0] >= self.heartbeat_s:
                last[0] = now
                self._line(
                    f"{description}: step {step + 1}/{total}, loss {loss:.4f}", now
                )

        return on_step


def _duration(seconds: float) -> str:
    """``"42 s"`` or ``"3 min 05 s"``.

    Examples:
      >>> _duration(42.4), _duration(185.0)
      ('42 s', '3 min 05 s')
    """
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    return f"{seconds // 60} min {seconds % 60:02d} s"
