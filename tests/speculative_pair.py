"""What tests/test_eagle3.py and tests/test_speculative.py share: the built-in target/draft
pair (torch_tree_attn.speculative.builtin), loaded for the tree_attn attention, and running
their tiny models on one thread."""
import contextlib

import torch

from torch_tree_attn import hf
from torch_tree_attn.speculative import builtin


def load_builtin_pair(device="cpu", dtype=torch.float32):
    """(target, draft): the built-in pair, the target on the tree_attn attention."""
    assert builtin.builtin_assets_present(), "the built-in weights are kept under examples/assets"
    hf.register()
    target = builtin.load_builtin_target(dtype=dtype, device=device, attn_implementation="tree_attn")
    return target, builtin.load_builtin_draft(target, dtype=dtype, device=device)


@contextlib.contextmanager
def one_torch_thread():
    """torch on one thread inside: tiny models run as fast, and are immune to OpenMP threads
    waiting for each other when the machine is busy (which slows small GEMMs down many-fold)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
