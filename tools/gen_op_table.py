"""Writes docs/op_table.md from the autocast op lists (or checks it with --check).

Usage, from the repository root::

    python tools/gen_op_table.py          # regenerate docs/op_table.md
    python tools/gen_op_table.py --check  # exit 1 if it is out of date
"""

import pathlib
import sys


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from mixprec._src.autocast.op_lists import _main  # noqa: E402


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
