"""A lane-by-lane CPU model of csrc/split_kv_mma/kernel.cuh's mma_split_kernel, to test its index math with no GPU.

The model keeps the kernel's tiling and order (blocks of one KV head and up to 16 query vectors, splits in whole
tiles of 64 keys, a 3-stage ring loaded two tiles ahead, warp w on keys [16 w, 16 w + 16) of a tile, per-warp online
softmax, the warps' states merged at the end) and its fragment addressing: every shared-memory or global element a
lane reads is computed from (lane, warp, tile) with the kernel's expressions. The hardware instructions are modelled
from the PTX ISA's fragment layouts (mma.m16n8k16, ldmatrix .trans), written independently of the kernel's
addressing, so a wrong index in the kernel's expressions gives a wrong result here. Arithmetic: fp32 scores and
sums, the weights rounded to the input dtype before PV, as on the GPU (the MMA's internal accumulation order is not
modelled: tolerances cover it).
"""
from __future__ import annotations

import math

import torch

WARPS, ROWS, TILE_KEYS, STAGES, PAD = 4, 16, 64, 3, 8
LANE = torch.arange(32)
G, T = LANE >> 2, LANE & 3  # the PTX ISA's groupID and threadID_in_group
LOG2E = 1.0 / math.log(2.0)


# ---- the instructions, from the PTX ISA ----------------------------------------------------------------------
def _a_coords():
    """(32, 4, 2) (row, col) of each lane's A registers a0..a3, two elements each (m16n8k16, .f16/.bf16)."""
    rows = torch.stack([G, G + 8, G, G + 8], 1)
    cols = torch.stack([2 * T, 2 * T, 2 * T + 8, 2 * T + 8], 1)
    return rows[..., None].expand(32, 4, 2), cols[..., None] + torch.arange(2)


def _b_coords():
    """(32, 2, 2) (k, n) of each lane's B registers b0, b1."""
    ks = torch.stack([2 * T, 2 * T + 8], 1)[..., None] + torch.arange(2)
    return ks, G[:, None, None].expand(32, 2, 2)


def _c_coords():
    """(32, 4) (row, col) of each lane's C registers c0..c3."""
    return torch.stack([G, G, G + 8, G + 8], 1), torch.stack([2 * T, 2 * T + 1, 2 * T, 2 * T + 1], 1)


def mma16816(c, a, b0, b1):
    """c (32, 4) fp32 += A B for A given as a (32, 4, 2) and B as b0, b1 (32, 2) per lane; returns the new c."""
    A = torch.zeros(16, 16, dtype=torch.float32)
    rows, cols = _a_coords()
    A[rows, cols] = a.float()
    B = torch.zeros(16, 8, dtype=torch.float32)
    ks, ns = _b_coords()
    B[ks, ns] = torch.stack([b0, b1], 1).float()
    C = torch.zeros(16, 8, dtype=torch.float32)
    rows, cols = _c_coords()
    C[rows, cols] = c
    return (A @ B + C)[rows, cols]


def ldmatrix_x4_trans(smem, address):
    """ldmatrix.m8n8.x4.trans.b16: lane i's `address` (an element index into `smem`) is row i % 8 of matrix i // 8;
    returns (32, 4, 2): register j holds elements (rows 2t, 2t + 1; column g) of matrix j."""
    rows = smem[address[:, None] + torch.arange(8)]  # (32, 8): row i % 8 of matrix i // 8
    matrices = rows.view(4, 8, 8)
    out = torch.empty(32, 4, 2, dtype=smem.dtype)
    for j in range(4):
        out[:, j, 0] = matrices[j, 2 * T, G]
        out[:, j, 1] = matrices[j, 2 * T + 1, G]
    return out


def _exp2_diff(x, m):
    """2^(x - m), 0 where x is -inf (state.cuh's exp2_diff)."""
    return torch.where(x == -math.inf, torch.zeros_like(x), torch.exp2(x - torch.where(m == -math.inf, 0.0, m)))


def _shfl_xor_max(x):
    """max over the four lanes of a row (xor 1, then 2), x (32,)."""
    for offset in (1, 2):
        x = torch.maximum(x, x[LANE ^ offset])
    return x


def _shfl_xor_sum(x):
    for offset in (1, 2):
        x = x + x[LANE ^ offset]
    return x


# ---- the kernel ---------------------------------------------------------------------------------------------
def mma_split_pass(q, k, v, start, input_end, end, scale, splits):
    """One split pass as mma_split_kernel computes it. q (B, H, R, D), k and v (B, H_kv, S, D) in fp16 or bf16 (v may
    be None); start, input_end, end (B, R) int; returns part_stats (B, H, R, splits, 4), part_acc
    (B, H, R, splits, D) or None, and scores (B, H, R, S) fp32 (NaN where not written), as SplitParams holds them."""
    batch, heads, rows, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    group = heads // kv_heads
    pitch = dim + PAD
    rows_per_block = min(ROWS // group, rows)
    row_chunks = -(-rows // rows_per_block)
    scale_log2 = scale * LOG2E
    part_stats = torch.zeros(batch, heads, rows, splits, 4)
    part_acc = None if v is None else torch.zeros(batch, heads, rows, splits, dim)
    scores = torch.full((batch, heads, rows, keys), math.nan)
    flat_scores = scores.view(-1)
    for b in range(batch):
        for by in range(kv_heads * row_chunks):
            kv_head, row0 = by // row_chunks, (by % row_chunks) * rows_per_block
            block_rows = min(rows_per_block, rows - row0)
            vectors, head0 = group * block_rows, kv_head * group
            # KeyRange: clamped into the cache.
            e_ = [min(max(int(end[b, row0 + i]), 0), keys) for i in range(block_rows)]
            s_ = [min(max(int(start[b, row0 + i]), 0), e_[i]) for i in range(block_rows)]
            ie_ = [min(max(int(input_end[b, row0 + i]), s_[i]), e_[i]) for i in range(block_rows)]
            for split in range(splits):
                _block(q, k, v, b, kv_head, row0, block_rows, vectors, head0, s_, ie_, e_, split, splits, pitch,
                       scale_log2, part_stats, part_acc, flat_scores, keys, heads, rows)
    return part_stats, part_acc, scores


def _block(q, k, v, b, kv_head, row0, block_rows, vectors, head0, s_, ie_, e_, split, splits, pitch, scale_log2,
           part_stats, part_acc, flat_scores, keys, heads, rows):
    dim = q.shape[-1]
    dtype = q.dtype
    ksteps, ntiles = dim // 16, dim // 8
    # Q's A fragments: rows g and g + 8, vector m = head m // block_rows at row m % block_rows; zeros past vectors.
    q_flat = torch.zeros(ROWS, dim, dtype=dtype)
    for m in range(vectors):
        q_flat[m] = q[b, head0 + m // block_rows, row0 + m % block_rows]
    qa = []
    for ks in range(ksteps):
        regs = []
        for h, col in ((0, 16 * ks + 2 * T), (1, 16 * ks + 2 * T), (0, 16 * ks + 2 * T + 8), (1, 16 * ks + 2 * T + 8)):
            rows_ = G + 8 * h
            regs.append(torch.stack([q_flat[rows_, col], q_flat[rows_, col + 1]], 1))
        qa.append(torch.stack(regs, 1))
    # This thread's two vectors' ranges.
    lane_start, lane_input_end, lane_end = (torch.zeros(32, 2, dtype=torch.long) for _ in range(3))
    for h in range(2):
        m = G + 8 * h
        rr = m % block_rows
        real = m < vectors
        lane_start[:, h] = torch.where(real, torch.tensor(s_)[rr], 0)
        lane_input_end[:, h] = torch.where(real, torch.tensor(ie_)[rr], 0)
        lane_end[:, h] = torch.where(real, torch.tensor(e_)[rr], 0)
    attended_rows = [i for i in range(block_rows) if s_[i] < e_[i]]
    first = min((s_[i] for i in attended_rows), default=keys)
    last = max((e_[i] for i in attended_rows), default=0)
    first = min(first, last)
    tiles_per_split = _ceil_div(_ceil_div(last - first, TILE_KEYS), splits)
    begin = first + split * tiles_per_split * TILE_KEYS
    stop = min(last, begin + tiles_per_split * TILE_KEYS)
    tiles = -(-(stop - begin) // TILE_KEYS) if begin < stop else 0

    k_stages = torch.full((STAGES * TILE_KEYS * pitch,), math.nan, dtype=dtype)  # padding is never read
    v_stages = torch.full((STAGES * TILE_KEYS * pitch,), math.nan, dtype=dtype)

    def load_tile(tile):
        tile0 = begin + tile * TILE_KEYS
        base = (tile % STAGES) * TILE_KEYS * pitch
        for j in range(TILE_KEYS):
            inside = tile0 + j < stop
            row = slice(base + j * pitch, base + j * pitch + dim)
            k_stages[row] = k[b, kv_head, tile0 + j] if inside else 0
            if v is not None:
                v_stages[row] = v[b, kv_head, tile0 + j] if inside else 0

    for tile in range(STAGES - 1):
        if tile < tiles:
            load_tile(tile)
    m = torch.full((WARPS, 32, 2), -math.inf)
    l_, mg, lg = torch.zeros(WARPS, 32, 2), torch.full((WARPS, 32, 2), -math.inf), torch.zeros(WARPS, 32, 2)
    acc = torch.zeros(WARPS, ntiles, 32, 4)
    for tile in range(tiles):
        if tile + STAGES - 1 < tiles:
            load_tile(tile + STAGES - 1)
        for warp in range(WARPS):
            key0 = begin + tile * TILE_KEYS + 16 * warp
            k_tile = (tile % STAGES) * TILE_KEYS * pitch + 16 * warp * pitch
            s = []
            for nt in range(2):
                c = torch.zeros(32, 4)
                key_row = k_tile + (8 * nt + G) * pitch + 2 * T
                for ks in range(ksteps):
                    b0 = torch.stack([k_stages[key_row + 16 * ks], k_stages[key_row + 16 * ks + 1]], 1)
                    b1 = torch.stack([k_stages[key_row + 16 * ks + 8], k_stages[key_row + 16 * ks + 9]], 1)
                    c = mma16816(c, qa[ks], b0, b1)
                s.append(c)
            step_max = torch.full((32, 2), -math.inf)
            generated_max = torch.full((32, 2), -math.inf)
            for nt in range(2):
                for i in range(4):
                    h = i >> 1
                    key = key0 + 8 * nt + 2 * T + (i & 1)
                    attended = (key < stop) & (key >= lane_start[:, h]) & (key < lane_end[:, h])
                    score = torch.where(attended, s[nt][:, i] * scale_log2, -math.inf)
                    s[nt][:, i] = score
                    step_max[:, h] = torch.maximum(step_max[:, h], score)
                    generated = key >= lane_input_end[:, h]
                    generated_max[:, h] = torch.where(generated, torch.maximum(generated_max[:, h], score),
                                                      generated_max[:, h])
                    vector = G + 8 * h
                    row = (b * heads + head0 + vector // block_rows) * rows + row0 + vector % block_rows
                    where = attended.nonzero().flatten()
                    flat_scores[row[where] * keys + key[where]] = score[where]
            factor = torch.empty(32, 2)
            for h in range(2):
                step = _shfl_xor_max(step_max[:, h])
                gen = _shfl_xor_max(generated_max[:, h])
                new_m = torch.maximum(m[warp, :, h], step)
                factor[:, h] = _exp2_diff(m[warp, :, h], new_m)
                l_[warp, :, h] *= factor[:, h]
                m[warp, :, h] = new_m
                new_mg = torch.maximum(mg[warp, :, h], gen)
                lg[warp, :, h] *= _exp2_diff(mg[warp, :, h], new_mg)
                mg[warp, :, h] = new_mg
            pa = torch.empty(32, 4, 2, dtype=dtype)
            for nt in range(2):
                w = torch.empty(32, 4)
                for i in range(4):
                    h = i >> 1
                    key = key0 + 8 * nt + 2 * T + (i & 1)
                    w[:, i] = _exp2_diff(s[nt][:, i], m[warp, :, h])
                    l_[warp, :, h] += w[:, i]
                    lg[warp, :, h] += torch.where(key >= lane_input_end[:, h],
                                                  _exp2_diff(s[nt][:, i], mg[warp, :, h]), 0.0)
                pa[:, 2 * nt] = w[:, 0:2].to(dtype)
                pa[:, 2 * nt + 1] = w[:, 2:4].to(dtype)
            if v is not None:
                v_tile = (tile % STAGES) * TILE_KEYS * pitch + 16 * warp * pitch
                v_lane = v_tile + ((LANE & 7) + 8 * ((LANE >> 3) & 1)) * pitch + 8 * (LANE >> 4)
                for n in range(0, ntiles, 2):
                    vb = ldmatrix_x4_trans(v_stages, v_lane + 8 * n)
                    for i in range(4):
                        acc[warp, n, :, i] *= factor[:, i >> 1]
                        acc[warp, n + 1, :, i] *= factor[:, i >> 1]
                    acc[warp, n] = mma16816(acc[warp, n], pa, vb[:, 0], vb[:, 1])
                    acc[warp, n + 1] = mma16816(acc[warp, n + 1], pa, vb[:, 2], vb[:, 3])
    # Merge the warps' states through shared memory.
    merge_stats = torch.empty(WARPS, ROWS, 4)
    merge_acc = torch.empty(WARPS, ROWS, dim)
    for warp in range(WARPS):
        for h in range(2):
            at = G + 8 * h
            l_sum, lg_sum = _shfl_xor_sum(l_[warp, :, h]), _shfl_xor_sum(lg[warp, :, h])
            lead = T == 0
            merge_stats[warp, at[lead]] = torch.stack([m[warp, lead, h], l_sum[lead], mg[warp, lead, h],
                                                       lg_sum[lead]], 1)
            for n in range(ntiles):
                merge_acc[warp, at, 8 * n + 2 * T] = acc[warp, n, :, 2 * h]
                merge_acc[warp, at, 8 * n + 2 * T + 1] = acc[warp, n, :, 2 * h + 1]
    for vector in range(vectors):
        all_m, all_l, gen_m, gen_l = -math.inf, 0.0, -math.inf, 0.0
        for warp in range(WARPS):
            all_m, all_l = _merge(all_m, all_l, *merge_stats[warp, vector, 0:2].tolist())
            gen_m, gen_l = _merge(gen_m, gen_l, *merge_stats[warp, vector, 2:4].tolist())
        head, r = head0 + vector // block_rows, row0 + vector % block_rows
        part_stats[b, head, r, split] = torch.tensor([all_m, all_l, gen_m, gen_l])
        if part_acc is not None:
            weights = _exp2_diff(merge_stats[:, vector, 0], torch.tensor(all_m))
            part_acc[b, head, r, split] = (weights[:, None] * merge_acc[:, vector]).sum(0)


def _ceil_div(a, b):
    return -(-a // b)


def _merge(m, total, other_m, other_total):
    """SoftmaxState.merge."""
    top = max(m, other_m)
    if top == -math.inf:
        return m, total

    def weight(x):
        return 0.0 if x == -math.inf else 2.0 ** (x - top)

    return top, total * weight(m) + other_total * weight(other_m)


def combine(part_stats, part_acc):
    """combine_kernel without sinks: (lse (B, H, R) natural log, base-2 normaliser, generated mass, out or None)."""
    batch, heads, rows, splits, _ = part_stats.shape
    lse2 = torch.empty(batch, heads, rows)
    generated = torch.empty(batch, heads, rows)
    out = None if part_acc is None else torch.zeros(batch, heads, rows, part_acc.shape[-1])
    for index in torch.cartesian_prod(torch.arange(batch), torch.arange(heads), torch.arange(rows)).tolist():
        stats = part_stats[tuple(index)]
        all_m, all_l, gen_m, gen_l = -math.inf, 0.0, -math.inf, 0.0
        for s in range(splits):
            all_m, all_l = _merge(all_m, all_l, *stats[s, 0:2].tolist())
            gen_m, gen_l = _merge(gen_m, gen_l, *stats[s, 2:4].tolist())
        lse2[tuple(index)] = all_m + math.log2(all_l) if all_l > 0 else -math.inf
        generated[tuple(index)] = gen_l * 2.0 ** (gen_m - lse2[tuple(index)]) if gen_l > 0 else 0.0
        if out is not None and all_l > 0:
            weights = torch.tensor([0.0 if x == -math.inf else 2.0 ** (x - all_m) for x in stats[:, 0].tolist()])
            out[tuple(index)] = (weights[:, None] * part_acc[tuple(index)]).sum(0) / all_l
    return lse2 / LOG2E, lse2, generated, out
