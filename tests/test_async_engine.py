"""The asyncio frontend: many concurrent streams, each equal to the offline result; a caller that
stops listening has its request aborted and its blocks freed."""

import asyncio

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.async_engine import AsyncEngine

PROMPTS = [[5 + i] * (3 + 7 * i) for i in range(16)]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def offline(tiny_model):
    with LLM(tiny_model("llama"), num_kv_blocks=256, max_model_len=256) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def engine(tiny_model):
    e = AsyncEngine(model=tiny_model("llama"), num_kv_blocks=256, max_model_len=256)
    yield e
    e.shutdown()


def test_concurrent_streams_equal_offline(engine, offline):
    async def one(prompt):
        tokens, text, updates = [], "", 0
        async for out in engine.generate(prompt, PARAMS):
            tokens += out.delta_token_ids
            text += out.delta_text
            updates += 1
        assert out.finished and text == out.output.outputs[0].text
        return tokens, updates

    async def main():
        return await asyncio.gather(*(one(p) for p in PROMPTS))

    results = asyncio.run(main())
    assert [tokens for tokens, _ in results] == offline
    assert all(updates > 1 for _, updates in results), "tokens should stream, not arrive at the end"


def test_a_caller_that_stops_listening_frees_its_blocks(engine):
    async def main():
        gen = engine.generate([7] * 40, SamplingParams(max_tokens=200, ignore_eos=True))
        async for out in gen:
            if len(out.output.outputs[0].token_ids) >= 3:
                break
        await gen.aclose()  # what a server does when the client disconnects
        finished = [out async for out in engine.generate([9, 9], PARAMS)]
        return finished[-1]

    last = asyncio.run(main())
    assert last.finished
    assert engine.last_stats.scheduler.kv_cache_usage == 0.0 and engine.last_stats.scheduler.num_running == 0


def test_n_samples_and_request_ids(engine):
    async def main():
        outs = [
            o
            async for o in engine.generate(
                [3, 4, 5], SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=5), request_id="mine"
            )
        ]
        return outs[-1]

    last = asyncio.run(main())
    assert last.output.request_id == "mine" and len(last.output.outputs) == 2
    assert all(len(c.token_ids) == 5 for c in last.output.outputs)


def test_aborting_n_samples_before_they_fork_ends_every_one(engine):
    """What a draining server does (abort_all) to a request of n = 3 whose prompt is still being
    prefilled: every one of its streams must end, none wait for samples that never forked."""

    async def main():
        stream = engine.add_request([7] * 200, SamplingParams(n=3, max_tokens=50, ignore_eos=True))
        engine.abort_all()
        return [out async for out in stream][-1]

    last = asyncio.run(asyncio.wait_for(main(), timeout=20))
    assert last.finished and [c.finish_reason for c in last.output.outputs] == ["abort"] * 3
