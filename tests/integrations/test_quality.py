"""kvstore.integrations.quality without the model: the quality bars and the texts they are measured on."""

from __future__ import annotations

from kvstore.integrations.quality import AIMS, GATES, QualityResult, Target, reference_texts


def result(kl: float, top1: float = 1.0, bits: float = 4.0) -> QualityResult:
    return QualityResult(
        codec="int4",
        params={},
        kl=kl,
        top1=top1,
        ppl_ref=10.0,
        ppl=10.1,
        rel_l2_k=0.04,
        rel_l2_v=0.08,
        bits_per_value=bits,
        max_abs_logprob_diff=1.0,
        positions=1024,
    )


def test_a_target_names_every_bar_a_result_misses() -> None:
    bar = Target(max_kl=2e-3, min_top1=0.98, max_bits=5.0)
    assert bar.misses(result(1e-3, 0.99, 5.0)) == []
    misses = bar.misses(result(3e-3, 0.97, 5.5))
    assert [m.split()[0] for m in misses] == ["KL", "top-1", "5.500"]
    # NaN never passes (a broken measurement is not a pass)
    assert bar.misses(result(float("nan")))


def test_gates_are_looser_than_aims_and_raw_must_be_exact() -> None:
    for name, gate in GATES.items():
        assert AIMS[name].max_kl <= gate.max_kl
    assert GATES["raw"].misses(result(0.0)) == []
    assert GATES["raw"].misses(result(1e-12))
    assert result(1e-3).ppl_change > 0


def test_real_texts_are_found_on_this_host() -> None:
    texts = reference_texts()
    assert len(texts) >= 3
    assert all(len(text) > 10_000 for _, text in texts)
    assert len({name for name, _ in texts}) == len(texts)
