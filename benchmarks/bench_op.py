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


def make_problem(P, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    S = P + T
    q = torch.randn(B, HQ, T, D, generator=gen).to(dtype)
    k = torch.randn(B, HKV, S, D, generator=gen).to(dtype)
    v = torch.randn(B, HKV, S, D, generator=gen).to(dtype)
    tree = random_tree_mask(T, gen)
    dense = torch.ones(B, 1, T, S, dtype=torch.bool)
    dense[..., P:] = tree
    to = lambda t: t.to(device)  # noqa: E731
    return dict(q=to(q), k=to(k), v=to(v), tree=to(tree[None]), offsets=to(torch.tensor([P])), dense=to(dense))


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
    args = parser.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: CUDA is not available in this torch build")
    if args.device == "mps" and not torch.backends.mps.is_available():
        sys.exit("--device mps: MPS is not available on this machine")
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
