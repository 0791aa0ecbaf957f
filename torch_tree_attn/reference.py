"""A plain float64 implementation of the op contract, for tests only.

Written from the contract, independently of every kernel: it expands the compact
(mask, mask_offset) form into one dense bias over all S keys and runs textbook softmax
attention in float64.
"""
import math
from typing import Optional, Tuple

import torch


def dense_bias(mask: torch.Tensor, mask_offset: Optional[torch.Tensor], B: int, Hq: int, T: int, S: int) -> torch.Tensor:
    """float64 additive bias ``[B, Hq, T, S]``: 0 over the prefix, the mask over the
    window, -inf past it."""
    if mask.dim() == 3:
        mask = mask[:, None]
    M = mask.shape[-1]
    window = mask.expand(B, Hq, T, M)
    if window.dtype == torch.bool:
        window = torch.zeros(window.shape, dtype=torch.float64).masked_fill(~window.cpu(), -math.inf)
    else:
        window = window.cpu().double()
    offsets = [0] * B if mask_offset is None else [int(o) for o in mask_offset.cpu()]
    bias = torch.full((B, Hq, T, S), -math.inf, dtype=torch.float64)
    for b, off in enumerate(offsets):
        bias[b, :, :, :off] = 0.0
        bias[b, :, :, off:off + M] = window[b]
    return bias


def tree_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    mask_offset: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Returns (out float64 ``[B, Hq, T, D]``, lse float64 ``[B, Hq, T]``)."""
    B, Hq, T, D = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    G = Hq // Hkv
    q = query.detach().cpu().double()
    k = key.detach().cpu().double().repeat_interleave(G, dim=1)
    v = value.detach().cpu().double().repeat_interleave(G, dim=1)
    bias = dense_bias(mask, mask_offset, B, Hq, T, S)
    # Keys the contract never reads may hold anything (tests put NaN there): drop them
    # before they can touch the arithmetic.
    visible = torch.isfinite(bias) | (bias == math.inf)
    k = torch.where(visible.any(dim=2)[..., None], k, 0.0)
    v = torch.where(visible.any(dim=2)[..., None], v, 0.0)
    scores = q @ k.transpose(-1, -2) * (D ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores + bias
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse[..., None])
    weights = torch.where(torch.isneginf(lse)[..., None], 0.0, weights)
    return weights @ v, lse
