"""Fixtures of the shared-memory tests: the hardening tests' real daemons."""

from tests.hardening.conftest import daemons  # noqa: F401 - a fixture
