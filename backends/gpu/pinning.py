"""Page-locked host memory for the swap space."""

from __future__ import annotations

import ctypes
import logging

import torch

logger = logging.getLogger("pagedllm.backends")


def pin(tensor: torch.Tensor) -> bool:
    """Page-lock a host tensor (the shared-memory swap space) so copies to and from the device
    are asynchronous DMA. Returns whether it worked."""
    if tensor.numel() == 0:
        return False
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
    if int(err) != 0:
        _clear_last_cuda_error()
        return False
    return True


def _clear_last_cuda_error() -> None:
    """A failed cudaHostRegister also leaves the thread's last CUDA error set, which the next
    kernel launch would report as its own (cuda-native checks every launch). torch's cudart
    bindings have no cudaGetLastError; torch loads libcudart globally, so look it up there."""
    try:
        ctypes.CDLL(None).cudaGetLastError()
    except (AttributeError, OSError):
        logger.warning("could not clear the CUDA error of the failed cudaHostRegister")
