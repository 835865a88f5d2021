"""Page-locked host memory for the swap space."""

from __future__ import annotations

import torch


def pin(tensor: torch.Tensor) -> bool:
    """Page-lock a host tensor (the shared-memory swap space) so copies to and from the device
    are asynchronous DMA. Returns whether it worked."""
    if tensor.numel() == 0:
        return False
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
    return int(err) == 0
