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

On CUDA (`--device cuda`) the run is a different table, every method under a CUDA graph
(captured after warm-up, timed over replays with CUDA events), bfloat16:

- tree_attn: the op as users call it, compact mask and mask_offset (the process's default
  kernel choice, "auto": on sm_90 the Hopper Gluon kernel where it covers the call, else the
  Triton kernel); the last column names the kernel it took;
- tree_attn_triton: the same call on the portable Triton kernel (kernel="triton");
- sdpa: F.scaled_dot_product_attention, dense bool mask, enable_gqa=True;
- flex: torch.nn.attention.flex_attention (compiled), 64x64 block mask built once from
  the tree (prefix blocks full, tree blocks partial);
- cascade: flash SDPA over the prefix with its LSE (GQA folded into the rows: the prefix
  has no mask), memory-efficient SDPA over the T tree keys with the tree bias and its
  LSE, then an LSE merge.

Shapes: B=1, Hq=32, Hkv=8, D=128, T=64 random tree, P in {1024, 4096, 16384, 65536}; plus
B=8 P=16384 and T=16 P=16384; then at P=16384 the rows D=64, D=256, D=512 (bfloat16) and
float32 D=128 (--no-extra-rows drops them). Prints µs, the ratio of the best peer's time to ours (> 1:
tree_attn is faster) and the fraction of the GPU's limit max(FLOPs / peak, bytes /
bandwidth) each method reaches (H200: 790e12 FLOP/s, 4.3e12 B/s; H100: 790e12, 3.35e12); --json PATH and --plot PATH (matplotlib, optional) save it.

    python benchmarks/bench_op.py --device cuda --json out.json --plot out.png

`--device mps-model` runs nothing on a GPU: for each Apple chip of benchmarks/apple_chips.py
it prints the time benchmarks/metal_cost.py *models* for the Metal plan (v1 vector kernel,
v2 matrix kernel, their ratio and what bounds each) from the simulator's counted work
(needs the simulator, tests/sim, built). Shapes llama and gemma4-global, bfloat16, float16,
float32, P in {1024, 4096, 16384} unless given. Modelled, not measured; --json writes
each plan JSON with its modelled times added.

    python benchmarks/bench_op.py --device mps-model --json model.json
"""
import argparse
import dataclasses
import os
import sys

import torch
import torch.nn.functional as F

try:
    import torch_tree_attn  # noqa: F401  (registers torch.ops.tree_attn)
except ImportError:  # run from a source checkout built in place (setup.py build_ext --inplace)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch_tree_attn  # noqa: F401
from torch_tree_attn.tree import ancestor_mask

from timing import graphed, median_ms, pyplot, replay_us  # benchmarks/timing.py, beside this script

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


def make_problem(shape, P, dtypes, device, seed=0, B=B, T=T):
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
    x = dict(shape=shape, q=q, k=k, v=v, tree=tree[None].expand(B, T, T).contiguous(), offsets=torch.tensor([P] * B),
             dense=dense, sinks=None, P=P, B=B, T=T)
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
    sink = x["sinks"].to(q.dtype)[None, :, None, None].expand(x["B"], -1, x["T"], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return probs @ v


# --- CUDA: every method under a CUDA graph ---------------------------------------------

CUDA_SHAPES = [dict(B=1, T=64, P=P) for P in (1024, 4096, 16384, 65536)] + [
    dict(B=8, T=64, P=16384), dict(B=1, T=16, P=16384)]
# At P=16384: the other head dims and a float32 call (the Triton kernel's rows today).
CUDA_EXTRA_SHAPES = [dict(B=1, T=64, P=16384, D=64), dict(B=1, T=64, P=16384, D=256),
                     dict(B=1, T=64, P=16384, D=512), dict(B=1, T=64, P=16384, dtype="float32")]
CUDA_SHAPE = SHAPES["llama"]
HQ, HKV, D = CUDA_SHAPE.Hq, CUDA_SHAPE.Hkv, CUDA_SHAPE.D
# The limit's peaks by GPU: (dense bf16 FLOP/s, memory bytes/s). The H200's are the issue's;
# the H100 SXM has the same SMs and clocks (so the same FLOP/s) and HBM3 at 3.35 TB/s (NVIDIA's
# datasheet figure). Another GPU falls back to the H200's, and the header says so.
PEAKS = {"H200": (790e12, 4.3e12), "H100": (790e12, 3.35e12)}


def peaks_for(gpu_name: str):
    """(name, FLOP/s, bytes/s) of the limit used for this GPU."""
    for name, (flops, nbytes) in PEAKS.items():
        if name in gpu_name:
            return name, flops, nbytes
    return "H200 (assumed)", *PEAKS["H200"]




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
    # Inductor's default 128-key blocks neither divide S = P + 64 nor find a config here
    # ("No choices to select"): the kernel's blocks match the 64x64 block mask.
    options = dict(BLOCK_M=64, BLOCK_N=64)
    return lambda: compiled(x["q"], x["k"], x["v"], block_mask=block_mask, enable_gqa=True, kernel_options=options)


def cascade_method(x):
    """Prefix: flash SDPA with its LSE, the G query heads of a kv head folded into its rows
    (no mask there, so GQA needs no K/V copy). Tree: memory-efficient SDPA over the T tree
    keys (expanded to Hq heads: T rows only) with the tree as a float bias and its LSE.
    Merge: lse = logaddexp, out = sum of o_i * exp(lse_i - lse)."""
    P, Bx, Tx = x["P"], x["B"], x["T"]
    G = HQ // HKV
    q, k, v = x["q"], x["k"], x["v"]
    D = q.shape[-1]   # the row's head dim (the D=64/256/512 rows too)
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


def limit_us(x, peaks):
    """The GPU's limit for this call (PEAKS): max(FLOPs / peak, bytes / bandwidth), in µs. FLOPs count
    what a row sees (prefix plus its tree ancestors): 4 * D per (row, visible key); bytes
    are K and V of the P + T keys once per (batch row, kv head), plus q and out. The bf16
    tensor-core peak for every dtype (a float32 call is held to the same bar)."""
    P, Bx, Tx = x["P"], x["B"], x["T"]
    sh = x["shape"]
    elem_bytes = x["k"].element_size()
    visible = P * Tx + int(x["tree"][0].sum())
    flops = 4.0 * sh.D * Bx * sh.Hq * visible
    nbytes = elem_bytes * (2 * Bx * sh.Hkv * (P + Tx) * sh.D + 2 * Bx * sh.Hq * Tx * sh.D)
    _, peak_flops, peak_bytes = peaks
    return max(flops / peak_flops, nbytes / peak_bytes) * 1e6


def tree_attn_triton(x):
    from torch_tree_attn.backends import cuda as cuda_backend

    return cuda_backend.forward_with_lse(x["q"], x["k"], x["v"], x["tree"], x["offsets"], x["shape"].scale, None,
                                           x["sinks"], kernel="triton")[0]


def cuda_main(args):
    props = torch.cuda.get_device_properties(0)
    peaks = peaks_for(props.name)   # here, not at import: importing bench_op must not start CUDA
    peak_name, peak_flops, peak_bytes = peaks
    print(f"torch {torch.__version__}, {props.name} ({props.multi_processor_count} SMs); Hq={HQ} Hkv={HKV}, "
          f"random tree; every method under a CUDA graph; us = median of replays; limit: {peak_name}, "
          f"{peak_flops / 1e12:.0f} TFLOP/s, {peak_bytes / 1e12:.2f} TB/s")
    methods = ("tree_attn", "tree_attn_triton", "sdpa", "flex", "cascade")
    peers = ("sdpa", "flex", "cascade")
    header = (f"{'B':>2} {'T':>3} {'P':>6} {'D':>3} {'dtype':>8} | " + " | ".join(f"{m[:16]:>16} us" for m in methods)
              + f" | {'best peer/ours':>14} | {'limit us':>8} | ours % of limit")
    print(header)
    print("-" * len(header))
    rows = []
    shapes = CUDA_SHAPES + (CUDA_EXTRA_SHAPES if args.extra_rows else []) if not args.quick else [
        dict(B=1, T=64, P=1024)]
    if args.prefix_given:
        shapes = [dict(B=1, T=64, P=P) for P in args.prefix]
    for shape in shapes:
        shape = dict(dict(D=D, dtype="bfloat16"), **shape)
        dtype = DTYPES[shape["dtype"]]
        x = make_problem(Shape(Hq=HQ, Hkv=HKV, D=shape["D"]), shape["P"], dtype, "cuda", B=shape["B"], T=shape["T"])
        builders = dict(tree_attn=lambda: (lambda: tree_attn(x)), tree_attn_triton=lambda: (lambda: tree_attn_triton(x)),
                        sdpa=lambda: (lambda: sdpa(x)), flex=lambda: flex_method(x), cascade=lambda: cascade_method(x))
        row = dict(shape, us={}, max_abs_diff={}, errors={})
        try:
            from torch_tree_attn import _C

            row["kernel"] = _C.cuda_plan_launch(x["q"], x["k"], x["v"], x["tree"], x["offsets"],
                                                arch=props.major * 10 + props.minor,
                                                num_sms=props.multi_processor_count)[0].kernel
        except Exception:  # noqa: BLE001
            row["kernel"] = "?"
        ref = None
        for name in methods:
            try:
                graph, out = graphed(builders[name]())
                row["us"][name] = replay_us(graph.replay, args.iters)
                out = out.float()
                if ref is None:
                    ref = out
                row["max_abs_diff"][name] = (out - ref).abs().max().item()
            except Exception as e:  # noqa: BLE001  (a peer missing in this torch is reported, not fatal)
                row["errors"][name] = f"{type(e).__name__}: {str(e)[:300]}"
        row["limit_us"] = limit_us(x, peaks)
        ours = row["us"].get("tree_attn")
        peer_us = [row["us"][m] for m in peers if m in row["us"]]
        row["best_peer_over_ours"] = (min(peer_us) / ours) if ours and peer_us else None
        tri = row["us"].get("tree_attn_triton")
        row["best_peer_over_triton"] = (min(peer_us) / tri) if tri and peer_us else None
        row["fraction_of_limit"] = {m: row["limit_us"] / t for m, t in row["us"].items()}
        rows.append(row)
        cells = " | ".join(f"{row['us'][m]:>19.1f}" if m in row["us"] else f"{'error':>19}" for m in methods)
        ratio = f"{row['best_peer_over_ours']:>13.2f}x" if row["best_peer_over_ours"] else f"{'-':>14}"
        frac = f"{100 * row['fraction_of_limit']['tree_attn']:.0f}%" if ours else "-"
        print(f"{shape['B']:>2} {shape['T']:>3} {shape['P']:>6} {shape['D']:>3} {shape['dtype'][:8]:>8} | {cells} | "
              f"{ratio} | {row['limit_us']:>8.1f} | {frac}; kernel {row['kernel']}; the Triton kernel: "
              f"{row['best_peer_over_triton'] or float('nan'):.2f}x peer", flush=True)
        for name, err in row["errors"].items():
            print(f"    {name}: {err}")
        del x
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(dict(device=props.name, sms=props.multi_processor_count, torch=torch.__version__,
                           Hq=HQ, Hkv=HKV, limit=dict(gpu=peak_name, flops=peak_flops, bytes_per_s=peak_bytes),
                           rows=rows), f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot(rows, methods, args.plot)


def plot(rows, methods, path):
    plt = pyplot("--plot")
    if plt is None:
        return
    labels = [f"B{r['B']} T{r['T']}\nP{r['P']}" + ("" if (r.get("D", D), r.get("dtype", "bfloat16")) == (
        D, "bfloat16") else f"\nD{r['D']} {r['dtype']}") for r in rows]
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
    ax.set_title(f"tree attention, Hq={HQ} Hkv={HKV} (D={D} bfloat16 unless labelled)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


# --- Apple GPUs: the cost model (modelled, not measured) ---------------------------------

def mps_model_main(args):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        import torch_tree_attn_sim  # noqa: F401
        import metal_cost
    except ImportError as e:
        sys.exit(f"--device mps-model needs the Metal simulator installed (pip install --no-build-isolation "
                 f"./tests/sim, as for the tests): {e}")
    from apple_chips import CHIPS

    label = metal_cost.LABEL.upper()
    shapes = args.shape if args.shape_given else ["llama", "gemma4-global"]
    dtypes = args.dtype if args.dtype_given else ["bfloat16", "float16", "float32"]
    for name in dtypes:
        if DTYPES[name][0] != DTYPES[name][1]:
            sys.exit(f"--device mps-model: {name} is not modelled (one dtype for query and cache)")
    families = ["vector", "matrix"] if metal_cost.has_family_override() else [None]
    print(f"Metal plan on Apple GPUs: {label}. Times come from the simulator's counted work and published "
          f"per-chip figures (benchmarks/metal_cost.py states every assumption); no Apple GPU ran anything.")
    if families == [None]:
        print("this simulator has no kernel-family override: only the plan's own choice is modelled (as v1)")
    results = []
    for shape_name in shapes:
        shape = SHAPES[shape_name]
        for dtype_name in dtypes:
            for P in args.prefix:
                problem = metal_cost.Problem(Hq=shape.Hq, Hkv=shape.Hkv, D=shape.D, P=P, dtype=dtype_name)
                per_family = {}
                for family in families:
                    try:
                        per_family[family] = metal_cost.model(problem, CHIPS, family)
                    except (ValueError, RuntimeError) as e:  # v2 has no instantiation here (D = 512)
                        per_family[family] = (None, str(e).splitlines()[0][:200])
                results.append((shape_name, dtype_name, P, per_family))
    v1, v2 = families[0], families[-1] if len(families) > 1 else None
    header = (f"{'chip':<7} {'shape':<14} {'dtype':<9} {'P':>6} | {'v1 us':>9} {'bound':>11} | {'v2 us':>9} "
              f"{'bound':>11} | {'v1/v2':>6}   ({label})")
    rows = []
    for chip in CHIPS:
        print(f"\n{chip.name}: {chip.gpu_cores} GPU cores, {chip.clock_mhz:.0f} MHz, {chip.bandwidth_gbs:g} GB/s"
              + (f" (estimated: {', '.join(chip.estimated)})" if chip.estimated else ""))
        print(header)
        print("-" * len(header))
        for shape_name, dtype_name, P, per_family in results:
            cells, row = [], dict(chip=chip.name, shape=shape_name, dtype=dtype_name, P=P, label=metal_cost.LABEL)
            for tag, family in (("v1", v1), ("v2", v2)):
                times, plan = per_family.get(family, (None, "not modelled")) if family or tag == "v1" else (None,
                                                                                                      "n/a")
                if times is None:
                    cells.append(f"{'n/a':>9} {'':>11}")
                    row[tag] = dict(error=plan)
                else:
                    t = times[chip.name]
                    cells.append(f"{t.total_us:>9.1f} {t.bound:>11}")
                    row[tag] = dict(modelled_us=t.total_us, bound=t.bound, kernel=t.launches[0].kernel)
            ratio = (row["v1"]["modelled_us"] / row["v2"]["modelled_us"]
                     if "modelled_us" in row["v1"] and "modelled_us" in row.get("v2", {}) else None)
            row["v1_over_v2"] = ratio
            rows.append(row)
            print(f"{chip.name:<7} {shape_name:<14} {dtype_name:<9} {P:>6} | {cells[0]} | {cells[1]} | "
                  + (f"{ratio:>5.2f}x" if ratio else f"{'-':>6}"), flush=True)
    if args.json:
        import json

        plans = [dict(shape=s, dtype=d, P=P, family=f or "auto", plan=r[1])
                 for s, d, P, pf in results for f, r in pf.items() if r[0] is not None]
        with open(args.json, "w") as f:
            json.dump(dict(label=metal_cost.LABEL, chips=[dataclasses.asdict(c) for c in CHIPS], rows=rows,
                           plans=plans), f, indent=1)
        print(f"wrote {args.json} ({metal_cost.LABEL})")
    if args.plot:
        plot_model(rows, args.plot, metal_cost.LABEL)


def plot_model(rows, path, label):
    plt = pyplot("--plot")
    if plt is None:
        return
    picked = [r for r in rows if r["shape"] == "llama" and r["dtype"] == rows[0]["dtype"] and r["P"] == max(
        x["P"] for x in rows)]
    fig, ax = plt.subplots(figsize=(1.0 * len(picked) + 2, 4.5))
    for j, tag in enumerate(("v1", "v2")):
        ys = [r[tag].get("modelled_us", float("nan")) for r in picked]
        ax.bar([i + (j - 0.5) * 0.4 for i in range(len(picked))], ys, 0.4, label=tag)
    ax.set_xticks(range(len(picked)))
    ax.set_xticklabels([r["chip"] for r in picked], rotation=45)
    ax.set_ylabel(f"µs ({label})")
    if picked:
        ax.set_title(f"llama shape, {picked[0]['dtype']}, P={picked[0]['P']}: {label}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "mps", "cuda", "mps-model"])
    parser.add_argument("--shape", nargs="+", default=["llama"], choices=list(SHAPES))
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    parser.add_argument("--prefix", nargs="+", type=int, default=[1024, 4096, 16384], help="prefix lengths P")
    parser.add_argument("--iters", type=int, default=10, help="timed runs per measurement (median)")
    parser.add_argument("--max-seconds", type=float, default=1.5,
                        help="stop a measurement after this long once it has 3 runs")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--no-extra-rows", dest="extra_rows", action="store_false",
                        help="(cuda) only the bf16 D=128 rows, not D=64/256/512 and float32 at P=16384")
    parser.add_argument("--quick", action="store_true", help="smoke run: P=256, 3 runs, float32 only")
    parser.add_argument("--json", default=None, help="(cuda, mps-model) write the results as JSON here")
    parser.add_argument("--plot", default=None,
                        help="(cuda, mps-model) write a PNG bar chart here (needs matplotlib)")
    args = parser.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    args.prefix_given = any(a.startswith("--prefix") for a in given)
    args.shape_given = any(a.startswith("--shape") for a in given)
    args.dtype_given = any(a.startswith("--dtype") for a in given)
    if args.device == "mps-model":
        return mps_model_main(args)

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
                # One warm-up call each; at most --iters timed runs, fewer (3 at least) past --max-seconds.
                timed = dict(warmup=1, max_seconds=args.max_seconds)
                ours = median_ms(lambda: tree_attn(x), args.device, args.iters, **timed)
                peer = median_ms(lambda: sdpa(x), args.device, args.iters, **timed)
                naive = median_ms(lambda: matmul_softmax_matmul(x), args.device, args.iters, **timed)
                print(f"{shape_name:<17} {dtype_name:<13} {P:>6} | {ours:>12.2f} | {peer:>9.2f} {peer / ours:>5.2f}x | "
                      f"{naive:>9.2f} {naive / ours:>5.2f}x | {diff:>12.2e}", flush=True)
                del x


if __name__ == "__main__":
    main()
