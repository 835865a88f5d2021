"""The frontend's tokenizer loader against AutoTokenizer left to itself: the same class, ids,
text and chat prompt, on every tiny architecture, the demo model, and tokenizer classes that
checkpoints declare (transformers picks the class from the model type and that declaration)."""

import json
import shutil

import pytest
from transformers import AutoTokenizer

from pagedllm.entrypoints.default_model import shipped_model_dir
from pagedllm.entrypoints.tokenizer import load_tokenizer
from pagedllm.fixtures.tiny_models import ARCHITECTURES

TEXTS = ["hello world", "  spaces and\nnew lines ", "ünïcödé €"]


def assert_same(ours, theirs):
    assert type(ours) is type(theirs)
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    chat = [{"role": "user", "content": TEXTS[0]}]
    prompt = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == prompt
    assert (ours.eos_token_id, ours.bos_token_id) == (theirs.eos_token_id, theirs.bos_token_id)


@pytest.mark.parametrize("arch", [*ARCHITECTURES, "demo"])
def test_load_tokenizer_equals_auto_tokenizer(tiny_model, arch):
    path = shipped_model_dir() if arch == "demo" else tiny_model(arch)
    assert_same(load_tokenizer(path), AutoTokenizer.from_pretrained(path))


DECLARED = [("llama", "LlamaTokenizerFast"), ("llama", "PreTrainedTokenizerFast"), ("qwen2", "Qwen2Tokenizer")]


@pytest.mark.parametrize("arch,declared", DECLARED)
def test_a_declared_tokenizer_class_is_chosen_as_auto_tokenizer_chooses_it(tiny_model, tmp_path, arch, declared):
    path = tmp_path / "m"
    shutil.copytree(tiny_model(arch), path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": declared}))
    assert_same(load_tokenizer(str(path)), AutoTokenizer.from_pretrained(str(path)))


def test_a_folder_without_a_config_still_loads(tiny_model, tmp_path):
    theirs = AutoTokenizer.from_pretrained(tiny_model("llama"))
    theirs.save_pretrained(tmp_path)
    assert not (tmp_path / "config.json").exists()
    assert load_tokenizer(str(tmp_path)).encode(TEXTS[0]) == theirs.encode(TEXTS[0])


def test_the_demo_models_tokenizer_loads_without_torch():
    """The frontend's start is on the engine's critical path: torch (1.8 s of CPU time here)
    is the workers' to import, not the tokenizer's."""
    import subprocess
    import sys

    code = (
        "import sys; from pagedllm.entrypoints.tokenizer import load_tokenizer; "
        f"load_tokenizer({shipped_model_dir()!r}); print('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
