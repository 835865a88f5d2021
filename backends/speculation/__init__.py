"""Speculative decoding in the worker: the step executors that override `propose` and `choose`.

A speculating request's chunk is its last known token and K proposed ones, computed in one
pass; `choose` keeps the longest prefix of the proposal the target itself draws, then the
target's own token (verify.py), and the other chunks sample as in a plain step. The n-gram
method's proposals come in the plan (the core makes them); the draft-model method's proposals
are made here by the draft (draft.py), whose KV lives in the pool beside the target's. This
package is the only place in the worker that knows speculation; the core's counterpart is
core/scheduling/speculation.py.
"""

from __future__ import annotations

from pagedllm.core.config import EngineConfig
from pagedllm.core.outputs import SchedulerOutput
from pagedllm.core.protocol import KVSpec, StepResult
from pagedllm.core.worker_state import ScheduledChunk, WorkerState

from ..kv_cache import kv_spec_of
from ..models.config import DTYPE_NAMES, ModelConfig
from ..models.loader import load_model
from ..registry import unsupported
from ..runner import ModelRunner
from ..sampler import SamplingRow
from ..step_executor import StepExecutor, wire_logprobs
from .draft import DraftProposer
from .verify import verify


class SpeculativeSteps(StepExecutor):
    """Proposals from the plan (the n-gram method's, made in the core)."""

    greedy_runs_whole = False  # a run's steps propose and verify

    def propose(self, plan: SchedulerOutput, chunks: list[ScheduledChunk]) -> dict[int, list[int]]:
        drafts = plan.draft_token_ids
        if not drafts:
            return {}
        speculating = {i: c for i, c in enumerate(chunks) if c.request_id in drafts}
        proposals = self.proposals(plan, list(speculating.values()))
        for chunk, proposal in zip(speculating.values(), proposals):
            chunk.state.token_ids.extend(proposal)  # computed now: verified (and cut back) in choose
        return dict(zip(speculating, proposals))

    def proposals(self, plan: SchedulerOutput, speculating: list[ScheduledChunk]) -> list[list[int]]:
        return [plan.draft_token_ids[c.request_id] for c in speculating]

    def choose(self, chunks, logits, every_row, proposals, masks, result: StepResult) -> None:
        """Rank 0 samples every position of each speculating chunk and keeps the proposal up to
        the first token its draws disagree with, then its own draw there; the other ranks learn
        the kept tokens. The other chunks sample as in a plain step."""
        if proposals:
            speculating = [chunks[i] for i in proposals]
            kept = None
            if self.tp.is_first:
                rows = [
                    SamplingRow(
                        c.state.params,
                        c.state.token_ids[: c.start + 1],
                        c.state.num_prompt_tokens,
                        c.state.eos_token_ids,
                    )
                    for c in speculating
                ]
                kept = []
                verified = verify(self.sampler, list(every_row.values()), rows, list(proposals.values()))
                for chunk, (tokens, lps) in zip(speculating, verified):
                    kept.append(tokens)
                    if lps[0] is not None:
                        result.spec_logprobs = result.spec_logprobs or {}
                        result.spec_logprobs[chunk.request_id] = [wire_logprobs(lp) for lp in lps]
            kept = self.from_first_rank_rows(kept, len(speculating), max(c.num_tokens for c in speculating))
            result.spec_token_ids = {}
            for chunk, tokens in zip(speculating, kept):
                self.state.keep_confirmed(chunk, tokens)
                self.confirmed(chunk)
                result.spec_token_ids[chunk.request_id] = tokens
        super().choose(chunks, logits, every_row, proposals, masks, result)

    def confirmed(self, chunk: ScheduledChunk) -> None:
        """After a chunk's verification (its state cut back to the kept tokens)."""


class DraftModelSteps(SpeculativeSteps):
    """Proposals from a draft model, run by rank 0 inside the step (under tensor parallelism
    the other ranks receive them); its KV follows the target's in the same pool."""

    def __init__(self, config: EngineConfig, model, ops, tp, threads, state: WorkerState):
        super().__init__(config, model, ops, tp, threads, state)
        self.draft_model = self._load_draft(model) if tp.is_first else None
        self.drafter: DraftProposer | None = None  # with the pool (attach)

    def _load_draft(self, target):
        """speculative_config's draft model, at the target's dtype, checked against the target
        and the backend."""
        cfg, spec, target_cfg = self.config, self.config.speculative_config, target.config
        if target_cfg.uniform_window:
            raise ValueError(
                "a draft model beside a target whose every layer has a sliding window is not supported (the core "
                "releases the blocks behind the window, which the draft would still read)"
            )
        dtype = DTYPE_NAMES[target_cfg.dtype]
        wanted = ModelConfig.from_pretrained(spec.model, dtype)
        if wanted.vocab_size != target_cfg.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({wanted.vocab_size} tokens) is not the target's "
                f"({target_cfg.vocab_size}): a draft model must share the target's tokenizer"
            )
        problem = unsupported(self.ops, cfg, wanted)
        if problem:
            raise ValueError(f"backend {cfg.backend} does not support the draft model's {problem}")
        max_positions = cfg.max_model_len or target_cfg.max_position_embeddings
        return load_model(spec.model, dtype=dtype, max_positions=max_positions, device=self.ops.device)

    def describe_kv(self, kv_spec: KVSpec) -> None:
        if self.draft_model is not None:
            kv_spec.draft_bytes_per_slot = kv_spec_of(self.draft_model, self.config.kv_cache_dtype).bytes_per_block_slot

    def attach(self, runner: ModelRunner, make_runner) -> None:
        super().attach(runner, make_runner)
        if self.draft_model is not None:
            target_bytes = kv_spec_of(self.model, self.config.kv_cache_dtype).bytes_per_block_slot
            self.drafter = DraftProposer(make_runner(self.draft_model, target_bytes), self.ops.argmax)

    def runners(self) -> tuple[ModelRunner, ...]:
        return (self.runner, self.drafter.runner) if self.drafter else (self.runner,)  # its one-token passes replay

    def forget(self, plan: SchedulerOutput) -> None:
        super().forget(plan)
        if self.drafter is not None:
            self.drafter.forget(plan, self.runner.block_size)

    def proposals(self, plan: SchedulerOutput, speculating: list[ScheduledChunk]) -> list[list[int]]:
        mine = self.drafter.propose(speculating) if self.drafter is not None else None
        return self.from_first_rank_rows(mine, len(speculating), max(c.num_tokens for c in speculating))

    def confirmed(self, chunk: ScheduledChunk) -> None:
        if self.drafter is not None:
            self.drafter.keep(chunk)


EXECUTORS = {"ngram": SpeculativeSteps, "draft_model": DraftModelSteps}


def speculative_executor(config: EngineConfig, *args) -> SpeculativeSteps:
    return EXECUTORS[config.speculative_config.method](config, *args)
