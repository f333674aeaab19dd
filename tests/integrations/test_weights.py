"""Naming weights by their content (kvstore.integrations.weights): copies on two hosts share a name,
a rewrite does not; a hub model is named by its cached snapshot."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kvstore.integrations.weights import PIECE, SAMPLES, SMALL, Weights, content_id, weights_id


def checkpoint(root: Path, seed: int = 0) -> Path:
    """A model directory: a config, a tokenizer and a 3 MB weights file (sampled, not read whole)."""
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"num_hidden_layers": 2}')
    (root / "tokenizer.json").write_text("{}")
    (root / "model.safetensors").write_bytes(bytes((i * 7 + seed) % 251 for i in range(3 * SMALL)))
    return root


def test_copies_of_the_same_weights_share_a_name_wherever_and_whenever_written(tmp_path: Path) -> None:
    a = checkpoint(tmp_path / "host-a" / "model")
    b = tmp_path / "host-b" / "elsewhere"
    shutil.copytree(a, b)  # new times, another path: another host's copy
    os.utime(b / "model.safetensors", ns=(1, 1))
    (b / ".cache").mkdir()  # a download tool's own files are not weights
    (b / ".cache" / "lock").write_text("x")
    assert content_id(str(a)) == content_id(str(b))
    assert weights_id(str(a)) == weights_id(str(b)) == f"files={content_id(str(a))}"


def test_rewritten_weights_get_another_name(tmp_path: Path) -> None:
    a = checkpoint(tmp_path / "a")
    before = content_id(str(a))
    (a / "config.json").write_text('{"num_hidden_layers": 3}')  # a small file: read whole
    assert content_id(str(a)) != before
    data = bytearray((a / "model.safetensors").read_bytes())
    (a / "config.json").write_text('{"num_hidden_layers": 2}')
    assert content_id(str(a)) == before
    at = (len(data) - PIECE) * (SAMPLES // 2) // (SAMPLES - 1)  # a sampled piece of a large file
    data[at] ^= 0xFF
    (a / "model.safetensors").write_bytes(bytes(data))
    assert content_id(str(a)) != before


def test_a_name_is_read_again_once_the_files_change(tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"v1")
    weights = Weights()
    first = weights.name(str(adapter))
    assert weights.name(str(adapter)) == first
    (adapter / "adapter_model.safetensors").write_bytes(b"v2, retrained")
    assert weights.name(str(adapter)) != first
    # a path that is nothing here (a hub id, a remote adapter) is named by the path
    assert weights.name("org/remote-adapter") == weights.name("org/remote-adapter") != first


def test_a_hub_model_is_named_by_its_cached_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    refs = tmp_path / "models--org--model" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text("a" * 40 + "\n")
    assert weights_id("org/model") == "hub=" + "a" * 16
    (refs / "main").write_text("b" * 40)  # main moved on, and the cache with it
    assert weights_id("org/model") == "hub=" + "b" * 16
    assert weights_id("org/model", "c" * 40) == "hub=" + "c" * 16  # a pinned commit names itself
    assert weights_id("org/other") == ""  # not in the cache: nothing more than its name is known
    assert "'org/other' cannot be named" in caplog.text  # (a ModelScope download): said
    caplog.clear()
    assert weights_id("org/other", "v2") == "" and not caplog.text  # named by its revision


def test_only_weights_and_configs_name_a_model_and_odd_file_names_do_not_break_it(tmp_path: Path) -> None:
    a = checkpoint(tmp_path / "a")
    before = content_id(str(a))
    (a / "README.md").write_text("a model card, edited")  # not weights: the name stands
    (a / "np").mkdir()
    (a / "np" / "cache.npy").write_bytes(b"an engine's own cache")
    assert content_id(str(a)) == before
    odd = os.fsdecode(b"notes-caf\xe9.json")  # a name that is not UTF-8 (a lone surrogate in Python)
    (a / odd).write_text("{}")
    assert content_id(str(a)) != before and Weights().name(str(a)) == content_id(str(a))
    assert weights_id(str(a)) == f"files={content_id(str(a))}"
    assert Weights().name("") == Weights().name("")  # an adapter without a path: not the working directory
