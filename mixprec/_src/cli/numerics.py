"""``mixprec inspect`` and ``mixprec diagnose``: precision reports from the shell.

Usage::

    mixprec inspect  my_model:loss [--policy mixed_bfloat16] [--json]
    mixprec diagnose my_model:loss [--policy mixed_float16] [--loss-scale 1024]
                     [--mixlist '{"black-list": {"to-add": ["mul"]}}'] [--json]

``TARGET`` is ``module:function`` (an importable module, or a path to a ``.py``
file, e.g. ``examples/diagnose_planted.py:mlp_loss``). The function is called with
example inputs, found in this order:

1. ``--args NAME``: a zero-argument callable ``NAME`` in the same module, or
   ``other_module:NAME``;
2. ``<function>_example_args()`` in the module, e.g. ``loss_example_args()``;
3. ``example_args()`` in the module.

The callable returns a tuple of positional arguments (a list works too; a dict is
taken as keyword arguments; anything else is the single argument). Inputs are
arrays (``jax.numpy``/``numpy``) or pytrees of them; use ``functools.partial`` in
the module for static arguments.

The reports are those of the public :func:`mixprec.explain` and
:func:`mixprec.diagnose`. The arguments are parsed in ``main.py``, which also owns
the exit statuses: a target that cannot be loaded, or a policy, mode or mixlist
that ``mixprec`` rejects, is an error (status 1); ``diagnose --fail-on-problems``
returns status 3 when it finds a problem.
"""

from __future__ import annotations

import argparse
import functools as ft
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

from .errors import EXIT_OK, EXIT_PROBLEMS, CLIError


class TargetError(CLIError):
    """A ``module:function`` target or its example arguments cannot be loaded."""


def _load_module(spec: str) -> Any:
    if spec.endswith(".py") or os.sep in spec or "/" in spec:
        path = os.path.abspath(spec)
        if not os.path.exists(path):
            raise TargetError(f"target file {spec!r} does not exist.")
        name = "_mixprec_target_" + os.path.splitext(os.path.basename(path))[0]
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise TargetError(f"cannot import {spec!r} as a module.")
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
            f"cannot import module {spec!r}: {e}. Run from the directory that "
            "contains it, set PYTHONPATH, or pass a path to a .py file."
        ) from None


def _split_target(target: str) -> tuple[str, str]:
    module, sep, name = target.rpartition(":")
    if not sep or not module or not name:
        raise TargetError(
            "expected a target of the form `module:function` (or "
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
                f"{what} {name!r} not found in module "
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

    Args:
      target: ``module:function`` or ``path/to/file.py:function``.
      args_spec: ``--args``: ``NAME`` or ``module:NAME`` of the example-args
        callable; ``None`` looks for ``<function>_example_args`` and then
        ``example_args`` in the target's module.

    Returns:
      ``(fn, args)``.

    Raises:
      TargetError: the module, function or example arguments cannot be found.

    Examples:
      >>> load_target("json:dumps")
      Traceback (most recent call last):
      ...
      mixprec._src.cli.numerics.TargetError: needs example inputs for 'json:dumps': ...
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
                f"needs example inputs for {target!r}: define "
                f"`{candidates[0]}()` or `example_args()` in the module returning a "
                "tuple of arguments, or pass `--args NAME`."
            )
    example = hook() if callable(hook) else hook
    if isinstance(example, dict):
        return ft.partial(fn, **example), ()
    if isinstance(example, (tuple, list)):
        return fn, tuple(example)
    return fn, (example,)


def _use_rich(args: argparse.Namespace) -> bool | None:
    return False if args.plain else None


def _print(text: str) -> None:
    sys.stdout.write(text.rstrip("\n") + "\n")


def _report(call: Callable[[], Any]) -> Any:
    """Runs ``mixprec.explain``/``diagnose``; a value or type it rejects (a bad
    policy, mode or mixlist, a target that fails on its inputs) is a user error."""
    try:
        return call()
    except (ValueError, TypeError, NotImplementedError) as e:
        raise CLIError(f"{type(e).__name__}: {e}") from e


def run_inspect(args: argparse.Namespace) -> int:
    """``mixprec inspect``: prints :func:`mixprec.explain` of the target.

    Returns:
      0 (an error raises :class:`CLIError`).
    """
    import mixprec

    fn, fn_args = load_target(args.target, args.example_args)
    report = _report(
        lambda: mixprec.explain(
            fn, *fn_args, policy=args.policy, mode=args.mode, mixlist=args.mixlist
        )
    )
    if args.json:
        _print(report.to_json())
    else:
        _print(
            report.table(
                use_rich=_use_rich(args), max_rows=args.max_rows, width=args.width
            )
        )
    return EXIT_OK


def run_diagnose(args: argparse.Namespace) -> int:
    """``mixprec diagnose``: prints :func:`mixprec.diagnose` of the target.

    Returns:
      0, or 3 with ``--fail-on-problems`` when an op overflows, underflows or
      turns NaN (an error raises :class:`CLIError`).
    """
    import mixprec

    fn, fn_args = load_target(args.target, args.example_args)
    argnums = args.argnums[0] if len(args.argnums) == 1 else tuple(args.argnums)
    report = _report(
        lambda: mixprec.diagnose(
            fn,
            *fn_args,
            policy=args.policy,
            mode=args.mode,
            mixlist=args.mixlist,
            loss_scale=args.loss_scale,
            argnums=argnums,
        )
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
    return EXIT_PROBLEMS if (args.fail_on_problems and not report.ok) else EXIT_OK
