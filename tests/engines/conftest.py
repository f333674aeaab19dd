"""Which engine tests a session collects.

Each ``tests/engines/NAME/`` folder needs its inference engine, installed only in the environment
``./dev engines`` builds for it (``.engines/NAME``). test_engines.py, in the main session, runs each
folder in its environment with ``KVSTORE_ENGINE=NAME`` set; that session collects that one folder.
The main session (no ``KVSTORE_ENGINE``) collects none of them, and ends with each run's summary line.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).parent
SUMMARIES = pytest.StashKey[dict[str, str]]()


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Ignore every engine folder except the one named by ``KVSTORE_ENGINE`` (none without it).

    Inside an engine's session the files here (test_engines.py, which starts such sessions) are ignored too.
    """
    if collection_path.parent != HERE:
        return None  # deeper down: pytest decides
    engine = os.environ.get("KVSTORE_ENGINE")
    if collection_path.is_dir():
        return collection_path.name not in (engine, "__pycache__")
    return True if engine else None


@pytest.fixture
def engine_summaries(pytestconfig: pytest.Config) -> dict[str, str]:
    """Engine name -> the summary line of its tests' run, printed at the end of the session."""
    return pytestconfig.stash.setdefault(SUMMARIES, {})


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    summaries = config.stash.get(SUMMARIES, {})
    if summaries:
        terminalreporter.section("engine tests (tests/engines/NAME, each in .engines/NAME)")
        for name, line in summaries.items():
            terminalreporter.write_line(f"{name}: {line}")
