"""``python -m mixprec``: the ``mixprec`` command line (see ``mixprec/_src/cli.py``)."""

import sys

from ._src.cli import main


if __name__ == "__main__":
    sys.exit(main())
