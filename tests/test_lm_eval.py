"""lm-evaluation-harness against `pagedllm serve`, as docs/serving.md's recipe runs it: its
local-completions model (token-id prompts, echo and logprobs; the tokenizer read from the
server's /tokenizer_info, /tokenize and /detokenize) for loglikelihood, rolling loglikelihood
and generate-until tasks, and local-chat-completions for generate-until, scored equal to its
`hf` model on the same weights. The tasks are tests/lm_eval_tasks' (offline, json datasets)."""

from __future__ import annotations

from pathlib import Path

import pytest

from serve_helpers import ServerProcess

lm_eval = pytest.importorskip(
    "lm_eval", reason="lm-evaluation-harness is not installed (pip install 'lm_eval[api,hf]')"
)

TASKS = Path(__file__).parent / "lm_eval_tasks"
MAX_LENGTH = 256


@pytest.fixture(scope="module")
def served(tiny_model):
    model = tiny_model("llama")
    server = ServerProcess(
        model, "--enable-tokenizer-info-endpoint", "--max-model-len", str(MAX_LENGTH), "--zmq-endpoint", "none"
    )
    yield server, model
    server.stop()


def evaluate(lm, tasks: list[str], **kwargs) -> dict:
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(TASKS), include_defaults=False)
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, log_samples=True, **kwargs)


def hf_model(model: str) -> str:
    return f"pretrained={model},dtype=float32,max_length={MAX_LENGTH},device=cpu"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.chdir(TASKS)  # the tasks' data_files are relative
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_local_completions_scores_equal_the_hf_model(served):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    server, model = served
    tasks = ["tiny_choice", "tiny_perplexity", "tiny_generate"]
    lm = LocalCompletionsAPI(
        model=model, base_url=f"{server.url}/v1/completions", max_length=MAX_LENGTH, num_concurrent=1, max_retries=1
    )
    assert lm.tokenizer_backend == "remote"  # found the server's /tokenizer_info and /tokenize
    ours = evaluate(lm, tasks)
    theirs = evaluate("hf", tasks, model_args=hf_model(model), batch_size=1)

    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["tiny_choice"][metric] == theirs["results"]["tiny_choice"][metric]
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ours["results"]["tiny_perplexity"][metric] == pytest.approx(
            theirs["results"]["tiny_perplexity"][metric], rel=1e-4
        )
    for task in ("tiny_choice", "tiny_perplexity"):
        for mine, hf in zip(ours["samples"][task], theirs["samples"][task], strict=True):
            for a, b in zip(mine["resps"], hf["resps"], strict=True):
                a, b = a[0], b[0]
                if isinstance(a, tuple):  # (loglikelihood, is_greedy)
                    assert a[0] == pytest.approx(b[0], abs=1e-4) and a[1] == b[1]
                else:  # a rolling loglikelihood
                    assert a == pytest.approx(b, abs=1e-4)
    generated = [s["resps"] for s in ours["samples"]["tiny_generate"]]
    assert generated == [s["resps"] for s in theirs["samples"]["tiny_generate"]] and all(g[0][0] for g in generated)


def test_local_chat_completions_generates_what_the_hf_model_does_through_the_template(served):
    server, model = served
    args = f"model={model},base_url={server.url}/v1/chat/completions,num_concurrent=1,max_retries=1"
    ours = evaluate("local-chat-completions", ["tiny_generate"], model_args=args, apply_chat_template=True)
    theirs = evaluate("hf", ["tiny_generate"], model_args=hf_model(model), batch_size=1, apply_chat_template=True)
    generated = [s["resps"] for s in ours["samples"]["tiny_generate"]]
    assert generated == [s["resps"] for s in theirs["samples"]["tiny_generate"]] and all(g[0][0] for g in generated)
