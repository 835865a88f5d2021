"""OpenAI's /v1/embeddings (with vLLM's truncate_prompt_tokens): the body, its prompts, and the
answer built from the engine's pooled vectors (`--runner pooling`)."""

from __future__ import annotations

import base64
from typing import Any, Literal

import msgspec
import numpy as np

from pagedllm.core.errors import InvalidParameter

from .openai_protocol import check_truncation, new_id, now


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    input: Any  # a string, token ids, or a list of either
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep this many tokens (-1: max_model_len)

    def prompts(self) -> list:
        """The inputs as strings or token-id lists."""
        x = self.input
        if (isinstance(x, str) and x) or (isinstance(x, list) and x and all(_is_token_id(t) for t in x)):
            x = [x]
        if not isinstance(x, list) or not x:
            raise InvalidParameter("input", "must be a non-empty string, token ids, or a non-empty list of either")
        for i, item in enumerate(x):
            if isinstance(item, str) and item:
                continue
            if isinstance(item, list) and item and all(_is_token_id(t) for t in item):
                continue
            raise InvalidParameter(f"input[{i}]", "must be a non-empty string or a non-empty list of token ids")
        return list(x)

    @property
    def truncation(self) -> tuple[int, str] | None:
        check_truncation(self.truncate_prompt_tokens)
        return None if self.truncate_prompt_tokens is None else (self.truncate_prompt_tokens, "left")


def _is_token_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def output_size(req: EmbeddingRequest, hidden_size: int, matryoshka) -> int | None:
    """The vectors' length where `dimensions` shortens them (matryoshka models only: their
    config says `is_matryoshka` or lists `matryoshka_dimensions`), else None."""
    d = req.dimensions
    if d is None or d == hidden_size:
        return None
    if isinstance(d, bool) or d < 1:
        raise InvalidParameter("dimensions", f"must be >= 1, got {d}")
    if not matryoshka:
        raise InvalidParameter(
            "dimensions",
            f"this model does not support matryoshka representation: its embeddings have {hidden_size} "
            "dimensions, and cutting them short would make poor embeddings",
        )
    allowed = matryoshka if isinstance(matryoshka, list) else range(1, hidden_size + 1)
    if d not in allowed:
        raise InvalidParameter("dimensions", f"must be one of {list(allowed)} for this model, got {d}")
    return d


def embedding_body(req: EmbeddingRequest, outputs: list, model: str, size: int | None, normalize: bool) -> dict:
    data = []
    for i, out in enumerate(outputs):
        vector = np.asarray(out.embedding, dtype=np.float32)
        if size is not None:  # matryoshka: the first `size` dimensions, normalised again
            vector = vector[:size]
            if normalize:
                vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        if req.encoding_format == "base64":  # float32, little-endian, as OpenAI's client reads it
            value = base64.b64encode(vector.astype("<f4").tobytes()).decode()
        else:
            value = vector.tolist()
        data.append({"object": "embedding", "index": i, "embedding": value})
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {
        "id": new_id("embd"),
        "object": "list",
        "created": now(),
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
