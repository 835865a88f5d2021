"""LoRA adapters as PEFT saves them: read and checked against the base model (core/lora.py)
before any weight is loaded. Adapters are made by PEFT itself on the tiny test models, with
random weights; every bad one is refused naming the adapter and what is wrong."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import tempfile
import threading

import pytest
import zmq

from pagedllm.core.errors import InvalidParameter
from pagedllm.core.lora import TARGETS, LoRARequest, read_adapter
from pagedllm.core.model_folder import model_folder

from model_helpers import hf_greedy, random_prompt

peft = pytest.importorskip("peft")


def make_adapter(model_dir: str, out: str, r: int = 8, alpha: int = 16, targets=TARGETS, **config) -> str:
    """A PEFT LoRA adapter of `model_dir`, its B weights random (PEFT starts them at zero)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(r)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), **config))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    lora.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def adapter(llama, tmp_path_factory):
    return make_adapter(llama, str(tmp_path_factory.mktemp("lora") / "all"))


def read(model_dir: str, path: str, max_rank: int = 16):
    return read_adapter(LoRARequest("sql", 1, path), model_folder(model_dir).config, max_rank)


def test_an_adapter_peft_saved_is_read_with_its_rank_scale_and_modules(llama, adapter, tmp_path):
    spec = read(llama, adapter)
    layers = model_folder(llama).config["num_hidden_layers"]
    assert (spec.rank, spec.scale, spec.modules) == (8, 2.0, TARGETS)
    assert len(spec.tensors) == layers * len(TARGETS) * 2
    rslora = read(
        llama, make_adapter(llama, str(tmp_path / "rs"), r=16, alpha=8, targets=("q_proj", "v_proj"), use_rslora=True)
    )
    assert (rslora.rank, rslora.scale, rslora.modules) == (16, 2.0, ("q_proj", "v_proj"))  # 8 / sqrt(16)


def test_bad_adapters_are_refused_naming_the_adapter_and_the_problem(llama, adapter, tiny_model, tmp_path):
    def refused(path, max_rank=16, model=llama) -> str:
        with pytest.raises(InvalidParameter) as e:
            read(model, path, max_rank)
        assert e.value.field == "lora_request" and "'sql'" in str(e.value)
        return str(e.value)

    assert "no such folder" in refused(str(tmp_path / "nowhere"))
    assert "rank 8 is above max_lora_rank 4" in refused(adapter, max_rank=4)
    # another base: its projections' shapes are not this model's
    other = make_adapter(tiny_model("llama", hidden_size=48), str(tmp_path / "other"))
    assert re.search(r"has shape \[\d+, \d+\], the base model needs \[\d+, \d+\]", refused(other))
    head = make_adapter(llama, str(tmp_path / "head"), targets=("q_proj", "lm_head"))
    assert "target module 'lm_head' is not served" in refused(head)
    no_weights = shutil.copytree(adapter, tmp_path / "no-weights")
    os.remove(no_weights / "adapter_model.safetensors")
    assert "no adapter_model.safetensors" in refused(str(no_weights))
    for field, value, clue in (
        ("bias", "all", "bias 'all'"),
        ("use_dora", True, "DoRA"),
        ("modules_to_save", ["lm_head"], "modules_to_save"),
        ("peft_type", "IA3", "only LORA"),
    ):
        changed = shutil.copytree(adapter, tmp_path / field)
        cfg = json.loads((changed / "adapter_config.json").read_text())
        (changed / "adapter_config.json").write_text(json.dumps({**cfg, field: value}))
        assert clue in refused(str(changed)), field
    listed = shutil.copytree(adapter, tmp_path / "listed")
    (listed / "adapter_config.json").write_text("[1, 2]")
    assert "is not a JSON object" in refused(str(listed))
    torn = shutil.copytree(adapter, tmp_path / "torn")
    (torn / "adapter_model.safetensors").write_bytes(b"\x10\x00")
    assert "is not a safetensors file" in refused(str(torn))
    with pytest.raises(InvalidParameter, match="lora_int_id must be >= 1"):
        read_adapter(LoRARequest("x", 0, adapter), model_folder(llama).config, 16)


def peft_greedy(model_dir: str, adapter: str | None, prompts: list[list[int]], max_new: int, merged: bool = False):
    """transformers + PEFT's greedy tokens for each prompt under `adapter` (None: the base)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
        if merged:
            model = model.merge_and_unload()
    model.eval()
    with torch.no_grad():
        return [hf_greedy(model, p, max_new) for p in prompts]


def test_greedy_under_adapters_equals_peft_alone_and_mixed_with_the_base(llama, adapter, tmp_path):
    """Two adapters (ranks 8 and 16, different modules) and the base in one batch, each prompt
    under its own: transformers + PEFT's tokens, adapters unmerged and merged. The same prompt
    under another adapter shares no prefix-cache block with it; under the same one it does; KV
    events name each block's adapter."""
    import torch
    from test_beam_search import hf_beams
    from test_kv_events import CacheView

    from pagedllm import LLM, BeamSearchParams, LoRARequest, SamplingParams
    from pagedllm.core.process.ipc import free_tcp_port
    from pagedllm.fixtures.tiny_models import load_hf

    wide = make_adapter(
        llama, str(tmp_path / "wide"), r=16, alpha=8, targets=("q_proj", "v_proj", "o_proj", "down_proj")
    )
    first, second = LoRARequest("all", 1, adapter), LoRARequest("wide", 2, wide)
    prompts = [random_prompt(n, seed) for seed, n in enumerate((5, 23, 40, 9, 17))]
    chosen = [None, first, second, first, second]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    pub, replay = free_tcp_port(), free_tcp_port()
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}"}
    events["replay_endpoint"] = f"tcp://*:{replay}"
    with LLM(llama, enable_lora=True, max_loras=2, max_lora_rank=16, max_model_len=256, kv_events_config=events) as llm:
        view = CacheView(pub, replay)
        view.sub.setsockopt(zmq.SUBSCRIBE, b"")
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=chosen)
        got = [o.outputs[0].token_ids for o in outs]
        # the same 40-token prompt again: a hit under its own adapter, none under the other or the base
        again = llm.generate([prompts[2]] * 3, params, use_tqdm=False, lora_request=[second, first, None])
        assert [o.num_cached_tokens for o in again] == [32, 0, 0]
        assert again[0].outputs[0].token_ids == got[2]
        # KV events name the adapter each block was computed under (vLLM's lora_id, and lora_name)
        view.replay_missed()
        view.drain(0.2)
        view.close()
        assert set(view.loras.values()) == {(None, None), (1, "all"), (2, "wide")}
        with pytest.raises(InvalidParameter, match="each adapter needs its own id"):
            llm.generate([prompts[0]], params, lora_request=LoRARequest("other", 1, wide))
        with pytest.raises(InvalidParameter, match="rank 16 is above max_lora_rank 8"):
            read_adapter(LoRARequest("wide", 2, wide), model_folder(llama).config, 8)
        with pytest.raises(InvalidParameter, match="no such folder"):  # a bad adapter fails its request alone
            llm.generate([prompts[0]], params, lora_request=LoRARequest("gone", 3, str(tmp_path / "gone")))
        assert llm.generate([prompts[0]], params, use_tqdm=False)[0].outputs[0].token_ids == got[0]
        beams = llm.beam_search([prompts[4]], BeamSearchParams(beam_width=2, max_tokens=12), lora_request=second)
        beams = [s.tokens[len(prompts[4]) :] for s in beams[0].sequences]
    # one slot, one adapter in host memory: the adapters take turns (the scheduler admits one at
    # a time, the slot is reloaded from disk each time): the same tokens
    with LLM(llama, enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=16, max_model_len=256) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=chosen)
        assert [o.outputs[0].token_ids for o in outs] == got
    for path, merged in ((adapter, False), (wide, False), (wide, True)):
        rows = [i for i, c in enumerate(chosen) if c is not None and c.lora_path == path]
        assert [got[i] for i in rows] == peft_greedy(llama, path, [prompts[i] for i in rows], 8, merged), path
    with torch.no_grad():  # beams as transformers' generate(num_beams=2) finds them under the adapter
        assert beams == hf_beams(peft.PeftModel.from_pretrained(load_hf(llama), wide), prompts[4], 2)
    base = peft_greedy(llama, None, prompts, 8)
    assert got[0] == base[0]
    assert sum(got[i] != base[i] for i in range(1, 5)) >= 2  # the adapters change the tokens


def test_four_adapters_and_the_base_on_an_odd_shaped_model_equal_peft_and_tp2_equals_tp1(tiny_model, tmp_path):
    """Qwen2 with biases, 6 heads of 10 over 36 wide, one KV head (replicated on both ranks),
    an intermediate size of 54 (27 a rank): four adapters of ranks 8 and 16 over different
    modules and the base in one batch equal PEFT's, and each request alone gets what it got in
    the batch; two ranks (each adapter's A and B split as their base weights) give the tokens
    of one."""
    from pagedllm import LLM, LoRARequest, SamplingParams

    odd = tiny_model(
        "qwen2", hidden_size=36, num_attention_heads=6, num_key_value_heads=1, head_dim=10, intermediate_size=54
    )
    shapes = [
        (8, TARGETS),
        (16, TARGETS),
        (8, ("k_proj", "o_proj", "up_proj")),
        (16, ("q_proj", "v_proj", "gate_proj", "down_proj")),
    ]
    adapters = [
        LoRARequest(f"a{i}", i + 1, make_adapter(odd, str(tmp_path / f"a{i}"), r=r, alpha=2 * r, targets=t))
        for i, (r, t) in enumerate(shapes)
    ]
    prompts = [random_prompt(n, seed) for seed, n in enumerate((7, 19, 33, 12, 26, 5))]
    chosen = [adapters[0], None, adapters[1], adapters[2], adapters[3], adapters[0]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = {}
    for tp in (1, 2):
        with LLM(
            odd, enable_lora=True, max_loras=4, max_lora_rank=16, max_model_len=128, tensor_parallel_size=tp
        ) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=chosen)
            got[tp] = [o.outputs[0].token_ids for o in outs]
            if tp == 1:  # each request alone: what it got in the mixed batch
                for prompt, lora, tokens in zip(prompts, chosen, got[1]):
                    alone = llm.generate([prompt], params, use_tqdm=False, lora_request=lora)
                    assert alone[0].outputs[0].token_ids == tokens
    assert got[2] == got[1]
    for lora in adapters:
        rows = [i for i, c in enumerate(chosen) if c is lora]
        assert [got[1][i] for i in rows] == peft_greedy(odd, lora.lora_path, [prompts[i] for i in rows], 8), lora
    base = peft_greedy(odd, None, prompts, 8)
    assert got[1][1] == base[1]
    assert sum(got[1][i] != base[i] for i in (0, 2, 3, 4, 5)) >= 3  # the adapters change the tokens


def test_the_demo_model_under_adapters_of_rank_8_and_16_equals_peft():
    """The shipped demo model (computed in float32, as transformers is here) under four adapters
    of ranks 8 and 16 over different modules, beside the base in one batch, and each request
    alone: PEFT's tokens (one adapter merged into the weights too)."""
    from pagedllm import LLM, LoRARequest, SamplingParams
    from pagedllm.entrypoints.default_model import shipped_model_dir

    demo = shipped_model_dir()
    if not os.path.isfile(os.path.join(demo, "config.json")):
        pytest.skip("the demo model is not in this checkout")
    shapes = [(8, TARGETS), (16, TARGETS[:4]), (8, TARGETS[4:]), (16, ("q_proj", "v_proj", "down_proj"))]
    prompts = [random_prompt(n, seed, vocab=4096) for seed, n in enumerate((11, 30, 20, 7, 16))]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [
            LoRARequest(f"a{i}", i + 1, make_adapter(demo, f"{tmp}/a{i}", r=r, alpha=16, targets=t))
            for i, (r, t) in enumerate(shapes)
        ]
        chosen = [adapters[0], adapters[1], None, adapters[2], adapters[3]]
        with LLM(demo, dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16, max_model_len=128) as llm:
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False, lora_request=chosen)]
            for prompt, lora, tokens in zip(prompts, chosen, got):
                assert (
                    llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids == tokens
                )
        for i, lora in enumerate(chosen):
            if lora is not None:
                assert [got[i]] == peft_greedy(demo, lora.lora_path, [prompts[i]], 10, merged=i == 4), lora
    base = peft_greedy(demo, None, prompts, 10)
    assert got[2] == base[2] and sum(got[i] != base[i] for i in (0, 1, 3, 4)) >= 3


def test_adapters_are_refused_where_the_engine_does_not_serve_them(llama, adapter):
    from pagedllm import LLM, LoRARequest, SamplingParams

    with LLM(llama, max_model_len=64) as llm, pytest.raises(InvalidParameter, match="started with enable_lora"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), lora_request=LoRARequest("all", 1, adapter))
    for options, clue in (
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative decoding"),
        ({"max_loras": 2, "max_cpu_loras": 1}, "max_cpu_loras"),
    ):
        with pytest.raises(InvalidParameter, match=clue):
            LLM(llama, enable_lora=True, **options)


def test_adapters_through_the_openai_api_named_listed_loaded_and_unloaded(llama, adapter, tmp_path):
    """`--lora-modules` names an adapter; another is loaded at run time (vLLM's endpoints, on
    with VLLM_ALLOW_RUNTIME_LORA_UPDATING); the base and both adapters stream at once, each its
    own tokens (transformers + PEFT's); an unknown or unloaded adapter is a 404 naming it."""
    import openai

    from pagedllm.entrypoints.zmq_client import ZmqClient, ZmqRequestError

    from serve_helpers import ServerProcess, client, post, post_text

    wide = make_adapter(
        llama, str(tmp_path / "wide"), r=16, alpha=8, targets=("q_proj", "v_proj", "o_proj", "down_proj")
    )

    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}
    server = ServerProcess(llama, "--enable-lora", "--max-loras", "2", "--lora-modules", f"all={adapter}", env=env)
    try:
        api = client(server)
        models = {m.id: m for m in api.models.list().data}
        assert set(models) == {llama, "all"} and models["all"].model_extra["parent"] == llama
        assert post_text(server, "/v1/load_lora_adapter", {"lora_name": "wide", "lora_path": wide}) == (
            200,
            "Success: LoRA adapter 'wide' added successfully.",
        )
        status, text = post_text(server, "/v1/load_lora_adapter", {"lora_name": "wide", "lora_path": wide})
        assert status == 400 and "already been loaded" in text
        status, text = post_text(
            server, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(tmp_path / "nowhere")}
        )
        assert status == 400 and "no such folder" in text
        prompt = random_prompt(23, 1)
        extra = {"ignore_eos": True, "return_token_ids": True, "temperature": 0}
        names = (llama, "all", "wide")
        streams = [
            api.completions.create(model=m, prompt=prompt, max_tokens=8, stream=True, extra_body=extra) for m in names
        ]
        texts = ["".join(c.choices[0].text for c in s if c.choices) for s in streams]
        whole = [
            post(server, "/v1/completions", {"model": m, "prompt": prompt, "max_tokens": 8, **extra})[1] for m in names
        ]
        assert [w["model"] for w in whole] == list(names)
        assert texts == [w["choices"][0]["text"] for w in whole]
        tokens = [w["choices"][0]["token_ids"] for w in whole]
        assert tokens == [peft_greedy(llama, path, [prompt], 8)[0] for path in (None, adapter, wide)]
        with pytest.raises(openai.NotFoundError, match="'nope'"):
            api.completions.create(model="nope", prompt=prompt, max_tokens=2)
        assert post_text(server, "/v1/unload_lora_adapter", {"lora_name": "wide"})[0] == 200
        assert post_text(server, "/v1/unload_lora_adapter", {"lora_name": "wide"})[0] == 404
        with pytest.raises(openai.NotFoundError, match="'wide'"):
            api.completions.create(model="wide", prompt=prompt, max_tokens=2)
        assert {m.id for m in api.models.list().data} == {llama, "all"}
        # the ZMQ entrypoint: params.lora, vLLM's LoRARequest as a map
        with ZmqClient(server.zmq_endpoint, timeout_s=30) as zc:
            lora = {"lora_name": "wide", "lora_int_id": 7, "lora_path": wide}
            final = zc.generate(prompt_token_ids=prompt, max_tokens=8, temperature=0, ignore_eos=True, lora=lora)
            assert final.completions[0].token_ids == tokens[2]
            with pytest.raises(ZmqRequestError) as e:
                zc.generate(
                    prompt_token_ids=prompt, max_tokens=2, lora={**lora, "lora_int_id": 8, "lora_path": str(tmp_path)}
                )
            assert e.value.code == 400 and e.value.field == "params.lora" and "no adapter_config.json" in str(e.value)
    finally:
        server.stop()


def test_adapters_through_int8_weights_and_kv_preemption_both_ways_n_samples_and_a_worker_kill(
    llama, adapter, tmp_path
):
    """Where LoRA meets the engine's other features: int8 base weights and an int8 KV cache, a
    pool small enough to preempt (swap, then recompute), prompts sharing a prefix under different
    adapters, n = 2 seeded samples and a choice constraint, a worker killed mid-run: every token
    as a roomy pool gives them (the cpu backend's batch invariance makes that exact)."""
    from pagedllm import LLM, LoRARequest, SamplingParams, StructuredOutputsParams

    from proc_helpers import workers_of

    wide = make_adapter(
        llama, str(tmp_path / "wide"), r=16, alpha=8, targets=("q_proj", "v_proj", "o_proj", "down_proj")
    )
    first, second = LoRARequest("all", 1, adapter), LoRARequest("wide", 2, wide)
    shared = list(range(5, 53))
    prompts = [shared + [60 + i] * (i + 1) for i in range(9)] + [[7 + i] * 30 for i in range(3)]
    chosen = [(None, first, second)[i % 3] for i in range(len(prompts))]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, n=2, seed=3, max_tokens=12, ignore_eos=True)
    choice = SamplingParams(
        temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["left", "right", "up"])
    )
    common = dict(enable_lora=True, max_loras=2, kv_cache_dtype="int8", quantization="int8", max_model_len=256)

    def run(llm):
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False, lora_request=chosen)]
        samples = llm.generate(prompts[:3], sampled, use_tqdm=False, lora_request=chosen[:3])
        out += [c.token_ids for o in samples for c in o.outputs]
        picks = llm.generate(["Pick:"] * 3, choice, use_tqdm=False, lora_request=[None, first, second])
        return out + [o.outputs[0].text for o in picks]

    with LLM(llama, **common) as llm:
        expected = run(llm)
    assert {t for t in expected[-3:]} <= {"left", "right", "up"}
    for mode in ("swap", "recompute"):
        tight = dict(num_kv_blocks=24, preemption_mode=mode, max_num_batched_tokens=128, max_worker_restarts=2)
        with LLM(llama, **common, **tight, **({"swap_space": 0.01} if mode == "swap" else {})) as llm:
            assert run(llm) == expected, mode
            stats = llm.last_stats.scheduler
            assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, mode
            if mode == "recompute":  # a worker killed while the adapters' requests run
                victim = workers_of(llm.engine.pid, llm.engine.ready.launcher_pid)[0]
                threading.Timer(0.3, os.kill, (victim, signal.SIGKILL)).start()
                assert run(llm) + run(llm) == expected + expected
                assert llm.last_stats.worker_restarts >= 1


def test_the_benchmarks_adapters_are_what_peft_saves(llama, tmp_path):
    """benchmarks/bench_lora.py writes its random adapters without PEFT: they read as PEFT's do."""
    from pagedllm.benchmarks.bench_lora import write_adapter

    spec = read(llama, write_adapter(llama, str(tmp_path / "bench"), seed=0), max_rank=16)
    assert (spec.rank, spec.scale, spec.modules) == (16, 2.0, TARGETS)
