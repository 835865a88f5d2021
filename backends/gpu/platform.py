"""The platform face of the CUDA backends (cuda-triton, cuda-native): NCCL between ranks, one
GPU per rank, the KV pool sized by profiling device memory, bfloat16 for `auto` on a float32
checkpoint, pinned swap space and decode steps replayed from CUDA graphs. Under Triton's
interpreter cuda-triton's device is the CPU, and each member falls back to the host's."""

from __future__ import annotations

import logging
import os
import time

import torch

from ..platform import Platform

logger = logging.getLogger("pagedllm.backends")


class CudaPlatform(Platform):
    device: str = "cuda"
    kv_in_shared_memory = False  # device memory: a replacement worker recomputes

    @property
    def on_cuda(self) -> bool:
        return str(self.device).startswith("cuda")

    @property
    def distributed_backend(self) -> str:
        return "nccl" if self.on_cuda else "gloo"

    @staticmethod
    def device_count() -> int | None:
        return None if os.environ.get("TRITON_INTERPRET") == "1" else torch.cuda.device_count()

    def set_device(self, rank: int, ranks_per_host: int) -> None:
        if not self.on_cuda:
            return super().set_device(rank, ranks_per_host)
        torch.cuda.set_device(rank % torch.cuda.device_count())

    def compute_threads(self, threads: int | None):
        if self.on_cuda and not threads:
            return None  # the GPU computes: the host's threads only launch kernels
        return super().compute_threads(threads)

    def default_dtype(self, model_dir: str, requested: str) -> str:
        if not self.on_cuda:
            return requested
        from .dtype import default_dtype

        return default_dtype(model_dir, requested)

    def kv_cache_blocks(
        self, model, block_size, slot_bytes, max_batched_tokens, max_seq_len, memory_utilization, device
    ) -> int | None:
        if not self.on_cuda:
            return None
        from .memory import profile_num_blocks

        return profile_num_blocks(
            model, self, block_size, slot_bytes, max_batched_tokens, max_seq_len, memory_utilization, device
        )

    def pin_memory(self, tensor: torch.Tensor) -> None:
        if not self.on_cuda:
            return
        from .pinning import pin

        if not pin(tensor):
            logger.warning("could not pin the swap space; swapping will be slower")

    def capture_graphs(self, model, kv_caches, block_size, max_batch, max_model_len):
        if not self.on_cuda:
            return None
        from .graphs import GRAPH_BATCH_SIZES, DecodeGraphs

        graphs = DecodeGraphs(model, self, kv_caches, block_size, min(max_batch, GRAPH_BATCH_SIZES[-1]), max_model_len)
        started = time.perf_counter()
        try:
            graphs.capture()
        except Exception as e:
            if os.environ.get("PAGEDLLM_STRICT_GRAPHS") == "1":  # the GPU check: graphs must run
                raise RuntimeError(f"CUDA graph capture failed (PAGEDLLM_STRICT_GRAPHS=1): {e}") from e
            logger.warning("CUDA graph capture failed, running eagerly: %s", e)
            return None
        logger.info(
            "captured CUDA graphs for %d batch sizes in %.1f s", len(graphs.graphs), time.perf_counter() - started
        )
        return graphs

    def synchronize(self) -> None:
        if self.on_cuda:
            torch.cuda.synchronize()
