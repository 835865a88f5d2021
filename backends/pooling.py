"""Embeddings: an embedding request's prompt runs through the model as any prompt does, in as
many chunks as the scheduler gives it, and instead of sampling a token its final hidden states
(after the last norm, what the LM head would read) are pooled into one vector, as vLLM's
poolers do: the last token's (LAST), the mean over the prompt (MEAN), or the first token's
(CLS); then L2-normalised where asked. A MEAN request's running sum lives here between its
chunks, in float32 as transformers' own mean is; it dies with the worker and is dropped where
the core preempts the request, so the core recomputes such a request from its start (never
swapped, recomputed after a worker is replaced)."""

from __future__ import annotations

import torch

from pagedllm.core.outputs import SchedulerOutput
from pagedllm.core.worker_state import ProtocolError


def pooled_rows(chunks) -> dict[int, int]:
    """{chunk index: how many of its first rows' hidden states the pooling needs}: every row of
    a MEAN chunk; the first row of a CLS request's first chunk; every row of a LAST request's
    chunk that ends the prompt (its last is the one kept)."""
    rows = {}
    for i, c in enumerate(chunks):
        pooling = c.state.params.pooling
        if pooling is None:
            continue
        ends = c.start + c.num_tokens == len(c.state.token_ids)
        if pooling.pooling_type == "MEAN" or (pooling.pooling_type == "LAST" and ends):
            rows[i] = c.num_tokens
        elif pooling.pooling_type == "CLS" and c.start == 0:
            rows[i] = 1
        elif ends:  # CLS, its first token pooled in an earlier chunk
            rows[i] = 0
    return rows


class Pooling:
    def __init__(self):
        self._partial: dict[str, torch.Tensor] = {}  # MEAN: the sum so far; CLS: the first row

    def forget(self, plan: SchedulerOutput) -> None:
        for rid in (*plan.finished_request_ids, *plan.preempted_request_ids):
            self._partial.pop(rid, None)

    def add(self, chunks, hidden: dict[int, torch.Tensor]) -> dict[str, list[float]] | None:
        """Pool each chunk's rows; {request id: its embedding} of the requests whose prompt
        this step completed."""
        done = {}
        for i, rows in hidden.items():
            chunk = chunks[i]
            rid, state = chunk.request_id, chunk.state
            pooling = state.params.pooling
            rows = rows.float()
            if chunk.start and pooling.pooling_type != "LAST" and rid not in self._partial:
                # the core recomputes such a request where its partial could be gone
                raise ProtocolError(f"embedding {rid!r} resumed at token {chunk.start} without its partial pooling")
            if pooling.pooling_type == "MEAN":
                total = rows.sum(dim=0)
                self._partial[rid] = total if chunk.start == 0 else self._partial[rid] + total
            elif pooling.pooling_type == "CLS" and chunk.start == 0:
                self._partial[rid] = rows[0]
            if chunk.start + chunk.num_tokens < len(state.token_ids):
                continue
            if pooling.pooling_type == "LAST":
                vector = rows[-1]
            elif pooling.pooling_type == "MEAN":
                vector = self._partial.pop(rid) / len(state.token_ids)
            else:
                vector = self._partial.pop(rid)
            if pooling.normalize:
                vector = torch.nn.functional.normalize(vector, dim=0)
            done[rid] = vector.cpu().tolist()
        return done or None
