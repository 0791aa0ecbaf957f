"""Tile and split choices for the Triton (CUDA) backend, from the problem's shape and the
GPU's SM count. Pure Python, no triton import: testable anywhere.

A main-kernel program owns BLOCK_M rows of one (batch row, kv head) -- the rows of a kv
head are its G x T (query head, tree node) pairs stacked -- and one key split. The grid is
(ceil(G*T / BLOCK_M), B * Hkv, num_splits). Each K/V byte is read once per program that
covers it: ceil(G*T / BLOCK_M) times in all (from L2 after the first), whatever the split.

CONFIGS is a table of placeholders, to be tuned on the H200 (benchmarks/bench_op.py
--device cuda); keys are (head dim, dot kind): "half" = float16/bfloat16 query and K/V
(tensor-core tl.dot), "f32" = float32 query (tl.dot with input_precision="ieee", K/V
upcast to float32).
"""
import dataclasses
import functools
from typing import Optional

# (D, dot kind) -> (BLOCK_M, BLOCK_N, num_warps, num_stages). PLACEHOLDERS: not tuned yet.
CONFIGS = {
    (64, "half"): (64, 64, 4, 3),
    (96, "half"): (64, 64, 4, 3),
    (128, "half"): (64, 64, 4, 3),
    (256, "half"): (64, 32, 8, 2),
    (512, "half"): (32, 32, 8, 1),
    (64, "f32"): (32, 32, 4, 2),
    (96, "f32"): (32, 32, 4, 2),
    (128, "f32"): (32, 32, 4, 2),
    (256, "f32"): (32, 32, 8, 1),
    (512, "f32"): (16, 16, 8, 1),
}

# Flash-decoding splits: aim at TARGET_WAVES programs per SM, give each split at least
# MIN_TILES_PER_SPLIT key tiles, never more than MAX_SPLITS splits (the reduce kernel reads
# every split's partial). PLACEHOLDERS: not tuned yet.
TARGET_WAVES = 2
MIN_TILES_PER_SPLIT = 4
MAX_SPLITS = 64
# The reduce kernel's rows per program.
REDUCE_BLOCK_ROWS = 16


@dataclasses.dataclass(frozen=True)
class Plan:
    block_m: int
    block_n: int
    block_d: int
    num_warps: int
    num_stages: int
    row_blocks: int      # programs along the rows of a kv head: ceil(G*T / block_m)
    num_splits: int      # programs along the keys; 1 = no reduce kernel

    @property
    def kv_reads(self) -> int:
        """How many times each visible K/V byte is read from memory (or L2)."""
        return self.row_blocks


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(x: int) -> int:
    return 1 << (max(1, x) - 1).bit_length()


def choose(D: int, half_dot: bool, rows_per_head: int, batch_heads: int, S: int, num_sms: int,
           num_splits: Optional[int] = None, config: Optional[tuple] = None) -> Plan:
    """The launch plan of one call. `rows_per_head` = G*T, `batch_heads` = B*Hkv, S the
    key capacity (an upper bound of every row's visible keys: offsets are never read on the
    host). `num_splits`/`config` override the table (tests, tuning)."""
    block_m, block_n, num_warps, num_stages = config or CONFIGS[(D, "half" if half_dot else "f32")]
    # Don't pad a tiny row count up to a large block (tl.dot needs M >= 16).
    block_m = max(16, min(block_m, _next_pow2(rows_per_head)))
    row_blocks = _cdiv(rows_per_head, block_m)
    if num_splits is None:
        programs = row_blocks * batch_heads
        by_occupancy = _cdiv(TARGET_WAVES * num_sms, programs) if programs < TARGET_WAVES * num_sms else 1
        by_length = max(1, _cdiv(S, block_n) // MIN_TILES_PER_SPLIT)
        num_splits = max(1, min(by_occupancy, by_length, MAX_SPLITS))
    return Plan(block_m=block_m, block_n=block_n, block_d=_next_pow2(D), num_warps=num_warps,
                num_stages=num_stages, row_blocks=row_blocks, num_splits=int(num_splits))


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Under TRITON_INTERPRET=1 (CPU tensors) there is no SM count; a small pretend GPU makes the
# plan split long key ranges, so the interpreter tests exercise the reduce kernel.
INTERPRETER_SMS = 4
