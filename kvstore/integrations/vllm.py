"""kvstore as vLLM's KV connector (the v1 connector API of vLLM 0.32 and 0.33), loaded by module path::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"endpoint": "ipc:///run/kvstore/kvstore.sock"}}'

Scheduler side: ``get_num_new_matched_tokens`` asks the daemon how much of a request's tokens it
holds (its prompt; resumed after a preemption, its output so far too. A lookup: no side effects,
asked once each time the request waits to be scheduled; the last token is always left to compute).
The step's metadata then tells the workers which tokens to load into which of vLLM's blocks, and
which newly computed full blocks to save.

Loads are asynchronous in vLLM's terms (``get_num_new_matched_tokens`` says so): vLLM gives the
request its blocks and leaves it waiting (WAITING_FOR_REMOTE_KVS); each worker queues the load to
its loading thread (vllm_loader.py: on its own CUDA stream on a GPU), which writes straight into
vLLM's paged caches (``get_into`` with the request's block ids, from the first token vLLM does not
hold itself, never writing a block it shares) while the step's forward pass runs; at the step's
end the worker waits for it and reports the load finished (``finished_recving``) with the blocks
that failed (``get_block_ids_with_load_errors``: a block evicted since the lookup, a daemon away or
busy). Only
then does vLLM schedule the request, set back to its first failed block (``kv_load_failure_policy =
"recompute"``), and put the blocks before it in its prefix cache: no request computes over a block
whose load failed, nor finds one in vLLM's prefix cache, with or without async scheduling. The
cost: a request with a hit is scheduled a step later than it would compute.

Saves are queued after the step and run on a thread (vllm_saver.py: a copy out of vLLM's blocks
into shared staging, then the daemon stores them); a finished request's blocks are kept until its
saves are done (``request_finished`` returns True, ``get_finished`` reports it).

The namespace holds everything that changes K/V: the model and its revision, the weights'
quantization and ``hf_overrides``, the KV layout (layers, KV heads per rank, head size, dtype,
kvstore's block size), the tensor- and pipeline-parallel rank and size, the LoRA adapter and
vLLM's ``cache_salt`` (hashed). Requests
with multimodal inputs or prompt embeddings are neither looked up nor saved: their token ids do not
name their K/V.

vLLM's block size and kvstore's ``block_tokens`` are independent: loads start at any token (the
block holding it is fetched and written from that token on), saves cover whole kvstore blocks. A
backend's kernel blocks smaller than the scheduler's (FlashInfer's 64 tokens under --block-size 128)
are addressed as vLLM's own kernels address them: block b's j-th kernel block is b * ratio + j.
K and V are read out of each layer's cache by attention backend: vLLM's per-layer
``[num_blocks, H, block_size, 2*head_size]`` holds K and V side by side in the last dimension
(FlashAttention, FlashInfer, Triton, FlexAttention), or per head K transposed then V (the CPU
backend's "vec" kernels; its AMX and Arm kernels pack K otherwise and are refused); the older
``[2, num_blocks, block_size, H, head_size]`` is read as it is.

``kv_connector_extra_config`` (all optional):
    endpoint        the daemon (default: kvstore's default ipc endpoint)
    tenant          kvstore tenant (default "default")
    model           the model's name in the namespace (default: vLLM's model name or path)
    block_tokens    kvstore's block size (default 64)
    timeout         seconds per daemon call (default 5)
    load, save      false switches that direction off (default both on)
    save_outputs    also save generated tokens' blocks, for the next turn of a conversation (default true)
    shared_memory   false: always the socket (default: shared memory when the daemon offers it)
    max_variants    LoRA/cache-salt variants cached besides the plain model (default 32): each takes
                    a namespace per rank from the tenant's quota, for good; requests of variants
                    past it (or past the quota) are computed without kvstore
Flags take true/false (or "true"/"false"), numbers a number (or its text); anything else stops the
engine at start with the key named. A daemon that fails, times out or is busy is a miss (recomputed)
or a save skipped, logged, never an error in the engine.
A request's ``kv_transfer_params`` may name a kvstore session: ``{"kvstore_session": "conv-42"}``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from kvstore.integrations.vllm_clients import Clients, worker_ranks
from kvstore.integrations.vllm_layout import check_attention, model_layout, split_kv
from kvstore.integrations.vllm_saver import Transfer
from kvstore.integrations.vllm_scheduler import KVStoreMetadata, SchedulerSide
from kvstore.integrations.vllm_settings import Settings
from kvstore.integrations.vllm_worker import WorkerSide

log = logging.getLogger(__name__)


class KVStoreConnector(SchedulerSide, WorkerSide, KVConnectorBase_V1):
    """kvstore as vLLM's KV connector: the scheduler's hooks (vllm_scheduler.py) and the workers'
    (vllm_worker.py) over one set of settings, clients and layout."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.settings = Settings.from_extra(extra)
        policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "recompute")
        if self.settings.load and policy != "recompute":
            # a daemon away, busy or a block evicted since the lookup would fail the requests that
            # hold the block; kvstore's misses must cost a recompute, never a request
            log.warning(
                "kvstore loads nothing: kv_load_failure_policy is %r, under which a block that cannot be "
                'loaded fails its requests; set "kv_load_failure_policy": "recompute" to load (saves go on)',
                policy,
            )
            self.settings = replace(self.settings, load=False)
        check_attention(vllm_config, kv_cache_config)
        self.layout = model_layout(vllm_config, self.settings.block_tokens)
        self._worker = role == KVConnectorRole.WORKER
        # the scheduler looks up what rank 0 of the first stage holds; each worker loads and saves its own
        self._clients = Clients(
            vllm_config, self.settings, self.layout, worker_ranks(vllm_config) if self._worker else (0, 0)
        )
        T = self.layout.block_tokens
        self._T = T
        self._bs = int(vllm_config.cache_config.block_size)  # vLLM's block size
        # seconds spent in this connector's hooks, on the engine's own thread (what it adds to a step)
        self.hook_seconds: dict[str, float] = {"lookup": 0.0, "meta": 0.0, "load": 0.0, "save": 0.0}
        log.info(
            "kvstore connector (%s): %s, namespace %s",
            "worker" if self._worker else "scheduler",
            self.settings.endpoint or "default endpoint",
            self.layout,
        )
        # both sides' state (no threads: those start with register_kv_caches), whatever the role:
        # vLLM calls some hooks of either side on both (shutdown)
        self._init_scheduler()
        self._init_worker()

    @property
    def requires_kv_delivery(self) -> bool:
        """False: kvstore is a best-effort cache, a save dropped at a preemption is a later miss. (vLLM
        then keeps a preempted request's output in flight under async scheduling, not resampled.)"""
        return False


__all__: Sequence[str] = ["KVStoreConnector", "KVStoreMetadata", "Settings", "Transfer", "split_kv"]
