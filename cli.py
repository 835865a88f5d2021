"""The `pagedllm` command: the engine's commands (entrypoints/cli.py), the conformance suite's
(conformance/cli.py) and the benchmarks' (benchmarks/cli.py). It sits above the three, so that
none of them imports another's command line."""

from __future__ import annotations

import argparse
import sys

from pagedllm import __version__

# the engine's name of a structured-output field -> the flag that gives it
CONSTRAINT_FLAGS = {
    "structured_outputs.json": "--json-schema",
    "structured_outputs.regex": "--regex",
    "structured_outputs.choice": "--choice",
    "structured_outputs.grammar": "--grammar",
}


def build_parser() -> argparse.ArgumentParser:
    from pagedllm.benchmarks import cli as bench_cli
    from pagedllm.conformance import cli as conformance_cli
    from pagedllm.entrypoints import cli as engine_cli

    parser = argparse.ArgumentParser(prog="pagedllm", description="PagedAttention LLM inference engine")
    parser.add_argument("--version", action="version", version=f"pagedllm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    engine_cli.add_commands(sub)
    bench_cli.add_parser(sub)
    conformance_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from pagedllm.core.logs import setup_logging

    setup_logging()
    if args.command is None:
        parser.print_help()
        return 2
    from pagedllm.backends.registry import BackendUnavailable, UnknownBackend
    from pagedllm.core.errors import InvalidParameter
    from pagedllm.entrypoints.interrupt import defer_sigint, raise_if_interrupted

    if args.command == "generate":  # its waits are all in the engine client's loops
        defer_sigint()
    try:
        code = args.func(args)
        raise_if_interrupted()  # a Ctrl-C while the outputs were written
        return code
    except InvalidParameter as e:
        flag = CONSTRAINT_FLAGS.get(e.field) or "--" + e.field.replace("_", "-")
        parser.exit(2, f"pagedllm: error: {flag}: {str(e).split(': ', 1)[-1]}\n")
    except (UnknownBackend, BackendUnavailable, ValueError, FileNotFoundError) as e:
        parser.exit(2, f"pagedllm: error: {e}\n")
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
