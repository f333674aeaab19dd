"""Where ``./dev engines`` builds the inference-engine environments, and what it leaves there.

${KVSTORE_ENGINES:-.engines}/          (a relative path is taken from the repository root)
    NAME/                  a virtual environment for tests/engines/NAME
    NAME/.kvstore-engine   written last: the hash of the files it was built from
    NAME.failed            the tail of the log of a build that failed
    NAME.log               the log of the last build
    vllm/vllm_kv_connector_utils.py
                           vLLM's KV-connector unit-test helpers, from its sdist; in that environment
                           it is Path(sys.prefix) / "vllm_kv_connector_utils.py", for importlib to load
    models/                converted models, shared by the environments (tests/engines/models.py)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENGINE_NAMES = ("vllm", "vllm_cpu", "sglang")


def engines_dir() -> Path:
    """``$KVSTORE_ENGINES`` (default ``.engines``), absolute; relative paths start at the repository root."""
    return REPO / os.environ.get("KVSTORE_ENGINES", ".engines")


@dataclass(frozen=True)
class EngineEnv:
    """The environment of one engine (which may not exist yet)."""

    name: str
    path: Path

    @classmethod
    def of(cls, name: str) -> EngineEnv:
        return cls(name, engines_dir() / name)

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    @property
    def failure(self) -> Path:
        """Present when the last build failed: the tail of its log."""
        return self.path.with_name(self.name + ".failed")

    def built(self) -> bool:
        """Whether a build finished (the marker is written last, so a killed build does not count)."""
        return (self.path / ".kvstore-engine").is_file() and self.python.exists()

    def tests(self) -> list[Path]:
        """The test files of this engine under tests/engines/NAME."""
        return sorted((REPO / "tests" / "engines" / self.name).rglob("test_*.py"))
