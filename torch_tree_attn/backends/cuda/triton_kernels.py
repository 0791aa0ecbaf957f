"""The CUDA backend's Triton kernels: the main pass and the key-split reduce pass.

Compiled three ways, from this one source: ahead of time at build time for the prebuilt
table (csrc/cuda/build_kernels.py), once per process for a variant outside that table
(torch_tree_attn.backends.cuda.compile_for_launcher), and under TRITON_INTERPRET=1 on CPU tensors (tests).
Every compiled form is launched from C++ (csrc/cuda/), except the interpreter's.

Which choices are compile-time: what changes the loops (tile sizes, head dim, dtypes, mask
kind, softcap, the window's skip test). What is a runtime argument: what only the prologue
or the epilogue looks at (the offsets' presence and integer width, sinks, whether the keys
are split), so that one compiled kernel serves all of those calls.
"""
import os

import triton
import triton.language as tl

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)    # log(x) = log2(x) * LN2
FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)


# Past this |max| (log2 units) a row's exponents switch to exact power-of-two units (see
# _online_softmax_step): below it, one FMA's rounding of the row max is at most 2 (so p <= 4,
# safe even as float16); above it, float32 scores are at least 2^26 * 2^-24 / log2(e) > 2.7
# apart, so their softmax is nearly one-hot, and exactly one-hot (ties shared) from about
# 2^32 on.
BIG = tl.constexpr(67108864.0)  # 2^26


@triton.jit
def _tanh(x):
    """tanh(x) to a few ulp of relative error for every x (no libdevice, so the interpreter
    runs it too). The softcap multiplies tanh by the cap, so the error must be relative near
    0, where 1 - e^{-2|x|} cancels: there (|x| < 0.625) x + x u P(u), u = x^2, P the CPU
    kernel's degree-4 minimax fit (relative error 4.4e-9); beyond it sign(x) (1 - e) / (1 +
    e), e = e^{-2|x|} < 0.29, which does not cancel. Odd, saturates to +-1 (x = +-inf too)."""
    a = tl.abs(x)
    u = x * x
    p = -5.704991985e-3 * u + 2.063909359e-2
    p = p * u - 5.373971909e-2
    p = p * u + 1.333144158e-1
    p = p * u - 3.333328068e-1
    small = x + (x * u) * p
    e = tl.exp2(a * (-2.0 * LOG2E))
    t = (1.0 - e) / (1.0 + e)
    big = tl.where(x < 0, -t, t)
    return tl.where(a < 0.625, small, big)


@triton.jit
def _not_finite(x):
    """NaN or +-inf, elementwise. Not `x - x != 0`: the compiler contracts `y*c - y*c` of a
    scaled score into an FMA, whose exact rounding error is nonzero for finite values."""
    return ~(tl.abs(x) < float("inf"))


@triton.jit
def _tf32_truncate(x):
    """float32 x with its low 13 mantissa bits cleared: a TF32 value (10 mantissa bits), what
    a TF32 tensor-core MMA reads of x. |result| <= |x|, same sign; +-inf and NaN stay
    non-finite."""
    return (x.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def _tf32_split(x):
    """(hi, lo) with x = hi + lo + (lo's truncation, |.| < 2^-20 |x|): hi = x truncated to
    TF32, lo = the exact rest (|lo| < 2^-10 |x|), truncated to TF32 in turn. Both carry x's
    sign and |hi| + |lo| <= |x|, so no product of the parts overflows where x's does not
    (a rounded hi of 3.4e38 would be +inf). A non-finite x gives a non-finite part."""
    hi = _tf32_truncate(x)
    return hi, _tf32_truncate(x - hi)


@triton.jit
def _dot_3xtf32(a_hi, a_lo, b):
    """a @ b for a float32 a = (a_hi, a_lo) (_tf32_split) on TF32 tensor cores, float32
    accumulation: a_lo b_hi + a_hi b_lo + a_hi b_hi, the small products first. The dropped
    a_lo b_lo and the parts' truncation leave a relative error of a few 2^-20 per product,
    against 2^-24 for IEEE float32 FMAs (the contract's float32 tolerance holds; tests run
    this same arithmetic under the interpreter, whose dot is exact float32, because the
    truncation is explicit). A float16/bfloat16 b is exact in TF32 (b_lo = 0): two MMAs."""
    if b.dtype == tl.float32:
        b_hi, b_lo = _tf32_split(b)
        acc = tl.dot(a_lo, b_hi, input_precision="tf32")
        acc = tl.dot(a_hi, b_lo, acc, input_precision="tf32")
    else:
        b_hi = b.to(tl.float32)
        acc = tl.dot(a_lo, b_hi, input_precision="tf32")
    return tl.dot(a_hi, b_hi, acc, input_precision="tf32")


@triton.jit
def _dot(a, b, HALF_DOT: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with float32 accumulation, on tensor cores. HALF_DOT: a is rounded to b's
    float16/bfloat16 (the probabilities P before P.V; a no-op for the query) and the
    product is a half MMA; otherwise 3xTF32 (_dot_3xtf32; half K/V under a float32 query
    are exact in TF32). UPCAST (interpreter only, whose numpy has no bfloat16 matmul)
    computes the half product exactly in float32 from the same rounded operands."""
    if HALF_DOT:
        a = a.to(b.dtype)
        if UPCAST:
            out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            out = tl.dot(a, b)
    else:
        a_hi, a_lo = _tf32_split(a.to(tl.float32))
        out = _dot_3xtf32(a_hi, a_lo, b)
    return out


@triton.jit
def _qk(q_hi, q_lo, k, HALF_DOT: tl.constexpr, UPCAST: tl.constexpr):
    """Raw scores Q.K^T of a tile: a half MMA (q_hi is the query, q_lo unused), or 3xTF32
    from the query's split, made once per program (_tf32_split)."""
    if HALF_DOT:
        s = _dot(q_hi, tl.trans(k), HALF_DOT, UPCAST)
    else:
        s = _dot_3xtf32(q_hi, q_lo, tl.trans(k))
    return s


@triton.jit
def _online_softmax_step(s, cn, cb, v, m_n, m_b, l_i, acc, EMPTY_ROWS: tl.constexpr, HALF_DOT: tl.constexpr,
                         UPCAST: tl.constexpr):
    """One key tile into the running state (m_n, m_b, l_i, acc) of each row. s are the tile's
    scores in some base unit (a prefix tile's raw Q.K^T, or natural scores); s * cn is the
    score in log2 units (cn >= 0 a scalar) and cb is a power of two with |s * cb| <= the
    natural score's magnitude (so it cannot overflow). m_n and m_b are the row's running max
    in both units: m_n = max s * cn (log2 units; it may overflow to +-inf), m_b = max s * cb
    (exact).

    The exponent of each score is one FMA, s * c - m, with c and m per row: while the row
    max is below BIG in log2 units, c = cn and m = m_n (the rounding of m is then at most 2
    and only scales the whole row's p, which cancels, as do the tile-to-tile rescales
    alpha, exact differences of consecutive m_n). From BIG on (either sign, overflow to
    inf included), c = cb and m = m_b: s * cb is exact, so the max's exponent is exactly 0
    (p = 1, shared by exact ties) and the other keys' exponents are -gap * cb, far below
    -150 (p = 0, as their true weights) for the magnitudes where float32 can overflow; a
    row switches units only when its max grows past +-BIG, and its old state is then
    rescaled by the new units' alpha. A prefix tile passes its raw scores and c = |scale| *
    log2(e), so the max is taken on raw scores and each exponent is still one FMA.

    NaN scores poison by propagation (p is NaN); the caller poisons raw scores that are
    not finite or overflow once scaled (per row, on the tile's max |s|). EMPTY_ROWS (window
    tiles): unseen entries are -inf by selection and p is exactly 0 there; a row that has
    seen no key keeps m = -inf and subtracts 0, so every exponent is exp2(-inf) = 0, never
    NaN. Without it (prefix tiles) every row sees a finite max, or is poisoned."""
    t_max = tl.max(s, axis=1)
    m_n_new = tl.maximum(m_n, t_max * cn)
    m_b_new = tl.maximum(m_b, t_max * cb)
    big = tl.abs(m_n_new) >= BIG
    c_row = tl.where(big, cb, cn)
    m_ref = tl.where(big, m_b_new, m_n_new)
    m_old = tl.where(big, m_b, m_n)
    if EMPTY_ROWS:
        m_ref = tl.where(m_ref == float("-inf"), 0.0, m_ref)
    # An explicit FMA (the GPU would contract it anyway), so the interpreter rounds as it does.
    p = tl.exp2(tl.fma(s, c_row[:, None], -m_ref[:, None]))
    alpha = tl.exp2(m_old - m_ref)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p, v, HALF_DOT, UPCAST)
    return m_n_new, m_b_new, l_i, acc


@triton.jit
def _natural_state(m_n, m_b):
    """(m, d) of a row's final state, m its max in natural units and d the log2 of the
    factor that makes l and acc relative to e^m (exact to float32: m = m_n ln 2 rounded,
    d its rounding error in log2 units, |d| < 1). m_b is in natural units here."""
    big = tl.abs(m_n) >= BIG
    m_nat = tl.where(big, m_b, m_n * LN2)
    d = tl.where(big, 0.0, tl.fma(-m_nat, LOG2E, m_n))
    return m_nat, d


@triton.jit
def _finalize(acc, m, d, l_i, poison, sink_ptr, h, row_ok, has_sink):
    """(out float32 [rows, D], lse [rows], natural log) of rows whose softmax state is
    sum_j e^{s_j} v_j = acc * 2^d * e^m, sum_j e^{s_j} = l_i * 2^d * e^m (m natural units):
    sinks join here, poisoned rows become NaN, rows that see no key give 0 and lse -inf (or
    their sink, exactly). Natural units throughout, so no finite max, lse or sink
    overflows (a sink of 3e38 is one), and every exponent is a difference first."""
    seen_any = l_i > 0
    l_safe = tl.where(seen_any, l_i, 1.0)
    keys_lse = tl.where(seen_any, m + (tl.log2(l_safe) + d) * LN2, float("-inf"))
    if has_sink != 0:
        sink = tl.load(sink_ptr + h, mask=row_ok, other=float("-inf"))
        poison = poison | ((sink != sink) | (sink == float("inf"))).to(tl.int32)
        sink_n = tl.where(sink == sink, sink, float("-inf"))
        hi = tl.maximum(keys_lse, sink_n)
        lo = tl.minimum(keys_lse, sink_n)
        hi_safe = tl.where(hi == float("-inf"), 0.0, hi)
        lse = tl.where(hi == float("-inf"), float("-inf"),
                       hi + tl.log2(1.0 + tl.exp2((lo - hi_safe) * LOG2E)) * LN2)
        lse_safe = tl.where(lse == float("-inf"), 0.0, lse)
        weight = tl.where(seen_any, tl.exp2(d + (m - lse_safe) * LOG2E), 0.0)
        # A row that sees no key: lse is the sink exactly.
        lse = tl.where(seen_any, lse, sink)
    else:
        weight = tl.where(seen_any, 1.0 / l_safe, 0.0)
        lse = keys_lse
    out = acc * weight[:, None]
    bad = poison != 0
    out = tl.where(bad[:, None], float("nan"), out)
    lse = tl.where(bad, float("nan"), lse)
    return out, lse


# Sizes vary from call to call: not specialised (fewer compilations); strides stay
# specialised (alignment of the K/V rows matters for vector loads).
@triton.jit(do_not_specialize=["Hkv", "G", "T", "S", "M", "R", "total_rows", "num_splits", "window_units",
                               "off_kind", "has_sink"])
def _tree_attn_main(
    Q, K, V, MASK, OFF, SINK, OUT, LSE, PO, PM, PL,
    sq0, sq1, sq2, sk0, sk1, sk2, sv0, sv1, sv2, sm0, sm1, sm2, sm3,
    Hkv, G, T, S, M, R, total_rows, num_splits, window_units, off_kind, has_sink,
    scale_abs, softcap,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    WINDOW_N: tl.constexpr, MASK_FLOAT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HALF_DOT: tl.constexpr, UPCAST: tl.constexpr,
    SKIP_UNSEEN: tl.constexpr,
):
    """Main pass. A program owns BLOCK_M rows of one (batch row b, kv head) -- rows r of a
    kv head are its (query head kvh*G + r // T, tree node r % T) pairs -- and one key split.
    Keys [0, kend), kend = min(off + M, S), from the clamped offset read on the device: the
    prefix tiles (BLOCK_N keys, entirely below off) and the window (WINDOW_N-key sub-tiles
    from the last prefix tile's end to kend) are shared out in equal work: the last split
    runs the window and fewer prefix tiles, none where the window is worth a split of its
    own (one split: the program does both). Each K/V byte is read once per program covering
    it, i.e. ceil(G*T / BLOCK_M) times per call; the mask is read only in the window, once
    per program.

    Prefix tiles run unmasked. Window sub-tiles load the mask, K and V at the top of the
    loop (so the pipeliner can prefetch them), with bounds masks (other=0) so no slot >=
    kend is read; with SKIP_UNSEEN they skip the math when no row of the block sees any of
    their keys. What a row does not see is excluded by selection (tl.where), never by
    arithmetic. Non-finite values poison by propagation everywhere: in the prefix through
    p + 0 * s (every row sees every key), in the window through a term that is NaN exactly
    where a row sees a key with a non-finite raw score, bias or V row (window V rows are
    zeroed before P.V so their NaN cannot reach rows that don't see them); at the end a
    non-finite l_i or accumulator poisons the row.

    Q is the query times sign(scale) (the launcher negates it, exactly, for a negative
    scale), so raw scores times |scale| are the scaled scores and a prefix tile's max can
    be taken before scaling. Q is loaded once and never modified: Triton then feeds the
    tensor cores from it without a per-tile reload."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    split = tl.program_id(2)
    b = (bh // Hkv).to(tl.int64)
    kvh = (bh % Hkv).to(tl.int64)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < R
    g = rows // T
    i = rows % T
    h = kvh * G + g                      # int64 query head per row
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D

    q = tl.load(Q + b * sq0 + h[:, None] * sq1 + i[:, None].to(tl.int64) * sq2 + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    # The query as the MMAs read it, once: itself (half), or its TF32 parts (float32).
    if HALF_DOT:
        q_hi = q
        q_lo = q
    else:
        q_hi, q_lo = _tf32_split(q.to(tl.float32))

    # off_kind: 0 no offsets (all 0), 1 int32, 2 int64 (OFF is cast to the given width).
    off = b * 0                          # int64 scalar 0
    if off_kind == 1:
        off = tl.load(OFF.to(tl.pointer_type(tl.int32)) + b).to(tl.int64)
    elif off_kind == 2:
        off = tl.load(OFF.to(tl.pointer_type(tl.int64)) + b)
    off = tl.minimum(tl.maximum(off, 0), S)
    kend = tl.minimum(off + M, S)
    n_prefix = off // BLOCK_N            # tiles entirely inside the prefix [0, off)
    # Balanced splits: the prefix tiles and the window (window_units tiles' worth, the
    # launcher's estimate) in equal shares; the last split takes the window and what is
    # left of the prefix (an empty range where the window is a share of its own).
    per_split = tl.cdiv(n_prefix + window_units, num_splits)
    p_lo = split * per_split
    p_hi = tl.where(split == num_splits - 1, n_prefix, tl.minimum(p_lo + per_split, n_prefix))
    SUB: tl.constexpr = BLOCK_N // WINDOW_N
    w_lo = n_prefix * SUB                # window sub-tiles [w_lo, w_hi)
    w_hi = tl.where(split == num_splits - 1, tl.cdiv(kend, WINDOW_N), w_lo)

    k_base = K + b * sk0 + kvh * sk1
    v_base = V + b * sv0 + kvh * sv1
    m_base = MASK + b * sm0 + h[:, None] * sm1 + i[:, None].to(tl.int64) * sm2

    m_n = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)   # running max, log2 units
    m_b = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)   # running max, power-of-two units
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    c = scale_abs * LOG2E
    # |scale| = P * to_nat: P its power of two (0 for a zero or subnormal scale), to_nat in
    # [1, 2). Raw scores times P are exact and never overflow; m_b * to_nat is then the
    # natural max rounded once, as the window's scaled scores are.
    scale_bits = tl.cast(scale_abs, tl.float32).to(tl.int32, bitcast=True)
    P = (scale_bits & 0x7F800000).to(tl.float32, bitcast=True)
    to_nat = ((scale_bits & 0x007FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    # 1 / softcap, refined by one Newton step (the GPU's division is approximate; a precise
    # one is a subroutine call, which costs the loops registers); at most float32's max.
    inv_cap = tl.minimum(1.0 / softcap, FLOAT32_MAX)
    inv_cap = tl.minimum(tl.fma(inv_cap, tl.fma(-softcap, inv_cap, 1.0), inv_cap), FLOAT32_MAX)
    x_per_raw = tl.minimum(scale_abs * inv_cap, FLOAT32_MAX)   # softcap's tanh argument per raw score

    # --- prefix tiles: every key < off <= S, every row sees every key ------------------
    # Addresses: an int64 scalar base per tile plus int32 offsets inside it (the launcher
    # checks BLOCK_N * key-row stride fits int32), so a tile's pointers cost no 64-bit
    # arithmetic per element.
    n_ar = tl.arange(0, BLOCK_N)
    k_in_tile = n_ar[:, None] * sk2 + d[None, :]
    v_in_tile = n_ar[:, None] * sv2 + d[None, :]
    for t in range(p_lo.to(tl.int32), p_hi.to(tl.int32)):
        key0 = tl.cast(t, tl.int64) * BLOCK_N
        k = tl.load(k_base + key0 * sk2 + k_in_tile, mask=d_ok[None, :], other=0.0)
        v = tl.load(v_base + key0 * sv2 + v_in_tile, mask=d_ok[None, :], other=0.0)
        s = _qk(q_hi, q_lo, k, HALF_DOT, UPCAST)
        # Every row sees every key: a raw score that is not finite, or overflows once scaled,
        # poisons its row, once per row (the tile's max |raw| times |scale| is then not
        # finite, and 0 times it is NaN; tanh would saturate it, and a huge negative score
        # would only get p = 0). NaN raw scores propagate through p as well.
        s_poison = tl.max(tl.abs(s), axis=1) * scale_abs * 0.0
        if HAS_SOFTCAP:
            s = softcap * _tanh(s * x_per_raw)
            m_n, m_b, l_i, acc = _online_softmax_step(s, LOG2E, 1.0, v, m_n, m_b, l_i, acc, False, HALF_DOT,
                                                      UPCAST)
        else:
            m_n, m_b, l_i, acc = _online_softmax_step(s, c, P, v, m_n, m_b, l_i, acc, False, HALF_DOT, UPCAST)
        l_i = l_i + s_poison
    if not HAS_SOFTCAP:
        m_b = m_b * to_nat           # from raw * P to natural units, as the window's scores

    # --- window sub-tiles: keys [n_prefix * BLOCK_N, kend), the mask decides -------------
    # WINDOW_N keys at a time: the mask and its selections are [BLOCK_M, WINDOW_N], which
    # keeps the kernel's register peak at the prefix loop's.
    w_ar = tl.arange(0, WINDOW_N)
    kw_in_tile = w_ar[:, None] * sk2 + d[None, :]
    vw_in_tile = w_ar[:, None] * sv2 + d[None, :]
    for u in range(w_lo, w_hi):
        key0 = tl.cast(u, tl.int64) * WINDOW_N
        keys = key0 + w_ar
        in_range = keys < kend
        in_win = (keys >= off) & in_range
        col = keys - off
        win2 = row_ok[:, None] & in_win[None, :]
        kv_ok = in_range[:, None] & d_ok[None, :]
        k = tl.load(k_base + key0 * sk2 + kw_in_tile, mask=kv_ok, other=0.0)
        v = tl.load(v_base + key0 * sv2 + vw_in_tile, mask=kv_ok, other=0.0)
        if MASK_FLOAT:
            bias = tl.load(m_base + col[None, :] * sm3, mask=win2, other=float("-inf"))
            seen_w = win2 & (bias != float("-inf"))         # a NaN bias is seen
        else:
            mb = tl.load(m_base + col[None, :] * sm3, mask=win2, other=0)
            seen_w = win2 & (mb != 0)
        seen = seen_w | (row_ok[:, None] & (keys < off)[None, :])
        # SKIP_UNSEEN: skip the math of a sub-tile no row of the block sees. The branch
        # stops Triton from pipelining this loop, so it is compiled in only where such
        # sub-tiles are expected (the launcher's choice); otherwise an unseen sub-tile's
        # probabilities are exactly 0 by selection.
        if not SKIP_UNSEEN or tl.max(tl.max(seen.to(tl.int32), axis=1), axis=0) > 0:
            s = _qk(q_hi, q_lo, k, HALF_DOT, UPCAST) * scale_abs
            # Poison by propagation, as in the prefix, but only through what a row sees:
            # z is NaN where a key's raw score, V row or (seen) bias is not finite, else 0;
            # it joins the exponent of the entries a row sees (the selection below).
            v_nan = tl.sum(v.to(tl.float32) * 0.0, axis=1)          # per key: 0, or NaN
            z = s * 0.0 + v_nan[None, :]
            if MASK_FLOAT:
                bias = tl.where(seen_w, bias, 0.0)
                z = z + bias * 0.0
            if HAS_SOFTCAP:
                s = softcap * _tanh(s * inv_cap)
            if MASK_FLOAT:
                s = s + bias
            s = tl.where(seen, s + z, float("-inf"))
            # A V row that is not finite is zeroed: 0 * NaN must not reach the rows that
            # don't see it (those that do are poisoned through z).
            v = tl.where((v_nan != 0.0)[:, None], 0.0, v).to(v.dtype)
            m_n, m_b, l_i, acc = _online_softmax_step(s, LOG2E, 1.0, v, m_n, m_b, l_i, acc, True, HALF_DOT,
                                                      UPCAST)

    # Every non-finite value a row sees has reached its l_i (a score, bias or window V row,
    # through p) or its acc (a prefix V row, through P.V, also as 0 * NaN): it poisons here.
    poison = _not_finite(l_i).to(tl.int32) | tl.max(_not_finite(acc).to(tl.int32), axis=1)
    flat = bh.to(tl.int64) * R + rows    # row of the [B, Hq, T] output, = (b*Hkv + kvh)*R + r
    io_mask = row_ok[:, None] & d_ok[None, :]
    m_nat, d_exp = _natural_state(m_n, m_b)
    if num_splits == 1:
        out, lse = _finalize(acc, m_nat, d_exp, l_i, poison, SINK, h, row_ok, has_sink)
        tl.store(OUT + flat[:, None] * D + d[None, :], out.to(OUT.dtype.element_ty), mask=io_mask)
        tl.store(LSE + flat, lse, mask=row_ok)
    else:
        # Partials in natural units: sum_j e^{s_j} v_j = PO e^PM, sum_j e^{s_j} = PL e^PM.
        part = split.to(tl.int64) * total_rows + flat
        to_e = tl.exp2(d_exp)
        tl.store(PO + part[:, None] * D + d[None, :], acc * to_e[:, None], mask=io_mask)
        tl.store(PM + part, tl.where(poison != 0, float("nan"), m_nat), mask=row_ok)
        tl.store(PL + part, l_i * to_e, mask=row_ok)


@triton.jit(do_not_specialize=["total_rows", "T", "Hq", "num_splits", "has_sink"])
def _tree_attn_reduce(
    PO, PM, PL, SINK, OUT, LSE, total_rows, T, Hq, num_splits, has_sink,
    D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr,
):
    """Reduce pass (only when the keys are split): a program owns BLOCK_R output rows and
    merges their num_splits partials (unnormalised O, max m in natural units, sum l; m = NaN
    marks a poisoned split) by an online rescale, in split order: deterministic, no
    atomics. Reads each partial once. The split loop is unrolled CHUNK at a time, so a
    chunk's loads are in flight together (one memory latency per chunk, not per split);
    few rows per program make many programs."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    row_ok = rows < total_rows
    d = tl.arange(0, BLOCK_D)
    io_mask = row_ok[:, None] & (d < D)[None, :]
    m_i = tl.full((BLOCK_R,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_R,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    poison = tl.zeros((BLOCK_R,), dtype=tl.int32)
    for c0 in range(0, num_splits, CHUNK):
        for j in tl.static_range(CHUNK):
            sp = rows * 0 + (c0 + j)                                   # the split, per row
            part = sp * total_rows + rows
            ok = row_ok & (sp < num_splits)
            m_s = tl.load(PM + part, mask=ok, other=float("-inf"))
            l_s = tl.load(PL + part, mask=ok, other=0.0)
            o_s = tl.load(PO + part[:, None] * D + d[None, :], mask=ok[:, None] & io_mask, other=0.0)
            poison = poison | (m_s != m_s).to(tl.int32)
            m_s = tl.where(m_s == m_s, m_s, float("-inf"))
            m_new = tl.maximum(m_i, m_s)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            # Natural units: the difference first (no finite max overflows), then log2.
            a_old = tl.exp2((m_i - m_use) * LOG2E)
            a_new = tl.exp2((m_s - m_use) * LOG2E)                     # 0: empty or poisoned split
            l_i = l_i * a_old + l_s * a_new
            acc = acc * a_old[:, None] + o_s * a_new[:, None]
            m_i = m_new
    h = (rows // T) % Hq
    out, lse = _finalize(acc, m_i, 0.0, l_i, poison, SINK, h, row_ok, has_sink)
    tl.store(OUT + rows[:, None] * D + d[None, :], out.to(OUT.dtype.element_ty), mask=io_mask)
    tl.store(LSE + rows, lse, mask=row_ok)
