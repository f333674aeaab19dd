"""``python -m kvstore.daemon --config FILE``: run the daemon in the foreground."""

from __future__ import annotations

from kvstore.daemon.process import main

raise SystemExit(main())
