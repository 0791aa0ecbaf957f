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

The summary reports tokens/s and target forwards of both decoders (plain greedy decoding is
measured in the same run on the same model), the time split, and the mean acceptance length:
the tokens the verify rounds emitted divided by the number of verify rounds. Each verify round
is one target forward over the tree and emits the accepted draft tokens plus the target's bonus
token; the first token (from the prefill forward) is not counted, nor are tokens a round
produced past --max-new-tokens or past an end-of-sequence token, since they are not emitted.

Exit status: 0 on success; 2 for a bad flag (argparse's usage error); 1 when the environment
or a model is the problem (device unavailable, checkpoint missing or unloadable) or --check
fails. Every failure is reported as one line, never a traceback.
"""
import argparse
import copy
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, List, NoReturn, Optional

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
from torch_tree_attn.hf import compact_kv_cache  # noqa: E402
from torch_tree_attn.tree import build_dynamic_tree, verify_greedy, verify_sampling  # noqa: E402

PROG = "eagle3_verify.py"
DEFAULT_PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    "
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Sampling divides the logits by the temperature in float32: far below this it overflows to
# inf (NaN probabilities), and already here it is greedy for any practical logit gap.
MIN_TEMPERATURE = 1e-4
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts


@dataclass
class Stats:
    tokens: List[int] = field(default_factory=list)  # emitted: <= --max-new-tokens, up to end-of-sequence
    forwards: int = 0  # target forwards: the prefill, then one per greedy step or verify round
    rounds: int = 0  # verify rounds (EAGLE-3 only)
    produced: int = 0  # tokens the verify rounds emitted (accepted + bonus), so len(tokens) - 1
    cut: int = 0  # tokens the verify rounds produced past the budget or end-of-sequence, not emitted
    draft_s: float = 0.0
    verify_s: float = 0.0
    bookkeeping_s: float = 0.0
    prefill_s: float = 0.0
    total_s: float = 0.0

    @property
    def mean_acceptance_length(self) -> Optional[float]:
        """Emitted tokens per verify round (accepted draft tokens + the bonus token); None
        when no round ran (the prefill's token alone met the budget or ended the sequence)."""
        return self.produced / self.rounds if self.rounds else None


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
    stats.forwards = len(stats.tokens)  # one token per forward, the prefill's included
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
    # Sliding-window layers of full length (tree_attn applies the window by tree position):
    # transformers' own sliding layers drop the keys that compaction moves (Gemma, gpt-oss).
    cache = hf.verification_cache(model)
    out = model(input_ids=input_ids, use_cache=True, output_hidden_states=True, **{cache_arg: cache})
    first = _pick(out.logits[0, -1], args, generator)
    # The draft pairs the target's feature at position t with the token at t + 1.
    features = capture_target_features(out.hidden_states, layer_ids)[0]
    drafter.commit(torch.cat([input_ids[0, 1:], first.view(1)]), features)
    prefix_len = input_ids.shape[1]
    root = first
    stats.tokens.append(int(first))
    stats.forwards = 1
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
            mask_offset=torch.tensor([prefix_len], device=device),
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
        # Emit the round's tokens (accepted draft tokens, then the bonus) up to the budget or an
        # end-of-sequence token. The rest were produced but are not output, so they count
        # neither as tokens nor toward the acceptance length (they are tallied in stats.cut).
        round_tokens = new_tokens.tolist()
        emitted = 0
        for tok in round_tokens:
            if len(stats.tokens) >= args.max_new_tokens or stats.tokens[-1] in stop:
                break
            stats.tokens.append(tok)
            emitted += 1
        stats.rounds += 1
        stats.forwards += 1
        _sync(device)
        t3 = time.perf_counter()
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        stats.bookkeeping_s += t3 - t2
        stats.produced += emitted
        stats.cut += len(round_tokens) - emitted
        if bar is not None:
            bar.update(emitted)
            bar.set_postfix(accept=f"{stats.mean_acceptance_length:.2f}")
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


# --------------------------------------------------------------------------------------------
# Errors: one line each, never a traceback
# --------------------------------------------------------------------------------------------


def fail(message: str) -> NoReturn:
    """An environment or model problem (not a bad flag): one line on stderr, exit status 1."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(1)


def usage_error(message: str) -> NoReturn:
    """A bad flag value found after parsing (it needed the model): argparse's exit status 2."""
    build_parser().error(message)


def _first_line(error: BaseException, limit: int = 300) -> str:
    """"ErrorType: the message's first line", shortened to limit characters."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# A Hugging Face Hub repo id: "name" or "namespace/name" of letters, digits, '-', '_', '.'.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def _looks_like_hub_id(text: str) -> bool:
    return bool(_HUB_ID.fullmatch(text)) and ".." not in text and "--" not in text and len(text) <= 96


def check_model_source(flag: str, source: str) -> None:
    """Refuse a --target/--draft that can be neither a local checkpoint nor a hub id, before
    loading anything. A hub id that is not a local directory is tried at load time."""
    if source == builtin.BUILTIN:
        if not builtin.builtin_assets_present():
            fail(f"{flag} builtin: the built-in weights are missing from {builtin.ASSETS} "
                 "(examples/train_builtin.py creates them)")
    elif os.path.isfile(source):
        fail(f"{flag} {source!r}: is a file; expected a checkpoint directory or a Hugging Face Hub id")
    elif not os.path.isdir(source) and not _looks_like_hub_id(source):
        fail(f"{flag} {source!r}: no such directory (and not a Hugging Face Hub id)")


def check_environment(args) -> None:
    """Device availability and model sources: what parse_args cannot judge from the flags."""
    if args.device == "cuda" and not torch.cuda.is_available():
        why = "this PyTorch build has no CUDA support" if torch.version.cuda is None else "no CUDA device is visible"
        fail(f"--device cuda: CUDA is not available ({why}); use --device cpu")
    if args.device == "mps" and not torch.backends.mps.is_available():
        why = ("this PyTorch build has no MPS support, which needs macOS on Apple silicon"
               if not torch.backends.mps.is_built() else "no MPS device is visible")
        fail(f"--device mps: MPS is not available ({why}); use --device cpu")
    check_model_source("--target", args.target)
    check_model_source("--draft", args.draft)


def _load(flag: str, source: str, loader: Callable):
    """Run loader(); report a missing or unloadable checkpoint as one line naming the flag."""
    try:
        return loader()
    except (OSError, ValueError) as e:  # missing files, failed downloads, bad configs or shapes
        if source != builtin.BUILTIN and not os.path.isdir(source):
            fail(f"{flag} {source!r}: not a local directory, and fetching it from the Hugging Face Hub "
                 f"failed: {_first_line(e)}")
        fail(f"{flag} {source!r}: cannot load it: {_first_line(e)}")


def load_models(args, device, dtype):
    hf.register()

    def target_and_tokenizer():
        if args.target == builtin.BUILTIN:
            model = builtin.load_builtin_target(dtype=dtype, device=device, attn_implementation="tree_attn")
            return model, builtin.ByteTokenizer()
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype, attn_implementation="tree_attn")
        return model.to(device).eval(), AutoTokenizer.from_pretrained(args.target)

    def draft():
        if args.draft == builtin.BUILTIN:  # parse_args made sure the target is built-in too
            return builtin.load_builtin_draft(target, dtype=dtype, device=device)
        return load_eagle3_draft(args.draft, target).to(device=device, dtype=dtype).eval()

    target, tokenizer = _load("--target", args.target, target_and_tokenizer)
    return target, _load("--draft", args.draft, draft), tokenizer


def encode_prompt(tokenizer, prompt: str, device) -> torch.Tensor:
    if isinstance(tokenizer, builtin.ByteTokenizer):
        ids = tokenizer.encode(prompt)
    elif getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    else:
        ids = tokenizer(prompt)["input_ids"]
    return torch.tensor([list(ids)], dtype=torch.long, device=device)


def positions_needed(prompt_len: int, max_new_tokens: int, tree_depth: int) -> int:
    """Target positions a run can use. The prefill takes 0 .. prompt_len - 1. A verify round
    starts with k <= max_new_tokens - 1 tokens emitted, its root at position prompt_len + k - 1
    and its deepest node tree_depth below; with a budget of 1 no round runs."""
    return prompt_len if max_new_tokens == 1 else prompt_len + max_new_tokens - 1 + tree_depth


def check_prompt(args, input_ids: torch.Tensor, target) -> None:
    """The encoded prompt must be non-empty, and it and the budget must fit the target's context."""
    prompt_len = input_ids.shape[1]
    if prompt_len == 0:
        usage_error(f"argument --prompt: {args.prompt!r} encodes to no tokens; the target needs at least one")
    context = getattr(target.config.get_text_config(), "max_position_embeddings", None)
    if not context:
        return
    if prompt_len > context:
        usage_error(f"argument --prompt: {prompt_len} tokens, longer than the target's context of "
                    f"{context} positions")
    tree_depth = min(args.depth + 1, args.total_tokens - 1)  # the deepest node below the root
    if positions_needed(prompt_len, args.max_new_tokens, tree_depth) > context:
        fits = max(1, context - prompt_len - tree_depth + 1)  # 1 always fits: no round runs
        usage_error(f"argument --max-new-tokens: {args.max_new_tokens} does not fit the target's context of "
                    f"{context} positions after the {prompt_len}-token prompt and a depth-{tree_depth} draft "
                    f"tree; the most that fits is {fits}")


# --------------------------------------------------------------------------------------------
# Flags
# --------------------------------------------------------------------------------------------


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= low. argparse reports "argument --flag: <message>"."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return value

    return parse


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def temperature(text: str) -> float:
    value = _number(text)
    if not (value == 0 or MIN_TEMPERATURE <= value < math.inf):  # NaN fails both
        raise argparse.ArgumentTypeError(f"expected 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g} "
                                         f"(sampling), got {text!r}")
    return abs(value)  # -0.0 is greedy too


def top_p(text: str) -> float:
    value = _number(text)
    if not 0 < value <= 1:  # NaN fails too
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not SEED_MIN <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"expected an integer in [-2**63, 2**64 - 1], got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=builtin.BUILTIN, help="local path or hub id of the target LM (default: built-in)")
    p.add_argument("--draft", default=builtin.BUILTIN, help="local path or hub id of an EAGLE-3 draft (default: built-in)")
    p.add_argument("--device", default="cpu", choices=["cpu", "mps", "cuda"])
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=400,
                   help="tokens to generate, the first (from the prefill) included")
    p.add_argument("--total-tokens", type=int_at_least(1), default=None,
                   help="draft tree size including the root (default: 24 for the built-in models on CPU, else 60)")
    p.add_argument("--depth", type=int_at_least(0), default=None,
                   help="draft steps after the root's (default: 8 built-in on CPU, else 7)")
    p.add_argument("--top-k", type=int_at_least(1), default=None,
                   help="children per node and frontier width (default: 4 built-in on CPU, else 10)")
    p.add_argument("--temperature", type=temperature, default=0.0,
                   help=f"0 = greedy verification, else sampling (>= {MIN_TEMPERATURE:g})")
    p.add_argument("--top-p", type=top_p, default=1.0, help="nucleus sampling mass in (0, 1]; sampling only")
    p.add_argument("--seed", type=seed, default=0, help="sampling seed")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--check", action="store_true", help="assert the output equals plain greedy decoding")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--threads", type=int_at_least(1), default=None,
                   help="torch CPU threads (default: 1 for the built-in models on CPU, else torch's default)")
    return p


def parse_args(argv: Optional[List[str]] = None):
    """Parse and validate the flags: a bad value exits through parser.error (status 2)."""
    p = build_parser()
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
        p.error(f"argument --check: compares with greedy decoding; use it with --temperature 0, "
                f"not {args.temperature:g}")
    if args.draft == builtin.BUILTIN and args.target != builtin.BUILTIN:
        p.error(f"argument --draft: the built-in draft only fits --target builtin, not {args.target!r}; "
                "pass --draft with an EAGLE-3 checkpoint for that target")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes on the command line arrive as lone surrogates
        p.error(f"argument --prompt: not valid UTF-8 text: {args.prompt!r}")
    if args.temperature == 0 and args.top_p != 1.0:
        print(f"{PROG}: note: --top-p {args.top_p:g} has no effect with --temperature 0 (greedy)", file=sys.stderr)
    return args


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def report(args, tokenizer, spec: Stats, base: Stats) -> None:
    n, nb = len(spec.tokens), len(base.tokens)
    print(f"prompt: {args.prompt!r}")
    print(f"output: {tokenizer.decode(spec.tokens)!r}")
    print(f"eagle-3 tree decoding: {_plural(n, 'token')} in {spec.total_s:.2f} s = {n / spec.total_s:.1f} "
          f"tokens/s, {_plural(spec.forwards, 'target forward')} (prefill + {_plural(spec.rounds, 'verify round')}; "
          f"tree: {args.total_tokens} tokens, depth {args.depth}, top-k {args.top_k})")
    # Mean acceptance length: emitted tokens per verify round (see the module docstring).
    if spec.rounds:
        cut = f" and {_plural(spec.cut, 'token')} produced past the budget or end-of-sequence" if spec.cut else ""
        print(f"mean acceptance length {spec.mean_acceptance_length:.2f} = {_plural(spec.produced, 'token')} "
              f"emitted by {_plural(spec.rounds, 'verify round')} (accepted draft tokens + bonus; not counting "
              f"the prefill's token{cut})")
        loop_s = spec.draft_s + spec.verify_s + spec.bookkeeping_s
        print(f"time split: draft {spec.draft_s:.2f} s ({100 * spec.draft_s / loop_s:.0f}%), verify (target tree "
              f"forward) {spec.verify_s:.2f} s ({100 * spec.verify_s / loop_s:.0f}%), bookkeeping (accept, compact "
              f"KV cache) {spec.bookkeeping_s:.2f} s ({100 * spec.bookkeeping_s / loop_s:.0f}%); "
              f"prefill {spec.prefill_s:.2f} s")
    else:
        print("mean acceptance length n/a: no verify round ran (the prefill's token was the whole output)")
        print(f"time split: prefill {spec.prefill_s:.2f} s, nothing else")
    speedup = (n / spec.total_s) / (nb / base.total_s)
    print(f"plain greedy decoding: {_plural(nb, 'token')} in {base.total_s:.2f} s = {nb / base.total_s:.1f} "
          f"tokens/s, {_plural(base.forwards, 'target forward')}; speedup {speedup:.2f}x")


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    check_environment(args)
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
    check_prompt(args, input_ids, target)
    stop = _stop_tokens(target, tokenizer)
    drafter = Eagle3Drafter(draft, capacity=input_ids.shape[1] + args.max_new_tokens + 64)

    # Warm both paths up once (allocator, kernels, lazy imports) so timings compare steady state.
    warm = copy.copy(args)
    warm.max_new_tokens = min(8, args.max_new_tokens)
    speculative(target, drafter, input_ids, warm, stop, progress=False)
    plain_greedy(target, input_ids, warm.max_new_tokens, stop)

    spec = speculative(target, drafter, input_ids, args, stop, progress=not args.no_progress)
    base = plain_greedy(target, input_ids, args.max_new_tokens, stop)
    report(args, tokenizer, spec, base)

    if args.temperature == 0:
        n = len(spec.tokens)
        same = spec.tokens == base.tokens
        if args.check:
            if not same:
                first_diff = next(i for i, (a, b) in enumerate(zip(spec.tokens + [None], base.tokens + [None])) if a != b)
                fail(f"check FAILED: outputs differ from token {first_diff} on "
                     f"(eagle-3 {spec.tokens[first_diff:first_diff + 8]}, greedy "
                     f"{base.tokens[first_diff:first_diff + 8]})")
            print(f"check: OK, the output equals plain greedy decoding ({_plural(n, 'token')})")
        else:
            print(f"same tokens as plain greedy decoding: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
