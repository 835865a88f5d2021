"""What one request may ask of `pagedllm serve`, so that no single client can exhaust the
server: checked before anything reaches the engine, named in the error (HTTP 400 or 413, a ZMQ
error reply) — the engine keeps serving everyone else."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.errors import InvalidParameter
from pagedllm.core.sampling_params import SamplingParams

MAX_STOP_STRING_CHARS = 1000


class RequestTooLarge(ValueError):
    """A body or frame over --max-request-bytes (HTTP 413)."""


@dataclass
class ServerLimits:
    max_request_bytes: int = 8 << 20  # an HTTP body or a ZMQ frame
    max_prompts: int = 64  # prompts in one completions request
    max_n: int = 64  # completions of one prompt, and beams of one search (best_of)
    max_stop_strings: int = 16
    # logprob entries one request may make the frontend hold (~200 bytes each: 1,000,000 is ~0.2 GB)
    max_logprob_entries: int = 1_000_000

    def __post_init__(self):
        for field in ("max_request_bytes", "max_prompts", "max_n", "max_stop_strings", "max_logprob_entries"):
            if getattr(self, field) < 1:
                raise ValueError(f"--{field.replace('_', '-')}: must be >= 1, got {getattr(self, field)}")

    def check_size(self, num_bytes: int, what: str = "request") -> None:
        if num_bytes > self.max_request_bytes:
            raise RequestTooLarge(
                f"the {what} has {num_bytes} bytes; this server takes at most "
                f"{self.max_request_bytes} (--max-request-bytes)"
            )

    def check_prompts(self, num_prompts: int, field: str = "prompt") -> None:
        if num_prompts > self.max_prompts:
            raise InvalidParameter(
                field, f"{num_prompts} prompts in one request; at most {self.max_prompts} (--max-prompts)"
            )

    def check(self, params: SamplingParams, wire=lambda field: field) -> None:
        """`wire` names an engine field as the protocol at hand names it."""
        if params.n > self.max_n:
            raise InvalidParameter(wire("n"), f"must be <= {self.max_n} (--max-n), got {params.n}")
        if params.beam_width > self.max_n:
            raise InvalidParameter(
                wire("beam_width"), f"beam width must be <= {self.max_n} (--max-n), got {params.beam_width}"
            )
        stops = params.stop or ()
        if len(stops) > self.max_stop_strings:
            raise InvalidParameter(
                "stop", f"{len(stops)} stop strings; at most {self.max_stop_strings} (--max-stop-strings)"
            )
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
            raise InvalidParameter("stop", f"each stop string has at most {MAX_STOP_STRING_CHARS} characters")

    def check_logprob_entries(
        self, params: SamplingParams, prompt_lens: list[int], max_model_len: int, wire=lambda field: field
    ) -> None:
        """The frontend holds every logprob entry of a request until it ends (a non-streamed
        answer needs them all): at most --max-logprob-entries per request, counting each
        token's own and its top ones, over all prompts and completions. `params` as
        InputProcessor.logprobs_asked gives them (a -1 already the vocabulary's size)."""
        total = 0
        for length in prompt_lens:
            if params.logprobs is not None:
                room = max_model_len - length
                tokens = min(params.max_tokens or room, room)
                total += params.n * tokens * (params.logprobs + 1)
            if params.prompt_logprobs is not None:
                total += length * (params.prompt_logprobs + 1)
        if total > self.max_logprob_entries:
            field = "logprobs" if params.logprobs is not None else "prompt_logprobs"
            raise InvalidParameter(
                wire(field),
                f"this request could hold {total} logprob entries (prompts x n x max_tokens x (logprobs + 1), "
                f"and prompt logprobs); at most {self.max_logprob_entries} (--max-logprob-entries): "
                "ask for fewer tokens, completions or logprobs",
            )
