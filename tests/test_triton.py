"""The CUDA backend's Triton kernels (torch_tree_attn/backends/cuda/__init__.py) without a GPU.

Everything the kernels compute runs in one child process per session under Triton's
interpreter (TRITON_INTERPRET=1 must be set before triton is imported; see
tests/triton_interp_worker.py and tests/backends.py InterpreterRun). The contract's tables
(a representative share of the parity matrix, every non-finite case, the bad-input table)
are tests/test_contract.py's triton-interp items; this file reports the backend's own
groups: key splits (the reduce pass), NaN/inf in unused cache slots, clamped out-of-range
offsets, softcap and finite extremes, the API (validation through the shared C++
prepare(), the CUDA registration). On a real GPU the contract runs as the cuda backend and
tests/test_cuda.py runs the rest.

The tile/split heuristics (pure Python) are checked here in-process.
"""
import importlib.util
import math

import pytest

from tests.backends import INTERPRETER
HAVE_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install -e '.[test]')")

# The worker's own groups (its contract tables are tests/test_contract.py's triton-interp items).
GROUPS = ("splits", "unused_slots", "clamped_offsets", "extremes", "api")


@needs_triton
@pytest.mark.parametrize("group", GROUPS)
def test_interpreter(group):
    got = INTERPRETER.group(group)
    assert got, f"group {group} produced no checks ({INTERPRETER.failure_context()})"
    failed = [(name, error) for name, error in got if error]
    assert not failed, f"{len(failed)} of {len(got)} failed:\n" + "\n".join(
        f"--- {name}\n{error}" for name, error in failed[:5])


def test_heuristics():
    from torch_tree_attn.backends.cuda import plan as heur

    # Reference shape on an H200 (132 SMs): 256 rows per kv head, 8 kv heads, a 64-node tree.
    plan = heur.choose(128, True, 256, 8, 16384 + 64, 64, 132, T=64)
    assert plan.row_blocks * plan.block_m >= 256 and plan.kv_reads == plan.row_blocks
    assert 1 < plan.num_splits <= heur.MAX_SPLITS
    per_sm = heur.programs_per_sm(plan.num_warps)
    assert plan.row_blocks * 8 * plan.num_splits <= 132 * per_sm, "one wave: no nearly empty last wave"
    assert heur.programs_per_sm(8) == 1 and heur.programs_per_sm(4) == 2
    # The split model's choice is its minimum, the smallest split count reaching it.
    for tiles, window, progs in [(257, 2.5, 32), (17, 2.5, 32), (1025, 2.5, 16), (3, 1.0, 1), (1, 8.0, 8), (40, 30.0, 4)]:
        costs = {s: heur.makespan(tiles, window, progs, 132, s) for s in range(1, min(heur.MAX_SPLITS, tiles + 1) + 1)}
        best = min(costs.values())
        assert heur.choose_splits(tiles, window, progs, 132) == min(s for s, c in costs.items() if c == best)
    # The splits share prefix and window in equal work: a window as long as the prefix is
    # worth a split of its own.
    assert heur.makespan(64, 64.0, 8, 132, 2) < heur.makespan(64, 64.0, 8, 132, 1)
    assert heur.makespan(64, 0.5, 8, 132, 8) == (9 + heur.PROGRAM_OVERHEAD_TILES + heur.REDUCE_COST_TILES
                                                 + 8 * heur.REDUCE_COST_PER_SPLIT)
    assert plan.window_units == math.ceil(heur.window_tiles(64, plan.block_n, plan.window_n)) > 0
    # Short keys or no prefix: no split (no reduce pass).
    assert heur.choose(128, True, 256, 8, 100, 64, 132).num_splits == 1
    assert heur.choose(128, True, 256, 8, 64, 64, 132).num_splits == 1
    # Many programs already: no split.
    assert heur.choose(64, True, 4096, 64, 100000, 64, 132).num_splits == 1
    # Tiny row counts are not padded to a big block (tl.dot needs 16).
    assert heur.choose(64, True, 1, 1, 10, 1, 132).block_m == 16
    assert heur.choose(96, False, 10, 1, 10, 10, 132).block_d == 128
    for (D, kind), (bm, bn, warps, stages, *wn) in heur.CONFIGS.items():
        assert D in (64, 96, 128, 256, 512) and kind in ("half", "f32") and bm >= 16 and bn >= 16
        plan = heur.choose(D, kind == "half", 4096, 1, 100, 64, 132)
        assert plan.window_n >= 16 and plan.block_n % plan.window_n == 0
        assert plan.window_n == (wn[0] if wn else min(heur.WINDOW_N, bn))
    assert heur.choose(64, True, 50, 1, 10000, 50, 132, num_splits=5).num_splits == 5
    assert heur.choose(64, True, 50, 1, 10000, 50, 132, num_splits=5).num_splits == 5
    assert heur.choose(128, True, 256, 8, 4096, 64, 132, config=(64, 64, 4, 3, 32)).window_n == 32
    for bad in (8, 24, 128):   # below tl.dot's 16, not a power of 2, wider than the tile
        with pytest.raises(ValueError, match=f"window sub-tile .* got {bad}"):
            heur.choose(128, True, 256, 8, 4096, 64, 132, config=(64, 64, 4, 3, bad))
    # The window loop's skip test (which costs it its pipelining) only where whole sub-tiles
    # can go unseen: part of a tree per block, or a window wider than the tree.
    assert not heur.choose(128, True, 256, 8, 16384 + 64, 64, 132, T=64).skip_unseen
    assert heur.choose(128, True, 1024, 8, 16384 + 256, 256, 132, T=256).skip_unseen
    assert heur.choose(128, True, 256, 8, 16384 + 96, 96, 132, T=64).skip_unseen


# Ahead-of-time compilation for an H100/H200 (sm_90) with triton's bundled ptxas, through
# the same spec -> signature path the prebuilt table and the run-time fallback use
# (torch_tree_attn/backends/cuda/compiler.py): the real (non-interpreter) Triton frontend and
# backend accept the kernels, without a GPU.
AOT_VARIANTS = [
    # (query, key/value, head dim, float mask, softcap, skip test)
    ("bf16", "bf16", 128, False, False, False),
    ("fp16", "fp16", 64, True, True, False),
    ("fp32", "fp32", 96, True, True, False),
    ("fp32", "bf16", 512, False, False, True),
    ("bf16", "bf16", 512, True, False, True),
]


def _spec(qt, kvt, D, mask_float, softcap, skip, block_m=None):
    from torch_tree_attn.backends.cuda import compiler as tc
    from torch_tree_attn.backends.cuda import plan as heur

    plan = heur.choose(D, qt != "fp32", 4096, 1, 100, 64, 132)
    spec = dict.fromkeys(tc.SPEC_FIELDS, 0)
    spec.update(kind=tc.MAIN, arch=90, q_dtype=tc.DTYPE_CODES[qt], kv_dtype=tc.DTYPE_CODES[kvt], head_dim=D,
                block_m=block_m or plan.block_m, block_n=plan.block_n, block_d=plan.block_d, window_n=plan.window_n,
                num_warps=plan.num_warps, num_stages=plan.num_stages, mask_float=int(mask_float),
                softcap=int(softcap), skip_unseen=int(skip), aligned=1)
    return spec


@needs_triton
@pytest.mark.parametrize("variant", AOT_VARIANTS, ids=lambda v: "-".join(map(str, v)))
def test_kernels_compile_for_sm90(variant):
    pytest.importorskip("triton.backends.nvidia")
    from torch_tree_attn.backends.cuda import compiler as tc
    from torch_tree_attn.backends.cuda import plan as heur

    spec = _spec(*variant)
    try:
        kernel = tc.compile_spec(spec)
    except RuntimeError as e:
        if "ptxas" in str(e).lower() and "not found" in str(e).lower():
            pytest.skip(f"no ptxas: {e}")
        raise
    binary = tc.binary_of(kernel)
    assert binary.cubin and binary.function == "_tree_attn_main" and binary.num_warps == spec["num_warps"]
    if spec["num_stages"] > 1:
        # The key loops are software-pipelined (asynchronous copies into shared memory).
        ttgir = kernel.asm["ttgir"]
        assert "async_copy" in ttgir or "async_tma" in ttgir, "the key loops are not pipelined"
    reduce_spec = dict(spec, kind=tc.REDUCE, kv_dtype=0, block_m=0, block_n=0, window_n=0, mask_float=0, softcap=0,
                       skip_unseen=0, block_r=heur.reduce_block(spec["block_d"]), chunk=heur.REDUCE_CHUNK,
                       num_warps=heur.REDUCE_WARPS, num_stages=1)
    assert tc.binary_of(tc.compile_spec(reduce_spec)).function == "_tree_attn_reduce"
