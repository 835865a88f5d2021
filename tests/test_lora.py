"""LoRA adapters as PEFT saves them: read and checked against the base model (core/lora.py)
before any weight is loaded. Adapters are made by PEFT itself on the tiny test models, with
random weights; every bad one is refused naming the adapter and what is wrong."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from pagedllm.core.errors import InvalidParameter
from pagedllm.core.lora import TARGETS, LoRARequest, read_adapter
from pagedllm.core.model_folder import model_folder

peft = pytest.importorskip("peft")


def make_adapter(model_dir: str, out: str, r: int = 8, alpha: int = 16, targets=TARGETS, **config) -> str:
    """A PEFT LoRA adapter of `model_dir`, its B weights random (PEFT starts them at zero)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(r)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), **config))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    lora.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def adapter(llama, tmp_path_factory):
    return make_adapter(llama, str(tmp_path_factory.mktemp("lora") / "all"))


def read(model_dir: str, path: str, max_rank: int = 16):
    return read_adapter(LoRARequest("sql", 1, path), model_folder(model_dir).config, max_rank)


def test_an_adapter_peft_saved_is_read_with_its_rank_scale_and_modules(llama, adapter, tmp_path):
    spec = read(llama, adapter)
    layers = model_folder(llama).config["num_hidden_layers"]
    assert (spec.rank, spec.scale, spec.modules) == (8, 2.0, TARGETS)
    assert len(spec.tensors) == layers * len(TARGETS) * 2
    rslora = read(
        llama, make_adapter(llama, str(tmp_path / "rs"), r=16, alpha=8, targets=("q_proj", "v_proj"), use_rslora=True)
    )
    assert (rslora.rank, rslora.scale, rslora.modules) == (16, 2.0, ("q_proj", "v_proj"))  # 8 / sqrt(16)


def test_bad_adapters_are_refused_naming_the_adapter_and_the_problem(llama, adapter, tiny_model, tmp_path):
    def refused(path, max_rank=16, model=llama) -> str:
        with pytest.raises(InvalidParameter) as e:
            read(model, path, max_rank)
        assert e.value.field == "lora_request" and "'sql'" in str(e.value)
        return str(e.value)

    assert "no such folder" in refused(str(tmp_path / "nowhere"))
    assert "rank 8 is above max_lora_rank 4" in refused(adapter, max_rank=4)
    # another base: its projections' shapes are not this model's
    other = make_adapter(tiny_model("llama", hidden_size=48), str(tmp_path / "other"))
    assert re.search(r"has shape \[\d+, \d+\], the base model needs \[\d+, \d+\]", refused(other))
    head = make_adapter(llama, str(tmp_path / "head"), targets=("q_proj", "lm_head"))
    assert "target module 'lm_head' is not served" in refused(head)
    no_weights = shutil.copytree(adapter, tmp_path / "no-weights")
    os.remove(no_weights / "adapter_model.safetensors")
    assert "no adapter_model.safetensors" in refused(str(no_weights))
    for field, value, clue in (
        ("bias", "all", "bias 'all'"),
        ("use_dora", True, "DoRA"),
        ("modules_to_save", ["lm_head"], "modules_to_save"),
        ("peft_type", "IA3", "only LORA"),
    ):
        changed = shutil.copytree(adapter, tmp_path / field)
        cfg = json.loads((changed / "adapter_config.json").read_text())
        (changed / "adapter_config.json").write_text(json.dumps({**cfg, field: value}))
        assert clue in refused(str(changed)), field
    torn = shutil.copytree(adapter, tmp_path / "torn")
    (torn / "adapter_model.safetensors").write_bytes(b"\x10\x00")
    assert "is not a safetensors file" in refused(str(torn))
    with pytest.raises(InvalidParameter, match="lora_int_id must be >= 1"):
        read_adapter(LoRARequest("x", 0, adapter), model_folder(llama).config, 16)
