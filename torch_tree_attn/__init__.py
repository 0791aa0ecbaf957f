"""torch-tree-attn: verify a speculative-decoding draft tree in one attention call.

Importing this package loads the C++ extension, which registers the operators
``torch.ops.tree_attn.forward`` and ``torch.ops.tree_attn.forward_with_lse`` for every
backend built on this machine, and registers their fake (meta) implementations, which
check their inputs, so they trace under ``torch.compile``. The op has no backward: asking
for one raises.
"""
import torch

from . import _C  # noqa: F401  (registers the operators)
from . import _fake  # noqa: F401  (registers the fake implementations and autograd)
from .ops import tree_attention


def _register_cuda_backend() -> None:
    """The CUDA op is C++ (csrc/cuda/, registered with the extension); this registers its
    prebuilt kernels and its compile-once fallback (torch_tree_attn/backends/cuda/__init__.py).
    Reads a small manifest; imports no triton; touches no GPU."""
    from .backends import cuda

    cuda.register()


_register_cuda_backend()

__all__ = ["tree_attention"]
__version__ = "0.1.0"
