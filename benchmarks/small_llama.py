"""The 19M-parameter random Llama of the project's throughput figures: hidden 256, 4 layers, 8
heads, 4 KV heads, a 32,000-token vocabulary (so the LM head dominates), random weights from a
fixed seed; with a 32,000-word tokenizer beside it on request, since vLLM refuses token ids
past its tokenizer's vocabulary.

Run: python -m pagedllm.benchmarks.small_llama DIR [--dtype bfloat16]
then: pagedllm bench throughput --model DIR ...
"""

from __future__ import annotations

import argparse

import torch

VOCAB_SIZE = 32000


def save_word_tokenizer(path: str, vocab_size: int = VOCAB_SIZE) -> None:
    """A word-level tokenizer whose vocabulary is <unk>, <s>, </s> and w3 ... w{vocab_size - 1}."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)


def small_llama_dir(path: str, dtype: str, tokenizer: bool = False) -> str:
    """Writes the model (weights in `dtype`) to `path`, and its tokenizer if asked; returns path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    )
    LlamaForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(path)
    if tokenizer:
        save_word_tokenizer(path)
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="folder to write the model and its tokenizer to")
    ap.add_argument("--dtype", default="bfloat16", help="the weights' dtype on disk (the figures': bfloat16)")
    args = ap.parse_args(argv)
    print(small_llama_dir(args.out, args.dtype, tokenizer=True))


if __name__ == "__main__":
    main()
