import json
import os
import subprocess
import sys

import pytest


def pagedllm(*args, env=None, timeout=180):
    return subprocess.run(
        [sys.executable, "-m", "pagedllm.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_generate_with_the_default_model():
    proc = pagedllm("generate", "Hello", "--max-tokens", "8", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("'Hello' -> ")


def test_fallback_default_model_is_made_when_none_ships(tmp_path, monkeypatch):
    from pagedllm.entrypoints import default_model

    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model, "shipped_model_dir", lambda: str(tmp_path / "absent"))
    path = default_model.default_model_dir()
    assert path == str(tmp_path / "pagedllm-tiny-random-llama-v1")
    assert os.path.isfile(os.path.join(path, "config.json"))


def test_generate_jsonl_in_and_out(tiny_model, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"prompt": "paged"}) + "\n" + json.dumps({"prompt_token_ids": [5, 6, 7]}) + "\n")
    proc = pagedllm(
        "generate",
        "--model",
        tiny_model("llama"),
        "--input",
        str(inp),
        "--output",
        str(out),
        "--max-tokens",
        "5",
        "--ignore-eos",
        "--n",
        "2",
        "--temperature",
        "0.8",
        "--sampling-seed",
        "3",
    )
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["paged", None]
    assert rows[1]["prompt_token_ids"] == [5, 6, 7]
    assert all(len(r["outputs"]) == 2 and all(len(o["token_ids"]) == 5 for o in r["outputs"]) for r in rows)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--temperature", "-1"], "--temperature"),
        (["--top-p", "2"], "--top-p"),
        (["--block-size", "3"], "--block-size"),
        (["--scheduler-policy", "lifo"], "--scheduler-policy"),
        (["--max-tokens", "abc"], "--max-tokens"),
        (["--backend", "tpu"], "unknown backend 'tpu'"),
        (["--bogus-flag"], "--bogus-flag"),
        (["--regex", "[a-"], "--regex: is not valid"),
        (["--choice", "a", "--regex", "b"], "not allowed with argument"),
    ],
)
def test_bad_flags_name_the_flag(tiny_model, args, needle):
    proc = pagedllm("generate", "x", "--model", tiny_model("llama"), *args)
    assert proc.returncode == 2
    assert needle in proc.stderr, proc.stderr


def test_generate_with_beam_search(tiny_model):
    proc = pagedllm(
        "generate",
        "paged attention",
        "--model",
        tiny_model("llama"),
        "--beam-width",
        "3",
        "--max-tokens",
        "6",
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split(" (")[0] for line in lines] == [f"'paged attention' beam {i}" for i in range(3)]


def test_every_engine_flag_comes_from_the_one_declaration():
    """`generate` and `serve` have exactly EngineArgs' options as engine flags, with its
    defaults and choices, and hand them back whole; the core's EngineConfig agrees with it on
    every option they share."""
    import argparse
    from dataclasses import fields

    import msgspec

    from pagedllm.cli import build_parser
    from pagedllm.core.config import BLOCK_SIZES, PLACEMENTS, PREEMPTION_MODES, SCHEDULER_POLICIES, EngineConfig
    from pagedllm.entrypoints.cli import engine_kwargs
    from pagedllm.entrypoints.engine_args import EngineArgs

    declared = {f.name: f for f in fields(EngineArgs)}
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("generate", "serve"):
        parser = sub.choices[command]
        group = next(g for g in parser._action_groups if g.title == "engine")
        flags = {a.dest: a for a in group._group_actions}
        assert set(flags) == set(declared), command
        for name, action in flags.items():
            assert action.default == declared[name].default, name
            assert action.help and action.help.startswith(declared[name].metadata["help"]), name
        args = parser.parse_args(["--block-size", "32", "--no-enable-prefix-caching"])
        kwargs = engine_kwargs(args)
        assert kwargs == {
            **{n: f.default for n, f in declared.items()},
            "block_size": 32,
            "enable_prefix_caching": False,
        }
    choices = {n: f.metadata["choices"] for n, f in declared.items()}
    assert choices["block_size"] == BLOCK_SIZES and choices["scheduler_policy"] == SCHEDULER_POLICIES
    assert choices["preemption_mode"] == PREEMPTION_MODES and choices["block_placement"] == PLACEMENTS
    converted = {"kv_cache_memory", "swap_space", "model"}  # bytes, and the absolute path, in the core
    core_fields = msgspec.structs.fields(EngineConfig)
    for f in core_fields:
        if f.name not in converted:
            assert f.default == declared[f.name].default, f"EngineConfig.{f.name} disagrees with EngineArgs"
    assert {f.name for f in core_fields} <= set(declared)
