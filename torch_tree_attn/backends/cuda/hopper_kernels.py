"""A Hopper (sm_90) main pass for tree attention, in Gluon: TMA producer warp, mbarrier ring,
async warpgroup MMAs with the next tile's Q.K^T in flight during this tile's softmax.

Same contract and the same split/LSE semantics as the portable Triton main kernel
(torch_tree_attn/backends/cuda/triton_kernels.py, ``_tree_attn_main``): with one split it writes the final
output and lse; with several it writes the (O, max, sum) partials in the Triton kernel's
layout, which ``triton_kernels._tree_attn_reduce`` merges unchanged.

Tiling plan
===========

Program = (row block ``pid_m``, batch row x kv head ``bh``, key split ``split``); grid
``(ceil(G*T / BLOCK_M), B*Hkv, num_splits)``. The rows of a kv head are its G x T (query head,
tree node) pairs stacked (row r = query head kvh*G + r // T, tree node r % T), so a program
owns BLOCK_M of them and every K/V byte it reads serves all of them: each K/V byte is read
``ceil(G*T / BLOCK_M)`` times per call (once per row block; BLOCK_M = 128: twice at the
reference shape Hq=32, Hkv=8, T=64; the second read mostly hits L2 since the row blocks of a
kv head run concurrently).

Warps of a program (``gl.warp_specialize``):

- default partition, the consumers: ``CONSUMER_WARPS`` = 4 or 8 warps = 1 or 2 warpgroups.
  Up to D=256, BLOCK_M = 16 * CONSUMER_WARPS rows (warpgroup w owns rows [64w, 64w + 64) of
  the block). At D=512 (``d_split``: a 64 x 512 float32 accumulator is 256 registers a
  thread, past one warpgroup's) the two warpgroups share BLOCK_M = 64 rows and split the
  columns: warpgroup g holds output columns [256g, 256g + 256) and computes score columns
  [g, g + 1) * BLOCK_N / 2 over the whole D (MMA layouts with warps_per_cta [4, 2]); the row
  max and sum reduce across the two through shared memory, and P is converted whole into
  each warpgroup's P.V operand. K/V bytes are read from shared memory once per warpgroup.
  They load Q once (plain masked loads: any strides, rows past G*T are 0) into shared
  memory, run every MMA (warpgroup_mma: Q.K^T with Q and K from shared memory, P.V with P
  from registers and V from shared memory), the online softmax in float32 (log2 units, the
  Triton kernel's per-row power-of-two mode for huge finite scores), the window tiles'
  masks, and the epilogue (final out + lse, or the split's partials).
- worker partition, the producer: 1 warp (``PRODUCER_REGS`` registers, setmaxnreg), issues
  the TMA loads of K and V tiles (BLOCK_N keys x D, 4-D descriptors over [B, Hkv, S, D]
  with the tensors' own strides) into a ring of ``STAGES`` shared-memory slots.

Registers: the kernel is compiled with maxnreg = 168 (8 consumer warps: 12 warps with the
producer's warpgroup, 168 * 384 <= 65536) or 128 (4 consumer warps: 8 warps, two programs per
SM); the producer's warpgroup drops to PRODUCER_REGS and the consumers get the rest (240 / 232).

Pipeline (per K/V slot s: k_ready/v_ready = TMA landed (expect-tx), k_empty/v_empty =
consumers done with the slot; tile i uses slot i % STAGES with phase (i // STAGES) & 1):

    producer, tile i:  wait k_empty[s] (phase ^ 1); expect + TMA K_i -> k_ready[s]
                       wait v_empty[s] (phase ^ 1); expect + TMA V_i -> v_ready[s]
    consumers:         S_0 = Q K_0^T; wait; release K_0; softmax_0 -> P_0
                       for i in 0 .. n-2:
                           issue S_{i+1} = Q K_{i+1}^T          (async, tensor cores)
                           issue O += P_i V_i                   (async, queued behind it)
                           wait until S_{i+1} is done (1 group outstanding); release K_{i+1}
                           softmax_{i+1} -> P_{i+1}, alpha      (CUDA cores, under P_i V_i)
                           wait for P_i V_i; release V_i; O *= alpha
                       O += P_{n-1} V_{n-1}; wait; release V_{n-1}

so the tensor cores run the next Q.K^T and this tile's P.V while the warpgroup computes the
exponentials. Each K/V tile is read from global memory once per program (TMA), from shared
memory by the MMAs only.

Keys and splits (identical to the Triton kernel, so partials merge the same way): keys [0,
kend), kend = min(off + M, S) with off clamped to [0, S] on the device. Prefix tiles (BLOCK_N
keys entirely below off, ``n_prefix = off // BLOCK_N``) are shared out in equal work with the
window (``window_units`` tiles' worth) over the splits; the last split runs the window tiles
[n_prefix, ceil(kend / BLOCK_N)) after its prefix tiles. A program's tiles are therefore one
contiguous range [t_lo, t_hi) of BLOCK_N-key tiles; tile t is a window tile iff t >= n_prefix.

- Prefix tiles run unmasked: raw scores, the row max taken before scaling, each exponent one
  FMA; a non-finite raw score (or one that overflows once scaled) poisons its row through
  ``max|s| * scale * 0`` added to the row sum, and a non-finite V row through P.V.
- Window tiles (1 or 2 per program at T <= BLOCK_N) load the mask tile (bool or float bias,
  any broadcast strides) in the MMA accumulator's layout and select: unseen entries get
  -inf. TMA reads whole tiles, so rows at or past kend may hold anything (NaN in the tests):
  K rows only reach their own score column, which the selection replaces by -inf; V rows
  are fixed in shared memory before P.V: every V row at or past kend or not finite is
  zeroed (after the TMA landed, before the MMA reads it, with a proxy fence), and a
  non-finite V row below kend poisons, through its score column, exactly the rows that see
  it (the Triton kernel's propagation rule). Slots past S are zero-filled by TMA.
- Sinks and softcap: as the Triton kernel (sinks at the write-out, softcap on the scaled
  score before the bias; compile-time HAS_SOFTCAP).

Variants (constexpr): D in {64, 128, 256, 512}, float16/bfloat16 Q = K/V, bool or float
mask, softcap on/off, BLOCK_N 16..64, STAGES 2..4, CONSUMER_WARPS 4 or 8 (8 at D=512). Not
covered (``covers()`` is False, the caller falls back to the Triton kernel): float32 queries
(a 3xTF32 split would add hi/lo operand tiles: Q hi/lo in shared memory, K/V split by the
consumers into hi/lo slots), D = 96, K/V whose base or strides are not 16-byte multiples
(TMA), S >= 2^31.

Resources (triton 3.6, sm_90a, ptxas -v): 0 spills for the D=64/128/256 defaults (D=512:
136-152 bytes of loop-invariant scalars, the consumers at R237 of 240); the consumers
use up to R192 (D=128, bool mask) / R235 (float mask + softcap) of their 240 registers. Shared memory: Q (BLOCK_M x D) + STAGES x (K + V tiles) +
barriers: 131,452 bytes at D=128 with 3 stages (1 program per SM), 98,628 with 2; 82,308 at
D=64 with 4 stages. 384 threads per program with 8 consumer warps (the producer's warp is
padded to a warpgroup), 256 with 4.

Launching it from C++ (compile_variant() gives the cubin; function ``_tree_attn_main_sm90``):
grid (ceil(G*T / BLOCK_M), B*Hkv, num_splits); block 32 * metadata.num_warps threads (384);
dynamic shared memory metadata.shared (set CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES);
49 parameters, in order:

    0  Q (pointer, the query times sign(scale))
    1  K tensor map: a CUtensorMap (128 bytes, 64-byte aligned, by value), then
    2-5    its shape as 4 x int32 (B, Hkv, S, D) and 6-9 its strides as 4 x int64 (elements)
    10 V tensor map, 11-14 shape, 15-18 strides (as K)
    19 MASK (uint8 view of a bool mask, or float32), 20 OFF (int32 words: an int64 offsets
       tensor is passed as is, off_kind says how to read it), 21 SINK (float32), 22 OUT,
       23 LSE, 24 PO, 25 PM, 26 PL (as the Triton main kernel)
    27-29 sq0..sq2, 30-33 sm0..sm3 (element strides, 0 along size-1 dimensions; int32, or
       int64 when compiled ``wide``)
    34-44 Hkv, G, T, S, M, R = G*T, total_rows, num_splits, window_units, off_kind, has_sink
    45 scale_abs, 46 softcap (float32, 1.0 when off)
    47, 48 triton's global and profile scratch pointers (null: the kernel needs neither)

The tensor maps: cuTensorMapEncodeTiled(dtype BFLOAT16 / FLOAT16, rank 4, base = K's data
pointer, globalDim = {D, S, Hkv, B} (innermost first), globalStrides = {stride(2),
stride(1), stride(0)} in bytes (a size-1 dimension may take any 16-byte multiple),
boxDim = metadata.tensordesc_meta[i]["block_size"] reversed = {64, BLOCK_N, 1, 1} (64
elements = the 128-byte swizzle width: the kernel issues two boxes per D=128 tile),
elementStrides {1, 1, 1, 1}, INTERLEAVE_NONE, SWIZZLE_128B (meta "swizzle" 3), L2
promotion 128B, OOB fill NONE (zeros)); see _tma_strides() for the size-1 strides. The
tensor maps hold K/V's addresses, so a CUDA graph replays with the captured cache
tensors (static caches), exactly as the pointers of the Triton kernel.
"""
import math
from typing import Optional, Tuple

import torch

try:  # Gluon and its Hopper module: triton >= 3.5 (the kernels below are written against 3.6)
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    HAVE_GLUON = True
except Exception:  # pragma: no cover - no triton, or a triton without Gluon's Hopper module
    HAVE_GLUON = False

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
FLOAT32_MAX = 3.4028234663852886e38
BIG = 67108864.0  # 2^26, as triton_kernels.BIG

# Supported cases (covers()).
HEAD_DIMS = (64, 128, 256, 512)
DTYPES = (torch.float16, torch.bfloat16)

# Default configuration: (CONSUMER_WARPS, BLOCK_N, STAGES) per D.
DEFAULT_CONFIG = {64: (4, 64, 3), 128: (4, 64, 2), 256: (4, 32, 3), 512: (8, 32, 2)}   # = csrc/cuda/tile_configs.def (a test holds them equal)
PRODUCER_REGS = 24
# The window's cost in prefix tiles per window tile (the split balance; masks, selections and
# the V fix-up make a window tile dearer than a prefix tile).
WINDOW_COST = 2.0


SHARED_PER_SM = 233472          # 228 KiB (sm_90) = triton_plan.h kSharedPerSm
SHARED_RESERVE_PER_BLOCK = 1024


# Above this head dim one warpgroup's registers cannot hold a 64-row float32 accumulator
# (64 x 512 floats = 256 a thread): two consumer warpgroups share the rows, each owning half
# of the output's (and of the scores') columns.
MAX_D_ONE_WARPGROUP = 256


def d_split(head_dim: int) -> int:
    """Warpgroups sharing one 64-row slice of the block (= triton_plan.cpp hopper_d_split)."""
    return 2 if head_dim > MAX_D_ONE_WARPGROUP else 1


def block_m_for(head_dim: int, consumer_warps: int) -> int:
    """BLOCK_M: 16 rows per consumer warp, over the warpgroups that split D
    (= triton_plan.cpp hopper_block_m). A D split takes exactly two warpgroups."""
    if d_split(head_dim) > 1 and consumer_warps != 8:
        raise ValueError(f"head dim {head_dim} needs 8 consumer warps (two warpgroups split D), got {consumer_warps}")
    return 16 * consumer_warps // d_split(head_dim)


def programs_per_sm(head_dim: int, consumer_warps: int, block_n: int, stages: int) -> int:
    """Programs one SM holds (= triton_plan.cpp hopper_programs_per_sm, which the C++ plan
    uses; this mirror serves the build, which runs before the extension exists): two with
    four consumer warps whose shared memory (Q, then STAGES K and V tiles, 16-bit) fits twice
    beside the per-block reserve, else one."""
    shared = 2 * (block_m_for(head_dim, consumer_warps) * head_dim + 2 * stages * block_n * head_dim)
    fits_twice = 2 * (shared + SHARED_RESERVE_PER_BLOCK) <= SHARED_PER_SM
    return 2 if consumer_warps == 4 and fits_twice else 1


def maxnreg_for(consumer_warps: int, per_sm: int = 1) -> int:
    """The kernel's maxnreg: what the SM's 64K registers allow for the padded warp count (the
    producer's warp takes a whole warpgroup) and per_sm programs, a multiple of 8 up to 248
    (setmaxnreg's granule; 256 is past ptxas's 255)."""
    warps = consumer_warps + 4
    per_thread = 65536 // (warps * 32 * per_sm)
    return min(248, per_thread // 8 * 8)


if HAVE_GLUON:
    _LOG2E = gl.constexpr(LOG2E)
    _LN2 = gl.constexpr(LN2)
    _FMAX = gl.constexpr(FLOAT32_MAX)
    _BIG = gl.constexpr(BIG)
    # A CTA-partition barrier (bar.sync over the partition's warps): thread_barrier in triton
    # 3.6, renamed barrier in later releases.
    _partition_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    # The TMA global -> shared copy: async_copy_global_to_shared in 3.6, async_load later.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

    @gluon.constexpr_function
    def _row_blocked(rows, cols, num_warps):
        """A blocked layout for a [rows, cols] 16-bit tile: 8 contiguous elements (16 bytes)
        per thread along the row, a warp covering whole rows."""
        vec = 8
        tpw_c = min(cols // vec, 32)
        tpw_r = 32 // tpw_c
        return gl.BlockedLayout([1, vec], [tpw_r, tpw_c], [num_warps, 1], [1, 0])

    @gluon.jit
    def _tanh(x):
        """tanh to a few ulp of relative error (triton_kernels._tanh, the same fit)."""
        a = gl.abs(x)
        u = x * x
        p = -5.704991985e-3 * u + 2.063909359e-2
        p = p * u - 5.373971909e-2
        p = p * u + 1.333144158e-1
        p = p * u - 3.333328068e-1
        small = x + (x * u) * p
        e = gl.exp2(a * (-2.0 * _LOG2E))
        t = (1.0 - e) / (1.0 + e)
        big = gl.where(x < 0, -t, t)
        return gl.where(a < 0.625, small, big)

    @gluon.jit
    def _not_finite(x):
        return ~(gl.abs(x) < float("inf"))

    @gluon.jit
    def _softmax_update(s, cn, cb, m_n, m_b, l_i, EMPTY_ROWS: gl.constexpr):
        """triton_kernels._online_softmax_step without the P.V: the tile's probabilities p
        (float32, s's layout), the rescale alpha of the rows' old state, and the new state."""
        t_max = gl.max(s, axis=1)
        m_n_new = gl.maximum(m_n, t_max * cn)
        m_b_new = gl.maximum(m_b, t_max * cb)
        big = gl.abs(m_n_new) >= _BIG
        c_row = gl.where(big, cb, cn)
        m_ref = gl.where(big, m_b_new, m_n_new)
        m_old = gl.where(big, m_b, m_n)
        if EMPTY_ROWS:
            m_ref = gl.where(m_ref == float("-inf"), 0.0, m_ref)
        p = gl.exp2(gl.fma(s, gl.expand_dims(c_row, 1), -gl.expand_dims(m_ref, 1)))
        alpha = gl.exp2(m_old - m_ref)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return p, alpha, m_n_new, m_b_new, l_i

    @gluon.jit
    def _natural_state(m_n, m_b):
        big = gl.abs(m_n) >= _BIG
        m_nat = gl.where(big, m_b, m_n * _LN2)
        d = gl.where(big, 0.0, gl.fma(-m_nat, _LOG2E, m_n))
        return m_nat, d

    @gluon.jit
    def _finalize(acc, m, d, l_i, poison, sink_ptr, h, row_ok, has_sink):
        """triton_kernels._finalize (the same arithmetic)."""
        seen_any = l_i > 0
        l_safe = gl.where(seen_any, l_i, 1.0)
        keys_lse = gl.where(seen_any, m + (gl.log2(l_safe) + d) * _LN2, float("-inf"))
        if has_sink != 0:
            sink = gl.load(sink_ptr + h, mask=row_ok, other=float("-inf"))
            poison = poison | ((sink != sink) | (sink == float("inf"))).to(gl.int32)
            sink_n = gl.where(sink == sink, sink, float("-inf"))
            hi = gl.maximum(keys_lse, sink_n)
            lo = gl.minimum(keys_lse, sink_n)
            hi_safe = gl.where(hi == float("-inf"), 0.0, hi)
            lse = gl.where(hi == float("-inf"), float("-inf"),
                           hi + gl.log2(1.0 + gl.exp2((lo - hi_safe) * _LOG2E)) * _LN2)
            lse_safe = gl.where(lse == float("-inf"), 0.0, lse)
            weight = gl.where(seen_any, gl.exp2(d + (m - lse_safe) * _LOG2E), 0.0)
            lse = gl.where(seen_any, lse, sink)
        else:
            weight = gl.where(seen_any, 1.0 / l_safe, 0.0)
            lse = keys_lse
        out = acc * gl.expand_dims(weight, 1)
        bad = poison != 0
        out = gl.where(gl.expand_dims(bad, 1), float("nan"), out)
        lse = gl.where(bad, float("nan"), lse)
        return out, lse

    @gluon.jit
    def _fix_window_v(v_slot, key0, kend, BLOCK_N: gl.constexpr, D: gl.constexpr, s_layout: gl.constexpr,
                      num_warps: gl.constexpr):
        """A window tile's V in shared memory, before P.V reads it: rows at or past kend (which
        TMA read whatever they hold) and rows that are not finite become 0, so that 0 * NaN
        never reaches a row that does not see them. Returns, per key in the score columns'
        layout, NaN for a non-finite V row below kend (it poisons exactly the rows that see
        it), else 0."""
        v_layout: gl.constexpr = _row_blocked(BLOCK_N, D, num_warps)
        v = v_slot.load(v_layout)
        keys = key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, v_layout))
        nonfin = gl.max(_not_finite(v.to(gl.float32)).to(gl.int32), axis=1) != 0
        drop = nonfin | (keys >= kend)
        v = gl.where(gl.expand_dims(drop, 1), gl.zeros_like(v), v)
        v_slot.store(v)
        # Generic-proxy writes, then the async proxy (wgmma) reads: fence, and all consumer
        # warps' writes before any warpgroup's MMA.
        fence_async_shared()
        _partition_barrier()
        v_nan = gl.where(nonfin & (keys < kend), float("nan"), 0.0)
        return gl.convert_layout(v_nan, gl.SliceLayout(0, s_layout))

    @gluon.jit
    def _score_tile(s, t, v_slot, v_bar, v_phase, m_n, m_b, l_i, rows_ok, m_row_base, sm3, off, kend, n_prefix,
                    scale_abs, c_pre, P_pre, to_nat, softcap, inv_cap, x_per_raw,
                    BLOCK_N: gl.constexpr, D: gl.constexpr, MASK_FLOAT: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
                    s_layout: gl.constexpr, num_warps: gl.constexpr):
        """The softmax of key tile t from its raw scores s = Q.K^T (float32, s_layout): the
        probabilities, the rows' rescale and new state."""
        if t < n_prefix:
            # Prefix tile: every key < off <= S, every row sees every key.
            s_poison = gl.max(gl.abs(s), axis=1) * scale_abs * 0.0
            if HAS_SOFTCAP:
                s = softcap * _tanh(s * x_per_raw)
                p, alpha, m_n, m_b, l_i = _softmax_update(s, _LOG2E, 1.0, m_n, m_b, l_i, False)
            else:
                p, alpha, m_n, m_b, l_i = _softmax_update(s, c_pre, P_pre, m_n, m_b, l_i, False)
            l_i = l_i + s_poison
        else:
            # Window tile: keys [t*BLOCK_N, +BLOCK_N), the mask decides in [off, kend).
            if not HAS_SOFTCAP:
                # The running max's exact part moves from raw * P to natural units at the
                # first window tile (the Triton kernel does it after its prefix loop).
                m_b = m_b * gl.where(t == n_prefix, to_nat, 1.0)
            key0 = t * BLOCK_N
            mbarrier.wait(v_bar, v_phase)
            v_nan = _fix_window_v(v_slot, key0, kend, BLOCK_N, D, s_layout, num_warps)
            keys = key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            in_win = (keys >= off) & (keys < kend)
            col = (keys - off).to(gl.int64)
            win2 = gl.expand_dims(rows_ok, 1) & gl.expand_dims(in_win, 0)
            m_ptrs = gl.expand_dims(m_row_base, 1) + gl.expand_dims(col * sm3, 0)
            if MASK_FLOAT:
                bias = gl.load(m_ptrs, mask=win2, other=float("-inf"))
                seen_w = win2 & (bias != float("-inf"))
            else:
                mb = gl.load(m_ptrs, mask=win2, other=0)
                seen_w = win2 & (mb != 0)
            seen = seen_w | (gl.expand_dims(rows_ok, 1) & gl.expand_dims(keys < off, 0))
            # Poison without a tile of its own (registers: the float-mask + softcap variant
            # would spill at 4 consumer warps): s + s * 0 is s, or NaN for a non-finite score;
            # bias + bias * 0 is bias, or NaN for +inf; v_nan is 0, or NaN for a key whose V
            # row is not finite. Finite inputs give the same bits as adding nothing.
            s = s * scale_abs
            s = s + s * 0.0
            if MASK_FLOAT:
                bias = gl.where(seen_w, bias, 0.0)
                bias = bias + bias * 0.0 + gl.expand_dims(v_nan, 0)
            if HAS_SOFTCAP:
                s = softcap * _tanh(s * inv_cap)
            if MASK_FLOAT:
                s = s + bias
            else:
                s = s + gl.expand_dims(v_nan, 0)
            s = gl.where(seen, s, float("-inf"))
            p, alpha, m_n, m_b, l_i = _softmax_update(s, _LOG2E, 1.0, m_n, m_b, l_i, True)
        return p, alpha, m_n, m_b, l_i

    @gluon.jit
    def _consumer(Q, MASK, SINK, OUT, LSE, PO, PM, PL, q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
                  sq0, sq1, sq2, sm0, sm1, sm2, sm3, b, kvh, bh, pid_m, split, G, T, R, total_rows, num_splits,
                  has_sink, off, kend, n_prefix, t_lo, n_tiles, scale_abs, softcap,
                  D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  MASK_FLOAT: gl.constexpr, HAS_SOFTCAP: gl.constexpr):
        num_warps: gl.constexpr = gl.num_warps()
        dtype: gl.constexpr = q_smem.dtype
        # D_SPLIT warpgroups share each 64-row slice: warpgroup g of a slice owns score columns
        # [g, g+1) * BLOCK_N / D_SPLIT and output columns [g, g+1) * D / D_SPLIT.
        D_SPLIT: gl.constexpr = 16 * num_warps // BLOCK_M
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0],
                                                           warps_per_cta=[num_warps // D_SPLIT, D_SPLIT],
                                                           instr_shape=[16, BLOCK_N // D_SPLIT, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0],
                                                           warps_per_cta=[num_warps // D_SPLIT, D_SPLIT],
                                                           instr_shape=[16, D // D_SPLIT, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        q_layout: gl.constexpr = _row_blocked(BLOCK_M, D, num_warps)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        # Q once: rows r of the block are (query head kvh*G + r // T, node r % T).
        rq = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_layout))
        dq = gl.arange(0, D, layout=gl.SliceLayout(0, q_layout))
        hq = kvh.to(gl.int64) * G + rq // T
        q_row = b.to(gl.int64) * sq0 + hq * sq1 + (rq % T).to(gl.int64) * sq2
        q_ptrs = Q + gl.expand_dims(q_row, 1) + gl.expand_dims(dq, 0)
        q = gl.load(q_ptrs, mask=gl.expand_dims(rq < R, 1), other=0.0)
        q_smem.store(q)
        fence_async_shared()
        _partition_barrier()

        # Per-row mask base pointers, in the score tile's row layout.
        rows = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_s)
        rows_ok = rows < R
        hs = kvh.to(gl.int64) * G + rows // T
        m_row_base = MASK + b.to(gl.int64) * sm0 + hs * sm1 + (rows % T).to(gl.int64) * sm2

        # |scale| = P * to_nat, P a power of two (triton_kernels._tree_attn_main).
        c_pre = scale_abs * _LOG2E
        scale_bits = scale_abs.to(gl.int32, bitcast=True)
        P_pre = (scale_bits & 0x7F800000).to(gl.float32, bitcast=True)
        to_nat = ((scale_bits & 0x007FFFFF) | 0x3F800000).to(gl.float32, bitcast=True)
        inv_cap = gl.minimum(1.0 / softcap, _FMAX)
        inv_cap = gl.minimum(gl.fma(inv_cap, gl.fma(-softcap, inv_cap, 1.0), inv_cap), _FMAX)
        x_per_raw = gl.minimum(scale_abs * inv_cap, _FMAX)

        m_n = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
        m_b = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
        o = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

        if n_tiles > 0:
            # Tile 0's scores and softmax.
            mbarrier.wait(k_ready.index(0), 0)
            k_t = k_bufs.index(0).reshape([BLOCK_N, D]).permute((1, 0))
            s = warpgroup_mma(q_smem, k_t, s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
            mbarrier.arrive(k_empty.index(0), count=1)
            p, alpha, m_n, m_b, l_i = _score_tile(s, t_lo, v_bufs.index(0).reshape([BLOCK_N, D]), v_ready.index(0),
                                                  0, m_n, m_b, l_i, rows_ok, m_row_base, sm3, off, kend, n_prefix,
                                                  scale_abs, c_pre, P_pre, to_nat, softcap, inv_cap, x_per_raw,
                                                  BLOCK_N, D, MASK_FLOAT, HAS_SOFTCAP, s_layout, num_warps)
            for i in range(n_tiles - 1):
                cur = i % STAGES
                cur_phase = (i // STAGES) & 1
                nxt = (i + 1) % STAGES
                nxt_phase = ((i + 1) // STAGES) & 1
                # The next tile's Q.K^T, then this tile's P.V behind it, both async.
                mbarrier.wait(k_ready.index(nxt), nxt_phase)
                k_t = k_bufs.index(nxt).reshape([BLOCK_N, D]).permute((1, 0))
                s = warpgroup_mma(q_smem, k_t, s_zero, use_acc=False, is_async=True)
                mbarrier.wait(v_ready.index(cur), cur_phase)
                p_op = gl.convert_layout(p.to(dtype), p_layout)
                o = warpgroup_mma(p_op, v_bufs.index(cur).reshape([BLOCK_N, D]), o, is_async=True)
                # Q.K^T done (P.V may still run): release K, softmax under the P.V.
                s = warpgroup_mma_wait(num_outstanding=1, deps=[s])
                mbarrier.arrive(k_empty.index(nxt), count=1)
                p, alpha, m_n, m_b, l_i = _score_tile(s, t_lo + i + 1, v_bufs.index(nxt).reshape([BLOCK_N, D]),
                                                      v_ready.index(nxt), nxt_phase, m_n, m_b, l_i, rows_ok,
                                                      m_row_base, sm3, off, kend, n_prefix, scale_abs, c_pre, P_pre,
                                                      to_nat, softcap, inv_cap, x_per_raw, BLOCK_N, D, MASK_FLOAT,
                                                      HAS_SOFTCAP, s_layout, num_warps)
                o, p_op = warpgroup_mma_wait(num_outstanding=0, deps=[o, p_op])
                mbarrier.arrive(v_empty.index(cur), count=1)
                o = o * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            last = n_tiles - 1
            cur = last % STAGES
            mbarrier.wait(v_ready.index(cur), (last // STAGES) & 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            o = warpgroup_mma(p_op, v_bufs.index(cur).reshape([BLOCK_N, D]), o, is_async=True)
            o, p_op = warpgroup_mma_wait(num_outstanding=0, deps=[o, p_op])
            mbarrier.arrive(v_empty.index(cur), count=1)
        if not HAS_SOFTCAP:
            # No window tile ran here: the exact max is still in raw * P units.
            m_b = m_b * gl.where(t_lo + n_tiles > n_prefix, 1.0, to_nat)

        # Epilogue, in the accumulator's layout.
        poison = _not_finite(l_i).to(gl.int32)
        poison = gl.convert_layout(poison, row_o) | gl.max(_not_finite(o).to(gl.int32), axis=1)
        m_nat, d_exp = _natural_state(m_n, m_b)
        m_nat = gl.convert_layout(m_nat, row_o)
        d_exp = gl.convert_layout(d_exp, row_o)
        l_o = gl.convert_layout(l_i, row_o)
        ro = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_o)
        ro_ok = ro < R
        do = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        flat = bh.to(gl.int64) * R + ro
        io_mask = gl.expand_dims(ro_ok, 1) & gl.expand_dims(do < D, 0)
        if num_splits == 1:
            h = kvh.to(gl.int64) * G + ro // T
            out, lse = _finalize(o, m_nat, d_exp, l_o, poison, SINK, h, ro_ok, has_sink)
            gl.store(OUT + gl.expand_dims(flat * D, 1) + gl.expand_dims(do, 0), out.to(OUT.dtype.element_ty),
                     mask=io_mask)
            gl.store(LSE + flat, lse, mask=ro_ok)
        else:
            part = split.to(gl.int64) * total_rows + flat
            to_e = gl.exp2(d_exp)
            gl.store(PO + gl.expand_dims(part * D, 1) + gl.expand_dims(do, 0), o * gl.expand_dims(to_e, 1),
                     mask=io_mask)
            gl.store(PM + part, gl.where(poison != 0, float("nan"), m_nat), mask=ro_ok)
            gl.store(PL + part, l_o * to_e, mask=ro_ok)

    @gluon.jit
    def _producer(k_desc, v_desc, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, b, kvh, t_lo, n_tiles,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """One warp: the TMA loads of the program's K/V tiles into the slot ring."""
        for i in range(n_tiles):
            slot = i % STAGES
            phase = (i // STAGES) & 1
            key0 = (t_lo + i) * BLOCK_N
            mbarrier.wait(k_empty.index(slot), phase ^ 1)
            mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
            _tma_load(k_desc, [b, kvh, key0, 0], k_ready.index(slot), k_bufs.index(slot))
            mbarrier.wait(v_empty.index(slot), phase ^ 1)
            mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
            _tma_load(v_desc, [b, kvh, key0, 0], v_ready.index(slot), v_bufs.index(slot))

    @gluon.jit(do_not_specialize=["Hkv", "G", "T", "S", "M", "R", "total_rows", "num_splits", "window_units",
                                  "off_kind", "has_sink"])
    def _tree_attn_main_sm90(
        Q, k_desc, v_desc, MASK, OFF, SINK, OUT, LSE, PO, PM, PL,
        sq0, sq1, sq2, sm0, sm1, sm2, sm3,
        Hkv, G, T, S, M, R, total_rows, num_splits, window_units, off_kind, has_sink,
        scale_abs, softcap,
        D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        MASK_FLOAT: gl.constexpr, HAS_SOFTCAP: gl.constexpr, PRODUCER_REGS_: gl.constexpr,
    ):
        """Main pass (see the module's plan). Q is the query times sign(scale), as for the
        Triton kernel; k_desc / v_desc: TMA descriptors over [B, Hkv, S, D] with block
        [1, 1, BLOCK_N, D]."""
        gl.static_assert((BLOCK_M == 16 * gl.num_warps()) | ((BLOCK_M == 64) & (gl.num_warps() == 8)),
                         "BLOCK_M is 16 rows per consumer warp, or 64 rows shared by two warpgroups (D split)")
        pid_m = gl.program_id(0)
        bh = gl.program_id(1)
        split = gl.program_id(2)
        b = (bh // Hkv).to(gl.int32)   # B * Hkv <= 65535 (the grid): int32 whatever Hkv's width
        kvh = (bh % Hkv).to(gl.int32)

        # Key indices are int32 (S < 2^31 is covered), whatever width the sizes came in
        # (compiled ``wide``: int64 sizes and strides for a huge query or mask).
        S32 = S.to(gl.int32)
        off = pid_m * 0
        if off_kind == 1:
            off = gl.load(OFF.to(gl.pointer_type(gl.int32)) + b)
        elif off_kind == 2:
            off = gl.minimum(gl.maximum(gl.load(OFF.to(gl.pointer_type(gl.int64)) + b), -1), S).to(gl.int32)
        off = gl.minimum(gl.maximum(off, 0), S32)
        kend = gl.minimum(off.to(gl.int64) + M, S).to(gl.int32)
        n_prefix = off // BLOCK_N
        per_split = gl.cdiv(n_prefix + window_units, num_splits)
        p_lo = split * per_split
        is_last = split == num_splits - 1
        p_hi = gl.minimum(p_lo + per_split, n_prefix)
        t_lo = gl.where(is_last, gl.minimum(p_lo, n_prefix), p_lo)
        t_hi = gl.where(is_last, gl.cdiv(kend, BLOCK_N), gl.maximum(p_hi, p_lo))
        n_tiles = gl.maximum(t_hi - t_lo, 0).to(gl.int32)
        t_lo = t_lo.to(gl.int32)
        n_prefix = n_prefix.to(gl.int32)

        dtype: gl.constexpr = k_desc.dtype
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], dtype)
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D], q_layout)
        k_bufs = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=1)

        gl.warp_specialize([
            (_consumer, (Q, MASK, SINK, OUT, LSE, PO, PM, PL, q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready,
                         v_empty, sq0, sq1, sq2, sm0, sm1, sm2, sm3, b, kvh, bh, pid_m, split, G, T, R, total_rows,
                         num_splits, has_sink, off, kend, n_prefix, t_lo, n_tiles, scale_abs, softcap, D, BLOCK_M,
                         BLOCK_N, STAGES, MASK_FLOAT, HAS_SOFTCAP)),
            (_producer, (k_desc, v_desc, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, b, kvh, t_lo, n_tiles,
                         BLOCK_N, STAGES)),
        ], [1], [PRODUCER_REGS_])


# ---------------------------------------------------------------------------------------
# Compilation (ahead of time, no GPU needed) and the kernel's parameter list.

_TORCH_TO_TRITON = {torch.float16: "fp16", torch.bfloat16: "bf16"}
_GL_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


def kv_descriptor_layout(dtype_name: str, block_n: int, head_dim: int):
    """The NVMMA shared layout of a K/V TMA block [1, 1, BLOCK_N, D] (and of its ring slots)."""
    return gl.NVMMASharedLayout.get_default_for([1, 1, block_n, head_dim], getattr(gl, _GL_DTYPES[dtype_name]))


def signature(dtype_name: str, head_dim: int, block_n: int, mask_float: bool, wide: bool = False) -> dict:
    """The kernel's signature for triton.compile: argument name -> type ("constexpr" for the
    compile-time ones). The descriptors' type string names the block and its layout."""
    layout = kv_descriptor_layout(dtype_name, block_n, head_dim)
    desc = f"tensordesc<{dtype_name}[1, 1, {block_n}, {head_dim}],{layout!r}>"
    int_t = "i64" if wide else "i32"
    sig = dict(Q="*" + dtype_name, k_desc=desc, v_desc=desc, MASK="*fp32" if mask_float else "*u8", OFF="*i32",
               SINK="*fp32", OUT="*" + dtype_name, LSE="*fp32", PO="*fp32", PM="*fp32", PL="*fp32")
    for name in ("sq0", "sq1", "sq2", "sm0", "sm1", "sm2", "sm3", "Hkv", "G", "T", "S", "M", "R", "total_rows",
                 "num_splits", "window_units", "off_kind", "has_sink"):
        sig[name] = int_t
    sig["scale_abs"] = "fp32"
    sig["softcap"] = "fp32"
    for name in ("D", "BLOCK_M", "BLOCK_N", "STAGES", "MASK_FLOAT", "HAS_SOFTCAP", "PRODUCER_REGS_"):
        sig[name] = "constexpr"
    return sig


def compile_variant(dtype_name: str = "bf16", head_dim: int = 128, mask_float: bool = False, softcap: bool = False,
                    consumer_warps: Optional[int] = None, block_n: Optional[int] = None,
                    stages: Optional[int] = None, arch: int = 90, wide: bool = False, aligned: bool = True):
    """One variant, compiled by Triton for sm_<arch>a without a GPU: triton's CompiledKernel
    (.asm["ptx"], ["cubin"], ["ttgir"]; .metadata.shared, .metadata.tensordesc_meta)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cw, bn, st = DEFAULT_CONFIG[head_dim]
    cw = consumer_warps or cw
    bn = block_n or bn
    st = stages or st
    sig = signature(dtype_name, head_dim, bn, mask_float, wide)
    constexprs = dict(D=head_dim, BLOCK_M=block_m_for(head_dim, cw), BLOCK_N=bn, STAGES=st, MASK_FLOAT=bool(mask_float),
                      HAS_SOFTCAP=bool(softcap), PRODUCER_REGS_=PRODUCER_REGS)
    attrs = {}
    if aligned:
        names = list(sig)
        for name in ("Q", "OUT", "LSE", "PO", "PM", "PL"):
            attrs[(names.index(name),)] = [["tt.divisibility", 16]]
    src = GluonASTSource(fn=_tree_attn_main_sm90, signature=sig, constexprs=constexprs, attrs=attrs)
    options = dict(num_warps=cw, num_stages=1, maxnreg=maxnreg_for(cw, programs_per_sm(head_dim, cw, bn, st)),
                   enable_fp_fusion=True)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


# ---------------------------------------------------------------------------------------
# The kernel's scalar plan, mirrored in Python (the tests model the tiling and the pipeline
# with it; keep it in step with _tree_attn_main_sm90 and _producer/_consumer).

def program_tiles(off: int, S: int, M: int, split: int, num_splits: int, window_units: int, block_n: int):
    """(t_lo, t_hi, n_prefix, kend) of one program: its BLOCK_N-key tiles [t_lo, t_hi), tile t
    a window tile iff t >= n_prefix, keys < kend valid. off is the raw offset (clamped here as
    on the device)."""
    off = min(max(off, 0), S)
    kend = min(off + M, S)
    n_prefix = off // block_n
    per_split = -(-(n_prefix + window_units) // num_splits)
    p_lo = split * per_split
    is_last = split == num_splits - 1
    p_hi = min(p_lo + per_split, n_prefix)
    t_lo = min(p_lo, n_prefix) if is_last else p_lo
    t_hi = -(-kend // block_n) if is_last else max(p_hi, p_lo)
    return t_lo, max(t_hi, t_lo), n_prefix, kend


def slot_phase(i: int, stages: int) -> Tuple[int, int]:
    """Ring slot and mbarrier phase parity of a program's i-th tile."""
    return i % stages, (i // stages) & 1


def choose_splits(S: int, M: int, programs: int, num_sms: int, block_n: int, per_sm: int = 1) -> Tuple[int, int]:
    """(num_splits, window_units): the C++ plan's makespan model (csrc/cuda/triton_plan.cpp,
    through _C) in this kernel's units: prefix tiles of BLOCK_N keys, window tiles at
    WINDOW_COST prefix tiles each."""
    from ... import _C

    window_units = int(math.ceil(-(-min(M, S) // block_n) * WINDOW_COST)) if M > 0 else 0
    tiles = -(-max(S - M, 0) // block_n)
    return _C.triton_choose_splits(tiles, float(window_units), programs, num_sms, per_sm), window_units


# ---------------------------------------------------------------------------------------
# What the kernel covers, and a Python launcher (tests and benchmarks on a real GPU).

def _tma_strides(t: torch.Tensor) -> list:
    """Element strides for a TMA descriptor over t [B, H, S, D]: a size-1 dimension's stride
    is irrelevant to addressing but must still be a 16-byte multiple, so it takes another
    valid one."""
    fallback = next((t.stride(i) for i in (2, 1, 0) if t.size(i) > 1), t.size(3))
    return [t.stride(i) if t.size(i) > 1 else fallback for i in range(3)] + [1]


def why_not(query, key, value, mask, mask_offset=None, scale=None, softcap=None, sinks=None, *,
            require_gluon: bool = True) -> Optional[str]:
    """None when the Hopper kernel handles the call on an sm_90 GPU, else the reason: the C++
    launcher's own test (csrc/cuda/tree_attn_cuda.cpp, hopper_why_not), which the plan uses
    to choose it. Covered: float16/bfloat16 query = key = value, D in the Hopper table (64,
    128, 256, 512), bool or floating masks of any broadcast shape, any offsets (clamped on the device),
    softcap, sinks, any GQA ratio and tree size; K/V whose base and strides TMA can address
    (16-byte multiples); 1 <= S < 2^31; B * Hkv <= 65535. Looks at metadata only (no device
    sync). require_gluon=False: the case's shape alone (the CPU model tests)."""
    from ... import _C

    if require_gluon and not HAVE_GLUON:
        return "triton with Gluon's Hopper module is not importable"
    reason = _C.cuda_hopper_why_not(query, key, value, mask, mask_offset, scale, softcap, sinks, arch=90)
    return reason or None


def covers(query, key, value, mask, mask_offset=None, scale=None, softcap=None, sinks=None, *,
           require_gluon: bool = True) -> bool:
    """Whether forward_with_lse_hopper handles these arguments (see why_not)."""
    return why_not(query, key, value, mask, mask_offset, scale, softcap, sinks, require_gluon=require_gluon) is None


def forward_with_lse_hopper(query, key, value, mask, mask_offset=None, scale=None, softcap=None, sinks=None,
                           num_splits: Optional[int] = None, config: Optional[Tuple[int, int, int]] = None
                           ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The op's forward_with_lse through the Gluon main pass (and, when the keys are split,
    the Triton reduce kernel), on an sm_90 GPU. config = (CONSUMER_WARPS, BLOCK_N, STAGES).
    Raises NotImplementedError when covers() is False. Never syncs with the device."""
    from .launch_prologue import prepare_call
    from .triton_kernels import _tree_attn_reduce

    reason = why_not(query, key, value, mask, mask_offset, scale, softcap, sinks)
    if reason is not None:
        raise NotImplementedError(f"forward_with_lse_hopper does not cover this call: {reason}")
    if query.device.type != "cuda" or torch.cuda.get_device_capability(query.device) != (9, 0):
        raise NotImplementedError("forward_with_lse_hopper runs on sm_90 (Hopper) CUDA devices only")
    prepared, q, out, lse = prepare_call(query, key, value, mask, mask_offset, scale, softcap, sinks)
    pb = prepared.problem
    k, v, m = prepared.key, prepared.value, prepared.mask
    if pb.empty:
        return out, lse
    cw, bn, st = config or DEFAULT_CONFIG[pb.D]
    block_m = block_m_for(pb.D, cw)
    R, total_rows = pb.G * pb.T, pb.B * pb.Hq * pb.T
    row_blocks = -(-R // block_m)
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    per_sm = programs_per_sm(pb.D, cw, bn, st)
    splits, window_units = choose_splits(pb.S, pb.M, row_blocks * pb.B * pb.Hkv, num_sms, bn, per_sm)
    if num_splits is not None:
        if num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        splits = num_splits

    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    dtype_name = _TORCH_TO_TRITON[q.dtype]
    layout = kv_descriptor_layout(dtype_name, bn, pb.D)
    shape = [pb.B, pb.Hkv, pb.S, pb.D]
    k_desc = TensorDescriptor(k, shape, _tma_strides(k), [1, 1, bn, pb.D], layout)
    v_desc = TensorDescriptor(v, shape, _tma_strides(v), [1, 1, bn, pb.D], layout)

    def strides(t):
        return [0 if t.size(i) == 1 else t.stride(i) for i in range(3)]

    off = prepared.mask_offset
    off_kind = 0 if off is None else (2 if off.dtype == torch.int64 else 1)
    # Pointer arguments keep one element type whatever the call (one compiled variant, the
    # AOT signature's): offsets as int32 words (the kernel reads int64 ones as such, by
    # off_kind), absent tensors as views of lse (never dereferenced).
    off_arg = off.view(torch.int32) if off is not None else lse.view(torch.int32)
    if splits > 1:
        po = torch.empty((splits, total_rows, pb.D), dtype=torch.float32, device=q.device)
        pm = torch.empty((splits, total_rows), dtype=torch.float32, device=q.device)
        pl = torch.empty((splits, total_rows), dtype=torch.float32, device=q.device)
    else:
        po = pm = pl = lse
    sink = prepared.sinks if prepared.sinks is not None else lse
    if m.numel():
        mask_arg = m if pb.mask_float else m.view(torch.uint8)
    else:
        mask_arg = lse if pb.mask_float else lse.view(torch.uint8)
    _tree_attn_main_sm90[(row_blocks, pb.B * pb.Hkv, splits)](
        q, k_desc, v_desc, mask_arg, off_arg, sink, out, lse, po, pm, pl,
        *strides(q), *pb.mask_stride,
        pb.Hkv, pb.G, pb.T, pb.S, pb.M, R, total_rows, splits, window_units, off_kind, int(pb.has_sinks),
        abs(pb.scale), pb.softcap if pb.softcap is not None else 1.0,
        D=pb.D, BLOCK_M=block_m, BLOCK_N=bn, STAGES=st, MASK_FLOAT=bool(pb.mask_float),
        HAS_SOFTCAP=pb.softcap is not None, PRODUCER_REGS_=PRODUCER_REGS, num_warps=cw, maxnreg=maxnreg_for(cw, per_sm),
    )
    if splits > 1:
        block_r = max(1, 512 // pb.D)
        _tree_attn_reduce[(-(-total_rows // block_r),)](
            po, pm, pl, sink, out, lse, total_rows, pb.T, pb.Hq, splits, int(pb.has_sinks),
            D=pb.D, BLOCK_R=block_r, BLOCK_D=pb.D, CHUNK=8, num_warps=4,
        )
    return out, lse
