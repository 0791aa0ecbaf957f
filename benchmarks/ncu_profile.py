"""Nsight Compute figures for the CUDA main kernels at bench_op.py's shapes: tensor-pipe and
issue-slot utilisation, DRAM throughput and the warp stall reasons, one kernel launch per
shape.

Two modes:

    python benchmarks/ncu_profile.py --run B,T,P,D,dtype     # the workload ncu profiles
    python benchmarks/ncu_profile.py --out DIR                # every shape under ncu, then a table

The second runs ``ncu`` (``$NCU``, default /usr/local/cuda/bin/ncu, else ``ncu`` on PATH) on
the first, once per shape, profiling the fourth launch of a kernel named ``_tree_attn_main*``
(the Hopper kernel ``_tree_attn_main_sm90`` or the Triton one) with the SpeedOfLight,
ComputeWorkloadAnalysis, SchedulerStats and WarpStateStats sections, appends each raw CSV to
DIR/ncu-raw.csv (and which metric filled each column to DIR/metrics-used.txt) and prints one
row per shape.
"""
import argparse
import csv
import io
import os
import shutil
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = ["1,64,1024,128,bf16", "1,64,4096,128,bf16", "1,64,16384,128,bf16", "1,64,65536,128,bf16",
          "8,64,16384,128,bf16", "1,16,16384,128,bf16", "1,64,16384,256,bf16", "1,64,16384,128,fp32"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "SchedulerStats", "WarpStateStats")
# (column title, metric name prefix in ncu's raw page); the first metric found per title wins.
COLUMNS = [
    ("time us", ("gpu__time_duration.sum",)),
    ("SM %", ("sm__throughput.avg.pct_of_peak_sustained_elapsed",)),
    ("memory %", ("gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
                  "dram__throughput.avg.pct_of_peak_sustained_elapsed")),
    ("DRAM %", ("dram__throughput.avg.pct_of_peak_sustained_elapsed",)),
    # wgmma (Hopper) runs on the gmma pipe; the hmma pipe is mma.sync's, near 0 for wgmma.
    ("tensor pipe %", ("sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
                       "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
                       "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active",
                       "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active")),
    ("issue slots %", ("sm__inst_issued.avg.pct_of_peak_sustained_active",
                       "smsp__issue_active.avg.pct_of_peak_sustained_active")),
    ("warps/sched", ("smsp__warps_active.avg.per_cycle_active",)),
]
# Stall reasons (WarpStateStats): cycles a warp spends stalled per issued instruction, by
# reason; ncu releases have spelled the metrics both ways.
STALL_PATTERNS = (("smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"),
                  ("smsp__average_warp_latency_issue_stalled_", ".ratio"),
                  ("smsp__warp_issue_stalled_", "_per_warp_active.pct"))
# Asked for by name beside the sections (the sections' own lists differ between ncu
# releases); a release that does not know one of them fails the call, which is then retried
# with the sections only.
EXTRA_METRICS = ("sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
                 "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
                 "smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct",
                 "smsp__warp_issue_stalled_barrier_per_warp_active.pct",
                 "smsp__warp_issue_stalled_wait_per_warp_active.pct",
                 "smsp__warp_issue_stalled_math_pipe_throttle_per_warp_active.pct",
                 "smsp__warp_issue_stalled_mio_throttle_per_warp_active.pct",
                 "smsp__warp_issue_stalled_short_scoreboard_per_warp_active.pct",
                 "smsp__warp_issue_stalled_dispatch_stall_per_warp_active.pct",
                 "smsp__warp_issue_stalled_lg_throttle_per_warp_active.pct",
                 "smsp__warp_issue_stalled_membar_per_warp_active.pct",
                 "smsp__warp_issue_stalled_sleeping_per_warp_active.pct",
                 "smsp__warp_issue_stalled_selected_per_warp_active.pct",
                 "smsp__warp_issue_stalled_not_selected_per_warp_active.pct",
                 "smsp__warp_issue_stalled_no_instruction_per_warp_active.pct",
                 "smsp__warp_issue_stalled_branch_resolving_per_warp_active.pct")


def workload(spec: str, calls: int = 6) -> None:
    from torch_tree_attn.ops import tree_attention
    import tune_cuda

    B, T, P, D, dtype = spec.split(",")
    B, T, P, D = int(B), int(T), int(P), int(D)
    Hq, Hkv = (16, 8) if D == 256 else (32, 8)
    x = tune_cuda.problem(B, T, P, Hq, Hkv, D, DTYPES[dtype])
    for _ in range(calls):
        tree_attention(x["q"], x["k"], x["v"], x["mask"], x["off"])
    torch.cuda.synchronize()


def _raw_rows(text: str):
    """ncu --csv --page raw: a header row of metric names, a units row, then one row a kernel."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    if len(rows) < 3:
        return {}
    return dict(zip(rows[0], rows[-1]))


def _value(row: dict, names) -> str:
    for name in names:
        if name in row:
            return row[name]
    return "-"


def _stalls(row: dict):
    """The stall reasons of the first spelling in STALL_PATTERNS that the row holds, largest
    first, as (value, reason) pairs; and the unit ("%" of active warp cycles, or "" for cycles
    per issued instruction)."""
    for prefix, suffix in STALL_PATTERNS:
        found = []
        for key, val in row.items():
            if key.startswith(prefix) and key.endswith(suffix):
                try:
                    found.append((float(val.replace(",", "")), key[len(prefix):-len(suffix)]))
                except ValueError:
                    pass
        if found:
            return sorted(found, reverse=True), ("%" if suffix.endswith(".pct") else "")
    return [], ""


def profile(out_dir: str) -> int:
    ncu = os.environ.get("NCU") or ("/usr/local/cuda/bin/ncu" if os.path.exists("/usr/local/cuda/bin/ncu")
                                     else shutil.which("ncu"))
    if not ncu:
        print("no ncu found (set $NCU)")
        return 2
    os.makedirs(out_dir, exist_ok=True)
    print(" | ".join(["shape".ljust(22)] + [t for t, _ in COLUMNS] + ["top stalls (% of active warp cycles, or cycles per issued instruction)"]))
    for spec in SHAPES:
        cmd = [ncu, "--target-processes", "all", "-k", "regex:_tree_attn_main", "--launch-skip", "3",
               "--launch-count", "1", "--csv", "--page", "raw"]
        for section in SECTIONS:
            cmd += ["--section", section]
        workload_cmd = [sys.executable, os.path.abspath(__file__), "--run", spec]
        proc = subprocess.run(cmd + ["--metrics", ",".join(EXTRA_METRICS)] + workload_cmd, capture_output=True,
                              text=True, timeout=240)
        if not _raw_rows(proc.stdout):
            proc = subprocess.run(cmd + workload_cmd, capture_output=True, text=True, timeout=240)
        # One file for every shape (the device tool returns only a few files a run).
        with open(os.path.join(out_dir, "ncu-raw.csv"), "a") as f:
            f.write(f"# shape {spec}\n{proc.stdout}")
        row = _raw_rows(proc.stdout)
        if not row:
            print(f"{spec:<22} | ncu gave no row (rc {proc.returncode}): {proc.stderr[-400:]} {proc.stdout[-400:]}")
            continue
        stalls, unit = _stalls(row)
        found = {title: next((n for n in names if n in row), None) for title, names in COLUMNS}
        with open(os.path.join(out_dir, "metrics-used.txt"), "a") as f:
            f.write(f"{spec}: {found}\n  tensor/stall metrics seen: "
                    f"{sorted(k for k in row if 'tensor' in k or 'stalled' in k)}\n")
        top = ", ".join(f"{n} {v:.2f}{unit}" for v, n in stalls[:4])
        kernel = row.get("Kernel Name", "?")[:24]
        print(" | ".join([f"{spec:<22}"] + [_value(row, names) for _, names in COLUMNS] + [f"{top}; {kernel}"]),
              flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", metavar="B,T,P,D,dtype", help="run the workload of one shape (what ncu profiles)")
    ap.add_argument("--out", default="ncu-results", help="folder for the raw CSVs")
    args = ap.parse_args()
    if args.run:
        workload(args.run)
        return 0
    return profile(args.out)


if __name__ == "__main__":
    sys.exit(main())
