"""The CUDA kernels' tile and split choices, as Python sees them: the C++ plan
(csrc/cuda/triton_plan.h, the one copy; its table csrc/cuda/tile_configs.def) through
_C, for the tests and the tuning scripts. No triton import."""
from typing import Optional

from ... import _C

globals().update(_C.triton_constants())
CONFIGS = _C.triton_table()
Plan = _C.TritonPlan


def choose(D: int, half_dot: bool, rows_per_head: int, batch_heads: int, S: int, M: int, num_sms: int, *,
           T: Optional[int] = None, num_splits: Optional[int] = None, config: Optional[tuple] = None) -> Plan:
    """The launch plan of a call; T (tree nodes per row, default rows_per_head) decides the
    window loop's skip test."""
    return _C.triton_plan(D, half_dot, rows_per_head if T is None else T, rows_per_head, batch_heads, S, M, num_sms,
                          num_splits, list(config) if config is not None else None)


makespan = _C.triton_makespan
choose_splits = _C.triton_choose_splits
window_tiles = _C.triton_window_tiles
programs_per_sm = _C.triton_programs_per_sm
reduce_block = _C.triton_reduce_block


def next_pow2(x: int) -> int:
    return 1 << (max(1, x) - 1).bit_length()
