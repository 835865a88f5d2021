"""GPTQ and AWQ 4-bit checkpoints, as their usual tools save them, into QuantizedWeight.

Every projection `P` of a decoder layer is saved as P.qweight, P.qzeros, P.scales (and for
GPTQ P.g_idx, and P.bias where the model has one), eight 4-bit values to an int32:
- GPTQ: qweight [K/8, N] packed along the input dimension, nibble j of row i being input
  channel 8i + j; qzeros [G, N/8] packed along the output dimension; scales [G, N]; g_idx [K]
  the group of each input channel. The `gptq` checkpoint format stores every zero point minus
  one, `gptq_v2` as it is.
- AWQ (GEMM): qweight [K, N/8] and qzeros [G, N/8] both packed along the output dimension in
  the interleaved order 0 2 4 6 1 3 5 7 (nibble i of a word holds output 8c + AWQ_ORDER[i]);
  scales [G, N]; groups are contiguous.
Weight = (code - zero) * scale in both.
"""

from __future__ import annotations

import torch

from .quantized import QuantizedWeight

QUANTIZED_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_int4(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their eight 4-bit values in nibble order, unpacked along `dim` (uint8)."""
    words = packed.to(torch.int32)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (words.unsqueeze(-1) >> shifts) & 0xF  # [..., 8]: nibble i last
    if dim == 0:  # [R, C, 8] -> [R, 8, C] -> [8R, C]
        return nibbles.permute(0, 2, 1).reshape(-1, packed.shape[1]).to(torch.uint8)
    return nibbles.reshape(packed.shape[0], -1).to(torch.uint8)


def _awq_columns(unpacked: torch.Tensor) -> torch.Tensor:
    """Undo AWQ's interleave: nibble i of each word is output 8c + AWQ_ORDER[i]."""
    rows, cols = unpacked.shape
    out = torch.empty_like(unpacked).view(rows, cols // 8, 8)
    out[..., list(AWQ_ORDER)] = unpacked.view(rows, cols // 8, 8)
    return out.view(rows, cols)


def read_quantized(method: str, params: dict, tensors: dict[str, torch.Tensor], name: str) -> QuantizedWeight:
    """One projection's QuantizedWeight [N, K] from its saved tensors (qweight, qzeros, scales,
    g_idx); `name` (the projection's checkpoint name) goes into error messages."""
    missing = [s for s in ("qweight", "qzeros", "scales") if s not in tensors]
    if missing:
        raise ValueError(f"model: {method} weight {name} has no {', '.join(missing)}")
    scales = tensors["scales"].float()
    num_groups, n = scales.shape
    if method == "gptq":
        codes = unpack_int4(tensors["qweight"], dim=0)  # [K, N]
        zeros = unpack_int4(tensors["qzeros"], dim=1).float() + params["zero_offset"]  # [G, N]
    else:
        codes = _awq_columns(unpack_int4(tensors["qweight"], dim=1))
        zeros = _awq_columns(unpack_int4(tensors["qzeros"], dim=1)).float()
    k = codes.shape[0]
    if codes.shape[1] != n or zeros.shape != (num_groups, n) or k % num_groups:
        raise ValueError(
            f"model: {method} weight {name}: qweight unpacks to {tuple(codes.shape)}, qzeros to "
            f"{tuple(zeros.shape)}, scales are {tuple(scales.shape)}; they do not fit together"
        )
    group = k // num_groups
    if params["group_size"] not in (-1, group):
        raise ValueError(
            f"model: {method} weight {name} has groups of {group}, config.json says {params['group_size']}"
        )
    g_idx = tensors.get("g_idx")
    if g_idx is not None:
        g_idx = g_idx.to(torch.int32)
        if torch.equal(g_idx, torch.arange(k, dtype=torch.int32) // group):
            g_idx = None  # no act order: the groups are contiguous
        elif g_idx.shape != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= num_groups:
            raise ValueError(f"model: {method} weight {name}: g_idx does not name a group for each input channel")
    return QuantizedWeight(
        "int4", codes.t().contiguous(), scales.t().contiguous(), zeros.t().contiguous(), group, g_idx
    )
