"""The vLLM connector's settings and the namespace it stores under.

The namespace holds everything that changes K/V: the model and revision, the weights'
quantization and ``hf_overrides``, the layout of this instance's share of the model, the tensor-
and pipeline-parallel ranks, the LoRA adapter and vLLM's ``cache_salt`` (hashed).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore.config import check_connect_endpoint
from kvstore.errors import ConfigError
from kvstore.integrations.weights import Weights


@dataclass(frozen=True)
class Settings:
    endpoint: str | None = None
    tenant: str = "default"
    model: str | None = None
    block_tokens: int = 64
    timeout: float = 5.0
    load: bool = True
    save: bool = True
    save_outputs: bool = True
    shared_memory: bool | None = None
    max_variants: int = 32

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> Settings:
        """The settings in vLLM's ``kv_connector_extra_config``, each checked (ConfigError naming the
        key and what it takes): a typo or a string where a number goes must stop the engine at
        start, not fail every call later."""
        extra = dict(extra or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config has unknown keys {unknown}; kvstore takes {sorted(known)}"
            )
        checks: dict[str, Callable[[Any], Any]] = {
            "endpoint": _endpoint,
            "tenant": _text,
            "model": _text,
            "block_tokens": _count,
            "timeout": seconds,
            "load": flag,
            "save": flag,
            "save_outputs": flag,
            "shared_memory": flag,
            "max_variants": _count,
        }
        values: dict[str, Any] = {}
        for key, v in extra.items():
            if v is None and key in ("endpoint", "model", "shared_memory"):
                values[key] = None
                continue
            try:
                values[key] = checks[key](v)
            except ValueError as e:
                raise ConfigError(f"kv_connector_extra_config {key!r}: {e}") from None
        return cls(**values)


def flag(v: Any) -> bool:
    """A boolean setting: true/false (JSON), or the strings true/false, yes/no, on/off, 1/0. Any
    other value raises ValueError (the string "false" is not true)."""
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in _TRUE + _FALSE:
        return v.strip().lower() in _TRUE
    raise ValueError(f"expected true or false, got {v!r}")


def seconds(v: Any) -> float:
    """A positive, finite number of seconds: a number or its text ("5", "2.5"); ValueError otherwise."""
    n = _number(v)
    if not (n > 0 and math.isfinite(n)):
        raise ValueError(f"expected a positive number of seconds, got {v!r}")
    return n


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _number(v: Any) -> float:
    if isinstance(v, str):
        try:
            return float(v.strip())
        except ValueError:
            pass
    elif isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    raise ValueError(f"expected a number, got {v!r}")


def _count(v: Any) -> int:
    n = _number(v)
    if not math.isfinite(n) or n != int(n) or n < 1:
        raise ValueError(f"expected a positive integer, got {v!r}")
    return int(n)


def _text(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise ValueError(f"expected a non-empty string, got {v!r}")
    return v


def _endpoint(v: Any) -> str:
    try:
        return check_connect_endpoint(v)  # tcp://*:5555 is where a daemon listens, not an address
    except ConfigError as e:
        raise ValueError(str(e)) from None


@dataclass(frozen=True)
class Variant:
    """What, besides the model's name, changes a request's K/V: the base weights (as the scheduler
    named them: the workers take the name from it, with each transfer), its LoRA adapter and cache salt."""

    lora: str = ""
    salt: str = ""  # sha256 of vLLM's cache_salt: the salt itself is never sent nor logged
    base: str = ""  # weights.weights_id of the model vLLM loaded

    @classmethod
    def of(cls, request: Any, weights: Weights, base: str = "") -> Variant:
        """The variant of ``request`` on base weights ``base``. A LoRA adapter is named by its weights
        as its files are now (``weights.name``): vLLM's adapter id is its load order, and a name may
        come back with retrained weights, after a restart or reloaded in place."""
        lora = getattr(request, "lora_request", None)
        salt = getattr(request, "cache_salt", None)
        return cls(
            lora=""
            if lora is None
            else f"{lora.lora_name}@{weights.name(str(getattr(lora, 'lora_path', '') or ''))}",
            salt="" if not salt else hashlib.sha256(str(salt).encode()).hexdigest()[:32],
            base=base,
        )

    @property
    def plain(self) -> bool:
        """No adapter, no salt: the model's own K/V."""
        return not self.lora and not self.salt

    @property
    def adapter(self) -> str:
        """The LoRA adapter's name ("" for none)."""
        return self.lora.rpartition("@")[0]


def namespace_revision(vllm_config: Any, ranks: tuple[int, int], variant: Variant) -> str:
    """The namespace's revision field: the model's revision and everything else that changes its K/V
    for the same weights' name (the weights themselves, as ``weights.weights_id`` names them, this
    shard, the weights' quantization, ``hf_overrides``, the variant)."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    parts = [
        f"rev={mc.revision or ''}",
        *([variant.base] if variant.base else []),
        f"tp={ranks[0]}/{pc.tensor_parallel_size}",
        f"pp={ranks[1]}/{pc.pipeline_parallel_size}",
    ]
    quantization = getattr(mc, "quantization", None)
    if quantization:  # quantized weights compute other K/V than the model's own
        parts.append(f"q={quantization}")
    overrides = _overrides_id(getattr(mc, "hf_overrides", None))
    if overrides:  # a changed config (rope scaling, layers...) computes other K/V
        parts.append(f"hf={overrides}")
    if variant.lora:
        parts.append(f"lora={variant.lora}")
    if variant.salt:
        parts.append(f"salt={variant.salt}")
    return ";".join(parts)


def _overrides_id(overrides: Any) -> str:
    """A short, stable name for vLLM's ``hf_overrides`` (a dict, or a function of the config)."""
    if not overrides:
        return ""
    if callable(overrides):
        text = f"{getattr(overrides, '__module__', '')}.{getattr(overrides, '__qualname__', repr(overrides))}"
    else:
        text = json.dumps(overrides, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def model_name(vllm_config: Any, settings: Settings) -> str:
    name = settings.model or str(vllm_config.model_config.model)
    if len(name.encode()) > 200:  # a namespace field holds 256 bytes
        name = "sha256:" + hashlib.sha256(name.encode()).hexdigest()
    return name
