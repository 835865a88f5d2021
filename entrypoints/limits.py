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
    max_logprobs: int = 20  # top log-probabilities per token
    max_stop_strings: int = 16

    def __post_init__(self):
        for field in ("max_request_bytes", "max_prompts", "max_n", "max_stop_strings"):
            if getattr(self, field) < 1:
                raise ValueError(f"--{field.replace('_', '-')}: must be >= 1, got {getattr(self, field)}")
        if self.max_logprobs < 0:
            raise ValueError(f"--max-logprobs: must be >= 0, got {self.max_logprobs}")

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

    def check(
        self, params: SamplingParams, n_field: str = "n", width_field: str = "best_of", logprobs_field: str = "logprobs"
    ) -> None:
        """The fields are named as the protocol at hand names them."""
        if params.n > self.max_n:
            raise InvalidParameter(n_field, f"must be <= {self.max_n} (--max-n), got {params.n}")
        if params.beam_width > self.max_n:
            raise InvalidParameter(
                width_field, f"beam width must be <= {self.max_n} (--max-n), got {params.beam_width}"
            )
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise InvalidParameter(
                logprobs_field, f"must be <= {self.max_logprobs} (--max-logprobs), got {params.logprobs}"
            )
        stops = params.stop or ()
        if len(stops) > self.max_stop_strings:
            raise InvalidParameter(
                "stop", f"{len(stops)} stop strings; at most {self.max_stop_strings} (--max-stop-strings)"
            )
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
            raise InvalidParameter("stop", f"each stop string has at most {MAX_STOP_STRING_CHARS} characters")
