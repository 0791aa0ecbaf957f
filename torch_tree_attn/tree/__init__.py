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
from .accept import sampling_probs, verify_greedy, verify_sampling
from .draft import DraftTree, ExpandStep, build_dynamic_tree
from .structure import (ancestor_mask, dense_tree_mask, leaf_mask, node_depths, pad_trees, position_ids,
                        retrieve_indices)

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
