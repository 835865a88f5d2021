"""Runs vLLM on a workload, inside vLLM's own Python environment (vLLM's CPU build pins its own
torch and transformers, so it cannot share pagedllm's). Imports nothing from pagedllm.

    VLLM_PYTHON vllm_peer.py IN.json OUT.json

IN.json:  {"model", "dtype", "prompts": [[token ids]], "max_tokens": [int], "max_num_seqs",
           "max_model_len"}
OUT.json: {"vllm_version", "startup_seconds", "seconds", "outputs": [[token ids]]}
"""

import json
import sys
import time


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    t0 = time.monotonic()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        max_num_seqs=job["max_num_seqs"],
        max_model_len=job["max_model_len"],
        seed=0,
        enforce_eager=False,
    )
    startup = time.monotonic() - t0
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in job["max_tokens"]]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up, as the pagedllm side is warm
    start = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.monotonic() - start
    with open(sys.argv[2], "w") as f:
        json.dump(
            {
                "vllm_version": vllm.__version__,
                "startup_seconds": startup,
                "seconds": seconds,
                "outputs": [list(o.outputs[0].token_ids) for o in outs],
            },
            f,
        )


if __name__ == "__main__":  # vLLM spawns its workers: the guard is required
    main()
