"""Tree structure: parents checks, ancestor masks, depths, positions, leaves, paths,
padding and the dense verify mask."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

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
