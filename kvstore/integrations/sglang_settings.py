"""The settings of kvstore's SGLang backend: the options of SGLang's storage ``extra_config``, each
checked (a bad one stops SGLang at start, naming it), and what names the K/V of the server's weights
beyond its model path (its revision, quantization, overrides, LoRA adapters and draft model), read
from SGLang's server arguments."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable
from typing import Any

from kvstore.errors import ConfigError
from kvstore.integrations.weights import weights_id


def server_args() -> Any | None:
    """The ServerArgs of the SGLang process this backend runs in, or None where it publishes none
    (a backend made outside a scheduler)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except Exception:  # noqa: BLE001 - not published, or an SGLang before runtime_context
        pass
    try:
        from sglang.srt.server_args import get_global_server_args

        return get_global_server_args()
    except Exception:  # noqa: BLE001 - retired (it raises), or not published either
        return None


# load formats that read the model's files as they are: the files name the weights (weights_id)
SAME_WEIGHTS = frozenset({"auto", "pt", "safetensors", "npcache", "fastsafetensors"})
# those that read the local files otherwise (quantized, or another checkpoint format): named by the
# files and the format. Any other format takes its weights from elsewhere (another server, a remote
# store, random numbers): nothing here names them, so its pages are named afresh in each process
OTHER_READINGS = frozenset({"gguf", "bitsandbytes", "sharded_state", "presharded", "mistral", "layered"})


def weights_of(served: Any, path: str) -> str:
    """What besides the model's path changes its K/V, from SGLang's server args: its revision, its
    weights (``weights.weights_id``), how they are loaded, their quantization and the config
    overrides (hashed). Weights that do not come from the files (``--load-format dummy``: random, for
    benchmarks; remote loads) are named afresh in each process: their pages are never another
    server's, nor a later one's."""
    revision = getattr(served, "revision", None)
    parts = [f"rev={revision}"] if revision else []
    named = weights_id(path, revision) if path else ""
    if named:
        parts.append(named)
    load_format = getattr(served, "load_format", None)  # a LoadFormat, or its value
    load_format = str(getattr(load_format, "value", load_format) or "auto").lower()
    if load_format in OTHER_READINGS:
        parts.append(f"lf={load_format}")
    elif load_format not in SAME_WEIGHTS:  # dummy (random), remote, rdma, ipc_cache, ...
        parts.append(f"lf={short_sha(load_format, 8)}-{secrets.token_hex(8)}")
    quantization = getattr(served, "quantization", None)
    if quantization:
        parts.append(f"q={quantization}")
    modelopt = getattr(served, "modelopt_quant", None)
    if modelopt:  # quantized by NVIDIA ModelOpt as it loads
        parts.append(f"mq={short_sha(str(modelopt), 12)}")
    overrides = getattr(served, "json_model_override_args", None)
    if overrides and overrides != "{}":
        parts.append(f"ov={short_sha(str(overrides), 16)}")
    # SGLang seeds a --lora-paths adapter's page hashes with an id made of its name and path only:
    # an adapter rewritten in place would find the old one's pages. Its content is named here (a
    # change of any adapter's files starts every page afresh; adapters loaded later get random ids)
    adapters = sorted(lora_adapters(getattr(served, "lora_paths", None)))
    if adapters:
        parts.append("lora=" + short_sha("\0".join(f"{n}\0{p}\0{weights_id(p)}" for n, p in adapters), 16))
    # a speculative draft model's layers may share the host pool's pages
    draft = getattr(served, "speculative_draft_model_path", None)
    if draft:
        named = weights_id(str(draft), getattr(served, "speculative_draft_model_revision", None))
        quantized = getattr(served, "speculative_draft_model_quantization", None) or ""
        parts.append("draft=" + short_sha(f"{draft}\0{named}\0{quantized}", 16))
    return ";".join(parts)


def lora_adapters(lora_paths: Any) -> list[tuple[str, str]]:
    """(name, path) of each adapter of SGLang's ``lora_paths``: LoRARef records once SGLang has read
    its arguments, or as given (``name=path`` or ``path`` strings, dicts)."""
    out = []
    if isinstance(lora_paths, dict):  # {name: path}
        lora_paths = [{"lora_name": k, "lora_path": v} for k, v in lora_paths.items()]
    for item in lora_paths or ():
        if isinstance(item, str):
            name, _, path = item.partition("=")
            out.append((name, path or name))
        elif isinstance(item, dict):
            out.append((str(item.get("lora_name", "")), str(item.get("lora_path", ""))))
        else:
            out.append((str(getattr(item, "lora_name", "")), str(getattr(item, "lora_path", ""))))
    return out


def weight_version() -> str | None:
    """The version of the weights SGLang serves now, as named by the update that loaded them
    (``weight_version`` of update_weights_from_*; None for the weights it started with, or where
    SGLang publishes none)."""
    try:
        from sglang.srt.runtime_context import get_serving

        v = get_serving().weight_version
    except Exception:  # noqa: BLE001 - an SGLang without runtime_context, or none published
        return None
    return None if v in (None, "", "default") else str(v)


def short_sha(text: str, n: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def option(extra: dict[str, Any], key: str, check: Callable[[Any], Any], default: Any) -> Any:
    """``extra[key]`` checked (``default`` when absent, or null for endpoint and model); ValueError
    naming the key: a bad setting stops SGLang at start, not every call later."""
    v = extra.get(key)
    if key not in extra or (v is None and key in ("endpoint", "model")):
        return default
    try:
        return check(v)
    except (ConfigError, ValueError) as e:
        raise ValueError(f"kvstore: extra_config {key!r}: {e}") from None


def check_name(v: Any) -> str:
    # length and control characters: kvstore.keys.Namespace refuses them, naming the field
    if not isinstance(v, str) or not v.strip():
        raise ValueError(f"expected a non-empty string, got {v!r}")
    return v


def check_revision(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"expected a string, got {v!r}")
    return v
