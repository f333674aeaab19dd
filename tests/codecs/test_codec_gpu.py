"""Codecs on CUDA: the same torch code, so a block encoded on the GPU decodes like one encoded on the CPU."""

from __future__ import annotations

import pytest
import torch

from kvstore.codecs import decode_frame, decode_frames
from kvstore.layout import KVLayout
from tests.codecs.codec_blocks import (
    DTYPES,
    codec_variants,
    make_codec,
    slice_absmax,
    structured_block,
    variant_id,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("variant", codec_variants(), ids=variant_id)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["normal", "heavy", "wide", "huge", "constant"])
def test_gpu_encode_and_decode_match_the_cpu(
    variant: tuple[str, dict], dtype: torch.dtype, kind: str
) -> None:
    codec = make_codec(variant)
    block = structured_block(kind, (3, 2, 64, 3, 64), dtype, seed=21)
    cpu_frame = codec.encode(block)
    gpu_frame = codec.encode(block.cuda())
    want = decode_frame(cpu_frame).double()
    # one frame decoded on either device: the same correctly rounded operations, so within
    # one unit of the dtype at the slice's scale (in practice bit for bit)
    on_gpu = decode_frame(cpu_frame, device="cuda")
    assert on_gpu.device.type == "cuda" and on_gpu.dtype == dtype
    # except int4's rotation, a matrix product: BLAS and cuBLAS sum in float32 in other orders, which
    # moves float32 results by a few units (float16 is rotated in float32 and rounds that away);
    # bfloat16 is rotated back in bfloat16 on the GPU, and on the CPU too where oneDNN takes it (else
    # in float32): its rounding before the product moves a result by up to sqrt(64)/2 units, plus one
    matmul = bool(variant[1].get("rotate")) and dtype in (torch.float32, torch.bfloat16)
    units = {torch.float32: 16, torch.bfloat16: 5}.get(dtype, 1) if matmul else 1
    ulp = slice_absmax(block) * float(torch.finfo(dtype).eps) * units
    assert bool(((on_gpu.cpu().double() - want).abs() <= ulp).all())
    # a frame encoded on the GPU: same size (unless zstd packed codes that moved), and it decodes
    # within the codec's promise of the block and of the CPU's result (a reduction order may move a
    # code by one step)
    if not codec.zstd_level:
        assert len(gpu_frame) == len(cpu_frame)
    got = decode_frame(gpu_frame, device="cuda").cpu().double()
    if codec.lossless:
        assert torch.equal(got, block.double()) and bytes(gpu_frame) == bytes(cpu_frame)
        return
    promise = codec.error_bound(KVLayout.of_block(block))
    assert promise is not None
    bound = promise * slice_absmax(block) + ulp
    assert bool(((got - block.double()).abs() <= bound).all())
    assert bool(((got - want).abs() <= 2 * bound).all())
    if not matmul:  # a rotated code moves wherever a product's rounding crosses a step
        assert float((got == want).double().mean()) > 0.99


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_batch_of_frames_decodes_on_the_gpu_as_each_frame_on_the_cpu(dtype: torch.dtype) -> None:
    codec = make_codec(("fp8", {}))
    blocks = [
        structured_block(kind, (3, 2, 64, 3, 64), dtype, seed=i)
        for i, kind in enumerate(["normal", "heavy", "wide"])
    ]
    frames = [codec.encode(b) for b in blocks]
    got, good = decode_frames(frames, layout=KVLayout.of_block(blocks[0]), device="cuda")
    assert good == 3 and got.device.type == "cuda"
    for i, f in enumerate(frames):
        assert torch.equal(got[i].cpu(), decode_frame(f)), i


def test_a_rotated_block_of_subnormal_values_keeps_the_promise_on_the_gpu() -> None:
    # rotated back in float32 there too (a product unit may flush them): see tests/codecs/test_int4.py
    g = torch.Generator().manual_seed(3)
    block = (torch.randn(1, 2, 256, 2, 8, generator=g, dtype=torch.float64) * 2.0**-128).to(torch.bfloat16)
    codec = make_codec(("int4", {"rotate": True}))
    got = decode_frame(codec.encode(block), device="cuda").cpu().double()
    promise = codec.error_bound(KVLayout.of_block(block))
    assert promise is not None
    absmax = block.double().abs().amax(dim=(2, 4), keepdim=True)
    assert bool(((got - block.double()).abs() <= promise * absmax).all())
