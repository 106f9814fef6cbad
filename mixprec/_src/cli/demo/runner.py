"""``mixprec demo``: run the workloads, print the tables, write JSON, markdown, PNG."""

from __future__ import annotations

import os
import pathlib
import time
from collections.abc import Sequence
from typing import Any

from ..errors import CLIError


def _meta(
    size: str, mechanism: str, seed: int, loss_scale_period: int
) -> dict[str, Any]:
    from ...workloads import timing

    env = timing.environment()
    return {
        "16-bit matmuls": _matmul_support(env["backend"]),
        "date": env["date"],
        "device": env["device"],
        "cpu": env["cpu_model"],
        "cpu cores": env["cpu_count"],
        "cpu flags": timing.flags_summary(env["cpu_flags"]),
        "load average at start (1, 5, 15 min)": _load_text(env["loadavg"]),
        "machine": env["machine"],
        "jax": env["jax"],
        "jaxlib": env["jaxlib"],
        "mixprec": env["mixprec"],
        "size": size,
        "mechanism": mechanism,
        "seed": seed,
        "loss scale (mixed_float16)": (
            f"dynamic, initial 2^15, x2 after {loss_scale_period} finite steps, "
            "/2 on inf/NaN"
        ),
    }


def _load_text(load: Any) -> str:
    """``"0.52, 0.31, 0.12"``, or ``"unknown"``.

    Examples:
      >>> _load_text([0.52, 0.31, 0.12]), _load_text(None)
      ('0.52, 0.31, 0.12', 'unknown')
    """
    return "unknown" if load is None else ", ".join(f"{x:.2f}" for x in load)


def _cpu_bf16(platform: str) -> Any:
    if platform != "cpu":
        return None
    from ...autocast import capability

    return capability.cpu_bf16()


def _matmul_support(platform: str) -> str:
    from .report import matmul_support

    return matmul_support(platform, _cpu_bf16(platform))


def run_demo(
    *,
    workloads: Sequence[str],
    precisions: Sequence[str],
    steps: int | None = None,
    size: str = "auto",
    batch_size: int | None = None,
    mechanism: str = "auto",
    out: str | os.PathLike[str] = "mixprec-out/demo",
    loss_scale_period: int = 100,
    seed: int = 0,
    seeds: int = 3,
    plot: bool = True,
    progress: bool = True,
    console: Any = None,
) -> int:
    """Runs the demo and writes its outputs; returns 0 when every run finished.

    Args:
      workloads: names from ``train.WORKLOADS``.
      precisions: names from ``train.PRECISIONS``; float32 is run first.
      steps: training steps per run (per-workload defaults when ``None``).
      size: ``"auto"``, ``"small"`` or ``"full"``.
      batch_size: overrides the per-size batch size.
      mechanism: ``"auto"``, ``"autocast"`` or ``"manual"``.
      out: output folder (created).
      loss_scale_period: growth period of the dynamic loss scale.
      seed: seeds parameters and data order (the same for every precision).
      seeds: float32 is trained with this many seeds (``seed``, ``seed + 1``,
        ...) to measure the seed-to-seed spread of its eval loss, against which
        the tables judge each mixed precision's difference; 1 skips it.
      plot: write ``demo.png``.
      progress: show progress bars (on stderr).
      console: a ``rich.console.Console`` for the tables (stdout by default).

    Raises:
      CLIError: bad options, an output folder that cannot be created, or runs
        that failed (raised after the other runs' results are written).
    """
    from rich.console import Console

    from ...workloads import train as train_lib
    from . import report

    if console is None:
        console = Console()
        if not console.is_terminal:  # piped or captured: don't squeeze the tables
            console = Console(width=max(console.width, 150))
    err_console = Console(stderr=True)
    t_start = time.perf_counter()
    out_dir = pathlib.Path(out)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CLIError(f"cannot create the output folder {str(out_dir)!r}: {e}") from e

    have_autocast = train_lib.autocast_available()
    if mechanism == "autocast" and not have_autocast:
        raise CLIError(
            "`--mechanism autocast` needs `mixprec.autocast`, which this build does "
            "not have; use `--mechanism manual`."
        )
    mech = (
        ("autocast" if have_autocast else "manual")
        if mechanism == "auto"
        else mechanism
    )
    order = [p for p in train_lib.PRECISIONS if p in precisions]
    size_name = train_lib.resolve_size(size)
    meta = _meta(size_name, mech, seed, loss_scale_period)
    if seeds > 1 and "float32" in order:
        meta["seeds (float32, for the spread)"] = ", ".join(
            str(seed + i) for i in range(seeds)
        )
    compiled: dict = {}  # compiled steps, reused by float32's other seeds

    results: list[train_lib.RunResult] = []
    titles: dict[str, str] = {}
    built: list[tuple[Any, int]] = []
    for name in workloads:
        err_console.print(
            f"[bold]{name}[/bold]: loading data and building the model ..."
        )
        try:
            workload = train_lib.make_workload(
                name, size=size_name, batch_size=batch_size
            )
        except ValueError as e:
            raise CLIError(str(e)) from e
        titles[name] = workload.title
        err_console.print(f"  {workload.title}")
        built.append((workload, steps if steps is not None else workload.steps))
    extra_seeds = max(seeds - 1, 0) if "float32" in order else 0
    total = sum(n * (len(order) + extra_seeds) for _, n in built)
    reporter = report.Progress(enabled=progress, console=err_console, total_steps=total)
    reporter.phase(
        f"{len(order) + extra_seeds} runs per workload, {total} training steps in "
        "all; the time they take depends on the CPU, its load and the sizes "
        "(on a terminal: bars; elsewhere: a line per run)"
    )
    for workload, n_steps in built:
        name = workload.name
        with reporter.session():
            for precision in order:
                on_step = reporter.task(f"{name} {precision}", n_steps)
                try:
                    result = train_lib.train(
                        workload,
                        precision,
                        mechanism=mech,
                        steps=n_steps,
                        seed=seed,
                        loss_scale_period=loss_scale_period,
                        on_step=on_step,
                        keep=True,
                        compiled_steps=compiled,
                    )
                except NotImplementedError as e:
                    result = train_lib.RunResult(name, precision, mech, n_steps)
                    result.error = str(e)
                    reporter.done_steps += n_steps
                results.append(result)
            base = next(
                (r for r in results if r.workload == name and r.precision == "float32"),
                None,
            )
            for other in range(seed + 1, seed + seeds):
                if base is None or base.error:
                    reporter.done_steps += n_steps
                    continue
                on_step = reporter.task(f"{name} float32 seed {other}", n_steps)
                spare = train_lib.train(
                    workload,
                    "float32",
                    steps=n_steps,
                    seed=other,
                    on_step=on_step,
                    compiled_steps=compiled,
                )
                base.seed_eval_losses[other] = spare.eval_loss
                base.seed_losses[other] = spare.losses
        # Fair speed-ups: re-time this workload's runs in interleaved rounds.
        reporter.phase(f"timing {name}: 3 interleaved rounds ...")
        train_lib.time_interleaved([r for r in results if r.workload == name])
    compiled.clear()

    meta["wall time (s)"] = round(time.perf_counter() - t_start, 1)
    import jax

    from ...workloads import timing

    load_end = timing.loadavg()
    meta["load average at end (1, 5, 15 min)"] = _load_text(load_end)
    platform = jax.default_backend()
    meta["why slower"] = report.speed_notes(
        results,
        platform=platform,
        cpu_bf16=_cpu_bf16(platform),
        load=None if load_end is None else load_end[0],
    )
    meta["why faster"] = report.faster_notes(results, platform=platform)
    report.write_json(out_dir / "results.json", results, meta)
    (out_dir / "results.md").write_text(report.markdown(results, titles, meta))
    png = None
    if plot:
        from . import plot as plot_lib

        png = plot_lib.save_figure(results, out_dir / "demo.png", titles=titles)
    report.print_tables(results, titles, console=console)
    for note in report.seed_notes(results):
        console.print(note)
    console.print(f"16-bit matmuls: {meta['16-bit matmuls']}")
    if meta["why slower"]:
        console.print("Slower than float32, and why:")
        for note in meta["why slower"]:
            console.print(f"  - {note}")
    if meta["why faster"]:
        console.print(report.FASTER_HEADING)
        for note in meta["why faster"]:
            console.print(f"  - {note}")
    console.print(report.NOTES, style="dim")
    console.print(
        f"wrote {out_dir / 'results.md'}, {out_dir / 'results.json'}"
        + (f", {png}" if png else "")
        + f" in {meta['wall time (s)']:.0f} s"
    )
    failed = [r for r in results if r.error]
    if failed:
        raise CLIError(
            f"{len(failed)} of {len(results)} runs failed ("
            + "; ".join(f"{r.workload} {r.precision}: {r.error}" for r in failed)
            + f"); the results of the others are in {out_dir}"
        )
    return 0
