"""`pagedllm conformance`: the suite's command line (conformance/suite.py runs it)."""

from __future__ import annotations


def add_parser(sub) -> None:
    from pagedllm.core.config import PLACEMENTS

    conf = sub.add_parser("conformance", help="run the backend conformance suite")
    conf.add_argument("--backend", help="the backend to check (required unless --support)")
    conf.add_argument("--quick", action="store_true", help="a smaller grid (about 2 minutes on CPU)")
    conf.add_argument("--ops-only", action="store_true", help="op numerics and cache writes only")
    conf.add_argument("--json", help="also write the results as JSON here, and the support matrix beside it (.md)")
    conf.add_argument(
        "--dtype",
        action="append",
        choices=["float32", "bfloat16", "float16"],
        help="check the ops in this dtype only (repeatable; default: every dtype the backend supports)",
    )
    conf.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="run the engine rows with this many ranks, against one"
    )
    conf.add_argument("--block-placement", default="lru", choices=PLACEMENTS, help="for the engine rows")
    conf.add_argument(
        "--perf",
        action="store_true",
        help="also the speed tier: decode attention against the measured memory bandwidth, prefill "
        "attention against the measured GEMM rate (information, never a pass or a fail)",
    )
    conf.add_argument("--perf-only", action="store_true", help="the speed tier alone (no checks)")
    conf.add_argument(
        "--only",
        action="append",
        metavar="CHECK",
        help="run this check alone (repeatable): an op check (decode_attention, kv_cache, ...) or an "
        "engine one (memory, invariance, ...); a wrong name lists them",
    )
    conf.add_argument(
        "--support",
        action="store_true",
        help="print what every installed backend supports, feature by feature, as CSV (runs no check)",
    )
    conf.add_argument("--csv", help="with --support: write the CSV here")
    conf.set_defaults(func=run)


def run(args) -> int:
    from .suite import main

    return main(args)
