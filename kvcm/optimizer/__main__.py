"""``python -m kvcm.optimizer``: the ``kvcm optimize`` command on its own."""

from __future__ import annotations

import sys

from kvcm.optimizer.cli import main

if __name__ == "__main__":
    sys.exit(main())
