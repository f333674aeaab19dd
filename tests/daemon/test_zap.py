"""The ZAP handler's decisions and what it logs of the keys it refuses."""

from __future__ import annotations

import logging
import os

import pytest
from zmq.utils import z85

from kvstore.daemon.zap import _DENIALS_LOGGED, ZapHandler


def test_only_listed_curve_keys_pass_with_their_tenant() -> None:
    alice = os.urandom(32)
    zap = ZapHandler({z85.encode(alice): "alice"})
    assert zap.decide(b"CURVE", [alice]) == "alice"
    assert zap.decide(b"CURVE", [os.urandom(32)]) is None
    assert zap.decide(b"NULL", []) is None
    assert zap.decide(b"CURVE", [alice[:31]]) is None


def test_refused_keys_are_logged_once_each_and_a_flood_of_them_goes_to_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A key is reported at warning level once (its reconnects go to debug); past _DENIALS_LOGGED
    distinct keys one line says so and the rest go to debug, repeats of a key included (they were
    warnings for good once the set was full)."""
    zap = ZapHandler({})
    keys = [os.urandom(32) for _ in range(_DENIALS_LOGGED + 20)]
    with caplog.at_level(logging.DEBUG, logger="kvstore.daemon.auth"):
        for k in keys:
            zap._report(b"CURVE", [k], b"127.0.0.1")
        for _ in range(50):  # a key past the cap reconnects, again and again
            zap._report(b"CURVE", [keys[-1]], b"127.0.0.1")
        zap._report(b"CURVE", [keys[0]], b"127.0.0.1")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == _DENIALS_LOGGED + 1
    assert "further refusals are logged at debug level" in warnings[-1]
