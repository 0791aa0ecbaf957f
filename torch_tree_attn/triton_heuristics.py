"""Tile and split choices for the Triton (CUDA) backend, from the problem's shape and the
GPU's SM count. Pure Python, no triton import: testable anywhere.

A main-kernel program owns BLOCK_M rows of one (batch row, kv head) -- the rows of a kv
head are its G x T (query head, tree node) pairs stacked -- and one key split. The grid is
(ceil(G*T / BLOCK_M), B * Hkv, num_splits). Each K/V byte is read once per program that
covers it: ceil(G*T / BLOCK_M) times in all (from L2 after the first), whatever the split.

CONFIGS holds tiles tuned on the H200 (benchmarks/tune_cuda.py); keys are (head dim, dot kind): "half" = float16/bfloat16 query and K/V
(tensor-core tl.dot), "f32" = float32 query (tl.dot with input_precision="ieee", K/V
upcast to float32).
"""
import dataclasses
import functools
import math
from typing import Optional

# (D, dot kind) -> (BLOCK_M, BLOCK_N, num_warps, num_stages[, WINDOW_N]), tuned on an H200
# (132 SMs, triton 3.6, torch 2.11) with benchmarks/tune_cuda.py, CUDA-graph replays, the
# split model below choosing the splits:
#   bf16 D=128 Hq32/Hkv8 T64, this kernel (balanced splits, pipelined window, one-FMA
#     exponent), (64, 64, 4, 3) best at every shape: P=1024 15.2 us (s=4), P=4096 21.1
#     (s=8), P=16384 48.1 (s=8), P=65536 153.5 (s=8), B=8 P=16384 307 (s=1), T=16 P=16384
#     29.6 (s=16); (128, 64, 8, 3) 4-12% slower, 16-key window sub-tiles 2-30% faster than
#     32 except at B=8 (1% slower).
#   Earlier kernel: bf16 D=64 Hq64/Hkv8: (64, 128, 4, 3) 63.2 us at P=16384; D=256 Hq16/Hkv8:
#     (128, 64, 8, 2) 68.4; D=512 Hq8/Hkv2: (32, 32, 4, 1) 194.6 (larger tiles spill).
#   float32 D=128: (32, 32, 4, 2) 1633 us at P=16384: IEEE float32 tl.dot has no tensor-core
#     path (TF32 would lose precision); the other float32 entries are scaled from it, untuned.
#   D=96 takes D=128's tiles (not measured).
CONFIGS = {
    (64, "half"): (64, 128, 4, 3),
    (96, "half"): (64, 64, 4, 3),
    (128, "half"): (64, 64, 4, 3),
    (256, "half"): (128, 64, 8, 2),
    (512, "half"): (32, 32, 4, 1),
    (64, "f32"): (32, 32, 4, 2),
    (96, "f32"): (32, 32, 4, 2),
    (128, "f32"): (32, 32, 4, 2),
    (256, "f32"): (32, 32, 8, 1),
    (512, "f32"): (16, 16, 8, 1),
}

# Flash-decoding splits, from a makespan model in units of one prefix key tile's work. The
# window (the masked sub-tiles) costs `window` tiles (WINDOW_COST_FACTOR per key of a prefix
# key: the H200 ran a 64-key window in about the time of 12 prefix tiles, 8 us, its
# sub-tiles being latency-bound); the splits share prefix and window in equal work, the
# last split taking the window:
#   waves(s) * (ceil((tiles + window) / s) + PROGRAM_OVERHEAD_TILES)
#     + [s > 1] * (REDUCE_COST_TILES + s * REDUCE_COST_PER_SPLIT)
# with waves(s) = ceil(programs * s / (SMs * programs per SM)); the smallest s reaching the
# minimum wins (fewer partials). The per-split term is each split's partials written and
# read back (without it the model chose 33 splits at P=65536 on the H200, 8 measured best).
# Only when the rows alone leave SMs idle. At most MAX_SPLITS splits.
# Programs resident per SM: the kernels use all 255 registers a thread may have (ptxas,
# sm_90a), so registers decide: 65536 per SM / (threads per program * 255).
REGISTERS_PER_SM = 65536
REGISTERS_PER_THREAD = 255
# Window tiles (where the mask applies) are processed WINDOW_N keys at a time (>= 16 for
# tl.dot; a config's fifth entry overrides it): their masks and selections then need few
# registers.
WINDOW_N = 16
PROGRAM_OVERHEAD_TILES = 2.0
REDUCE_COST_TILES = 4.0
REDUCE_COST_PER_SPLIT = 1.0
WINDOW_COST_FACTOR = 8.0
MAX_SPLITS = 64
# The reduce kernel: REDUCE_ELEMS partial elements per split per program (4 warps, 4 per
# thread), REDUCE_CHUNK splits' loads issued together (an unrolled loop).
REDUCE_ELEMS = 512
REDUCE_CHUNK = 8


@dataclasses.dataclass(frozen=True)
class Plan:
    block_m: int
    block_n: int
    block_d: int
    window_n: int        # keys per step on window tiles (divides block_n)
    num_warps: int
    num_stages: int
    row_blocks: int      # programs along the rows of a kv head: ceil(G*T / block_m)
    num_splits: int      # programs along the keys; 1 = no reduce kernel
    window_units: int    # the window's share of the split work, in prefix tiles

    def skip_unseen(self, T: int, M: int) -> bool:
        """Whether the window loop tests each sub-tile for a row that sees it (a branch,
        which costs the loop its software pipelining). In a tree in topological order a
        node sees only keys up to its own, so whole sub-tiles go unseen by a block only when
        it holds part of a tree (T > block_m) or the window is wider than the tree."""
        return T > self.block_m or M >= T + self.window_n

    @property
    def kv_reads(self) -> int:
        """How many times each visible K/V byte is read from memory (or L2)."""
        return self.row_blocks


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(x: int) -> int:
    return 1 << (max(1, x) - 1).bit_length()


def choose(D: int, half_dot: bool, rows_per_head: int, batch_heads: int, S: int, M: int, num_sms: int,
           num_splits: Optional[int] = None, config: Optional[tuple] = None) -> Plan:
    """The launch plan of one call. `rows_per_head` = G*T, `batch_heads` = B*Hkv, S the
    key capacity, M the window (mask columns). Offsets are never read on the host, so the
    model assumes a full cache: a prefix of S - M keys. `num_splits`/`config` override the
    table (tests, tuning)."""
    block_m, block_n, num_warps, num_stages, *window_override = config or CONFIGS[(D, "half" if half_dot else "f32")]
    # Don't pad a tiny row count up to a large block (tl.dot needs M >= 16).
    block_m = max(16, min(block_m, _next_pow2(rows_per_head)))
    window_n = window_override[0] if window_override else min(WINDOW_N, block_n)
    if window_n < 16 or window_n & (window_n - 1) or block_n % window_n:
        raise ValueError(f"config: the window sub-tile must be a power of 2 >= 16 dividing BLOCK_N={block_n}, "
                         f"got {window_n}")
    row_blocks = _cdiv(rows_per_head, block_m)
    # The window's share of the split work, in whole prefix tiles: the kernel's and the model's.
    window_units = math.ceil(window_tiles(min(M, S), block_n, window_n))
    if num_splits is None:
        num_splits = choose_splits(_cdiv(max(S - M, 0), block_n), window_units, row_blocks * batch_heads, num_sms,
                                   programs_per_sm(num_warps))
    return Plan(block_m=block_m, block_n=block_n, block_d=_next_pow2(D), window_n=window_n,
                num_warps=num_warps, num_stages=num_stages, row_blocks=row_blocks, num_splits=int(num_splits),
                window_units=window_units)


def window_tiles(M: int, block_n: int, window_n: int) -> float:
    """The window's modelled cost in prefix-tile units: its sub-tiles (on average half a
    tile's worth of prefix keys before the offset run with it), WINDOW_COST_FACTOR each."""
    if M <= 0:
        return 0.0
    sub_tiles = _cdiv(M, window_n) + (block_n // window_n - 1) / 2
    return sub_tiles * window_n / block_n * WINDOW_COST_FACTOR


def reduce_block(block_d: int) -> int:
    """Rows per program of the reduce kernel: REDUCE_ELEMS of a split's partial each (4 per
    thread), so that there are many programs and each has one load per split in flight."""
    return max(1, REDUCE_ELEMS // block_d)


def programs_per_sm(num_warps: int) -> int:
    return max(1, REGISTERS_PER_SM // (num_warps * 32 * REGISTERS_PER_THREAD))


def makespan(tiles: int, window: float, programs: int, num_sms: int, splits: int, per_sm: int = 1) -> float:
    """The split model's cost of `splits` key splits, in key-tile units (see above)."""
    waves = _cdiv(programs * splits, num_sms * per_sm)
    cost = waves * (math.ceil((tiles + window) / splits) + PROGRAM_OVERHEAD_TILES)
    return cost + (REDUCE_COST_TILES + splits * REDUCE_COST_PER_SPLIT if splits > 1 else 0.0)


def choose_splits(tiles: int, window: float, programs: int, num_sms: int, per_sm: int = 1) -> int:
    """Key splits for `tiles` prefix tiles and a window costing `window` tiles per row
    block, `programs` programs per split. No split when the rows alone fill every SM:
    splitting then only adds partials to write and reduce: 1 then."""
    if programs >= num_sms * per_sm or tiles == 0:
        return 1
    best, best_cost = 1, makespan(tiles, window, programs, num_sms, 1, per_sm)
    for splits in range(2, min(MAX_SPLITS, tiles + 1) + 1):
        cost = makespan(tiles, window, programs, num_sms, splits, per_sm)
        if cost < best_cost:
            best, best_cost = splits, cost
    return best


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Under TRITON_INTERPRET=1 (CPU tensors) there is no SM count; a small pretend GPU makes the
# plan split long key ranges, so the interpreter tests exercise the reduce kernel.
INTERPRETER_SMS = 4
