"""Tile and split tuning of the Triton kernels on a CUDA GPU: the source of the numbers in
torch_tree_attn/backends/cuda/plan.py (CONFIGS and the split model).

For each problem it times every (BLOCK_M, BLOCK_N, num_warps, num_stages) of a grid with
every candidate number of key splits, under a CUDA graph (replays of the whole op call,
reduce pass included), and prints the best few, the table's current choice and what the
split model picks for each config. JSON with every measurement goes to --json.

    python benchmarks/tune_cuda.py --json tune.json              # the default groups
    python benchmarks/tune_cuda.py --groups d128 --max-seconds 300

Groups: d128 (the benchmark's shapes, bf16, D=128, the full grid), dims (D=64/256/512 bf16
and float32 D=128 at P=16384, smaller grids), f32 (float32 D=128 and D=64 at P=16384, the
3xTF32 grid), d512 (bf16 D=512 at P=16384: bench_op's Hq32/Hkv8 row and Gemma 4's Hq8/Hkv2).
Every timing is one run on a shared GPU:
compare configs within a run, not across runs.
"""
import argparse
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_op  # noqa: E402
import timing  # noqa: E402

from torch_tree_attn.backends import cuda as tb  # noqa: E402
from torch_tree_attn.backends.cuda import plan as heur  # noqa: E402


def problem(B, T, P, Hq, Hkv, D, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    S = P + T
    q = torch.randn(B, Hq, T, D, generator=gen).to(dtype).cuda()
    k = torch.randn(B, Hkv, S, D, generator=gen).to(dtype).cuda()
    v = torch.randn(B, Hkv, S, D, generator=gen).to(dtype).cuda()
    tree = bench_op.random_tree_mask(T, gen)[None].expand(B, T, T).contiguous().cuda()
    off = torch.full((B,), P, dtype=torch.int64, device="cuda")
    return dict(q=q, k=k, v=v, mask=tree, off=off, B=B, T=T, P=P, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype)


def grid_d128():
    return [c for c in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))]


def grid_small(D, half):
    if not half:  # float32 (3xTF32): wgmma wants BLOCK_M >= 64 a warpgroup; fp32 tiles fill registers
        return [(32, 32, 4, 2), (64, 16, 4, 3), (64, 32, 4, 2), (64, 32, 4, 3), (64, 32, 8, 2), (128, 32, 8, 2)]
    if D == 64:
        return [c for c in itertools.product((64, 128), (64, 128), (4, 8), (2, 3))]
    if D == 256:
        return [(64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 2), (64, 32, 8, 3)]
    if D == 512:
        # ptxas (triton 3.9, sm_90): (32, 32, 4, 1) spills ~400 bytes; the 8-warp 32-row tiles
        # (32, 32, 8, 1/2/3), (32, 16, 8, 2) and (16, 32, 8, 2) none.
        return [(32, 32, 4, 1), (32, 32, 8, 1), (32, 32, 8, 2), (32, 32, 8, 3), (32, 16, 8, 2), (16, 32, 8, 2),
                (64, 32, 8, 1), (16, 32, 4, 1)]
    return [(32, 32, 4, 2), (64, 32, 4, 2), (64, 64, 4, 2), (64, 32, 8, 2), (128, 32, 8, 2), (64, 64, 8, 3)]


def candidate_splits(x, block_n, heuristic):
    n_tiles = -(-(x["P"] + x["T"]) // block_n)
    cands = {heuristic, 1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64}
    return sorted(s for s in cands if 1 <= s <= min(n_tiles, heur.MAX_SPLITS))


def time_call(x, config, splits, iters):
    fn = lambda: tb.forward_with_lse(x["q"], x["k"], x["v"], x["mask"], x["off"], None, None, None,  # noqa: E731
                                     num_splits=splits, config=config)
    graph, out = timing.graphed(fn, warmup=2)
    return timing.replay_us(graph.replay, iters, repeats=5), out


def tune(name, x, configs, iters, deadline, results):
    G = x["Hq"] // x["Hkv"]
    half = x["dtype"] != torch.float32
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ref = torch.ops.tree_attn.forward(x["q"].cpu().float(), x["k"].cpu().float(), x["v"].cpu().float(),
                                      x["mask"].cpu(), x["off"].cpu(), None, None, None) if x["P"] <= 4096 else None
    rows = []
    for config in configs:
        if time.time() > deadline:
            print(f"  ({name}: out of time after {len(rows)} measurements)")
            break
        plan = heur.choose(x["D"], half, G * x["T"], x["B"] * x["Hkv"], x["P"] + x["T"], x["T"], sms, T=x["T"], config=config)
        for splits in candidate_splits(x, plan.block_n, plan.num_splits):
            try:
                us, out = time_call(x, config, splits, iters)
            except Exception as e:  # noqa: BLE001  (a config that does not fit is reported)
                rows.append(dict(config=config, splits=splits, error=f"{type(e).__name__}: {str(e)[:200]}"))
                print(f"  {config} s={splits}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                break
            err = (out[0].float().cpu() - ref).abs().max().item() if ref is not None else None
            rows.append(dict(config=config, splits=splits, us=us, model_splits=plan.num_splits, max_err=err))
    ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    current = heur.choose(x["D"], half, G * x["T"], x["B"] * x["Hkv"], x["P"] + x["T"], x["T"], sms, T=x["T"])
    cur_cfg = (current.block_m, current.block_n, current.num_warps, current.num_stages)
    cur = [r for r in ok if tuple(r["config"]) == cur_cfg and r["splits"] == current.num_splits]
    print(f"{name}: best " + "; ".join(f"{tuple(r['config'])} s={r['splits']} {r['us']:.1f}us" for r in ok[:5]))
    model = [r for r in ok if r["splits"] == r["model_splits"]]
    if model:
        print(f"  best with the model's splits: {tuple(model[0]['config'])} s={model[0]['splits']} {model[0]['us']:.1f}us")
    if cur:
        print(f"  table+model now: {cur_cfg} s={current.num_splits} {cur[0]['us']:.1f}us")
    errs = [r["max_err"] for r in ok if r.get("max_err") is not None]
    if errs:
        print(f"  max |err| vs CPU float32 over all configs: {max(errs):.3g}")
    results[name] = dict(shape={k: (str(v) if k == "dtype" else v) for k, v in x.items()
                                if not isinstance(v, torch.Tensor)}, rows=rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", nargs="+", default=["d128", "dims"], choices=["d128", "dims", "f32", "d512"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--max-seconds", type=float, default=420)
    ap.add_argument("--json", default=None)
    ap.add_argument("--configs", nargs="+", default=None, metavar="BM,BN,WARPS,STAGES[,WINDOW_N]",
                    help="d128: time only these configs instead of the full grid")
    args = ap.parse_args()
    configs = [tuple(int(x) for x in c.split(",")) for c in args.configs] if args.configs else None
    deadline = time.time() + args.max_seconds
    props = torch.cuda.get_device_properties(0)
    print(f"torch {torch.__version__}, {props.name} ({props.multi_processor_count} SMs)", flush=True)
    results = {}
    if "d128" in args.groups:
        for shape in bench_op.CUDA_SHAPES:
            x = problem(shape["B"], shape["T"], shape["P"], 32, 8, 128, torch.bfloat16)
            tune(f"bf16 D128 B{shape['B']} T{shape['T']} P{shape['P']}", x, configs or grid_d128(), args.iters, deadline,
                 results)
            del x
    if "dims" in args.groups:
        for D, Hq, Hkv, dtype in ((64, 64, 8, torch.bfloat16), (256, 16, 8, torch.bfloat16),
                                  (512, 8, 2, torch.bfloat16), (128, 32, 8, torch.float32)):
            x = problem(1, 64, 16384, Hq, Hkv, D, dtype)
            tune(f"{str(dtype)[6:]} D{D} Hq{Hq} Hkv{Hkv} B1 T64 P16384", x, grid_small(D, dtype != torch.float32),
                 args.iters, deadline, results)
            del x
    if "d512" in args.groups:
        for Hq, Hkv in ((32, 8), (8, 2)):   # bench_op's D=512 row, and a Gemma 4 global layer
            x = problem(1, 64, 16384, Hq, Hkv, 512, torch.bfloat16)
            tune(f"bf16 D512 Hq{Hq} Hkv{Hkv} B1 T64 P16384", x, grid_small(512, True), args.iters, deadline, results)
    if "f32" in args.groups:
        for D in (128, 64):
            x = problem(1, 64, 16384, 32, 8, D, torch.float32)
            tune(f"float32 D{D} Hq32 Hkv8 B1 T64 P16384", x, grid_small(D, False), args.iters, deadline, results)
            del x
    # Where one default call's time goes (every kernel it launches), at the smallest shape.
    x = problem(1, 64, 1024, 32, 8, 128, torch.bfloat16)
    graph, _ = timing.graphed(lambda: tb.forward_with_lse(x["q"], x["k"], x["v"], x["mask"], x["off"]))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
