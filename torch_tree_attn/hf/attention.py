"""Hugging Face transformers integration: ``attn_implementation="tree_attn"``.

After :func:`register`, any decoder-only model whose attention goes through transformers'
``AttentionInterface`` (Llama, Qwen2/3, Mistral, Gemma 2/3/4, gpt-oss, ...) can be loaded with
``attn_implementation="tree_attn"`` (or switched with ``model.set_attn_implementation``)
and then

* runs ordinary prefill / decoding like ``"sdpa"`` / ``"eager"``: 2D padding masks,
  causal masking, sliding windows, Gemma-2 logit softcapping, dense 4D masks passed by
  the user (taken as final, as eager and sdpa take them);
* verifies a whole draft tree in one forward::

      model(input_ids=tree_tokens,                 # [B, T]
            position_ids=mask_offset[:, None] + depth,
            cache=cache,                           # or past_key_values=cache
            tree_mask=ancestor_mask,               # bool [B, T, T] ancestor-or-self
            mask_offset=mask_offset)               # int64 [B]: prefix lengths, cache slot of node 0

  Each layer's attention then calls :func:`torch_tree_attn.tree_attention` with
  ``mask=tree_mask, mask_offset=mask_offset`` (and gpt-oss's attention sinks): the cache slots before the tree are
  visible, the tree follows its mask, slots past ``prefix + T`` are never read, and no
  ``[T, S]`` mask exists anywhere (see "Dense fallbacks" for the cases that need one).

How the mask reaches the op
---------------------------
transformers builds the masks once per forward (``create_causal_mask`` and friends)
through the function registered in ``AttentionMaskInterface``; that function never sees
the model's extra keyword arguments, so it cannot know that a forward is a tree
verification. So it builds nothing of size ``[T, S]`` for causal masks: it returns a
*causal spec*, a small int64 tensor ``[B, 1, 1, 2 + K]`` (the key index of the first
query, the sliding window asked for, and the 2D padding flags of the ``K`` keys when
anything is padded, else ``K = 0``). Being 4D it passes through ``generate()`` and the
models untouched (transformers returns prepared 4D masks as they are); being integer it
cannot be mistaken for a user's bool / float mask. :func:`tree_attention_forward`
expands it only as far as the layer needs:

* ordinary forward, no padding, window inactive: ``mask=tril(T, T)`` at
  ``mask_offset=first query`` (decoding reads only keys up to the query);
* tree forward, no padding, window inactive: the compact tree form above;
* otherwise a bool ``[B, 1, T, S]`` mask built in the layer (see below).

Masks with custom overlays (image-token blocks), chunked or bidirectional masks, and compiled
single-token decoding into a static cache get the dense bool mask ``"sdpa"`` would get.

Dense fallbacks
---------------
* Padding (a 2D ``attention_mask`` with zeros): padded keys are hidden, in tree mode on
  top of the tree structure.
* A dense 4D mask together with ``tree_mask``: intersected with the tree structure (keys
  before the tree: as the dense mask says; tree keys: also only ancestors-or-self; keys
  after the tree: never).
* A sliding-window layer whose key tensor is longer than the window. In tree mode the
  window counts tree positions, for queries and keys alike: node i sits at ``prefix +
  depth(i)``, a key before the tree at its cache slot, and node i sees key k iff
  ``pos(i) - pos(k) < window`` (transformers' own masks would count cache slots, which is
  wrong for all but a chain: a tree node's slot ``prefix + j`` runs ahead of its depth). transformers' sliding cache layers keep
  at most ``window - 1`` old keys, so such masks are at most ``[B, 1, T, window - 1 + T]``.
  The window comes from the layer's ``sliding_window`` argument (checked against the
  mask's on CPU outside compiled code).

Batching
--------
transformers' caches write every batch row at the same cache slot, so within one
forward all rows' trees start at the same slot ``L`` (the cache length):
``mask_offset`` is ``L`` in every row. Rows with shorter real prefixes are
left-padded: pass the 2D ``attention_mask`` ``[B, L + T]`` and position ids that count
real tokens only (:func:`tree_forward` does both). The op itself takes per-row offsets,
so a cache that writes rows at different slots would work unchanged.

torch.compile
-------------
The attention and mask functions trace with ``fullgraph=True``. With a ``StaticCache``
and ``mask_offset`` passed as a tensor (same shape every step), consecutive verify
steps reuse one graph. A Python int / list for ``mask_offset`` is accepted but
becomes a constant of the graph (a recompile whenever it changes). Models with
sliding-window layers (Mistral, Gemma, gpt-oss) get transformers'
``StaticSlidingWindowLayer`` in a plain ``StaticCache``, which tracks its length in a
Python int that the graph guards on: those recompile per new cache length whatever the
attention, and once past the window the layer cannot be rolled back (``crop``) after a
verify step. :func:`verification_cache` gives them full-length layers instead (tree_attn
applies the window): one graph for every step.

Attention sinks (gpt-oss's ``s_aux``, the attention module's ``sinks``) are passed to the
op as its ``sinks``. Not supported (clear errors): attention dropout, a float
``tree_mask``. ``output_attentions`` returns no weights.

KV-cache compaction
-------------------
After verification, :func:`compact_kv_cache` keeps the accepted path in a DynamicCache /
StaticCache (the transformers-specific part of the loop; the tree logic itself is in
:mod:`torch_tree_attn.tree`, which does not import transformers).

transformers versions
---------------------
Supported: transformers 5.0 to 5.25 (tested: 5.0, 5.3, 5.4, 5.10, 5.13, 5.14, 5.17, 5.20,
5.22, 5.24, 5.25). Their cache and mask APIs differ (``cache=`` or ``past_key_values=``,
``q_length`` / ``q_offset`` or ``cache_position``, where cache layers keep their length,
when the causal skip is refused); :mod:`torch_tree_attn.hf.compat` detects and hides
each difference, :func:`tree_forward` passes the cache under whichever name the model's
forward declares. Before 5.14 transformers refuses its causal skip for every forward into
a ``StaticCache``; there the mask function tells such a forward from a mask with overlays
by the mask function it is given, and keeps the dense mask for the one call it cannot
tell from a cache-less forward over packed sequences: no 2D ``attention_mask`` and as
many keys as queries. For a tree that is a verify step at cache slot 0 on a sliding
layer whose window is shorter than the tree: its window is then counted in cache slots,
as transformers' own masks count it (pass a 2D ``attention_mask`` to avoid that).
"""
from typing import Optional, Tuple

import torch
from transformers import masking_utils
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from ..ops import tree_attention
from ..tree.structure import _mask_depths, _mask_offset_tensor
from . import compat as _compat


def register(name: str = "tree_attn") -> None:
    """Register the tree-attention implementation under ``name`` with transformers.

    Registers :func:`tree_attention_forward` in ``AttentionInterface`` and
    :func:`tree_attention_mask` in ``AttentionMaskInterface``. Idempotent. Call it before
    ``from_pretrained(..., attn_implementation=name)`` or
    ``model.set_attn_implementation(name)``.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register: name must be a non-empty string, got {name!r}")
    if "flash" in name:
        # transformers routes every implementation whose name mentions "flash" through its
        # flash-attention code paths (unpadded inputs, no 4D masks).
        raise ValueError(
            f"register: name must not contain 'flash' (transformers treats it as flash attention), got {name!r}"
        )
    # Read the installed transformers' behaviour here, outside any compiled code.
    _compat.static_caches_refuse_causal_skip()
    AttentionInterface.register(name, tree_attention_forward)
    AttentionMaskInterface.register(name, tree_attention_mask)


# --------------------------------------------------------------------------------------
# The mask function (AttentionMaskInterface)
# --------------------------------------------------------------------------------------
#
# A "causal spec" stands in for a causal mask: int64 [B, 1, 1, 2 + K] holding
#   [..., 0]   the key index just after the last query (q_offset - kv_offset + q_length):
#              the end, not the start, so that a layer that gets only the last queries
#              (Gemma 4's KV-shared layers under generate's logits_to_keep slice the
#              queries, and the mask along them, from the end) still finds its queries,
#   [..., 1]   the sliding window transformers asked for (0: none),
#   [..., 2:]  K = 0 when nothing is padded, else K = kv_length flags (1 = real key).
# Its size is O(B * S) at worst, never O(T * S). It is 4D, so transformers passes it on
# untouched (generate() included), and integer, so it cannot be confused with a user's
# bool / float mask.

_SPEC_QUERY_END, _SPEC_WINDOW, _SPEC_PADDING = 0, 1, 2


def tree_attention_mask(
    batch_size: int,
    q_length: Optional[int] = None,
    kv_length: int = 0,
    q_offset=None,
    kv_offset: int = 0,
    mask_function=masking_utils.causal_mask_function,
    attention_mask: Optional[torch.Tensor] = None,
    local_size: Optional[int] = None,
    allow_is_causal_skip: bool = True,
    device="cpu",
    **kwargs,
) -> Optional[torch.Tensor]:
    """Mask function for ``AttentionMaskInterface``.

    For a causal mask (possibly with padding and a sliding window, without custom
    overlays: transformers signals those with ``allow_is_causal_skip``, see
    :func:`torch_tree_attn.hf.compat.is_plain_causal_call` for the releases where that
    flag says more) returns a causal spec, int64 ``[batch_size, 1, 1, 2 + K]``, that
    :func:`tree_attention_forward` expands only as far as the layer needs. Otherwise
    (custom overlays, chunked or bidirectional masks, compiled single-token decoding into a
    static cache) returns what ``"sdpa"`` gets without its shortcut: a bool
    ``[batch_size, 1, q_length, kv_length]`` mask (True = attend), or None for an unmasked
    bidirectional attention.
    """
    q_length, q_offset, device, query_args = _compat.query_span(q_length, q_offset, kwargs, device)
    config = kwargs.get("config")
    # local_size is either the sliding window (which the spec carries) or another local
    # pattern such as chunked attention (which it cannot express).
    is_sliding_window = local_size is None or local_size == getattr(config, "sliding_window", None)
    is_plain_causal = _compat.is_plain_causal_call(
        masking_utils, mask_function, local_size, allow_is_causal_skip, kwargs.get("use_vmap", False),
        attention_mask, q_length, kv_length, kv_offset,
    )
    if not (is_plain_causal and is_sliding_window):
        return masking_utils.sdpa_mask(
            batch_size=batch_size,
            kv_length=kv_length,
            kv_offset=kv_offset,
            **query_args,
            mask_function=mask_function,
            attention_mask=attention_mask,
            local_size=local_size,
            allow_is_causal_skip=False,
            device=device,
            **kwargs,
        )
    header = torch.stack(
        [
            torch.as_tensor(q_offset, device=device, dtype=torch.int64).reshape(()) - kv_offset + q_length,
            torch.full((), local_size or 0, device=device, dtype=torch.int64),
        ]
    ).expand(batch_size, 2)
    padding = _padding_of_keys(attention_mask, kv_length, kv_offset)
    if padding is not None and not torch.compiler.is_compiling():
        # Keys after the last query are hidden by causality anyway (a static cache's
        # future slots): padding-free if every key up to there is real.
        causal_end = int(q_offset) - kv_offset + q_length
        if bool(padding[:, :causal_end].all()):
            padding = None
    if padding is not None:
        header = torch.cat([header, padding.to(device=device, dtype=torch.int64).expand(batch_size, -1)], dim=1)
    return header.reshape(batch_size, 1, 1, -1)


def _padding_of_keys(attention_mask, kv_length, kv_offset):
    """The 2D padding mask's flags for the layer's keys [kv_offset, kv_offset + kv_length);
    slots the 2D mask does not cover (a static cache's future) count as padding."""
    if attention_mask is None:
        return None
    missing = kv_offset + kv_length - attention_mask.shape[-1]
    if missing > 0:
        attention_mask = torch.nn.functional.pad(attention_mask, (0, missing))
    return attention_mask[:, kv_offset:kv_offset + kv_length]


def _is_causal_spec(attention_mask) -> bool:
    return (
        isinstance(attention_mask, torch.Tensor)
        and attention_mask.dim() == 4
        and attention_mask.shape[1:3] == (1, 1)
        and attention_mask.shape[3] >= 2
        and not attention_mask.dtype.is_floating_point
        and attention_mask.dtype != torch.bool
    )


class _CausalSpec:
    """A decoded causal spec for a layer's ``q_len`` queries (the last ones of the forward):
    first query index [B], padding bool [B, S] or None."""

    def __init__(self, spec: torch.Tensor, key_len: int, q_len: int, sliding_window: Optional[int]):
        spec = spec.reshape(spec.shape[0], -1)
        self.first_query = spec[:, _SPEC_QUERY_END] - q_len
        padded_keys = spec.shape[1] - _SPEC_PADDING
        if padded_keys == 0:
            self.padding = None
        elif padded_keys == key_len:
            self.padding = spec[:, _SPEC_PADDING:] != 0
        else:
            raise ValueError(
                f"tree_attn: the causal mask covers {padded_keys} keys but the layer has S={key_len}; "
                "was the mask built for another layer type?"
            )
        # The window is applied from the layer's sliding_window argument (a Python int, so
        # compiled graphs stay static); check it against the mask's where that is free.
        if spec.device.type == "cpu" and not torch.compiler.is_compiling():
            expected = int(spec[0, _SPEC_WINDOW])
            if expected != (sliding_window or 0):
                raise ValueError(
                    f"tree_attn: transformers built this layer's mask with sliding window {expected or None} but the "
                    f"attention layer passed sliding_window={sliding_window}; this model is not supported"
                )


# --------------------------------------------------------------------------------------
# The attention function (AttentionInterface)
# --------------------------------------------------------------------------------------


def tree_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    tree_mask: Optional[torch.Tensor] = None,
    mask_offset=None,
    s_aux: Optional[torch.Tensor] = None,
    **kwargs,
) -> Tuple[torch.Tensor, None]:
    """Attention function for ``AttentionInterface``.

    query ``[B, Hq, T, D]`` (after RoPE), key/value ``[B, Hkv, S, D]`` after the cache
    update, not repeated for GQA. ``attention_mask`` is what :func:`tree_attention_mask`
    returned, a dense 4D mask passed by the user, or None. ``sliding_window`` and
    ``softcap`` come from the attention layer, ``s_aux`` (gpt-oss's attention sinks, the
    module's ``sinks`` parameter, ``[Hq]``) too: it joins every row's softmax denominator.
    With ``tree_mask`` / ``mask_offset`` among the model's keyword arguments the forward is
    a tree verification. Returns ``(attn_output [B, T, Hq, D], None)``.
    """
    if dropout:
        raise ValueError(f"tree_attn: attention dropout is not supported (got dropout={dropout}); call model.eval()")
    if "tree_prefix_lens" in kwargs:
        raise TypeError("tree_attn: tree_prefix_lens was renamed mask_offset (the op's name for the prefix lengths)")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"tree_attn: sliding_window must be positive, got {sliding_window}")
    key_len = key.shape[2]
    q_len = query.shape[2]
    spec = _CausalSpec(attention_mask, key_len, q_len, sliding_window) if _is_causal_spec(attention_mask) else None
    dense = None if spec is not None else _check_dense_mask(attention_mask, query, key_len)
    if tree_mask is not None or mask_offset is not None:
        mask, mask_offset = _tree_mode_mask(query, key_len, spec, dense, tree_mask, mask_offset, sliding_window)
    elif spec is not None:
        mask, mask_offset = _causal_mask(query, key_len, spec, sliding_window)
    elif dense is not None:
        mask, mask_offset = dense, None  # a dense mask is final, as for eager and sdpa
    else:
        is_causal = kwargs.get("is_causal")
        if is_causal is None:
            is_causal = getattr(module, "is_causal", True)
        mask, mask_offset = _unmasked(query, key_len, is_causal)
    sinks = None if s_aux is None else s_aux.to(query.device)
    out = tree_attention(query, key, value, mask, mask_offset, scaling, softcap, sinks)
    return out.transpose(1, 2), None


def _check_dense_mask(attention_mask, query, key_len):
    if attention_mask is None:
        return None
    if not (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4):
        raise ValueError(
            "tree_attn: expected a 4D attention mask [B, 1, T, S] or None, got "
            f"{type(attention_mask).__name__} of shape {tuple(getattr(attention_mask, 'shape', ()))}"
        )
    return attention_mask.to(query.device)


def _window_is_active(sliding_window, key_len):
    # Every query is at most S - 1 positions after every key of the layer's S keys, so a
    # window of at least S excludes nothing.
    return sliding_window is not None and key_len > sliding_window


def _causal_mask(query, key_len, spec, sliding_window):
    batch, _, q_len, _ = query.shape
    device = query.device
    window_active = _window_is_active(sliding_window, key_len)
    if spec.padding is None and not window_active:
        causal = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()
        return causal[None, None], spec.first_query.expand(batch)
    query_index = spec.first_query[:, None] + torch.arange(q_len, device=device)[None, :]  # [B, T]
    distance = query_index[:, :, None] - torch.arange(key_len, device=device)[None, None, :]  # [B, T, S]
    visible = distance >= 0
    if window_active:
        visible = visible & (distance < sliding_window)
    if spec.padding is not None:
        visible = visible & spec.padding[:, None, :]
    return visible[:, None], None


def _unmasked(query, key_len, is_causal):
    batch, _, q_len, _ = query.shape
    if is_causal and q_len > 1:
        # sdpa's is_causal reading: upper-left aligned over the first T keys (a prefill,
        # also into a larger static cache); keys >= T are never read.
        causal = torch.ones(q_len, q_len, dtype=torch.bool, device=query.device).tril()
        return causal[None, None], None
    # Everything visible: an empty window after all S keys ("keys < offset are attended").
    everything = torch.ones(1, 1, q_len, 0, dtype=torch.bool, device=query.device)
    return everything, torch.full((batch,), key_len, dtype=torch.int64, device=query.device)


def _tree_mode_mask(query, key_len, spec, dense, tree_mask, mask_offset, sliding_window):
    batch, _, q_len, _ = query.shape
    device = query.device
    if tree_mask is None or mask_offset is None:
        raise ValueError(
            "tree_attn: tree verification needs both tree_mask and mask_offset, got "
            f"tree_mask={'None' if tree_mask is None else tuple(tree_mask.shape)}, "
            f"mask_offset={'None' if mask_offset is None else mask_offset!r}"
        )
    tree_mask = _check_tree_mask(tree_mask, batch, q_len, device)
    # Values are checked by the op on CPU; elsewhere reading them would sync.
    prefix = _mask_offset_tensor(mask_offset, batch, device, check_values=False).expand(batch)
    if dense is not None and dense.shape[-1] != key_len:
        raise ValueError(
            f"tree_attn: the 4D attention_mask covers {dense.shape[-1]} keys but the layer has S={key_len} "
            f"(mask shape {tuple(dense.shape)})"
        )
    padding = spec.padding if spec is not None else None

    tree_start = prefix
    if sliding_window is not None:
        # transformers' sliding cache layers may have evicted old keys: then the key tensor
        # ends with the tree, and key index j holds cache slot j + evicted.
        evicted = (prefix + q_len - key_len).clamp(min=0)
        tree_start = prefix - evicted
    if spec is not None and device.type == "cpu" and not torch.compiler.is_compiling():
        # transformers knows where this forward's tokens went: the tree must start there.
        if not bool((tree_start == spec.first_query).all()):
            raise ValueError(
                f"tree_attn: mask_offset {prefix.tolist()} does not match the cache: this forward's tokens "
                f"were written at cache slot {spec.first_query.tolist()} of this layer's keys (transformers' "
                "caches write every row at the cache length)"
            )
    # A dense mask is final (as for eager / sdpa): no window on top of it.
    window_active = dense is None and _window_is_active(sliding_window, key_len)

    if dense is None and padding is None and not window_active:
        return tree_mask, tree_start

    visible = _expand_tree_mask(tree_mask, tree_start, batch, q_len, key_len)
    if padding is not None:
        visible = visible & padding[:, None, :]
    if window_active:
        # By tree position, for queries and keys alike: tree node i sits at position
        # prefix + depth(i), not at its cache slot prefix + i; a key before the tree at its
        # slot. Key index j holds cache slot j + evicted.
        depth = _mask_depths(tree_mask).expand(batch, q_len)  # [B, T]
        query_pos = prefix[:, None] + depth  # [B, T]
        key_slot = torch.arange(key_len, device=device)[None, :] + evicted[:, None]  # [B, S]
        rel = key_slot - prefix[:, None]  # [B, S]: index in the tree for tree keys
        tree_key_pos = prefix[:, None] + depth.gather(1, rel.clamp(0, q_len - 1))
        key_pos = torch.where(rel >= 0, tree_key_pos, key_slot)  # keys after the tree are hidden anyway
        visible = visible & (query_pos[:, :, None] - key_pos[:, None, :] < sliding_window)
    visible = visible[:, None]  # [B, 1, T, S]
    if dense is None:
        return visible, None
    if dense.dtype == torch.bool:
        return dense & visible, None
    return torch.where(visible, dense, torch.tensor(float("-inf"), dtype=dense.dtype, device=device)), None


def _expand_tree_mask(tree_mask, tree_start, batch, q_len, key_len):
    """bool [B, T, S]: keys before the tree visible, tree keys per the tree mask, later keys not."""
    rel = torch.arange(key_len, device=tree_mask.device)[None, :] - tree_start[:, None]  # [B, S]
    in_tree = (rel >= 0) & (rel < q_len)
    columns = rel.clamp(0, q_len - 1)[:, None, :].expand(batch, q_len, key_len)
    tree_cols = torch.gather(tree_mask.expand(batch, q_len, q_len), 2, columns)
    return (rel < 0)[:, None, :] | (in_tree[:, None, :] & tree_cols)


def _check_tree_mask(tree_mask, batch, q_len, device):
    if not isinstance(tree_mask, torch.Tensor):
        raise TypeError(f"tree_attn: tree_mask must be a tensor, got {type(tree_mask).__name__}")
    if tree_mask.dtype.is_floating_point or tree_mask.is_complex():
        raise TypeError(f"tree_attn: tree_mask must be bool (True = ancestor-or-self), got {tree_mask.dtype}")
    if tree_mask.dim() == 2:
        tree_mask = tree_mask[None]
    if tree_mask.dim() != 3 or tree_mask.shape[1:] != (q_len, q_len) or tree_mask.shape[0] not in (1, batch):
        raise ValueError(
            f"tree_attn: tree_mask must have shape [B={batch} or 1, T={q_len}, T={q_len}] (T = number of tree "
            f"tokens), got {tuple(tree_mask.shape)}"
        )
    return tree_mask.to(device=device, dtype=torch.bool)
