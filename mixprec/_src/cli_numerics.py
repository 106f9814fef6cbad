"""``mixprec inspect`` and ``mixprec diagnose``: precision reports from the shell.

Usage::

    mixprec inspect  my_model:loss [--policy mixed_bfloat16] [--json]
    mixprec diagnose my_model:loss [--policy mixed_float16] [--loss-scale 1024]
                     [--mixlist '{"black-list": {"to-add": ["mul"]}}'] [--json]

``TARGET`` is ``module:function`` (an importable module, or a path to a ``.py``
file, e.g. ``examples/diagnose_softmax.py:attention``). The function is called with
example inputs, found in this order:

1. ``--args NAME``: a zero-argument callable ``NAME`` in the same module, or
   ``other_module:NAME``;
2. ``<function>_example_args()`` in the module, e.g. ``loss_example_args()``;
3. ``example_args()`` in the module.

The callable returns a tuple of positional arguments (a list works too; a dict is
taken as keyword arguments; anything else is the single argument). Inputs are
arrays (``jax.numpy``/``numpy``) or pytrees of them; use ``functools.partial`` in
the module for static arguments.

The demo CLI (``mixprec._src.cli``) adds these subcommands through
:func:`register`; ``python -m mixprec._src.cli_numerics inspect ...`` runs them
standalone. Exit status: 0, or 1 for ``diagnose --fail-on-problems`` when a problem
was found, or 2 for a bad target/arguments.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any


__all__ = ["main", "main_diagnose", "main_inspect", "register"]


class TargetError(ValueError):
    """A ``module:function`` target or its example arguments cannot be loaded."""


def _load_module(spec: str) -> Any:
    if spec.endswith(".py") or os.sep in spec or "/" in spec:
        path = os.path.abspath(spec)
        if not os.path.exists(path):
            raise TargetError(f"`mixprec` target file {spec!r} does not exist.")
        name = "_mixprec_target_" + os.path.splitext(os.path.basename(path))[0]
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise TargetError(f"`mixprec` cannot import {spec!r} as a module.")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        module_spec.loader.exec_module(module)
        return module
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as e:
        raise TargetError(
            f"`mixprec` cannot import module {spec!r}: {e}. Run from the directory "
            "that contains it, set PYTHONPATH, or pass a path to a .py file."
        ) from None


def _split_target(target: str) -> tuple[str, str]:
    module, sep, name = target.rpartition(":")
    if not sep or not module or not name:
        raise TargetError(
            f"Expected a target of the form `module:function` (or "
            f"`path/to/file.py:function`), got {target!r}."
        )
    return module, name


def _get_attr(module: Any, name: str, what: str) -> Any:
    obj = module
    for part in name.split("."):
        if not hasattr(obj, part):
            import difflib

            names = [n for n in dir(module) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=3)
            hint = f" Did you mean: {', '.join(close)}?" if close else ""
            raise TargetError(
                f"`mixprec` {what} {name!r} not found in module "
                f"{getattr(module, '__name__', module)!r}.{hint}"
            )
        obj = getattr(obj, part)
    return obj


def load_target(
    target: str, args_spec: str | None = None
) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The function named by ``target`` and its example positional arguments.

    Keyword arguments returned by the example hook are bound with
    ``functools.partial``. See the module docstring for the conventions.

    Raises:
      TargetError: if the module, function or example arguments cannot be found.
    """
    module_name, fn_name = _split_target(target)
    module = _load_module(module_name)
    fn = _get_attr(module, fn_name, "function")
    if args_spec is not None:
        if ":" in args_spec:
            mod2, hook_name = _split_target(args_spec)
            hook = _get_attr(_load_module(mod2), hook_name, "example-args callable")
        else:
            hook = _get_attr(module, args_spec, "example-args callable")
    else:
        candidates = (f"{fn_name.rsplit('.', 1)[-1]}_example_args", "example_args")
        hook = next(
            (getattr(module, c) for c in candidates if hasattr(module, c)), None
        )
        if hook is None:
            raise TargetError(
                f"`mixprec` needs example inputs for {target!r}: define "
                f"`{candidates[0]}()` or `example_args()` in the module returning a "
                "tuple of arguments, or pass `--args NAME`."
            )
    example = hook() if callable(hook) else hook
    if isinstance(example, dict):
        return functools.partial(fn, **example), ()
    if isinstance(example, (tuple, list)):
        return fn, tuple(example)
    return fn, (example,)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="module:function or path/to/file.py:function")
    p.add_argument(
        "--args",
        dest="example_args",
        default=None,
        metavar="NAME",
        help="callable returning example arguments (NAME or module:NAME); default: "
        "<function>_example_args or example_args in the module",
    )
    p.add_argument(
        "--policy",
        default="mixed_float16",
        help="policy name or spec (default: mixed_float16)",
    )
    p.add_argument(
        "--mode", default="allow_mix_precision", help="precision mode (seed 003)"
    )
    p.add_argument(
        "--mixlist",
        default=None,
        help="modify_mixlist JSON text or path to a JSON file",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--plain", action="store_true", help="plain text, no rich tables")
    p.add_argument("--max-rows", type=int, default=None, help="show at most N rows")
    p.add_argument(
        "--width", type=int, default=None, help="console width for rich tables"
    )


def register(subparsers: Any) -> None:
    """Adds the ``inspect`` and ``diagnose`` subcommands to an argparse CLI.

    Each sets ``func`` (:func:`main_inspect` / :func:`main_diagnose`), which takes
    the parsed namespace and returns the exit status.

    Args:
      subparsers: the object returned by ``ArgumentParser.add_subparsers()``.

    Examples:
      >>> import argparse
      >>> parser = argparse.ArgumentParser(prog="mixprec")
      >>> register(parser.add_subparsers(dest="command"))
      >>> ns = parser.parse_args(["inspect", "m:f", "--json"])
      >>> ns.func is main_inspect, ns.json
      (True, True)
    """
    p = subparsers.add_parser(
        "inspect",
        help="which dtype autocast runs each op of a function in, and why",
        description="Print mixprec.explain(fn, *example_args) as a table or JSON.",
    )
    _add_common(p)
    p.set_defaults(func=main_inspect)

    p = subparsers.add_parser(
        "diagnose",
        help="run a function in float32 and mixed precision side by side and "
        "find the ops that overflow, underflow or turn NaN",
        description="Print mixprec.diagnose(fn, *example_args) with advice.",
    )
    _add_common(p)
    p.add_argument(
        "--loss-scale",
        type=float,
        default=None,
        help="treat the function as a scalar loss and diagnose its gradient at "
        "this loss scale",
    )
    p.add_argument(
        "--argnums",
        type=int,
        nargs="+",
        default=[0],
        help="arguments to differentiate with --loss-scale (default: 0)",
    )
    p.add_argument(
        "--all", action="store_true", help="list every op, not only problems"
    )
    p.add_argument(
        "--fail-on-problems",
        action="store_true",
        help="exit with status 1 if any op overflows, underflows or turns NaN",
    )
    p.set_defaults(func=main_diagnose)


def _use_rich(args: argparse.Namespace) -> bool | None:
    return False if getattr(args, "plain", False) else None


def _print(text: str) -> None:
    sys.stdout.write(text.rstrip("\n") + "\n")


def _load(args: argparse.Namespace) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    return load_target(args.target, getattr(args, "example_args", None))


def main_inspect(args: argparse.Namespace) -> int:
    """Runs ``mixprec inspect`` on parsed arguments; returns the exit status."""
    from .numerics.explain import explain

    try:
        fn, fn_args = _load(args)
    except TargetError as e:
        sys.stderr.write(f"mixprec inspect: {e}\n")
        return 2
    report = explain(
        fn, *fn_args, policy=args.policy, mode=args.mode, mixlist=args.mixlist
    )
    if args.json:
        _print(report.to_json())
    else:
        _print(
            report.table(
                use_rich=_use_rich(args), max_rows=args.max_rows, width=args.width
            )
        )
    return 0


def main_diagnose(args: argparse.Namespace) -> int:
    """Runs ``mixprec diagnose`` on parsed arguments; returns the exit status."""
    from .numerics.diagnose import diagnose

    try:
        fn, fn_args = _load(args)
    except TargetError as e:
        sys.stderr.write(f"mixprec diagnose: {e}\n")
        return 2
    argnums = args.argnums[0] if len(args.argnums) == 1 else tuple(args.argnums)
    report = diagnose(
        fn,
        *fn_args,
        policy=args.policy,
        mode=args.mode,
        mixlist=args.mixlist,
        loss_scale=args.loss_scale,
        argnums=argnums,
    )
    if args.json:
        _print(report.to_json())
    else:
        _print(report.summary())
        _print(
            report.table(
                only_problems=not args.all,
                use_rich=_use_rich(args),
                max_rows=args.max_rows,
                width=args.width,
            )
        )
        _print("Advice:\n" + report.advice())
    return 1 if (args.fail_on_problems and not report.ok) else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point: ``python -m mixprec._src.cli_numerics inspect ...``.

    Examples:
      >>> main(["inspect", "no_such_module_xyz:f"])
      2
    """
    parser = argparse.ArgumentParser(
        prog="mixprec", description="mixprec numerics: inspect and diagnose"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
