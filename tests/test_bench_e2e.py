"""benchmarks/bench_e2e.py's CPU variant (a small random Llama, float32, eager) runs end to end:
it times tree_attn and sdpa at every prefix, profiles their attention share and, before any
timing, finds the tree_attn logits equal to sdpa's. Speed itself is never asserted."""
import json
import math
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
ROOT = pathlib.Path(__file__).resolve().parents[1]
PREFIXES = [32, 96]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e") / "e2e.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_e2e.py"), "--device", "cpu", "--prefix",
               *map(str, PREFIXES), "--iters", "3", "--warmup", "1", "--json", str(out)]
    proc = subprocess.run(command, cwd=str(ROOT), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "best peer / ours" in proc.stdout  # the table was printed
    return json.loads(out.read_text())


def test_environment_is_recorded(result):
    env = result["env"]
    for key in ("torch", "transformers", "triton", "device", "dtype", "date"):
        assert key in env, key
    assert env["device"] == "cpu" and env["dtype"] == "float32"


@pytest.mark.parametrize("impl", ["tree_attn", "sdpa"])
def test_every_prefix_is_timed_and_profiled(result, impl):
    rows = [r for r in result["rows"] if r["impl"] == impl]
    assert [r["P"] for r in rows] == PREFIXES, rows
    for row in rows:
        assert row["mode"] == "eager" and "error" not in row, row
        assert math.isfinite(row["ms"]) and row["ms"] > 0, row
        assert 0 < row["attention_share"] < 1, row
    if impl == "tree_attn":
        assert all(r["best_peer_over_ours"] > 0 for r in rows), rows


def test_tree_attn_logits_match_sdpa_before_timing(result):
    checks = [c for c in result["checks"] if c["impl"] == "tree_attn"]
    assert [c["P"] for c in checks] == PREFIXES, result["checks"]
    for check in checks:
        assert check["ok"], check
        # float32: 1e-4 of the largest logit (a wrong mask moves them by whole units)
        assert check["max_abs_logit_diff"] <= 1e-4 * check["max_abs_logit"], check
        assert check["top1_agreement"] == 1.0, check
