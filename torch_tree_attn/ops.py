"""The Python entry point of the op."""
from typing import Optional, Sequence, Tuple, Union

import torch

from . import _C


def _offsets_tensor(mask_offset, query: torch.Tensor) -> Optional[torch.Tensor]:
    """A Python int (every batch row) or a sequence of ints (one per row) as the op's int64
    tensor on the query's device; a tensor or None as it is."""
    if mask_offset is None or isinstance(mask_offset, torch.Tensor):
        return mask_offset
    if isinstance(mask_offset, bool) or not (isinstance(mask_offset, int) or (
            isinstance(mask_offset, Sequence) and all(isinstance(v, int) and not isinstance(v, bool)
                                                      for v in mask_offset))):
        raise TypeError("mask_offset must be an int32/int64 tensor [B], a Python int or a sequence of B ints, got "
                        f"{type(mask_offset).__name__} {mask_offset!r}")
    values = [mask_offset] * query.shape[0] if isinstance(mask_offset, int) else list(mask_offset)
    return torch.tensor(values, dtype=torch.int64, device=query.device)


def _direct_cuda_call(tensors) -> bool:
    """Whether a call may go straight to the C++ CUDA launcher, skipping the dispatcher and
    the autograd layer (what they would do is nothing here): plain CUDA tensors, eager (not
    traced or compiled), no tensor needing a gradient, no Python mode active."""
    query = tensors[0]
    if query.device.type != "cuda" or torch.compiler.is_compiling():
        return False
    if torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack():
        return False
    grad = torch.is_grad_enabled()
    return all(t is None or (type(t) is torch.Tensor and not (grad and t.requires_grad)) for t in tensors)


def tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    mask_offset: Union[torch.Tensor, int, Sequence[int], None] = None,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    return_lse: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Attention of draft-tree queries over a KV cache: each query sees the committed
    prefix and the keys its mask allows.

    Args:
        query: ``[B, Hq, T, D]``; float32, float16 or bfloat16. D in {64, 96, 128, 256, 512}.
        key, value: ``[B, Hkv, S, D]`` with ``Hq % Hkv == 0`` (GQA/MQA), one dtype: the
            query's, or float16/bfloat16 under a float32 query. S may be a static cache's
            capacity. Any strides with ``stride(-1) == 1`` are
            used without a copy (e.g. a ``[B, S, Hkv, D]`` cache passed as
            ``.transpose(1, 2)``); other layouts are copied.
        mask: bool (True = attend) or floating (additive bias; ``-inf`` or very negative
            = masked), shape ``[B or 1, T, M]`` or ``[B or 1, 1 or Hq, T, M]``; size-1
            dims broadcast. It covers the key window ``[off_b, off_b + M)``.
        mask_offset: int32/int64 ``[B]`` on the query's device, or None for all zeros; a
            Python int (the same offset for every row) or a sequence of B ints is turned
            into an int64 tensor on the query's device (a copy to the device each call:
            pass a tensor inside CUDA graphs).
            For batch row b, keys ``j < off_b`` are always attended (the committed
            prefix), keys in the window follow the mask, keys ``j >= off_b + M`` are never
            read. A dense HF mask is ``mask_offset=None, M=S``; the compact tree form is
            an ancestor-or-self ``[B, T, T]`` mask with ``mask_offset`` = the prefix lengths and
            the tree's K/V at ``[off_b, off_b + T)``. ``M = 0`` (prefix only) is legal.
            CPU checks ``0 <= off_b`` and ``off_b + M <= S``; MPS/CUDA do not read the
            offsets on the host (that would sync) and clamp instead: keys outside
            ``[0, S)`` are never read.
        scale: score scale, default ``D ** -0.5``.
        softcap: if set, ``softcap * tanh(s / softcap)`` of the scaled score ``s``,
            applied before the mask's bias is added (Gemma-2 style).
        sinks: optional floating ``[Hq]`` on the query's device: one logit per query head
            that joins the softmax denominator and attends to no value (gpt-oss). softcap
            does not apply to it. ``-inf`` is no sink.
        return_lse: also return the float32 ``[B, Hq, T]`` log-sum-exp of the final
            scores (natural log).

    Returns:
        ``[B, Hq, T, D]`` in the query dtype (accumulated in float32), and the lse if
        asked. A query that sees no key gets output 0 and lse ``-inf`` (its head's sink
        with sinks), never NaN.

    Raises:
        ValueError / TypeError naming the argument and the values seen.
    """
    mask_offset = _offsets_tensor(mask_offset, query)
    if _direct_cuda_call((query, key, value, mask, mask_offset, sinks)):
        # The op's CUDA kernel itself (csrc/cuda/), minus ~10 us of Python dispatch per call.
        out, lse = _C.cuda_forward_with_lse(query, key, value, mask, mask_offset, scale, softcap, sinks)
        return (out, lse) if return_lse else out
    if return_lse:
        return torch.ops.tree_attn.forward_with_lse(query, key, value, mask, mask_offset, scale, softcap, sinks)
    return torch.ops.tree_attn.forward(query, key, value, mask, mask_offset, scale, softcap, sinks)
