"""vLLM 0.33's own scheduler driving kvstore's connector, with a real daemon (no model runs).

Runs inside the ``vllm`` engine environment (``./dev engines``), where vLLM's
connector unit-test helpers (``tests/v1/kv_connector/unit/utils.py`` of its
sdist) lie at ``<env>/vllm_kv_connector_utils.py``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.engines.models import hf_model_dir
from tests.hardening.conftest import daemons  # noqa: F401  (a fixture)

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


@pytest.fixture(scope="session")
def vllm_utils() -> ModuleType:
    path = Path(sys.prefix) / "vllm_kv_connector_utils.py"
    if not path.exists():
        pytest.fail(f"{path} is missing: ./dev engines puts vLLM's connector test helpers there")
    spec = importlib.util.spec_from_file_location("vllm_kv_connector_utils", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return hf_model_dir()
