"""Speculative decoding with a draft model: a smaller model with the target's tokenizer, run
by the worker inside the step, before the target verifies. Its KV lives in the paged pool
beside the target's (the same block ids and slots, a region of its own), so a proposal costs
the draft one pass over the tokens it has not seen and K - 1 one-token passes.

The core schedules 1 + K tokens for a speculating request and sends an empty proposal;
`propose` makes the K tokens, the draft's greedy choices. What the draft has computed is kept per
request (`computed`: its KV is valid for positions below it) and cut back wherever the target's
KV was: to the kept tokens after a verification, and to the first block of a table the core
replaced (a rollback's freed blocks, a swap-in, a copy-on-write copy). A request the worker
sees for the first time (a new one, a preempted one back, a fork, after a worker restart)
starts at 0, so the draft catches up over its whole context once.
"""

from __future__ import annotations

from pagedllm.core.outputs import SchedulerOutput
from pagedllm.core.worker_state import ScheduledChunk

from ..runner import ModelRunner, SeqInput


class DraftProposer:
    def __init__(self, runner: ModelRunner, argmax):
        self.runner = runner
        self.argmax = argmax  # the backend's (AttentionOps.argmax)
        self.computed: dict[str, int] = {}

    def forget(self, plan: SchedulerOutput, block_size: int) -> None:
        """The plan's ended requests, and the blocks the core replaced in the others' tables."""
        computed = self.computed
        for rid in (*plan.finished_request_ids, *plan.preempted_request_ids):
            computed.pop(rid, None)
        for rid, (start, _) in plan.block_table_deltas.items():
            if rid in computed:
                computed[rid] = min(computed[rid], start * block_size)

    def propose(self, chunks: list[ScheduledChunk]) -> list[list[int]]:
        """Each chunk is the request's last known token and K slots to fill: the draft's K
        greedy tokens for each, in the chunks' order."""
        computed = self.computed
        seqs = []
        for c in chunks:
            done = min(computed.get(c.request_id, 0), c.start)
            seqs.append(SeqInput(c.state.token_ids[done : c.start + 1], done, c.state.block_ids))
        proposals = [[t] for t in self.argmax(self.runner.execute(seqs)).tolist()]
        for step in range(1, max(c.num_tokens for c in chunks) - 1):
            active = [i for i, c in enumerate(chunks) if c.num_tokens - 1 > step]
            seqs = [SeqInput([proposals[i][-1]], chunks[i].start + step, chunks[i].state.block_ids) for i in active]
            for i, token in zip(active, self.argmax(self.runner.execute(seqs)).tolist()):
                proposals[i].append(token)
        for c, proposal in zip(chunks, proposals):
            computed[c.request_id] = c.start + len(proposal)  # the last token and all but the last proposed
        return proposals

    def keep(self, chunk: ScheduledChunk) -> None:
        """After verification: the draft's KV past the kept tokens is not the request's."""
        rid = chunk.request_id
        self.computed[rid] = min(self.computed.get(rid, 0), chunk.state.num_computed)
