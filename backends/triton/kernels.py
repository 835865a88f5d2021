"""Triton kernels for paged attention. Every kernel reads K/V in place through the block table:
token position p of a request lives in block table[p // block_size], slot p % block_size.

- write_kv: one program per (token, KV head) stores that token's K and V at its slot.
- decode: one program per (request, KV head, context partition) handles all the query heads
  that share the KV head (GQA), so K/V are read once for the group; long contexts are split
  into partitions whose partial results a second kernel combines (vLLM's "v2").
- prefill: one program per (request, block of queries, query head), flash-attention style
  online softmax over the cached prefix and the new tokens, causal with the prefix offset.
- copy_blocks: one program per (block pair, layer x K/V).
- add_lora: one program per row: its adapter's shrink and expand (multi-LoRA; BGMV).

8-bit KV caches (KV_CODES 1 int8, 2 fp8_e4m3, 3 fp8_e5m2; backends/kv_cache.py): the codes are
read as int8 and widened by bit placement (the same for every GPU generation and for the
interpreter, which has no fp8), times their row's scale; write_kv_codes_kernel quantizes.

Scores and softmax are in float32; float32 dots ask for IEEE precision (not TF32); 16-bit
caches use 16-bit tensor-core dots with float32 accumulation.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch + d
        k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=dmask)
        v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=dmask)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=dmask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=dmask)


@triton.jit
def write_kv_codes_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_ss,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_CODES: tl.constexpr,
):
    """write_kv into an 8-bit cache: each (token, KV head) row quantized with its own scale."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        dst = block * stride_cb + offset * stride_cs + h * stride_ch + d
        scale_at = block * stride_sb + offset * stride_ss + h
        k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=dmask, other=0.0).to(tl.float32)
        codes, scale = _quantize_row(k, dmask, KV_CODES)
        tl.store(k_cache_ptr + dst, codes, mask=dmask)
        tl.store(k_scale_ptr + scale_at, scale)
        v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=dmask, other=0.0).to(tl.float32)
        codes, scale = _quantize_row(v, dmask, KV_CODES)
        tl.store(v_cache_ptr + dst, codes, mask=dmask)
        tl.store(v_scale_ptr + scale_at, scale)


@triton.jit
def _rint(x):
    # round to nearest, ties to even, for |x| < 2^22: adding 1.5 * 2^23 leaves no fraction bits
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _quantize_row(x, dmask, KV_CODES: tl.constexpr):
    """A row of float32 as (int8-typed codes, its scale): the reference is kv_cache.quantize."""
    if KV_CODES == 1:
        top = 127.0
    elif KV_CODES == 2:
        top = 448.0
    else:
        top = 57344.0
    absmax = tl.max(tl.where(dmask, tl.abs(x), 0.0), 0)
    scale = tl.where(absmax > 0.0, absmax / top, 1.0)
    v = tl.minimum(tl.maximum(x / scale, -top), top)
    if KV_CODES == 1:
        code = _rint(v).to(tl.int32)
    else:
        bits = v.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        mag = bits & 0x7FFFFFFF
        a = mag.to(tl.float32, bitcast=True)
        if KV_CODES == 2:  # e4m3: below 2^-6 multiples of 2^-9; above, the mantissa rounded to 3 bits
            small = _rint(tl.minimum(a, 0.015625) * 512.0).to(tl.int32)  # (the other branch past 2^-6)
            r = mag + 0x7FFFF + ((mag >> 20) & 1)
            code = sign | tl.where(mag < 0x3C800000, small, tl.minimum((r >> 20) - 960, 0x7E))
        else:  # e5m2: below 2^-14 multiples of 2^-16; above, 2 mantissa bits
            small = _rint(tl.minimum(a, 6.103515625e-05) * 65536.0).to(tl.int32)
            r = mag + 0xFFFFF + ((mag >> 21) & 1)
            code = sign | tl.where(mag < 0x38800000, small, tl.minimum((r >> 21) - 448, 0x7B))
    return code.to(tl.int8), scale


@triton.jit
def _widen_codes(c, KV_CODES: tl.constexpr):
    """8-bit codes (loaded as int8) as float32, before their scale. fp8: sign-extended, the
    exponent and mantissa bits shifted to the top of a float32's (the extended sign's copies
    cleared), then scaled by 2^(127 - bias); the format's subnormals land on float32's."""
    if KV_CODES == 1:
        return c.to(tl.float32)
    bits = c.to(tl.int32)
    if KV_CODES == 2:
        return ((bits << 20) & -2014314496).to(tl.float32, bitcast=True) * 1.329227995784916e36  # 0x87f00000, 2^120
    return ((bits << 21) & -1881145344).to(tl.float32, bitcast=True) * 5.192296858534828e33  # 0x8fe00000, 2^112


@triton.jit
def _scores(q, k, scale, soft_cap, FP32: tl.constexpr, SOFT_CAP: tl.constexpr):
    # FP32: float32 operands at IEEE precision. Set for float32 caches, and under Triton's
    # interpreter, whose dot mishandles 16-bit floats (triton 3.9).
    if FP32:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * scale
    if SOFT_CAP:  # soft_cap * tanh(s / soft_cap), tanh from exp (1 - 2 / (e^2x + 1) saturates cleanly)
        s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0))
    return s


@triton.jit
def _weighted(p, v, FP32: tl.constexpr):
    if FP32:
        out = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(p.to(v.dtype), v)
    return out


@triton.jit
def _tile_step(
    q,
    k_cache_ptr,
    v_cache_ptr,
    tables_ptr,
    pos,
    pmask,
    visible,
    kvh,
    d,
    dmask,
    scale,
    soft_cap,
    m_i,
    l_i,
    acc,
    stride_kb,
    stride_ks,
    stride_kh,
    k_scale_ptr,
    v_scale_ptr,
    stride_sb,
    stride_ss,
    BLOCK_SIZE: tl.constexpr,
    FP32: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    KV_CODES: tl.constexpr,
):
    """One tile of context positions: gather their K/V through the block table and fold them
    into the running max, sum and weighted values (online softmax)."""
    block = tl.load(tables_ptr + pos // BLOCK_SIZE, mask=pmask, other=0).to(tl.int64)
    off = block * stride_kb + (pos % BLOCK_SIZE) * stride_ks + kvh * stride_kh
    kv_mask = pmask[:, None] & dmask[None, :]
    k = tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if KV_CODES:
        scale_at = block * stride_sb + (pos % BLOCK_SIZE) * stride_ss + kvh
        k = _widen_codes(k, KV_CODES) * tl.load(k_scale_ptr + scale_at, mask=pmask, other=0.0)[:, None]
    s = tl.where(visible, _scores(q, k, scale, soft_cap, FP32, SOFT_CAP), float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row that has seen nothing yet (a window starts past this tile) keeps max -inf: shift by 0
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if KV_CODES:
        v = _widen_codes(v, KV_CODES) * tl.load(v_scale_ptr + scale_at, mask=pmask, other=0.0)[:, None]
    acc = acc * alpha[:, None] + _weighted(p, v, FP32)
    return m_new, l_i, acc


@triton.jit
def decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    tables_ptr,
    ctx_ptr,
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    scale,
    soft_cap,
    window,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    stride_os,
    stride_oh,
    num_heads,
    num_splits,
    k_scale_ptr,
    v_scale_ptr,
    stride_sb,
    stride_ss,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    PARTITION: tl.constexpr,
    SPLIT: tl.constexpr,
    FP32: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    KV_CODES: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + seq)
    end = tl.minimum(split * PARTITION + PARTITION, ctx)
    start = split * PARTITION
    if window > 0:  # the first position the window shows; a partition before it stays empty
        start = tl.maximum(start, ctx - window)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(
        q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :],
        mask=gmask[:, None] & dmask[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for t in range(start, end, TILE):
        pos = t + tl.arange(0, TILE)
        pmask = pos < end
        m_i, l_i, acc = _tile_step(
            q,
            k_cache_ptr,
            v_cache_ptr,
            tables_ptr + seq * stride_bt,
            pos,
            pmask,
            pmask[None, :],
            kvh,
            d,
            dmask,
            scale,
            soft_cap,
            m_i,
            l_i,
            acc,
            stride_kb,
            stride_ks,
            stride_kh,
            k_scale_ptr,
            v_scale_ptr,
            stride_sb,
            stride_ss,
            BLOCK_SIZE,
            FP32,
            SOFT_CAP,
            KV_CODES,
        )
    if SPLIT:
        # partials, unnormalised; a partition past the context leaves max -inf and sum 0
        base = (seq * num_heads + heads) * num_splits + split  # partials: [seqs, heads, splits, (D)]
        tl.store(part_max_ptr + base, m_i, mask=gmask)
        tl.store(part_sum_ptr + base, l_i, mask=gmask)
        tl.store(part_acc_ptr + base[:, None] * BLOCK_D + d[None, :], acc, mask=gmask[:, None] & dmask[None, :])
    else:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=gmask[:, None] & dmask[None, :],
        )


@triton.jit
def decode_reduce_kernel(
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    out_ptr,
    stride_os,
    stride_oh,
    num_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = s < num_splits
    base = (seq * num_heads + h) * num_splits
    m = tl.load(part_max_ptr + base + s, mask=smask, other=float("-inf"))
    total_max = tl.max(m, 0)
    w = tl.where(smask, tl.exp(m - total_max), 0.0)
    sums = tl.load(part_sum_ptr + base + s, mask=smask, other=0.0)
    # a partition past the context (sum 0) is not read at all: its buffer may hold anything
    acc = tl.load(
        part_acc_ptr + (base + s)[:, None] * BLOCK_D + d[None, :],
        mask=(smask & (sums > 0))[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )
    out = tl.sum(acc * w[:, None], 0) / tl.sum(sums * w, 0)
    tl.store(out_ptr + seq * stride_os + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit
def prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    tables_ptr,
    qsl_ptr,
    ctx_ptr,
    out_ptr,
    scale,
    soft_cap,
    window,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    stride_ot,
    stride_oh,
    k_scale_ptr,
    v_scale_ptr,
    stride_sb,
    stride_ss,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE: tl.constexpr,
    FP32: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    KV_CODES: tl.constexpr,
):
    req = tl.program_id(0)
    qblock = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    if qblock * BLOCK_M < q_len:
        ctx = tl.load(ctx_ptr + req)
        prefix = ctx - q_len
        m_offs = qblock * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = m_offs < q_len
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        q = tl.load(
            q_ptr + (q_start + m_offs)[:, None] * stride_qt + head * stride_qh + d[None, :],
            mask=mmask[:, None] & dmask[None, :],
            other=0.0,
        )
        q_pos = prefix + m_offs
        kvh = head // GROUP
        hi = tl.minimum(ctx, prefix + (qblock + 1) * BLOCK_M)  # no query of this block looks further
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        lo = 0
        if window > 0:  # no query of this block looks further back
            lo = tl.maximum(prefix + qblock * BLOCK_M - window + 1, 0)
        for t in range(lo, hi, TILE):
            pos = t + tl.arange(0, TILE)
            pmask = pos < hi
            # causal (and within the window); each row sees its own position
            visible = (pos[None, :] <= q_pos[:, None]) & pmask[None, :]
            if window > 0:
                visible = visible & (pos[None, :] > q_pos[:, None] - window)
            m_i, l_i, acc = _tile_step(
                q,
                k_cache_ptr,
                v_cache_ptr,
                tables_ptr + req * stride_bt,
                pos,
                pmask,
                visible,
                kvh,
                d,
                dmask,
                scale,
                soft_cap,
                m_i,
                l_i,
                acc,
                stride_kb,
                stride_ks,
                stride_kh,
                k_scale_ptr,
                v_scale_ptr,
                stride_sb,
                stride_ss,
                BLOCK_SIZE,
                FP32,
                SOFT_CAP,
                KV_CODES,
            )
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + (q_start + m_offs)[:, None] * stride_ot + head * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mmask[:, None] & dmask[None, :],
        )


@triton.jit
def copy_blocks_kernel(cache_ptr, pairs_ptr, stride_layer, BLOCK_ELEMS: tl.constexpr, CHUNK: tl.constexpr):
    pair = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    src = tl.load(pairs_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(pairs_ptr + 2 * pair + 1).to(tl.int64)
    base = cache_ptr + layer * stride_layer
    for i in range(0, BLOCK_ELEMS, CHUNK):
        offs = i + tl.arange(0, CHUNK)
        mask = offs < BLOCK_ELEMS
        tl.store(base + dst * BLOCK_ELEMS + offs, tl.load(base + src * BLOCK_ELEMS + offs, mask=mask), mask=mask)


@triton.jit
def add_lora_kernel(
    out_ptr,
    x_ptr,
    a_ptr,
    b_ptr,
    slots_ptr,
    scales_ptr,
    stride_ot,
    stride_xt,
    width_in,
    width_out,
    rank,
    RANK: tl.constexpr,
    TILE_IN: tl.constexpr,
    TILE_OUT: tl.constexpr,
):
    """One program per row: shrink x[t] to its adapter's rank (A [slots, rank, in]), scale,
    expand (B [slots, out, rank]) and add into out[t], in float32; a row of slot -1 is left."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t)
    n_in = tl.where(slot >= 0, width_in, 0)  # a row without an adapter reads and writes nothing
    n_out = tl.where(slot >= 0, width_out, 0)
    s = tl.maximum(slot, 0).to(tl.int64)
    r = tl.arange(0, RANK)
    rmask = r < rank
    a_base = a_ptr + s * rank * width_in
    shrunk = tl.zeros([RANK], dtype=tl.float32)
    for i0 in range(0, width_in, TILE_IN):
        i = i0 + tl.arange(0, TILE_IN)
        imask = i < n_in
        xv = tl.load(x_ptr + t * stride_xt + i, mask=imask, other=0.0).to(tl.float32)
        av = tl.load(a_base + r[:, None] * width_in + i[None, :], mask=rmask[:, None] & imask[None, :], other=0.0)
        shrunk += tl.sum(av.to(tl.float32) * xv[None, :], axis=1)
    shrunk = shrunk * tl.load(scales_ptr + s)
    b_base = b_ptr + s * width_out * rank
    for o0 in range(0, width_out, TILE_OUT):
        o = o0 + tl.arange(0, TILE_OUT)
        omask = o < n_out
        bv = tl.load(b_base + o[:, None] * rank + r[None, :], mask=omask[:, None] & rmask[None, :], other=0.0)
        delta = tl.sum(bv.to(tl.float32) * shrunk[None, :], axis=1)
        cur = tl.load(out_ptr + t * stride_ot + o, mask=omask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * stride_ot + o, (cur + delta).to(out_ptr.dtype.element_ty), mask=omask)
