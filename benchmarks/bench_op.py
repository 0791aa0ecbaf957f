"""Benchmark torch.ops.tree_attn.forward against the ways PyTorch can already do tree
verification, all measured in the same run on the same inputs.

Shapes are the reference ones (Llama-3-8B-like attention): B=1, Hq=32, Hkv=8, D=128, and a
random draft tree of T=64 nodes (ancestor-or-self mask, parents first) after a committed
prefix of P tokens. The cache holds P + T keys.

- tree_attn: compact mask [1, T, T] with mask_offset = P.
- sdpa: F.scaled_dot_product_attention with the dense bool mask [1, 1, T, P + T] and
  enable_gqa=True (PyTorch's fused kernel; the peer to beat).
- matmul: repeat_kv, then matmul - softmax - matmul in the input dtype (what eager
  Hugging Face attention does).

Prints the median time of each and its ratio to tree_attn (> 1: tree_attn is faster),
plus the largest difference between tree_attn's and SDPA's outputs.

    python benchmarks/bench_op.py                  # the full table on CPU
    python benchmarks/bench_op.py --quick          # a seconds-long smoke run
    python benchmarks/bench_op.py --threads 2 --dtype bfloat16 --prefix 4096

On CUDA (`--device cuda`) the run is a different table, every method under a CUDA graph
(captured after warm-up, timed over replays with CUDA events), bfloat16:

- tree_attn: the op (the Triton kernels), compact mask and mask_offset;
- sdpa: F.scaled_dot_product_attention, dense bool mask, enable_gqa=True;
- flex: torch.nn.attention.flex_attention (compiled), 64x64 block mask built once from
  the tree (prefix blocks full, tree blocks partial);
- cascade: flash SDPA over the prefix with its LSE (GQA folded into the rows: the prefix
  has no mask), memory-efficient SDPA over the T tree keys with the tree bias and its
  LSE, then an LSE merge.

Shapes: B=1, Hq=32, Hkv=8, D=128, T=64 random tree, P in {1024, 4096, 16384, 65536}; plus
B=8 P=16384 and T=16 P=16384. Prints µs, the ratio of the best peer's time to ours (> 1:
tree_attn is faster) and the fraction of the H200 limit max(FLOPs / 790e12, bytes /
4.3e12) each method reaches; --json PATH and --plot PATH (matplotlib, optional) save it.

    python benchmarks/bench_op.py --device cuda --json out.json --plot out.png
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

try:
    import torch_tree_attn  # noqa: F401  (registers torch.ops.tree_attn)
except ImportError:  # run from a source checkout built in place (setup.py build_ext --inplace)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch_tree_attn  # noqa: F401
from torch_tree_attn.tree import ancestor_mask

B, HQ, HKV, D, T = 1, 32, 8, 128, 64


def random_tree_mask(T, gen):
    """Ancestor-or-self mask of a random tree with nodes ordered parents first."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, T)]
    return ancestor_mask(torch.tensor(parents))


def synchronize(device):
    if device == "cuda":
        torch.cuda.synchronize()
    elif device == "mps":
        torch.mps.synchronize()


def median_ms(fn, device, iters, max_seconds):
    """Median wall time of `fn` after one warm-up call: `iters` runs, fewer (but at least
    3) when they would take longer than `max_seconds`."""
    fn()
    synchronize(device)
    times = []
    started = time.perf_counter()
    while len(times) < iters and (len(times) < 3 or time.perf_counter() - started < max_seconds):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def make_problem(P, dtype, device, seed=0, B=B, T=T):
    gen = torch.Generator().manual_seed(seed)
    S = P + T
    q = torch.randn(B, HQ, T, D, generator=gen).to(dtype)
    k = torch.randn(B, HKV, S, D, generator=gen).to(dtype)
    v = torch.randn(B, HKV, S, D, generator=gen).to(dtype)
    tree = random_tree_mask(T, gen)
    dense = torch.ones(B, 1, T, S, dtype=torch.bool)
    dense[..., P:] = tree
    to = lambda t: t.to(device)  # noqa: E731
    return dict(q=to(q), k=to(k), v=to(v), tree=to(tree[None].expand(B, T, T).contiguous()),
                offsets=to(torch.tensor([P] * B)), dense=to(dense), P=P, B=B, T=T)


def tree_attn(x):
    return torch.ops.tree_attn.forward(x["q"], x["k"], x["v"], x["tree"], x["offsets"], None, None)


def sdpa(x):
    return F.scaled_dot_product_attention(x["q"], x["k"], x["v"], attn_mask=x["dense"], enable_gqa=True)


def matmul_softmax_matmul(x):
    k = x["k"].repeat_interleave(HQ // HKV, dim=1)
    v = x["v"].repeat_interleave(HQ // HKV, dim=1)
    scores = (x["q"] @ k.transpose(-1, -2)) * D ** -0.5
    scores = scores.masked_fill(~x["dense"], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


# --- CUDA: every method under a CUDA graph ---------------------------------------------

CUDA_SHAPES = [dict(B=1, T=64, P=P) for P in (1024, 4096, 16384, 65536)] + [
    dict(B=8, T=64, P=16384), dict(B=1, T=16, P=16384)]
PEAK_FLOPS = 790e12   # H200 dense bf16, as the issue states it
PEAK_BYTES = 4.3e12   # H200 HBM3e, bytes/s


def flex_method(x):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    P, Bx, Tx = x["P"], x["B"], x["T"]
    tree = x["tree"][0]
    S = P + Tx

    def mask_mod(b, h, q_idx, kv_idx):
        col = (kv_idx - P).clamp(0, Tx - 1)
        return (kv_idx < P) | ((kv_idx < S) & tree[q_idx, col])

    block_mask = create_block_mask(mask_mod, Bx, None, Tx, S, device="cuda", BLOCK_SIZE=64)
    compiled = torch.compile(flex_attention, fullgraph=True)
    return lambda: compiled(x["q"], x["k"], x["v"], block_mask=block_mask, enable_gqa=True)


def cascade_method(x):
    """Prefix: flash SDPA with its LSE, the G query heads of a kv head folded into its rows
    (no mask there, so GQA needs no K/V copy). Tree: memory-efficient SDPA over the T tree
    keys (expanded to Hq heads: T rows only) with the tree as a float bias and its LSE.
    Merge: lse = logaddexp, out = sum of o_i * exp(lse_i - lse)."""
    P, Bx, Tx = x["P"], x["B"], x["T"]
    G = HQ // HKV
    q, k, v = x["q"], x["k"], x["v"]
    q_fold = q.view(Bx, HKV, G * Tx, D)
    kp, vp = k[:, :, :P], v[:, :, :P]
    kt = k[:, :, P:P + Tx].repeat_interleave(G, dim=1)
    vt = v[:, :, P:P + Tx].repeat_interleave(G, dim=1)
    bias = torch.zeros(Bx, HQ, Tx, Tx, dtype=q.dtype, device=q.device)
    bias.masked_fill_(~x["tree"][:, None], float("-inf"))
    scale = D ** -0.5

    def run():
        o1, l1 = torch.ops.aten._scaled_dot_product_flash_attention(q_fold, kp, vp, 0.0, False, False,
                                                                     scale=scale)[:2]
        o2, l2 = torch.ops.aten._scaled_dot_product_efficient_attention(q, kt, vt, bias, True, 0.0, False,
                                                                         scale=scale)[:2]
        l1 = l1.reshape(Bx, HQ, Tx)
        l2 = l2[..., :Tx]
        lse = torch.logaddexp(l1, l2)
        return (o1.reshape(Bx, HQ, Tx, D) * torch.exp(l1 - lse)[..., None]
                + o2 * torch.exp(l2 - lse)[..., None]).to(q.dtype)

    return run


def graphed(fn, warmup=3):
    """fn captured in a CUDA graph after warm-up (compilation included); returns
    (replay, output of the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph.replay, out


def time_us(replay, iters, repeats=7):
    """Median over `repeats` of the mean time of `iters` back-to-back graph replays."""
    replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(samples)


def limit_us(x, elem_bytes=2):
    """The H200 limit for this call: max(FLOPs / peak, bytes / bandwidth), in µs. FLOPs count
    what a row sees (prefix plus its tree ancestors): 4 * D per (row, visible key); bytes
    are K and V of the P + T keys once per (batch row, kv head), plus q and out."""
    P, Bx, Tx = x["P"], x["B"], x["T"]
    visible = P * Tx + int(x["tree"][0].sum())
    flops = 4.0 * D * Bx * HQ * visible
    nbytes = elem_bytes * (2 * Bx * HKV * (P + Tx) * D + 2 * Bx * HQ * Tx * D)
    return max(flops / PEAK_FLOPS, nbytes / PEAK_BYTES) * 1e6


def cuda_main(args):
    dtype = torch.bfloat16
    props = torch.cuda.get_device_properties(0)
    print(f"torch {torch.__version__}, {props.name} ({props.multi_processor_count} SMs); Hq={HQ} Hkv={HKV} "
          f"D={D}, bfloat16, random tree; every method under a CUDA graph; us = median of replays")
    methods = ("tree_attn", "sdpa", "flex", "cascade")
    header = (f"{'B':>2} {'T':>3} {'P':>6} | " + " | ".join(f"{m:>10} us" for m in methods)
              + f" | {'best peer/ours':>14} | {'limit us':>8} | ours % of limit")
    print(header)
    print("-" * len(header))
    rows = []
    shapes = CUDA_SHAPES if not args.quick else [dict(B=1, T=64, P=1024)]
    if args.prefix_given:
        shapes = [dict(B=1, T=64, P=P) for P in args.prefix]
    for shape in shapes:
        x = make_problem(shape["P"], dtype, "cuda", B=shape["B"], T=shape["T"])
        builders = dict(tree_attn=lambda: (lambda: tree_attn(x)), sdpa=lambda: (lambda: sdpa(x)),
                        flex=lambda: flex_method(x), cascade=lambda: cascade_method(x))
        row = dict(shape, us={}, max_abs_diff={}, errors={})
        ref = None
        for name in methods:
            try:
                replay, out = graphed(builders[name]())
                row["us"][name] = time_us(replay, args.iters)
                out = out.float()
                if ref is None:
                    ref = out
                row["max_abs_diff"][name] = (out - ref).abs().max().item()
            except Exception as e:  # noqa: BLE001  (a peer missing in this torch is reported, not fatal)
                row["errors"][name] = f"{type(e).__name__}: {str(e)[:300]}"
        row["limit_us"] = limit_us(x)
        ours = row["us"].get("tree_attn")
        peers = [row["us"][m] for m in methods[1:] if m in row["us"]]
        row["best_peer_over_ours"] = (min(peers) / ours) if ours and peers else None
        row["fraction_of_limit"] = {m: row["limit_us"] / t for m, t in row["us"].items()}
        rows.append(row)
        cells = " | ".join(f"{row['us'][m]:>13.1f}" if m in row["us"] else f"{'error':>13}" for m in methods)
        ratio = f"{row['best_peer_over_ours']:>13.2f}x" if row["best_peer_over_ours"] else f"{'-':>14}"
        frac = f"{100 * row['fraction_of_limit']['tree_attn']:.0f}%" if ours else "-"
        print(f"{shape['B']:>2} {shape['T']:>3} {shape['P']:>6} | {cells} | {ratio} | {row['limit_us']:>8.1f} | "
              f"{frac}", flush=True)
        for name, err in row["errors"].items():
            print(f"    {name}: {err}")
        del x
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(dict(device=props.name, sms=props.multi_processor_count, torch=torch.__version__,
                           Hq=HQ, Hkv=HKV, D=D, dtype="bfloat16", rows=rows), f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot(rows, methods, args.plot)


def plot(rows, methods, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed, no plot written")
        return
    labels = [f"B{r['B']} T{r['T']}\nP{r['P']}" for r in rows]
    fig, ax = plt.subplots(figsize=(1.6 * len(rows) + 2, 4.5))
    width = 0.8 / (len(methods) + 1)
    for j, name in enumerate(list(methods) + ["limit"]):
        xs = [i + (j - len(methods) / 2) * width for i in range(len(rows))]
        ys = [r["limit_us"] if name == "limit" else r["us"].get(name, float("nan")) for r in rows]
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels)
    ax.set_yscale("log")
    ax.set_ylabel("µs (CUDA graph replay)")
    ax.set_title(f"tree attention, Hq={HQ} Hkv={HKV} D={D}, bfloat16")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "mps", "cuda"])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--prefix", nargs="+", type=int, default=[1024, 4096, 16384], help="prefix lengths P")
    parser.add_argument("--iters", type=int, default=10, help="timed runs per measurement (median)")
    parser.add_argument("--max-seconds", type=float, default=1.5,
                        help="stop a measurement after this long once it has 3 runs")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--quick", action="store_true", help="smoke run: P=256, 3 runs, float32 only")
    parser.add_argument("--json", default=None, help="(cuda) write the results as JSON here")
    parser.add_argument("--plot", default=None, help="(cuda) write a PNG bar chart here (needs matplotlib)")
    args = parser.parse_args(argv)
    args.prefix_given = any(a.startswith("--prefix") for a in (sys.argv[1:] if argv is None else argv))

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: CUDA is not available in this torch build")
    if args.device == "mps" and not torch.backends.mps.is_available():
        sys.exit("--device mps: MPS is not available on this machine")
    if args.device == "cuda":
        if args.iters == 10:
            args.iters = 50
        return cuda_main(args)
    if args.quick:
        args.prefix, args.iters, args.dtype = [256], 3, ["float32"]
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    print(f"torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}; "
          f"B={B} Hq={HQ} Hkv={HKV} D={D} T={T} (random tree)")
    header = (f"{'dtype':<9} {'P':>6} | {'tree_attn ms':>12} | {'sdpa ms':>9} {'x':>6} | "
              f"{'matmul ms':>9} {'x':>6} | {'max|op-sdpa|':>12}")
    print(header)
    print("-" * len(header))
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        for P in args.prefix:
            x = make_problem(P, dtype, args.device)
            diff = (tree_attn(x).float() - sdpa(x).float()).abs().max().item()
            ours = median_ms(lambda: tree_attn(x), args.device, args.iters, args.max_seconds)
            peer = median_ms(lambda: sdpa(x), args.device, args.iters, args.max_seconds)
            naive = median_ms(lambda: matmul_softmax_matmul(x), args.device, args.iters, args.max_seconds)
            print(f"{dtype_name:<9} {P:>6} | {ours:>12.2f} | {peer:>9.2f} {peer / ours:>5.2f}x | "
                  f"{naive:>9.2f} {naive / ours:>5.2f}x | {diff:>12.2e}", flush=True)
            del x


if __name__ == "__main__":
    main()
