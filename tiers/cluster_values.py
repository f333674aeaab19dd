"""Values read off a Redis node's socket by kvstore itself: the blocks a cluster read fetches.

::

    by_node(values=True) --> one ValueReader per node's connection, its answers in order:
      $<n>\r\n<n bytes>\r\n   a value: into memory of its own (numpy, not zeroed), or
                              its last tail.nbytes bytes straight into ``tail`` (Received)
      $-1\r\n                nil (None)
      -<error>\r\n           ResponseError, returned (a MOVED: the caller asks again through redis-py)
      anything else          InvalidResponse, raised (the caller disconnects the connection)

redis-py still makes the connections (credentials, TLS, time-outs), packs and sends the commands
and keeps the cluster's topology; only the answers to GETEX are read here, in RESP2 (which
cluster_client's connections speak). Through hiredis a value is copied three times (the socket read
buffer, hiredis's own, the bytes object); here the kernel's copy is the only one.
"""

from __future__ import annotations

import builtins
import socket
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

HEAD_READ = 1 << 16  # bytes a value reader reads at a time for the answers' header lines


@dataclass(frozen=True)
class Received:
    """A value read in two pieces: its last ``tail.nbytes`` bytes straight into ``tail`` (the memory
    the caller named for them: where the block goes), the bytes before them into ``head``."""

    head: memoryview
    tail: memoryview

    def joined(self) -> memoryview:
        """The whole value, in memory of its own (``tail``'s memory may be written again after this)."""
        whole = np.empty(self.head.nbytes + self.tail.nbytes, dtype=np.uint8).data
        whole[: self.head.nbytes] = self.head
        whole[self.head.nbytes :] = self.tail
        return whole


def raw_socket(conn: Any) -> socket.socket | None:
    """The socket of a connection that answers in RESP2, for ``ValueReader``; None: read it through
    redis-py (RESP3, or a redis-py that keeps its socket elsewhere)."""
    sock = getattr(conn, "_sock", None)
    if str(getattr(conn, "protocol", 2) or 2) != "2" or not isinstance(sock, socket.socket):
        return None
    return sock


class ValueReader:
    """RESP2 answers to GET-like commands, read from one connection's socket: a bulk string into a
    buffer of its own (the bytes already read for the header lines copied in first, the rest
    received into it), nil as None, an error reply as a ResponseError (returned, not raised: the
    answers after it are read all the same). Anything else raises InvalidResponse; a socket error,
    a time-out or a closed connection raise what redis-py raises for them. ``by_node`` disconnects
    the connection on any raise, so a reader never leaves it out of step."""

    def __init__(self, sock: socket.socket, deadline: float | None = None) -> None:
        """``deadline`` (time.monotonic()): the answers end by then, or TimeoutError: a node that
        sends each piece just within the socket's time-out holds a read no longer than that."""
        self._sock = sock
        self._deadline = deadline
        self._timeout = sock.gettimeout()  # the connection's own, put back after each receive
        self._head = bytearray(HEAD_READ)
        self._view = memoryview(self._head)
        self._start = self._end = 0  # the bytes read and not yet taken: _head[_start:_end]

    def _recv(self, into: memoryview) -> int:
        from redis.exceptions import ConnectionError, TimeoutError

        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the node's answers did not all come within the time-out")
            self._sock.settimeout(left if self._timeout is None else min(left, self._timeout))
        try:
            n = self._sock.recv_into(into)
        except builtins.TimeoutError as e:
            raise TimeoutError("Timeout reading from socket") from e
        except OSError as e:
            raise ConnectionError(f"Error while reading from socket: {e}") from e
        finally:
            if self._deadline is not None:
                self._sock.settimeout(self._timeout)
        if n == 0:
            raise ConnectionError("Connection closed by server.")
        return n

    def _more(self) -> None:
        """Read more bytes after those held (moved to the front first when the buffer's end is reached)."""
        held = self._end - self._start
        if not held:
            self._start = self._end = 0
        elif self._end == len(self._head):
            self._head[:held] = self._head[self._start : self._end]
            self._start, self._end = 0, held
        self._end += self._recv(self._view[self._end :])

    def _line(self) -> bytes:
        from redis.exceptions import InvalidResponse

        while True:
            i = self._head.find(b"\r\n", self._start, self._end)
            if i >= 0:
                line = bytes(self._head[self._start : i])
                self._start = i + 2
                return line
            if self._end - self._start >= len(self._head) // 2:
                raise InvalidResponse("an answer's header line runs on past 32 KiB")
            self._more()

    def reply(self, tail: memoryview | None = None) -> memoryview | Received | Exception | None:
        """The next answer; a value longer than ``tail`` comes as Received, its last bytes in ``tail``."""
        from redis.exceptions import InvalidResponse, ResponseError

        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            return ResponseError(rest.decode(errors="replace"))
        if kind != b"$" or not rest.lstrip(b"-").isdigit():
            raise InvalidResponse(f"an answer to a read that is no value: {line[:40]!r}")
        n = int(rest)
        if n < 0:
            return None
        value: memoryview | Received
        if tail is not None and 0 < tail.nbytes < n:
            head = np.empty(n - tail.nbytes, dtype=np.uint8).data
            self._receive(head)
            self._receive(tail)
            value = Received(head, tail)
        else:
            value = np.empty(n, dtype=np.uint8).data  # not zeroed: every byte is received into it
            self._receive(value)
        while self._end - self._start < 2:
            self._more()
        if self._head[self._start : self._start + 2] != b"\r\n":
            raise InvalidResponse("a value's answer does not end where its length says")
        self._start += 2
        return value

    def _receive(self, into: memoryview) -> None:
        """Fill ``into``: the bytes already read first, then straight from the socket."""
        have = min(into.nbytes, self._end - self._start)
        into[:have] = self._view[self._start : self._start + have]
        self._start += have
        while have < into.nbytes:
            have += self._recv(into[have:])

    def finish(self) -> None:
        """Every byte read was an answer: InvalidResponse if more came than the commands asked for."""
        from redis.exceptions import InvalidResponse

        if self._start != self._end:
            raise InvalidResponse("a node sent more than the answers asked of it")
