"""The same workload through the peers, for comparison: transformers with static batches
(padding), transformers' own continuous batching, and vLLM in its own Python environment.
Only the tokens each request asked for count."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time

import torch

from pagedllm.core.model_folder import model_folder

from .peer_rounds import DONE, GO, READY


def _greedy_config(model, max_new_tokens: int):
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=model.config.bos_token_id,
    )


@torch.inference_mode()
def hf_static(model, prompts: list[list[int]], max_tokens: list[int], batch_size: int):
    """transformers generate() over fixed batches in arrival order; each batch runs until its
    longest request is done. Returns (seconds, useful output tokens, tokens per request)."""
    outputs: list[list[int]] = []
    warm = torch.tensor([prompts[0]], device=model.device)  # warm-up, as every system gets one
    model.generate(input_ids=warm, attention_mask=torch.ones_like(warm), generation_config=_greedy_config(model, 2))
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        wants = max_tokens[start : start + batch_size]
        width = max(map(len, batch))
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, p in enumerate(batch):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        out = model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            generation_config=_greedy_config(model, max(wants)),
        )
        for i, want in enumerate(wants):
            outputs.append(out[i, width : width + want].tolist())
    return time.perf_counter() - t0, outputs


@torch.inference_mode()
def hf_continuous(model, prompts: list[list[int]], max_tokens: list[int]):
    """transformers' continuous batching manager, each request with its own max_new_tokens."""
    cfg = _greedy_config(model, max(max_tokens))
    outputs: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=cfg, block=True, timeout=5) as manager:
        ids = [
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=m)
            for i, (p, m) in enumerate(zip(prompts, max_tokens))
        ]
        while len(outputs) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                outputs[result.request_id] = list(result.generated_tokens)
    seconds = time.perf_counter() - t0
    ordered = [outputs.get(f"r{i}", [])[:m] for i, m in enumerate(max_tokens)]
    return seconds, ordered


def vllm_process(
    python: str,
    model_dir: str,
    rounds: list[list[list[int]]],
    max_tokens: list[int],
    dtype: str,
    work_dir: str,
    kv_cache_gib: int = 2,
    max_num_seqs: int = 256,
    timeout_s: float = 1800,
) -> PeerProcess:
    """vLLM's LLM.generate on the same token ids (each round's prompts), run by `python` (an
    interpreter with vllm installed) through benchmarks/vllm_peer.py; its caches go under
    work_dir. Its result: seconds (a round each), outputs, startup_seconds, vllm_version."""
    context = model_folder(model_dir).max_position_embeddings
    job = _job(model_dir, dtype, rounds, max_tokens, max_num_seqs=max_num_seqs, max_model_len=context)
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}",  # all cores (it keeps one back by default)
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),  # GiB, allocated at start-up
        "VLLM_CACHE_ROOT": os.path.join(os.path.abspath(work_dir), "vllm-cache"),
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(os.path.abspath(work_dir), "inductor-cache"),
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    return PeerProcess("vLLM", python, "vllm_peer.py", job, work_dir, env, timeout_s)


# pagedllm's --quantization and llama.cpp's type of the same width
LLAMA_CPP_QUANTIZED_TYPES = {"int8": "Q8_0", "int4": "Q4_0"}


def llama_cpp_process(
    python: str,
    model_dir: str,
    rounds: list[list[list[int]]],
    max_tokens: list[int],
    dtype: str,
    work_dir: str,
    timeout_s: float = 3600,
    quantization: str | None = None,
) -> PeerProcess:
    """llama.cpp on the same token ids, run by `python` (an interpreter with llama-cpp-python
    and gguf installed) through benchmarks/llama_cpp_peer.py, which writes the weights as GGUF
    at `dtype` first (int8 and int4 `quantization` as Q8_0 and Q4_0). One request at a time
    (llama-cpp-python's Llama decodes one sequence). Its result: seconds (a round each),
    outputs, first_logits, startup_seconds, llama_cpp_version."""
    if quantization is not None and quantization not in LLAMA_CPP_QUANTIZED_TYPES:
        raise ValueError(f"llama.cpp has no counterpart of --quantization {quantization} here (int8: Q8_0, int4: Q4_0)")
    gguf = os.path.join(os.path.abspath(work_dir), f"model-{dtype}-{quantization or 'dense'}.gguf")
    job = _job(
        model_dir, dtype, rounds, max_tokens, gguf=gguf, threads=torch.get_num_threads(), quantization=quantization
    )
    return PeerProcess("llama.cpp", python, "llama_cpp_peer.py", job, work_dir, {}, timeout_s)


def _job(model_dir: str, dtype: str, rounds, max_tokens, **extra) -> dict:
    """A peer script's job: the model, the dtype, each round's prompts, and what that peer needs."""
    return {"model": os.path.abspath(model_dir), "dtype": dtype, "rounds": rounds, "max_tokens": max_tokens, **extra}


class PeerProcess:
    """benchmarks/SCRIPT under `python` (a peer's own environment) on the job, in work_dir, with
    `env` added to this one's (PYTHONPATH left out: nothing of this environment may leak into
    the peer's). Started, it loads and warms up; each run_round() runs one round of the job
    (peer_rounds.py says how the two sides take turns); result() waits for it to end. It is
    killed if it has not ended timeout_s after its start."""

    def __init__(self, name: str, python: str, script: str, job: dict, work_dir: str, env: dict, timeout_s: float):
        self.name, self.python = name, python
        work_dir = os.path.abspath(work_dir)
        os.makedirs(work_dir, exist_ok=True)
        stem = os.path.splitext(script)[0]
        job_path = os.path.join(work_dir, f"{stem}_job.json")
        self.result_path = os.path.join(work_dir, f"{stem}_result.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **env}
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), script)
        self.stderr = open(os.path.join(work_dir, f"{stem}_stderr.txt"), "w+")  # noqa: SIM115 - the peer's, while it runs
        self.proc = subprocess.Popen(
            [python, path, job_path, self.result_path],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            cwd=work_dir,
        )
        self.ready = False  # it said it is ready for a round
        self.timeout_s, self.timed_out = timeout_s, False
        self.deadline = threading.Timer(timeout_s, self._kill_late)
        self.deadline.daemon = True
        self.deadline.start()

    def _kill_late(self) -> None:
        self.timed_out = True
        self.proc.kill()

    def _failure(self, what: str, stderr: str = "") -> RuntimeError:
        late = f" (killed: not done within {self.timeout_s:.0f} s)" if self.timed_out else ""
        return RuntimeError(f"{self.name} ({self.python}) {what}{late}" + (f":\n{stderr}" if stderr else ""))

    def _line_starting(self, marker: str) -> str:
        """The peer's next stdout line that starts with `marker` (its libraries may print too)."""
        for line in self.proc.stdout:
            if line.startswith(marker):
                return line
        self.proc.wait()
        self.stderr.seek(0)
        raise self._failure(f"failed with code {self.proc.returncode}", self.stderr.read()[-3000:])

    def wait_ready(self) -> None:
        """Until it has loaded and warmed up, or finished its last round."""
        if not self.ready:
            self._line_starting(READY)
            self.ready = True

    def run_round(self) -> float:
        """One round, timed by the peer; returns when it is done."""
        self.wait_ready()
        self.ready = False
        self.proc.stdin.write(GO + "\n")
        self.proc.stdin.flush()
        return float(self._line_starting(DONE).split()[1])

    def result(self) -> dict:
        self.proc.stdin.close()
        code = self.proc.wait()
        self.deadline.cancel()
        self.stderr.close()
        if code != 0:
            raise self._failure(f"exited with code {code}")
        with open(self.result_path) as f:
            return json.load(f)

    def stop(self) -> None:
        self.deadline.cancel()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()
