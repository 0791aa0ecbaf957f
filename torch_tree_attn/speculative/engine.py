"""The engine: static buffers and the steps of a round for one shape (draft, verify, accept,
compact), captured in CUDA graphs on CUDA."""
from __future__ import annotations

import inspect
import time
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..hf import compat
from ..hf.attention import _SPEC_QUERY_END, _SPEC_WINDOW
from ..ops import tree_attention
from ..tree.accept import sampling_probs
from ..tree.structure import _ancestor_mask, _mask_depths
from .config import TreeConfig
from .eagle3 import Eagle3Draft, capture_target_features, feature_layer_ids
from .row_cache import RowCache


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
        self.cache_arg = compat.cache_argument(target)
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
