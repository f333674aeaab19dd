"""The ``kvstore`` command: ``commands.py`` parses and runs, ``display.py`` renders, ``demo.py`` chats."""

from __future__ import annotations

from kvstore.cli.commands import main

__all__ = ["main"]
