"""The test model converts from its GGUF file into a directory an engine can load (run in .engines/vllm_cpu)."""

from __future__ import annotations

import json

from transformers import AutoConfig, AutoTokenizer

from tests.engines.models import hf_model_dir


def test_smollm2_converts_to_a_plain_bf16_checkpoint_with_its_tokenizer() -> None:
    path = hf_model_dir()
    config = json.loads((path / "config.json").read_text())
    # SmolLM2-135M: 30 layers, 9 query heads sharing 3 KV heads of 64 dims; what engines size their cache by.
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]) == (30, 3, 64)
    assert "quantization_config" not in config  # plain weights: no GGUF kernels wanted
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    assert (path / "model.safetensors").is_file()
    assert AutoConfig.from_pretrained(path).model_type == "llama"
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = tokenizer.decode(tokenizer("The capital of France")["input_ids"])
    assert isinstance(text, str) and text.endswith("The capital of France")
