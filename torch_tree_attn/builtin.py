"""The built-in target LM and its EAGLE-3 draft: small models this project trained itself
(``examples/train_builtin.py``) so the EAGLE-3 demo runs with no network and no downloads.

The target is a 12-layer transformers ``LlamaForCausalLM`` over bytes (9.6M parameters), trained
on the Python sources of the CPython 3.11 standard library (PSF License Version 2, which permits
derived works; see ``assets/NOTICE.txt``), so it writes Python-like code. The draft is an
EAGLE-3 head (one layer, 1.1M parameters besides the shared embeddings) trained on that
target's own hidden states and outputs. The target is twelve layers deep so that one of its
decoding steps costs several draft steps, the regime speculative decoding is for. Both are shipped as
float16 safetensors under ``assets/`` and loaded in the dtype asked for.
"""
import json
import os
from typing import List, Optional, Sequence, Union

import torch

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
TARGET_CONFIG = os.path.join(ASSETS, "builtin_target.json")
TARGET_WEIGHTS = os.path.join(ASSETS, "builtin_target.safetensors")
DRAFT_CONFIG = os.path.join(ASSETS, "builtin_draft.json")
DRAFT_WEIGHTS = os.path.join(ASSETS, "builtin_draft.safetensors")

# The name the demo and the loaders accept in place of a path or hub id.
BUILTIN = "builtin"

# The target's architecture. head_dim 64 is one of the op's supported head sizes.
TARGET_ARCH = dict(
    vocab_size=264,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=12,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=256,
    eos_token_id=257,
    pad_token_id=258,
)


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, plus BOS/EOS/PAD; ids above 258 are never produced."""

    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = TARGET_ARCH["vocab_size"]

    def encode(self, text: str, add_bos: bool = True) -> List[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id] + ids if add_bos else ids

    def decode(self, ids: Union[Sequence[int], torch.Tensor]) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def __call__(self, text: str, return_tensors: Optional[str] = None):
        ids = self.encode(text)
        if return_tensors == "pt":
            return {"input_ids": torch.tensor([ids], dtype=torch.long)}
        return {"input_ids": ids}


def target_config(**overrides):
    """A LlamaConfig of TARGET_ARCH, with any keys given replaced."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**TARGET_ARCH, **overrides})


def builtin_assets_present() -> bool:
    return all(os.path.exists(p) for p in (TARGET_CONFIG, TARGET_WEIGHTS, DRAFT_CONFIG, DRAFT_WEIGHTS))


def load_builtin_target(dtype: torch.dtype = torch.float32, device="cpu", attn_implementation: str = "sdpa"):
    """The built-in byte-level Llama target, in eval mode."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    if not os.path.exists(TARGET_WEIGHTS):
        raise FileNotFoundError(
            f"built-in target weights not found at {TARGET_WEIGHTS}; run examples/train_builtin.py to create them"
        )
    with open(TARGET_CONFIG) as f:
        config = LlamaConfig(**json.load(f))
    config._attn_implementation = attn_implementation
    model = LlamaForCausalLM(config)
    model.load_state_dict(load_file(TARGET_WEIGHTS))
    return model.to(device=device, dtype=dtype).eval()


def load_builtin_draft(target, dtype: torch.dtype = torch.float32, device="cpu"):
    """The built-in EAGLE-3 draft for :func:`load_builtin_target`'s model."""
    from .eagle3 import load_eagle3_draft_files

    return load_eagle3_draft_files(DRAFT_CONFIG, DRAFT_WEIGHTS, target).to(device=device, dtype=dtype).eval()
