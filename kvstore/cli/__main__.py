"""``python -m kvstore.cli``: the ``kvstore`` command without its console script."""

from __future__ import annotations

from kvstore.cli.commands import main

raise SystemExit(main())
