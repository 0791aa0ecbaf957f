"""KV cache handling for tree verification on transformers 5.x caches: the verification
cache and compaction of the accepted path."""
from typing import Optional, Sequence, Union

import torch

from ..tree.structure import _mask_offset_tensor
from . import compat as _compat


# --------------------------------------------------------------------------------------
# KV cache compaction (transformers 5.x caches)
# --------------------------------------------------------------------------------------

_COMPACTABLE_LAYERS = ("DynamicLayer", "StaticLayer", "DynamicSlidingWindowLayer", "StaticSlidingWindowLayer")


def verification_cache(model, max_cache_len: Optional[int] = None):
    """A transformers cache for a tree-verification loop on ``model``: a DynamicCache
    (``max_cache_len=None``) or a StaticCache of ``max_cache_len`` positions whose
    sliding-window layers are replaced by full-length ones (DynamicLayer / StaticLayer).

    transformers' sliding cache layers drop the keys that left the window, so after a
    verify step past the window the accepted path cannot be compacted
    (:func:`compact_kv_cache`) or the step rolled back (``crop``), and the static one
    keeps its length in a Python int that compiled graphs guard on (a recompile per cache
    length). Full-length layers keep every position; tree_attn applies the window itself,
    by tree position (see "Dense fallbacks"), as it does for eager and sdpa masks. Layers
    that keep no KV of their own (Gemma 4's KV-shared layers) stay as they are. For a model
    without sliding layers this is the ordinary cache.
    """
    from transformers import DynamicCache, StaticCache
    from transformers.cache_utils import DynamicLayer, StaticLayer

    if max_cache_len is None:
        cache = DynamicCache(config=model.config)
    else:
        cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    for index, layer in enumerate(cache.layers):
        if getattr(layer, "is_sliding", False):
            cache.layers[index] = DynamicLayer() if max_cache_len is None else StaticLayer(max_cache_len=max_cache_len)
    if isinstance(vars(cache).get("is_sliding"), list):  # a release that stores the flags instead of deriving them
        cache.is_sliding = [getattr(layer, "is_sliding", False) for layer in cache.layers]
    return cache


def _layer_kind(layer) -> str:
    # Exact class names: subclasses such as quantized or indexed layers keep more state
    # than keys/values, which moving keys/values alone would corrupt.
    kind = type(layer).__name__
    if kind not in _COMPACTABLE_LAYERS:
        raise TypeError(
            f"compact_kv_cache supports {', '.join(_COMPACTABLE_LAYERS)} cache layers "
            f"(sliding-window ones only before they slide), got a {kind} layer"
        )
    return kind


def _compact_layer(layer, prefix_len: int, source: torch.Tensor, new_len: int) -> None:
    keys, values = layer.keys, layer.values
    n = source.shape[-1]
    dst = slice(prefix_len, prefix_len + n)
    for cache_tensor in (keys, values):
        if source.dim() == 1:
            moved = cache_tensor.index_select(2, source)
        else:  # one path per batch row
            B, H, _, D = cache_tensor.shape
            moved = cache_tensor.gather(2, source[:, None, :, None].expand(B, H, n, D))
        # `moved` is a copy, so overlapping source and destination slots are safe.
        cache_tensor[:, :, dst].copy_(moved)
    # Where the layer records its length depends on the transformers release; a static
    # layer's is reset in place (fixed addresses under torch.compile).
    _compat.set_layer_length(layer, new_len)


def compact_kv_cache(cache, mask_offset: int, accepted: Union[torch.Tensor, Sequence[int]]) -> int:
    """Keep only the accepted path of a verified tree in a transformers cache.

    After a tree verify forward, tree node i's K/V sits at position ``mask_offset + i``.
    This moves the K/V of node ``accepted[k]`` to position ``mask_offset + k`` in every
    layer, in place on the cache's device, and sets the cache length to
    ``mask_offset + len(accepted)``: a DynamicCache is cut there; a StaticCache keeps its
    buffers and resets its length, so the next forward writes right after the path.

    Args:
        cache: a transformers 5.x ``DynamicCache`` or ``StaticCache`` (anything whose
            ``layers`` are DynamicLayer / StaticLayer). Sliding-window layers work only
            while nothing has slid out of their window.
        mask_offset: number of committed tokens before the tree (the verify step's
            ``mask_offset``), an int.
        accepted: int64 ``[n]`` tree node indices (as from ``verify_greedy``), applied to
            every batch row, or ``[B, n]`` with one path per row.

    Returns:
        The new cache length, ``mask_offset + n`` (the next step's ``mask_offset``).
    """
    if not hasattr(cache, "layers"):
        raise TypeError(f"cache must be a transformers Cache with .layers, got {type(cache).__name__}")
    if not isinstance(mask_offset, int) or isinstance(mask_offset, bool):
        raise TypeError(f"mask_offset must be an int (the prefix length), got {type(mask_offset).__name__}")
    _mask_offset_tensor(mask_offset, 1, "cpu")  # the one prefix-length validator: >= 0
    prefix_len = mask_offset
    if not isinstance(accepted, torch.Tensor):
        accepted = torch.tensor(list(accepted), dtype=torch.int64)
    if accepted.dtype not in (torch.int32, torch.int64) or accepted.dim() not in (1, 2) or accepted.shape[-1] == 0:
        raise ValueError(
            f"accepted must be a non-empty int tensor [n] or [B, n], got {accepted.dtype} {tuple(accepted.shape)}"
        )
    n = accepted.shape[-1]
    new_len = prefix_len + n

    # Layers that hold no KV of their own (transformers' DummyLayer: Gemma 4's KV-shared
    # layers, attention-free layers) have nothing to move.
    layers = [
        layer for layer in cache.layers
        if getattr(layer, "is_initialized", False) and getattr(layer, "keys", None) is not None
    ]
    if not layers:
        raise ValueError("compact_kv_cache got a cache with no initialized layer (run the tree forward first)")
    kinds = [_layer_kind(layer) for layer in layers]
    for layer, kind in zip(layers, kinds):
        if kind == "DynamicSlidingWindowLayer" and layer.keys.shape[-2] != _compat.layer_length(layer):
            raise NotImplementedError(
                f"a DynamicSlidingWindowLayer holding {layer.keys.shape[-2]} of {_compat.layer_length(layer)} "
                "positions has already dropped keys; compaction needs them all"
            )
        if kind == "StaticSlidingWindowLayer" and _compat.layer_length(layer) > layer.max_cache_len:
            raise NotImplementedError(
                f"a StaticSlidingWindowLayer of window {layer.max_cache_len} has slid past "
                f"({_compat.layer_length(layer)} positions written); compaction needs them all"
            )
        if accepted.dim() == 2 and accepted.shape[0] != layer.keys.shape[0]:
            raise ValueError(f"accepted has {accepted.shape[0]} rows but the cache batch is {layer.keys.shape[0]}")
    if not torch.compiler.is_compiling():
        # All layers of one cache hold the same positions; one host read checks them.
        length = _compat.layer_length(layers[0])
        low, high = torch.stack([accepted.min(), accepted.max()]).tolist()
        if low < 0 or prefix_len + high >= length:
            raise ValueError(
                f"accepted nodes must lie in the tree slots [0, {length - prefix_len}) after mask_offset="
                f"{prefix_len} (cache length {length}), got min {low}, max {high}"
            )

    sources = {}
    for layer in layers:
        device = layer.keys.device
        if device not in sources:
            sources[device] = accepted.to(device=device, dtype=torch.int64) + prefix_len
        _compact_layer(layer, prefix_len, sources[device], new_len)
    return new_len
