"""``python -m kwexport``: the command line (``kwexport._cli``)."""

import sys

from kwexport._cli import describe, main

__all__ = ["describe", "main"]

if __name__ == "__main__":
    sys.exit(main())
