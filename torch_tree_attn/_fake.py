"""Fake implementations: output metadata for torch.compile / FakeTensor tracing.

They mirror the real kernels exactly: out is a contiguous ``[B, Hq, T, D]`` tensor in the
query dtype, lse a contiguous float32 ``[B, Hq, T]``. Argument checking is the C++
validation's job and happens when the real kernel runs.
"""
import torch


def _out(query):
    return torch.empty(query.shape, dtype=query.dtype, device=query.device)


def _lse(query):
    return torch.empty(query.shape[:-1], dtype=torch.float32, device=query.device)


def _forward_fake(query, key, value, mask, mask_offset=None, scale=None, softcap=None):
    return _out(query)


def _forward_with_lse_fake(query, key, value, mask, mask_offset=None, scale=None, softcap=None):
    return _out(query), _lse(query)


for _name, _fn in (
    ("tree_attn::forward", _forward_fake),
    ("tree_attn::forward_with_lse", _forward_with_lse_fake),
    ("tree_attn::_metal_sim_forward", _forward_fake),
    ("tree_attn::_metal_sim_forward_with_lse", _forward_with_lse_fake),
):
    torch.library.register_fake(_name)(_fn)
