"""Runs vLLM on a workload, inside vLLM's own Python environment (vLLM's CPU build pins its own
torch and transformers, so it cannot share pagedllm's). Imports nothing from pagedllm.

    VLLM_PYTHON vllm_peer.py IN.json OUT.json

IN.json:  {"model", "dtype", "rounds": [[[token ids]]] (each round's prompts, of the same
           lengths), "max_tokens": [int], "max_num_seqs", "max_model_len"}
OUT.json: {"vllm_version", "startup_seconds", "seconds": [each round's], "outputs": [[token ids]]
           (the first round's)}
Each round runs when the bench says (peer_rounds.py).
"""

import json
import sys
import time

from peer_rounds import timed_rounds  # beside this script


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
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in job["max_tokens"]]

    def generate(token_ids):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in token_ids], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    warm = [TokensPrompt(prompt_token_ids=p) for p in job["rounds"][0][:2]]
    llm.generate(warm, params[:2], use_tqdm=False)  # warm-up, as the pagedllm side is warm
    seconds, outputs = timed_rounds(job["rounds"], generate)
    with open(sys.argv[2], "w") as f:
        json.dump(
            {
                "vllm_version": vllm.__version__,
                "startup_seconds": startup,
                "seconds": seconds,
                "outputs": outputs,
            },
            f,
        )


if __name__ == "__main__":  # vLLM spawns its workers: the guard is required
    main()
