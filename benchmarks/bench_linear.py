"""float32 linear layers: oneDNN's packed GEMM against the cpu backend's panel kernel
(csrc/panel_linear.cpp), the two alternated call by call on the same inputs, per shape and
number of rows; the ratio decides model_kernels.panel_float32_linear's rule.

Run: python -m pagedllm.benchmarks.bench_linear [--rows 1,8,64,180,1860] [--shapes 256x512,...]
(shapes are in_features x out_features; the defaults are the demo model's and the 19M model's)
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

DEFAULT_SHAPES = "256x512,256x256,256x1408,704x256,256x4096,256x32000,2048x2048,2048x5632"


def alternated(fns, calls: int) -> list[float]:
    """Median seconds per call of each function, called in turn `calls` times after a warm-up."""
    times = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(calls):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


@torch.inference_mode()
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", default="1,8,64,180,1860")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--calls", type=int, default=15)
    args = ap.parse_args(argv)

    from pagedllm.backends.cpu import native
    from pagedllm.backends.cpu.model_kernels import panel_float32_linear
    from pagedllm.backends.cpu.packed_linear import pack_weight, packed_linear, packing_available

    if native.unavailable_reason() is not None or not packing_available(torch.float32):
        raise SystemExit("needs the compiled kernels and oneDNN's packed float32 GEMM")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    gen = torch.Generator().manual_seed(0)
    print(f"float32 layers here run on: {'the panel kernel' if panel_float32_linear() else 'oneDNN'}")
    print(f"{'rows':>5} {'in x out':>12} {'oneDNN us':>10} {'panel us':>9} {'GFLOP/s':>13} {'panel is':>9}")
    for m in (int(r) for r in args.rows.split(",")):
        for k, n in shapes:
            x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
            onednn, panel = pack_weight(w), native.pack_panel_weight(w)
            a, b = alternated(
                (
                    functools.partial(packed_linear, x, onednn, None),
                    functools.partial(native.panel_linear, x, panel, n, None),
                ),
                args.calls,
            )
            flops = 2 * m * k * n
            print(
                f"{m:5d} {f'{k}x{n}':>12} {a * 1e6:10.0f} {b * 1e6:9.0f} "
                f"{flops / a / 1e9:6.0f} /{flops / b / 1e9:5.0f} {a / b:8.2f}x"
            )


if __name__ == "__main__":
    main()
