"""``kvstore demo``: the command without a daemon, and the conversation through a real one."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore.cli.commands import EXIT_USAGE, main
from kvstore.cli.demo import QUESTIONS, run_demo, tier_summary
from kvstore.integrations.models import LoadedModel


def test_demo_without_a_daemon_says_how_to_start_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["demo", "--endpoint", f"ipc://{tmp_path / 'none.sock'}"])
    assert code == EXIT_USAGE
    assert "no kvstore daemon is running" in capsys.readouterr().err


def test_tier_summary_counts_blocks_in_tier_order() -> None:
    assert tier_summary(["nvme", "hbm", "hbm", "ram"]) == "hbm x2, ram x1, nvme x1"
    assert tier_summary([]) == "-"


@pytest.mark.model
@pytest.mark.slow
def test_the_demo_reuses_each_earlier_turn(serve: Callable[..., Any], smollm2: LoadedModel) -> None:
    d = serve(hbm="64MiB", ram="16MiB")
    out = io.StringIO()
    turns = run_demo(
        d.endpoint, out, questions=QUESTIONS[:2], document_tokens=200, max_new_tokens=8, loaded=smollm2
    )
    # turn 1 had nothing to reuse; turn 2 reuses every whole block of turn 1 (its prompt and answer)
    assert turns[0].reused_tokens == 0
    computed = turns[0].prompt_tokens + 8 - 1  # unless the answer ended early
    assert turns[1].reused_tokens >= 64 and turns[1].reused_tokens <= computed
    assert turns[1].tiers == ["hbm"] * (turns[1].reused_tokens // 64)
    text = out.getvalue()
    assert f"{turns[1].reused_tokens:,} reused (hbm x{len(turns[1].tiers)})" in text
    assert "time to first token" in text and "recomputing" in text
