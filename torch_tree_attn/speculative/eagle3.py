"""The EAGLE-3 draft model: checkpoint layout, forward pass with its own KV cache, and the
``expand`` callback that grows a dynamic draft tree with it.

An EAGLE-3 draft is one decoder layer that reads the target model's own hidden states. For the
committed sequence, the target's low, middle and high layer inputs (HF ``hidden_states[2]``,
``[L // 2]`` and ``[L - 3]``) are concatenated and fused by ``fc`` (3·Ht -> H). The layer input
at position t is ``cat(input_layernorm(embed(x[t + 1])), hidden_norm(h[t]))`` (2H wide, token
embedding first), so q/k/v project 2H -> heads·head_dim; the residual stream starts at
``h[t]``. Its own LM head covers a reduced draft vocabulary; ``target_id = draft_id +
d2t[draft_id]``. Inside the tree, a node's hidden state is the draft's own output at its
parent (no ``fc``), and its attention sees the committed prefix plus its tree ancestors; only
the K/V of committed positions survive a round.

Checkpoints load from, and save to, the layout of the public EAGLE-3 releases (SafeAILab/EAGLE):
``config.json`` plus ``pytorch_model.bin`` or ``model.safetensors`` with the names ``fc``,
``midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}``,
``midlayer.self_attn.{q,k,v,o}_proj``, ``midlayer.mlp.{gate,up,down}_proj``, ``norm``,
``lm_head``, buffers ``d2t`` / ``t2d``; ``embed_tokens`` is optional and copied from the target
when absent.
"""
import json
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "Eagle3Config",
    "Eagle3Draft",
    "DraftKVCache",
    "Eagle3Drafter",
    "feature_layer_ids",
    "capture_target_features",
    "load_eagle3_draft",
    "load_eagle3_draft_files",
    "save_eagle3_draft",
]


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


@dataclass
class Eagle3Config:
    """The keys of a public EAGLE-3 ``config.json`` that shape the draft."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: Optional[int] = None
    target_hidden_size: Optional[int] = None
    head_dim: Optional[int] = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    # Which target layers feed fc, when the checkpoint says (else 2, L // 2, L - 3).
    aux_hidden_state_layer_ids: Optional[List[int]] = None
    extra: Dict = field(default_factory=dict)  # other keys, written back unchanged

    def __post_init__(self):
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                    f"({self.num_attention_heads}) and the config has no head_dim"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, vocab_size={self.vocab_size}], got {self.draft_vocab_size}")
        if self.rope_theta is None:
            self.rope_theta = 10000.0

    _KNOWN = (
        "hidden_size num_attention_heads num_key_value_heads intermediate_size vocab_size draft_vocab_size "
        "target_hidden_size head_dim hidden_act rms_norm_eps max_position_embeddings rope_theta rope_scaling"
    ).split()

    @classmethod
    def from_dict(cls, d: dict) -> "Eagle3Config":
        missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size") if k not in d]
        if missing:
            raise ValueError(f"EAGLE-3 config is missing keys {missing}; keys present: {sorted(d)}")
        kwargs = {k: d[k] for k in cls._KNOWN if k in d and d[k] is not None}
        kwargs.setdefault("num_key_value_heads", d["num_attention_heads"])
        layer_ids = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        extra = {k: v for k, v in d.items() if k not in cls._KNOWN}
        return cls(**kwargs, aux_hidden_state_layer_ids=layer_ids, extra=extra)

    def to_dict(self) -> dict:
        d = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "tie_word_embeddings": False,
        }
        d.update(self.extra)
        for k in self._KNOWN:
            d[k] = getattr(self, k)
        if self.aux_hidden_state_layer_ids is not None:
            d.setdefault("eagle_config", {})["eagle_aux_hidden_state_layer_ids"] = list(self.aux_hidden_state_layer_ids)
        return d


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    table = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu,
             "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
    if name not in table:
        raise ValueError(f"hidden_act {name!r} is not supported; expected one of {sorted(table)}")
    return table[name]


class Rotary(nn.Module):
    """Llama rotary embedding; rope_scaling types "linear", "dynamic" and "llama3"."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.head_dim = config.head_dim
        self.base = float(config.rope_theta)
        self.max_positions = config.max_position_embeddings
        scaling = dict(config.rope_scaling or {})
        self.kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
        if self.kind not in ("default", "linear", "dynamic", "llama3"):
            raise ValueError(f"rope_scaling type {self.kind!r} is not supported (linear, dynamic, llama3)")
        self.factor = float(scaling.get("factor", 1.0))
        self.scaling = scaling
        self.register_buffer("inv_freq", self._inv_freq(self.base), persistent=False)

    def _inv_freq(self, base: float) -> torch.Tensor:
        inv = 1.0 / (base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim))
        if self.kind == "llama3":
            low = float(self.scaling.get("low_freq_factor", 1.0))
            high = float(self.scaling.get("high_freq_factor", 4.0))
            old_len = float(self.scaling.get("original_max_position_embeddings", 8192))
            wavelen = 2 * math.pi / inv
            smooth = ((old_len / wavelen) - low) / (high - low)
            scaled = torch.where(wavelen > old_len / low, inv / self.factor, inv)
            middle = (wavelen <= old_len / low) & (wavelen >= old_len / high)
            inv = torch.where(middle, (1 - smooth) * inv / self.factor + smooth * inv, scaled)
        return inv.float()

    def forward(self, position_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [*position_ids.shape, head_dim] (float32)."""
        inv_freq = self.inv_freq.to(position_ids.device)
        positions = position_ids.float()
        if self.kind == "linear":
            positions = positions / self.factor
        elif self.kind == "dynamic":
            # NTK-aware base growth once the sequence outgrows the trained length (as the
            # reference does, keyed on the largest position seen in this call).
            seq_len = int(position_ids.max().item()) + 1
            if seq_len > self.max_positions:
                base = self.base * (
                    (self.factor * seq_len / self.max_positions) - (self.factor - 1)
                ) ** (self.head_dim / (self.head_dim - 2))
                inv_freq = self._inv_freq(base).to(position_ids.device)
        angles = positions[..., None] * inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, heads, n, D]; cos/sin: [B, n, D]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    return x * cos + rotated * sin


class Eagle3Attention(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(2 * h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)


class Eagle3MLP(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = _activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Eagle3MidLayer(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.mlp = Eagle3MLP(config)


# An attention function of the decoder layer: (q [B, Hq, n, D], k_new, v_new [B, Hkv, n, D])
# -> [B, Hq, n, D]. It owns where the new K/V go and which keys each query sees.
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DraftKVCache:
    """The draft's K/V for one sequence: preallocated [1, Hkv, capacity, D], grown by doubling.

    ``length`` entries are live. Committed (real-feature) positions come first; tree nodes
    are appended behind them during one tree build and dropped with :meth:`crop`.
    """

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device, capacity: int = 256):
        self.keys = torch.empty(1, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[2]
        if self.length + n > self.keys.shape[2]:
            capacity = max(2 * self.keys.shape[2], self.length + n)
            grown_k = self.keys.new_empty(*self.keys.shape[:2], capacity, self.keys.shape[3])
            grown_v = torch.empty_like(grown_k)
            grown_k[:, :, : self.length] = self.keys[:, :, : self.length]
            grown_v[:, :, : self.length] = self.values[:, :, : self.length]
            self.keys, self.values = grown_k, grown_v
        self.keys[:, :, self.length : self.length + n] = k
        self.values[:, :, self.length : self.length + n] = v
        self.length += n

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"crop length must be in [0, {self.length}], got {length}")
        self.length = length


# --------------------------------------------------------------------------------------------
# The draft model
# --------------------------------------------------------------------------------------------


class Eagle3Draft(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)  # frozen copy of the target's
        self.fc = nn.Linear(3 * config.target_hidden_size, h, bias=False)
        self.midlayer = Eagle3MidLayer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.rotary = Rotary(config)
        # Identity mapping until a checkpoint or set_vocab_map says otherwise.
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(config.vocab_size) < config.draft_vocab_size)

    # -- vocabulary ---------------------------------------------------------------------------

    def set_vocab_map(self, draft_to_target_ids: torch.Tensor) -> None:
        """Use the given target ids (one per draft id, distinct) as the draft vocabulary."""
        ids = torch.as_tensor(draft_to_target_ids, dtype=torch.long).flatten()
        v, dv = self.config.vocab_size, self.config.draft_vocab_size
        if ids.numel() != dv or ids.min() < 0 or ids.max() >= v or ids.unique().numel() != dv:
            raise ValueError(f"draft_to_target_ids must be {dv} distinct ids in [0, {v}), got {ids.numel()} "
                             f"(range {int(ids.min())}..{int(ids.max())}, {ids.unique().numel()} distinct)")
        self.d2t.copy_(ids - torch.arange(dv))
        self.t2d.zero_()
        self.t2d[ids] = True

    def target_ids(self) -> torch.Tensor:
        """Target id of every draft id: draft_id + d2t[draft_id]."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    @property
    def maps_vocab(self) -> bool:
        return self.config.draft_vocab_size != self.config.vocab_size

    # -- forward pieces -----------------------------------------------------------------------

    def fuse(self, target_features: torch.Tensor) -> torch.Tensor:
        """[..., 3·Ht] concatenated low/mid/high target hidden states -> [..., H]."""
        return self.fc(target_features.to(self.fc.weight.dtype))

    def decoder(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                attention: AttentionFn) -> torch.Tensor:
        """The draft layer on [B, n] tokens and [B, n, H] hidden states -> [B, n, H] (pre-norm).

        ``position_ids`` is [B, n], or [B, 1] when all n tokens sit at one position (a tree
        frontier): the rotary angles are then computed once and broadcast."""
        layer, attn = self.midlayer, self.midlayer.self_attn
        b, n, _ = hidden.shape
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        q = attn.q_proj(x).view(b, n, attn.num_heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, n, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, n, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        cos, sin = self.rotary(position_ids)
        q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        out = attention(q, k, v).transpose(1, 2).reshape(b, n, attn.num_heads * attn.head_dim)
        h = hidden + attn.o_proj(out)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] draft outputs -> [..., draft_vocab] logits."""
        return self.lm_head(self.norm(hidden))

    def target_logprobs(self, hidden: torch.Tensor, target_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[..., H] -> [..., vocab] log-probs over TARGET ids (-inf outside the draft vocabulary).

        ``target_ids``: :meth:`target_ids`, when the caller already holds it."""
        logits = self.draft_logits(hidden)
        logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        if not self.maps_vocab:
            return logp
        full = logp.new_full((*logp.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.target_ids() if target_ids is None else target_ids, logp)

    def new_cache(self, capacity: int = 256) -> DraftKVCache:
        return DraftKVCache(self.config.num_key_value_heads, self.config.head_dim, self.fc.weight.dtype,
                            self.fc.weight.device, capacity)

    def forward_cached(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                       cache: DraftKVCache, mask: torch.Tensor, mask_offset: int) -> torch.Tensor:
        """Append n new entries to ``cache`` and run the layer on them (batch 1).

        Key j < mask_offset is attended by every query (the committed prefix); keys
        ``[mask_offset, cache.length + n)`` follow ``mask`` ([n, cache.length + n - mask_offset],
        True = attend). Uses the tree attention op, so no [n, S] mask is built.
        """
        from ..ops import tree_attention

        def attend(q, k, v):
            cache.append(k, v)
            s = cache.length
            if mask.shape != (q.shape[2], s - mask_offset):
                raise ValueError(f"mask must be [{q.shape[2]}, {s - mask_offset}] (queries, cache "
                                 f"length {s} - mask_offset {mask_offset}), got {tuple(mask.shape)}")
            offset = torch.tensor([mask_offset], dtype=torch.int64, device=q.device)
            return tree_attention(q, cache.keys[:, :, :s], cache.values[:, :, :s], mask[None], offset)

        return self.decoder(input_ids, hidden, position_ids, attend)


# --------------------------------------------------------------------------------------------
# Target features
# --------------------------------------------------------------------------------------------


def feature_layer_ids(num_target_layers: int, config: Optional[Eagle3Config] = None) -> List[int]:
    """Which HF ``hidden_states`` entries (inputs to those layers) feed fc: low, mid, high."""
    if config is not None and config.aux_hidden_state_layer_ids is not None:
        # Checkpoints that name layers give the layer whose OUTPUT is used: hidden_states[i + 1].
        return [i + 1 for i in config.aux_hidden_state_layer_ids]
    n = num_target_layers
    return [min(2, n - 1), n // 2, max(n - 3, 0)]


def capture_target_features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """cat(low, mid, high) from a model output's ``hidden_states`` (``output_hidden_states=True``)."""
    return torch.cat([hidden_states[i] for i in layer_ids], dim=-1)


# --------------------------------------------------------------------------------------------
# The tree-building state
# --------------------------------------------------------------------------------------------


class Eagle3Drafter:
    """Runs the draft for a speculative-decoding loop (batch 1).

    Protocol per round:
      1. :meth:`commit` the tokens that follow the last committed draft position with the
         target features of the positions before them (after prefill: prompt[1:] + first token
         with the prompt's features; after verification: accepted[1:] + bonus with the accepted
         nodes' features).
      2. ``build_dynamic_tree(root_token, drafter.expand, ...)``: the first ``expand`` runs the
         committed inputs (the last of which is the root) and returns the root's next-token
         log-probs; later calls run the tree frontier over prefix + ancestors.
      3. :meth:`end_tree` drops the tree's entries from the draft cache.
    """

    def __init__(self, draft: Eagle3Draft, capacity: int = 256):
        self.draft = draft
        self.cache = draft.new_cache(capacity)
        self.committed = 0  # draft cache entries from real target features
        self._pending_ids: Optional[torch.Tensor] = None
        self._pending_features: Optional[torch.Tensor] = None
        self._node_hidden: Optional[torch.Tensor] = None  # draft outputs of all expanded nodes
        self._target_ids: Optional[torch.Tensor] = None

    def reset(self) -> None:
        self.cache.crop(0)
        self.committed = 0
        self._pending_ids = self._pending_features = self._node_hidden = None

    def commit(self, next_token_ids: torch.Tensor, target_features: torch.Tensor) -> None:
        """Queue n new committed positions: token ids [n] and target features [n, 3·Ht]."""
        ids = next_token_ids.reshape(-1)
        feats = target_features.reshape(ids.numel(), -1)
        if self._pending_ids is not None:
            ids = torch.cat([self._pending_ids, ids])
            feats = torch.cat([self._pending_features, feats])
        self._pending_ids, self._pending_features = ids, feats

    @torch.no_grad()
    def expand(self, step) -> torch.Tensor:
        """The ``expand`` callback of :func:`torch_tree_attn.tree.build_dynamic_tree`: log-probs
        [n, vocab] over target ids of the next token after each frontier node."""
        draft = self.draft
        device = draft.fc.weight.device
        if step.depth == 0:
            if self._pending_ids is None or self._pending_ids.numel() == 0:
                raise RuntimeError("Eagle3Drafter.expand at depth 0 needs commit() first")
            self.cache.crop(self.committed)  # a previous tree's nodes, if end_tree was skipped
            n = self._pending_ids.numel()
            ids = self._pending_ids.to(device)[None]
            hidden = draft.fuse(self._pending_features.to(device))[None]
            positions = torch.arange(self.committed, self.committed + n, device=device)[None]
            causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
            out = draft.forward_cached(ids, hidden, positions, self.cache, causal, self.committed)
            self.committed += n
            self._pending_ids = self._pending_features = None
            self._node_hidden = out[0, -1:]  # the root: the last committed position
            self._target_ids = draft.target_ids()  # once per tree, not once per frontier
            return draft.target_logprobs(self._node_hidden, self._target_ids)
        # A frontier of tree nodes: hidden state = the draft's output at the parent.
        parents = torch.as_tensor(step.parents_in_tree, device=device)
        hidden = self._node_hidden[parents][None]
        ids = torch.as_tensor(step.tokens, device=device)[None]
        # Every node of a frontier sits at the same depth, so one rotary position serves all
        # (the decoder broadcasts a [1, 1] position over the frontier).
        positions = torch.full((1, 1), self.committed - 1 + step.depth, dtype=torch.int64, device=device)
        # The root's K/V is the last committed entry (always visible as prefix): drop its column.
        mask = torch.as_tensor(step.ancestor_mask, device=device)[:, 1:]
        out = draft.forward_cached(ids, hidden, positions, self.cache, mask, self.committed)
        self._node_hidden = torch.cat([self._node_hidden, out[0]])
        return draft.target_logprobs(out[0], self._target_ids)

    def end_tree(self) -> None:
        self.cache.crop(self.committed)
        self._node_hidden = None


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------

_BIN, _SAFETENSORS, _CONFIG = "pytorch_model.bin", "model.safetensors", "config.json"


def _read_state_dict(path: str) -> Dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def _resolve_checkpoint(path_or_id: str) -> Tuple[str, str]:
    """(config path, weights path) for a local directory or a Hugging Face hub id."""
    if os.path.isdir(path_or_id):
        config = os.path.join(path_or_id, _CONFIG)
        for name in (_BIN, _SAFETENSORS):
            weights = os.path.join(path_or_id, name)
            if os.path.exists(weights) and os.path.exists(config):
                return config, weights
        raise FileNotFoundError(f"{path_or_id!r} needs {_CONFIG} and {_BIN} or {_SAFETENSORS}; "
                                f"found {sorted(os.listdir(path_or_id))}")
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as e:  # pragma: no cover
        raise FileNotFoundError(f"{path_or_id!r} is not a directory and huggingface_hub is not installed") from e
    config = hf_hub_download(path_or_id, _CONFIG)
    for name in (_BIN, _SAFETENSORS):
        try:
            return config, hf_hub_download(path_or_id, name)
        except Exception:  # noqa: BLE001  (the next name may exist)
            continue
    raise FileNotFoundError(f"hub repo {path_or_id!r} has neither {_BIN} nor {_SAFETENSORS}")


def load_eagle3_draft_files(config_path: str, weights_path: str, target=None) -> Eagle3Draft:
    """Build a draft from a config.json and a weights file in the public EAGLE-3 layout.

    Like the reference, loading is non-strict about missing entries: ``embed_tokens.weight``
    is normally absent and is copied from ``target``'s input embeddings; ``d2t``/``t2d`` absent
    means the identity mapping. Entries present must have the expected shape, and unknown
    names are reported with a warning.
    """
    with open(config_path) as f:
        config = Eagle3Config.from_dict(json.load(f))
    state = _read_state_dict(weights_path)
    draft = Eagle3Draft(config)
    expected = draft.state_dict()
    for name, tensor in state.items():
        if name in expected and tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"{weights_path}: {name} has shape {tuple(tensor.shape)}, the config "
                             f"({config_path}) implies {tuple(expected[name].shape)}")
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if unexpected:
        warnings.warn(f"{weights_path}: ignored entries not in the EAGLE-3 layout: {unexpected}")
    if "embed_tokens.weight" in missing:
        if target is None:
            raise ValueError(f"{weights_path} has no embed_tokens.weight; pass the target model to copy it from")
        emb = target.get_input_embeddings().weight
        if tuple(emb.shape) != (config.vocab_size, config.hidden_size):
            raise ValueError(f"target embeddings are {tuple(emb.shape)}, the draft expects "
                             f"({config.vocab_size}, {config.hidden_size})")
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(emb.detach().to(draft.embed_tokens.weight.dtype).cpu())
    weights_missing = [m for m in missing if m not in ("embed_tokens.weight", "d2t", "t2d")]
    if weights_missing:
        raise ValueError(f"{weights_path} lacks draft weights {weights_missing}")
    if "d2t" in state and "t2d" not in state:
        draft.t2d.zero_()
        draft.t2d[draft.target_ids()] = True
    return draft.eval()


def load_eagle3_draft(path_or_id: str, target=None) -> Eagle3Draft:
    """Load an EAGLE-3 draft from a directory or hub id (config.json + pytorch_model.bin or
    model.safetensors, the public EAGLE-3 layout). The target supplies embed_tokens when the
    checkpoint has none; it is also checked against the draft's vocabulary and hidden size."""
    config_path, weights_path = _resolve_checkpoint(path_or_id)
    draft = load_eagle3_draft_files(config_path, weights_path, target)
    if target is not None:
        cfg = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
        if getattr(cfg, "hidden_size", draft.config.target_hidden_size) != draft.config.target_hidden_size:
            raise ValueError(f"target hidden_size {cfg.hidden_size} != draft target_hidden_size "
                             f"{draft.config.target_hidden_size}")
    return draft


def save_eagle3_draft(draft: Eagle3Draft, directory: str, safetensors: bool = True,
                      include_embeddings: bool = False, dtype: Optional[torch.dtype] = None) -> str:
    """Write ``config.json`` and ``model.safetensors`` (or ``pytorch_model.bin``) in the public
    EAGLE-3 layout; embed_tokens is left out unless asked, as the releases do."""
    os.makedirs(directory, exist_ok=True)
    state = {}
    for name, tensor in draft.state_dict().items():
        if name == "embed_tokens.weight" and not include_embeddings:
            continue
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        state[name] = tensor.detach().cpu().contiguous()
    with open(os.path.join(directory, _CONFIG), "w") as f:
        json.dump(draft.config.to_dict(), f, indent=2)
    if safetensors:
        from safetensors.torch import save_file

        path = os.path.join(directory, _SAFETENSORS)
        save_file(state, path, metadata={"format": "pt"})
    else:
        path = os.path.join(directory, _BIN)
        torch.save(state, path)
    return path
