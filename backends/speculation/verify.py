"""Speculative decoding's verification, for every sampling mode: the target model's logits at
each position of a speculating request (its last known token, then the K proposed ones) are
sampled as if the request had decoded one token at a time with the proposal as its history, and
the proposal is kept up to the first position where the draw disagrees with it.

For a proposal that puts all its mass on one token (n-gram lookup, a greedy draft), this is
rejection sampling: the proposed token d is kept with probability p(d), and on a rejection the
token drawn is distributed as p without d, renormalised — so every output token is distributed
exactly as the target's. The draw at each position uses the randomness plain decoding would use
there (a seeded request's generator is keyed by its output index), so a seeded request's tokens
are the same with speculation as without, on any batch, across runs. Penalties, min_tokens and
logprobs are applied per position over the history the position would have.
"""

from __future__ import annotations

import torch

from ..sampler import Logprobs, Sampler, SamplingRow


def position_rows(row: SamplingRow, proposal: list[int]) -> list[SamplingRow]:
    """The sampling row of each of the K + 1 positions: the history up to it, the proposal's
    earlier tokens included."""
    return [
        SamplingRow(row.params, row.token_ids + proposal[:j], row.num_prompt_tokens, row.eos_token_ids)
        for j in range(len(proposal) + 1)
    ]


def verify(
    sampler: Sampler, logits: list[torch.Tensor], rows: list[SamplingRow], proposals: list[list[int]]
) -> list[tuple[list[int], list[Logprobs | None]]]:
    """For each request (its logits [K + 1, vocab], its row before the proposal, the proposal):
    the proposed tokens kept and the target's own token after them, with their logprobs."""
    positions = [r for row, proposal in zip(rows, proposals) for r in position_rows(row, proposal)]
    out = sampler(torch.cat(logits), positions)
    results, at = [], 0
    for proposal in proposals:
        drawn = out.token_ids[at : at + len(proposal) + 1]
        kept = next((j for j, (p, t) in enumerate(zip(proposal, drawn)) if p != t), len(proposal))
        results.append((drawn[: kept + 1], out.logprobs[at : at + kept + 1]))
        at += len(proposal) + 1
    return results
