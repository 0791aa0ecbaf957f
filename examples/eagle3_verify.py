"""EAGLE-3 speculative decoding with tree attention, end to end.

Each round: the EAGLE-3 draft grows a dynamic tree of candidate continuations; the target
verifies the whole tree in ONE forward (attn_implementation="tree_attn": the tree's tokens,
positions prefix + depth, and a compact [T, T] ancestor mask with the prefix length); the
longest path the target agrees with is accepted plus one bonus token; the accepted K/V are
compacted into place in the target's cache and the draft gets the target's hidden states of
the accepted tokens.

    python examples/eagle3_verify.py                   # built-in target + draft, CPU, no network
    python examples/eagle3_verify.py --check           # also assert output == plain greedy decoding
    python examples/eagle3_verify.py --target meta-llama/Llama-3.1-8B-Instruct \\
        --draft yuhuili/EAGLE3-LLaMA3.1-Instruct-8B --device cuda --dtype bfloat16

The tree's shape defaults to EAGLE's (60 tokens, depth 7, top-k 10), except for the built-in
models on CPU, where a smaller tree (24 tokens, depth 8, top-k 4) is faster: see parse_args.

The summary reports tokens/s, the mean acceptance length (tokens produced per target
forward: accepted draft tokens + 1), the time split, and plain greedy decoding's tokens/s
measured in the same run on the same model.
"""
import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from typing import List, Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch_tree_attn  # noqa: E402,F401
from torch_tree_attn import builtin, hf  # noqa: E402
from torch_tree_attn.eagle3 import (  # noqa: E402
    Eagle3Drafter,
    capture_target_features,
    feature_layer_ids,
    load_eagle3_draft,
)
from torch_tree_attn.tree import build_dynamic_tree, compact_kv_cache, verify_greedy, verify_sampling  # noqa: E402

DEFAULT_PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    "
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Stats:
    tokens: List[int] = field(default_factory=list)
    rounds: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    bookkeeping_s: float = 0.0
    produced: int = 0  # tokens the rounds produced (accepted + bonus), before the budget cut
    prefill_s: float = 0.0
    total_s: float = 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _cache_kwarg(model) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _stop_tokens(model, tokenizer) -> set:
    ids = getattr(model.generation_config, "eos_token_id", None) or getattr(tokenizer, "eos_token_id", None)
    if ids is None:
        return set()
    return set(ids) if isinstance(ids, (list, tuple)) else {int(ids)}


@torch.no_grad()
def plain_greedy(model, input_ids: torch.Tensor, max_new_tokens: int, stop: set) -> Stats:
    """Token-by-token greedy decoding with a KV cache: the baseline and the --check reference."""
    device = input_ids.device
    stats = Stats()
    cache_arg = _cache_kwarg(model)
    _sync(device)
    start = time.perf_counter()
    cache = _new_cache(model)
    out = model(input_ids=input_ids, use_cache=True, **{cache_arg: cache})
    token = out.logits[0, -1].argmax()
    stats.tokens.append(int(token))
    while len(stats.tokens) < max_new_tokens and stats.tokens[-1] not in stop:
        out = model(input_ids=token.view(1, 1), use_cache=True, **{cache_arg: cache})
        token = out.logits[0, -1].argmax()
        stats.tokens.append(int(token))
    _sync(device)
    stats.total_s = time.perf_counter() - start
    return stats


@torch.no_grad()
def speculative(model, drafter: Eagle3Drafter, input_ids: torch.Tensor, args, stop: set,
                progress: bool = True) -> Stats:
    """EAGLE-3 decoding: draft a tree, verify it in one target forward, accept, compact."""
    device = input_ids.device
    layer_ids = feature_layer_ids(model.config.get_text_config().num_hidden_layers, drafter.draft.config)
    cache_arg = _cache_kwarg(model)
    generator = torch.Generator(device=device).manual_seed(args.seed) if args.temperature > 0 else None
    stats = Stats()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=args.max_new_tokens, unit="tok", desc="eagle-3", leave=False, file=sys.stderr)

    _sync(device)
    start = time.perf_counter()
    drafter.reset()
    cache = _new_cache(model)
    out = model(input_ids=input_ids, use_cache=True, output_hidden_states=True, **{cache_arg: cache})
    first = _pick(out.logits[0, -1], args, generator)
    # The draft pairs the target's feature at position t with the token at t + 1.
    features = capture_target_features(out.hidden_states, layer_ids)[0]
    drafter.commit(torch.cat([input_ids[0, 1:], first.view(1)]), features)
    prefix_len = input_ids.shape[1]
    root = first
    stats.tokens.append(int(first))
    _sync(device)
    stats.prefill_s = time.perf_counter() - start
    if bar is not None:
        bar.update(1)

    while len(stats.tokens) < args.max_new_tokens and stats.tokens[-1] not in stop:
        t0 = time.perf_counter()
        tree = build_dynamic_tree(root, drafter.expand, total_tokens=args.total_tokens, depth=args.depth,
                                  top_k=args.top_k)
        drafter.end_tree()
        _sync(device)
        t1 = time.perf_counter()
        out = model(
            input_ids=tree.tokens[None],
            position_ids=tree.position_ids(prefix_len),
            tree_mask=tree.mask[None],
            tree_prefix_lens=torch.tensor([prefix_len], device=device),
            use_cache=True,
            output_hidden_states=True,
            **{cache_arg: cache},
        )
        _sync(device)
        t2 = time.perf_counter()
        if args.temperature > 0:
            accepted, next_token = verify_sampling(tree, out.logits[0], temperature=args.temperature,
                                                   top_p=args.top_p, generator=generator)
        else:
            accepted, next_token = verify_greedy(tree, out.logits[0])
        features = capture_target_features(out.hidden_states, layer_ids)[0, accepted]
        prefix_len = compact_kv_cache(cache, prefix_len, accepted)
        next_token = torch.tensor([next_token], device=device)
        new_tokens = torch.cat([tree.tokens[accepted[1:]], next_token])
        drafter.commit(new_tokens, features)
        root = next_token
        produced = new_tokens.tolist()
        for tok in produced:  # stop at the budget or an end-of-sequence token
            if len(stats.tokens) >= args.max_new_tokens or stats.tokens[-1] in stop:
                break
            stats.tokens.append(tok)
        stats.rounds += 1
        _sync(device)
        t3 = time.perf_counter()
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        stats.bookkeeping_s += t3 - t2
        stats.produced += len(produced)
        if bar is not None:
            bar.update(min(len(produced), bar.total - bar.n))
            bar.set_postfix(accept=f"{stats.produced / stats.rounds:.2f}")
    if bar is not None:
        bar.close()
    stats.total_s = time.perf_counter() - start
    return stats


def _pick(logits: torch.Tensor, args, generator) -> torch.Tensor:
    if args.temperature > 0:
        from torch_tree_attn.tree import sampling_probs

        probs = sampling_probs(logits, args.temperature, args.top_p)
        return torch.multinomial(probs, 1, generator=generator)[0]
    return logits.argmax()


def load_models(args, device, dtype):
    hf.register()
    if args.target == builtin.BUILTIN:
        target = builtin.load_builtin_target(dtype=dtype, device=device, attn_implementation="tree_attn")
        tokenizer = builtin.ByteTokenizer()
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype, attn_implementation="tree_attn")
        target = target.to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(args.target)
    if args.draft == builtin.BUILTIN:
        if args.target != builtin.BUILTIN:
            raise SystemExit("--draft builtin only fits --target builtin; pass --draft with an EAGLE-3 checkpoint")
        draft = builtin.load_builtin_draft(target, dtype=dtype, device=device)
    else:
        draft = load_eagle3_draft(args.draft, target).to(device=device, dtype=dtype).eval()
    return target, draft, tokenizer


def encode_prompt(tokenizer, prompt: str, device) -> torch.Tensor:
    if isinstance(tokenizer, builtin.ByteTokenizer):
        ids = tokenizer.encode(prompt)
    elif getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    else:
        ids = tokenizer(prompt)["input_ids"]
    return torch.tensor([list(ids)], dtype=torch.long, device=device)


def parse_args(argv: Optional[List[str]] = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=builtin.BUILTIN, help="local path or hub id of the target LM (default: built-in)")
    p.add_argument("--draft", default=builtin.BUILTIN, help="local path or hub id of an EAGLE-3 draft (default: built-in)")
    p.add_argument("--device", default="cpu", choices=["cpu", "mps", "cuda"])
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--max-new-tokens", type=int, default=400)
    p.add_argument("--total-tokens", type=int, default=None,
                   help="draft tree size including the root (default: 24 for the built-in models on CPU, else 60)")
    p.add_argument("--depth", type=int, default=None, help="draft steps after the root's (default: 8 built-in on CPU, else 7)")
    p.add_argument("--top-k", type=int, default=None, help="children per node and frontier width (default: 4 built-in on CPU, else 10)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy verification")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--check", action="store_true", help="assert the output equals plain greedy decoding")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: 1 for the built-in models on CPU, else torch's default)")
    args = p.parse_args(argv)
    # EAGLE's tree (60 tokens, depth 7, top-k 10) suits a target whose forward costs about the
    # same for 1 token as for 60. The built-in target on one CPU core is compute-bound: a
    # 60-token forward costs about 3 greedy steps and each draft step grows with the frontier,
    # so a smaller, narrower, deeper tree is faster there.
    small_tree = args.target == builtin.BUILTIN and args.device == "cpu"
    for name, builtin_cpu, eagle in (("total_tokens", 24, 60), ("depth", 8, 7), ("top_k", 4, 10)):
        if getattr(args, name) is None:
            setattr(args, name, builtin_cpu if small_tree else eagle)
    if args.check and args.temperature > 0:
        p.error("--check compares with greedy decoding; use it with --temperature 0")
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    threads = args.threads
    if threads is None and args.device == "cpu" and args.target == builtin.BUILTIN:
        # The built-in model's matrices are too small to gain from intra-op threads, and on a
        # busy machine OpenMP threads waiting for each other at every op slow it down many-fold.
        threads = 1
    if threads:
        torch.set_num_threads(threads)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    target, draft, tokenizer = load_models(args, device, dtype)
    input_ids = encode_prompt(tokenizer, args.prompt, device)
    stop = _stop_tokens(target, tokenizer)
    drafter = Eagle3Drafter(draft, capacity=input_ids.shape[1] + args.max_new_tokens + 64)

    # Warm both paths up once (allocator, kernels, lazy imports) so timings compare steady state.
    warm = parse_args(argv)
    warm.max_new_tokens = min(8, args.max_new_tokens)
    speculative(target, drafter, input_ids, warm, stop, progress=False)
    plain_greedy(target, input_ids, warm.max_new_tokens, stop)

    spec = speculative(target, drafter, input_ids, args, stop, progress=not args.no_progress)
    base = plain_greedy(target, input_ids, args.max_new_tokens, stop)

    n = len(spec.tokens)
    mean_accept = spec.produced / spec.rounds if spec.rounds else float("nan")
    loop_s = spec.draft_s + spec.verify_s + spec.bookkeeping_s
    print(f"prompt: {args.prompt!r}")
    print(f"output: {tokenizer.decode(spec.tokens)!r}")
    print(f"eagle-3 tree decoding: {n} tokens in {spec.total_s:.2f} s = {n / spec.total_s:.1f} tokens/s; "
          f"mean acceptance length {mean_accept:.2f} over {spec.rounds} target forwards "
          f"(tree: {args.total_tokens} tokens, depth {args.depth}, top-k {args.top_k})")
    print(f"time split: draft {spec.draft_s:.2f} s ({100 * spec.draft_s / loop_s:.0f}%), verify (target tree "
          f"forward) {spec.verify_s:.2f} s ({100 * spec.verify_s / loop_s:.0f}%), bookkeeping (accept, compact "
          f"KV cache) {spec.bookkeeping_s:.2f} s ({100 * spec.bookkeeping_s / loop_s:.0f}%); "
          f"prefill {spec.prefill_s:.2f} s")
    nb = len(base.tokens)
    print(f"plain greedy decoding: {nb} tokens in {base.total_s:.2f} s = {nb / base.total_s:.1f} tokens/s; "
          f"speedup {(n / spec.total_s) / (nb / base.total_s):.2f}x")
    if args.temperature == 0:
        same = spec.tokens == base.tokens
        if args.check:
            if not same:
                first_diff = next(i for i, (a, b) in enumerate(zip(spec.tokens + [None], base.tokens + [None])) if a != b)
                raise SystemExit(f"check FAILED: outputs differ from token {first_diff} on "
                                 f"(eagle-3 {spec.tokens[first_diff:first_diff + 8]}, greedy "
                                 f"{base.tokens[first_diff:first_diff + 8]})")
            print(f"check: OK, the output equals plain greedy decoding ({n} tokens)")
        else:
            print(f"same tokens as plain greedy decoding: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
