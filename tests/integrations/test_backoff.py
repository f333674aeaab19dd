"""kvstore.integrations.backoff: engine hooks leave a daemon that does not answer, or answers busy,
alone for a while instead of each waiting out its own time-out."""

from __future__ import annotations

import logging
import time

import pytest

from kvstore.integrations import backoff
from kvstore.integrations.backoff import Backoff
from kvstore.wire.errors import DeadlinePassed, RequestTimeout, ServerError


def test_a_busy_daemon_is_left_alone_a_moment_and_said_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # every queued save asked a daemon over its budget again, each waiting out its own time-out
    monkeypatch.setattr(backoff, "BUSY_BACKOFF", 0.2)
    b = Backoff(logging.getLogger("t"), seconds=5.0)
    with caplog.at_level(logging.WARNING, logger="t"):
        b.failed("lookup", ServerError("busy", "the daemon is over its budget"))  # turned away at once
        assert b.available()
        b.failed("save of r1", ServerError("busy", "the daemon is over its budget"), waited=True)
        b.failed("save of r2", ServerError("busy", "the daemon is over its budget"), waited=True)
    assert not b.available() and b.timeouts == 0
    assert [r.getMessage()[:16] for r in caplog.records] == ["kvstore is busy ", "kvstore is busy "]
    time.sleep(0.25)
    assert b.available()  # asked again after a moment, not after a time-out's back-off


def test_calls_turned_away_busy_are_said_once_a_minute(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # each lookup and load a busy daemon turns away (a miss, at once) was logged: under load, a line
    # per call of the engine's
    monkeypatch.setattr(backoff, "BUSY_QUIET", 0.2)
    b = Backoff(logging.getLogger("t"))
    with caplog.at_level(logging.WARNING, logger="t"):
        for _ in range(50):
            b.failed("lookup", ServerError("busy", "the daemon is over its budget"))
        assert b.available() and len(caplog.records) == 1
        time.sleep(0.25)
        b.failed("load", ServerError("busy", "the daemon is over its budget"))
    assert len(caplog.records) == 2 and "miss meanwhile" in caplog.records[0].getMessage()


def test_a_time_out_backs_off_longer_and_other_failures_not_at_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backoff, "BUSY_BACKOFF", 0.05)
    b = Backoff(logging.getLogger("t"), seconds=0.3)
    b.failed("lookup", ServerError("forbidden", "not yours"))
    assert b.available()
    b.failed("lookup", RequestTimeout("no reply in 5 s"))
    assert not b.available() and b.timeouts == 1
    b.failed("save", ServerError("busy", "over its budget"), waited=True)  # does not shorten the time-out's
    time.sleep(0.2)
    assert not b.available()
    time.sleep(0.15)
    assert b.available()


def test_a_daemon_that_stays_away_is_asked_ever_less_often(monkeypatch: pytest.MonkeyPatch) -> None:
    # every 10 s back-off ended in another 5 s time-out on the scheduler's thread: a third of the
    # engine's time stalled while the daemon was down. Each time-out in a row doubles the back-off
    monkeypatch.setattr(backoff, "MAX_BACKOFF", 0.4)
    b = Backoff(logging.getLogger("t"), seconds=0.1)
    spans = []
    for _ in range(4):
        b.failed("lookup", RequestTimeout("no reply"))
        b.failed("load", RequestTimeout("no reply"))  # the same outage, another call: no longer
        spans.append(b.span)
        assert not b.available()
        while not b.available():
            time.sleep(0.01)
    assert spans == [0.1, 0.2, 0.4, 0.4] and b.timeouts == 8
    time.sleep(0.9)  # a while without a time-out: the next outage starts over
    b.failed("lookup", RequestTimeout("no reply"))
    assert b.span == 0.1


def test_busy_answers_neither_lengthen_nor_hide_a_time_out(monkeypatch: pytest.MonkeyPatch) -> None:
    # a busy back-off moved the time-out's clock: a time-out long after read as the same outage
    # (doubled, not logged), and one during a busy back-off set none at all
    monkeypatch.setattr(backoff, "BUSY_BACKOFF", 0.2)
    monkeypatch.setattr(backoff, "MAX_BACKOFF", 0.4)
    b = Backoff(logging.getLogger("t"), seconds=0.1)
    b.failed("lookup", RequestTimeout("no reply"))
    time.sleep(0.15)
    b.failed("save", ServerError("busy", "over its budget"), waited=True)
    b.failed("lookup", RequestTimeout("no reply"))  # during the busy back-off: a time-out still
    assert b.span == 0.2 and b.timeouts == 2
    time.sleep(1.0)  # long after both
    b.failed("save", ServerError("busy", "over its budget"), waited=True)
    time.sleep(0.25)
    b.failed("lookup", RequestTimeout("no reply"))  # a new outage: the first back-off again
    assert b.span == 0.1 and not b.available()


def test_stores_back_off_on_their_own_and_whenever_lookups_do(monkeypatch: pytest.MonkeyPatch) -> None:
    # one store that waited out a busy daemon (or outlasted its time-out behind a loaded daemon's
    # demotions) held every lookup and load back too, though the daemon answered those at once
    monkeypatch.setattr(backoff, "BUSY_BACKOFF", 0.2)
    engine = Backoff(logging.getLogger("t"), seconds=0.2)
    stores = Backoff(logging.getLogger("t"), seconds=0.2, under=engine)
    stores.failed("store", ServerError("busy", "over its budget"), waited=True)
    assert not stores.available() and engine.available()
    time.sleep(0.25)
    assert stores.available()
    stores.failed("store", RequestTimeout("no reply"))
    assert not stores.available() and engine.available() and engine.timeouts == 0
    time.sleep(0.25)
    assert stores.available()
    # a lookup that timed out: the daemon is away for everyone, stores included
    engine.failed("lookup", RequestTimeout("no reply"))
    assert not engine.available() and not stores.available() and stores.timeouts == 1
    time.sleep(0.25)
    assert engine.available() and stores.available()


def test_an_outage_the_engine_s_calls_met_first_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    engine = Backoff(logging.getLogger("t"), seconds=5.0)
    stores = Backoff(logging.getLogger("t"), seconds=5.0, under=engine, held="no store sent")
    with caplog.at_level(logging.WARNING, logger="t"):
        engine.failed("lookup", RequestTimeout("no reply"))
        stores.failed("store", RequestTimeout("no reply"))  # one in flight as the lookup timed out
    assert [r.getMessage()[:25] for r in caplog.records] == ["kvstore did not answer a "]
    assert "not asked again" in caplog.records[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="t"):
        fresh = Backoff(
            logging.getLogger("t"), seconds=5.0, under=Backoff(logging.getLogger("t")), held="no store sent"
        )
        fresh.failed("store", RequestTimeout("no reply"))  # a store met it first: said, as its own
    assert len(caplog.records) == 1 and "no store sent for 5 s" in caplog.records[0].getMessage()


def test_a_call_cut_by_its_callers_budget_rests_a_moment_not_a_time_out_s_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a daemon slow in each reply (answering within each time-out) ran the hook out of its budget:
    # it is there, and was left alone 10 s, then a minute, as a daemon that does not answer
    monkeypatch.setattr(backoff, "BUSY_BACKOFF", 0.2)
    b = Backoff(logging.getLogger("t"), seconds=5.0)
    b.failed("store", DeadlinePassed("the caller's time ran out"))
    assert not b.available() and b.timeouts == 0 and b.span == 0
    time.sleep(0.25)
    assert b.available()
