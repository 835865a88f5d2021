"""Train the demo model that ships with pagedllm: a small Llama with a byte-level BPE tokenizer,
on English text that ships with Python itself (the pydoc topics and standard-library
docstrings). Plain torch training loop, seeded; writes a standard Hugging Face folder.

    python tools/train_demo_model.py --out assets/demo-model --minutes 20

Its draft model for speculative decoding (one layer, the demo model's tokenizer):

    python tools/train_demo_model.py --out assets/demo-draft --tokenizer assets/demo-model \
        --layers 1 --hidden 128 --minutes 12

Going on from a trained model, with copy lessons (random tokens, then the same again) in part
of each batch: `--init assets/demo-model --copy-fraction 0.5 --seq 512 --lr 8e-4`.

Held out from training (for the loss test): every 10th pydoc topic, in sorted order.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
import os
import random
import time

import torch

VOCAB = 4096
SEQ = 128
STDLIB_MODULES = [
    "argparse",
    "array",
    "ast",
    "asyncio",
    "base64",
    "bisect",
    "calendar",
    "cmd",
    "codecs",
    "collections",
    "colorsys",
    "concurrent.futures",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "dis",
    "email",
    "enum",
    "filecmp",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "getopt",
    "gettext",
    "glob",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "html",
    "http.client",
    "http.server",
    "imaplib",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "keyword",
    "linecache",
    "locale",
    "logging",
    "lzma",
    "mailbox",
    "math",
    "mimetypes",
    "numbers",
    "operator",
    "os",
    "pathlib",
    "pickle",
    "pkgutil",
    "platform",
    "plistlib",
    "poplib",
    "pprint",
    "queue",
    "quopri",
    "random",
    "re",
    "reprlib",
    "sched",
    "secrets",
    "selectors",
    "shelve",
    "shlex",
    "shutil",
    "signal",
    "smtplib",
    "socket",
    "socketserver",
    "sqlite3",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "token",
    "tokenize",
    "trace",
    "traceback",
    "types",
    "typing",
    "unittest",
    "urllib.parse",
    "urllib.request",
    "uuid",
    "warnings",
    "wave",
    "weakref",
    "xml.dom.minidom",
    "xml.etree.ElementTree",
    "zipfile",
    "zlib",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def pydoc_topics() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics

    return [(k, topics[k]) for k in sorted(topics)]


def held_out_texts() -> list[str]:
    return [text for i, (_, text) in enumerate(pydoc_topics()) if i % 10 == 0]


def training_texts() -> list[str]:
    texts = [text for i, (_, text) in enumerate(pydoc_topics()) if i % 10 != 0]
    for name in STDLIB_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        docs = [inspect.getdoc(module) or ""]
        for attr in sorted(dir(module)):
            if attr.startswith("_"):
                continue
            obj = getattr(module, attr, None)
            if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj):
                doc = inspect.getdoc(obj)
                if doc and len(doc) > 40:
                    docs.append(f"{attr}: {doc}")
        texts.append("\n\n".join(d for d in docs if d))
    return texts


def train_tokenizer(texts: list[str]):
    from pagedllm.fixtures.tokenizers import train_bpe

    return train_bpe(texts, VOCAB, CHAT_TEMPLATE)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="assets/demo-model")
    ap.add_argument("--minutes", type=float, default=20.0, help="training time budget")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256, help="hidden size (the MLP is 2.75x, heads 64 wide)")
    ap.add_argument("--tokenizer", help="a model folder whose tokenizer to use (a draft model's target)")
    ap.add_argument("--init", help="a model folder to go on training from (its weights and its tokenizer)")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=SEQ, help="training sequence length")
    ap.add_argument(
        "--copy-fraction",
        type=float,
        default=0.0,
        help="share of training sequences that are a span of random tokens followed by the same span again "
        "(to teach quoting: what speculative decoding's n-gram proposals pay on)",
    )
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    t0 = time.time()
    texts = training_texts()
    tokenizer_from = args.init or args.tokenizer
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from) if tokenizer_from else train_tokenizer(texts)
    eos = tokenizer.eos_token_id
    ids = []
    for text in texts:
        ids += tokenizer.encode(text) + [eos]
    data = torch.tensor(ids, dtype=torch.long)
    print(
        f"corpus: {len(texts)} texts, {sum(map(len, texts))} characters, {len(ids)} tokens; "
        f"tokenizer trained in {time.time() - t0:.0f} s"
    )

    if args.init:  # its shape is the saved one: --layers and --hidden do not apply
        model = LlamaForCausalLM.from_pretrained(args.init, dtype=torch.float32)
    else:
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=len(tokenizer),
                hidden_size=args.hidden,
                intermediate_size=args.hidden * 11 // 4,
                num_hidden_layers=args.layers,
                num_attention_heads=args.hidden // 64,
                num_key_value_heads=max(1, args.hidden // 128),
                max_position_embeddings=512,
                tie_word_embeddings=True,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=eos,
                pad_token_id=tokenizer.pad_token_id,
                rms_norm_eps=1e-5,
            )
        )
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.1f}M parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    batch, budget = args.batch, args.minutes * 60
    start, step, losses = time.time(), 0, []
    gen = torch.Generator().manual_seed(args.seed)
    model.train()
    while time.time() - start < budget:
        frac = (time.time() - start) / budget
        lr = args.lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        seq = args.seq
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[s : s + seq] for s in starts])
        # random tokens then the same tokens again: text from the corpus would not do, the model
        # recalls it from its weights instead of copying it. The span's length is drawn anew each
        # time (a fixed one would teach "look back so far" instead of "find the last match"); the
        # first span is no lesson, so it carries no loss.
        spans = torch.randint(seq // 16, seq // 2 + 1, (int(args.copy_fraction * batch),), generator=gen).tolist()
        for row, span in enumerate(spans):
            noise = torch.randint(3, len(tokenizer), (span,), generator=gen)  # past pad, bos, eos (0-2)
            x[row, :span] = x[row, span : 2 * span] = noise
        labels = x.clone()
        for row, span in enumerate(spans):
            labels[row, :span] = -100
        loss = model(input_ids=x, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
        if step % 50 == 0:
            print(
                f"step {step}: loss {sum(losses[-50:]) / 50:.3f}, lr {lr:.2e}, {time.time() - start:.0f} s", flush=True
            )
    model.eval()
    os.makedirs(args.out, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(
        f"trained {step} steps ({step * batch * args.seq} tokens) in {time.time() - start:.0f} s; "
        f"total {time.time() - t0:.0f} s; saved to {args.out}"
    )


if __name__ == "__main__":
    main()
