"""End to end: one tree-verify forward of a whole transformers model, tree_attn against the
attention implementations transformers ships, on the same weights, cache and tree.

What is measured
----------------
A LlamaForCausalLM built from its config with random weights (nothing is downloaded):

- ``--device cuda``: Llama-3-8B's shape (hidden 4096, 32 layers, 32 heads, 8 kv heads,
  head_dim 128, intermediate 14336, vocab 128256, rope_theta 500000), bfloat16, prefixes
  P = 1024, 4096, 16384, 65536;
- ``--device cpu``: a small Llama (2 layers, hidden 256, 4 heads, 2 kv heads, head_dim 64,
  vocab 1000, initializer_range 0.2 so attention is far from uniform), float32, P = 64,
  256, eager only: a smoke run for CI.

The cache is a transformers StaticCache of exactly P + T slots (T = 64). No P-token prefill
is run: one 1-token forward allocates every layer's buffers, then the first P slots of each
layer's keys/values are filled with random values in place (on the device) and the layers'
length is set to P (``torch_tree_attn.hf.compat.set_layer_length``, which knows each
release's length bookkeeping). One verify step is then a forward of a random T-node tree
(parent of node i drawn uniformly from nodes 0..i-1, so parents come first), with the same
token ids and position ids (P + depth) for every implementation:

- tree_attn: the documented tree call (README "Hugging Face transformers", as
  tests/test_hf.py and examples/eagle3_verify.py run it, by hand rather than through
  ``hf.tree_forward``, which reads the cache length on the host): ``model(input_ids,
  position_ids, cache, tree_mask=ancestor_mask(parents)[None], mask_offset=[P])``;
- sdpa: the equivalent dense 4-D mask over the cache's P + T keys, bool [1, 1, T, P + T]
  (prefix visible, tree keys by ancestry), the form transformers' own sdpa_mask builds and
  test_hf.py's reference masks hold (as booleans: SDPA takes no float32 mask under bf16);
- flex_attention (where this transformers has it): the same mask as a BlockMask with 64x64
  blocks (prefix blocks full, tree blocks partial), as benchmarks/bench_op.py's flex peer
  and transformers' own flex mask builder do, and kernel_options BLOCK_M = BLOCK_N = 64
  (Inductor's default 128-key blocks do not divide P + 64). A dense tensor mask would reach
  flex as an additive score_mod term, which a bool mask is not.

Before anything is timed, each P is checked once: every implementation's logits against
sdpa's for the same inputs (max |difference| and top-1 agreement go to the JSON; float32 on
CPU must agree to 1e-4 relative to the largest logit, bf16 on CUDA gets a warning past 10 %
of it). A wrong answer is never benchmarked silently.

Modes, per (P, implementation):

- eager: a plain forward; median over --iters after warm-up, CUDA events around the forward
  on the GPU, time.perf_counter on the CPU. The cache length is reset to P before each step,
  outside the timing.
- graph (CUDA only): the forward captured once in a torch.cuda.CUDAGraph (after warm-up on a
  side stream, as PyTorch's CUDA-graph docs prescribe), replayed with new tree token ids
  copied into the static input buffer and the cache length reset to P before each replay
  (both outside the timing; the positions, masks and cache addresses are static). The masks
  are built once outside the graph ("prepared"): for tree_attn that is the causal spec its
  registered mask function returns (``create_causal_mask``), passed as the 4-D
  ``attention_mask`` that transformers hands on unchanged, because the mask function makes a
  small CUDA tensor from a Python int (``torch.tensor(..., device=...)`` in
  ``hf.tree_attention_mask``: a synchronous host-to-device copy, which stream capture
  refuses, pytorch/pytorch#168991). Same kernels, same logits; only the mask function's few
  tiny launches leave the graph. ``--graph-masks in-graph`` captures the plain documented
  call instead (to see whether this torch / torch_tree_attn.hf capture it). The replayed logits are compared with the eager ones. A capture
  that fails is reported in its row, not raised.

Attention share: one profiled eager step per (P, implementation). On CUDA: the device time
of the kernels that count as attention over the device time of all kernels. A kernel counts
when its name matches ATTENTION_KERNELS (ours: _tree_attn_main / _tree_attn_reduce, also
when launched straight from C++ with no op around it; SDPA's flash / cutlass fmha / cuDNN
kernels; flex's Inductor template ``triton_tem_*``) or when the op that launched it lies
inside an op matching ATTENTION_OPS (``tree_attn::forward*``, ``aten::*scaled_dot_product*``,
``flex_attention``, and torch.compile's regions and guard lookups: in these eager forwards the
only compiled code is the flex_attention call transformers compiles), so the mask conversion
inside SDPA counts too; transformers' repeat_kv copies before SDPA and the RoPE / cache
writes do not. On CPU: the CPU time of the outermost ops matching ATTENTION_OPS over the CPU
time of the whole step.

Output: a table (P, impl, mode, ms/step, attention share, best peer / ours: the fastest
non-tree_attn implementation of the same P and mode over tree_attn, > 1 means tree_attn is
faster), a JSON (--json, default benchmarks/results/e2e-<device>-<date>.json) with the
environment and every row and check, and with --png a bar chart (matplotlib optional). Speed
is printed, never asserted.

    python benchmarks/bench_e2e.py --device cuda --json out.json --png out.png
    python benchmarks/bench_e2e.py --device cuda --prefix 4096 --impl tree_attn sdpa
    python benchmarks/bench_e2e.py --device cpu          # small model, a few seconds
"""
import argparse
import datetime
import json
import math
import os
import re
import sys

import torch

try:
    import torch_tree_attn  # noqa: F401  (registers torch.ops.tree_attn)
except ImportError:  # run from a source checkout built in place
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch_tree_attn  # noqa: F401
from torch_tree_attn.hf import compat
from torch_tree_attn.tree import ancestor_mask

from timing import graphed, median_ms, pyplot, synchronize  # benchmarks/timing.py, beside this script

T = 64
FLEX_BLOCK = 64
IMPLS = ("tree_attn", "sdpa", "flex_attention")
ATTENTION_KERNELS = re.compile(r"tree_attn|flash_fwd|flash::|fmha|efficient_attention|cudnn.*(sdpa|attn)"
                               r"|triton_tem_fused|flex_attention", re.IGNORECASE)
ATTENTION_OPS = re.compile(r"^tree_attn::forward|scaled_dot_product|flex_attention|^Torch-Compiled Region"
                           r"|^TorchDynamo Cache Lookup", re.IGNORECASE)

LLAMA3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 intermediate_size=14336, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072)
SMALL = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             intermediate_size=512, vocab_size=1000, max_position_embeddings=4096, initializer_range=0.2)
DEFAULTS = {  # device: (config, dtype, prefixes, warm-up steps, timed steps, implementations)
    "cuda": (LLAMA3_8B, torch.bfloat16, [1024, 4096, 16384, 65536], 3, 20, list(IMPLS)),
    # flex_attention is left out of the CPU default: Inductor compiles it on first use, which
    # is slow on 2 cores and once crashed a run with torch 2.13 (CI smokes this default).
    # --impl tree_attn sdpa flex_attention runs it (it did here with torch 2.13, 2026-12-06).
    "cpu": (SMALL, torch.float32, [64, 256], 3, 10, ["tree_attn", "sdpa"]),
}


# --------------------------------------------------------------------------------------
# Model, cache and inputs
# --------------------------------------------------------------------------------------


def build_model(device, config_kwargs, dtype):
    """A LlamaForCausalLM with random weights, made directly on ``device`` in ``dtype``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**config_kwargs)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def random_parents(gen):
    """A random T-node tree, parents first: node i's parent is uniform over 0..i-1."""
    return torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, T)])


class VerifyStep:
    """One model, a StaticCache of P + T slots holding P random prefix positions, and the static
    inputs of one tree-verify forward (the same buffers every step, as a CUDA graph needs)."""

    def __init__(self, model, P, device, seed=0):
        from transformers import StaticCache

        self.model, self.P, self.device = model, P, torch.device(device)
        gen = torch.Generator().manual_seed(seed)
        parents = random_parents(gen)
        tree = ancestor_mask(parents)                          # bool [T, T], ancestor-or-self
        depth = tree.sum(-1) - 1
        self.cache = StaticCache(config=model.config, max_cache_len=P + T)
        self._fill_prefix(seed)
        vocab = model.config.vocab_size
        self.tokens = torch.randint(0, vocab, (1, T), generator=gen).to(self.device)
        self.positions = (P + depth)[None].to(self.device)
        self.tree_mask = tree[None].to(self.device)            # [1, T, T]
        self.mask_offset = torch.tensor([P], device=self.device)
        dense = torch.ones(1, 1, T, P + T, dtype=torch.bool)
        dense[..., P:] = tree
        self.dense = dense.to(self.device)                     # [1, 1, T, P + T]
        self._block_mask = None
        self._prepared_spec = None

    def _fill_prefix(self, seed):
        """Allocate the layers' buffers with a 1-token forward, then write random K/V into the
        first P slots of every layer in place (a stand-in for a P-token prefill)."""
        with torch.no_grad():
            self.model.set_attn_implementation("sdpa")
            self.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device), use_cache=True,
                       **compat.cache_kwargs(self.model, self.cache))
        gen = torch.Generator(device=self.device).manual_seed(seed + 1)
        for layer in self.cache.layers:
            for buffer in (layer.keys, layer.values):
                buffer.zero_()
                buffer[:, :, :self.P].normal_(generator=gen)
        self.reset()

    def reset(self):
        """Cache length back to P: the next forward writes the tree at slots [P, P + T)."""
        for layer in self.cache.layers:
            compat.set_layer_length(layer, self.P)

    def block_mask(self):
        if self._block_mask is None:
            from torch.nn.attention.flex_attention import create_block_mask

            P, tree = self.P, self.tree_mask[0]

            def mask_mod(b, h, q_idx, kv_idx):
                rel = kv_idx - P
                return (rel < 0) | tree[q_idx, rel.clamp(0, T - 1)]

            self._block_mask = create_block_mask(mask_mod, 1, None, T, P + T, device=self.device,
                                                 BLOCK_SIZE=FLEX_BLOCK)
        return self._block_mask

    def prepared_spec(self):
        """The causal spec tree_attn's mask function returns for this forward, built outside any
        graph (it makes a small device tensor from a Python int, which capture refuses)."""
        if self._prepared_spec is None:
            from transformers.masking_utils import create_causal_mask

            self.model.set_attn_implementation("tree_attn")
            self.reset()
            embeds = torch.empty(1, T, self.model.config.hidden_size, dtype=self.model.dtype, device=self.device)
            # Positional: the cache argument is past_key_values before transformers 5.24, cache after.
            self._prepared_spec = create_causal_mask(self.model.config, embeds, None, self.cache, self.positions)
        return self._prepared_spec

    def forward_kwargs(self, impl, prepared=False):
        """Keyword arguments of the model call for ``impl`` (not the token ids)."""
        kwargs = dict(position_ids=self.positions, use_cache=True, **compat.cache_kwargs(self.model, self.cache))
        if impl == "tree_attn":
            kwargs.update(tree_mask=self.tree_mask, mask_offset=self.mask_offset)
            if prepared:
                kwargs["attention_mask"] = self.prepared_spec()
        elif impl == "flex_attention":
            kwargs.update(attention_mask=self.block_mask(), kernel_options=dict(BLOCK_M=FLEX_BLOCK, BLOCK_N=FLEX_BLOCK))
        else:
            kwargs["attention_mask"] = self.dense
        return kwargs

    def forward(self, impl, prepared=False):
        """One verify step from a cache of length P; returns the logits [1, T, vocab]."""
        self.model.set_attn_implementation(impl)
        kwargs = self.forward_kwargs(impl, prepared)
        self.reset()
        return self.model(input_ids=self.tokens, **kwargs).logits


def supported(model, impl):
    """None if this transformers / model takes ``impl``, else why not."""
    try:
        model.set_attn_implementation(impl)
    except Exception as e:  # noqa: BLE001  (missing in this release: reported and skipped)
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return None


# --------------------------------------------------------------------------------------
# Correctness, timing, profile
# --------------------------------------------------------------------------------------


def compare_logits(P, impl, logits, reference, cuda):
    """A check row: max |logits - sdpa's|, the largest |logit|, top-1 agreement, and whether
    the difference is within tolerance (1e-4 of the largest logit in float32, 10 % in bf16)."""
    diff = (logits - reference).abs().max().item()
    scale = max(1.0, reference.abs().max().item())
    top1 = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    tolerance = (0.1 if cuda else 1e-4) * scale
    return dict(P=P, impl=impl, against="sdpa", max_abs_logit_diff=diff, max_abs_logit=scale, top1_agreement=top1,
                tolerance=tolerance, ok=bool(math.isfinite(diff) and diff <= tolerance))


def check_step(step, impls, cuda):
    """Every implementation's logits against sdpa's, once, for the same tokens and cache."""
    logits = {}
    for impl in impls:
        try:
            logits[impl] = step.forward(impl).float()
        except Exception as e:  # noqa: BLE001  (reported; its timing rows will say so too)
            print(f"  P={step.P} {impl}: forward failed: {type(e).__name__}: {str(e)[:300]}")
    if "sdpa" not in logits:
        return [], logits
    checks = [compare_logits(step.P, impl, out, logits["sdpa"], cuda) for impl, out in logits.items() if impl != "sdpa"]
    for c in checks:
        warn = "" if c["ok"] else ("  WARNING: large difference" if cuda else "  FAILED")
        print(f"  P={step.P} check {c['impl']} vs sdpa: max |logit diff| {c['max_abs_logit_diff']:.3g} (max |logit| "
              f"{c['max_abs_logit']:.3g}, top-1 agreement {c['top1_agreement']:.0%}){warn}")
    return checks, logits


def time_eager(step, impl, warmup, iters):
    """Median ms of one eager verify step (CUDA events on the GPU, perf_counter on the CPU),
    the cache length reset to P before each, outside the timing."""
    step.model.set_attn_implementation(impl)
    kwargs = step.forward_kwargs(impl)
    return median_ms(lambda: step.model(input_ids=step.tokens, **kwargs), step.device, iters, warmup=warmup,
                     before=lambda i: step.reset())


def capture(step, impl, prepared, warmup):
    """The verify forward captured in a CUDA graph after warm-up on a side stream; returns
    (graph, its static logits)."""
    step.model.set_attn_implementation(impl)
    kwargs = step.forward_kwargs(impl, prepared)

    def run():
        return step.model(input_ids=step.tokens, **kwargs).logits

    # The cache length back to P before each warm-up forward and before the capture.
    return graphed(run, warmup, prepare=step.reset)


def time_graph(step, impl, prepared, warmup, iters, eager_logits):
    """Median ms of one graph replay, new tree tokens each time; and the replayed logits'
    max |difference| from the eager ones for the check's tokens."""
    graph, logits = capture(step, impl, prepared, warmup)
    check_tokens = step.tokens.clone()
    step.reset()
    graph.replay()
    torch.cuda.synchronize()
    diff = None if eager_logits is None else (logits.float() - eager_logits).abs().max().item()
    gen = torch.Generator(device=step.device).manual_seed(7)
    new_tokens = torch.randint(0, step.model.config.vocab_size, (warmup + iters, 1, T), generator=gen,
                               device=step.device)

    def next_step(i):
        step.tokens.copy_(new_tokens[i])
        step.reset()

    ms = median_ms(graph.replay, step.device, iters, warmup=warmup, before=next_step)
    step.tokens.copy_(check_tokens)
    del graph, logits
    return ms, diff


def _under_attention_op(event):
    while event is not None:
        if ATTENTION_OPS.search(event.name):
            return True
        event = event.cpu_parent
    return False


def attention_share(step, impl):
    """(share, attention ms, total ms) of one profiled eager step; see the module docstring
    for what counts as attention."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = step.device.type == "cuda"
    step.model.set_attn_implementation(impl)
    kwargs = step.forward_kwargs(impl)
    step.reset()
    synchronize(step.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        with record_function("verify_step"):
            step.model(input_ids=step.tokens, **kwargs)
        synchronize(step.device)
    events = prof.events()
    total = attention = 0.0
    if cuda:
        ops = {e.id: e for e in events
               if e.device_type == DeviceType.CPU and getattr(e, "linked_correlation_id", 0) == 0}
        for e in events:
            if e.device_type != DeviceType.CUDA:
                continue
            us = e.time_range.elapsed_us()
            total += us
            launcher = ops.get(getattr(e, "linked_correlation_id", 0))
            if ATTENTION_KERNELS.search(e.name) or _under_attention_op(launcher):
                attention += us
    else:
        for e in events:
            if e.device_type != DeviceType.CPU:
                continue
            if e.name == "verify_step":
                total += e.cpu_time_total
            elif ATTENTION_OPS.search(e.name) and not _under_attention_op(e.cpu_parent):
                attention += e.cpu_time_total
    share = attention / total if total > 0 else float("nan")
    return share, attention / 1e3, total / 1e3


# --------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------


def environment(device, dtype, threads):
    import transformers

    env = dict(torch=torch.__version__, transformers=transformers.__version__, python=sys.version.split()[0],
               device=device, dtype=str(dtype).replace("torch.", ""), T=T, date=datetime.date.today().isoformat())
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, sms=props.multi_processor_count, cuda=torch.version.cuda)
    else:
        env.update(gpu=None, threads=threads)
    return env


def add_ratios(rows):
    """best_peer_over_ours on each tree_attn row: the fastest other implementation measured in
    the same (P, mode) over tree_attn's time."""
    for row in rows:
        if row["impl"] != "tree_attn" or "ms" not in row:
            continue
        peers = [r["ms"] for r in rows if r["P"] == row["P"] and r["mode"] == row["mode"] and r["impl"] != "tree_attn"
                 and "ms" in r]
        if peers:
            row["best_peer_over_ours"] = min(peers) / row["ms"]


HEADER = f"{'P':>6} {'impl':<15} {'mode':<6} | {'ms/step':>9} | {'attn share':>10} | best peer / ours"


def format_row(row):
    ms = f"{row['ms']:>9.3f}" if "ms" in row else f"{'failed':>9}"
    share = row.get("attention_share")
    share = f"{share:>10.1%}" if share is not None and math.isfinite(share) else f"{'':>10}"
    tail = f"{row['best_peer_over_ours']:.2f}x" if "best_peer_over_ours" in row else ""
    if "error" in row:
        tail = row["error"]
    elif row.get("note"):
        tail = (tail + "  " if tail else "") + f"({row['note']})"
    return f"{row['P']:>6} {row['impl']:<15} {row['mode']:<6} | {ms} | {share} | {tail}"


def plot(rows, env, path):
    """Bars of ms per verify step, one group per P, one panel per mode (log scale)."""
    plt = pyplot("--png")
    if plt is None:
        return
    modes = [m for m in ("eager", "graph") if any(r["mode"] == m for r in rows)]
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    prefixes = sorted({r["P"] for r in rows})
    fig, axes = plt.subplots(1, len(modes), figsize=((1.4 * len(prefixes) + 2) * len(modes), 4.5), squeeze=False)
    width = 0.8 / max(1, len(impls))
    for ax, mode in zip(axes[0], modes):
        for j, impl in enumerate(impls):
            ms = {r["P"]: r.get("ms", float("nan")) for r in rows if r["mode"] == mode and r["impl"] == impl}
            xs = [i + (j - (len(impls) - 1) / 2) * width for i in range(len(prefixes))]
            ax.bar(xs, [ms.get(P, float("nan")) for P in prefixes], width, label=impl)
        ax.set_xticks(range(len(prefixes)))
        ax.set_xticklabels([f"P={P}" for P in prefixes])
        ax.set_yscale("log")
        ax.set_ylabel(f"ms per verify step ({mode})")
        ax.set_title(f"T={T} tree verify, {env.get('gpu') or env['device']}, {env['dtype']}, {mode}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def run_prefix(step, impls, modes, args, cuda):
    """Check, then time every (implementation, mode) at one P; returns (checks, rows)."""
    with torch.no_grad():
        checked = [i for i in impls if not (i == "flex_attention" and args.flex_max_prefix is not None
                                            and step.P > args.flex_max_prefix)]
        checks, eager_logits = check_step(step, checked, cuda)
        rows = []
        for mode in modes:
            for impl in impls:
                row = dict(P=step.P, impl=impl, mode=mode)
                warmup, iters = args.warmup, args.iters
                if impl == "flex_attention":
                    if args.flex_max_prefix is not None and step.P > args.flex_max_prefix:
                        row["error"] = f"skipped: P > --flex-max-prefix {args.flex_max_prefix} (seconds per step)"
                        rows.append(row)
                        continue
                    warmup, iters = min(warmup, 1), min(iters, args.flex_iters)
                try:
                    if mode == "eager":
                        row["ms"] = time_eager(step, impl, warmup, iters)
                        row["attention_share"], row["attention_ms"], row["profiled_ms"] = attention_share(step, impl)
                    else:
                        prepared = args.graph_masks == "prepared"
                        row["ms"], row["graph_vs_eager_max_abs_diff"] = time_graph(
                            step, impl, prepared, warmup, iters, eager_logits.get(impl))
                        if prepared and impl == "tree_attn":
                            row["note"] = "causal spec prepared outside the graph"
                except Exception as e:  # noqa: BLE001  (a failed forward or capture is reported in its row)
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    if cuda:
                        try:  # let the failed step drain; a broken context shows in the next rows' errors
                            torch.cuda.synchronize()
                        except Exception:  # noqa: BLE001
                            pass
                rows.append(row)
    add_ratios(rows)
    return checks, rows


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--prefix", type=int, nargs="+", help="prefix lengths P (cuda: 1024 4096 16384 65536; "
                        "cpu: 64 256)")
    parser.add_argument("--impl", nargs="+", choices=IMPLS,
                        help="attention implementations (cuda: all three; cpu: tree_attn sdpa)")
    parser.add_argument("--iters", type=int, help="timed steps per measurement, median (cuda 20, cpu 10)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (3)")
    parser.add_argument("--flex-iters", type=int, default=3,
                        help="timed steps for flex_attention, which is far slower here (3, after 1 warm-up)")
    parser.add_argument("--flex-max-prefix", type=int, default=16384,
                        help="flex_attention rows only up to this P (16384: at 65536 one step takes many seconds)")
    parser.add_argument("--no-graph", action="store_true", help="(cuda) eager mode only")
    parser.add_argument("--graph-masks", choices=["prepared", "in-graph"], default="prepared",
                        help="(cuda) tree_attn's mask in graph mode: its causal spec built outside the graph "
                        "(default) or the plain documented call captured as it is")
    parser.add_argument("--quick", action="store_true", help="smoke run: the smallest default P, 3 timed steps")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (CPU)")
    parser.add_argument("--json", help="results file (default benchmarks/results/e2e-<device>-<date>.json)")
    parser.add_argument("--png", help="bar chart of ms per step (needs matplotlib)")
    args = parser.parse_args(argv)
    config, dtype, prefixes, warmup, iters, impls = DEFAULTS[args.device]
    args.config, args.dtype = config, dtype
    args.prefix = args.prefix or (prefixes[:1] if args.quick else prefixes)
    args.iters = args.iters or (3 if args.quick else iters)
    args.warmup = warmup if args.warmup is None else args.warmup
    args.impl = list(dict.fromkeys(args.impl or impls))
    return args


def main(argv=None):
    args = parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("--device cuda: CUDA is not available in this torch build / on this machine")
    try:
        import transformers  # noqa: F401
    except ImportError:
        sys.exit("bench_e2e needs transformers (pip install -e '.[hf]')")
    import torch_tree_attn.hf as hf

    if args.threads:
        torch.set_num_threads(args.threads)
    hf.register()
    env = environment(args.device, args.dtype, torch.get_num_threads())
    model = build_model(args.device, args.config, args.dtype)
    skipped = {impl: why for impl in args.impl if (why := supported(model, impl))}
    for impl, why in skipped.items():
        print(f"skipping {impl}: {why}")
    impls = [i for i in args.impl if i not in skipped]
    if "sdpa" not in impls:
        print("note: without sdpa there is no reference to check the logits against")
    modes = ["eager"] + (["graph"] if cuda and not args.no_graph else [])
    cfg = args.config
    print(f"{env}\nmodel: Llama, {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, heads "
          f"{cfg['num_attention_heads']}/{cfg['num_key_value_heads']}, head_dim {cfg['head_dim']}, random weights; "
          f"T={T} random tree after P cached tokens; ms = median of {args.iters} steps")
    checks, rows = [], []
    for P in args.prefix:
        step = VerifyStep(model, P, args.device)
        print(f"P={P}:")
        p_checks, p_rows = run_prefix(step, impls, modes, args, cuda)
        checks += p_checks
        rows += p_rows
        print(HEADER + "\n" + "-" * len(HEADER))
        for row in p_rows:
            print(format_row(row), flush=True)
        del step
        if cuda:
            torch.cuda.empty_cache()
    model.set_attn_implementation("tree_attn")

    path = args.json or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                     f"e2e-{args.device}-{env['date']}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(env=env, model=cfg, modes=modes, impls=impls, skipped=skipped, graph_masks=args.graph_masks,
                       checks=checks, rows=rows), f, indent=1)
    print(f"wrote {path}")
    if args.png:
        plot(rows, env, args.png)
    failed = [c for c in checks if not c["ok"]]
    if failed:
        print("WARNING: logits differ from sdpa's beyond tolerance: "
              + ", ".join(f"P={c['P']} {c['impl']} ({c['max_abs_logit_diff']:.3g})" for c in failed))


if __name__ == "__main__":
    main()
