"""One forward of a transformers model verifies a draft tree: tree_forward."""
import torch

from ..tree.structure import _mask_depths, _mask_offset_tensor, ancestor_mask
from . import compat as _compat


# --------------------------------------------------------------------------------------
# Convenience
# --------------------------------------------------------------------------------------


def tree_forward(model, tokens, parents, mask_offset, cache, **model_kwargs):
    """Verify draft trees in one forward of ``model`` (loaded with a registered tree_attn).

    Args:
        tokens: int64 ``[B, T]`` (or ``[T]``) tree tokens, node 0 the root.
        parents: int64 ``[B, T]`` (or ``[T]``) parent indices, -1 for the root, parents
            before children.
        mask_offset: the prefix lengths: the cache slot where every row's tree is
            written, i.e. the cache length (int, or int tensor ``[B]``; transformers'
            caches need it equal in all rows).
        cache: a transformers ``Cache`` (DynamicCache, StaticCache) holding the prefix.
        model_kwargs: passed to the model. ``attention_mask`` may be a 2D padding mask
            over ``[B, prefix]`` or ``[B, prefix + T]`` for left-padded rows; position ids
            then count real tokens only.

    Returns the model output; logits ``[B, T, V]``. The tree's K/V is written at cache
    slots ``[prefix, prefix + T)``.
    """
    if tokens.dim() == 1:
        tokens = tokens[None]
    if parents.dim() == 1:
        parents = parents[None].expand(tokens.shape[0], -1)
    batch, q_len = tokens.shape
    if parents.shape != tokens.shape:
        raise ValueError(
            f"tree_forward: parents shape {tuple(parents.shape)} must match tokens shape {tuple(tokens.shape)}"
        )
    device = tokens.device
    prefix = _mask_offset_tensor(mask_offset, batch, device).expand(batch)
    if cache is not None and not torch.compiler.is_compiling():
        cached = int(cache.get_seq_length())
        if bool((prefix != cached).any()):
            raise ValueError(
                f"tree_forward: mask_offset {prefix.tolist()} must equal the cache length {cached} in every row "
                "(transformers' caches write all rows at the same slot; left-pad shorter rows and pass attention_mask)"
            )

    mask = ancestor_mask(parents.to(device))
    depth = _mask_depths(mask)

    real_prefix = prefix
    attention_mask = model_kwargs.pop("attention_mask", None)
    if attention_mask is not None:
        # A padded batch: every row's tree sits at the same slot, its position counts the
        # row's real tokens only.
        width = attention_mask.shape[-1]
        slot = int(prefix[0])
        if attention_mask.dim() != 2 or width not in (slot, slot + q_len) or bool((prefix != slot).any()):
            raise ValueError(
                "tree_forward: attention_mask must be a 2D padding mask over [B, prefix] or [B, prefix + T] with "
                f"one prefix length for all rows, got shape {tuple(attention_mask.shape)}, mask_offset "
                f"{prefix.tolist()}, T={q_len}"
            )
        if width == slot:
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, q_len)], dim=1)
        real_prefix = attention_mask[:, :slot].to(torch.int64).sum(dim=1)
        model_kwargs["attention_mask"] = attention_mask
    model_kwargs.setdefault("position_ids", real_prefix[:, None] + depth)
    model_kwargs.setdefault("use_cache", True)
    model_kwargs.update(_compat.cache_kwargs(model, cache))
    return model(input_ids=tokens, tree_mask=mask, mask_offset=prefix, **model_kwargs)
