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

A ``path/to/file.py`` target is imported as ``python path/to/file.py`` would
import it: the file's directory comes first on ``sys.path`` (while it is loaded
and while the function runs), so modules beside it import; a ``module`` target
imports from the current directory.

The reports are those of the public :func:`mixprec.explain` and
:func:`mixprec.diagnose`. The arguments are parsed in ``main.py``; the exit
statuses are those of ``errors.py``. Errors (status 1): a target that cannot be
loaded or is not callable; example arguments with no array, or a function that
runs no JAX op (there would be nothing to report); an exception raised by the
user's own code (its module, function or example hook), reported with the user's
file and line (``--verbose`` adds the traceback). An exception with no frame of
the user's code keeps its traceback: it is mixprec's. A ``--policy`` (see
``precisions.py``), ``--mode`` or ``--mixlist`` that ``mixprec`` rejects is a bad
command line (status 2, the subcommand's usage, the flag and the valid choices),
checked before the target is loaded.
``diagnose --fail-on-problems`` returns status 3 when it finds a problem.
"""

from __future__ import annotations

import argparse
import contextlib
import functools as ft
import importlib
import importlib.util
import keyword
import os
import sys
import sysconfig
import traceback
import types
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from .errors import (
    EXIT_OK,
    EXIT_PROBLEMS,
    PROG,
    CLIError,
    UsageError,
    UserCodeError,
    unknown_choice,
)


class TargetError(CLIError):
    """A ``module:function`` target or its example arguments cannot be loaded."""


# ----------------------------------------------------------------------------- loading


def _is_file_spec(spec: str) -> bool:
    return spec.endswith(".py") or os.sep in spec or "/" in spec


@contextlib.contextmanager
def _on_sys_path(directory: str) -> Iterator[None]:
    """``directory`` first on ``sys.path`` inside the block, as ``python FILE``
    puts the file's directory; removed afterwards unless it was there before."""
    if directory in sys.path:
        yield
        return
    sys.path.insert(0, directory)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(directory)


@contextlib.contextmanager
def target_imports(*specs: str | None) -> Iterator[None]:
    """The import path a target's module sees while it is loaded and run.

    A ``path/to/file.py:function`` target imports modules beside the file (its
    directory comes first on ``sys.path``, as with ``python path/to/file.py``);
    a ``module:function`` target imports from the current directory (as with
    ``python -m``). Both stay on the path while the function runs, for imports
    inside it; the path is restored afterwards.

    Args:
      *specs: targets and ``--args`` values (``None`` is skipped).

    Examples:
      >>> import sys
      >>> with target_imports("/tmp/project/model.py:loss"):
      ...     sys.path[0]
      '/tmp/project'
      >>> "/tmp/project" in sys.path
      False
    """
    directories: list[str] = []
    for spec in specs:
        if not spec:
            continue
        module = spec.rpartition(":")[0] or spec
        if _is_file_spec(module):
            directory = os.path.dirname(os.path.abspath(module))
        else:
            directory = os.getcwd()
        if directory not in directories:
            directories.append(directory)
    with contextlib.ExitStack() as stack:
        for directory in reversed(directories):
            stack.enter_context(_on_sys_path(directory))
        yield


def _module_name_for(path: str) -> str:
    """``model`` for ``dir/model.py``, the name ``python -c "import model"`` from
    ``dir`` gives it, unless that name is taken by another module."""
    stem = os.path.splitext(os.path.basename(path))[0]
    if stem.isidentifier() and not keyword.iskeyword(stem):
        existing = sys.modules.get(stem)
        same_file = existing is not None and _same_file(
            getattr(existing, "__file__", None), path
        )
        if existing is None or same_file:
            return stem
    return f"_mixprec_target_{abs(hash(path)):x}_{stem}"


def _same_file(a: str | None, b: str) -> bool:
    return a is not None and os.path.realpath(a) == os.path.realpath(b)


def _load_module(spec: str) -> types.ModuleType:
    if _is_file_spec(spec):
        path = os.path.abspath(spec)
        if not os.path.exists(path):
            raise TargetError(f"target file {spec!r} does not exist.")
        name = _module_name_for(path)
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise TargetError(f"cannot import {spec!r} as a module.")
        module = importlib.util.module_from_spec(module_spec)
        module.__dict__["__mixprec_target__"] = spec  # how messages name it
        previous = sys.modules.get(name)
        sys.modules[name] = module
        with target_imports(spec):
            try:
                module_spec.loader.exec_module(module)
            except BaseException as e:
                if previous is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = previous
                if not isinstance(e, Exception):
                    raise
                _raise_user_error(e, f"importing {spec!r}", _roots_of(path))
        return module
    with target_imports(spec):
        try:
            return importlib.import_module(spec)
        except ModuleNotFoundError as e:
            if e.name is not None and (spec == e.name or spec.startswith(e.name + ".")):
                raise TargetError(
                    f"cannot import module {spec!r}: {e}. Run from the directory "
                    "that contains it, set PYTHONPATH, or pass a path to a .py file."
                ) from None
            _raise_user_error(e, f"importing {spec!r}", _roots_of(spec))
        except Exception as e:
            _raise_user_error(e, f"importing {spec!r}", _roots_of(spec))


def _display_name(module: Any) -> str:
    """The module as the user named it: the path of a file target."""
    return module.__dict__.get("__mixprec_target__") or getattr(
        module, "__name__", repr(module)
    )


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
                f"{what} {name!r} not found in {_display_name(module)!r}.{hint}"
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
      TargetError: the module, function or example arguments cannot be found,
        the target is not callable, or importing the module or calling the
        example hook raised (the message names the user's file and line).

    Examples:
      >>> load_target("json:dumps")
      Traceback (most recent call last):
      ...
      mixprec._src.cli.numerics.TargetError: needs example inputs for 'json:dumps': ...
      >>> load_target("json:decoder.NaN")
      Traceback (most recent call last):
      ...
      mixprec._src.cli.numerics.TargetError: 'json:decoder.NaN' names a `float` ...
    """
    module_name, fn_name = _split_target(target)
    module = _load_module(module_name)
    fn = _get_attr(module, fn_name, "function")
    if not callable(fn):
        raise TargetError(
            f"{target!r} names a `{type(fn).__name__}` ({_short_repr(fn)}), not a "
            "function: expected `module:function` naming a callable (a function, "
            "a jitted function, a model's apply, an NNX module)."
        )
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
    if callable(hook):
        try:
            example = hook()
        except Exception as e:
            name = getattr(hook, "__name__", "the example-args callable")
            _raise_user_error(e, f"{name}()", _roots_of(module_name, args_spec))
    else:
        example = hook
    if isinstance(example, dict):
        return ft.partial(fn, **example), ()
    if isinstance(example, (tuple, list)):
        return fn, tuple(example)
    return fn, (example,)


def _short_repr(obj: Any, limit: int = 40) -> str:
    text = repr(obj)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ----------------------------------------------------------------------------- errors


def _real(path: str) -> str:
    return os.path.realpath(path)


_MIXPREC_DIR = _real(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
_LIBRARY_DIRS = tuple(
    {
        _real(p)
        for key in ("stdlib", "platstdlib", "purelib", "platlib")
        if (p := sysconfig.get_paths().get(key))
    }
)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _roots_of(*specs: str | None) -> tuple[str, ...]:
    """The directories whose code is the user's: a file target's directory, a
    module target's top-level package (or the module's directory)."""
    roots: list[str] = []
    for spec in specs:
        if not spec:
            continue
        module = spec.rpartition(":")[0] if ":" in spec else spec
        if _is_file_spec(module):
            roots.append(_real(os.path.dirname(os.path.abspath(module))))
            continue
        top = module.split(".")[0]
        found = importlib.util.find_spec(top) if top else None
        if found is not None and found.submodule_search_locations:
            roots.extend(_real(p) for p in found.submodule_search_locations)
        elif found is not None and found.origin:
            roots.append(_real(os.path.dirname(found.origin)))
        else:
            roots.append(_real(os.getcwd()))
    return tuple(roots)


def _is_user_file(filename: str, roots: tuple[str, ...]) -> bool:
    if filename.startswith("<"):
        return False
    path = _real(filename)
    if _under(path, _MIXPREC_DIR):
        return False
    for root in roots:
        # A frame in an installed package or the standard library is not the
        # user's, unless the user's code is itself installed there.
        libs = [lib for lib in _LIBRARY_DIRS if not _under(root, lib)]
        if _under(path, root) and not any(_under(path, lib) for lib in libs):
            return True
    return False


def _user_frame(
    error: BaseException, roots: tuple[str, ...]
) -> traceback.FrameSummary | None:
    """The deepest frame of ``error``'s traceback in the user's code, if any.

    ``roots`` are the directories of the user's code (see :func:`_roots_of`);
    frames in mixprec, the standard library and installed packages are not the
    user's unless a root lies inside them. A ``SyntaxError`` points at its line.
    """
    if isinstance(error, SyntaxError) and error.filename and error.lineno:
        if _is_user_file(error.filename, roots):
            return traceback.FrameSummary(
                error.filename, error.lineno, "<module>", line=error.text or ""
            )
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        if _is_user_file(frame.filename, roots):
            return frame
    return None


def _where(frame: traceback.FrameSummary) -> str:
    path = frame.filename
    with contextlib.suppress(ValueError):
        rel = os.path.relpath(path)
        if not rel.startswith(".."):
            path = rel
    line = (frame.line or "").strip()
    return f"{path}:{frame.lineno} in {frame.name}" + (f": {line}" if line else "")


def _user_error(
    error: Exception, what: str, roots: tuple[str, ...]
) -> UserCodeError | None:
    """A :class:`UserCodeError` naming the user's frame, or ``None`` when no
    frame of ``error``'s traceback is the user's (mixprec's own error)."""
    frame = _user_frame(error, roots)
    if frame is None:
        return None
    message = str(error).strip().splitlines()
    first = message[0] if message else ""
    return UserCodeError(
        f"{what} raised {type(error).__name__}"
        + (f": {first}" if first else "")
        + f"\n  at {_where(frame)}"
    )


def _raise_user_error(error: Exception, what: str, roots: tuple[str, ...]) -> NoReturn:
    """Raises :func:`_user_error` of ``error`` if it is the user's, else ``error``."""
    user = _user_error(error, what, roots)
    if user is None:
        raise error
    raise user from error


# ----------------------------------------------------------------------------- checks


def _check_example_args(target: str, fn: Any, args: tuple[Any, ...]) -> None:
    """Refuses example arguments with no array in them: autocast traces array
    arguments and treats Python numbers as constants, so nothing would be seen."""
    import jax

    keywords = fn.keywords if isinstance(fn, ft.partial) else {}
    leaves = jax.tree.leaves((args, keywords))
    scalars = (bool, int, float, complex, str, bytes)
    if all(isinstance(leaf, scalars) for leaf in leaves):
        got = ", ".join(type(leaf).__name__ for leaf in leaves) or "no arguments"
        raise TargetError(
            f"the example arguments of {target!r} hold no array (got {got}): "
            "autocast traces array arguments (jax or NumPy arrays, or pytrees of "
            "them) and takes Python numbers as constants, so there would be no op "
            "to report. Return arrays from the example hook, e.g. "
            "`jnp.ones((8, 8))` or `jnp.asarray(3.0)`."
        )


def _check_ops(target: str, report: Any) -> None:
    if not report.ops:
        raise TargetError(
            f"{target!r} ran no JAX operation on its array arguments, so there is "
            "nothing to report: expected JAX code (jax.numpy, jax.lax, a Flax/"
            "Equinox/Haiku model) that computes from its arguments. A function that "
            "ignores them, returns them unchanged or computes in NumPy or plain "
            "Python shows no op."
        )


# ----------------------------------------------------------------------------- commands


def _use_rich(args: argparse.Namespace) -> bool | None:
    return False if args.plain else None


def _print(text: str) -> None:
    sys.stdout.write(text.rstrip("\n") + "\n")


def _policy(args: argparse.Namespace) -> Any:
    from .precisions import resolve_policy

    policy, note = resolve_policy(args.policy, command=args.command)
    if note:
        print(f"{PROG} {args.command}: note: {note}", file=sys.stderr)
    return policy


def _report(
    call: Callable[[], Any], args: argparse.Namespace, roots: tuple[str, ...]
) -> Any:
    """Runs ``mixprec.explain``/``diagnose``. An exception raised in the user's
    code is reported with its file and line; a value or type mixprec rejects (a
    bad mode or mixlist, a primitive it cannot handle) is a user error too."""
    try:
        return call()
    except Exception as e:
        error = _user_error(e, f"{args.target!r}", roots)
        if error is not None:
            raise error from e
        if isinstance(e, (ValueError, TypeError, NotImplementedError)):
            raise CLIError(f"{type(e).__name__}: {e}") from e
        raise


def _check_mode_and_mixlist(args: argparse.Namespace) -> None:
    """``--mode`` and ``--mixlist`` as :func:`mixprec.explain` would check
    them, as flags: :class:`UsageError` (status 2) names the flag."""
    import mixprec

    from ..autocast import modes

    if args.mode not in modes.MODES:
        raise UsageError(
            "--mode", unknown_choice("precision mode", args.mode, modes.MODES)
        )
    if args.mixlist is not None:
        try:
            mixprec.modify_mixlist(None, args.mixlist)
        except (ValueError, TypeError) as e:
            raise UsageError("--mixlist", str(e)) from None


def _load_plan(path: str) -> Any:
    """``--plan FILE`` as a :class:`mixprec.Plan`; a bad file is a usage
    error naming the flag."""
    import mixprec

    try:
        return mixprec.Plan.load(path)
    except OSError as e:
        raise UsageError("--plan", f"cannot read {path!r}: {e.strerror}") from None
    except (ValueError, TypeError) as e:
        raise UsageError("--plan", str(e)) from None


def _prepare(
    args: argparse.Namespace,
) -> tuple[Callable[..., Any], tuple[Any, ...], Any, tuple[str, ...]]:
    plan = getattr(args, "plan", None)
    policy = _policy(args) if plan is None else _load_plan(plan)
    _check_mode_and_mixlist(args)
    fn, fn_args = load_target(args.target, args.example_args)
    _check_example_args(args.target, fn, fn_args)
    return fn, fn_args, policy, _roots_of(args.target, args.example_args)


def run_inspect(args: argparse.Namespace) -> int:
    """``mixprec inspect``: prints :func:`mixprec.explain` of the target.

    Returns:
      0 (an error raises :class:`CLIError`).
    """
    import mixprec

    with target_imports(args.target, args.example_args):
        fn, fn_args, policy, roots = _prepare(args)
        report = _report(
            lambda: mixprec.explain(
                fn, *fn_args, policy=policy, mode=args.mode, mixlist=args.mixlist
            ),
            args,
            roots,
        )
    _check_ops(args.target, report)
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

    argnums = args.argnums[0] if len(args.argnums) == 1 else tuple(args.argnums)
    with target_imports(args.target, args.example_args):
        fn, fn_args, policy, roots = _prepare(args)
        report = _report(
            lambda: mixprec.diagnose(
                fn,
                *fn_args,
                policy=policy,
                mode=args.mode,
                mixlist=args.mixlist,
                loss_scale=args.loss_scale,
                argnums=argnums,
            ),
            args,
            roots,
        )
    _check_ops(args.target, report)
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


def run_plan(args: argparse.Namespace) -> int:
    """``mixprec plan``: runs :func:`mixprec.plan` on the target, prints the
    plan and writes it to ``--out``.

    Returns:
      0 (an error raises :class:`CLIError`).
    """
    import mixprec

    from ..numerics import plan as planner

    if args.platform not in planner.THROUGHPUT:
        raise UsageError(
            "--platform",
            unknown_choice("platform", args.platform, sorted(planner.THROUGHPUT)),
        )
    for c in args.candidates:
        try:
            mixprec.get_policy(c)
        except (ValueError, TypeError) as e:
            raise UsageError("--candidates", str(e)) from None
    argnums = args.argnums[0] if len(args.argnums) == 1 else tuple(args.argnums)
    tolerance = planner.DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance
    with target_imports(args.target, args.example_args):
        fn, fn_args = load_target(args.target, args.example_args)
        _check_example_args(args.target, fn, fn_args)
        roots = _roots_of(args.target, args.example_args)
        plan = _report(
            lambda: mixprec.plan(
                fn,
                *fn_args,
                candidates=tuple(args.candidates),
                tolerance=tolerance,
                platform=args.platform,
                argnums=argnums,
            ),
            args,
            roots,
        )
    if not plan.sites:
        raise TargetError(
            f"{args.target!r} has no matmul-like op (dot_general, convolution) on "
            "its array arguments: a plan would have no site."
        )
    plan.save(args.out)
    _print(str(plan))
    if args.json:
        _print(plan.to_json())
    _print(f"wrote {args.out}")
    return EXIT_OK
