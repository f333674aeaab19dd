"""Which weights an engine's K/V was computed with: what a namespace names beyond the model's name.

A model's name does not say which weights stand behind it: a local checkpoint
rewritten in place, an adapter retrained under its old name, a hub model whose
``main`` moved on, or a fine-tune served under the base model's alias all
compute other K/V for the same tokens, and a namespace that named only the
model would serve one's blocks to the other. The engine connectors put
``weights_id`` of the base model into the namespace's revision, and a LoRA
adapter's ``Weights.name`` into its variant.

Local weights are named by their content, so that hosts holding the same files
(each its own copy, written at its own time) share blocks through the cluster
tier (under the same model name: the same path, or the engine's ``model``
setting): each weight or config file's relative name and size (``WEIGHT_FILES``),
and its bytes where it is small; of a large file, ``SAMPLES`` pieces spread
over it (its header, with every tensor's name, dtype and shape, among them). A rewrite that changes no sampled byte of
any file is not seen: one training only a small part of the weights might not be;
give such weights a ``revision`` of their own. A hub model is named by the
commit of its snapshot in the Hugging Face cache.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

log = logging.getLogger("kvstore.integrations")

_MAX_FILES = 10_000  # a model directory holds tens; a path that is not one stops being walked here
SMALL = 1 << 20  # files up to this size are hashed whole (configs, tokenizers, most adapters' weights)
SAMPLES = 64  # pieces of each larger file hashed, evenly spread, the first and last among them
PIECE = 4096
# the files that hold weights or change what they compute (configs); a README, a tokenizer, a
# download tool's or an engine's own files beside them are not named (hidden ones neither)
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json")

Signature = tuple[tuple[str, int, int], ...]  # (relative name, size, mtime_ns) of each file


def signature(path: str) -> Signature:
    """The weight and config files under ``path`` (a file, or a directory's tree, hidden entries and
    other files left out), each with its size and modification time: what changes when they are
    rewritten. () when not local."""
    if not path:  # an adapter without a path: not the working directory
        return ()
    p = Path(path).expanduser()
    out: list[tuple[str, int, int]] = []
    try:
        if p.is_file():
            st = p.stat()
            return ((p.name, st.st_size, st.st_mtime_ns),)
        if not p.is_dir():
            return ()
        for root, dirs, files in os.walk(p):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(files):
                if name.startswith(".") or not name.endswith(WEIGHT_FILES):
                    continue
                f = Path(root, name)
                st = f.stat()
                out.append((str(f.relative_to(p)), st.st_size, st.st_mtime_ns))
                if len(out) >= _MAX_FILES:
                    return tuple(out)
    except (OSError, ValueError):  # unreadable: what was read names it
        pass
    return tuple(out)


def _bytes(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")  # a file name that is not UTF-8 is its own bytes


def content_id(path: str, files: Signature | None = None) -> str:
    """``path``'s weights named by their content (16 hex digits of a sha256; see the module): the same
    on every host holding the same files, wherever and whenever they were written. A path that is
    not local (a hub id, a remote adapter) is named by the path itself."""
    files = signature(path) if files is None else files
    if not files:
        return hashlib.sha256(b"path\0" + _bytes(path)).hexdigest()[:16]
    p = Path(path).expanduser()
    h = hashlib.sha256(b"content")
    for rel, size, _ in files:
        h.update(b"\0" + _bytes(rel) + f":{size}\0".encode())
        try:
            with open(p if p.is_file() else p / rel, "rb") as f:
                if size <= SMALL:
                    h.update(f.read())
                    continue
                for i in range(SAMPLES):
                    f.seek((size - PIECE) * i // (SAMPLES - 1))
                    h.update(f.read(PIECE))
        except OSError:  # unreadable now: its name and size stand for it
            h.update(b"\0unreadable")
    return h.hexdigest()[:16]


def named(path: str, files: Signature | None = None) -> str:
    """``content_id(path, files)``; never raises (an engine's scheduler and SGLang's start call it):
    weights that cannot be read are named by their path."""
    try:
        return content_id(path, files)
    except Exception:  # noqa: BLE001 - whatever the files hold, the path alone names them
        return hashlib.sha256(b"path\0" + _bytes(path)).hexdigest()[:16]


class Weights:
    """``content_id`` of each path asked about, read again only when its files' sizes or times
    change (a walk and a stat per file on each call): adapters are named on every request. Thread-safe."""

    def __init__(self, capacity: int = 256) -> None:
        self._known: dict[str, tuple[Signature, str]] = {}
        self._capacity = capacity
        self._lock = threading.Lock()

    def name(self, path: str) -> str:
        """``named(path)``, from memory while the files' sizes and times stay as they were."""
        files = signature(path)
        with self._lock:
            known = self._known.get(path)
        if known is not None and known[0] == files:
            return known[1]
        name = named(path, files)
        with self._lock:
            self._known.pop(path, None)
            if len(self._known) >= self._capacity:
                self._known.pop(next(iter(self._known)))
            self._known[path] = (files, name)
        return name


def weights_id(model: str, revision: str | None = None) -> str:
    """The weights an engine serves as ``model`` (a local path, or a hub id at ``revision``), named:
    ``files=`` and their ``content_id`` for a local path, ``hub=`` and the snapshot's commit where
    the Hugging Face cache resolves the hub id (what the engine loaded from it), "" otherwise.
    Never raises."""
    if os.path.exists(os.path.expanduser(model)):
        return f"files={named(model)}"
    commit = _hub_commit(model, revision or "main")
    if commit:
        return f"hub={commit[:16]}"
    if not revision:  # a hub other than Hugging Face's (ModelScope), or a cache elsewhere
        log.warning(
            "kvstore: the weights served as %r cannot be named (no local path, and the Hugging Face "
            "cache holds no snapshot of it): its K/V is named by that name alone, and another "
            "version served under it would find it: serve the weights from a local path, or name "
            "them with --revision",
            model,
        )
    return ""


def _hub_commit(repo: str, revision: str) -> str | None:
    """The commit the local Hugging Face cache holds for ``repo`` at ``revision`` (a branch or tag,
    through its ref; a commit hash as itself), or None."""
    if len(revision) == 40 and all(c in "0123456789abcdef" for c in revision):
        return revision
    try:
        from huggingface_hub.constants import HF_HUB_CACHE

        ref = Path(HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}" / "refs" / revision
        commit = ref.read_text().strip()
    except (ImportError, OSError, ValueError):
        return None
    return commit or None
