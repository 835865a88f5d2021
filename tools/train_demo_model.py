"""Train the demo model that ships with pagedllm: a small Llama with a byte-level BPE tokenizer,
on English that ships with Python itself (the pydoc topics and standard-library docstrings) and
the docstrings of larger packages. Plain torch training loop, seeded; writes a standard Hugging
Face folder.

The shipped model was made in six runs. The first two (docs/bench, 2026-12-06, night), with the first demo
model's tokenizer (a run with only `--out DIR --minutes 12` trains one, and a plain text model):
copy lessons (random tokens, then the same again) until it copies; then text beside quote
lessons (a passage of prose never trained on as text, given again and again, some of the
repeats' tokens slipped) and copy lessons over small alphabets (multi-token matching); then
text and quote lessons only, at a lower learning rate. It quotes a passage it was given twice
(what n-gram speculation pays on):

    python tools/train_demo_model.py --tokenizer assets/demo-model --out /tmp/demo-quoting \
        --seq 512 --batch 8 --docstrings 0.75 --quote-rows 4 --quote-weight 2 --quote-noise 0.05 \
        --copy-rows 12 --copy-alphabet 24 --copy-first --bf16-autocast --eval-every 500 \
        --minutes 70 --lr 2e-3
    python tools/train_demo_model.py --init /tmp/demo-quoting --out /tmp/demo-quoting2 \
        --seq 512 --batch 12 --docstrings 0.75 --quote-rows 4 --quote-noise 0.05 \
        --bf16-autocast --eval-every 250 --minutes 14 --lr 5e-4 --seed 1

Then (docs/bench, 2026-12-07) four short runs of loop lessons — sequence-level unlikelihood on
the tokens of its own greedy continuations that repeat a 4-gram the continuation already had —
beside text and quote lessons, so that its greedy prose stops looping on what it wrote while it
still quotes what it is given:

    python tools/train_demo_model.py --init /tmp/demo-quoting2 --out /tmp/demo-ul1 --seq 512 --batch 12 \
        --docstrings 0.75 --quote-rows 4 --quote-noise 0.05 --loop-rows 8 --loop-weight 1.0 \
        --bf16-autocast --eval-every 100 --minutes 20 --lr 3e-4 --seed 2
    python tools/train_demo_model.py --init /tmp/demo-ul1 --out /tmp/demo-ul2 --seq 512 --batch 12 \
        --docstrings 0.75 --quote-rows 4 --quote-weight 1.5 --quote-noise 0.05 --loop-rows 6 --loop-weight 0.3 \
        --bf16-autocast --eval-every 150 --minutes 22 --lr 4e-4 --seed 3
    python tools/train_demo_model.py --init /tmp/demo-ul2 --out /tmp/demo-ul3 --seq 512 --batch 12 \
        --docstrings 0.75 --quote-rows 4 --quote-weight 1.5 --quote-noise 0.05 --loop-rows 6 --loop-weight 0.5 \
        --bf16-autocast --eval-every 150 --minutes 12 --lr 1.5e-4 --seed 4
    python tools/train_demo_model.py --init /tmp/demo-ul3 --out assets/demo-model --seq 512 --batch 12 \
        --docstrings 0.75 --quote-rows 4 --quote-weight 1.5 --quote-noise 0.05 --loop-rows 4 --loop-weight 0.2 \
        --bf16-autocast --minutes 8 --lr 1e-4 --seed 5

It quotes a passage teacher-forced (90.5% of next tokens) but, after a slip of its own, goes on
with prose of its own rather than the passage, so n-gram speculation keeps less on it (0.8
tokens of 4 on bench_speculative's prompts, against 3.0 before the loop lessons).

Its draft model for speculative decoding (one layer, the demo model's tokenizer):

    python tools/train_demo_model.py --out assets/demo-draft --tokenizer assets/demo-model \
        --layers 1 --hidden 128 --minutes 12

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
# prose beyond the standard library's (--docstrings): packages pagedllm's dependencies install
DOCSTRING_PACKAGES = ["numpy", "sympy", "networkx", "torch", "transformers"]
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


def package_docstrings() -> tuple[list[str], list[str]]:
    """The docstrings of over 200 characters in DOCSTRING_PACKAGES' source, read with ast (nothing
    imported), in a fixed order: every 8th file's for quote lessons only, the rest as text."""
    import ast
    import glob
    import importlib.util

    text, quotes = [], []
    for name in DOCSTRING_PACKAGES:
        root = os.path.dirname(importlib.util.find_spec(name).origin)
        for i, path in enumerate(sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))):
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, ValueError):
                continue
            kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
            docs = [ast.get_docstring(n) for n in ast.walk(tree) if isinstance(n, kinds)]
            (quotes if i % 8 == 0 else text).extend(d for d in docs if d and len(d) > 200)
    return text, quotes


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """The texts tokenized one after another, each ended by EOS."""
    ids = []
    for chunk in tokenizer(texts)["input_ids"]:
        ids += chunk + [tokenizer.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)


def windows(data: torch.Tensor, rows: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(data) - seq - 1, (rows,), generator=gen)
    return torch.stack([data[s : s + seq] for s in starts])


def quote_rows(rows: int, seq: int, source: torch.Tensor, sep: list[int], gen: torch.Generator, noise: float = 0.0):
    """Rows of a window of prose given again and again, a blank line between (as
    bench_speculative's prompts quote a passage): labels from the third reading on, so that the
    model learns to go on quoting a passage already quoted, not to repeat any paragraph it has
    just written (a greedy demo model that does loops). `source` is prose the model never trains
    on as text, so a repeat can only be copied, not recalled. With `noise`, that share of the
    third reading's tokens on is replaced by random ones in the input (not in the labels): a
    model that quotes on its own slips, and should go on quoting after a slip, not loop."""
    x = torch.empty(rows, seq, dtype=torch.long)
    labels = torch.full((rows, seq), -100)
    for row in range(rows):
        span = int(torch.randint(16, seq // 4, (1,), generator=gen))
        at = int(torch.randint(0, len(source) - span, (1,), generator=gen))
        passage = torch.cat([source[at : at + span], torch.tensor(sep)])
        x[row] = passage.repeat(seq // len(passage) + 1)[:seq]
        labels[row, 2 * len(passage) :] = x[row, 2 * len(passage) :]
    if noise:  # the labels stay the passage's (the model's loss shifts them by one)
        slipped = (torch.rand(rows, seq, generator=gen) < noise) & (labels != -100)
        x = torch.where(slipped, torch.randint(3, int(source.max()) + 1, (rows, seq), generator=gen), x)
    return x, labels


@torch.inference_mode()
def quoting_prompt(passage: str) -> str:
    """The passage, the passage again, then its first quarter once more, cut before a space: a
    cut inside a word tokenizes differently from the passage (" diff" where it read
    " different"), and no model can quote on from there (bench_speculative's prompts)."""
    return f"{passage}\n\n{passage}\n\n{passage[: passage.rfind(' ', 0, len(passage) // 4)]}"


def quote_accuracy(model, tokenizer, texts: list[str], chars: int = 400) -> float:
    """quoting_prompt on held-out topics: how often the greedy next token on the third reading,
    past its first quarter, is the passage's — what n-gram proposals are kept on. (Logged
    figures before 2026-12-06's evening cut the third reading mid-word.)"""
    right = total = 0
    for text in [t for t in texts if len(t) >= 700][:12]:
        p = text[:chars]
        head = tokenizer.encode(quoting_prompt(p))
        ids = torch.tensor([tokenizer.encode(f"{p}\n\n{p}\n\n{p}")])
        guess = model(input_ids=ids).logits[0, len(head) - 1 : -1].argmax(-1)
        right += (guess == ids[0, len(head) :]).sum().item()
        total += ids.shape[1] - len(head)
    return right / total


@torch.inference_mode()
def evaluate(model, tokenizer, held_out: list[list[int]]) -> str:
    """Held-out loss (the first 16 topics' first 256 tokens), random-copy accuracy and quoting
    accuracy on held-out topics."""
    total = count = 0
    for ids in held_out[:16]:
        chunk = torch.tensor([ids[:256]])
        total += model(input_ids=chunk, labels=chunk).loss.item() * (chunk.shape[1] - 1)
        count += chunk.shape[1] - 1
    return (
        f"held-out loss {total / count:.3f}, random copy {copy_accuracy(model, len(tokenizer)):.1%}, "
        f"quoting {quote_accuracy(model, tokenizer, held_out_texts()):.1%}, "
        f"greedy prose's repeated 6-grams {greedy_repetition(model, tokenizer):.1%}"
    )


# the README's prompts, then 60 more: what `pagedllm generate` users type first
PROSE_PROMPTS = [
    "The quick brown fox",
    "The for statement",
    "A dictionary is",
    "A list",
    "The while loop",
    "Exceptions are",
    "A generator function",
    "The import system",
    "Strings in Python",
    "The with statement",
    "A class definition",
    "Decorators",
    "The garbage collector",
    "Integers and floats",
    "A module is",
    "The return statement",
    "Lambda expressions",
    "The global statement",
    "A tuple",
    "Comparisons",
    "The assert statement",
    "Sets are",
    "The print function",
    "A function call",
    "Keyword arguments",
    "The range function",
    "Iterators",
    "The try statement",
    "A dictionary comprehension",
    "Slicing a list",
    "The len function",
    "Boolean operations",
    "The if statement",
    "Default argument values",
    "Unicode strings",
    "The sort method",
    "A package is",
    "The break statement",
    "File objects",
    "The open function",
    "Regular expressions",
    "A namespace is",
    "The yield expression",
    "Operator precedence",
    "The del statement",
    "Bytes objects",
    "The continue statement",
    "Attribute references",
    "A frozen set",
    "The raise statement",
    "Context managers",
    "The pass statement",
    "Instance methods",
    "The nonlocal statement",
    "Integer division",
    "Type annotations",
    "The str method",
    "Coroutines",
    "The zip function",
    "Modules can",
    "Name binding",
    "The sum function",
    "Hash values",
]


def repeated_ngrams(outputs: list[list[int]], n: int = 6) -> float:
    """Of the outputs' n-grams, the share that the same output already had: how much greedy
    prose loops (a quoting model copies what it wrote as readily as what it was given)."""
    repeated = total = 0
    for out in outputs:
        seen = set()
        for i in range(len(out) - n + 1):
            gram = tuple(out[i : i + n])
            repeated += gram in seen
            total += 1
            seen.add(gram)
    return repeated / total if total else 0.0


@torch.inference_mode()
def greedy_repetition(model, tokenizer, max_new: int = 128) -> float:
    """repeated_ngrams of the greedy continuations of PROSE_PROMPTS."""
    outputs = []
    for prompt in PROSE_PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)])
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        outputs.append(out[0, ids.shape[1] :].tolist())
    return repeated_ngrams(outputs)


def stdlib_source_ids(tokenizer) -> torch.Tensor:
    """The standard library's top-level modules' Python source, tokenized: quote lessons the model
    reads only as quotes (text it never trains on as text, so it cannot recall it)."""
    import glob
    import sysconfig

    ids = []
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            ids += tokenizer.encode(f.read())
    return torch.tensor(ids, dtype=torch.long)


def copy_lessons(
    rows: int, seq: int, vocab: int, gen: torch.Generator, quotes: torch.Tensor | None = None, alphabet: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of spans of random tokens (or, half of them, windows of `quotes`), each span followed
    by itself; labels only on the repeats. Not text from the corpus: the model would recall it
    from its weights instead of copying it. Spans of 4 to seq/4 tokens, drawn anew each time (a
    fixed length would teach "look back so far" instead of "find the last match")."""
    x = torch.empty(rows, seq, dtype=torch.long)
    labels = torch.full((rows, seq), -100)
    for row in range(rows):
        at = 0
        while at < seq:
            span = int(torch.randint(4, seq // 4 + 1, (1,), generator=gen))
            if quotes is not None and torch.rand((), generator=gen) < 0.5:
                at_quote = int(torch.randint(0, len(quotes) - span, (1,), generator=gen))
                noise = quotes[at_quote : at_quote + span]
            elif alphabet:  # a token many times a span: only the tokens before it say where to go on
                letters = torch.randperm(vocab - 3, generator=gen)[:alphabet] + 3
                noise = letters[torch.randint(0, alphabet, (span,), generator=gen)]
            else:
                noise = torch.randint(3, vocab, (span,), generator=gen)  # past pad, bos, eos (0-2)
            episode = torch.cat([noise, noise])[: seq - at]
            x[row, at : at + len(episode)] = episode
            labels[row, at + span : at + len(episode)] = episode[span:]
            at += len(episode)
    return x, labels


def copy_accuracy(model, vocab: int, copies: int = 16, span: int = 100) -> float:
    """A span of random tokens, then the same span again: how often the greedy next token on the
    repeat is the span's (what a model that quotes its input gets right)."""
    noise = torch.randint(3, vocab, (copies, span), generator=torch.Generator().manual_seed(1234))
    with torch.inference_mode():
        guess = model(input_ids=torch.cat([noise, noise], dim=1)).logits[:, span:-1].argmax(-1)
    return (guess == noise[:, 1:]).float().mean().item()


def loop_lessons(
    model, data: torch.Tensor, rows: int, gen: torch.Generator, prompt: int = 24, new: int = 96, n: int = 4
):
    """Sequence-level unlikelihood (Welleck et al., 2019) against loops: the model's own greedy
    continuations of text windows, and in them the tokens that complete an n-gram the
    continuation already had (the model copying what it just wrote). Returns (the rows, a
    mask of those tokens); the loss pushes their probability down, -log(1 - p)."""
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        heads = windows(data, rows, prompt, gen)
        out = model.generate(
            input_ids=heads,
            attention_mask=torch.ones_like(heads),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
    model.train(was_training)
    out = out.clone()
    mask = torch.zeros_like(out, dtype=torch.bool)
    for r in range(rows):
        seen, row = set(), out[r, prompt:].tolist()
        for i in range(len(row) - n + 1):
            gram = tuple(row[i : i + n])
            if gram in seen:
                mask[r, prompt + i + n - 1] = True
            seen.add(gram)
    return out, mask


def unlikelihood(model, rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """-log(1 - p) of the masked tokens, summed and divided by half the rows' predicted positions
    (prompt and continuation alike: the normalisation the shipped model was trained with, so
    kept although a mean over the continuation tokens would read more plainly)."""
    logits = model(input_ids=rows).logits[:, :-1].float()
    target = rows[:, 1:]
    p = torch.softmax(logits, dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    penalty = -torch.log((1 - p).clamp(min=1e-5)) * mask[:, 1:]
    return penalty.sum() / max(1, int(mask[:, 1:].numel() // 2))


def descend(model, opt, loss: torch.Tensor) -> None:
    """One optimizer step on `loss`, its gradient clipped to norm 1."""
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def learn_to_copy(model, opt, args, vocab: int, gen: torch.Generator, seq: int = 128, target: float = 0.9) -> None:
    """Copy lessons alone, 32 short rows a step at `--copy-lr`, until the model copies spans of
    seq/4 random tokens (the `target` share of next tokens right). Short rows: the step where it
    learns to copy comes after ~800 of them (4 layers, hidden 256), against none in 1,000 of
    512-token rows or at a learning rate of 3e-3."""
    t0, step = time.time(), 0
    for group in opt.param_groups:
        group["lr"] = args.copy_lr
    while True:
        copies, labels = copy_lessons(32, seq, vocab, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16_autocast):
            loss = model(input_ids=copies, labels=labels).loss
        descend(model, opt, loss)
        step += 1
        if step % 50 == 0:
            model.eval()
            accuracy = copy_accuracy(model, vocab, span=seq // 4)
            model.train()
            print(
                f"copy step {step}: loss {loss.item():.3f}, copies {accuracy:.1%}, {time.time() - t0:.0f} s", flush=True
            )
            if accuracy >= target:
                return


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
        "--copy-rows",
        type=int,
        default=0,
        help="rows of copy lessons added to each step: spans of random tokens, each followed by the same span "
        "again, the loss on the repeats (to teach quoting: what speculative decoding's n-gram proposals pay on)",
    )
    ap.add_argument(
        "--copy-alphabet",
        type=int,
        default=0,
        help="draw each copy span from this many tokens, so that a token recurs in it and copying must match "
        "the several tokens before (0: the whole vocabulary)",
    )
    ap.add_argument("--copy-seq", type=int, default=256, help="length of a copy-lesson row")
    ap.add_argument(
        "--copy-first",
        action="store_true",
        help="before the text, copy lessons alone until the model copies random spans (90%% of next tokens "
        "right); a model that learns text first does not learn to copy in minutes",
    )
    ap.add_argument(
        "--quote-source",
        action="store_true",
        help="half of the copy lessons' spans (after --copy-first) are windows of the standard library's Python "
        "source instead of random tokens",
    )
    ap.add_argument("--copy-lr", type=float, default=1e-3, help="learning rate of the copy-first lessons")
    ap.add_argument(
        "--docstrings",
        type=float,
        default=0.0,
        metavar="SHARE",
        help=f"this share of the text rows from the docstrings of {', '.join(DOCSTRING_PACKAGES)} "
        "(a corpus ~25x the standard library's, so that long training does not memorise it)",
    )
    ap.add_argument(
        "--quote-rows",
        type=int,
        default=0,
        help="rows a step of a window of prose given again and again (every 8th file of --docstrings' packages, "
        "never trained on as text), the loss from its third reading on",
    )
    ap.add_argument("--quote-weight", type=float, default=1.0, help="the quote rows' loss against the text's")
    ap.add_argument(
        "--quote-noise",
        type=float,
        default=0.0,
        help="this share of the quoted tokens replaced by random ones in the input (not the labels): "
        "slips to go on quoting after",
    )
    ap.add_argument(
        "--loop-rows",
        type=int,
        default=0,
        help="rows a step of the model's own greedy continuations of text, with unlikelihood on each token "
        "that repeats a 4-gram the continuation already had (against greedy loops)",
    )
    ap.add_argument("--loop-weight", type=float, default=1.0, help="the loop rows' unlikelihood against the text loss")
    ap.add_argument(
        "--bf16-autocast",
        action="store_true",
        help="run the forward and backward passes under bfloat16 autocast (weights and optimizer stay float32); "
        "about 1.8x faster on a CPU with AMX or AVX-512 BF16",
    )
    ap.add_argument(
        "--eval-every", type=int, default=0, help="every N steps, print the held-out loss and random-copy accuracy"
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
    data = token_stream(tokenizer, texts)
    print(
        f"corpus: {len(texts)} texts, {sum(map(len, texts))} characters, {len(data)} tokens; "
        f"tokenizer trained in {time.time() - t0:.0f} s"
    )
    if args.docstrings or args.quote_rows:
        doc_texts, quote_texts = package_docstrings()
        docs, prose_quotes = token_stream(tokenizer, doc_texts), token_stream(tokenizer, quote_texts)
        print(f"docstrings: {len(docs)} tokens of text, {len(prose_quotes)} for quotes, {time.time() - t0:.0f} s")

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
    held_out = [tokenizer.encode(t) for t in held_out_texts()] if args.eval_every else []
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.1f}M parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    batch, budget = args.batch, args.minutes * 60
    step, losses = 0, []
    gen = torch.Generator().manual_seed(args.seed)
    model.train()
    quotes = stdlib_source_ids(tokenizer) if args.quote_source else None
    blank_line = tokenizer.encode("\n") * 2
    if args.copy_first:
        learn_to_copy(model, opt, args, len(tokenizer), gen)
    start = time.time()
    while time.time() - start < budget:
        frac = (time.time() - start) / budget
        lr = args.lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        from_docs = round(batch * args.docstrings)
        x = windows(data, batch - from_docs, args.seq, gen)
        if from_docs:
            x = torch.cat([x, windows(docs, from_docs, args.seq, gen)])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16_autocast):
            loss = model(input_ids=x, labels=x).loss
            if args.quote_rows:
                quoted, labels = quote_rows(args.quote_rows, args.seq, prose_quotes, blank_line, gen, args.quote_noise)
                loss = loss + args.quote_weight * model(input_ids=quoted, labels=labels).loss
            if args.loop_rows:
                rows, mask = loop_lessons(model, data, args.loop_rows, gen)
                loss = loss + args.loop_weight * unlikelihood(model, rows, mask)
            if args.copy_rows:
                copies, labels = copy_lessons(
                    args.copy_rows, args.copy_seq, len(tokenizer), gen, quotes, args.copy_alphabet
                )
                loss = loss + model(input_ids=copies, labels=labels).loss
        descend(model, opt, loss)
        losses.append(loss.item())
        step += 1
        if step % 50 == 0:
            print(
                f"step {step}: loss {sum(losses[-50:]) / 50:.3f}, lr {lr:.2e}, {time.time() - start:.0f} s", flush=True
            )
        if args.eval_every and step % args.eval_every == 0:
            model.eval()
            print(f"step {step}: {evaluate(model, tokenizer, held_out)}", flush=True)
            model.train()
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
