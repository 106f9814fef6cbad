"""``python -m mixprec``: the ``mixprec`` command line (``_src/cli/main.py``)."""

import sys

from ._src.cli.main import main


if __name__ == "__main__":
    sys.exit(main())
