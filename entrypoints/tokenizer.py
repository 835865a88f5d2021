"""The frontend's tokenizer: transformers' AutoTokenizer, handed the model's config.json as a
plain PreTrainedConfig. Left to itself AutoTokenizer loads the config through AutoConfig, which
imports the model's configuration module and with it torch.distributed.tensor and sympy — one
and a half seconds of every engine start here, all before the first prompt can be tokenized.
The class choice reads only the config's model type, name and tokenizer class, which the plain
config carries; tests/test_tokenizer.py checks the result against AutoTokenizer's own."""

from __future__ import annotations

from pagedllm.core.model_folder import model_folder


def load_tokenizer(path: str):
    from transformers import AutoTokenizer, PreTrainedConfig

    try:
        config = PreTrainedConfig(**model_folder(path).config)
    except (OSError, ValueError, TypeError):
        return AutoTokenizer.from_pretrained(path)  # no readable config here: transformers decides
    config._name_or_path = path
    return AutoTokenizer.from_pretrained(path, config=config)
