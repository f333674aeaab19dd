"""Leave a daemon that does not answer alone for a while: engine hooks must not wait on it each call."""

from __future__ import annotations

import logging
import time

from kvstore.wire.errors import DeadlinePassed

BACKOFF = 10.0  # seconds, after a call timed out
MAX_BACKOFF = 60.0  # seconds: the back-off doubles with each time-out in a row, up to this
BUSY_BACKOFF = 1.0  # seconds, after a call waited out its time-out on a daemon answering busy
BUSY_QUIET = 60.0  # seconds between two logs of calls turned away busy (each a miss, at once)
# seconds an engine's lookup waits at most, whatever its calls' timeout: one takes about a
# millisecond on the same host, and the engine's scheduler waits on it
LOOKUP_TIMEOUT = 2.0


class Backoff:
    """``available()`` is False for ``seconds`` after a call timed out (``failed``), twice as long
    after each time-out in a row (the call after a back-off timed out again: a daemon that stays
    away costs the engine one time-out a minute at most, not one every ``seconds``), and for
    BUSY_BACKOFF after one ``waited`` its time-out on a daemon answering busy (a call that does not
    wait is turned away at once, and costs nothing: logged once a minute); each is logged once per
    outage, other failures every time."""

    def __init__(
        self,
        log: logging.Logger,
        seconds: float = BACKOFF,
        *,
        under: Backoff | None = None,
        held: str = "not asked again",
    ) -> None:
        """``under``: the back-off of the engine's own calls (lookups, loads), kept by this one too (a
        daemon they found away is away for stores as well), while this one's failures are its own:
        stores wait out a busy daemon and may outlast their time-out on a loaded one (a big put
        behind demotions), where lookups, answered at once, still get through. A time-out during
        ``under``'s back-off is that outage's, said already. ``held``: what the log says is held back."""
        self._log = log
        self._under = under
        self._held = held
        self.seconds = seconds
        self._until = 0.0  # the time-out's back-off ends
        self._busy_until = 0.0  # a busy answer's ends
        self._span = 0.0  # the last time-out's back-off
        self._busy_said = -BUSY_QUIET  # when a call turned away busy was last logged
        self.timeouts = 0

    @property
    def span(self) -> float:
        """How long the back-off after the last time-out lasts (0 before any)."""
        return self._span

    def available(self) -> bool:
        mine = time.monotonic() >= max(self._until, self._busy_until)
        return mine and (self._under is None or self._under.available())

    def failed(self, what: str, err: Exception, *, waited: bool = False) -> None:
        if isinstance(err, DeadlinePassed):  # it answers, too slowly for the caller's budget: a rest
            if self.available():  # as after a busy daemon waited out, not a time-out's (it is there)
                self._log.warning(
                    "kvstore was too slow for a %s within its budget (%s); %s for %.0f s",
                    what,
                    err,
                    self._held,
                    BUSY_BACKOFF,
                )
            self._busy_until = max(self._busy_until, time.monotonic() + BUSY_BACKOFF)
        elif isinstance(err, TimeoutError):
            self.timeouts += 1
            now = time.monotonic()
            if now < self._until:  # another call's time-out of the same outage
                return
            # the first call after the last back-off timed out again: the daemon is still away
            again = self._span > 0 and now - self._until < self._span + MAX_BACKOFF
            self._span = min(MAX_BACKOFF, 2 * self._span) if again else self.seconds
            said = self._under is not None and not self._under.available()  # (its outage, logged)
            if not again and not said:
                self._log.warning(
                    "kvstore did not answer a %s (%s); %s for %.0f s (longer while it stays away)",
                    what,
                    err,
                    self._held,
                    self._span,
                )
            self._until = now + self._span
        elif waited and getattr(err, "code", None) == "busy":  # each after it would wait as long
            if self.available():
                self._log.warning("kvstore is busy (%s); %s for %.0f s", err, self._held, BUSY_BACKOFF)
            self._busy_until = max(self._busy_until, time.monotonic() + BUSY_BACKOFF)
        elif getattr(err, "code", None) == "busy":  # turned away at once (a miss): under load that is
            now = time.monotonic()  # every call, so it is said once a minute, not each time
            if now - self._busy_said >= BUSY_QUIET:
                self._busy_said = now
                self._log.warning(
                    "kvstore is busy (%s): lookups and loads miss meanwhile (said once a minute)", err
                )
        else:
            self._log.warning("kvstore %s failed: %s", what, err)
