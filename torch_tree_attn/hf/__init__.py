"""FIXME docstring"""
from .attention import register, tree_attention_forward, tree_attention_mask
from .cache import compact_kv_cache, verification_cache
from .forward import tree_forward

__all__ = [
    "register",
    "tree_attention_forward",
    "tree_attention_mask",
    "tree_forward",
    "verification_cache",
    "compact_kv_cache",
]
