"""EAGLE-3 speculative decoding with tree attention, end to end: a command line over
:mod:`torch_tree_attn.speculative`, run as ``examples/eagle3_verify.py`` (or
``python -m torch_tree_attn.speculative.cli``). It lives in the package so that its pieces
(parse_args, plain_greedy, main, ...) are importable by the tests and by other code.

Each round (``torch_tree_attn.speculative.generate`` does them): the EAGLE-3 draft grows a
dynamic tree of candidate continuations; the target verifies the whole tree in ONE forward
(attn_implementation="tree_attn": the tree's tokens, positions prefix + depth, and a compact
[T, T] ancestor mask with the prefix length); the longest path the target agrees with is
accepted plus one bonus token; the accepted K/V are compacted into place in the target's cache
and the draft gets the target's hidden states of the accepted tokens. On CUDA the rounds are
replayed from CUDA graphs.

    python examples/eagle3_verify.py                   # built-in target + draft, CPU, no network
    python examples/eagle3_verify.py --check           # also assert output == plain greedy decoding
    python examples/eagle3_verify.py --target meta-llama/Llama-3.1-8B-Instruct \\
        --draft yuhuili/EAGLE3-LLaMA3.1-Instruct-8B --device cuda --dtype bfloat16

The tree's shape defaults to EAGLE's (60 tokens, depth 7, top-k 10), except for the built-in
models on CPU, where a smaller tree (16 tokens, depth 6, top-k 2) is faster: see parse_args.

Both decoders run twice on the same model in the same process. The first calls are the cold
start: nothing warmed up, EAGLE-3's first (its buffers, and on CUDA its graph capture,
included), then plain greedy's; the report gives their speedup and the time from process
start to EAGLE-3's last token. The second calls are the steady state: tokens/s and target
forwards of both, the time split, and the mean acceptance length: the tokens the verify
rounds emitted divided by the number of verify rounds. Each verify round is one target
forward over the tree and emits the accepted draft tokens plus the target's bonus token; the
first token (from the prefill forward) is not counted, nor are tokens a round produced past
--max-new-tokens or past an end-of-sequence token, since they are not emitted.

Exit status: 0 on success; 2 for a bad flag (argparse's usage error); 1 when the environment
or a model is the problem (device unavailable, checkpoint missing or unloadable) or --check
fails. Every failure is reported as one line, never a traceback.

The built-in models are read from ``torch_tree_attn.speculative.builtin.assets_dir()``: the checkout's
examples/assets, or $TORCH_TREE_ATTN_ASSETS.
"""
import time

# "Process start" for the cold-start figure when main() is not given one (the example script
# passes the time it took before its imports).
IMPORT_START = time.perf_counter()

import argparse  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Callable, List, NoReturn, Optional  # noqa: E402

import torch  # noqa: E402

from .. import hf, speculative  # noqa: E402
from . import builtin  # noqa: E402
from .eagle3 import load_eagle3_draft  # noqa: E402

PROG = "eagle3_verify.py"
DEFAULT_PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    "
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Sampling divides the logits by the temperature in float32: far below this it overflows to
# inf (NaN probabilities), and already here it is greedy for any practical logit gap.
MIN_TEMPERATURE = 1e-4
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts


@dataclass
class Run:
    """One decoder call: the tokens it emitted (<= --max-new-tokens, up to end-of-sequence),
    its wall time, its target forwards, and (EAGLE-3 only) the library's statistics."""

    tokens: List[int]
    total_s: float
    forwards: int
    stats: Optional[speculative.Stats] = None


def _runtime_compiles() -> Optional[int]:
    """How many CUDA kernels this process has compiled at run time (no prebuilt one fitted), or
    None without the CUDA backend."""
    from .. import _C

    stats = getattr(_C, "cuda_registry_stats", None)
    return stats()["compiled"] if stats is not None else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _cache_kwarg(model) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _stop_tokens(model, tokenizer) -> set:
    ids = getattr(model.generation_config, "eos_token_id", None) or getattr(tokenizer, "eos_token_id", None)
    if ids is None:
        return set()
    return set(ids) if isinstance(ids, (list, tuple)) else {int(ids)}


@torch.no_grad()
def plain_greedy(model, input_ids: torch.Tensor, max_new_tokens: int, stop: set) -> Run:
    """Token-by-token greedy decoding with a KV cache: the baseline and the --check reference."""
    from transformers import DynamicCache

    device = input_ids.device
    cache_arg = _cache_kwarg(model)
    _sync(device)
    start = time.perf_counter()
    cache = DynamicCache(config=model.config)
    out = model(input_ids=input_ids, use_cache=True, **{cache_arg: cache})
    token = out.logits[0, -1].argmax()
    tokens = [int(token)]
    while len(tokens) < max_new_tokens and tokens[-1] not in stop:
        out = model(input_ids=token.view(1, 1), use_cache=True, **{cache_arg: cache})
        token = out.logits[0, -1].argmax()
        tokens.append(int(token))
    _sync(device)
    return Run(tokens=tokens, total_s=time.perf_counter() - start, forwards=len(tokens))


def tree_config(args) -> speculative.TreeConfig:
    return speculative.TreeConfig(total_tokens=args.total_tokens, depth=args.depth, top_k=args.top_k)


def speculative_decode(model, draft, input_ids: torch.Tensor, args, stop: set, progress: bool = True) -> Run:
    """EAGLE-3 tree decoding through torch_tree_attn.speculative.stream (a progress bar on stderr)."""
    generator = torch.Generator().manual_seed(args.seed)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=args.max_new_tokens, unit="tok", desc="eagle-3", leave=False, file=sys.stderr)
    _sync(input_ids.device)
    start = time.perf_counter()
    tokens, stats = [], None
    for chunk in speculative.stream(model, draft, input_ids, args.max_new_tokens, temperature=args.temperature,
                                    top_p=args.top_p, tree=tree_config(args), stop=sorted(stop),
                                    generator=generator):
        tokens.extend(chunk.tokens[0])
        stats = chunk.stats
        if bar is not None:
            bar.update(len(chunk.tokens[0]))
            if stats.rounds:
                bar.set_postfix(accept=f"{stats.mean_acceptance_length:.2f}")
    if bar is not None:
        bar.close()
    return Run(tokens=tokens, total_s=time.perf_counter() - start, forwards=stats.forwards, stats=stats)


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
        try:
            builtin.find_assets()
        except FileNotFoundError as e:
            fail(f"{flag} builtin: {e}")
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


def check_prompt(args, input_ids: torch.Tensor, target, draft) -> None:
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
    tree_depth = tree_config(args).shape(draft.config.draft_vocab_size).path - 1  # the deepest node below the root
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
                   help="draft tree size including the root (default: 16 for the built-in models on CPU, else 60)")
    p.add_argument("--depth", type=int_at_least(0), default=None,
                   help="draft steps after the root's (default: 6 built-in on CPU, else 7)")
    p.add_argument("--top-k", type=int_at_least(1), default=None,
                   help="children per node and frontier width (default: 2 built-in on CPU, else 10)")
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
    # 60-token forward costs about 3 greedy steps, a 24-token one 2, a 16-token one 1.7, and
    # each draft step costs about 0.07 of one; on the default prompt 16 / 6 / 2 was the
    # fastest of the shapes tried (2.45x plain greedy, 24 / 8 / 4: 2.2x).
    small_tree = args.target == builtin.BUILTIN and args.device == "cpu"
    for name, builtin_cpu, eagle in (("total_tokens", 16, 60), ("depth", 6, 7), ("top_k", 2, 10)):
        if getattr(args, name) is None:
            setattr(args, name, builtin_cpu if small_tree else eagle)
    if args.check and args.temperature > 0:
        p.error(f"argument --check: compares with greedy decoding; use it with --temperature 0, "
                f"not {args.temperature:g}")
    if args.draft == builtin.BUILTIN and args.target != builtin.BUILTIN:
        # A --target that can be no checkpoint is the problem to report, not the draft that
        # would not fit it.
        check_model_source("--target", args.target)
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


def tree_summary(args, draft) -> str:
    """The tree actually built: --total-tokens nodes, or fewer where depth and top-k cannot grow that many."""
    size = tree_config(args).size(draft.config.draft_vocab_size)
    text = f"tree: {_plural(size, 'token')}, depth {args.depth}, top-k {args.top_k}"
    if size < args.total_tokens:
        text += f"; --total-tokens {args.total_tokens} asked for more than depth {args.depth} and top-k {args.top_k} grow"
    return text


def report(args, tokenizer, draft, spec: Run, base: Run, cold_spec: Run, cold_base: Run, to_last_token_s: float,
           load_s: float, cold_compiles: Optional[int] = None) -> None:
    stats = spec.stats
    n, nb = len(spec.tokens), len(base.tokens)
    print(f"prompt: {args.prompt!r}")
    print(f"output: {tokenizer.decode(spec.tokens)!r}")
    cold_speedup = (len(cold_spec.tokens) / cold_spec.total_s) / (len(cold_base.tokens) / cold_base.total_s)
    capture = f", CUDA-graph capture {cold_spec.stats.capture_s:.2f} s" if cold_spec.stats.cuda_graphs else ""
    print(f"cold start (each decoder's first call, nothing warmed up): eagle-3 {_plural(len(cold_spec.tokens), 'token')} "
          f"in {cold_spec.total_s:.2f} s (buffers {cold_spec.stats.setup_s:.2f} s{capture}), plain greedy "
          f"{_plural(len(cold_base.tokens), 'token')} in {cold_base.total_s:.2f} s; speedup {cold_speedup:.2f}x; "
          f"process start to eagle-3's last token {to_last_token_s:.2f} s (imports and model load {load_s:.2f} s)")
    cs = cold_spec.stats
    if cs.rounds:
        compiles = "" if cold_compiles is None else f"; CUDA kernels compiled at run time: {cold_compiles}"
        print(f"  eagle-3's first call: draft {cs.draft_s:.2f} s, verify {cs.verify_s:.2f} s, bookkeeping "
              f"{cs.accept_s:.2f} s, prefill {cs.prefill_s:.2f} s{compiles}")
    graphs = ", CUDA graphs" if stats.cuda_graphs else ""
    print(f"eagle-3 tree decoding: {_plural(n, 'token')} in {spec.total_s:.2f} s = {n / spec.total_s:.1f} "
          f"tokens/s, {_plural(spec.forwards, 'target forward')} (prefill + {_plural(stats.rounds, 'verify round')}; "
          f"{tree_summary(args, draft)}{graphs})")
    # Mean acceptance length: emitted tokens per verify round (see the module docstring).
    if stats.rounds:
        cut = f" and {_plural(stats.cut, 'token')} produced past the budget or end-of-sequence" if stats.cut else ""
        print(f"mean acceptance length {stats.mean_acceptance_length:.2f} = {_plural(stats.produced, 'token')} "
              f"emitted by {_plural(stats.rounds, 'verify round')} (accepted draft tokens + bonus; not counting "
              f"the prefill's token{cut})")
        loop_s = stats.draft_s + stats.verify_s + stats.accept_s
        print(f"time split: draft {stats.draft_s:.2f} s ({100 * stats.draft_s / loop_s:.0f}%), verify (target tree "
              f"forward) {stats.verify_s:.2f} s ({100 * stats.verify_s / loop_s:.0f}%), bookkeeping (accept, compact "
              f"KV cache) {stats.accept_s:.2f} s ({100 * stats.accept_s / loop_s:.0f}%); "
              f"prefill {stats.prefill_s:.2f} s")
    else:
        print("mean acceptance length n/a: no verify round ran (the prefill's token was the whole output)")
        print(f"time split: prefill {stats.prefill_s:.2f} s, nothing else")
    speedup = (n / spec.total_s) / (nb / base.total_s)
    print(f"plain greedy decoding: {_plural(nb, 'token')} in {base.total_s:.2f} s = {nb / base.total_s:.1f} "
          f"tokens/s, {_plural(base.forwards, 'target forward')}; speedup {speedup:.2f}x (steady state)")


def main(argv: Optional[List[str]] = None, process_start: Optional[float] = None) -> int:
    """The command line; process_start (time.perf_counter() at process start) defaults to
    this module's import."""
    start = IMPORT_START if process_start is None else process_start
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
    check_prompt(args, input_ids, target, draft)
    stop = _stop_tokens(target, tokenizer)
    load_s = time.perf_counter() - start

    # Cold start: each decoder's first call on this model, EAGLE-3's first (it pays for its
    # buffers, lazy initialisation and, on CUDA, the graph capture). Then the steady state.
    speculative.release(target)  # a fresh start also when main() runs twice in one process
    compiles_before = _runtime_compiles() if device.type == "cuda" else None
    cold_spec = speculative_decode(target, draft, input_ids, args, stop, progress=not args.no_progress)
    cold_compiles = None if compiles_before is None else _runtime_compiles() - compiles_before
    to_last_token_s = time.perf_counter() - start
    cold_base = plain_greedy(target, input_ids, args.max_new_tokens, stop)
    spec = speculative_decode(target, draft, input_ids, args, stop, progress=not args.no_progress)
    base = plain_greedy(target, input_ids, args.max_new_tokens, stop)
    speculative.release(target)
    report(args, tokenizer, draft, spec, base, cold_spec, cold_base, to_last_token_s, load_s, cold_compiles)

    if args.temperature == 0:
        n = len(spec.tokens)
        # Both EAGLE-3 calls (cold and steady) against plain greedy decoding.
        wrong = [(name, run) for name, run in (("eagle-3", spec), ("eagle-3's first call", cold_spec))
                 if run.tokens != base.tokens]
        if args.check:
            if wrong:
                name, run = wrong[0]
                first_diff = next(i for i, (a, b) in enumerate(zip(run.tokens + [None], base.tokens + [None])) if a != b)
                fail(f"check FAILED: outputs differ from token {first_diff} on "
                     f"({name} {run.tokens[first_diff:first_diff + 8]}, greedy "
                     f"{base.tokens[first_diff:first_diff + 8]})")
            print(f"check: OK, the output equals plain greedy decoding ({_plural(n, 'token')})")
        else:
            print(f"same tokens as plain greedy decoding: {not wrong}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
