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
from .config import Chunk, GenerateOutput, Stats, TreeConfig, TreeShape, tie_tolerance
from .engine import release
from .decode import generate, stream
from .row_cache import RowCache

__all__ = ["TreeConfig", "TreeShape", "Stats", "Chunk", "GenerateOutput", "RowCache", "generate", "stream", "release",
           "tie_tolerance"]
