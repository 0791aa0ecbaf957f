"""benchmarks/bench_e2e.py's CPU variant (a small Llama, eager): it runs, measures both
implementations and the tree_attn logits match sdpa's before anything is timed."""
import json
import math
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_bench_e2e_cpu_smoke(tmp_path):
    out = tmp_path / "e2e.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_e2e.py"), "--device", "cpu", "--prefix",
                           "32", "96", "--iters", "2", "--json", str(out)], cwd=str(ROOT), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    for impl in ("tree_attn", "sdpa"):
        got = [r for r in rows if r["impl"] == impl and r["mode"] == "eager"]
        assert [r["P"] for r in got] == [32, 96]
        assert all(math.isfinite(r["ms"]) and r["ms"] > 0 and 0 < r["attention_share"] < 1 for r in got), got
    assert all("best_peer_over_ours" in r for r in rows if r["impl"] == "tree_attn")
    assert [c["P"] for c in result["checks"]] == [32, 96]
    assert all(c["ok"] and c["max_abs_logit_diff"] < 1e-4 for c in result["checks"]), result["checks"]
