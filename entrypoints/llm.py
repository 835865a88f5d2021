"""`LLM`: the offline Python API, following vLLM's.

from pagedllm import LLM, SamplingParams
with LLM(model="path/to/hf-folder") as llm:
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
"""

from __future__ import annotations

import itertools
import time

import msgspec

from pagedllm.core.errors import InvalidParameter, rejection_error
from pagedllm.core.lora import LoRARequest
from pagedllm.core.protocol import EngineOutputs, EngineStats, RequestRejected
from pagedllm.core.sampling_params import BeamSearchParams, SamplingParams

from .engine_args import EngineArgs, start_engine
from .input_processor import per_prompt
from .output_processor import OutputProcessor
from .outputs import BeamSearchOutput, BeamSearchSequence, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from .request_tracker import RequestTracker


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        """`engine_args`: the options of `pagedllm.entrypoints.engine_args.EngineArgs`, where
        each is declared once with its default and meaning (`pagedllm generate --help` lists them)."""
        self.engine, self.inputs = start_engine(EngineArgs(model=model, **engine_args))
        self.outputs = OutputProcessor()
        self.last_stats: EngineStats | None = None
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.inputs.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.inputs.max_model_len

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation (generation_config.json's list, as transformers reads it)."""
        return self.inputs.eos_token_ids

    def get_tokenizer(self):
        return self.tokenizer

    # --- context management ---------------------------------------------------------------
    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 - interpreter teardown: modules may be half gone
                pass

    def shutdown(self) -> None:
        self.engine.shutdown()

    def reset_prefix_cache(self) -> None:
        """Forget the prefix cache, as vLLM's LLM.reset_prefix_cache (the core does it between
        steps, where no request holds a block)."""
        self.engine.reset_prefix_cache()

    # --- generation -----------------------------------------------------------------------
    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """lora_request: the adapter every prompt runs under, or one per prompt (None: the base
        model); the engine needs enable_lora."""
        items = self.inputs.prompts(prompts)
        params = per_prompt(sampling_params, len(items))
        if priority is not None:
            if len(priority) != len(items):
                raise InvalidParameter("priority", f"needs one value per prompt ({len(items)}), got {len(priority)}")
            params = [msgspec.structs.replace(p, priority=pr) for p, pr in zip(params, priority)]
        adapters = self._adapters(lora_request, len(items))
        trackers = [
            self.inputs.tracker(item, p, str(next(self._ids)), a) for item, p, a in zip(items, params, adapters)
        ]
        return self._run(trackers, use_tqdm)

    def _adapters(self, lora_request, count: int) -> list[LoRARequest | None]:
        adapters = lora_request if isinstance(lora_request, list) else [lora_request] * count
        if len(adapters) != count:
            raise InvalidParameter("lora_request", f"needs one per prompt ({count}), got {len(adapters)}")
        return [self.inputs.adapter(a) for a in adapters]

    def beam_search(
        self,
        prompts,
        params: BeamSearchParams,
        use_tqdm: bool = False,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search, as transformers' generate(num_beams=W, do_sample=False) runs it. The beams
        are forked requests in the engine: they share the prompt's blocks and every common full
        block, and a beam group is preempted as a whole. lora_request: as generate's."""
        sampling = params.to_sampling_params()
        items = self.inputs.prompts(prompts)
        adapters = self._adapters(lora_request, len(items))
        trackers = [self.inputs.tracker(item, sampling, str(next(self._ids)), a) for item, a in zip(items, adapters)]
        self._run(trackers, use_tqdm)
        return [BeamSearchOutput([self._beam_sequence(t, b, params) for b in (t.beams or [])]) for t in trackers]

    def _beam_sequence(self, tracker: RequestTracker, beam, params: BeamSearchParams) -> BeamSearchSequence:
        text = self.tokenizer.decode(beam.token_ids, skip_special_tokens=True) if self.tokenizer is not None else None
        return BeamSearchSequence(
            tokens=tracker.output.prompt_token_ids + beam.token_ids,
            text=text,
            cum_logprob=beam.cum_logprob,
            score=beam.score,
            finish_reason=beam.finish_reason,
        )

    def embed(self, prompts, use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding: its final hidden states pooled as the engine's --pooler-config
        says (needs runner="pooling", as vLLM's LLM.embed)."""
        items = self.inputs.prompts(prompts)
        params = self.inputs.embedding_params()
        trackers = [self.inputs.tracker(item, params, str(next(self._ids))) for item in items]
        outputs = self._run(trackers, use_tqdm)
        return [EmbeddingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(o.embedding)) for o in outputs]

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.inputs.render_chat(conv, chat_template, add_generation_prompt) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _run(self, trackers: list[RequestTracker], use_tqdm: bool) -> list[RequestOutput]:
        """Submit the requests in one message (the core admits them in one step) and fold the
        engine's outputs in until all are finished."""
        now = time.monotonic()
        for t in trackers:
            self.outputs.add(t)
            t.timing.submitted = now
        bar = _progress(len(trackers)) if use_tqdm else None
        try:
            # nothing reads tokens before a request ends unless a stop string is watched for
            requests = [self.inputs.engine_request(t, now, final_only=not t.params.stop) for t in trackers]
            self.engine.add_requests(requests)
            remaining = len(trackers)
            while remaining:
                msg = self.engine.recv(100)
                if isinstance(msg, EngineOutputs):
                    self.last_stats = msg.stats
                    finished, aborts = self.outputs.fold(msg.outputs)
                    self.engine.abort(aborts)
                    for tracker in finished:
                        remaining -= 1
                        self.outputs.remove(tracker)
                    if bar is not None and finished:
                        bar.update(len(finished))
                elif isinstance(msg, RequestRejected):
                    raise rejection_error(msg.field, msg.message, msg.internal)
        except BaseException:
            if self.engine.dead_reason is None and not self.engine.closed:
                self.engine.abort([rid for t in trackers for rid in t.unfinished_engine_ids()])
            raise
        finally:
            for t in trackers:
                self.outputs.remove(t)
            if bar is not None:
                bar.close()
        return [t.output for t in trackers]


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="Generating", unit="req", dynamic_ncols=True)
