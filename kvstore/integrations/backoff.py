"""Leave a daemon that does not answer alone for a while: engine hooks must not wait on it each call."""

from __future__ import annotations

import logging
import time

BACKOFF = 10.0  # seconds


class Backoff:
    """``available()`` is False for ``seconds`` after a call timed out (``failed``); the time-out is
    logged once per outage, other failures every time."""

    def __init__(self, log: logging.Logger, seconds: float = BACKOFF) -> None:
        self._log = log
        self.seconds = seconds
        self._until = 0.0
        self.timeouts = 0

    def available(self) -> bool:
        return time.monotonic() >= self._until

    def failed(self, what: str, err: Exception) -> None:
        if isinstance(err, TimeoutError):
            self.timeouts += 1
            if self.available():
                self._log.warning(
                    "kvstore did not answer a %s (%s); not asked again for %.0f s", what, err, self.seconds
                )
            self._until = time.monotonic() + self.seconds
        else:
            self._log.warning("kvstore %s failed: %s", what, err)
