"""Runs llama.cpp (through llama-cpp-python) on a workload, inside its own Python environment:
writes the Hugging Face folder's weights as GGUF (the `gguf` package, at the requested dtype;
Llama-family models), then generates each request greedily from the same token ids. Imports
nothing from pagedllm or torch.

    LLAMA_CPP_PYTHON llama_cpp_peer.py IN.json OUT.json

IN.json:  {"model", "dtype": float32|bfloat16|float16, "quantization": null|int8|int4, "rounds":
           [[[token ids]]] (each round's prompts, of the same lengths), "max_tokens": [int], "gguf":
           where to write the GGUF file, "threads"}
OUT.json: {"llama_cpp_version", "startup_seconds", "seconds": [each round's], "outputs": [[token ids]]
           (the first round's), "first_logits": the first prompt's next-token logits, "one_at_a_time": true}

The KV cache is kept in the model's dtype (llama.cpp's default is float16), as pagedllm's `auto`
keeps it, so that both compute the same model; int8 and int4 weights are llama.cpp's own Q8_0
and Q4_0 (blocks of 32 with a scale each) of the decoder layers' projections, the embedding and
the LM head in the model's dtype, as pagedllm quantizes them.
Each round runs when the bench says (peer_rounds.py).

llama-cpp-python's Llama object decodes one sequence at a time, so the requests run one after
another: its batched number is that, not a batch.
"""

import json
import os
import struct
import sys
import time

import numpy as np
from peer_rounds import timed_rounds  # beside this script

SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}  # bfloat16 kept as its bits


def read_safetensors(folder: str) -> dict:
    """{name: array} of every *.safetensors file in the folder (bfloat16 as uint16 bits)."""
    tensors = {}
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(folder, name), "rb") as f:
            data = f.read()
        size = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8 : 8 + size])
        for key, info in header.items():
            if key == "__metadata__":
                continue
            start, end = info["data_offsets"]
            raw = data[8 + size + start : 8 + size + end]
            tensors[key] = np.frombuffer(raw, dtype=SAFETENSORS_DTYPES[info["dtype"]]).reshape(info["shape"])
    return tensors


def to_float32(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.uint16:  # bfloat16 bits
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def to_bfloat16(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.uint16:
        return a
    bits = a.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even


def rope_halves_to_pairs(w: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's q/k rows (rotate-half: each head's first and second halves pair up) in
    llama.cpp's order (adjacent rows pair up), as its own converter permutes them."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# llama.cpp's ggml types: the KV cache's, per model dtype
KV_TYPES = {"float32": 0, "float16": 1, "bfloat16": 30}
QUANTIZED_TYPES = {"int8": "Q8_0", "int4": "Q4_0"}
QUANTIZED_FILE_TYPES = {"int8": 7, "int4": 2}  # llama_ftype: MOSTLY_Q8_0, MOSTLY_Q4_0


def write_gguf(folder: str, dtype: str, path: str, quantization: str | None = None) -> None:
    import gguf

    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(theta))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_vocab_size(cfg["vocab_size"])
    file_type = {"float32": 0, "float16": 1, "bfloat16": 32}[dtype]
    w.add_file_type(QUANTIZED_FILE_TYPES[quantization] if quantization else file_type)
    _add_vocab(w, folder, cfg)
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for key, value in read_safetensors(folder).items():
        if key == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif key == "model.norm.weight":
            name = "output_norm.weight"
        elif key == "lm_head.weight":
            if cfg.get("tie_word_embeddings"):
                continue
            name = "output.weight"
        else:
            _, _, layer, rest = key.split(".", 3)
            name = f"blk.{layer}.{names[rest.removesuffix('.weight')]}.weight"
        if name.endswith("attn_q.weight"):
            value = rope_halves_to_pairs(value, heads)
        elif name.endswith("attn_k.weight"):
            value = rope_halves_to_pairs(value, kv_heads)
        if quantization and name.startswith("blk.") and value.ndim == 2:
            qtype = getattr(gguf.GGMLQuantizationType, QUANTIZED_TYPES[quantization])
            w.add_tensor(name, gguf.quants.quantize(to_float32(value), qtype), raw_dtype=qtype)
        elif value.ndim == 1 or dtype == "float32":  # norms stay float32, as llama.cpp's converter keeps them
            w.add_tensor(name, to_float32(value))
        elif dtype == "float16":
            w.add_tensor(name, to_float32(value).astype(np.float16))
        else:
            w.add_tensor(name, to_bfloat16(value), raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _add_vocab(w, folder: str, cfg: dict) -> None:
    """A byte-level BPE vocabulary (the requests are token ids: it only has to load)."""
    with open(os.path.join(folder, "tokenizer.json")) as f:
        tok = json.load(f)
    vocab = dict(tok["model"]["vocab"])
    special = set()
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        if added.get("special"):
            special.add(added["id"])
    size = max(cfg["vocab_size"], max(vocab.values()) + 1)
    tokens, types = [f"[PAD{i}]" for i in range(size)], [5] * size  # unused ids: placeholders
    for text, i in vocab.items():
        tokens[i], types[i] = text, 3 if i in special else 1
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id)):
        value = cfg.get(key)
        if isinstance(value, list):
            value = value[0]
        if value is not None:
            add(value)


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    t0 = time.monotonic()
    write_gguf(job["model"], job["dtype"], job["gguf"], job.get("quantization"))
    import llama_cpp

    context = max(len(p) + m for p, m in zip(job["rounds"][0], job["max_tokens"])) + 8
    llm = llama_cpp.Llama(
        model_path=job["gguf"],
        n_ctx=context,
        n_batch=512,
        n_threads=job["threads"],
        n_threads_batch=job["threads"],
        seed=0,
        type_k=KV_TYPES[job["dtype"]],
        type_v=KV_TYPES[job["dtype"]],
        verbose=False,
    )
    startup = time.monotonic() - t0

    def generate(prompt, max_tokens):
        out = []
        if max_tokens == 0:
            return out
        # greedy, no penalties; generate() goes on past EOS (the workload ignores EOS)
        for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(token)
            if len(out) == max_tokens:
                break
        return out

    first = job["rounds"][0][0]
    llm.reset()
    llm.eval(first)
    # the last position's logits (kept by llama.cpp's context: the Llama object keeps none
    # without logits_all), to check that both compute the same model
    last = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    first_logits = [float(last[i]) for i in range(llm.n_vocab())]
    generate(first, 2)  # warm-up, as the pagedllm side is warm
    seconds, outputs = timed_rounds(
        job["rounds"], lambda prompts: [generate(p, m) for p, m in zip(prompts, job["max_tokens"])]
    )
    with open(sys.argv[2], "w") as f:
        json.dump(
            {
                "llama_cpp_version": llama_cpp.__version__,
                "startup_seconds": startup,
                "seconds": seconds,
                "outputs": outputs,
                "first_logits": first_logits,
                "one_at_a_time": True,
            },
            f,
        )


if __name__ == "__main__":
    main()
