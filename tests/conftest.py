"""Fixtures shared by several test folders.

``smollm2``: one SmolLM2-135M-Instruct for the whole test session (loading takes
~15-45 s on two shared cores), used by tests/model and tests/integrations.
"""

from __future__ import annotations

import pytest

from kvstore.integrations.models import LoadedModel, ModelUnavailable, load_smollm2


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """SmolLM2-135M-Instruct (float32, CPU), loaded once; the test is skipped where it is not installed."""
    try:
        return load_smollm2()
    except ModelUnavailable as e:
        pytest.skip(f"SmolLM2 is not available: {e}")
