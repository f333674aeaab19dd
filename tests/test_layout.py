"""kvstore.layout: the shape of a block, its sizes, its identity, and the checks on tensors."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import LayoutError
from kvstore.layout import DTYPES, KVLayout, dtype_name

# SmolLM2-135M: 30 layers, 3 KV heads of 64, bf16; 64-token blocks
SMOL = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16", block_tokens=64)


def test_sizes_of_a_smollm2_block() -> None:
    assert SMOL.shape() == (30, 2, 64, 3, 64)
    assert SMOL.shape(10) == (30, 2, 10, 3, 64)
    assert SMOL.values_per_token == 30 * 2 * 3 * 64
    assert SMOL.bytes_per_token == 30 * 2 * 3 * 64 * 2  # 23 KiB a token
    assert SMOL.block_numel == SMOL.values_per_token * 64
    assert SMOL.block_nbytes == 30 * 2 * 64 * 3 * 64 * 2
    assert SMOL.itemsize == 2 and SMOL.torch_dtype == torch.bfloat16
    assert torch.empty(SMOL.shape(), dtype=SMOL.torch_dtype).nbytes == SMOL.block_nbytes


def test_defaults_and_dtype_normalization() -> None:
    lay = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8)
    assert (lay.dtype, lay.block_tokens) == ("bfloat16", 64)
    # a torch dtype or its printed name becomes the canonical name, so equal layouts compare equal
    assert KVLayout(2, 1, 8, dtype=torch.float16) == KVLayout(2, 1, 8, dtype="float16")  # type: ignore[arg-type]
    assert KVLayout(2, 1, 8, dtype="torch.float32").dtype == "float32"
    assert hash(KVLayout(2, 1, 8, dtype=torch.float16)) == hash(KVLayout(2, 1, 8, dtype="float16"))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.int8, torch.float8_e4m3fn, "float64", "fp16", "half", ""]
)
def test_unsupported_dtypes_raise(dtype: object) -> None:
    with pytest.raises(LayoutError, match="not supported"):
        KVLayout(2, 1, 8, dtype=dtype)  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="not supported"):
        dtype_name(dtype)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("num_layers", 0, "must be between 1 and 1024"),
        ("num_layers", -1, "must be between 1 and 1024"),
        ("num_layers", 1025, "must be between 1 and 1024"),
        ("num_kv_heads", 0, "must be between 1 and 1024"),
        ("head_dim", 4097, "must be between 1 and 4096"),
        ("block_tokens", 0, "must be between 1 and 65536"),
        ("block_tokens", 65537, "must be between 1 and 65536"),
        ("num_layers", 2.0, "must be an integer"),
        ("head_dim", "64", "must be an integer"),
        ("num_kv_heads", True, "must be an integer"),
        ("block_tokens", None, "must be an integer"),
    ],
)
def test_bad_layout_fields_raise_naming_the_field(field: str, value: object, match: str) -> None:
    args: dict[str, object] = {
        "num_layers": 2,
        "num_kv_heads": 1,
        "head_dim": 8,
        "block_tokens": 4,
        field: value,
    }
    with pytest.raises(LayoutError, match=f"{field} {match}"):
        KVLayout(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "change",
    [
        {"num_layers": 31},
        {"num_kv_heads": 4},
        {"head_dim": 128},
        {"dtype": "float16"},
        {"block_tokens": 32},
    ],
)
def test_fingerprint_and_canonical_differ_when_any_field_differs(change: dict[str, object]) -> None:
    other = replace(SMOL, **change)  # type: ignore[arg-type]
    assert other.canonical() != SMOL.canonical()
    assert other.fingerprint() != SMOL.fingerprint()
    assert len(SMOL.fingerprint()) == 16


def test_fingerprint_golden() -> None:
    # frames on disk carry this; a change of the scheme would orphan every stored frame
    lay = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16", block_tokens=4)
    assert lay.canonical() == b"L=30;H=3;D=64;dtype=bfloat16;T=4"
    assert lay.fingerprint().hex() == "8adbc0bbf8b1237594e3fb3b23ab3b78"


def test_check_tensor_accepts_the_canonical_shape() -> None:
    lay = KVLayout(2, 1, 8, dtype="float16", block_tokens=4)
    lay.check_tensor(torch.zeros(2, 2, 4, 1, 8, dtype=torch.float16))
    lay.check_tensor(torch.zeros(2, 2, 7, 1, 8, dtype=torch.float16))  # any token count
    lay.check_tensor(torch.zeros(2, 2, 4, 1, 8, dtype=torch.float16), tokens=4)


@pytest.mark.parametrize(
    "kv, tokens, match",
    [
        ([[0.0]], None, "must be a torch.Tensor"),
        (torch.zeros(2, 2, 4, 8, dtype=torch.float16), None, "must have 5 dims"),
        (torch.zeros(2, 3, 4, 1, 8, dtype=torch.float16), None, "layout expects"),
        (torch.zeros(3, 2, 4, 1, 8, dtype=torch.float16), None, "layout expects"),
        (torch.zeros(2, 2, 4, 2, 8, dtype=torch.float16), None, "layout expects"),
        (torch.zeros(2, 2, 4, 1, 16, dtype=torch.float16), None, "layout expects"),
        (torch.zeros(2, 2, 3, 1, 8, dtype=torch.float16), 4, "layout expects"),
        (
            torch.zeros(2, 2, 4, 1, 8, dtype=torch.bfloat16),
            None,
            "dtype torch.bfloat16, layout expects float16",
        ),
    ],
)
def test_check_tensor_rejects(kv: object, tokens: int | None, match: str) -> None:
    lay = KVLayout(2, 1, 8, dtype="float16", block_tokens=4)
    with pytest.raises(LayoutError, match=match):
        lay.check_tensor(kv, tokens=tokens)  # type: ignore[arg-type]


def test_of_block_reads_the_layout_off_a_tensor() -> None:
    block = torch.zeros(SMOL.shape(), dtype=torch.bfloat16)
    assert KVLayout.of_block(block) == SMOL
    with pytest.raises(LayoutError, match=r"\[L, 2, T, H, D\]"):
        KVLayout.of_block(torch.zeros(30, 3, 64, 3, 64))
    with pytest.raises(LayoutError, match=r"\[L, 2, T, H, D\]"):
        KVLayout.of_block("block")  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="not supported"):
        KVLayout.of_block(torch.zeros(2, 2, 4, 1, 8, dtype=torch.float64))


def test_dict_round_trip_and_bad_dicts() -> None:
    assert KVLayout.from_dict(SMOL.to_dict()) == SMOL
    assert KVLayout.from_dict({"num_layers": 2, "num_kv_heads": 1, "head_dim": 8}).block_tokens == 64
    with pytest.raises(LayoutError, match="must be a mapping"):
        KVLayout.from_dict([2, 1, 8])
    with pytest.raises(LayoutError, match=r"unknown layout field\(s\) \['heads'\]"):
        KVLayout.from_dict({**SMOL.to_dict(), "heads": 3})
    with pytest.raises(LayoutError, match=r"missing \['head_dim'\]"):
        KVLayout.from_dict({"num_layers": 2, "num_kv_heads": 1})
    with pytest.raises(LayoutError, match="between 1"):
        KVLayout.from_dict({**SMOL.to_dict(), "num_layers": 0})


@settings(max_examples=200, deadline=None)
@given(
    L=st.integers(1, 1024),
    H=st.integers(1, 1024),
    D=st.integers(1, 4096),
    T=st.integers(1, 65536),
    dtype=st.sampled_from(sorted(DTYPES)),
)
def test_layout_properties(L: int, H: int, D: int, T: int, dtype: str) -> None:
    lay = KVLayout(L, H, D, dtype=dtype, block_tokens=T)
    assert KVLayout.from_dict(lay.to_dict()) == lay
    assert lay.block_nbytes == L * 2 * T * H * D * DTYPES[dtype].itemsize
    assert lay.shape() == (L, 2, T, H, D)
    # canonical bytes identify the layout: parse them back
    parts = dict(p.split("=") for p in lay.canonical().decode().split(";"))
    assert parts == {"L": str(L), "H": str(H), "D": str(D), "dtype": dtype, "T": str(T)}
