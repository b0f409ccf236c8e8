"""``python -m kvcm`` is the ``kvcm`` command."""

from kvcm.cli import main

raise SystemExit(main())
