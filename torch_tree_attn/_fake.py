"""Fake implementations (for torch.compile / FakeTensor tracing, and the Meta backend)
and the `_no_backward` op the C++ autograd kernel (csrc/autograd.cpp) calls.

The fakes check a call with the contract's own rules: ``_C.check_contract`` is the C++
``check_contract()`` that every backend's ``prepare()`` runs, applied to the arguments'
metadata (shapes, strides, dtypes, devices), so a bad call fails while tracing with the
same ValueError/TypeError the kernel would raise, and a call that mixes devices (a meta
tensor among CPU ones, which the dispatcher sends here) fails instead of returning
uninitialised memory. Only offset *values* are not checked: a fake has none.

Outputs mirror the real kernels exactly: a contiguous ``[B, Hq, T, D]`` tensor in the
query dtype, and a contiguous float32 ``[B, Hq, T]`` lse.
"""
from typing import List, Optional, Tuple

import torch

from . import _C

OPS = ("tree_attn::forward", "tree_attn::forward_with_lse")


def _hinted(values) -> Optional[List[int]]:
    """The ints of a shape or stride; symbolic sizes by their hint (no guard is added).
    None if a size has no hint (an unbacked symbol): then nothing can be checked."""
    out = []
    for v in values:
        if isinstance(v, int):
            out.append(v)
            continue
        node = getattr(v, "node", None)
        if node is None or not node.has_hint() or not isinstance(node.hint, int):
            return None
        out.append(node.hint)
    return out


def _meta(t: torch.Tensor):
    sizes, strides = _hinted(t.shape), _hinted(t.stride())
    if sizes is None or strides is None:
        return None
    return sizes, strides, t.dtype, t.device


def check_call(query, key, value, mask, mask_offset=None, scale=None, softcap=None, sinks=None) -> None:
    """Raises what the op would raise for this call, from its metadata alone."""
    optional = [mask_offset, sinks]
    metas = [_meta(t) for t in (query, key, value, mask)]
    optional_metas = [None if t is None else _meta(t) for t in optional]
    if any(m is None for m in metas) or any(m is None and t is not None for m, t in zip(optional_metas, optional)):
        return  # unbacked sizes: the kernel checks them when it runs
    _C.check_contract(*metas, optional_metas[0], scale, softcap, optional_metas[1])


def _out(query):
    return torch.empty(query.shape, dtype=query.dtype, device=query.device)


def _lse(query):
    return torch.empty(query.shape[:-1], dtype=torch.float32, device=query.device)


def _forward_fake(query, key, value, mask, mask_offset=None, scale=None, softcap=None, sinks=None):
    check_call(query, key, value, mask, mask_offset, scale, softcap, sinks)
    return _out(query)


def _forward_with_lse_fake(query, key, value, mask, mask_offset=None, scale=None, softcap=None, sinks=None):
    check_call(query, key, value, mask, mask_offset, scale, softcap, sinks)
    return _out(query), _lse(query)


torch.library.register_fake("tree_attn::forward")(_forward_fake)
torch.library.register_fake("tree_attn::forward_with_lse")(_forward_with_lse_fake)


# --- autograd: the op has no backward, and says so when one is run ---------------------
#
# The op's Autograd kernel is C++ (csrc/autograd.cpp: an eager call with no input needing a
# gradient goes straight through). With one that does, the outputs' grad_fn calls
# `tree_attn::_no_backward` once per input that needs a gradient: traceable (its fake
# returns a tensor of the input's shape, so torch.compile can build the backward graph),
# and raising, naming the op and the input, when it runs.


@torch.library.custom_op("tree_attn::_no_backward", mutates_args=())
def _no_backward_op(grad: torch.Tensor, shape: List[int], op: str, argument: str) -> torch.Tensor:
    raise RuntimeError(
        f"{op} has no backward (asked for the gradient of {argument!r}): tree attention is an inference op "
        "(speculative-decoding verification). Call it under torch.no_grad() / torch.inference_mode(), or "
        "detach its inputs, or use F.scaled_dot_product_attention where gradients are needed."
    )


@_no_backward_op.register_fake
def _(grad, shape, op, argument):
    return grad.new_empty(shape)
