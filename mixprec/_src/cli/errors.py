"""The command line's errors and exit statuses, imported by every command.

Kept apart from ``main.py`` (the parser) so that the commands (``bench.py``,
``numerics.py``, ``demo/runner.py``) raise :class:`CLIError` without importing
the parser that imports them: the CLI's imports form no cycle.

Exit statuses (listed by ``mixprec --help`` as well):

* 0 (:data:`EXIT_OK`): success.
* 1 (:data:`EXIT_ERROR`): an error while running, printed on stderr as
  ``mixprec <command>: error: <message>``.
* 2 (:data:`EXIT_USAGE`): a bad command line (argparse's usage and message), or
  a flag's value that the command rejects (:class:`UsageError`).
* 3 (:data:`EXIT_PROBLEMS`): ``mixprec diagnose --fail-on-problems`` found an op
  that overflows, underflows or turns NaN.
* 130 (:data:`EXIT_INTERRUPTED`): interrupted with Ctrl-C.
"""

from __future__ import annotations

import difflib
import importlib.util
from collections.abc import Sequence


PROG = "mixprec"

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_PROBLEMS = 3
EXIT_INTERRUPTED = 130


class CLIError(Exception):
    """A user error: printed as ``mixprec <command>: error: <message>``, status 1.

    Examples:
      >>> str(CLIError("cannot create the output folder 'x'"))
      "cannot create the output folder 'x'"
    """


class UsageError(CLIError):
    """A bad value of a flag that only the command can check (``--policy``,
    ``--mode``): printed as argparse prints a bad command line, with the
    subcommand's usage, as ``mixprec <command>: error: argument <flag>: ...``,
    status 2.

    Args:
      flag: the flag at fault (``"--policy"``).
      message: what is wrong with its value, with the valid choices.

    Examples:
      >>> str(UsageError("--mode", "unknown mode 'fast'"))
      "argument --mode: unknown mode 'fast'"
    """

    def __init__(self, flag: str, message: str):
        super().__init__(f"argument {flag}: {message}")
        self.flag = flag


def unknown_choice(
    what: str, value: str, valid: Sequence[str], *, names: Sequence[str] = ()
) -> str:
    """The message for a value that is not one of the choices: the value, the
    closest choices ("did you mean") and every valid one.

    Args:
      what: what the value names (``"mode"``).
      value: the value given.
      valid: the choices listed.
      names: more names to suggest from (aliases), ``valid`` by default.

    Examples:
      >>> print(unknown_choice("size", "smal", ["tiny", "small", "full"]))
      unknown size 'smal'; did you mean 'small'? (choose from tiny, small, full)
    """
    close = difflib.get_close_matches(
        value.strip().lower(), list(names or valid), n=2, cutoff=0.6
    )
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    return f"unknown {what} {value!r}{hint} (choose from {', '.join(valid)})"


class UserCodeError(CLIError):
    """The user's code (a target's module, function or example hook) raised.

    The message names the exception and the user's file and line; the original
    exception is the ``__cause__``, whose full traceback ``--verbose`` prints.

    Examples:
      >>> issubclass(UserCodeError, CLIError)
      True
    """


def require(module: str, command: str) -> None:
    """Raises :class:`CLIError` naming the pip extra if ``module`` is missing.

    Args:
      module: the top-level module the command needs (``"optax"``, ``"rich"``).
      command: the subcommand, for the message (``"demo"``).

    Raises:
      CLIError: ``module`` cannot be found.

    Examples:
      >>> require("json", "demo")
      >>> require("no_such_module_xyz", "demo")
      Traceback (most recent call last):
      ...
      mixprec._src.cli.errors.CLIError: `mixprec demo` requires ...
    """
    if importlib.util.find_spec(module) is None:
        raise CLIError(
            f"`{PROG} {command}` requires `{module}`; install with "
            f"`pip install 'mixprec[cli]'`."
        )
