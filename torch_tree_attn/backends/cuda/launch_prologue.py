"""What the CUDA backend's two Python launchers do before their first launch: the
interpreter's (``torch_tree_attn.backends.cuda._interpret``, Triton kernels on CPU tensors)
and the Hopper kernel's (``hopper_kernels.forward_with_lse_hopper``), as the C++ launcher does.

Imports neither triton nor, until called, the C++ extension: hopper_kernels must stay
importable while the build compiles the prebuilt kernels (csrc/cuda/build_kernels.py),
before the extension exists.
"""
import torch


def prepare_call(query, key, value, mask, mask_offset, scale, softcap, sinks):
    """(prepared, q, out, lse) of a call: ``_C._prepare``'s validated, defaulted problem; the
    query the main kernel reads (negated for a negative scale: the kernels take |scale|);
    and the outputs to fill, out [B, Hq, T, D] in the query's dtype and lse [B, Hq, T]
    float32. When ``prepared.problem.empty`` there is nothing to launch: out and lse are the
    answer, and q is the prepared query as it is."""
    from ... import _C

    prepared = _C._prepare(query, key, value, mask, mask_offset, scale, softcap, sinks)
    pb = prepared.problem
    q = prepared.query
    out, lse = prepared.empty_output(), prepared.empty_lse()   # the C++ backends' allocation
    if not pb.empty and pb.scale < 0:
        q = torch.neg(q)
    return prepared, q, out, lse
