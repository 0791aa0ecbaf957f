"""generate and stream: argument checks and the rounds loop."""
from __future__ import annotations

import math
import time
import warnings
from typing import Iterable, Iterator, List, Optional, Tuple, Union

import torch

from ..hf.attention import tree_attention_forward
from .config import Chunk, GenerateOutput, Stats, TreeConfig
from .eagle3 import Eagle3Draft, Eagle3Drafter
from .engine import _engine_for, _Timer


# --------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------


def _check_target(target) -> torch.device:
    config = getattr(target, "config", None)
    if config is None or not callable(target):
        raise TypeError(f"target must be a transformers causal LM, got {type(target).__name__}")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = getattr(config, "_attn_implementation", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    name = getattr(text, "_attn_implementation", name)
    if name not in ALL_ATTENTION_FUNCTIONS or ALL_ATTENTION_FUNCTIONS[name] is not tree_attention_forward:
        raise ValueError(
            f"target must run attn_implementation='tree_attn' (torch_tree_attn.hf.register(), then "
            f"from_pretrained(..., attn_implementation='tree_attn') or model.set_attn_implementation('tree_attn')), "
            f"got {name!r}")
    return next(target.parameters()).device


def _check_draft(drafter, target, device) -> Eagle3Draft:
    draft = drafter.draft if isinstance(drafter, Eagle3Drafter) else drafter
    if not isinstance(draft, Eagle3Draft):
        raise TypeError(f"drafter must be an Eagle3Draft or an Eagle3Drafter, got {type(drafter).__name__}")
    draft_device = draft.fc.weight.device
    if draft_device != device:
        raise ValueError(f"drafter is on {draft_device} but target is on {device}; move them to one device")
    text = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    if draft.config.target_hidden_size != text.hidden_size:
        raise ValueError(f"drafter reads target hidden states of size {draft.config.target_hidden_size}, "
                         f"the target's hidden_size is {text.hidden_size}")
    if draft.config.vocab_size != text.vocab_size:
        raise ValueError(f"drafter's vocab_size is {draft.config.vocab_size}, the target's is {text.vocab_size}")
    return draft


def _prompt_rows(input_ids, attention_mask, vocab_size: int) -> List[List[int]]:
    """The prompts as lists of ids: a [B, L] / [L] tensor (with an optional 0/1
    attention_mask whose ones are contiguous in each row: left or right padding) or a
    sequence of sequences of ints."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dtype not in (torch.int32, torch.int64) or input_ids.dim() not in (1, 2):
            raise ValueError(f"input_ids must be an int64 tensor [B, L] or [L], got {input_ids.dtype} "
                             f"of shape {tuple(input_ids.shape)}")
        ids = (input_ids[None] if input_ids.dim() == 1 else input_ids).cpu()
        if ids.shape[0] == 0:
            raise ValueError(f"input_ids has no rows, shape {tuple(input_ids.shape)}")
        if attention_mask is None:
            rows = ids.tolist()
        else:
            if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
                shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
                raise ValueError(f"attention_mask must be a tensor shaped like input_ids {tuple(input_ids.shape)}, got {shape}")
            mask = attention_mask.reshape(ids.shape).cpu()
            if bool(((mask != 0) & (mask != 1)).any()):
                raise ValueError(f"attention_mask must hold 0 (padding) and 1 (token), got values {mask.unique().tolist()}")
            rows = []
            for b, (row, keep) in enumerate(zip(ids.tolist(), mask.bool().tolist())):
                where = [i for i, k in enumerate(keep) if k]
                if where and where[-1] - where[0] + 1 != len(where):
                    raise ValueError(f"attention_mask row {b} has padding between tokens ({keep}); each row's tokens "
                                     "must be contiguous (left or right padding)")
                rows.append(row[where[0]: where[-1] + 1] if where else [])
    elif attention_mask is not None:
        raise ValueError("attention_mask goes with a tensor input_ids; pass the rows of a list without padding")
    elif isinstance(input_ids, (list, tuple)) and all(isinstance(r, (list, tuple, torch.Tensor)) for r in input_ids):
        rows = [r.reshape(-1).tolist() if isinstance(r, torch.Tensor) else list(r) for r in input_ids]
        if not rows:
            raise ValueError("input_ids has no rows (an empty list)")
        for b, row in enumerate(rows):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in row):
                raise ValueError(f"input_ids row {b} must hold ints, got {row!r}")
    else:
        raise TypeError(f"input_ids must be an int64 tensor [B, L] or a list of token-id lists, got "
                        f"{type(input_ids).__name__}")
    for b, row in enumerate(rows):
        if not row:
            raise ValueError(f"input_ids row {b} has no tokens; every prompt needs at least one")
        bad = [t for t in row if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"input_ids row {b} holds ids outside the target's vocabulary [0, {vocab_size}): {bad[:8]}")
    return rows


def _stop_ids(stop, target, vocab_size: int) -> List[int]:
    if stop is None:
        ids = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
        if ids is None:
            ids = getattr(target.config, "eos_token_id", None)
        stop = [] if ids is None else ([ids] if isinstance(ids, int) else list(ids))
    elif isinstance(stop, int) and not isinstance(stop, bool):
        stop = [stop]
    try:
        values = list(stop)
    except TypeError:
        raise TypeError(f"stop must be None, a token id or an iterable of token ids, got {type(stop).__name__}") from None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TypeError(f"stop must hold int token ids, got {values!r}")
    bad = [v for v in values if not 0 <= v < vocab_size]
    if bad:
        raise ValueError(f"stop holds ids outside the target's vocabulary [0, {vocab_size}): {bad}")
    return sorted(set(values))


def _check_numbers(max_new_tokens, temperature, top_p) -> Tuple[float, float]:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if (not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature >= 0
            or math.isinf(temperature)):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if 0 < temperature < 1e-4:
        raise ValueError(f"temperature must be 0 (greedy) or >= 1e-4 (logits / temperature overflows float32 "
                         f"below), got {temperature!r}")
    if not isinstance(top_p, (int, float)) or isinstance(top_p, bool) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    return float(temperature), float(top_p)


def _seed_from(generator) -> int:
    """A seed for the engine's own generator, drawn from the caller's generator (or torch's
    default one): the same generator state gives the same output."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    device = generator.device if generator is not None else "cpu"
    return int(torch.randint(0, 2**62, (1,), generator=generator, device=device))


# --------------------------------------------------------------------------------------------
# The API
# --------------------------------------------------------------------------------------------


def stream(target, drafter, input_ids, max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
           tree: TreeConfig = TreeConfig(), stop: Union[None, int, Iterable[int]] = None,
           attention_mask: Optional[torch.Tensor] = None, generator: Optional[torch.Generator] = None,
           cuda_graphs: Optional[bool] = None) -> Iterator[Chunk]:
    """Speculative decoding of ``target`` with an EAGLE-3 ``drafter``, chunk by chunk: the first
    :class:`Chunk` holds every row's first token (from the prefill), each later one what a
    round output. Arguments as :func:`generate`; they are checked at the call, before the
    first chunk is asked for."""
    device = _check_target(target)
    draft = _check_draft(drafter, target, device)
    temperature, top_p = _check_numbers(max_new_tokens, temperature, top_p)
    if not isinstance(tree, TreeConfig):
        raise TypeError(f"tree must be a TreeConfig, got {type(tree).__name__}")
    text = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    rows = _prompt_rows(input_ids, attention_mask, text.vocab_size)
    stop_ids = _stop_ids(stop, target, text.vocab_size)
    graphs_auto = cuda_graphs is None
    if cuda_graphs is None:
        cuda_graphs = device.type == "cuda" and draft.rotary.kind != "dynamic"
    elif not isinstance(cuda_graphs, bool):
        raise TypeError(f"cuda_graphs must be None (auto), True or False, got {cuda_graphs!r}")
    elif cuda_graphs and device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs a CUDA target, got one on {device}")
    elif cuda_graphs and draft.rotary.kind == "dynamic":
        raise ValueError("cuda_graphs=True: the drafter's dynamic rope scaling reads positions on the host")
    seed = _seed_from(generator)
    return _stream(target, draft, rows, max_new_tokens, temperature, top_p, tree, stop_ids, seed, cuda_graphs,
                   graphs_auto, device)


def _stream(target, draft, rows, max_new_tokens, temperature, top_p, tree, stop_ids, seed, cuda_graphs,
            graphs_auto, device) -> Iterator[Chunk]:
    clock = time.perf_counter()
    B = len(rows)
    shape = tree.shape(draft.config.draft_vocab_size)
    # The target's slots: the prompt, then a tree (or a compacted path) after every prefix.
    capacity = max(len(r) for r in rows) + max_new_tokens + max(shape.size, shape.path)
    stats = Stats(batch=B, emitted=[0] * B, row_rounds=[0] * B, cuda_graphs=cuda_graphs)
    elapsed = 0.0

    def lap() -> float:  # time spent in here since the last lap, the caller's excluded
        nonlocal clock, elapsed
        now = time.perf_counter()
        elapsed += now - clock
        clock = now
        return elapsed

    with torch.no_grad():
        setup = time.perf_counter()
        engine, new = _engine_for(target, draft, B, capacity, tree, device)
        if new:
            stats.setup_s = time.perf_counter() - setup
        engine.begin(max_new_tokens, stop_ids, seed)
        prefill = time.perf_counter()
        first = engine.prefill(rows, temperature, top_p)
        done = engine.done.tolist()
        first = first.tolist()
        stats.prefill_s = time.perf_counter() - prefill
        stats.forwards = 1
        stats.emitted = [1] * B
        engine.cache.length_hint = max(len(r) for r in rows)
        stats.total_s = lap()
    yield Chunk(tokens=[[t] for t in first], done=list(done), stats=stats)
    clock = time.perf_counter()

    timer = _Timer(device)
    while not all(done):
        with torch.no_grad():
            timer.start()
            engine.round(temperature, top_p, cuda_graphs, timer)
            result = engine.result.tolist()  # the round's one synchronisation
            timer.finish()
            if engine.pending_capture:
                try:
                    stats.capture_s += engine.capture(temperature, top_p)
                except Exception as error:  # noqa: BLE001
                    if not graphs_auto:
                        raise
                    warnings.warn(f"speculative: CUDA-graph capture failed, running the rounds eagerly "
                                  f"(pass cuda_graphs=False to skip it): {type(error).__name__}: {error}")
                    engine.graphs, engine.graph_keys = {}, None
                    cuda_graphs = stats.cuda_graphs = False
        tokens, lengths = [], []
        for b, (emit, length, finished, *new) in enumerate(result):
            active = not done[b]
            tokens.append(new[:emit])
            lengths.append(length if active else 0)
            if active:
                stats.row_rounds[b] += 1
                stats.emitted[b] += emit
                stats.produced += emit
                stats.cut += length - emit
            done[b] = bool(finished)
        engine.cache.length_hint = max(len(r) for r in rows) + max(stats.emitted)
        stats.rounds += 1
        stats.forwards += 1
        stats.accept_lengths.append(lengths)
        stats.draft_s, stats.verify_s = timer.totals["draft"], timer.totals["verify"]
        stats.accept_s = timer.totals["accept"]
        stats.total_s = lap()
        yield Chunk(tokens=tokens, done=list(done), stats=stats)
        clock = time.perf_counter()


def generate(target, drafter, input_ids, max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
             tree: TreeConfig = TreeConfig(), stop: Union[None, int, Iterable[int]] = None,
             attention_mask: Optional[torch.Tensor] = None, generator: Optional[torch.Generator] = None,
             cuda_graphs: Optional[bool] = None) -> GenerateOutput:
    """Generate up to ``max_new_tokens`` tokens per row with EAGLE-3 tree speculative decoding.

    Args:
        target: a transformers causal LM running ``attn_implementation="tree_attn"``
            (:func:`torch_tree_attn.hf.register`), in eval mode, on CPU, CUDA or MPS.
        drafter: its EAGLE-3 draft (:class:`~torch_tree_attn.speculative.eagle3.Eagle3Draft`, or an
            :class:`~torch_tree_attn.speculative.eagle3.Eagle3Drafter`, whose draft is used), on the
            target's device.
        input_ids: int64 ``[B, L]`` or ``[L]`` (with ``attention_mask`` for rows of different
            lengths, left- or right-padded), or a list of B lists of token ids.
        max_new_tokens: tokens to generate per row, the first (from the prefill) included, >= 1.
        temperature: 0 = greedy; else sampling from ``softmax(logits / temperature)``
            (>= 1e-4), exactly the target's distribution.
        top_p: nucleus sampling mass in (0, 1] (sampling only).
        tree: the draft tree's shape.
        stop: token ids that end a row (output, then the row stops): an int, an iterable, or
            None for the target's ``generation_config.eos_token_id``; ``()`` for none.
        attention_mask: 0/1 ``[B, L]`` marking each row's tokens in a padded ``input_ids``.
        generator: a torch.Generator for reproducible sampling (default: torch's global one).
        cuda_graphs: replay each round's steps from CUDA graphs (captured on the first call
            for a shape, after one warm-up round). None = on for CUDA targets (and, should the
            capture fail, a warning and eager rounds); True insists (a failure raises).

    Returns:
        :class:`GenerateOutput`: the new tokens of every row, their lengths, :class:`Stats`.
        Each row is what it would be alone (different lengths, trees and acceptance per row).
    """
    chunks = stream(target, drafter, input_ids, max_new_tokens, temperature=temperature, top_p=top_p,
                    tree=tree, stop=stop, attention_mask=attention_mask, generator=generator,
                    cuda_graphs=cuda_graphs)
    rows: List[List[int]] = []
    stats = None
    for chunk in chunks:
        if not rows:
            rows = [[] for _ in chunk.tokens]
        for row, new in zip(rows, chunk.tokens):
            row.extend(new)
        stats = chunk.stats
    width = max(len(r) for r in rows)
    tokens = torch.full((len(rows), width), -1, dtype=torch.int64)
    for b, row in enumerate(rows):
        tokens[b, : len(row)] = torch.tensor(row, dtype=torch.int64)
    return GenerateOutput(tokens=tokens, lengths=torch.tensor([len(r) for r in rows], dtype=torch.int64),
                          stats=stats)
