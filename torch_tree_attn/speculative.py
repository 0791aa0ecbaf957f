"""Speculative decoding with EAGLE-3 draft trees, as a library: :func:`generate` and :func:`stream`.

One *round* (per batch row, all rows at once):

1. **draft**: the EAGLE-3 draft commits the tokens the previous round accepted (with the
   target's hidden states of those positions), then grows a dynamic tree from the last
   token (EAGLE-2/3: each frontier node's top-k children, scored by cumulative draft
   log-probability; the best top-k children form the next frontier; the tree keeps the
   ``total_tokens - 1`` best candidates). This is :func:`torch_tree_attn.tree.build_dynamic_tree`'s
   algorithm with fixed shapes and no data-dependent early stop (which never changed its
   result), so that it needs no host synchronisation;
2. **verify**: one target forward over every row's tree (``attn_implementation="tree_attn"``:
   the tree's tokens at positions ``prefix + depth``, the compact ``[B, T, T]`` ancestor mask,
   ``mask_offset`` = each row's own prefix length);
3. **accept**: greedy (the longest path the target's argmax agrees with, plus the target's
   token after it) or exact sampling (multi-candidate rejection sampling, below);
4. **compact**: the accepted nodes' K/V move to the slots right after the row's prefix, in
   every layer, and the accepted tokens with their target features are queued for the next
   draft commit.

The host reads the round's result once (tokens, lengths, finished flags): that is the only
synchronisation in a round. Everything else has fixed shapes, so on CUDA the three steps are
captured once per shape in CUDA graphs and replayed every round (``cuda_graphs``).

Caches. Each batch row keeps its own prefix length: the target's KV cache is a static
``[B, H, capacity, D]`` buffer per layer (:class:`RowCache`) that writes every row at its own
slot, and the tree-attention op reads row b's keys up to ``mask_offset[b] + T`` only. So
rows of different prompt lengths and different accepted lengths need no padding mask;
prompts are right-padded for the prefill, which causal attention makes exact. The
draft's cache works the same way. A row that has finished keeps running (its results are
discarded) without moving its caches, so shapes stay fixed until every row has finished.

Exactness. Greedy (``temperature=0``): the output is plain greedy decoding's, token for token,
wherever the target's best token is not a near-tie: the tree forward and token-by-token
decoding compute the same logits in a different order (other matrix shapes), so where the two
best logits of a step are within :func:`tie_tolerance` of the dtype times the step's largest
|logit| (float32 1e-4, bfloat16 2**-5), either may be taken, and the outputs may differ from
there on. Sampling (``temperature > 0``): every emitted token is distributed exactly as sampling the target
token by token from ``sampling_probs(logits, temperature, top_p)``. The draft's children
are deterministic (top-k), so the draft distribution of each child is a point mass, and
SpecInfer/EAGLE's rule "accept child x with probability min(1, p(x) / q(x)), else
p <- normalize(max(p - q, 0))" becomes: try the children of a node in order, accept child
x with probability p(x) (p renormalised after each rejection), else set p(x) = 0 and
renormalise; accept -> move to that child; if every child is rejected (or the node is a
leaf), draw the next token from what is left of p.
"""
from __future__ import annotations

import inspect
import math
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import _hf_compat
from .eagle3 import Eagle3Draft, Eagle3Drafter, capture_target_features, feature_layer_ids
from .hf import _SPEC_QUERY_END, _SPEC_WINDOW, tree_attention_forward
from .ops import tree_attention
from .tree import _ancestor_mask, _mask_depths, sampling_probs

__all__ = ["TreeConfig", "TreeShape", "Stats", "Chunk", "GenerateOutput", "RowCache", "generate", "stream", "release",
           "tie_tolerance"]


# The tie rule of greedy decoding (module docstring), relative to a step's largest |logit|.
_TIE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2.0 ** -5}


def tie_tolerance(dtype: torch.dtype) -> float:
    """Greedy's tie rule: at a step where plain greedy decoding's best logit beats every other
    by more than ``tie_tolerance(dtype) * max |logit|`` (the target's logits in ``dtype``),
    :func:`generate` with ``temperature=0`` takes the same token. Closer than that, the tree
    forward's rounding (other matrix shapes than a 1-token step) may pick the other one, and
    the outputs may differ from there on. float32 1e-4, float16 1e-2, bfloat16 2**-5: several
    times the differences measured between the two forwards."""
    if dtype not in _TIE_TOLERANCE:
        raise ValueError(f"dtype must be one of {sorted(map(str, _TIE_TOLERANCE))}, got {dtype}")
    return _TIE_TOLERANCE[dtype]


# --------------------------------------------------------------------------------------------
# Configuration and results
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeConfig:
    """The draft tree's shape, EAGLE's three numbers (defaults: EAGLE's 60 / 7 / 10).

    Attributes:
        total_tokens: tree size including the root (the last committed token), >= 1.
        depth: frontier steps after the root's (the tree reaches depth ``depth + 1``), >= 0.
        top_k: children per expanded node and frontier width, >= 1.

    The tree actually built may be smaller than ``total_tokens`` when depth and top-k cannot
    grow that many candidates: :meth:`size` tells.
    """

    total_tokens: int = 60
    depth: int = 7
    top_k: int = 10

    def __post_init__(self) -> None:
        for name, low in (("total_tokens", 1), ("depth", 0), ("top_k", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"TreeConfig.{name} must be an int >= {low}, got {value!r}")

    def shape(self, draft_vocab_size: int) -> "TreeShape":
        """The fixed sizes of the trees this config grows with a draft vocabulary this big:
        :class:`TreeShape` (``size``: nodes, root included; ``path - 1``: the deepest node)."""
        if not isinstance(draft_vocab_size, int) or draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size must be an int >= 1, got {draft_vocab_size!r}")
        keep = self.total_tokens - 1
        width = min(self.top_k, keep, draft_vocab_size)  # children per expanded node
        frontier, previous = [], width  # frontier widths of steps 1..depth
        if keep > 0:
            for _ in range(self.depth):
                f = min(self.top_k, keep, previous)
                frontier.append(f)
                previous = f * width
        candidates = width * (1 + sum(frontier)) if keep > 0 else 0
        kept = min(keep, candidates)
        # A root-to-leaf path has at most depth + 2 nodes, and no more than the tree has.
        return TreeShape(width=width, frontier=tuple(frontier), candidates=candidates, kept=kept,
                          size=1 + kept, expanded=sum(frontier), path=min(self.depth + 2, 1 + kept))

    def size(self, draft_vocab_size: int) -> int:
        """Nodes of the trees actually built (root included): ``total_tokens`` or fewer."""
        return self.shape(draft_vocab_size).size


@dataclass(frozen=True)
class TreeShape:
    """The fixed sizes of the trees a :class:`TreeConfig` grows (:meth:`TreeConfig.shape`)."""

    width: int  # children of each expanded node
    frontier: Tuple[int, ...]  # frontier width of each step after the root's
    candidates: int  # children created in all steps
    kept: int  # candidates kept in the tree
    size: int  # T: tree nodes, root included
    expanded: int  # tree nodes the draft runs on besides the root (its K/V slots per tree)
    path: int  # P: the longest accepted path, root included; one round emits at most this


@dataclass
class Stats:
    """What a generation did. Times in seconds; on CUDA they are device times measured with
    events (no synchronisation added), elsewhere host times.

    Attributes:
        batch: number of rows.
        rounds: verify rounds (one draft tree per row and one target forward each).
        forwards: target forwards: the prefill, then one per round.
        emitted: per row, tokens output (the prefill's first token included).
        row_rounds: per row, the rounds in which it was still generating.
        produced: tokens the rounds output, all rows (``sum(emitted) - batch``).
        cut: tokens the rounds produced past a row's budget or stop token, not output.
        accept_lengths: per round, per row, the tokens the round produced for it (accepted
            draft tokens + the target's next token, before any cut); 0 for a finished row.
        prefill_s: the prompt's target forward and the first token.
        draft_s, verify_s, accept_s: the rounds' steps (accept: acceptance, cache
            compaction, the result's read and bookkeeping; with CUDA graphs, the eager warm-up
            round before a capture counts as drafting).
        setup_s: buffers allocated for a new shape (0 when reused).
        capture_s: CUDA-graph capture (0 when the graphs were already captured, or off).
        total_s: the whole call, from its start to its last token (time spent by the
            caller between streamed chunks excluded).
        cuda_graphs: whether the rounds were replayed from CUDA graphs.
    """

    batch: int = 1
    rounds: int = 0
    forwards: int = 0
    emitted: List[int] = field(default_factory=list)
    row_rounds: List[int] = field(default_factory=list)
    produced: int = 0
    cut: int = 0
    accept_lengths: List[List[int]] = field(default_factory=list)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    accept_s: float = 0.0
    setup_s: float = 0.0
    capture_s: float = 0.0
    total_s: float = 0.0
    cuda_graphs: bool = False

    @property
    def mean_acceptance_length(self) -> Optional[float]:
        """Tokens output per row per round (accepted draft tokens + the target's token), over
        all rows; None when no round ran (the prefill's token alone ended every row)."""
        row_rounds = sum(self.row_rounds)
        return self.produced / row_rounds if row_rounds else None

    def row_acceptance_length(self, row: int) -> Optional[float]:
        """:attr:`mean_acceptance_length` of one row."""
        if not 0 <= row < self.batch:
            raise IndexError(f"row must be in [0, {self.batch}), got {row}")
        return (self.emitted[row] - 1) / self.row_rounds[row] if self.row_rounds[row] else None


@dataclass
class Chunk:
    """One step of :func:`stream`: the prefill (first chunk) or one round.

    Attributes:
        tokens: per row, the tokens this step output (empty for a row that has finished).
        done: per row, whether it has finished (budget met or a stop token output).
        stats: the generation's statistics so far (the same object in every chunk).
    """

    tokens: List[List[int]]
    done: List[bool]
    stats: Stats


@dataclass
class GenerateOutput:
    """The result of :func:`generate`.

    Attributes:
        tokens: int64 ``[B, max(lengths)]`` on the CPU, the new tokens of each row (the
            prompt not included), padded with -1 after ``lengths[b]``.
        lengths: int64 ``[B]``: new tokens of each row (stop token included).
        stats: :class:`Stats`.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    stats: Stats

    def tolist(self) -> List[List[int]]:
        """The new tokens of each row, as lists of ints."""
        return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths.tolist())]


# --------------------------------------------------------------------------------------------
# The target's cache: one prefix length per batch row
# --------------------------------------------------------------------------------------------


class _RowLayer(CacheLayerMixin):
    """One layer of a :class:`RowCache`: static ``[B, H, capacity, D]`` keys and values."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: "RowCache", capacity: int):
        super().__init__()
        self._owner = weakref.ref(owner)
        self.capacity = capacity

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> None:
        batch, heads = key_states.shape[:2]
        self.device, self.dtype = key_states.device, key_states.dtype
        self.keys = key_states.new_zeros(batch, heads, self.capacity, key_states.shape[-1])
        self.values = value_states.new_zeros(batch, value_states.shape[1], self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        owner = self._owner()
        batch, _, n, _ = key_states.shape
        slots = owner.write_start[:, None] + torch.arange(n, device=key_states.device)  # [B, n]
        for cache, new in ((self.keys, key_states), (self.values, value_states)):
            index = slots[:, None, :, None].expand(batch, new.shape[1], n, new.shape[3])
            cache.scatter_(2, index, new.to(cache.dtype))
        return self.keys, self.values

    def get_seq_length(self, *args, **kwargs) -> int:
        owner = self._owner()
        return owner.length_hint if owner is not None else 0

    def get_mask_sizes(self, *args, **kwargs) -> Tuple[int, int]:
        return self.capacity, 0

    def get_max_length(self) -> int:  # transformers >= 5.x late releases
        return self.capacity

    def get_max_cache_shape(self) -> int:  # transformers 5.0
        return self.capacity


class RowCache(Cache):
    """A transformers KV cache in which every batch row has its own length.

    Each layer holds static ``[B, H, capacity, D]`` keys and values; a forward writes row b's
    new K/V at slots ``write_start[b] ...`` (set :attr:`write_start`, an int64 ``[B]`` tensor
    on the model's device, before the forward). transformers' own caches write every row at
    one slot. Pass ``mask_offset=write_start`` (and ``tree_mask``) to a tree_attn model so the
    op reads row b's keys up to ``write_start[b] + T`` only. Sliding-window layers are
    full-length here (tree_attn applies the window itself). Used by :func:`generate`.
    """

    def __init__(self, num_layers: int, capacity: int, write_start: torch.Tensor):
        super().__init__(layers=[_RowLayer(self, capacity) for _ in range(num_layers)])
        self.capacity = capacity
        self.write_start = write_start
        self.length_hint = 0  # what get_seq_length reports (the longest row), for model code that asks

    def initialized_layers(self) -> List[_RowLayer]:
        return [layer for layer in self.layers if layer.is_initialized]


# --------------------------------------------------------------------------------------------
# The engine: static buffers and the steps of a round for one shape
# --------------------------------------------------------------------------------------------


def _causal_spec_layout(target) -> Tuple[Optional[Dict[str, int]], int]:
    """How the per-row causal masks reach the model: a dict {layer type: sliding window (0 =
    none)} for models with several layer types, else (None, the window of every layer)."""
    config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    layer_types = getattr(config, "layer_types", None)
    window = int(getattr(config, "sliding_window", None) or 0)
    if not layer_types:
        return None, window
    windows = {}
    for kind in layer_types:
        if kind == "full_attention":
            windows[kind] = 0
        elif kind == "sliding_attention":
            windows[kind] = window
        else:
            raise NotImplementedError(
                f"speculative decoding supports full and sliding-window attention layers, got a {kind!r} layer "
                f"(the target's layer_types: {sorted(set(layer_types))})")
    if len(windows) == 1:
        return None, next(iter(windows.values()))
    return windows, 0


def _sibling_trials(p: torch.Tensor, kid_tokens: torch.Tensor, is_kid: torch.Tensor, draws: torch.Tensor):
    """The rejection-sampling trials of one tree level, for every row at once.

    ``p`` [B, V] is the target's distribution at each row's current node, ``kid_tokens`` [B, W]
    its children's tokens in node order (``is_kid`` marks the real ones; siblings' tokens
    are distinct), ``draws`` [B, W] uniforms in [0, 1). Child j is tried after the earlier
    ones were rejected, each rejection having set p(x) = 0 and renormalised; so it is
    accepted with probability ``q_j / (q_j + q_{j+1} + ... + rest)`` (q = p at the children,
    rest = p's mass elsewhere), and the first success wins. Returns (success [B, W] bool,
    the residual [B, V]: p with every child's mass removed, unnormalised), the distribution
    of the next token when every child is rejected.
    """
    kid_mass = torch.where(is_kid, p.gather(1, kid_tokens), 0.0)
    covered = torch.zeros_like(p).scatter_add_(1, kid_tokens, is_kid.to(p.dtype)) > 0
    residual = p.masked_fill(covered, 0.0)
    mass_left = kid_mass.flip(-1).cumsum(-1).flip(-1) + residual.sum(-1, keepdim=True)
    accept = torch.where(mass_left > 0, kid_mass / mass_left, 0.0)
    return (draws < accept) & is_kid, residual


class _Engine:
    """Static buffers and the step functions of a round, for one (target, draft, batch size,
    capacity, tree shape). Tensors carried from round to round are updated in place (CUDA
    graphs replay on fixed addresses); a round's intermediate results are attributes that
    each step sets and the next one reads."""

    def __init__(self, target, draft: Eagle3Draft, batch: int, capacity: int, tree: TreeConfig,
                 device: torch.device):
        # The target is held weakly: engines are kept per target in a WeakKeyDictionary.
        self._target_ref = weakref.ref(target)
        self.draft, self.batch, self.capacity, self.tree = draft, batch, capacity, tree
        self.device = device
        config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
        self.num_layers = config.num_hidden_layers
        self.layer_ids = feature_layer_ids(self.num_layers, draft.config)
        self.shape = tree.shape(draft.config.draft_vocab_size)
        self.mask_windows, self.window = _causal_spec_layout(target)
        self.cache_arg = _hf_compat.cache_argument(target)
        # The prefill needs the logits of each row's last prompt token only; transformers'
        # logits_to_keep saves the [B, L, V] rest, except where it also cuts the hidden states
        # the draft reads (Gemma 4's KV-shared layers then run on the kept positions only).
        forward = getattr(target, "_orig_mod", target).forward
        self.keeps_logits = ("logits_to_keep" in inspect.signature(forward).parameters
                             and not getattr(config, "num_kv_shared_layers", 0))
        sh, B = self.shape, batch
        P = sh.path
        dcfg = draft.config
        self.draft_capacity = capacity + max(P, sh.expanded)
        dtype = draft.fc.weight.dtype
        self.draft_keys = torch.zeros(B, dcfg.num_key_value_heads, self.draft_capacity, dcfg.head_dim,
                                      dtype=dtype, device=device)
        self.draft_values = torch.zeros_like(self.draft_keys)
        self.target_ids = draft.target_ids().to(device)
        feature_size = 3 * dcfg.target_hidden_size
        feature_dtype = next(target.parameters()).dtype

        def zeros(*size, dtype=torch.int64):
            return torch.zeros(*size, dtype=dtype, device=device)

        # Carried from round to round (in place only).
        self.prefix = zeros(B)  # target tokens in the cache = draft entries after the commit
        self.pending_ids = zeros(B, P)  # next commit: the tokens the last round accepted + its next token
        self.pending_features = zeros(B, P, feature_size, dtype=feature_dtype)  # the accepted nodes' features
        self.pending_n = zeros(B)  # how many of them are real (0: a finished row)
        self.root = zeros(B)  # the next tree's root: the last token output
        self.emitted = zeros(B)
        self.budget = zeros(B)
        self.done = zeros(B, dtype=torch.bool)
        self.stop_ids = torch.full((8,), -1, dtype=torch.int64, device=device)
        self.generator = torch.Generator(device=device)
        self.commit_mask = torch.ones(P, P, dtype=torch.bool, device=device).tril()[None]
        # Per frontier step: its width, each node's own column in the ancestor rows (the tree's
        # draft cache slots), and those slots relative to the committed entries.
        self.frontier_constants, slot, columns = [], 0, max(sh.expanded, 1)
        for f in sh.frontier:
            own = torch.zeros(1, f, columns, dtype=torch.bool, device=device)
            own[0, torch.arange(f), slot + torch.arange(f)] = True
            self.frontier_constants.append((f, own, torch.arange(slot, slot + f, device=device)))
            slot += f
        self.cache = RowCache(self.num_layers, capacity, self.prefix)
        self.graphs: Dict[tuple, "torch.cuda.CUDAGraph"] = {}
        self.graph_keys: Optional[tuple] = None  # the settings the captured graphs are for
        self.graph_pool = None
        self.pending_capture: Optional[tuple] = None

    @property
    def target(self):
        return self._target_ref()

    # -- the draft ----------------------------------------------------------------------------

    def _draft_layer(self, ids, hidden, positions, slots, mask, offset):
        """The draft layer on ``[B, n]`` tokens: new K/V written at draft cache ``slots`` [B, n];
        each query sees the row's entries before ``offset`` [B] and the window ``mask``."""
        keys, values = self.draft_keys, self.draft_values

        def attend(q, k, v):
            batch, heads, n, dim = k.shape
            index = slots[:, None, :, None].expand(batch, heads, n, dim)
            keys.scatter_(2, index, k)
            values.scatter_(2, index, v)
            return tree_attention(q, keys, values, mask, offset)

        return self.draft.decoder(ids, hidden, positions, attend)

    def _draft_logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft log-probabilities over the DRAFT vocabulary, float32."""
        return torch.log_softmax(self.draft.draft_logits(hidden).float(), dim=-1)

    def commit(self, ids: torch.Tensor, features: torch.Tensor, count: torch.Tensor, start: torch.Tensor):
        """Run the draft on ``count[b]`` committed positions of each row (``ids`` [B, M] and the
        target ``features`` [B, M, F] before them, right-padded), written at draft slots
        ``start[b] ...``; returns the draft output at each row's last one, [B, H]."""
        B, M = ids.shape
        hidden = self.draft.fuse(features)
        steps = torch.arange(M, device=self.device)
        positions = start[:, None] + steps
        mask = self.commit_mask if M == self.commit_mask.shape[-1] else torch.ones(
            M, M, dtype=torch.bool, device=self.device).tril()[None]
        out = self._draft_layer(ids, hidden, positions, positions, mask, start)
        last = (count - 1).clamp(min=0)
        return out.gather(1, last[:, None, None].expand(B, 1, out.shape[-1]))[:, 0]

    def grow(self, root: torch.Tensor, root_hidden: torch.Tensor, committed: torch.Tensor):
        """EAGLE's dynamic tree for every row at once, with fixed shapes: tokens, parents [B, T].

        ``root`` [B] is the last committed token, ``root_hidden`` [B, H] the draft's output
        there, ``committed`` [B] the draft entries before the tree (the root's is the last)."""
        sh, B = self.shape, self.batch
        device = self.device
        if sh.kept == 0:
            return root[:, None].clone(), torch.full((B, 1), -1, dtype=torch.int64, device=device)
        w = sh.width
        log_probs, ids = self._draft_logprobs(root_hidden).topk(w, dim=-1)  # [B, w]
        cand_tokens, cand_scores = [self.target_ids[ids]], [log_probs]
        cand_parents = [torch.full((B, w), -1, dtype=torch.int64, device=device)]
        # The expanded nodes: 0 is the root, then each frontier's nodes in order; their draft
        # outputs and their ancestor-or-self rows over the tree's draft cache slots.
        node_hidden = root_hidden[:, None]
        node_ancestors = torch.zeros(B, 1, max(sh.expanded, 1), dtype=torch.bool, device=device)
        step_scores, step_tokens = log_probs, cand_tokens[0]
        step_first_candidate, step_parent_base, slot = 0, 0, 0
        num_candidates = w
        hidden_size = root_hidden.shape[-1]
        for step, (f, own, offsets) in enumerate(self.frontier_constants, start=1):
            # The next frontier: the step's best children, ties by creation order.
            picked = torch.sort(step_scores, dim=-1, descending=True, stable=True).indices[:, :f]  # [B, f]
            parent = step_parent_base + picked // w  # expanded-node index of each one's parent
            tokens = step_tokens.gather(1, picked)
            scores = step_scores.gather(1, picked)
            candidate = step_first_candidate + picked
            hidden = node_hidden.gather(1, parent[:, :, None].expand(B, f, hidden_size))
            # A node sees what its parent sees, and itself.
            ancestors = node_ancestors.gather(1, parent[:, :, None].expand(B, f, node_ancestors.shape[-1])) | own
            out = self._draft_layer(tokens, hidden, (committed - 1 + step)[:, None], committed[:, None] + offsets,
                                    ancestors[:, :, : slot + f], committed)
            node_hidden = torch.cat([node_hidden, out], dim=1)
            node_ancestors = torch.cat([node_ancestors, ancestors], dim=1)
            step_parent_base = 1 + slot
            slot += f
            child_log_probs, child_ids = self._draft_logprobs(out).topk(w, dim=-1)  # [B, f, w]
            step_scores = (scores[:, :, None] + child_log_probs).reshape(B, f * w)
            step_tokens = self.target_ids[child_ids].reshape(B, f * w)
            step_first_candidate = num_candidates
            num_candidates += f * w
            cand_tokens.append(step_tokens)
            cand_scores.append(step_scores)
            cand_parents.append(candidate.repeat_interleave(w, dim=1))
        all_tokens, all_scores, all_parents = (torch.cat(c, dim=1) for c in (cand_tokens, cand_scores, cand_parents))
        # Keep the best candidates overall (ties by creation order: a parent, created first and
        # scored at least as high, is always kept before its children), in creation order.
        kept = torch.sort(all_scores, dim=-1, descending=True, stable=True).indices[:, : sh.kept]
        kept = torch.sort(kept, dim=-1).values
        tree_index = torch.full((B, sh.candidates), -1, dtype=torch.int64, device=device)
        tree_index.scatter_(1, kept, torch.arange(1, sh.kept + 1, device=device).expand(B, sh.kept).contiguous())
        parent_candidate = all_parents.gather(1, kept)
        parents = torch.where(parent_candidate >= 0, tree_index.gather(1, parent_candidate.clamp(min=0)), 0)
        minus_one = torch.full((B, 1), -1, dtype=torch.int64, device=device)
        return torch.cat([root[:, None], all_tokens.gather(1, kept)], dim=1), torch.cat([minus_one, parents], dim=1)

    def draft_step(self) -> None:
        """Step 1: commit the last round's tokens to the draft, grow every row's tree."""
        start = self.prefix - self.pending_n
        root_hidden = self.commit(self.pending_ids, self.pending_features, self.pending_n, start)
        tokens, parents = self.grow(self.root, root_hidden, self.prefix)
        self.tree_tokens, self.tree_parents = tokens, parents
        self.tree_mask = _ancestor_mask(parents)  # [B, T, T]
        self.tree_depth = _mask_depths(self.tree_mask)  # [B, T]

    # -- the target ---------------------------------------------------------------------------

    def _masks(self, query_end: torch.Tensor):
        """The prepared causal masks (hf's causal spec, per row): int64 [B, 1, 1, 2] whose
        entries are the key index after each row's last query and the layer's window."""
        def spec(window):
            columns = [None, None]
            columns[_SPEC_QUERY_END] = query_end
            columns[_SPEC_WINDOW] = torch.full_like(query_end, window)
            return torch.stack(columns, dim=-1).view(-1, 1, 1, 2)

        if self.mask_windows is None:
            return spec(self.window)
        return {kind: spec(window) for kind, window in self.mask_windows.items()}

    def _forward(self, ids, positions, query_end, **kwargs):
        return self.target(input_ids=ids, position_ids=positions, attention_mask=self._masks(query_end),
                           use_cache=True, output_hidden_states=True, **{self.cache_arg: self.cache}, **kwargs)

    def verify_step(self) -> None:
        """Step 2: one target forward over every row's tree, written at the row's prefix."""
        T = self.tree_tokens.shape[1]
        self.cache.write_start = self.prefix
        out = self._forward(self.tree_tokens, self.prefix[:, None] + self.tree_depth, self.prefix + T,
                           tree_mask=self.tree_mask, mask_offset=self.prefix)
        self.logits = out.logits
        self.features = capture_target_features(out.hidden_states, self.layer_ids)

    # -- acceptance ---------------------------------------------------------------------------

    def _accept_greedy(self):
        """The longest path whose every token is the target's argmax at its parent: path
        nodes [B, P] (root first, padded with 0), lengths [B], the target's next token [B]."""
        best = self.logits.argmax(-1)  # [B, T]
        parents, mask, depth = self.tree_parents, self.tree_mask, self.tree_depth
        match = (self.tree_tokens == best.gather(1, parents.clamp(min=0))) | (parents < 0)
        agreed = ~(mask & ~match[:, None, :]).any(-1)  # every ancestor-or-self matches
        last = torch.where(agreed, depth, -1).argmax(-1)  # deepest (unique: siblings differ)
        on_path = mask.gather(1, last[:, None, None].expand(-1, 1, mask.shape[-1]))[:, 0]  # [B, T]
        return self._path_of(on_path), depth.gather(1, last[:, None])[:, 0] + 1, best.gather(1, last[:, None])[:, 0]

    def _path_of(self, on_path: torch.Tensor) -> torch.Tensor:
        # Ancestors have increasing node indices from the root down: the k-th marked node is
        # the one at depth k.
        P = self.shape.path
        B, T = on_path.shape
        slot = torch.where(on_path, on_path.cumsum(-1) - 1, P)
        nodes = torch.arange(T, device=self.device).expand(B, T)
        out = torch.zeros(B, P + 1, dtype=torch.int64, device=self.device)
        out.scatter_(1, slot, torch.where(on_path, nodes, 0))
        return out[:, :P]

    def _children(self) -> torch.Tensor:
        """[B, T, W]: each node's children in node order, -1 padded (W = children per node)."""
        B, T = self.tree_parents.shape
        W = max(self.shape.width, 1)
        parents = self.tree_parents
        is_child = parents[:, :, None] == torch.arange(T, device=self.device)  # [B, child, parent]
        rank = (is_child.cumsum(1) - 1).gather(2, parents.clamp(min=0)[:, :, None])[:, :, 0]  # among siblings
        flat = torch.where(parents >= 0, parents * W + rank, T * W)  # the root goes to a spare slot
        table = torch.full((B, T * W + 1), -1, dtype=torch.int64, device=self.device)
        table.scatter_(1, flat, torch.arange(T, device=self.device).expand(B, T).contiguous())
        return table[:, : T * W].view(B, T, W)

    def _sample(self, probs: torch.Tensor) -> torch.Tensor:
        """One draw per row from (unnormalised, non-negative) ``probs`` [B, V], by inverse CDF
        with u in (0, 1]: a token of probability 0 is never drawn."""
        cdf = probs.cumsum(-1)
        u = 1.0 - torch.rand(probs.shape[0], 1, device=probs.device, generator=self.generator)
        return (cdf < u * cdf[:, -1:]).sum(-1).clamp(max=probs.shape[-1] - 1)

    def _accept_sampling(self, temperature: float, top_p: float):
        """Multi-candidate rejection sampling with deterministic children (see the module
        docstring), one tree level per iteration for every row at once."""
        B, T = self.tree_parents.shape
        P = self.shape.path
        device = self.device
        probs = sampling_probs(self.logits, temperature, top_p)  # [B, T, V]
        children = self._children()  # [B, T, W]
        V = probs.shape[-1]
        nodes = torch.arange(T, device=device)
        node = torch.zeros(B, 1, dtype=torch.int64, device=device)  # each row's current node
        walking = torch.ones(B, dtype=torch.bool, device=device)
        next_token = torch.zeros(B, dtype=torch.int64, device=device)
        on_path = nodes == 0
        on_path = on_path.expand(B, T).contiguous()
        length = torch.ones(B, dtype=torch.int64, device=device)
        for _ in range(P):  # gathers, not indexing: nothing here reads a tensor on the host
            p = probs.gather(1, node[:, :, None].expand(B, 1, V))[:, 0]  # [B, V]
            kids = children.gather(1, node[:, :, None].expand(B, 1, children.shape[-1]))[:, 0]  # [B, W]
            is_kid = kids >= 0
            kid_tokens = self.tree_tokens.gather(1, kids.clamp(min=0))
            draws = torch.rand(kids.shape, device=device, generator=self.generator)
            success, residual = _sibling_trials(p, kid_tokens, is_kid, draws)
            moved = walking & success.any(-1)
            chosen = kids.gather(1, success.to(torch.int8).argmax(-1, keepdim=True))
            # All rejected (or a leaf): the next token comes from what is left of p (if rounding
            # left nothing, from p itself).
            residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
            stops = walking & ~moved
            next_token = torch.where(stops, self._sample(residual), next_token)
            node = torch.where(moved[:, None], chosen, node)
            on_path = on_path | ((nodes == node) & moved[:, None])
            length += moved.to(torch.int64)
            walking = moved
        return self._path_of(on_path), length, next_token

    def accept_step(self, temperature: float, top_p: float) -> None:
        """Steps 3 and 4: accept, count what is output against budget and stop tokens, move the
        accepted K/V after each row's prefix, queue the accepted tokens for the draft, and pack
        the round's result for the one host read."""
        if temperature > 0:
            path, length, next_token = self._accept_sampling(temperature, top_p)
        else:
            path, length, next_token = self._accept_greedy()
        B, P = path.shape
        steps = torch.arange(P, device=self.device)
        along = self.tree_tokens.gather(1, path)  # tokens of the path's nodes
        new = torch.cat([along[:, 1:], torch.zeros_like(along[:, :1])], dim=1)
        new.scatter_(1, (length - 1)[:, None], next_token[:, None])  # accepted draft tokens, then next

        real = steps < length[:, None]
        is_stop = (new[:, :, None] == self.stop_ids).any(-1) & real
        stop_at = torch.where(is_stop, steps, P).min(-1).values
        emit = torch.minimum(torch.minimum(length, stop_at + 1), self.budget - self.emitted)
        emit = torch.where(self.done, 0, emit)
        emitted = self.emitted + emit
        done = self.done | (emitted >= self.budget) | (stop_at < emit)
        advance = torch.where(done, 0, length)

        # Compaction: node path[j] of row b moves from slot prefix + path[j] to prefix + j (the
        # gather copies first, so overlapping slots are safe; slots past the accepted length
        # get junk beyond the new prefix, which the next tree overwrites).
        source = self.prefix[:, None] + path
        target = self.prefix[:, None] + steps
        for layer in self.cache.initialized_layers():
            for buffer in (layer.keys, layer.values):
                size = (B, buffer.shape[1], P, buffer.shape[3])
                moved = buffer.gather(2, source[:, None, :, None].expand(size))
                buffer.scatter_(2, target[:, None, :, None].expand(size), moved)

        features = self.features.gather(1, path[:, :, None].expand(B, P, self.features.shape[-1]))
        self.pending_ids.copy_(new)
        self.pending_features.copy_(features)
        self.pending_n.copy_(advance)
        self.root.copy_(next_token)
        self.prefix.add_(advance)
        self.emitted.copy_(emitted)
        self.done.copy_(done)
        self.result = torch.cat([emit[:, None], length[:, None], done[:, None].to(torch.int64), new], dim=1)

    # -- prefill ------------------------------------------------------------------------------

    def prefill(self, rows: List[List[int]], temperature: float, top_p: float) -> torch.Tensor:
        """The prompts' target forward (right-padded, each row's K/V at slots 0 ...), the first
        token of every row, and the draft commit of the prompts; sets up the first round.
        Returns the first tokens, int64 [B] on the device."""
        B, device = self.batch, self.device
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64, device=device)
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int64, device=device)
        zero = torch.zeros(B, dtype=torch.int64, device=device)
        self.cache.write_start = zero
        self.cache.length_hint = width
        positions = torch.arange(width, device=device).expand(B, width)
        keep = width - min(len(r) for r in rows) + 1  # the last positions, every row's last token among them
        extra = {"logits_to_keep": keep} if self.keeps_logits else {}
        out = self._forward(ids, positions, torch.full((B,), width, dtype=torch.int64, device=device), **extra)
        last = (lengths - 1)[:, None]
        kept = last - (width - out.logits.shape[1])  # index among the logits returned
        logits = out.logits.gather(1, kept[:, :, None].expand(B, 1, out.logits.shape[-1]))[:, 0]
        if temperature > 0:
            first = self._sample(sampling_probs(logits, temperature, top_p))
        else:
            first = logits.argmax(-1)
        features = capture_target_features(out.hidden_states, self.layer_ids)  # [B, width, F]
        if width > 1:
            # Draft entry t pairs the target's feature at position t with the token at t + 1: all
            # but the last prompt position now, the last one (with the first token) in round 1.
            self.commit(ids[:, 1:], features[:, :-1], lengths - 1, zero)
        self.pending_ids.zero_()
        self.pending_ids[:, 0] = first
        self.pending_features.zero_()
        self.pending_features[:, 0] = features.gather(1, last[:, :, None].expand(B, 1, features.shape[-1]))[:, 0]
        self.pending_n.fill_(1)
        self.prefix.copy_(lengths)
        self.root.copy_(first)
        self.emitted.fill_(1)
        self.done.copy_((self.budget <= 1) | (first[:, None] == self.stop_ids).any(-1))
        return first

    def begin(self, max_new_tokens: int, stop: Sequence[int], seed: int) -> None:
        """Per call: the budget, the stop tokens and the sampling generator's seed."""
        self.budget.fill_(max_new_tokens)
        if len(stop) > self.stop_ids.numel():
            size = 1 << (len(stop) - 1).bit_length()
            self.stop_ids = torch.full((size,), -1, dtype=torch.int64, device=self.device)
            self.graphs, self.graph_keys = {}, None  # they read the old buffer
        values = list(stop) + [-1] * (self.stop_ids.numel() - len(stop))
        self.stop_ids.copy_(torch.tensor(values, dtype=torch.int64))
        self.generator.manual_seed(seed)

    # -- rounds: eager or CUDA-graph replayed ---------------------------------------------------

    def round(self, temperature: float, top_p: float, use_graphs: bool, timer: "_Timer") -> None:
        """Run one round: draft, verify, accept. With ``use_graphs``, replay the captured graphs,
        or (none captured for these settings yet) run a warm-up round eagerly on a side stream
        and ask for a capture after its read (:meth:`capture`)."""
        keys = (("draft",), ("verify",), ("accept", temperature, top_p, self.stop_ids.numel()))
        if use_graphs and self.graph_keys == keys:
            for key in keys:
                self.graphs[key].replay()
                timer.mark(key[0])
            return
        steps = (self.draft_step, self.verify_step, lambda: self.accept_step(temperature, top_p))
        if not use_graphs:
            for key, run in zip(keys, steps):
                run()
                timer.mark(key[0])
            return
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for run in steps:
                run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        for key in keys:  # the warm-up round's time is counted as drafting
            timer.mark(key[0])
        self.pending_capture = keys

    def capture(self, temperature: float, top_p: float) -> float:
        """Capture the round's three steps, after a warm-up round whose result has been read:
        the draft, the verify forward and the acceptance, each in its own graph, in order and
        in one memory pool (each step reads what the one before it left in the pool). All
        three are captured anew whenever one is missing, so that they share their buffers.
        One synchronisation for the three (``torch.cuda.graph`` would add a synchronisation,
        a garbage collection and an emptied allocator cache per graph: cold-start time).
        Returns the seconds it took."""
        keys, self.pending_capture = self.pending_capture, None
        start = time.perf_counter()
        self.graphs, self.graph_keys = {}, None  # the old graphs (and their pool) go first
        self.graph_pool = torch.cuda.graph_pool_handle()
        runs = {"draft": self.draft_step, "verify": self.verify_step,
                "accept": lambda: self.accept_step(temperature, top_p)}
        torch.cuda.synchronize(self.device)
        side = torch.cuda.Stream(device=self.device)  # capture cannot run on the default stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for key in keys:
                graph = torch.cuda.CUDAGraph()
                if key[0] == "accept" and temperature > 0:
                    graph.register_generator_state(self.generator)
                graph.capture_begin(pool=self.graph_pool)
                try:
                    runs[key[0]]()
                except BaseException:
                    try:
                        graph.capture_end()
                    except Exception:  # noqa: BLE001  (the capture's own error is the one to report)
                        pass
                    raise
                graph.capture_end()
                self.graphs[key] = graph
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.graph_keys = keys
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - start


class _Timer:
    """Step times of a round: CUDA events on CUDA (no synchronisation until the round's one
    read), host clocks elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.totals = {"draft": 0.0, "verify": 0.0, "accept": 0.0}
        if self.cuda:
            self.events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]

    def start(self) -> None:
        self.order = []
        if self.cuda:
            self.events[0].record()
        else:
            self.last = time.perf_counter()

    def mark(self, step: str) -> None:
        self.order.append(step)
        if self.cuda:
            self.events[len(self.order)].record()
        else:
            if self.device.type == "mps":  # asynchronous too, and without graphs: time it here
                torch.mps.synchronize()
            now = time.perf_counter()
            self.totals[step] += now - self.last
            self.last = now

    def finish(self) -> None:
        """After the round's read (the device has finished): add the event intervals."""
        if self.cuda:
            for i, step in enumerate(self.order):
                self.totals[step] += self.events[i].elapsed_time(self.events[i + 1]) / 1000.0


# One engine per target model (the latest shape asked for), so that repeated calls reuse its
# buffers and CUDA graphs. release() frees it.
_ENGINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_CAPACITY_STEP = 32


def release(target=None) -> None:
    """Free the buffers and CUDA graphs kept for ``target`` (every target when None)."""
    if target is None:
        _ENGINES.clear()
    else:
        _ENGINES.pop(target, None)


def _engine_for(target, draft, batch, capacity, tree, device) -> Tuple[_Engine, bool]:
    engine = _ENGINES.get(target)
    if (engine is not None and engine.draft is draft and engine.batch == batch and engine.tree == tree
            and engine.capacity >= capacity and engine.device == device
            and next(target.parameters()).dtype == engine.pending_features.dtype):
        return engine, False
    _ENGINES.pop(target, None)
    del engine
    capacity = -(-capacity // _CAPACITY_STEP) * _CAPACITY_STEP
    engine = _Engine(target, draft, batch, capacity, tree, device)
    _ENGINES[target] = engine
    return engine, True


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
        drafter: its EAGLE-3 draft (:class:`~torch_tree_attn.eagle3.Eagle3Draft`, or an
            :class:`~torch_tree_attn.eagle3.Eagle3Drafter`, whose draft is used), on the
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
