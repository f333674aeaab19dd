"""Codec quality on the real model: teacher-forced continuation through a decoded cache.

Each registered codec must keep SmolLM2's next-token distributions close to those
of the exact (bfloat16) cache, over >= 1,000 positions of real text. A per-block
int4 -- one scale for the whole block -- must fail the int4 gate: it shows the gate
can fail, and that what int4 keeps per group is what passes it.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from kvstore.codecs import CODECS, get_codec
from kvstore.codecs.base import Codec, expect_bytes
from kvstore.config import NvmeConfig
from kvstore.integrations.quality import AIMS, GATES, QualityHarness
from kvstore.layout import KVLayout

pytestmark = pytest.mark.model


class PerBlockInt4(Codec):
    """Negative control: 4-bit codes with a single minimum and scale for the whole block."""

    name = "int4-per-block"
    codec_id = 254  # test-local, never registered

    def _encode(self, block: torch.Tensor) -> tuple[dict[str, Any], list[torch.Tensor]]:
        x = block.float().reshape(-1)
        lo, hi = x.min(), x.max()
        scale = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(hi))
        q = ((x - lo) / scale).round().clamp(0, 15).to(torch.uint8)
        q = torch.nn.functional.pad(q, (0, q.numel() % 2))
        return {}, [torch.stack([lo, scale]), q[0::2] | (q[1::2] << 4)]

    def _decode(self, payload: torch.Tensor, layout: KVLayout, params: dict[str, Any]) -> torch.Tensor:
        expect_bytes(payload, 8 + (layout.block_numel + 1) // 2, "int4-per-block")
        lo, scale = payload[:8].view(torch.float32)
        packed = payload[8:]
        q = torch.stack([packed & 15, packed >> 4], -1).reshape(-1)[: layout.block_numel]
        return (q.float() * scale + lo).to(layout.torch_dtype).reshape(layout.shape())


def registered(name: str) -> Codec:
    if name not in CODECS:
        pytest.skip(f"codec {name} is not registered in kvstore.codecs.CODECS yet")
    return get_codec(name)


def test_enough_real_text_is_scored(harness: QualityHarness) -> None:
    # >= 1,000 scored positions, from several different texts, each after a 1,024-token prefix
    assert harness.positions >= 1000
    assert len({t.name for t in harness.texts}) >= 3
    assert all(t.kv.shape[2] == 1024 and t.kv.dtype == torch.bfloat16 for t in harness.texts)


def test_raw_gives_identical_logits(harness: QualityHarness) -> None:
    result = harness.measure(registered("raw"))
    assert result.max_abs_logprob_diff == 0.0
    assert result.kl == 0.0 and result.top1 == 1.0
    assert result.rel_l2_k == 0.0 and result.rel_l2_v == 0.0
    assert GATES["raw"].misses(result) == []


@pytest.mark.parametrize("name", ["int8", "fp8", "int4"])
def test_lossy_codec_meets_its_gate(harness: QualityHarness, name: str) -> None:
    result = harness.measure(registered(name))
    assert GATES[name].misses(result) == [], f"{name} {result.params}: {GATES[name].misses(result)}"
    # lossy, but not by accident lossless: the gate measured something
    assert result.kl > 0 and 0 < result.rel_l2_k < 0.2 and 0 < result.rel_l2_v < 0.2


def test_int4_with_one_scale_per_block_fails_the_int4_gate(harness: QualityHarness) -> None:
    # same 4 bits per value, but one range for the whole block: the gate must catch it
    result = harness.measure(PerBlockInt4())
    assert result.bits_per_value <= 5.0
    misses = GATES["int4"].misses(result)
    assert misses and misses[0].startswith("KL"), misses


def test_keeping_the_first_block_exact_helps_and_is_paid_for(harness: QualityHarness) -> None:
    # the first block holds the attention sink: kept exact (raw), int4 loses less,
    # and the raw block's 16 bits show up in bits per value
    codec = registered("int4")
    every = harness.measure(codec)
    first_exact = harness.measure(codec, head_blocks=1)
    assert first_exact.head_blocks == 1 and first_exact.head_codec == "raw"
    assert first_exact.kl < every.kl
    assert first_exact.bits_per_value > every.bits_per_value + 0.5


def test_nvme_tier_as_configured_by_default_meets_the_int4_gate(harness: QualityHarness) -> None:
    # what a restarted daemon serves from disk: int4 (rotated) + zstd, the first block of each prefix
    # at int8; bits per value count every frame of the prefix as stored
    nvme = NvmeConfig()
    codec, head = nvme.codecs()
    assert codec.name == "int4" and head is not None and nvme.head_blocks >= 1
    result = harness.measure(codec, head_blocks=nvme.head_blocks, head_codec=head)
    assert result.head_codec == head.name
    assert GATES["int4"].misses(result) == [], GATES["int4"].misses(result)
    # the head block is paid for, but the whole prefix stays within int4's 5 bits
    every = harness.measure(codec)
    assert result.kl < every.kl and result.bits_per_value > every.bits_per_value
    # for information: the aim (KL <= 2e-3, top-1 >= 98 %, <= 5 bits); measured KL 1.7e-3, 98.3 %, 4.94
    misses = AIMS["int4"].misses(result)
    if misses:
        warnings.warn(f"nvme default misses the int4 aim: {misses}", stacklevel=1)
