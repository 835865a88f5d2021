"""The `pagedllm` command's engine commands: generate, serve, worker and keygen, and the engine,
sampling, limit and ZMQ-security flags (the command itself is `pagedllm.cli`)."""

from __future__ import annotations

import argparse
import json
import os

DEFAULT_ZMQ_ENDPOINT = "tcp://127.0.0.1:5555"


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """One flag per EngineArgs option, made from its declaration."""
    from .engine_args import EngineArgs

    EngineArgs.add_cli_args(p)


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """A flag per SamplingParams field, from its declaration (entrypoints/sampling_fields.py),
    and the output constraints'."""
    from .sampling_fields import add_sampling_flags as add_declared_flags

    add_declared_flags(p)
    g = p.add_argument_group("structured outputs (one of)")
    c = g.add_mutually_exclusive_group()
    c.add_argument("--json-schema", metavar="FILE", default=None, help="the output is JSON that follows this schema")
    c.add_argument("--regex", default=None, help="the output matches this regular expression")
    c.add_argument("--choice", default=None, help="the output is one of these comma-separated strings")
    c.add_argument("--grammar", metavar="FILE", default=None, help="the output follows this Lark or GBNF grammar")


def add_zmq_security_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("ZMQ authentication (CurveZMQ; keys from `pagedllm keygen`)")
    g.add_argument("--zmq-curve-secret-key", default=None, metavar="FILE", help="the server's NAME.key_secret")
    g.add_argument(
        "--zmq-authorized-keys",
        default=None,
        metavar="DIR",
        help="folder of the client public keys (NAME.key) accepted",
    )
    g.add_argument(
        "--zmq-allow-insecure",
        action="store_true",
        help="serve ZMQ on a non-loopback address without authentication (refused otherwise)",
    )


def add_chat_flags(p) -> None:
    from .reasoning_parsers import REASONING_FORMATS
    from .tool_parsers import TOOL_CALL_FORMATS

    g = p.add_argument_group("chat (vLLM's flags)")
    g.add_argument("--chat-template", default=None, help="a Jinja chat template, or its file, instead of the model's")
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto" (the default where tools are given): calls are read from the model\'s text',
    )
    g.add_argument(
        "--tool-call-parser", choices=list(TOOL_CALL_FORMATS), default=None, help="the model's tool-call format"
    )
    g.add_argument(
        "--reasoning-parser",
        choices=list(REASONING_FORMATS),
        default=None,
        help="put the model's <think>...</think> in the message's reasoning field",
    )
    g.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="GET /tokenizer_info answers the tokenizer's special tokens and chat template",
    )


def add_limit_flags(p: argparse.ArgumentParser) -> None:
    from .limits import ServerLimits

    d = ServerLimits()
    g = p.add_argument_group("limits on one request")
    g.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes, help="HTTP body or ZMQ frame")
    g.add_argument("--max-prompts", type=int, default=d.max_prompts, help="prompts in one completions request")
    g.add_argument("--max-n", type=int, default=d.max_n, help="n, and best_of / beam width (also <= --max-num-seqs)")
    g.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings)
    g.add_argument(
        "--max-logprob-entries",
        type=int,
        default=d.max_logprob_entries,
        help="logprob entries the server may hold for one request: prompts x n x max_tokens x (logprobs + 1)",
    )


def engine_kwargs(args) -> dict:
    from .engine_args import EngineArgs

    return EngineArgs.from_cli_args(args)


def sampling_params(args):
    from pagedllm.core.sampling_params import SamplingParams

    from .sampling_fields import sampling_values

    return SamplingParams(**{**sampling_values(args), "structured_outputs": structured_outputs(args)})


def structured_outputs(args):
    """The constraint the flags give (checked that it compiles before any engine starts), or None."""
    constraint = _constraint(args)
    if constraint is not None:
        from .input_processor import check_structured

        check_structured(constraint)
    return constraint


def _constraint(args):
    from pagedllm.core.sampling_params import StructuredOutputsParams

    if args.json_schema is not None:
        with open(args.json_schema) as f:
            try:
                return StructuredOutputsParams(json=json.load(f))
            except json.JSONDecodeError as e:
                raise ValueError(f"--json-schema: {args.json_schema} is not JSON: {e}") from None
    if args.regex is not None:
        return StructuredOutputsParams(regex=args.regex)
    if args.choice is not None:
        return StructuredOutputsParams(choice=[c for c in args.choice.split(",") if c])
    if args.grammar is not None:
        with open(args.grammar) as f:
            return StructuredOutputsParams(grammar=f.read())
    return None


def read_jsonl(path: str) -> list:
    prompts = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"--input: line {lineno} is not JSON: {e}") from None
            if isinstance(item, str):
                item = {"prompt": item}
            if not isinstance(item, dict) or not ("prompt" in item or "prompt_token_ids" in item):
                raise ValueError(f"--input: line {lineno} needs a 'prompt' or 'prompt_token_ids' field")
            prompts.append(item)
    return prompts


def cmd_generate(args) -> int:
    from pagedllm.entrypoints.llm import LLM

    if args.input:
        prompts = read_jsonl(args.input)
    elif args.prompts:
        prompts = list(args.prompts)
    else:
        raise ValueError("give prompts as arguments or --input prompts.jsonl")
    if args.beam_width:
        from pagedllm.core.sampling_params import BeamSearchParams

        if _constraint(args) is not None:
            raise ValueError("--beam-width: beam search takes no constraint on the output")

        beam_params = BeamSearchParams(
            beam_width=args.beam_width,
            max_tokens=args.max_tokens,
            ignore_eos=args.ignore_eos,
            length_penalty=args.length_penalty,
        )
        with LLM(**engine_kwargs(args)) as llm:
            return write_beams(
                llm.beam_search(prompts, beam_params, use_tqdm=not args.no_progress), prompts, args.output
            )
    params = sampling_params(args)
    with LLM(**engine_kwargs(args)) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
    if not args.output:
        for o in outputs:
            for c in o.outputs:
                print(f"{o.prompt or o.prompt_token_ids!r} -> {c.text!r} [{c.finish_reason}]")
        return 0
    with open(args.output, "w") as out:
        for o in outputs:
            completions = [
                {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason} for c in o.outputs
            ]
            row = {"prompt": o.prompt, "prompt_token_ids": o.prompt_token_ids, "outputs": completions}
            out.write(json.dumps(row) + "\n")
    return 0


def write_beams(outputs, prompts, path: str | None) -> int:
    if not path:
        for prompt, o in zip(prompts, outputs):
            for rank, b in enumerate(o.sequences):
                print(f"{prompt!r} beam {rank} (score {b.score:.3f}) -> {b.text!r}")
        return 0
    with open(path, "w") as out:
        for prompt, o in zip(prompts, outputs):
            beams = [
                {"text": b.text, "token_ids": b.tokens, "cum_logprob": b.cum_logprob, "score": b.score}
                for b in o.sequences
            ]
            out.write(json.dumps({"prompt": prompt, "beams": beams}) + "\n")
    return 0


def add_commands(sub) -> None:
    """generate, serve, worker and keygen (the root `pagedllm.cli` adds bench and conformance)."""
    gen = sub.add_parser("generate", help="generate completions offline")
    gen.add_argument("prompts", nargs="*", metavar="PROMPT")
    gen.add_argument("--input", help='JSONL file: one {"prompt": ...} or {"prompt_token_ids": [...]} per line')
    gen.add_argument("--output", help="write JSONL results here instead of printing")
    gen.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_flags(gen)
    add_sampling_flags(gen)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API and the ZMQ entrypoint")
    srv.add_argument("--host", default="127.0.0.1", help="HTTP address (loopback unless told otherwise)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument(
        "--zmq-endpoint",
        default=None,
        help=f"where the ZMQ entrypoint binds (tcp:// or ipc://; default {DEFAULT_ZMQ_ENDPOINT}); 'none' turns it off",
    )
    srv.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) a request's `model` names (needs --enable-lora); or vLLM's JSON "
        '{"name": ..., "path": ...}',
    )
    srv.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine replicas behind a prefix-aware router on Ray Serve (pip install 'pagedllm[ray]'; "
        "a Ray cluster where RAY_ADDRESS names one)",
    )
    srv.add_argument(
        "--api-key",
        default=os.environ.get("PAGEDLLM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 (default: $PAGEDLLM_API_KEY)",
    )
    srv.add_argument("--served-model-name", default=None, help="the model's name in the API (default: --model)")
    srv.add_argument(
        "--max-queue-len",
        type=int,
        default=1024,
        help="requests waiting for a first token beyond which new ones get 503",
    )
    srv.add_argument("--log-level", default="warning", help="uvicorn's log level")
    srv.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM or Ctrl-C: seconds running requests may take to finish before they are aborted",
    )
    srv.add_argument(
        "--enable-server-load-tracking",
        action="store_true",
        help="GET /load answers how many completions and chat requests are being answered",
    )
    srv.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="usage on every streamed chunk, whether the client asks for it or not",
    )
    srv.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="logprobs name each token `token_id:N` (a request's return_tokens_as_token_ids overrides it)",
    )
    add_chat_flags(srv)
    add_zmq_security_flags(srv)
    add_limit_flags(srv)
    add_engine_flags(srv)
    srv.set_defaults(func=cmd_serve)

    node = sub.add_parser("worker", help="run this host's tensor-parallel ranks of an engine whose core runs elsewhere")
    node.add_argument("--head", required=True, help="the head's --worker-endpoint, e.g. tcp://10.0.0.1:29600")
    node.add_argument("--nnodes", type=int, required=True)
    node.add_argument("--node-rank", type=int, required=True, help="this host's place, 1..nnodes-1 (0 is the head)")
    node.add_argument("--tensor-parallel-size", type=int, required=True)
    node.set_defaults(func=cmd_worker)

    keys = sub.add_parser("keygen", help="make a CurveZMQ key pair for the ZMQ entrypoint or one of its clients")
    keys.add_argument("--out", default="zmq-keys", help="folder for NAME.key (public) and NAME.key_secret")
    keys.add_argument("--name", default="server", help="file name stem (server, or a client's name)")
    keys.set_defaults(func=cmd_keygen)


def cmd_serve(args) -> int:
    from .chat_output import ChatOptions
    from .limits import ServerLimits
    from .serve import ServeOptions, run_server
    from .zmq_auth import ServerCurve

    if (args.zmq_curve_secret_key is None) != (args.zmq_authorized_keys is None):
        raise ValueError("--zmq-curve-secret-key and --zmq-authorized-keys go together")
    curve = None
    if args.zmq_curve_secret_key is not None:
        curve = ServerCurve(args.zmq_curve_secret_key, args.zmq_authorized_keys)
    limits = ServerLimits(
        max_request_bytes=args.max_request_bytes,
        max_prompts=args.max_prompts,
        max_n=args.max_n,
        max_stop_strings=args.max_stop_strings,
        max_logprob_entries=args.max_logprob_entries,
    )
    options = ServeOptions(
        host=args.host,
        port=args.port,
        zmq_endpoint=_zmq_endpoint(args),
        api_key=args.api_key,
        model_name=args.served_model_name,
        max_queue_len=args.max_queue_len,
        log_level=args.log_level,
        shutdown_timeout=args.shutdown_timeout,
        zmq_curve=curve,
        zmq_allow_insecure=args.zmq_allow_insecure,
        limits=limits,
        enable_server_load_tracking=args.enable_server_load_tracking,
        enable_force_include_usage=args.enable_force_include_usage,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        lora_modules=args.lora_modules,
        chat=ChatOptions(
            args.chat_template,
            args.enable_auto_tool_choice,
            args.tool_call_parser,
            args.reasoning_parser,
            args.enable_tokenizer_info_endpoint,
        ),
    )
    if args.data_parallel_size > 1:
        from .ray_serve.run import run_replicas

        run_replicas(engine_kwargs(args), options, args.data_parallel_size)
    else:
        run_server(engine_kwargs(args), options)
    return 0


def _zmq_endpoint(args) -> str | None:
    """The ZMQ entrypoint's address; none for replicas on Ray Serve, whose clients use HTTP."""
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size: must be >= 1, got {args.data_parallel_size}")
    if args.data_parallel_size > 1:
        if args.zmq_endpoint not in (None, "none"):
            raise ValueError(
                "--zmq-endpoint: the ZMQ entrypoint serves one engine; with --data-parallel-size the replicas "
                "are reached through the HTTP endpoint (or run one `pagedllm serve` per engine)"
            )
        if args.kv_events_config:
            raise ValueError(
                "--kv-events-config: the replicas on Ray Serve are routed by their own router; for an external "
                "KV-aware router run one `pagedllm serve` per engine (docs/serving.md)"
            )
        return None
    if args.zmq_endpoint == "none":
        return None
    return args.zmq_endpoint or DEFAULT_ZMQ_ENDPOINT


def cmd_worker(args) -> int:
    from .node import node_ranks, run_node

    return run_node(args.head, node_ranks(args.tensor_parallel_size, args.nnodes, args.node_rank))


def cmd_keygen(args) -> int:
    from .zmq_auth import keygen

    public, secret = keygen(args.out, args.name)
    print(f"wrote {public} (public: give it to the other side) and {secret} (secret: keep it)")
    return 0
