"""The built-in target LM and its EAGLE-3 draft: small models this project trained itself
(``examples/train_builtin.py``) so the EAGLE-3 demo runs with no network and no downloads.

The target is a 12-layer transformers ``LlamaForCausalLM`` over bytes (9.6M parameters), trained
on the Python sources of the CPython 3.11 standard library (PSF License Version 2, which permits
derived works; see ``examples/assets/NOTICE.txt``), so it writes Python-like code. The draft is an
EAGLE-3 head (one layer, 1.1M parameters besides the shared embeddings) trained on that
target's own hidden states and outputs. The target is twelve layers deep so that one of its
decoding steps costs several draft steps, the regime speculative decoding is for. Both are kept as
float16 safetensors in the repository's ``examples/assets/`` (not in the wheel: 21 MB of demo
weights) and loaded in the dtype asked for.

Where the weights are looked for (:func:`assets_dir`): the ``assets`` argument of the loaders,
else the environment variable ``TORCH_TREE_ATTN_ASSETS``, else ``examples/assets`` of the
checkout this package is imported from (an editable install or PYTHONPATH). An installed wheel
has no checkout beside it: point one of the first two at a copy of ``examples/assets``.
"""
import json
import os
from typing import List, Optional, Sequence, Union

import torch

# The environment variable that names the assets directory (see assets_dir).
ASSETS_ENV = "TORCH_TREE_ATTN_ASSETS"
# The file names inside the assets directory.
TARGET_CONFIG = "builtin_target.json"
TARGET_WEIGHTS = "builtin_target.safetensors"
DRAFT_CONFIG = "builtin_draft.json"
DRAFT_WEIGHTS = "builtin_draft.safetensors"
ASSET_FILES = (TARGET_CONFIG, TARGET_WEIGHTS, DRAFT_CONFIG, DRAFT_WEIGHTS)


def checkout_assets_dir() -> str:
    """``examples/assets`` of the checkout this package lies in (it need not exist: an
    installed package has no checkout beside it)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # torch_tree_attn/
    return os.path.join(os.path.dirname(package), "examples", "assets")


def assets_dir(assets: Optional[str] = None) -> str:
    """The directory the built-in models are read from: ``assets`` if given, else
    $TORCH_TREE_ATTN_ASSETS if set and non-empty, else :func:`checkout_assets_dir`. Not
    checked for existence (see :func:`find_assets`)."""
    if assets:
        return os.path.abspath(os.fspath(assets))
    env = os.environ.get(ASSETS_ENV)
    if env:
        return os.path.abspath(env)
    return checkout_assets_dir()


def _where(assets: Optional[str]) -> str:
    """How assets_dir chose its answer, for error messages."""
    if assets:
        return "the directory passed as assets"
    if os.environ.get(ASSETS_ENV):
        return f"${ASSETS_ENV}"
    return f"the checkout's examples/assets (no assets argument, ${ASSETS_ENV} unset)"


def missing_assets(assets: Optional[str] = None) -> List[str]:
    """The built-in model files absent from assets_dir(assets), as full paths."""
    root = assets_dir(assets)
    return [os.path.join(root, name) for name in ASSET_FILES if not os.path.isfile(os.path.join(root, name))]


def builtin_assets_present(assets: Optional[str] = None) -> bool:
    return not missing_assets(assets)


def find_assets(assets: Optional[str] = None) -> str:
    """assets_dir(assets), or FileNotFoundError naming where it looked and what is missing."""
    missing = missing_assets(assets)
    root = assets_dir(assets)
    if missing:
        names = ", ".join(os.path.basename(p) for p in missing)
        raise FileNotFoundError(
            f"built-in model files not found: looked in {root} ({_where(assets)}); missing {names}. "
            f"Pass assets=<dir> or set {ASSETS_ENV} to a copy of the repository's examples/assets, "
            "or run examples/train_builtin.py to create them")
    return root


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


def load_builtin_target(dtype: torch.dtype = torch.float32, device="cpu", attn_implementation: str = "sdpa",
                        assets: Optional[str] = None):
    """The built-in byte-level Llama target, in eval mode, from :func:`find_assets`'s directory."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    root = find_assets(assets)
    with open(os.path.join(root, TARGET_CONFIG)) as f:
        config = LlamaConfig(**json.load(f))
    config._attn_implementation = attn_implementation
    model = LlamaForCausalLM(config)
    model.load_state_dict(load_file(os.path.join(root, TARGET_WEIGHTS)))
    return model.to(device=device, dtype=dtype).eval()


def load_builtin_draft(target, dtype: torch.dtype = torch.float32, device="cpu", assets: Optional[str] = None):
    """The built-in EAGLE-3 draft for :func:`load_builtin_target`'s model."""
    from .eagle3 import load_eagle3_draft_files

    root = find_assets(assets)
    draft = load_eagle3_draft_files(os.path.join(root, DRAFT_CONFIG), os.path.join(root, DRAFT_WEIGHTS), target)
    return draft.to(device=device, dtype=dtype).eval()
