"""One SmolLM2-135M-Instruct and one set of exact prefix caches for the whole test session.

Loading takes ~15 s and preparing the texts (a 1,024-token prefill each, plus the
reference continuation) ~15 s more on two cores, so both are session-scoped and every
codec is measured against the same prepared texts. ``smollm2`` itself is in tests/conftest.py
(shared with tests/integrations).
"""

from __future__ import annotations

import pytest

from kvstore.integrations.models import LoadedModel
from kvstore.integrations.quality import QualityHarness, reference_texts


@pytest.fixture(scope="session")
def harness(smollm2: LoadedModel) -> QualityHarness:
    """Texts prepared (exact bfloat16 caches and reference distributions), ready to measure codecs."""
    h = QualityHarness(smollm2)
    h.prepare(reference_texts())
    return h
