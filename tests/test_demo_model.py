"""The shipped demo model: transformers loads it as it is, pagedllm's greedy output equals
transformers', and it has learned its kind of text (loss far below the uniform baseline)."""

import importlib.util
import math
import os
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.default_model import default_model_dir, shipped_model_dir

from model_helpers import hf_greedy

DEMO = shipped_model_dir()
pytestmark = pytest.mark.skipif(
    not os.path.isfile(os.path.join(DEMO, "config.json")), reason="the demo model is not in this checkout"
)


def load_training_script():
    path = os.path.join(os.path.dirname(__file__), "..", "tools", "train_demo_model.py")
    spec = importlib.util.spec_from_file_location("train_demo_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_model_is_the_default_and_small():
    assert default_model_dir() == DEMO
    size = sum(os.path.getsize(os.path.join(DEMO, f)) for f in os.listdir(DEMO))
    assert size <= 20 * 1024 * 1024


def test_greedy_output_equals_transformers():
    hf = AutoModelForCausalLM.from_pretrained(DEMO, attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(DEMO)
    prompts = ["The for statement", "A dictionary is", "def"]
    with LLM(max_model_len=256) as llm:  # no model: the default is the demo model
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, tok.encode(prompt), 24), prompt


def test_held_out_loss_is_far_below_uniform():
    script = load_training_script()
    tok = AutoTokenizer.from_pretrained(DEMO)
    model = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.inference_mode():
        for text in script.held_out_texts():
            ids = tok.encode(text)
            for start in range(0, len(ids) - 1, 256):
                chunk = torch.tensor([ids[start : start + 257]])
                if chunk.shape[1] < 2:
                    continue
                loss = model(input_ids=chunk, labels=chunk).loss
                total += loss.item() * (chunk.shape[1] - 1)
                count += chunk.shape[1] - 1
    nll, uniform = total / count, math.log(len(tok))
    print(
        f"held-out: {count} tokens, loss {nll:.3f} nats (perplexity {math.exp(nll):.1f}); "
        f"uniform {uniform:.3f} (perplexity {len(tok)})",
        file=sys.stderr,
    )
    assert nll < 0.6 * uniform
