"""The CUDA backend's Triton kernels (torch_tree_attn/triton_backend.py) without a GPU.

Everything the kernels compute runs in one child process under Triton's interpreter
(TRITON_INTERPRET=1 must be set before triton is imported; see
tests/triton_interp_worker.py): a representative share of the parity matrix, every
non-finite case, key splits (the reduce pass), NaN/inf in unused cache slots, clamped
out-of-range offsets, validation through the shared C++ prepare(), and the CUDA
registration. tests/test_cuda.py runs the whole matrix on a real GPU.

The tile/split heuristics (pure Python) are checked here in-process.
"""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
HAVE_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install -e '.[test]')")

GROUPS = ("parity", "nonfinite", "splits", "unused_slots", "clamped_offsets", "api")


@pytest.fixture(scope="module")
def interpreter_results():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run([sys.executable, "-m", "tests.triton_interp_worker", *GROUPS], cwd=str(ROOT), env=env,
                          capture_output=True, text=True, timeout=900)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            results.setdefault(r["group"], []).append(r)
    assert results or proc.returncode == 0, f"worker failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return results, proc


@needs_triton
@pytest.mark.parametrize("group", GROUPS)
def test_interpreter(group, interpreter_results):
    results, proc = interpreter_results
    got = results.get(group, [])
    assert got, f"group {group} produced no checks (worker rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    failed = [r for r in got if r["error"]]
    assert not failed, f"{len(failed)} of {len(got)} failed:\n" + "\n".join(
        f"--- {r['name']}\n{r['error']}" for r in failed[:5])


def test_heuristics():
    from torch_tree_attn import triton_heuristics as heur

    # Reference shape on an H200 (132 SMs): 256 rows per kv head, 8 kv heads.
    plan = heur.choose(128, True, 256, 8, 16384 + 64, 132)
    assert plan.row_blocks * plan.block_m >= 256 and plan.kv_reads == plan.row_blocks
    assert 1 < plan.num_splits <= heur.MAX_SPLITS
    assert plan.row_blocks * 8 * plan.num_splits >= 132, "the grid must fill the GPU"
    # Short keys: no split (no reduce pass).
    assert heur.choose(128, True, 256, 8, 100, 132).num_splits == 1
    # Many programs already: no split.
    assert heur.choose(64, True, 4096, 64, 100000, 132).num_splits == 1
    # Tiny row counts are not padded to a big block (tl.dot needs 16).
    assert heur.choose(64, True, 1, 1, 10, 132).block_m == 16
    assert heur.choose(96, False, 10, 1, 10, 132).block_d == 128
    for (D, kind), (bm, bn, warps, stages) in heur.CONFIGS.items():
        assert D in (64, 96, 128, 256, 512) and kind in ("half", "f32") and bm >= 16 and bn >= 16
    assert heur.choose(64, True, 50, 1, 10000, 132, num_splits=5).num_splits == 5
