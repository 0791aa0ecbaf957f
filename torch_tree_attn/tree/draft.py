"""The draft tree and EAGLE-2/3 dynamic drafting (build_dynamic_tree)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Optional, Union

import torch

from .structure import _ancestor_mask, _check_parents, _mask_depths, _mask_offset_tensor, _retrieve_indices


# ----------------------------------------------------------------------------------------
# The draft tree and EAGLE-2/3 dynamic drafting
# ----------------------------------------------------------------------------------------

@dataclass(eq=False)
class DraftTree:
    """A draft tree: ``tokens`` int64 ``[T]`` (node 0 is the root, the last committed
    token), ``parents`` int64 ``[T]``, ``scores`` float32 ``[T]`` (cumulative draft
    log-probability of the path to each node, 0 at the root). Derived structure is
    computed once, on the tree's device, when first asked for."""

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor

    def __post_init__(self) -> None:
        _check_parents(self.parents, "DraftTree.parents")
        if self.parents.dim() != 1:
            raise ValueError(f"DraftTree.parents must be [T], got shape {tuple(self.parents.shape)}")
        for name in ("tokens", "scores"):
            value = getattr(self, name)
            if value.shape != self.parents.shape:
                raise ValueError(
                    f"DraftTree.{name} must have the shape of parents {tuple(self.parents.shape)}, "
                    f"got {tuple(value.shape)}"
                )

    @classmethod
    def _trusted(cls, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor) -> "DraftTree":
        # For trees built here, valid by construction: skips the host reads of validation.
        tree = cls.__new__(cls)
        tree.tokens, tree.parents, tree.scores = tokens, parents, scores
        return tree

    def __len__(self) -> int:
        return self.parents.shape[0]

    @cached_property
    def mask(self) -> torch.Tensor:
        """Ancestor-or-self mask, bool ``[T, T]``."""
        return _ancestor_mask(self.parents)

    @cached_property
    def depths(self) -> torch.Tensor:
        """int64 ``[T]``, root 0."""
        return _mask_depths(self.mask)

    @cached_property
    def retrieve(self) -> torch.Tensor:
        """Root-to-leaf paths, int64 ``[L, max_depth + 1]`` padded with -1."""
        return _retrieve_indices(self.parents)

    @cached_property
    def children(self) -> torch.Tensor:
        """int64 ``[T, C]``: the children of each node in node order, padded with -1
        (C = the largest number of children, at least 1)."""
        T = len(self)
        device = self.parents.device
        child = torch.arange(1, T, device=device)
        parent = self.parents[1:]
        counts = torch.bincount(parent, minlength=T)
        width = max(int(counts.max()) if T > 1 else 0, 1)
        # Children of one parent are contiguous after a stable sort by parent, in node
        # order; a child's rank among its siblings is its offset from the group start.
        order = torch.sort(parent, stable=True).indices
        group_start = counts.cumsum(0) - counts
        rank = torch.empty_like(order)
        rank[order] = torch.arange(T - 1, device=device) - group_start[parent[order]]
        table = torch.full((T, width), -1, dtype=torch.int64, device=device)
        table[parent, rank] = child
        return table

    @cached_property
    def sibling_trials(self) -> torch.Tensor:
        """bool ``[T, C]`` over ``children``: True at the first occurrence of each distinct
        child token, the children that sampling verification tries."""
        children = self.children
        is_kid = children >= 0
        kid_tokens = self.tokens[children.clamp(min=0)]
        rank = torch.arange(children.shape[1], device=children.device)
        repeated = (
            (kid_tokens[:, :, None] == kid_tokens[:, None, :]) & is_kid[:, None, :] & (rank < rank[:, None])
        ).any(-1)
        return is_kid & ~repeated

    def position_ids(self, mask_offset: Union[int, torch.Tensor]) -> torch.Tensor:
        """int64 ``[1, T]`` (``[B, T]`` for B prefix lengths): ``mask_offset + depth``."""
        lens = _mask_offset_tensor(mask_offset, None, self.parents.device)
        return self.depths[None] + lens[:, None]


@dataclass(eq=False)
class ExpandStep:
    """One draft forward of ``build_dynamic_tree``: the frontier to run the draft on.

    Every node ever passed to ``expand`` is an *expanded node*, numbered in call order
    (the root is 0, then each frontier's nodes in order); a draft keeping its own KV
    cache across the steps of one tree holds exactly these nodes in this order.

    Attributes:
        tokens: int64 ``[n]``, the frontier's tokens (target vocabulary ids).
        parents_in_tree: int64 ``[n]``, the expanded-node index of each node's parent,
            -1 for the root.
        depth: depth of the frontier (0 for the root step).
        ancestor_mask: bool ``[n, N + n]`` over all expanded nodes so far (the N of
            previous steps, then these n): ancestor-or-self, True = attend.
        position_offsets: int64 ``[n]``, each node's depth: its position is the position
            of the root plus this offset.
    """

    tokens: torch.Tensor
    parents_in_tree: torch.Tensor
    depth: int
    ancestor_mask: torch.Tensor
    position_offsets: torch.Tensor


def build_dynamic_tree(
    root_token: Union[int, torch.Tensor],
    expand: Callable[[ExpandStep], torch.Tensor],
    total_tokens: int = 60,
    depth: int = 7,
    top_k: int = 10,
    *,
    device: Optional[Union[str, torch.device]] = None,
) -> DraftTree:
    """The EAGLE-2/EAGLE-3 dynamic draft tree.

    The root is expanded first: ``expand`` returns log-probs ``[n, V]`` of the next token
    after each frontier node, each node's ``top_k`` best tokens become candidate
    children scored by cumulative log-probability, and the ``top_k`` best children of a
    step form the next frontier. After the root step, ``depth`` frontier steps follow
    (EAGLE's loop), so candidates reach depth ``depth + 1`` and ``expand`` is called at
    most ``depth + 1`` times. The tree keeps the root and the ``total_tokens - 1`` best
    candidates overall, in creation order, so parents precede children.

    Ranking is by score, then creation order: a child's score never exceeds its
    parent's (log-probs are <= 0) and the parent was created first, so a kept node's
    parent is always kept, ties included. Drafting stops early once no descendant of
    the frontier can still make the cut (every frontier node already has
    ``total_tokens - 1`` candidates scored at least as high), which leaves the result
    unchanged; per-node and per-frontier widths are capped at ``total_tokens - 1`` for
    the same reason.

    Args:
        root_token: the root's token id (the last committed token).
        expand: ``expand(step: ExpandStep) -> Tensor [n, V]`` of log-probabilities
            (e.g. ``log_softmax`` of the draft's logits, mapped to target token ids).
        total_tokens: tree size including the root (EAGLE's ``total_token``).
        depth: frontier steps after the root step (EAGLE's ``depth``).
        top_k: children per expanded node and frontier width (EAGLE's ``top_k``).
        device: where the tree's bookkeeping lives before ``expand`` first answers
            (default: ``root_token``'s device, else CPU); the tree ends up on the device
            of the log-probs.
    """
    for name, value, low in (("total_tokens", total_tokens, 1), ("depth", depth, 0), ("top_k", top_k, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if isinstance(root_token, torch.Tensor):
        if root_token.numel() != 1:
            raise ValueError(f"root_token must hold one token id, got shape {tuple(root_token.shape)}")
        device = root_token.device if device is None else torch.device(device)
        root = root_token.reshape(1).to(device=device, dtype=torch.int64)
    else:
        device = torch.device("cpu") if device is None else torch.device(device)
        root = torch.tensor([int(root_token)], dtype=torch.int64, device=device)

    keep = total_tokens - 1  # draft nodes kept besides the root
    if keep == 0:
        zero = torch.zeros(1, dtype=torch.float32, device=device)
        return DraftTree._trusted(root, torch.full((1,), -1, dtype=torch.int64, device=device), zero)

    # The current frontier: tokens, scores, candidate ids (-1 = root), expanded-node ids
    # of their parents, and the expanded-node mask rows of the frontier.
    frontier_tokens = root
    frontier_scores = torch.zeros(1, dtype=torch.float32, device=device)
    frontier_candidate = torch.full((1,), -1, dtype=torch.int64, device=device)
    frontier_parent_expanded = torch.full((1,), -1, dtype=torch.int64, device=device)
    frontier_mask = torch.ones((1, 1), dtype=torch.bool, device=device)
    num_expanded = 0

    cand_tokens, cand_parent, cand_scores = [], [], []  # per step, in creation order
    num_candidates = 0

    for step_depth in range(depth + 1):
        n = frontier_tokens.shape[0]
        step = ExpandStep(
            tokens=frontier_tokens,
            parents_in_tree=frontier_parent_expanded,
            depth=step_depth,
            ancestor_mask=frontier_mask,
            position_offsets=torch.full((n,), step_depth, dtype=torch.int64, device=device),
        )
        log_probs = expand(step)
        if not isinstance(log_probs, torch.Tensor) or log_probs.dim() != 2 or log_probs.shape[0] != n:
            shape = tuple(log_probs.shape) if isinstance(log_probs, torch.Tensor) else type(log_probs).__name__
            raise ValueError(f"expand must return log-probs [n={n}, V], got {shape} at depth {step_depth}")
        if step_depth == 0:
            # The draft decides where the bookkeeping lives.
            device = log_probs.device
            frontier_tokens, frontier_scores, frontier_candidate, frontier_parent_expanded, frontier_mask = (
                t.to(device) for t in (frontier_tokens, frontier_scores, frontier_candidate,
                                       frontier_parent_expanded, frontier_mask))
        else:
            log_probs = log_probs.to(device)
        frontier_expanded = torch.arange(num_expanded, num_expanded + n, device=device)
        num_expanded += n

        # Children: each frontier node's best tokens, node-major then by rank, which is
        # also their creation order.
        width = min(top_k, keep, log_probs.shape[1])
        child_log_probs, child_tokens = log_probs.float().topk(width, dim=-1)
        child_scores = (frontier_scores[:, None] + child_log_probs).reshape(-1)
        cand_tokens.append(child_tokens.reshape(-1))
        cand_scores.append(child_scores)
        cand_parent.append(frontier_candidate.repeat_interleave(width))
        first_new = num_candidates
        num_candidates += child_scores.shape[0]
        if step_depth == depth:
            break

        # Next frontier: the best children of this step (stable: ties by creation order).
        frontier_width = min(top_k, keep, child_scores.shape[0])
        picked = torch.sort(child_scores, descending=True, stable=True).indices[:frontier_width]
        best_score = child_scores[picked[0]]
        # If the best frontier node already has `keep` candidates scored at least as high,
        # no descendant of any frontier node can rank among the kept ones.
        all_scores = torch.cat(cand_scores)
        if int((all_scores >= best_score).sum()) >= keep:
            break

        parent_row = picked // width
        parent_expanded = frontier_expanded[parent_row]
        frontier_tokens = cand_tokens[-1][picked]
        frontier_scores = child_scores[picked]
        frontier_candidate = first_new + picked
        frontier_parent_expanded = parent_expanded
        # A new node sees what its parent sees (the parent's row covers every node
        # expanded so far, the parent included) plus itself.
        parent_rows = frontier_mask[parent_row]
        frontier_mask = torch.cat(
            [parent_rows, torch.eye(frontier_width, dtype=torch.bool, device=device)], dim=1
        )

    all_tokens = torch.cat(cand_tokens)
    all_scores = torch.cat(cand_scores)
    all_parents = torch.cat(cand_parent)
    kept = torch.sort(all_scores, descending=True, stable=True).indices[:keep]
    kept = torch.sort(kept).values  # creation order: parents before children

    tree_index = torch.full((num_candidates,), -1, dtype=torch.int64, device=device)
    tree_index[kept] = torch.arange(1, kept.shape[0] + 1, device=device)
    parent_candidate = all_parents[kept]
    tree_parents = torch.where(parent_candidate >= 0, tree_index[parent_candidate.clamp(min=0)], 0)
    if bool((tree_parents < 0).any()):
        raise ValueError(
            "a kept draft node's parent was not kept: expand must return log-probabilities "
            "(<= 0), so that a child never outscores its parent"
        )
    minus_one = torch.full((1,), -1, dtype=torch.int64, device=device)
    zero = torch.zeros(1, dtype=torch.float32, device=device)
    return DraftTree._trusted(
        tokens=torch.cat([root.to(device), all_tokens[kept]]),
        parents=torch.cat([minus_one, tree_parents]),
        scores=torch.cat([zero, all_scores[kept]]),
    )
