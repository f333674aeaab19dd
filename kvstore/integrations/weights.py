"""Which weights an engine's K/V was computed with: what a namespace names beyond the model's name.

A model's name does not say which weights stand behind it: a local checkpoint
rewritten in place, an adapter retrained under its old name, a hub model whose
``main`` moved on, or a fine-tune served under the base model's alias all
compute other K/V for the same tokens, and a namespace that named only the
model would serve one's blocks to the other. The engine connectors put
``weights_id`` of the base model into the namespace's revision, and
``files_id`` of a LoRA adapter into its variant.

Weights are named by their files' names, sizes and modification times (stats,
no reads of the files' contents): a rewrite changes them, a copy with ``cp -p``
or a restore from backup may not, and a hub snapshot by its commit.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

_MAX_FILES = 10_000  # a model directory holds tens; a path that is not one stops being walked here


def files_id(path: str) -> str:
    """``path`` named by itself and, for a local file or directory, by each file's relative name, size
    and modification time (16 hex digits of a sha256); a path that is not local (a hub id) by the
    path alone. Walks the tree on each call: callers that must name what an engine loaded at start
    keep the first answer."""
    h = hashlib.sha256(path.encode())
    p = Path(path).expanduser()
    try:
        files = sorted(p.rglob("*")) if p.is_dir() else [p] if p.is_file() else []
        for f in files[:_MAX_FILES]:
            if f.is_file():
                st = f.stat()
                h.update(
                    f"\0{f.relative_to(p) if p.is_dir() else f.name}:{st.st_size}:{st.st_mtime_ns}".encode()
                )
    except (OSError, RuntimeError, ValueError):  # unreadable: the path alone names it
        pass
    return h.hexdigest()[:16]


def weights_id(model: str, revision: str | None = None) -> str:
    """The weights an engine serves as ``model`` (a local path, or a hub id at ``revision``), named:
    ``files=`` and ``files_id`` for a local path, ``hub=`` and the snapshot's commit where the
    Hugging Face cache resolves the hub id (what the engine loaded from it), "" otherwise."""
    if os.path.exists(os.path.expanduser(model)):
        return f"files={files_id(model)}"
    commit = _hub_commit(model, revision or "main")
    return f"hub={commit[:16]}" if commit else ""


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
