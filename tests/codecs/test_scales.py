"""Scale rounding: scales are rounded up into their storage dtype, never to 0, never past the value."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.codecs.scales import require_finite, round_down, round_up
from kvstore.errors import CodecError

NARROW = (torch.bfloat16, torch.float16, torch.float32)


@pytest.mark.parametrize("dtype", NARROW)
@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.floats(0, 1e4, allow_nan=False, width=32), min_size=1, max_size=20))
def test_round_up_is_the_smallest_value_not_below(dtype: torch.dtype, values: list[float]) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    up = round_up(x, dtype)
    assert up.dtype == dtype
    assert bool((up.float() >= x).all())
    # one step down would be below x (or x is exactly representable)
    ints = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
    below = (up.view(ints) - 1).view(dtype).float()
    assert bool(((below < x) | (up.float() == x)).all())
    # a positive value never rounds to zero
    assert bool((up[x > 0] > 0).all())


def test_round_up_tiny_and_exact() -> None:
    x = torch.tensor([0.0, 1e-45, 1.0, 3.0], dtype=torch.float32)
    assert round_up(x, torch.bfloat16).tolist()[0] == 0.0
    assert round_up(x, torch.bfloat16).tolist()[1] > 0
    assert round_up(x, torch.float16).tolist()[2:] == [1.0, 3.0]
    same = round_up(x, torch.float32)
    assert torch.equal(same, x) and same.data_ptr() != x.data_ptr()  # a new tensor


@pytest.mark.parametrize("dtype", NARROW)
def test_round_down(dtype: torch.dtype) -> None:
    limit = float(torch.finfo(dtype).max)
    for value in (limit / 448, limit / 127, 1.0, 1 / 3):
        got = round_down(value, dtype)
        assert got <= value
        assert float(torch.tensor(got, dtype=dtype)) == got  # representable


def test_require_finite_names_the_codec() -> None:
    require_finite(torch.tensor([1.0, -2.0]), "fp8")
    for bad in (float("inf"), float("nan")):
        with pytest.raises(CodecError, match="int8: the block holds inf or NaN"):
            require_finite(torch.tensor([1.0, bad]), "int8")
