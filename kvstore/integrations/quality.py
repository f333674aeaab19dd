"""How much a codec costs a real model: teacher-forced continuation through a decoded cache.

For every text::

    tokens   [0 ............ P) [P ............ P+N) P+N
             prefix (P = 16 x 64)  continuation, teacher-forced
    exact:   prefill -> KV [L, 2, P, H, D] in the block dtype  -> cache -> logits_ref [N, vocab]
    codec:   the same KV cut into 64-token blocks, each encoded and decoded -> cache -> logits [N, vocab]

and the two next-token distributions are compared position by position: KL(ref || codec)
(mean over positions), top-1 agreement, perplexity of the true next tokens, relative L2
error of K and of V, and bits per value (frame bytes x 8 / values).

The model computes in float32; the cache is stored in ``block_dtype`` (bfloat16 by
default, what the store keeps), so the reference is the bfloat16 cache and a lossless
codec gives bit-identical logits. The exact caches and reference distributions are
computed once (``QualityHarness.prepare``) and reused for every codec.
"""

from __future__ import annotations

import importlib
import math
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvstore.codecs.base import Codec
from kvstore.codecs.raw import RawCodec
from kvstore.errors import KVStoreError
from kvstore.integrations.models import LoadedModel
from kvstore.integrations.transformers import cache_to_kv, kv_to_cache

# Real text present on every host of this project after setup (Debian licenses, CPython's
# own files). Several kinds: legal text, a license with history prose, reference prose.
_LICENSE_DIR = Path("/usr/share/common-licenses")
_PYDOC_TOPICS = ("execmodel", "exceptions", "naming", "import", "compound", "assignment")


class NotEnoughText(KVStoreError):
    """The texts found hold fewer scored positions than asked for."""

    code = "not_enough_text"


def reference_texts() -> list[tuple[str, str]]:
    """(name, text) of the real texts found on this host, in a fixed order."""
    found: list[tuple[str, str]] = []
    for name in ("GPL-3", "Apache-2.0"):
        path = _LICENSE_DIR / name
        if path.is_file():
            found.append((name, path.read_text(encoding="utf-8")))
    py_license = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if py_license.is_file():
        found.append(("Python LICENSE", py_license.read_text(encoding="utf-8")))
    try:  # CPython's reference manual, as prose
        topics: dict[str, str] = importlib.import_module("pydoc_data.topics").topics
    except ImportError:
        topics = {}
    prose = "\n\n".join(topics[t] for t in _PYDOC_TOPICS if t in topics)
    if prose:
        found.append(("Python reference", prose))
    return found


@dataclass(frozen=True)
class PreparedText:
    """One text with its exact prefix cache and the reference next-token log-probabilities."""

    name: str
    prefix: torch.Tensor  # [P] token ids
    continuation: torch.Tensor  # [N] token ids fed teacher-forced
    targets: torch.Tensor  # [N] the true next tokens
    kv: torch.Tensor  # [L, 2, P, H, D] in the block dtype
    ref_logprobs: torch.Tensor  # [N, vocab] float32


@dataclass(frozen=True)
class QualityResult:
    """What one codec did to the model, over every prepared text."""

    codec: str
    params: dict[str, Any]
    kl: float  # mean KL(ref || codec) in nats over all scored positions
    top1: float  # fraction of positions whose most likely token is unchanged
    ppl_ref: float
    ppl: float
    rel_l2_k: float  # ||K' - K|| / ||K|| over all blocks
    rel_l2_v: float
    bits_per_value: float  # frame bytes x 8 / values, frames as the codec wrote them
    max_abs_logprob_diff: float
    positions: int
    head_blocks: int = 0  # leading blocks (the attention sink's) that went through ``head_codec``
    head_codec: str = ""

    @property
    def ppl_change(self) -> float:
        """Relative change of perplexity (0.01 = 1 % worse)."""
        return self.ppl / self.ppl_ref - 1.0


@dataclass(frozen=True)
class Target:
    """A quality bar for one codec: KL at most ``max_kl``, and optionally top-1 and bits per value."""

    max_kl: float
    min_top1: float | None = None
    max_bits: float | None = None

    def misses(self, result: QualityResult) -> list[str]:
        """What ``result`` falls short of (empty when it meets the bar)."""
        out = []
        if not result.kl <= self.max_kl:
            out.append(f"KL {result.kl:.2e} > {self.max_kl:.0e}")
        if self.min_top1 is not None and not result.top1 >= self.min_top1:
            out.append(f"top-1 {result.top1:.2%} < {self.min_top1:.0%}")
        if self.max_bits is not None and not result.bits_per_value <= self.max_bits:
            out.append(f"{result.bits_per_value:.3f} bits/value > {self.max_bits}")
        return out

    def describe(self) -> str:
        parts = [f"KL <= {self.max_kl:.0e}"]
        if self.min_top1 is not None:
            parts.append(f"top-1 >= {self.min_top1:.0%}")
        if self.max_bits is not None:
            parts.append(f"<= {self.max_bits:g} bits/value")
        return ", ".join(parts)


# "5 bits per value" means codes and per-group stats; the frame header (~130 bytes a
# block, 0.0015 bits/value for SmolLM2) comes on top, hence 5.01.
_FIVE_BITS = 5.01

# What the model tests enforce (tests/model/test_codec_quality.py) ...
GATES: dict[str, Target] = {
    "raw": Target(max_kl=0.0, min_top1=1.0),
    "int8": Target(max_kl=5e-4),
    "fp8": Target(max_kl=3e-3),
    "int4": Target(max_kl=1e-2, max_bits=_FIVE_BITS),
}
# ... and what the codecs aim for (bench/codec_quality.py prints both).
AIMS: dict[str, Target] = {
    "raw": Target(max_kl=0.0, min_top1=1.0),
    "int8": Target(max_kl=5e-5),
    "fp8": Target(max_kl=5e-4),
    "int4": Target(max_kl=2e-3, min_top1=0.98, max_bits=_FIVE_BITS),
}


class QualityHarness:
    """Measure codecs on a loaded model; prepare the texts once, then ``measure`` each codec."""

    def __init__(
        self, loaded: LoadedModel, *, block_dtype: torch.dtype = torch.bfloat16, block_tokens: int = 64
    ) -> None:
        self.loaded = loaded
        self.block_dtype = block_dtype
        self.block_tokens = block_tokens
        self.texts: list[PreparedText] = []

    @property
    def positions(self) -> int:
        return sum(t.targets.numel() for t in self.texts)

    def prepare(
        self,
        texts: Sequence[tuple[str, str]],
        *,
        prefix_blocks: int = 16,
        continuation: int = 256,
        min_positions: int = 1000,
    ) -> None:
        """Tokenize, prefill and score the reference for each text long enough (P + N + 1 tokens).

        Replaces any earlier preparation. Raises NotEnoughText when fewer than
        ``min_positions`` positions result.
        """
        prefix = prefix_blocks * self.block_tokens
        prepared = []
        for name, text in texts:
            ids = self.loaded.tokenizer(text, return_tensors="pt").input_ids[0]
            if ids.numel() < prefix + continuation + 1:
                continue
            p, c = ids[:prefix], ids[prefix : prefix + continuation]
            targets = ids[prefix + 1 : prefix + continuation + 1]
            with torch.no_grad():
                out = self.loaded.model(p.unsqueeze(0), use_cache=True)
            kv = cache_to_kv(
                out.cache if hasattr(out, "cache") else out.past_key_values, dtype=self.block_dtype
            )
            prepared.append(PreparedText(name, p, c, targets, kv, self._logprobs(c, kv)))
        self.texts = prepared
        if self.positions < min_positions:
            raise NotEnoughText(
                f"only {self.positions} scored positions from {len(prepared)} texts, "
                f"need {min_positions}; give more or longer texts"
            )

    def _logprobs(self, continuation: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """Next-token log-probabilities of the continuation through a cache holding ``kv``."""
        model = self.loaded.model
        cache = kv_to_cache(kv, model.config, dtype=model.dtype)
        with torch.no_grad():
            logits = model(continuation.unsqueeze(0), cache=cache, use_cache=True).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)

    def roundtrip(
        self, codec: Codec, kv: torch.Tensor, *, head_blocks: int = 0, head_codec: Codec | None = None
    ) -> tuple[torch.Tensor, int]:
        """``kv`` [L, 2, P, H, D] with every block encoded and decoded; returns (decoded kv, frame bytes).

        The first ``head_blocks`` blocks go through ``head_codec`` instead (raw when None:
        kept exact, and counted at their full size).
        """
        T = self.block_tokens
        head = head_codec or RawCodec()
        out, nbytes = kv.clone(), 0
        for i, start in enumerate(range(0, kv.shape[2], T)):
            c = head if i < head_blocks else codec
            frame = c.encode(kv[:, :, start : start + T])
            nbytes += len(frame)
            out[:, :, start : start + T] = c.decode(frame)
        return out, nbytes

    def measure(
        self, codec: Codec, *, head_blocks: int = 0, head_codec: Codec | None = None
    ) -> QualityResult:
        """Run every prepared text through ``codec`` and compare with the reference.

        ``head_blocks``/``head_codec``: see ``roundtrip`` (a store may keep the first
        block of a prefix, which holds the attention sink, at higher fidelity).
        """
        if not self.texts:
            raise NotEnoughText("QualityHarness.measure called before prepare()")
        kl_sum = top1 = n = 0.0
        nll_ref = nll = 0.0
        err = {"k": 0.0, "v": 0.0}
        ref_norm = {"k": 0.0, "v": 0.0}
        nbytes = values = 0
        max_diff = 0.0
        for text in self.texts:
            kv, fb = self.roundtrip(codec, text.kv, head_blocks=head_blocks, head_codec=head_codec)
            nbytes += fb
            values += kv.numel()
            for i, key in enumerate(("k", "v")):
                err[key] += float((kv[:, i].float() - text.kv[:, i].float()).square().sum())
                ref_norm[key] += float(text.kv[:, i].float().square().sum())
            lp = self._logprobs(text.continuation, kv)
            ref = text.ref_logprobs
            kl_sum += float((ref.exp() * (ref - lp)).sum(dim=-1, dtype=torch.float64).sum())
            top1 += float((lp.argmax(-1) == ref.argmax(-1)).sum())
            nll_ref -= float(ref.gather(-1, text.targets[:, None]).sum(dtype=torch.float64))
            nll -= float(lp.gather(-1, text.targets[:, None]).sum(dtype=torch.float64))
            max_diff = max(max_diff, float((lp - ref).abs().max()))
            n += text.targets.numel()
        return QualityResult(
            codec=codec.name,
            params=codec.params(),
            kl=kl_sum / n,
            top1=top1 / n,
            ppl_ref=math.exp(nll_ref / n),
            ppl=math.exp(nll / n),
            rel_l2_k=math.sqrt(err["k"] / ref_norm["k"]),
            rel_l2_v=math.sqrt(err["v"] / ref_norm["v"]),
            bits_per_value=nbytes * 8 / values if values else float("nan"),
            max_abs_logprob_diff=max_diff,
            positions=int(n),
            head_blocks=head_blocks,
            head_codec=(head_codec or RawCodec()).name if head_blocks else "",
        )
