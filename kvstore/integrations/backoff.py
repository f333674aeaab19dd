"""Leave a daemon that does not answer alone for a while: engine hooks must not wait on it each call."""

from __future__ import annotations

import logging
import time

BACKOFF = 10.0  # seconds


BUSY_BACKOFF = 1.0  # seconds, after a call waited out its time-out on a daemon answering busy


class Backoff:
    """``available()`` is False for ``seconds`` after a call timed out (``failed``), and for
    BUSY_BACKOFF after one ``waited`` its time-out on a daemon answering busy (a call that does not
    wait is turned away at once, and costs nothing); each is logged once per outage, other failures
    every time."""

    def __init__(self, log: logging.Logger, seconds: float = BACKOFF) -> None:
        self._log = log
        self.seconds = seconds
        self._until = 0.0
        self.timeouts = 0

    def available(self) -> bool:
        return time.monotonic() >= self._until

    def failed(self, what: str, err: Exception, *, waited: bool = False) -> None:
        if isinstance(err, TimeoutError):
            self.timeouts += 1
            if self.available():
                self._log.warning(
                    "kvstore did not answer a %s (%s); not asked again for %.0f s", what, err, self.seconds
                )
            self._until = time.monotonic() + self.seconds
        elif waited and getattr(err, "code", None) == "busy":  # each after it would wait as long
            if self.available():
                self._log.warning("kvstore is busy (%s); not asked again for %.0f s", err, BUSY_BACKOFF)
            self._until = max(self._until, time.monotonic() + BUSY_BACKOFF)
        else:
            self._log.warning("kvstore %s failed: %s", what, err)
