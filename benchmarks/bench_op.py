"""Benchmark torch.ops.tree_attn.forward against the ways PyTorch can already do tree
verification, all measured in the same run on the same inputs.

Every shape verifies a random draft tree of T=64 nodes (ancestor-or-self mask, parents
first) after a committed prefix of P tokens; the cache holds P + T keys. `--shape`:

- llama (the reference): B=1, Hq=32, Hkv=8, D=128 (Llama-3-8B-like);
- gemma4-global: Hq=8, Hkv=2, D=512, scale 1 (a Gemma 4 full-attention layer);
  gemma4-global-mqa: the same with Hkv=1;
- gpt-oss: Hq=64, Hkv=8, D=64 with attention sinks (gpt-oss-20b).

`--dtype` float32, float16, bfloat16, or f32-over-bf16 / f32-over-f16 (a float32 query over
a half-precision cache; the peers widen K/V to float32 inside the timed call, as they need
one dtype). The implementations:

- tree_attn: compact mask [1, T, T] with mask_offset = P (and the sinks).
- sdpa: F.scaled_dot_product_attention with the dense bool mask [1, 1, T, P + T] and
  enable_gqa=True (PyTorch's fused kernel; the peer to beat). With sinks: the cache holds
  one extra all-zero key/value slot whose float mask entry is the head's sink (mask
  [1, Hq, T, P + T + 1], built once, outside the timing), which is exactly the sink's
  softmax term.
- matmul: repeat_kv, then matmul - softmax - matmul in the input dtype (what eager
  Hugging Face attention does; with sinks as gpt-oss's eager code: the sink logits
  joined to the scores, softmax, then dropped).

Prints the median time of each and its ratio to tree_attn (> 1: tree_attn is faster),
plus the largest difference between tree_attn's and SDPA's outputs.

    python benchmarks/bench_op.py                  # the full table on CPU
    python benchmarks/bench_op.py --quick          # a seconds-long smoke run
    python benchmarks/bench_op.py --threads 2 --dtype bfloat16 --prefix 4096
    python benchmarks/bench_op.py --shape gemma4-global gpt-oss --dtype float32 bfloat16
"""
import argparse
import dataclasses
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

B, T = 1, 64


@dataclasses.dataclass(frozen=True)
class Shape:
    Hq: int
    Hkv: int
    D: int
    scale: float = None  # None: D ** -0.5
    sinks: bool = False


SHAPES = {
    "llama": Shape(Hq=32, Hkv=8, D=128),
    "gemma4-global": Shape(Hq=8, Hkv=2, D=512, scale=1.0),
    "gemma4-global-mqa": Shape(Hq=8, Hkv=1, D=512, scale=1.0),
    "gpt-oss": Shape(Hq=64, Hkv=8, D=64, sinks=True),
}
# name: (query dtype, key/value dtype)
DTYPES = {
    "float32": (torch.float32, torch.float32),
    "float16": (torch.float16, torch.float16),
    "bfloat16": (torch.bfloat16, torch.bfloat16),
    "f32-over-bf16": (torch.float32, torch.bfloat16),
    "f32-over-f16": (torch.float32, torch.float16),
}


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


def make_problem(shape, P, dtypes, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    S = P + T
    q_dtype, kv_dtype = dtypes
    Hq, Hkv, D = shape.Hq, shape.Hkv, shape.D
    q = torch.randn(B, Hq, T, D, generator=gen).to(q_dtype)
    k = torch.randn(B, Hkv, S, D, generator=gen).to(kv_dtype)
    v = torch.randn(B, Hkv, S, D, generator=gen).to(kv_dtype)
    tree = random_tree_mask(T, gen)
    dense = torch.ones(B, 1, T, S, dtype=torch.bool)
    dense[..., P:] = tree
    x = dict(shape=shape, q=q, k=k, v=v, tree=tree[None], offsets=torch.tensor([P]), dense=dense, sinks=None)
    if shape.sinks:
        sinks = torch.randn(Hq, generator=gen)
        x["sinks"] = sinks
        # SDPA's form: slot 0 of a cache one key longer is zero, its bias the sink.
        zero = torch.zeros(B, Hkv, 1, D, dtype=kv_dtype)
        x["k_sink"], x["v_sink"] = torch.cat([zero, k], dim=2), torch.cat([zero, v], dim=2)
        bias = torch.zeros(B, Hq, T, S + 1).masked_fill(~torch.cat([dense[:, :, :, :1], dense], -1), float("-inf"))
        bias[..., 0] = sinks[None, :, None]
        x["dense_sink"] = bias.to(q_dtype)
    return {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in x.items()}


def tree_attn(x):
    return torch.ops.tree_attn.forward(x["q"], x["k"], x["v"], x["tree"], x["offsets"], x["shape"].scale, None,
                                       x["sinks"])


def sdpa(x):
    q, sinks = x["q"], x["sinks"] is not None
    k, v = (x["k_sink"], x["v_sink"]) if sinks else (x["k"], x["v"])
    k, v = k.to(q.dtype), v.to(q.dtype)  # a no-op unless the cache is narrower than the query
    mask = x["dense_sink"] if sinks else x["dense"]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=x["shape"].scale)


def matmul_softmax_matmul(x):
    shape, q = x["shape"], x["q"]
    G = shape.Hq // shape.Hkv
    k = x["k"].to(q.dtype).repeat_interleave(G, dim=1)
    v = x["v"].to(q.dtype).repeat_interleave(G, dim=1)
    scale = shape.D ** -0.5 if shape.scale is None else shape.scale
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~x["dense"], float("-inf"))
    if x["sinks"] is None:
        return torch.softmax(scores, dim=-1) @ v
    sink = x["sinks"].to(q.dtype)[None, :, None, None].expand(B, -1, T, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return probs @ v


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "mps", "cuda"])
    parser.add_argument("--shape", nargs="+", default=["llama"], choices=list(SHAPES))
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
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
          f"B={B} T={T} (random tree)")
    header = (f"{'shape':<17} {'dtype':<13} {'P':>6} | {'tree_attn ms':>12} | {'sdpa ms':>9} {'x':>6} | "
              f"{'matmul ms':>9} {'x':>6} | {'max|op-sdpa|':>12}")
    for shape_name in args.shape:
        shape = SHAPES[shape_name]
        print(f"\n{shape_name}: Hq={shape.Hq} Hkv={shape.Hkv} D={shape.D}"
              + (f" scale={shape.scale}" if shape.scale is not None else "") + (" sinks" if shape.sinks else ""))
        print(header)
        print("-" * len(header))
        for dtype_name in args.dtype:
            for P in args.prefix:
                x = make_problem(shape, P, DTYPES[dtype_name], args.device)
                diff = (tree_attn(x).float() - sdpa(x).float()).abs().max().item()
                ours = median_ms(lambda: tree_attn(x), args.device, args.iters, args.max_seconds)
                peer = median_ms(lambda: sdpa(x), args.device, args.iters, args.max_seconds)
                naive = median_ms(lambda: matmul_softmax_matmul(x), args.device, args.iters, args.max_seconds)
                print(f"{shape_name:<17} {dtype_name:<13} {P:>6} | {ours:>12.2f} | {peer:>9.2f} {peer / ours:>5.2f}x | "
                      f"{naive:>9.2f} {naive / ours:>5.2f}x | {diff:>12.2e}", flush=True)
                del x


if __name__ == "__main__":
    main()
