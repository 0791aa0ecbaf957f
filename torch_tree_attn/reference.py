"""A plain float64 implementation of the op contract, for tests only.

Written from the contract, independently of every kernel: it expands the compact
(mask, mask_offset) form into one dense bias over all S keys and runs textbook softmax
attention in float64, with the contract's rules for what a row sees and for non-finite
values (README, "Non-finite values").
"""
import math
from typing import Optional, Tuple

import torch

FLOAT32_MAX = torch.finfo(torch.float32).max


def dense_bias(mask: torch.Tensor, mask_offset: Optional[torch.Tensor], B: int, Hq: int, T: int, S: int) -> torch.Tensor:
    """float64 additive bias ``[B, Hq, T, S]``: 0 over the prefix, the mask over the
    window (floating masks as the float32 the kernels read), -inf past it."""
    if mask.dim() == 3:
        mask = mask[:, None]
    M = mask.shape[-1]
    window = mask.expand(B, Hq, T, M).cpu()
    if window.dtype == torch.bool:
        window = torch.zeros(window.shape, dtype=torch.float64).masked_fill(~window, -math.inf)
    else:
        window = window.float().double()
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
    sinks: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Returns (out float64 ``[B, Hq, T, D]``, lse float64 ``[B, Hq, T]``).

    ``sinks`` ``[Hq]`` join each row's softmax denominator as one extra logit with no
    value; they are read as the float32 the kernels read."""
    B, Hq, T, D = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    G = Hq // Hkv
    q = query.detach().cpu().double()
    k = key.detach().cpu().double().repeat_interleave(G, dim=1)
    v = value.detach().cpu().double().repeat_interleave(G, dim=1)
    bias = dense_bias(mask, mask_offset, B, Hq, T, S)
    # What row (b, h, i) sees: key j with a bias other than -inf (a NaN bias is seen).
    seen = ~torch.isneginf(bias)

    # Non-finite inputs poison exactly the rows that see them; everything else is
    # computed from finite stand-ins (0) so unseen slots cannot touch the arithmetic.
    bad_q = ~torch.isfinite(q).all(dim=-1)                      # [B, Hq, T]
    bad_kv = ~(torch.isfinite(k).all(dim=-1) & torch.isfinite(v).all(dim=-1))  # [B, Hq, S]
    bad_bias = seen & ~torch.isfinite(bias)                     # NaN or +inf where seen
    k, v = torch.nan_to_num(k, nan=0.0, posinf=0.0, neginf=0.0), torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
    q_clean = torch.where(bad_q[..., None], 0.0, q)

    raw = q_clean @ k.transpose(-1, -2) * (D ** -0.5 if scale is None else float(torch.tensor(scale, dtype=torch.float32)))
    # A score the kernels' float32 cannot hold is non-finite there too.
    overflow = seen & (raw.abs() > FLOAT32_MAX)
    scores = raw if softcap is None else softcap * torch.tanh(raw / softcap)
    scores = torch.where(seen & ~bad_bias, scores + torch.where(seen, bias, 0.0), -math.inf)

    poisoned = bad_q & seen.any(dim=-1)
    poisoned |= (seen & (bad_kv[:, :, None, :] | bad_bias | overflow)).any(dim=-1)

    if sinks is not None:
        sink = sinks.detach().cpu().float().double()[None, :, None].expand(B, Hq, T)  # [B, Hq, T]
        # A NaN or +inf sink poisons its head's rows; -inf is no sink.
        poisoned |= torch.isnan(sink) | torch.isposinf(sink)
        sink = torch.where(torch.isfinite(sink), sink, -math.inf)
        scores = torch.cat([scores, sink[..., None]], dim=-1)
        v = torch.cat([v, v.new_zeros(B, Hq, 1, D)], dim=2)

    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse[..., None])
    weights = torch.where(torch.isneginf(lse)[..., None], 0.0, weights)
    out = weights @ v
    out = torch.where(poisoned[..., None], math.nan, out)
    lse = torch.where(poisoned, math.nan, lse)
    return out, lse
