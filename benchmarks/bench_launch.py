"""What one CUDA call of the op costs the host, and what a fresh process pays before its
first result. Every number of a run is measured in that run, peers included.

1. Eager host cost, P=1024 (the latency-bound end; Llama-3-8B attention shape: bf16, B=1,
   Hq=32, Hkv=8, D=128, T=64 random tree after P keys). For the op and for SDPA (dense bool
   mask, enable_gqa), the peer a transformers user has:
   - enqueue µs/call: N back-to-back eager calls timed on the host without waiting for the
     GPU (the CUDA queue absorbs them): the host's own cost of a call;
   - eager µs/call: the same N calls until the GPU is done, over N (max of host and GPU);
   - graph µs/call: the same call captured once in a CUDA graph, replayed N times (the
     GPU's time alone).
   eager minus graph is what the host adds to a call that users see.
2. First call in a fresh process (a subprocess per row): seconds from interpreter start to
   `import torch_tree_attn` done, to the first result on the GPU, and the kernels the
   registry compiled on the way (0 when prebuilt kernels fit). Rows: prebuilt kernels
   (the default); the compile-once fallback with prebuilt kernels disabled
   (TORCH_TREE_ATTN_NO_PREBUILT=1) and an empty Triton cache (a user on a GPU the table
   does not cover, first run); the same again with a warm Triton cache.

    python benchmarks/bench_launch.py --json out.json
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from timing import graphed, replay_us  # benchmarks/timing.py, beside this script

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

FIRST_CALL = r"""
import time, json, sys
t0 = time.perf_counter()
import torch
import torch_tree_attn
from torch_tree_attn import _C
t_import = time.perf_counter() - t0
B, Hq, Hkv, T, D, P = 1, 32, 8, 64, 128, 1024
q = torch.randn(B, Hq, T, D, device="cuda", dtype=torch.bfloat16)
k = torch.randn(B, Hkv, P + T, D, device="cuda", dtype=torch.bfloat16)
mask = torch.tril(torch.ones(1, T, T, dtype=torch.bool, device="cuda"))
off = torch.tensor([P], device="cuda")
torch.cuda.synchronize()
t1 = time.perf_counter()
out = torch.ops.tree_attn.forward(q, k, k, mask, off)
torch.cuda.synchronize()
t_call = time.perf_counter() - t1
print(json.dumps(dict(import_s=t_import, first_call_s=t_call, total_s=time.perf_counter() - t0,
                      registry=_C.cuda_registry_stats())))
"""


def first_call(env_extra):
    env = dict(os.environ, **env_extra)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", FIRST_CALL], env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return dict(error=proc.stderr[-2000:], process_s=wall)
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    row["process_s"] = wall
    return row


def problem(P, T=64, Hq=32, Hkv=8, D=128, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, Hq, T, D, generator=gen).to(torch.bfloat16).cuda()
    k = torch.randn(1, Hkv, P + T, D, generator=gen).to(torch.bfloat16).cuda()
    v = torch.randn(1, Hkv, P + T, D, generator=gen).to(torch.bfloat16).cuda()
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, T)]
    from torch_tree_attn.tree import ancestor_mask

    tree = ancestor_mask(torch.tensor(parents))[None].cuda()
    dense = torch.ones(1, 1, T, P + T, dtype=torch.bool, device="cuda")
    dense[..., P:] = tree
    return dict(q=q, k=k, v=v, tree=tree, off=torch.tensor([P], device="cuda"), dense=dense)


def calls(x, breakdown=False):
    op = lambda: torch.ops.tree_attn.forward(x["q"], x["k"], x["v"], x["tree"], x["off"])  # noqa: E731
    out = {"tree_attn": op,
           "sdpa": lambda: F.scaled_dot_product_attention(x["q"], x["k"], x["v"], attn_mask=x["dense"],
                                                          enable_gqa=True)}
    if breakdown:
        import torch_tree_attn
        from torch_tree_attn import _C

        def inference():
            with torch.inference_mode():
                return op()

        # Where the host time goes: the op without the autograd layer, and the C++ launch
        # without the dispatcher (pybind straight into prepare + launch).
        out["tree_attn (inference_mode)"] = inference
        overload = torch.ops.tree_attn.forward.default
        out["tree_attn (.default overload)"] = lambda: overload(x["q"], x["k"], x["v"], x["tree"], x["off"])
        out["tree_attention()"] = lambda: torch_tree_attn.tree_attention(x["q"], x["k"], x["v"], x["tree"], x["off"])
        out["tree_attn (_C direct)"] = lambda: _C.cuda_forward_with_lse(x["q"], x["k"], x["v"], x["tree"], x["off"])
    return out


def profile(fn, n=50):
    """The profiler's CPU-side table of n calls (what each host step costs)."""
    from torch.profiler import ProfilerActivity, profile as prof

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return p.key_averages().table(sort_by="cpu_time_total", row_limit=18)


def host_costs(fn, n, repeats):
    """(enqueue µs/call, eager µs/call): medians over `repeats` loops of n calls."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    enqueue, eager = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        enqueue.append((t1 - t0) / n * 1e6)
        eager.append((t2 - t0) / n * 1e6)
    return statistics.median(enqueue), statistics.median(eager)


def graph_cost(fn, n, repeats):
    """graph µs/call: fn captured once (after 3 warm-up calls), the median over `repeats`
    loops of n replays."""
    graph, _ = graphed(fn, warmup=3)
    return replay_us(graph.replay, n, repeats)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix", type=int, nargs="+", default=[1024])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-first-call", action="store_true")
    ap.add_argument("--breakdown", action="store_true", help="also time the op without autograd / dispatcher, "
                    "and print the profiler's host table")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    import torch_tree_attn  # noqa: F401
    from torch_tree_attn import _C

    props = torch.cuda.get_device_properties(0)
    print(f"torch {torch.__version__}, {props.name}; bf16 B=1 Hq=32 Hkv=8 D=128 T=64; {a.calls} calls x "
          f"{a.repeats} repeats, medians")
    rows = []
    print(f"{'P':>6} {'method':<28} | {'enqueue us':>10} | {'eager us':>9} | {'graph us':>9} | {'eager-graph':>11}")
    for P in a.prefix:
        x = problem(P)
        for name, fn in calls(x, a.breakdown).items():
            enq, eager = host_costs(fn, a.calls, a.repeats)
            graph = graph_cost(fn, a.calls, a.repeats)
            rows.append(dict(P=P, method=name, enqueue_us=enq, eager_us=eager, graph_us=graph))
            print(f"{P:>6} {name:<28} | {enq:>10.1f} | {eager:>9.1f} | {graph:>9.1f} | {eager - graph:>11.1f}")
    if a.breakdown:
        print(profile(calls(problem(a.prefix[0]))["tree_attn"]))
    first = []
    if not a.no_first_call:
        with tempfile.TemporaryDirectory() as cold:
            variants = [("prebuilt kernels", {}),
                        ("fallback, cold Triton cache", dict(TORCH_TREE_ATTN_NO_PREBUILT="1", TRITON_CACHE_DIR=cold)),
                        ("fallback, warm Triton cache", dict(TORCH_TREE_ATTN_NO_PREBUILT="1", TRITON_CACHE_DIR=cold))]
            print(f"\n{'first call in a fresh process':<30} | {'import s':>8} | {'1st call s':>10} | "
                  f"{'process s':>9} | compiled")
            for label, env in variants:
                r = first_call(env)
                r["variant"] = label
                first.append(r)
                if "error" in r:
                    print(f"{label:<30} | failed: {r['error'][-300:]}")
                else:
                    print(f"{label:<30} | {r['import_s']:>8.2f} | {r['first_call_s']:>10.3f} | "
                          f"{r['process_s']:>9.2f} | {r['registry']['compiled']}")
    result = dict(torch=torch.__version__, gpu=props.name, registry=_C.cuda_registry_stats(), eager=rows,
                  first_call=first)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
