"""Token sampling for a batch, each row with its own SamplingParams.

Order: logit_bias (added to the model's logits: the distribution the request asked for), the
structured-outputs mask, min_tokens masking, penalties (repetition on prompt and output tokens;
presence and frequency on output tokens), then greedy argmax, or temperature, top-k, top-p,
min-p and a draw. A request with a seed draws from a generator seeded by (seed, number of
tokens it has generated), so its tokens do not depend on the batch around it, nor on
preemption. Logprobs are those of the model's distribution with the request's logit_bias
added, before masks and penalties (vLLM reports the raw distribution by default).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.utils import derive_seed

from .attention import apply_token_bitmask


@dataclass
class SamplingRow:
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)  # prompt and output so far
    num_prompt_tokens: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    bitmask: torch.Tensor | None = None  # structured outputs: the tokens allowed now (see AttentionOps)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class Logprobs:
    token_logprob: float  # of the sampled token
    rank: int  # 1 = the most likely token
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[Logprobs | None]


BIAS_CACHE_SIZE = 4096  # requests' logit_bias tensors kept (cleared whole when full)
DENSE_BIAS_BYTES = 16 << 20  # a batch's logit_bias as a dense [rows, vocab] tensor up to this size


def _same_objects(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _seed_for(seed: int, step: int) -> int:
    """The generator seed of a seeded request's `step`-th output token."""
    return derive_seed(seed, step)


class Sampler:
    def __init__(
        self,
        seed: int = 0,
        argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
        apply_bitmask: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    ):
        self.generator = torch.Generator().manual_seed(seed)  # for rows without a seed
        self.argmax = argmax or (lambda scores: scores.argmax(dim=-1))  # the backend's (AttentionOps.argmax)
        self.apply_bitmask = apply_bitmask or apply_token_bitmask  # the backend's (AttentionOps.apply_token_bitmask)
        self._biases: dict[int, tuple] = {}  # id(params) -> (params, token ids, biases): see _bias_tensors
        self._batch_bias = None  # the last batch's logit_bias: see _batch_bias_tensors

    @torch.inference_mode()  # the logits are the runner's (inference tensors): masked in place
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        logits = self.logit_bias(logits.float(), rows)
        want_logprobs = any(r.params.logprobs is not None for r in rows)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        logits = self._constrain(logits, rows)
        logits = apply_min_tokens(logits, rows)
        logits = apply_penalties(logits, rows)

        greedy = [i for i, r in enumerate(rows) if r.params.temperature == 0.0]
        random = [i for i, r in enumerate(rows) if r.params.temperature != 0.0]
        if not random:  # the common all-greedy batch: no copies of the logits
            tokens = self.argmax(logits)
        else:
            tokens = torch.empty(len(rows), dtype=torch.long)
        if greedy and random:
            tokens[greedy] = self.argmax(logits[greedy])
        if random:
            probs = probabilities([rows[i].params for i in random], logits[random])
            tokens[random] = self._draw(probs, [rows[i] for i in random])
        token_list = tokens.tolist()
        logprobs = [None] * len(rows)
        if want_logprobs:
            for i, row in enumerate(rows):
                if row.params.logprobs is not None:
                    logprobs[i] = _logprobs(raw_logprobs[i], token_list[i], row.params.logprobs)
        return SamplerOutput(token_list, logprobs)

    def logit_bias(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Each row's logit_bias added to its logits, in place (the sampler's logits are its own,
        as _constrain masks them). A request's bias becomes tensors once; a batch's, once for as
        long as the same requests sample in the same order (a decode step's usual case): a dense
        [rows, vocab] bias added in one pass where it takes at most DENSE_BIAS_BYTES (64 rows of
        a 4,096-token vocabulary: 0.02 ms, where a scatter of their 300 entries each took 0.08),
        else one scatter."""
        params = [r.params for r in rows]
        cached = self._batch_bias
        if cached is None or cached[0] != logits.shape[1] or not _same_objects(cached[1], params):
            cached = self._batch_bias = self._batch_bias_tensors(params, logits.shape[1])
        _, _, flat, values, dense = cached
        if dense is not None:
            logits.add_(dense)
        elif flat is not None:
            logits.view(-1).index_add_(0, flat, values)
        return logits

    def _batch_bias_tensors(self, params: list[SamplingParams], vocab: int) -> tuple:
        """(vocab, params, flat indices, biases, dense bias or None) of a batch's logit_bias."""
        biased = [(i, self._bias_tensors(p)) for i, p in enumerate(params) if p.logit_bias]
        if not biased:
            return vocab, params, None, None, None
        flat = torch.cat([ids + i * vocab for i, (ids, _) in biased])
        values = torch.cat([values for _, (_, values) in biased])
        dense = None
        if len(params) * vocab * 4 <= DENSE_BIAS_BYTES:
            dense = torch.zeros(len(params) * vocab).index_add_(0, flat, values).view(len(params), vocab)
        return vocab, params, flat, values, dense

    def _bias_tensors(self, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids, biases) of a request's logit_bias, made once per SamplingParams object."""
        cached = self._biases.get(id(params))
        if cached is None or cached[0] is not params:
            if len(self._biases) >= BIAS_CACHE_SIZE:
                self._biases.clear()
            bias = params.logit_bias
            ids = torch.tensor(list(bias.keys()), dtype=torch.long)
            cached = self._biases[id(params)] = (params, ids, torch.tensor(list(bias.values()), dtype=torch.float32))
        return cached[1], cached[2]

    def _constrain(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Structured outputs: the rows with a token bitmask keep only the tokens it allows."""
        masked = [i for i, r in enumerate(rows) if r.bitmask is not None]
        if not masked:
            return logits
        masks = torch.stack([rows[i].bitmask for i in masked]).to(logits.device)
        if len(masked) == len(rows):  # every row: in place (the sampler's logits are its own)
            self.apply_bitmask(logits, masks)
            return logits
        sub = logits[masked]
        self.apply_bitmask(sub, masks)
        logits = logits.clone()
        logits[masked] = sub
        return logits

    def _draw(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """argmax(p / E) with E ~ Exp(1) picks token i with probability p_i."""
        noise = torch.empty_like(probs)
        for j, row in enumerate(rows):
            seed = row.params.seed
            gen = (
                self.generator
                if seed is None
                else torch.Generator().manual_seed(_seed_for(seed, row.num_output_tokens))
            )
            noise[j].exponential_(generator=gen)
        return self.argmax(probs / noise)


def probabilities(params: list[SamplingParams], logits: torch.Tensor) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks; rows are renormalised."""
    vocab = logits.shape[-1]
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
    logits = logits / temps[:, None]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if any(k < vocab for k in top_k):
        ordered = logits.sort(dim=-1, descending=True).values
        kth = ordered.gather(1, torch.tensor(top_k)[:, None] - 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype)
    if (top_p < 1.0).any():
        ascending, order = logits.sort(dim=-1)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1.0 - top_p)[:, None]  # the least likely tail outside the nucleus
        drop[:, -1] = False  # always keep the most likely token
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype)
    if (min_p > 0).any():
        probs = logits.softmax(dim=-1)
        floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits.softmax(dim=-1)


def apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Until a request has min_tokens outputs, its EOS and stop tokens cannot be drawn."""
    blocked = []
    for i, row in enumerate(rows):
        if row.num_output_tokens < row.params.min_tokens:
            ids = list(row.params.stop_token_ids or ())
            if not row.params.ignore_eos:
                ids.extend(row.eos_token_ids)
            blocked.extend((i, t) for t in ids if 0 <= t < logits.shape[-1])
    if not blocked:
        return logits
    logits = logits.clone()
    rows_idx, cols = zip(*blocked)
    logits[list(rows_idx), list(cols)] = float("-inf")
    return logits


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """repetition: a seen token's logit is divided by the penalty if positive, multiplied if
    not (HF/vLLM); frequency: minus penalty x count in the output; presence: minus penalty
    if in the output at all."""
    if not any(
        r.params.repetition_penalty != 1.0 or r.params.presence_penalty or r.params.frequency_penalty for r in rows
    ):
        return logits
    batch, vocab = logits.shape
    counts = torch.zeros(batch, vocab, dtype=logits.dtype)
    seen = torch.zeros(batch, vocab, dtype=torch.bool)
    for i, row in enumerate(rows):
        if row.output_token_ids:
            out = torch.tensor(row.output_token_ids, dtype=torch.long)
            counts[i] = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
        if row.prompt_token_ids:
            seen[i, torch.tensor(row.prompt_token_ids, dtype=torch.long)] = True
    seen |= counts > 0
    rep = torch.tensor([r.params.repetition_penalty for r in rows], dtype=logits.dtype)[:, None]
    freq = torch.tensor([r.params.frequency_penalty for r in rows], dtype=logits.dtype)[:, None]
    pres = torch.tensor([r.params.presence_penalty for r in rows], dtype=logits.dtype)[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    return logits - freq * counts - pres * (counts > 0).to(logits.dtype)


def _logprobs(row_logprobs: torch.Tensor, token: int, k: int) -> Logprobs:
    token_lp = row_logprobs[token]
    rank = int((row_logprobs > token_lp).sum()) + 1
    top = row_logprobs.topk(k) if k else None
    return Logprobs(float(token_lp), rank, top.indices.tolist() if k else [], top.values.tolist() if k else [])
