import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm.backends.models.config import ModelConfig
from pagedllm.backends.models.loader import load_model


def copy_model(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def edit_config(path: str, **changes) -> None:
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


def test_unsupported_architecture_lists_the_supported_ones(tiny_model, tmp_path):
    path = copy_model(tiny_model("llama"), tmp_path / "m")
    edit_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError) as err:
        load_model(path)
    msg = str(err.value)
    assert "GPT2LMHeadModel" in msg
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in msg


def test_missing_and_unexpected_weights_are_reported(tiny_model, tmp_path):
    path = copy_model(tiny_model("llama"), tmp_path / "m")
    weights = load_file(os.path.join(path, "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    weights["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    save_file(weights, os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError) as err:
        load_model(path)
    assert "layers.1.gate_up_proj.weight" in str(err.value)
    assert "model.layers.0.self_attn.extra.weight" in str(err.value)


def test_wrong_shape_names_the_weight(tiny_model, tmp_path):
    path = copy_model(tiny_model("llama"), tmp_path / "m")
    weights = load_file(os.path.join(path, "model.safetensors"))
    weights["model.norm.weight"] = torch.ones(3)
    save_file(weights, os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        load_model(path)


def test_sharded_checkpoint_loads_like_the_single_file(tiny_model, tmp_path):
    src = tiny_model("qwen2")
    path = copy_model(src, tmp_path / "m")
    weights = load_file(os.path.join(path, "model.safetensors"))
    os.remove(os.path.join(path, "model.safetensors"))
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, shard_names in halves.items():
        save_file({n: weights[n] for n in shard_names}, os.path.join(path, shard))
        weight_map.update({n: shard for n in shard_names})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    sharded, single = load_model(path), load_model(src)
    for (name, a), (_, b) in zip(sharded.state_dict().items(), single.state_dict().items()):
        assert torch.equal(a, b), name


def test_dtype_from_config_or_overridden(tiny_model):
    path = tiny_model("llama")
    assert ModelConfig.from_pretrained(path).dtype == torch.float32
    model = load_model(path, dtype="bfloat16")
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert load_model(path, dtype="float16").lm_head.weight.dtype == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        load_model(path, dtype="int8")


def test_tied_embeddings_share_one_tensor(tiny_model):
    model = load_model(tiny_model("llama3-rope"))
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert model.config.rope["rope_type"] == "llama3"
