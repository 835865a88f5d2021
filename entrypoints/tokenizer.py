"""The frontend's tokenizer: transformers' AutoTokenizer, handed the model's config.json as a
plain PreTrainedConfig. Left to itself AutoTokenizer loads the config through AutoConfig, which
imports the model's configuration module and with it torch.distributed.tensor and sympy — one
and a half seconds of every engine start here, all before the first prompt can be tokenized.
The class choice reads only the config's model type, name and tokenizer class, which the plain
config carries; tests/test_tokenizer.py checks the result against AutoTokenizer's own.

A folder whose tokenizer_config.json names the generic class (transformers' tokenizers-backed
`TokenizersBackend`, `PreTrainedTokenizerFast` before it), of a model type for which
AutoTokenizer then picks that class (not Qwen2, which gets its own), is loaded by that class
directly: transformers' config module imports torch (1.8 s of CPU time, on the cores the
engine's own start needs), its tokenizer classes do not. tests/test_tokenizer.py checks each of
those model types against AutoTokenizer.
"""

from __future__ import annotations

import json
import os

from pagedllm.core.model_folder import model_folder

GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
GENERIC_MODEL_TYPES = ("llama", "mistral", "qwen3")  # AutoTokenizer keeps a generic declared class


def declared_class(path: str) -> str | None:
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            return json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def _model_type(path: str) -> str | None:
    try:
        return model_folder(path).config.get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def load_tokenizer(path: str):
    generic = declared_class(path) in GENERIC_CLASSES and _model_type(path) in GENERIC_MODEL_TYPES
    if generic and os.path.isfile(os.path.join(path, "tokenizer.json")):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer, PreTrainedConfig

    try:
        config = PreTrainedConfig(**model_folder(path).config)
    except (OSError, ValueError, TypeError):
        return AutoTokenizer.from_pretrained(path)  # no readable config here: transformers decides
    config._name_or_path = path
    return AutoTokenizer.from_pretrained(path, config=config)
