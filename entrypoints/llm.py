"""`LLM`: the offline Python API, following vLLM's.

    from pagedllm import LLM, SamplingParams
    with LLM(model="path/to/hf-folder") as llm:
        outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time

import msgspec

from pagedllm.backends.registry import check_available, resolve_alias
from pagedllm.core.config import EngineConfig, parse_size
from pagedllm.core.errors import InvalidParameter
from pagedllm.core.protocol import EngineOutputs, EngineStats, RequestRejected
from pagedllm.core.request import EngineRequest
from pagedllm.core.sampling_params import BeamSearchParams, SamplingParams

from .engine_client import EngineClient
from .outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from .request_tracker import RequestTracker

GiB = 1 << 30


class LLM:
    def __init__(self, model: str | None = None, backend: str = "cpu", dtype: str = "auto",
                 block_size: int = 16, max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 max_model_len: int | None = None, enable_prefix_caching: bool = True,
                 scheduler_policy: str = "fcfs", preemption_mode: str = "recompute", seed: int = 0,
                 kv_cache_memory: int | str = "1GiB", swap_space: float | str | None = None,
                 tensor_parallel_size: int = 1, num_kv_blocks: int | None = None,
                 gpu_memory_utilization: float = 0.9, enforce_eager: bool = False,
                 tokenizer: str | None = None, skip_tokenizer_init: bool = False, transport: str = "ipc"):
        backend, picked = resolve_alias(backend)  # "cuda" -> the best CUDA backend that can run here
        if picked:
            print(f"pagedllm: {picked}", file=sys.stderr)
        check_available(backend)  # unknown or unusable here: fails now, saying why
        if model is None:
            from .default_model import default_model_dir
            model = default_model_dir()
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise InvalidParameter("model", f"{model!r} is not a folder with a config.json")
        if swap_space is None:
            swap = GiB if preemption_mode == "swap" else 0
        elif isinstance(swap_space, str):
            swap = parse_size(swap_space, "swap_space")
        else:
            swap = int(swap_space * GiB)  # vLLM's unit: GiB
        self.config = EngineConfig(
            model=os.path.abspath(model), backend=backend, dtype=dtype, block_size=block_size,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching,
            scheduler_policy=scheduler_policy, preemption_mode=preemption_mode, seed=seed,
            kv_cache_memory=parse_size(kv_cache_memory, "kv_cache_memory"), num_kv_blocks=num_kv_blocks,
            swap_space=swap, gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size, enforce_eager=enforce_eager)
        self.engine = EngineClient(self.config, transport)
        try:
            # the tokenizer loads while the engine starts
            self.tokenizer = None
            if not skip_tokenizer_init:
                from transformers import AutoTokenizer
                self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or model)
            self.eos_token_id, self.vocab_size = _model_facts(model, self.tokenizer)
            self.ready = self.engine.wait_ready()
        except BaseException:
            self.engine.shutdown()
            raise
        self.max_model_len = self.ready.max_model_len
        self.last_stats: EngineStats | None = None
        self._ids = itertools.count()

    # --- context management ---------------------------------------------------------------
    def __enter__(self) -> "LLM":
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

    def get_tokenizer(self):
        return self.tokenizer

    # --- generation -----------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None) -> list[RequestOutput]:
        items = self._normalise_prompts(prompts)
        params = self._per_prompt(sampling_params, len(items))
        if priority is not None:
            if len(priority) != len(items):
                raise InvalidParameter("priority", f"needs one value per prompt ({len(items)}), got {len(priority)}")
            params = [msgspec.structs.replace(p, priority=pr) for p, pr in zip(params, priority)]
        trackers = [self._tracker(text, ids, p) for (text, ids), p in zip(items, params)]
        return self._run(trackers, use_tqdm)

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search, as transformers' generate(num_beams=W, do_sample=False) runs it. The beams
        are forked requests in the engine: they share the prompt's blocks and every common full
        block, and a beam group is preempted as a whole."""
        items = self._normalise_prompts(prompts)
        sampling = params.to_sampling_params()
        trackers = [self._tracker(text, ids, sampling) for text, ids in items]
        self._run(trackers, use_tqdm)
        outputs = []
        for t in trackers:
            prompt_ids = t.output.prompt_token_ids
            outputs.append(BeamSearchOutput([
                BeamSearchSequence(tokens=prompt_ids + b.token_ids, cum_logprob=b.cum_logprob, score=b.score,
                                   text=self.tokenizer.decode(b.token_ids, skip_special_tokens=True)
                                   if self.tokenizer is not None else None,
                                   finish_reason="stop" if b.token_ids and b.token_ids[-1] == self.eos_token_id
                                   and not params.ignore_eos else "length")
                for b in (t.beams or [])]))
        return outputs

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.render_chat(conv, chat_template, add_generation_prompt) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def render_chat(self, conversation: list[dict], chat_template: str | None = None,
                    add_generation_prompt: bool = True) -> dict:
        """A conversation as a prompt dict (text and token ids), through the tokenizer's template."""
        if self.tokenizer is None:
            raise InvalidParameter("messages", "chat needs a tokenizer (skip_tokenizer_init is set)")
        if getattr(self.tokenizer, "chat_template", None) is None and chat_template is None:
            raise InvalidParameter("messages", "the model's tokenizer has no chat template")
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False, chat_template=chat_template,
                                                  add_generation_prompt=add_generation_prompt)
        return {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}

    def _tracker(self, text, ids, params, request_id: str | None = None) -> RequestTracker:
        if len(ids) >= self.max_model_len:
            raise InvalidParameter("prompt", f"has {len(ids)} tokens; max_model_len is {self.max_model_len}, "
                                             f"which leaves room for at most {self.max_model_len - 1}")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidParameter("prompt_token_ids",
                                   f"token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        if self.tokenizer is None and params.stop:
            raise InvalidParameter("stop", "stop strings need a tokenizer (skip_tokenizer_init is set)")
        return RequestTracker(request_id or str(next(self._ids)), text, ids, params, self.tokenizer)

    def _run(self, trackers: list[RequestTracker], use_tqdm: bool,
             arrivals: list[float] | None = None) -> list[RequestOutput]:
        """Submit the requests — all at once, or each `arrivals[i]` seconds after the start — and
        fold the engine's outputs in until all are finished. Each tracker records when it was
        submitted and when each of its tokens arrived (for latency figures)."""
        route = {rid: t for t in trackers for rid in t.engine_ids}
        schedule = sorted(zip(arrivals or [0.0] * len(trackers), range(len(trackers))))
        start = time.monotonic()
        bar = _progress(len(trackers)) if use_tqdm else None
        remaining = len(trackers)
        try:
            while remaining:
                now = time.monotonic()
                due = []
                while schedule and schedule[0][0] <= now - start:
                    t = trackers[schedule.pop(0)[1]]
                    t.submitted_at = now
                    due.append(EngineRequest(
                        request_id=t.request_id, prompt_token_ids=t.output.prompt_token_ids,
                        sampling_params=t.params, eos_token_id=self.eos_token_id, arrival_time=now))
                self.engine.add_requests(due)
                wait_ms = 100 if not schedule else max(0, int((schedule[0][0] - (now - start)) * 1000))
                msg = self.engine.recv(min(wait_ms, 100))
                if isinstance(msg, EngineOutputs):
                    self.last_stats = msg.stats
                    arrived = time.monotonic()
                    aborts = []
                    for delta in msg.outputs:
                        tracker = route.get(delta.request_id)
                        if tracker is None or tracker.finished:
                            continue
                        tracker.token_times += [arrived] * len(delta.new_token_ids)
                        _, _, _, abort = tracker.apply(delta)
                        if abort:
                            aborts.append(delta.request_id)
                        if tracker.finished:
                            remaining -= 1
                            if bar is not None:
                                bar.update(1)
                    self.engine.abort(aborts)
                elif isinstance(msg, RequestRejected):
                    raise InvalidParameter(msg.field, msg.message)
        except BaseException:
            if self.engine.dead_reason is None and not self.engine.closed:
                self.engine.abort([rid for t in trackers for rid in t.unfinished_engine_ids()])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [t.output for t in trackers]

    # --- inputs ---------------------------------------------------------------------------
    def _normalise_prompts(self, prompts) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        items = []
        for p in prompts:
            if self.tokenizer is None and (isinstance(p, str) or (isinstance(p, dict)
                                                                   and "prompt_token_ids" not in p)):
                raise InvalidParameter("prompts", "text prompts need a tokenizer (skip_tokenizer_init is set)")
            if isinstance(p, str):
                items.append((p, self.tokenizer.encode(p)))
            elif isinstance(p, dict) and "prompt_token_ids" in p:
                items.append((p.get("prompt"), [int(t) for t in p["prompt_token_ids"]]))
            elif isinstance(p, dict) and "prompt" in p:
                items.append((p["prompt"], self.tokenizer.encode(p["prompt"])))
            elif isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p):
                items.append((None, list(p)))
            else:
                raise InvalidParameter("prompts", "each prompt must be a string, a list of token ids, "
                                                  "or a dict with 'prompt' or 'prompt_token_ids'")
        if not items:
            raise InvalidParameter("prompts", "no prompts given")
        for _, ids in items:
            if not ids:
                raise InvalidParameter("prompt", "must contain at least one token")
        return items

    @staticmethod
    def _per_prompt(params, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        if len(params) != n:
            raise InvalidParameter("sampling_params", f"needs one per prompt ({n}), got {len(params)}")
        return list(params)


def _model_facts(model_dir: str, tokenizer) -> tuple[int | None, int]:
    """EOS id (generation_config.json, then config.json, then the tokenizer) and vocab size."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    eos = None
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
    if eos is None:
        eos = cfg.get("eos_token_id", tokenizer.eos_token_id if tokenizer is not None else None)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos, cfg["vocab_size"]


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="Generating", unit="req", dynamic_ncols=True)
