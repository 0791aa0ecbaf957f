"""RowCache: the target's KV cache with one prefix length per batch row."""
from __future__ import annotations

import weakref
from typing import List, Tuple

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


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
