"""n > 1, seeds, stop strings, detokenization, chat and bad input through the real engine."""

import asyncio

import msgspec
import pytest

from pagedllm import LLM, InvalidParameter, SamplingParams
from pagedllm.entrypoints.detokenizer import IncrementalDetokenizer
from pagedllm.fixtures.tiny_models import load_hf, make_tokenizer

from model_helpers import hf_greedy


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model("llama"), num_kv_blocks=256, max_model_len=512, enable_prefix_caching=False) as engine:
        yield engine


def test_n4_shares_prompt_blocks_and_seeds_reproduce(llm):
    prompt = list(range(10, 10 + 160))  # 10 full blocks of 16
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=42, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    peak = llm.last_stats.scheduler.peak_blocks_used
    texts = [tuple(c.token_ids) for c in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    assert len(set(texts)) == 4, "4 samples should differ"
    # unshared, 4 x 11 blocks; shared: 10 prompt blocks + 4 x (1 copied partial block + growth)
    assert peak <= 10 + 4 * 2, f"peak {peak} blocks: the prompt's blocks were not shared"
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [tuple(c.token_ids) for c in again.outputs] == texts


def test_stop_string_spanning_two_tokens_is_cut(llm):
    tok = llm.get_tokenizer()
    prompt = "The quick brown fox"
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    ids = plain[0].outputs[0].token_ids
    # a stop string made of the last character of token k-1 and the first of token k
    pieces = [tok.decode(ids[:k]) for k in range(len(ids) + 1)]

    def clean_boundary(k):
        a, b = pieces[k], pieces[k + 1]
        return (
            len(b) > len(a) > len(pieces[k - 1])
            and b.startswith(a)
            and "\ufffd" not in a[-1] + b[len(a)]
            and a[-1] + b[len(a)] not in a
        )

    k = next(k for k in range(2, len(ids) - 1) if clean_boundary(k))
    stop = pieces[k][-1] + pieces[k + 1][len(pieces[k])]
    expected_text = pieces[k + 1][: pieces[k + 1].find(stop)]
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == expected_text and stop not in out.text
    assert len(out.token_ids) < 20


def test_multibyte_characters_split_across_tokens_come_out_whole():
    tok = make_tokenizer()
    text = "déjà vu 東京 😀 über"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids), "the test needs a character split across tokens"
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[])
    deltas = [detok.add([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == text


def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "Hello"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert out.prompt == "<|user|>Hello</s><|assistant|>"
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt, add_special_tokens=False)


def test_string_prompts_and_logprobs(llm, tiny_model):
    hf = load_hf(tiny_model("llama"))
    tok = llm.get_tokenizer()
    out = llm.generate(
        "paged attention", SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True), use_tqdm=False
    )[0]
    assert out.prompt_token_ids == tok.encode("paged attention")
    comp = out.outputs[0]
    assert comp.token_ids == hf_greedy(hf, out.prompt_token_ids, 6)
    assert len(comp.logprobs) == 6
    for token, entry in zip(comp.token_ids, comp.logprobs):
        assert entry[token].rank == 1 and len(entry) == 3
        assert entry[token].logprob == max(lp.logprob for lp in entry.values())
    assert comp.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(comp.token_ids, comp.logprobs)))


def test_bad_input_names_the_field_and_the_engine_keeps_serving(llm):
    with pytest.raises(InvalidParameter, match="prompt"):
        llm.generate([list(range(3, 600))], use_tqdm=False)
    with pytest.raises(InvalidParameter, match="prompt_token_ids"):
        llm.generate([[5, 100000]], use_tqdm=False)
    with pytest.raises(InvalidParameter, match="prompt"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(InvalidParameter, match="temperature"):
        SamplingParams(temperature=-1)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert llm.last_stats.scheduler.kv_cache_usage == 0.0


def test_one_generate_call_is_admitted_as_one_batch(llm):
    """The requests of one call reach the core in one message, so the first step holds all of
    them however the processes are timed (the conformance preemption checks rely on this)."""
    prompts = [[5 + i, 6, 7, 8] for i in range(32)]
    llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    assert llm.last_stats.batch_sizes == [32]


def test_unknown_backend_lists_known_ones():
    with pytest.raises(ValueError, match=r"known backends: .*\bcpu\b"):
        LLM(backend="tpu")


def test_tcp_transport(tiny_model):
    with LLM(tiny_model("llama"), num_kv_blocks=64, max_model_len=256, transport="tcp") as engine:
        assert all(e.startswith("tcp://127.0.0.1:") for e in engine.engine.endpoints.values())
        out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_seeded_samples_repeat_across_separately_started_engines(tiny_model):
    """Each engine core is a new interpreter with its own str-hash seed: sample i's seed must
    be derived without hash()."""
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
    runs = []
    for _ in range(2):
        with LLM(tiny_model("llama"), num_kv_blocks=64, max_model_len=256, skip_tokenizer_init=True) as engine:
            runs.append([c.token_ids for c in engine.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs])
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[0]}) == 3


def test_every_eos_id_of_generation_config_stops(tiny_model, tmp_path):
    """Llama 3 lists several EOS ids; transformers stops on each. The second id of the list is
    the token greedy decoding emits fifth."""
    import json
    import shutil

    src = tiny_model("llama")
    prompt = [5, 6, 7, 8]
    with LLM(src, num_kv_blocks=64, max_model_len=256, skip_tokenizer_init=True) as engine:
        free = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    tokens = free[0].outputs[0].token_ids
    stop_at = tokens[4]
    first = tokens.index(stop_at)
    folder = shutil.copytree(src, tmp_path / "two-eos")
    unused = next(t for t in range(3, 400) if t not in tokens)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [unused, stop_at]}))
    with LLM(str(folder), num_kv_blocks=64, max_model_len=256, skip_tokenizer_init=True) as engine:
        out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
        assert engine.eos_token_ids == [unused, stop_at]
    assert out.finish_reason == "stop"
    assert out.token_ids == tokens[: first + 1]


def test_a_high_priority_request_preempts_a_full_engine_and_nothing_changes_tokens(tiny_model):
    """8 long low-priority generations hold every sequence slot; an urgent request finishes
    while they still run (under fcfs it waits for one to finish), and theirs end with the
    tokens they have without preemption."""
    from pagedllm.entrypoints.async_engine import AsyncEngine

    # long enough that the urgent request ends first even when this process sees the low ones'
    # tokens late (a loaded machine: at 80 tokens, 7 of 8 had ended before it)
    low = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, priority=5)
    urgent = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, priority=0)
    prompts = [[5 + i, 6, 7 + i] * (2 + i) for i in range(8)]

    async def run(policy):
        engine = AsyncEngine(
            model=tiny_model("llama"), max_num_seqs=8, scheduler_policy=policy, skip_tokenizer_init=True
        )
        try:
            tokens = {}
            started = asyncio.Event()

            async def one(name, prompt, params):
                async for out in engine.generate({"prompt_token_ids": prompt}, params):
                    tokens[name] = list(out.output.outputs[0].token_ids)
                    if all(len(tokens.get(f"low{i}", ())) >= 5 for i in range(8)):
                        started.set()
                return name

            lows = [asyncio.create_task(one(f"low{i}", p, low)) for i, p in enumerate(prompts)]
            await started.wait()
            await one("urgent", [300, 301, 302], urgent)
            lows_done = sum(t.done() for t in lows)
            await asyncio.gather(*lows)
            return tokens, lows_done, engine.last_stats
        finally:
            engine.shutdown()

    fcfs_tokens, fcfs_done, _ = asyncio.run(run("fcfs"))
    assert fcfs_done > 0, "under fcfs the urgent request waits for a free slot"
    tokens, done, stats = asyncio.run(run("priority"))
    assert done == 0, "the urgent request should have finished while every low-priority one ran"
    assert stats.scheduler.num_preemptions > 0
    assert tokens == fcfs_tokens


def test_max_model_len_past_the_models_positions_is_refused_unless_allowed(tiny_model, monkeypatch):
    """The tiny models have max_position_embeddings 1024: 2048 is refused before anything starts,
    naming both numbers; with PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN=1 the engine runs a prompt past
    position 1024 (the rotary tables are as long as the context) instead of its worker dying."""
    from pagedllm.core.model_folder import ModelFolder

    path = tiny_model("llama")
    with pytest.raises(InvalidParameter, match=r"max_model_len: 2048 .*max_position_embeddings 1024"):
        LLM(path, max_model_len=2048)
    monkeypatch.setenv("PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    with LLM(path, max_model_len=2048, num_kv_blocks=160, skip_tokenizer_init=True) as llm:
        out = llm.generate([[7] * 1500], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    # linear rope scaling stretches the positions by its factor, as vLLM derives it
    scaled = ModelFolder(path)
    scaled.config["rope_parameters"] = {**scaled.config["rope_parameters"], "rope_type": "linear", "factor": 4.0}
    assert scaled.position_limit()[0] == 4096
    scaled.check_max_model_len(4096)


def test_offline_requests_reach_the_frontend_once_unless_a_stop_string_is_watched(llm):
    """LLM.generate reads a request's tokens when it ends: the core holds them until then (one
    hand-off per request, not one per step), and streams per step only where the frontend must
    watch for a stop string. The tokens are the same either way."""
    messages = []
    recv = llm.engine.recv

    def counting_recv(timeout_ms):
        msg = recv(timeout_ms)
        if msg is not None:
            messages.append(msg)
        return msg

    llm.engine.recv = counting_recv
    prompts = [[10, 11, 12], list(range(20, 60))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2, seed=3)
    try:
        held = llm.generate(prompts, params, use_tqdm=False)
        assert len(messages) <= 4, f"{len(messages)} messages for 2 requests x n=2"
        messages.clear()
        watched = llm.generate(prompts, msgspec.structs.replace(params, stop=["\x00never"]), use_tqdm=False)
        assert len(messages) >= 20, "a watched request streams step by step"
    finally:
        llm.engine.recv = recv
    for a, b in zip(held, watched):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert all(len(c.token_ids) == 24 for c in a.outputs)


def test_merged_deltas_say_what_the_steps_said():
    from pagedllm.core.outputs import PromptLogprobs, RequestOutputDelta, TokenLogprobs, merge_deltas

    lp = [TokenLogprobs(-float(i), 1, [], []) for i in range(6)]
    first = RequestOutputDelta("r", [], prompt_logprobs=PromptLogprobs(1, lp[:3]), queued_seconds=0.5)
    second = RequestOutputDelta("r", [7], logprobs=[lp[0]], prompt_logprobs=PromptLogprobs(2, lp[1:5]))
    last = RequestOutputDelta("r", [8, 9], "length", logprobs=[lp[1], lp[2]], num_cached_tokens=16)
    merged = merge_deltas(merge_deltas(first, second), last)
    assert merged.new_token_ids == [7, 8, 9] and merged.finish_reason == "length"
    assert merged.logprobs == [lp[0], lp[1], lp[2]]
    assert merged.queued_seconds == 0.5 and merged.num_cached_tokens == 16
    # positions 1-3 from the first chunk, 4-5 from the second (its report of 2-3 again is dropped)
    assert merged.prompt_logprobs.start == 1 and merged.prompt_logprobs.entries == lp[:5]


def test_max_logprobs_caps_what_a_request_asks_and_minus_one_is_the_vocabulary():
    """The engine's max_logprobs (vLLM's; 20 by default) bounds logprobs and prompt_logprobs; a
    request's -1 asks for the whole vocabulary, which only max_logprobs -1 (or one as large)
    allows; a count wider than the vocabulary is the vocabulary."""
    from pagedllm.entrypoints.input_processor import InputProcessor

    inputs = InputProcessor(None, [], vocab_size=400, max_model_len=512)
    assert inputs.logprobs_asked(SamplingParams(logprobs=20, prompt_logprobs=0)).logprobs == 20
    for field, value in (("logprobs", 21), ("prompt_logprobs", -1), ("logprobs", -1)):
        with pytest.raises(InvalidParameter) as e:
            inputs.logprobs_asked(SamplingParams(**{field: value}))
        assert e.value.field == field and "max_logprobs" in str(e.value)
    unlimited = InputProcessor(None, [], vocab_size=400, max_model_len=512, max_logprobs=-1)
    asked = unlimited.logprobs_asked(SamplingParams(logprobs=-1, prompt_logprobs=1000))
    assert (asked.logprobs, asked.prompt_logprobs) == (400, 400)
    with pytest.raises(InvalidParameter, match="max_logprobs"):
        LLM(None, max_logprobs=-2)
