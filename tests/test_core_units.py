import subprocess
import sys

import msgspec
import pytest

from pagedllm.core import CacheConfig, InvalidParameter, SamplingParams, SchedulerConfig
from pagedllm.core.protocol import Decoder, Encoder, Step, ToWorker
from pagedllm.core.scheduling.block_pool import BlockPool


def test_core_imports_no_torch():
    code = (
        "import sys, pkgutil, importlib, pagedllm.core\n"
        "for m in pkgutil.iter_modules(pagedllm.core.__path__): importlib.import_module('pagedllm.core.' + m.name)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'transformers'))\n"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("temperature", -0.5, ">= 0.0"),
        ("top_p", 0.0, "> 0.0"),
        ("top_p", 1.5, "<= 1.0"),
        ("top_k", -2, ">= -1"),
        ("min_p", 2.0, "<= 1.0"),
        ("presence_penalty", 3.0, "<= 2.0"),
        ("frequency_penalty", -2.5, ">= -2.0"),
        ("repetition_penalty", 0.0, "> 0.0"),
        ("max_tokens", 0, ">= 1"),
        ("n", 0, ">= 1"),
        ("min_tokens", -1, ">= 0"),
        ("logprobs", -2, ">= -1"),
        ("temperature", float("nan"), "finite"),
        ("max_tokens", 2.5, "integer"),
    ],
)
def test_sampling_params_errors_name_field_and_range(field, value, needle):
    with pytest.raises(InvalidParameter) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field
    assert field in str(err.value) and needle in str(err.value)


def test_sampling_params_min_tokens_above_max_tokens():
    with pytest.raises(InvalidParameter, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_sampling_params_round_trip_msgpack_and_stop_string():
    params = SamplingParams(temperature=0.0, top_k=5, stop="END", seed=7, logprobs=3)
    assert params.stop == ["END"]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"temperature": -1}), type=SamplingParams)


def test_configs_validate():
    with pytest.raises(InvalidParameter, match="block_size"):
        CacheConfig(block_size=3)
    with pytest.raises(InvalidParameter, match="scheduler_policy"):
        SchedulerConfig(policy="lifo")
    with pytest.raises(InvalidParameter, match="preemption_mode"):
        SchedulerConfig(preemption_mode="drop")


def test_scheduler_rejects_model_len_that_cannot_fit():
    from core_helpers import make_scheduler

    with pytest.raises(InvalidParameter, match="max_model_len"):
        make_scheduler(block_size=4, num_blocks=5, max_model_len=64)


def test_block_pool_allocate_free_and_null_block():
    pool = BlockPool(6)
    blocks = pool.allocate(5)
    assert sorted(b.block_id for b in blocks) == [1, 2, 3, 4, 5]
    assert pool.num_free == 0 and pool.usage == 1.0
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.free(blocks)
    assert pool.num_free == 5 and pool.usage == 0.0
    pool.check_invariants({})


def test_block_pool_lru_eviction_prefers_uncached_then_oldest():
    pool = BlockPool(5)
    a, b, c = pool.allocate(3)
    pool.cache_full_block(a, 111, (1, 2), None)
    pool.cache_full_block(b, 222, (3, 4), None)
    pool.free([b])  # cached, older
    pool.free([a])  # cached, newer
    pool.free([c])  # uncached
    assert pool.num_free == 4 and pool.num_cached_free == 2
    first, second = pool.allocate(2)  # block 4 (never used) and c: the uncached ones
    assert {first.block_id, second.block_id} == {4, c.block_id}
    assert pool.lookup(111, (1, 2), None) is a and pool.lookup(222, (3, 4), None) is b
    (evicted,) = pool.allocate(1)
    assert evicted is b and pool.lookup(222, (3, 4), None) is None and pool.lookup(111, (1, 2), None) is a
    pool.touch([a])  # revival from the LRU
    assert a.ref_cnt == 1 and pool.num_free == 0
    pool.check_invariants({a.block_id: 1, first.block_id: 1, second.block_id: 1, b.block_id: 1})


def test_a_cached_block_is_a_hit_only_for_its_tokens_after_its_parent():
    pool = BlockPool(3)  # two usable blocks
    root, child = pool.allocate(2)
    pool.cache_full_block(root, 1, (1, 2), None)
    pool.cache_full_block(child, 2, (3, 4), root)
    assert pool.lookup(1, (1, 2), None) is root and pool.lookup(2, (3, 4), root) is child
    assert pool.lookup(1, (9, 9), None) is None, "the same key, other tokens"
    assert pool.lookup(2, (3, 4), None) is None, "the same key and tokens, another parent"
    pool.free([root, child])  # the root is the older: evicted first
    (reused,) = pool.allocate(1)
    assert reused is root and pool.lookup(1, (1, 2), None) is None
    pool.cache_full_block(reused, 1, (1, 2), None)  # the block holds new K/V now
    assert pool.lookup(1, (1, 2), None) is reused
    assert pool.lookup(2, (3, 4), reused) is None, "its child was computed after the evicted content"


def test_scheduler_output_is_msgpack_serialisable():
    from core_helpers import add, make_scheduler

    sched = make_scheduler()
    add(sched, "a", range(1, 10))
    plan = sched.schedule()
    frames = Encoder().encode(Step(plan))
    assert len(frames) == 2  # the prompt's token ids travel as their own frame
    again = Decoder(ToWorker).decode([bytes(f) for f in frames]).plan
    assert again.num_scheduled_tokens == {"a": 9}
    assert again.new_requests[0].block_ids == plan.new_requests[0].block_ids
    assert again.new_requests[0].token_ids.tolist() == list(range(1, 10))


@pytest.mark.parametrize("placement", ["lru", "first-fit", "best-fit"])
def test_free_block_policies_against_a_model_of_the_free_set(placement):
    """Random takes and puts: every policy hands out each free id once, and the fit policies
    keep their runs equal to the runs of the free set."""
    import random

    from pagedllm.core.scheduling.free_blocks import make_free_blocks, run_lengths

    rng = random.Random(7)
    free = make_free_blocks(placement, range(1, 200))
    model = set(range(1, 200))
    held: list[int] = []
    for _ in range(2000):
        if held and (rng.random() < 0.45 or len(model) < 10):
            block_id = held.pop(rng.randrange(len(held)))
            free.put(block_id)
            model.add(block_id)
        else:
            n = rng.randrange(1, 6)
            after = rng.choice(held) if held and rng.random() < 0.5 else None
            got = free.take(n, after)
            assert len(got) == n and set(got) <= model and len(set(got)) == n
            model -= set(got)
            held += got
        assert len(free) == len(model) and sorted(free) == sorted(model)
        if placement != "lru":
            assert sorted(free.runs()) == sorted(run_lengths(model))


def test_first_fit_and_best_fit_choose_their_runs():
    from pagedllm.core.scheduling.free_blocks import make_free_blocks

    # free runs: [1..2] (2), [5..9] (5), [12..14] (3)
    ids = [1, 2, 5, 6, 7, 8, 9, 12, 13, 14]
    assert make_free_blocks("first-fit", ids).take(3) == [5, 6, 7]  # the lowest run holding 3
    assert make_free_blocks("best-fit", ids).take(3) == [12, 13, 14]  # the smallest run holding 3
    assert make_free_blocks("best-fit", ids).take(2) == [1, 2]
    assert make_free_blocks("first-fit", ids).take(1, after=11) == [12]  # a table grows in place
    # none holds 7: the longest first, then the rest as any 2 would be placed
    assert make_free_blocks("best-fit", ids).take(7) == [5, 6, 7, 8, 9, 1, 2]


@pytest.mark.parametrize("placement,grows_into", [("lru", 5), ("first-fit", 12), ("best-fit", 12)])
def test_a_growing_table_continues_its_run_under_the_fit_policies(placement, grows_into):
    pool = BlockPool(32, placement)
    blocks = pool.allocate(11)
    assert [b.block_id for b in blocks] == list(range(1, 12))  # every policy starts from the low ids
    pool.free([blocks[i - 1] for i in (7, 3, 9, 1, 5)])  # churn: 5 was freed last
    (grown,) = pool.allocate(1, after=11)  # a table ending in block 11 grows
    assert grown.block_id == grows_into


def test_the_default_step_budget_and_the_gpu_profiling_step_stay_bounded(monkeypatch):
    """A 131k-context model must not get a 131k-token profiling prefill at start-up (quadratic
    in cuda-native: past the worker's start timeout); prompts past the budget are chunked."""
    import types

    from pagedllm.backends import worker
    from pagedllm.backends.gpu import memory
    from pagedllm.backends.gpu.platform import CudaPlatform
    from pagedllm.core.config import EngineConfig, default_batched_tokens

    assert [default_batched_tokens(n) for n in (512, 4096, 131072)] == [2048, 4096, 8192]
    seen = {}
    monkeypatch.setattr(memory, "profile_num_blocks", lambda *a: seen.setdefault("tokens", a[4]) and 100)
    fake = types.SimpleNamespace(
        config=EngineConfig(model="m"),
        model_config=types.SimpleNamespace(max_position_embeddings=131072),
        model=None,
        ops=CudaPlatform(),  # the CUDA backends' platform face: it profiles
        device="cuda",
    )
    worker.Worker._profile_num_blocks(fake, 64)
    assert seen["tokens"] == 8192
