"""One tree-verify step of a whole transformers model: tree_attn against the attention
implementations transformers ships, measured in the same run on the same weights and cache.

The model is built from a config with random weights (no download): on CUDA Llama-3-8B's
shape (32 layers, hidden 4096, 32 heads, 8 kv heads, head dim 128, bf16); on CPU a small
Llama (2 layers, hidden 256, 4 heads, 2 kv heads, head dim 64, float32) so CI can smoke
the script. A StaticCache of P + T positions holds P prefix keys/values (random, written
in place: no P-token prefill), then one forward verifies a random T=64 tree (parents
first):

- tree_attn: the documented tree call, model(input_ids=tree tokens, position_ids=P +
  depth, past_key_values=cache, tree_mask=[1, T, T] ancestor mask, mask_offset=[P]);
- sdpa / flex_attention: the same tokens and positions with the equivalent dense bool
  mask [1, 1, T, P + T] (prefix visible, tree by ancestry, nothing after the tree).

Modes: eager (a plain forward; CUDA events on the GPU, perf_counter on CPU; median of
--iters after warm-up) and, on CUDA, graph (the forward captured once in a CUDA graph,
replayed with new tree tokens copied into its input buffer; the cache length is reset to
P before each step, outside the timing). Each step's attention share comes from one
profiled eager step: the device time of kernels whose name marks them as attention
(ours: _tree_attn_main/_tree_attn_reduce; SDPA's flash/efficient/cudnn/math kernels;
flex's triton templates) over all device time; on CPU the ops' CPU time instead. Before
timing, the tree_attn logits are compared with sdpa's (max |difference| in the JSON).

    python benchmarks/bench_e2e.py --device cuda --json out.json --png out.png
    python benchmarks/bench_e2e.py --device cpu          # small model, seconds
"""
import argparse
import datetime
import json
import os
import re
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

T = 64
ATTENTION_KERNELS = re.compile(r"tree_attn|flash|fmha|efficient_attention|cudnn.*attn|attention|sdpa|flex|triton_tem",
                               re.IGNORECASE)
CPU_ATTENTION_OPS = re.compile(r"tree_attn::forward|scaled_dot_product|flex_attention", re.IGNORECASE)


def build_model(device):
    from transformers import LlamaConfig, LlamaForCausalLM

    if device == "cuda":
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0,
                          max_position_embeddings=131072)
        dtype = torch.bfloat16
    else:
        cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=64, vocab_size=1000, max_position_embeddings=4096)
        dtype = torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = LlamaForCausalLM(cfg).eval()
        finally:
            torch.set_default_dtype(prev)
    return model, dtype


def random_tree(gen):
    from torch_tree_attn.tree import ancestor_mask

    parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, T)])
    mask = ancestor_mask(parents)
    return parents, mask, mask.sum(-1) - 1     # depth = ancestors


class Step:
    """One model, one static cache of P + T slots holding P random prefix positions, and the
    inputs of one tree-verify forward for each attention implementation."""

    def __init__(self, model, dtype, P, device, seed=0):
        from torch_tree_attn import _hf_compat as compat
        from transformers import StaticCache

        self.model, self.P, self.device, self.compat = model, P, device, compat
        gen = torch.Generator().manual_seed(seed)
        _, anc, depth = random_tree(gen)
        self.cache = StaticCache(config=model.config, max_cache_len=P + T)
        with torch.no_grad():   # one token initialises every layer's buffers
            model.set_attn_implementation("sdpa")
            model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), **compat.cache_kwargs(model, self.cache))
        for layer in self.cache.layers:
            for buf in (layer.keys, layer.values):
                buf.zero_()
                buf[:, :, :P].copy_(torch.randn(buf[:, :, :P].shape, generator=gen).to(buf.dtype))
        self.tokens = torch.randint(0, model.config.vocab_size, (1, T), generator=gen).to(device)
        self.positions = (P + depth)[None].to(device)
        self.tree = anc[None].to(device)
        self.offset = torch.tensor([P], device=device)
        dense = torch.zeros(1, 1, T, P + T, dtype=torch.bool)
        dense[..., :P] = True
        dense[..., P:] = anc
        self.dense = dense.to(device)

    def reset(self):
        for layer in self.cache.layers:
            self.compat.set_layer_length(layer, self.P)

    def forward(self, impl):
        kw = self.compat.cache_kwargs(self.model, self.cache)
        if impl == "tree_attn":
            kw.update(tree_mask=self.tree, mask_offset=self.offset)
        else:
            kw.update(attention_mask=self.dense)
        return self.model(input_ids=self.tokens, position_ids=self.positions, use_cache=True, **kw).logits


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_eager(step, impl, iters):
    times = []
    for i in range(iters + 2):
        step.reset()
        sync(step.device)
        if step.device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step.forward(impl)
            b.record()
            b.synchronize()
            ms = a.elapsed_time(b)
        else:
            t0 = time.perf_counter()
            step.forward(impl)
            ms = (time.perf_counter() - t0) * 1e3
        if i >= 2:
            times.append(ms)
    return statistics.median(times)


def time_graph(step, impl, iters):
    gen = torch.Generator().manual_seed(1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step.reset()
            step.forward(impl)
    torch.cuda.current_stream().wait_stream(side)
    step.reset()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.forward(impl)
    times = []
    for i in range(iters + 2):
        step.tokens.copy_(torch.randint(0, step.model.config.vocab_size, (1, T), generator=gen))
        step.reset()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        if i >= 2:
            times.append(a.elapsed_time(b))
    del graph
    return statistics.median(times)


def attention_share(step, impl):
    from torch.profiler import ProfilerActivity, profile

    cuda = step.device == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    step.reset()
    sync(step.device)
    with profile(activities=acts) as prof:
        step.forward(impl)
        sync(step.device)
    total = attn = 0.0
    for e in prof.key_averages():
        if cuda:
            t = e.self_device_time_total if hasattr(e, "self_device_time_total") else e.self_cuda_time_total
            if t <= 0:
                continue
            total += t
            attn += t if ATTENTION_KERNELS.search(e.key) else 0.0
        else:
            if CPU_ATTENTION_OPS.search(e.key):
                attn += e.cpu_time_total
    if not cuda:
        total = sum(e.self_cpu_time_total for e in prof.key_averages())
    return attn / total if total else float("nan")


def supported(model, impl):
    try:
        model.set_attn_implementation(impl)
        return None
    except Exception as e:  # noqa: BLE001  (this transformers or model does not take it)
        return f"{type(e).__name__}: {e}"[:200]


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None


def plot(rows, path):
    plt = _pyplot()
    if plt is None:
        return
    modes = sorted({r["mode"] for r in rows})
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for impl in sorted({r["impl"] for r in rows}):
            pts = [(r["P"], r["ms"]) for r in rows if r["mode"] == mode and r["impl"] == impl and r.get("ms")]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prefix P")
        ax.set_ylabel("ms per verify step")
        ax.set_title(f"T={T} tree verify, {mode}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--prefix", type=int, nargs="+")
    ap.add_argument("--impl", nargs="+", help="default: tree_attn sdpa flex_attention (CUDA), tree_attn sdpa (CPU: "
                    "flex_attention's CPU compile crashed the process with torch 2.13)")
    ap.add_argument("--iters", type=int)
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--png")
    a = ap.parse_args(argv)
    cuda = a.device == "cuda"
    prefixes = a.prefix or ([1024, 4096, 16384, 65536] if cuda else [64, 256])
    iters = a.iters or (10 if cuda else 3)
    a.impl = a.impl or (["tree_attn", "sdpa", "flex_attention"] if cuda else ["tree_attn", "sdpa"])

    import transformers

    import torch_tree_attn.hf as hf

    hf.register()
    model, dtype = build_model(a.device)
    skipped = {impl: why for impl in a.impl if (why := supported(model, impl))}
    impls = [i for i in a.impl if i not in skipped]
    for impl, why in skipped.items():
        print(f"skipping {impl}: {why}")
    modes = ["eager"] + (["graph"] if cuda and not a.no_graph else [])
    env = dict(torch=torch.__version__, transformers=transformers.__version__, device=a.device,
               gpu=torch.cuda.get_device_name(0) if cuda else None, dtype=str(dtype), T=T,
               date=datetime.date.today().isoformat())
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    print(f"{env}")
    rows, checks = [], []
    header = f"{'P':>6} {'impl':<15} {'mode':<6} | {'ms/step':>8} | {'attn share':>10} | best peer / ours"
    print(header + "\n" + "-" * len(header))
    for P in prefixes:
        step = Step(model, dtype, P, a.device)
        with torch.no_grad():
            logits = {}
            for impl in ("tree_attn", "sdpa"):
                if impl in impls:
                    model.set_attn_implementation(impl)
                    step.reset()
                    logits[impl] = step.forward(impl).float()
            if len(logits) == 2:
                diff = (logits["tree_attn"] - logits["sdpa"]).abs().max().item()
                scale = logits["sdpa"].abs().max().item()
                tol = 1e-3 * max(1.0, scale) if not cuda else 0.1 * max(1.0, scale)
                checks.append(dict(P=P, max_abs_logit_diff=diff, max_abs_logit=scale, ok=diff <= tol))
                print(f"P={P}: max |tree_attn - sdpa| logits {diff:.3g} (max |logit| {scale:.3g})"
                      + ("" if diff <= tol else "  WARNING: large"))
            for mode in modes:
                got = {}
                for impl in impls:
                    model.set_attn_implementation(impl)
                    row = dict(P=P, impl=impl, mode=mode)
                    try:
                        row["ms"] = time_eager(step, impl, iters) if mode == "eager" else time_graph(step, impl, iters)
                        if mode == "eager":
                            row["attention_share"] = attention_share(step, impl)
                        got[impl] = row["ms"]
                    except Exception as e:  # noqa: BLE001  (reported in the row)
                        row["error"] = f"{type(e).__name__}: {e}"[:300]
                        if cuda:
                            torch.cuda.synchronize()
                    rows.append(row)
                peers = [v for k, v in got.items() if k != "tree_attn"]
                for row in rows[-len(impls):]:
                    if row["impl"] == "tree_attn" and "ms" in row and peers:
                        row["best_peer_over_ours"] = min(peers) / row["ms"]
                    share = row.get("attention_share")
                    ratio = row.get("best_peer_over_ours")
                    print(f"{P:>6} {row['impl']:<15} {mode:<6} | "
                          + (f"{row['ms']:>8.3f}" if "ms" in row else f"{'failed':>8}") + " | "
                          + (f"{share:>9.0%} " if share is not None else f"{'':>10}") + " | "
                          + (f"{ratio:.2f}x" if ratio else row.get("error", "")))
        del step
        if cuda:
            torch.cuda.empty_cache()
    model.set_attn_implementation("tree_attn")
    out = a.json or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                 f"e2e-{a.device}-{env['date']}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(dict(env=env, skipped=skipped, checks=checks, rows=rows), f, indent=1)
    print(f"json: {out}")
    if a.png:
        plot(rows, a.png)


if __name__ == "__main__":
    main()
