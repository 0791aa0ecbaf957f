"""Draft trees for speculative decoding: structure, EAGLE-2/3 dynamic drafting and
verification. Plain torch: nothing here knows transformers (compacting a transformers KV
cache after verification is :func:`torch_tree_attn.hf.compact_kv_cache`).

A tree is a ``parents`` int64 tensor ``[T]`` (or ``[B, T]`` for a batch of trees padded
to a common T): ``parents[0] == -1`` is the root and ``parents[i] < i`` for every other
node, so parents always come before their children. Node ``i`` of a tree being verified
sits in the KV cache at slot ``mask_offset + i`` and at sequence position
``mask_offset + depth(i)``; ``mask_offset`` (the prefix length, the op's argument of the
same name) is the number of committed tokens before the tree.

Everything that runs once per decoding step is tensor code on the tree's device: loops
run over tree depth levels (at most a handful) or over a fixed ``ceil(log2 T)`` rounds,
never over nodes. Host synchronisations happen only where a result's shape or a decision
depends on data (the number of leaves, the accepted length, whether drafting can stop).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Optional, Sequence, Tuple, Union

import torch

__all__ = [
    "ancestor_mask",
    "node_depths",
    "position_ids",
    "retrieve_indices",
    "leaf_mask",
    "pad_trees",
    "dense_tree_mask",
    "DraftTree",
    "ExpandStep",
    "build_dynamic_tree",
    "verify_greedy",
    "verify_sampling",
    "sampling_probs",
]


# ----------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------

def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


def _check_parents(parents: torch.Tensor, name: str = "parents") -> None:
    """Raise a clear error unless ``parents`` is a valid (padded) forest of trees.

    Accepted: int64 ``[T]`` or ``[B, T]`` with T >= 1, entry 0 of each row == -1, and
    ``-1 <= parents[..., i] < i``. Extra -1 entries are roots of their own (the padding
    nodes of ``pad_trees``). The value checks read the tensor on the host, so they are
    skipped while torch.compile traces.
    """
    if not isinstance(parents, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(parents).__name__}")
    if parents.dtype != torch.int64:
        raise TypeError(f"{name} must be int64, got {parents.dtype}")
    if parents.dim() not in (1, 2) or parents.shape[-1] == 0:
        raise ValueError(f"{name} must have shape [T] or [B, T] with T >= 1, got {tuple(parents.shape)}")
    if _is_compiling():
        return
    rows = parents.reshape(-1, parents.shape[-1])
    if bool((rows[:, 0] != -1).any()):
        raise ValueError(f"{name}[..., 0] must be -1 (the root), got {rows[:, 0].tolist()}")
    index = torch.arange(rows.shape[-1], device=rows.device)
    bad = (rows < -1) | (rows >= index)
    if bool(bad.any()):
        b, i = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"{name} must satisfy -1 <= parents[i] < i (parents before children); "
            f"row {b}, node {i} has parent {int(rows[b, i])}"
        )


# ----------------------------------------------------------------------------------------
# Structure of a tree (single [T] or batched [B, T])
# ----------------------------------------------------------------------------------------

def _ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    # Pointer jumping: reach[i] holds the ancestors of i within `span` hops (and i itself),
    # hop[i] the ancestor exactly `span` hops up (roots point at themselves). Each round
    # doubles the span, so ceil(log2(T - 1)) rounds of [T, T] row gathers cover the
    # longest possible chain; the round count depends only on T, not on the data.
    T = parents.shape[-1]
    index = torch.arange(T, device=parents.device)
    hop = torch.where(parents >= 0, parents, index)
    reach = (index[:, None] == index) | (hop[..., :, None] == index)
    span = 1
    while span < T - 1:
        rows = hop[..., :, None].expand(reach.shape)
        reach = reach | reach.gather(-2, rows)
        hop = hop.gather(-1, hop)
        span *= 2
    return reach


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """Ancestor-or-self mask, bool ``[T, T]`` or ``[B, T, T]``.

    ``mask[..., i, j]`` is True when node j is node i or one of its ancestors: the keys
    query i may attend to inside the tree.
    """
    _check_parents(parents)
    return _ancestor_mask(parents)


def _mask_depths(mask: torch.Tensor) -> torch.Tensor:
    # Depth from an ancestor-or-self mask: a node's ancestors-or-self, less itself.
    return mask.sum(-1) - 1


def _node_depths(parents: torch.Tensor) -> torch.Tensor:
    return _mask_depths(_ancestor_mask(parents))


def node_depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of every node, int64 ``[T]`` or ``[B, T]``; roots have depth 0."""
    _check_parents(parents)
    return _node_depths(parents)


def _mask_offset_tensor(
    mask_offset, batch: Optional[int], device, name: str = "mask_offset", check_values: bool = True
) -> torch.Tensor:
    """The one validator of prefix lengths (``mask_offset``: the cache slot of each batch
    row's tree node 0, as the op takes it), for this module and :mod:`torch_tree_attn.hf`.

    Accepts a Python int, a list/tuple of ints, or an int32/int64 tensor ``[]`` / ``[n]``;
    with ``batch`` given, n must be 1 or ``batch`` (None: any n). Returns int64 ``[n]`` on
    ``device``. Negative values raise where ``check_values`` is set (a host read, skipped
    while torch.compile traces).
    """
    if isinstance(mask_offset, (list, tuple)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in mask_offset
    ):
        mask_offset = torch.tensor(list(mask_offset), dtype=torch.int64, device=device)
    if isinstance(mask_offset, torch.Tensor):
        if mask_offset.dtype not in (torch.int32, torch.int64) or mask_offset.dim() > 1:
            raise TypeError(
                f"{name} must be an int or an int32/int64 tensor [B], got {mask_offset.dtype} "
                f"of shape {tuple(mask_offset.shape)}"
            )
        lens = mask_offset.to(device=device, dtype=torch.int64).reshape(-1)
        if batch is not None and lens.numel() not in (1, batch):
            expected = "1" if batch == 1 else f"1 or {batch}"
            raise ValueError(f"{name} has {lens.numel()} entries, expected {expected} (one per batch row)")
    elif isinstance(mask_offset, int) and not isinstance(mask_offset, bool):
        lens = torch.tensor([mask_offset], dtype=torch.int64, device=device)
    else:
        raise TypeError(f"{name} must be an int or an int tensor, got {type(mask_offset).__name__}")
    if check_values and not _is_compiling() and bool((lens < 0).any()):
        raise ValueError(f"{name} must be >= 0, got {lens.tolist()}")
    return lens


def position_ids(parents: torch.Tensor, mask_offset: Union[int, torch.Tensor]) -> torch.Tensor:
    """Sequence positions of the tree nodes, int64 ``[B, T]``: ``mask_offset + depth``.

    ``mask_offset`` (the prefix lengths) is an int or an int tensor ``[B]`` (or ``[1]``);
    a single tree ``[T]`` broadcasts against B prefix lengths.
    """
    _check_parents(parents)
    depths = _node_depths(parents)
    single = depths.dim() == 1
    if single:
        depths = depths[None]
    lens = _mask_offset_tensor(mask_offset, None if single else depths.shape[0], depths.device)
    return depths + lens[:, None]


def _leaf_mask(parents: torch.Tensor) -> torch.Tensor:
    # Slot 0 of `has_child` absorbs the roots' parent (-1), so no masking is needed.
    shape = parents.shape[:-1] + (parents.shape[-1] + 1,)
    has_child = torch.zeros(shape, dtype=torch.bool, device=parents.device)
    has_child.scatter_(-1, parents + 1, True)
    return ~has_child[..., 1:]


def leaf_mask(parents: torch.Tensor) -> torch.Tensor:
    """bool ``[T]`` or ``[B, T]``: True for nodes without children."""
    _check_parents(parents)
    return _leaf_mask(parents)


def _retrieve_indices(parents: torch.Tensor, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    single = parents.dim() == 1
    if single:
        parents = parents[None]
        valid = None if valid is None else valid[None]
    B, T = parents.shape
    device = parents.device
    reach = _ancestor_mask(parents)  # [B, T, T]
    leaves = _leaf_mask(parents)
    if valid is not None:
        leaves = leaves & valid
    depths = _mask_depths(reach)
    # The two shape-defining numbers, read in one host transfer.
    counts = torch.stack([leaves.sum(-1).max(), torch.where(leaves, depths, 0).max()]).tolist()
    num_leaves, max_depth = int(counts[0]), int(counts[1])

    # Leaves first, each group in node order: row r of tree b is its r-th leaf.
    order = torch.sort((~leaves).to(torch.int8), dim=-1, stable=True).indices[:, :num_leaves]
    row_is_leaf = leaves.gather(-1, order)
    paths = reach.gather(1, order[..., None].expand(B, num_leaves, T)) & row_is_leaf[..., None]
    # Ancestors of a node have increasing indices from the root down (parents come first),
    # so the k-th set bit of a mask row is the node at depth k of the path.
    slot = paths.cumsum(-1) - 1
    width = max_depth + 1
    slot = torch.where(paths, slot, width)  # unused entries land in a spare column
    node = torch.arange(T, device=device).expand(B, num_leaves, T)
    out = torch.full((B, num_leaves, width + 1), -1, dtype=torch.int64, device=device)
    out.scatter_(-1, slot, torch.where(paths, node, -1))
    out = out[..., :width]
    return out[0] if single else out


def retrieve_indices(parents: torch.Tensor, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Root-to-leaf paths, int64 ``[L, max_depth + 1]`` (``[B, L_max, max_depth + 1]``
    batched), padded with -1.

    Row r lists the nodes from the root down to the r-th leaf (leaves in node order);
    ``max_depth`` is the deepest leaf's depth. For batched trees, ``valid`` (from
    ``pad_trees``) excludes padding nodes; trees with fewer leaves get all -1 rows.
    """
    _check_parents(parents)
    if valid is not None and (valid.dtype != torch.bool or valid.shape != parents.shape):
        raise ValueError(
            f"valid must be a bool tensor shaped like parents {tuple(parents.shape)}, "
            f"got {valid.dtype} {tuple(valid.shape)}"
        )
    return _retrieve_indices(parents, valid)


def pad_trees(trees: Sequence[Union[torch.Tensor, Sequence[int]]]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Stack trees of different sizes into ``(parents [B, T_max], valid bool [B, T_max])``.

    Padding nodes get parent -1: each is a root of its own, so it attends only to itself
    and never to a real node (and no real node attends to it).
    """
    if len(trees) == 0:
        raise ValueError("pad_trees needs at least one tree, got an empty sequence")
    tensors = [t if isinstance(t, torch.Tensor) else torch.tensor(list(t), dtype=torch.int64) for t in trees]
    for b, t in enumerate(tensors):
        _check_parents(t, name=f"trees[{b}]")
        if t.dim() != 1:
            raise ValueError(f"trees[{b}] must be a single tree [T], got shape {tuple(t.shape)}")
    T = max(t.shape[0] for t in tensors)
    device = tensors[0].device
    parents = torch.full((len(tensors), T), -1, dtype=torch.int64, device=device)
    valid = torch.zeros((len(tensors), T), dtype=torch.bool, device=device)
    for b, t in enumerate(tensors):
        parents[b, : t.shape[0]] = t.to(device)
        valid[b, : t.shape[0]] = True
    return parents, valid


def dense_tree_mask(
    parents: torch.Tensor, mask_offset: Union[int, torch.Tensor], kv_len: Optional[int] = None
) -> torch.Tensor:
    """The dense attention mask of a tree verify step, bool ``[B, 1, T, kv_len]``, True =
    attend: every query sees the prefix ``[0, mask_offset)`` and its ancestors-or-self at
    ``mask_offset + j``; nothing past the tree. For eager/sdpa attention and for tests.

    ``kv_len`` defaults to ``max(mask_offset) + T``; a StaticCache needs its capacity.
    """
    _check_parents(parents)
    reach = _ancestor_mask(parents)
    if reach.dim() == 2:
        reach = reach[None]
    B, T, _ = reach.shape
    lens = _mask_offset_tensor(mask_offset, None if parents.dim() == 1 else B, reach.device)
    if kv_len is None:
        kv_len = (mask_offset if isinstance(mask_offset, int) else int(lens.max())) + T
    column = torch.arange(kv_len, device=reach.device)
    offset = column - lens[:, None]  # [B or 1, S]: key position relative to the tree
    in_tree = (offset >= 0) & (offset < T)
    gathered = reach.gather(-1, offset.clamp(0, T - 1)[:, None, :].expand(max(B, lens.numel()), T, kv_len))
    mask = (offset < 0)[:, None, :] | (gathered & in_tree[:, None, :])
    return mask[:, None]


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


# ----------------------------------------------------------------------------------------
# Verification
# ----------------------------------------------------------------------------------------

def _check_target_logits(tree: DraftTree, target_logits: torch.Tensor) -> torch.Tensor:
    if not isinstance(tree, DraftTree):
        raise TypeError(f"tree must be a DraftTree, got {type(tree).__name__}")
    if not isinstance(target_logits, torch.Tensor):
        raise TypeError(f"target_logits must be a tensor, got {type(target_logits).__name__}")
    if target_logits.dim() == 3 and target_logits.shape[0] == 1:
        target_logits = target_logits[0]
    if target_logits.dim() != 2 or target_logits.shape[0] != len(tree):
        raise ValueError(
            f"target_logits must be [T={len(tree)}, V] (or [1, T, V]), got {tuple(target_logits.shape)}"
        )
    if not target_logits.is_floating_point():
        raise TypeError(f"target_logits must be floating point, got {target_logits.dtype}")
    return target_logits


def verify_greedy(tree: DraftTree, target_logits: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """Greedy acceptance: the longest root-to-leaf prefix whose every token equals the
    target's argmax at its parent, plus the bonus token (the argmax at the last accepted
    node).

    Args:
        tree: the verified draft tree (T nodes).
        target_logits: ``[T, V]``, the target's logits at every tree node.

    Returns:
        ``(accepted, bonus_token)``: int64 ``[n]`` node indices from the root down (the
        root included, so n >= 1), and the next token as a Python int. Among equally long
        accepted paths the first in ``tree.retrieve`` wins.
    """
    target_logits = _check_target_logits(tree, target_logits)
    best = target_logits.argmax(-1)  # [T]
    paths = tree.retrieve.to(best.device)  # [L, D + 1]
    child, parent = paths[:, 1:], paths[:, :-1]
    matches = (child >= 0) & (tree.tokens.to(best.device)[child.clamp(min=0)] == best[parent.clamp(min=0)])
    accepted_len = matches.to(torch.int64).cumprod(-1).sum(-1)  # draft tokens accepted per path
    path = accepted_len.argmax()
    last_node = paths[path, accepted_len[path]]
    n, bonus = torch.stack([accepted_len[path], best[last_node]]).tolist()  # one host read
    return paths[path, : n + 1], bonus


def sampling_probs(
    logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0
) -> torch.Tensor:
    """The sampling distribution over the last dim, float32: logits / temperature, then
    top-k (keep tokens whose logit reaches the k-th largest), then top-p (keep the
    smallest set of most likely tokens whose mass reaches ``top_p``; the most likely
    token always stays), then softmax. The order matches transformers' ``generate``.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for a sampling distribution, got {temperature}")
    scores = logits.float() / temperature
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        kth = scores.topk(top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, -math.inf)
    return scores.softmax(-1)


def _check_sampling_args(temperature, top_p, top_k) -> None:
    if not isinstance(temperature, (int, float)) or not temperature >= 0 or math.isinf(temperature):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")


def verify_sampling(
    tree: DraftTree,
    target_logits: torch.Tensor,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: Optional[torch.Generator] = None,
) -> Tuple[torch.Tensor, int]:
    """Lossless verification for sampling: EAGLE's recursive rejection sampling over
    siblings, with a deterministic (top-k) draft.

    From the root down: let p be the target's sampling distribution at the current node
    (``sampling_probs`` of its logits). Its children are tried in node order, each
    distinct token x once: accept x with probability p(x); on rejection set p(x) = 0,
    renormalise and try the next sibling. On acceptance move to that child and repeat;
    when every child is rejected (or the node is a leaf), the next token is drawn from
    what is left of p. The emitted tokens (accepted tokens then the next token) are
    distributed exactly as sampling the target token by token.

    The sibling trials of one node are evaluated at once: with q the target mass of the
    distinct children in order, trying child j happens after rejecting the earlier ones,
    which leaves mass ``q_j + q_{j+1} + ... + rest``, so child j is accepted with
    probability ``q_j / (q_j + ... + rest)``; the first success wins. One host read per
    tree level decides where to go.

    Args:
        tree: the verified draft tree (T nodes).
        target_logits: ``[T, V]``.
        temperature: 0 means greedy (``verify_greedy``).
        top_p, top_k: applied to the target distribution (1.0 / 0 = off).
        generator: a torch.Generator on the logits' device, for reproducible draws.

    Returns:
        ``(accepted, next_token)`` as in ``verify_greedy``.
    """
    _check_sampling_args(temperature, top_p, top_k)
    target_logits = _check_target_logits(tree, target_logits)
    if temperature == 0:
        return verify_greedy(tree, target_logits)
    device = target_logits.device
    vocab = target_logits.shape[-1]
    children = tree.children.to(device)  # [T, C]
    width = children.shape[1]
    kid_tokens = tree.tokens.to(device)[children.clamp(min=0)]
    trials = tree.sibling_trials.to(device)

    node = 0
    accepted = [0]
    while True:
        probs = sampling_probs(target_logits[node], temperature, top_p, top_k)  # [V]
        kids, tokens, trial = children[node], kid_tokens[node], trials[node]
        kid_mass = torch.where(trial, probs[tokens], 0.0)
        # What is left of p outside the children: the residual distribution.
        covered = torch.zeros(vocab, dtype=torch.int32, device=device)
        covered.scatter_add_(0, tokens, trial.to(torch.int32))
        residual = probs.masked_fill(covered > 0, 0.0)
        mass_left = kid_mass.flip(0).cumsum(0).flip(0) + residual.sum()
        accept_prob = torch.where(mass_left > 0, kid_mass / mass_left, 0.0)
        draws = torch.rand(width, device=device, generator=generator)
        success = draws < accept_prob
        chosen = torch.where(success.any(), kids[success.to(torch.int8).argmax()], -1)
        chosen, = chosen.reshape(1).tolist()
        if chosen < 0:
            next_token = torch.multinomial(residual, 1, generator=generator)
            return torch.tensor(accepted, dtype=torch.int64, device=device), int(next_token)
        node = chosen
        accepted.append(node)
