"""What the Python API returns, shaped like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    # with SamplingParams.prompt_logprobs: per prompt token, None for the first, else its
    # Logprob and those of the most likely tokens at that position, by token id
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    embedding: list[float] | None = None  # an embedding request's vector (--runner pooling)


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """LLM.embed's answer for one prompt, as vLLM's."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt and generated token ids
    text: str | None  # the generated text
    cum_logprob: float  # sum of the generated tokens' log-probabilities
    score: float  # cum_logprob / generated_len ** length_penalty: the ranking
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first
