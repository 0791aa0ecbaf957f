"""The one place that knows how the supported transformers 5.x releases differ.

transformers changed its cache and masking APIs several times within 5.x. Each difference
that torch_tree_attn depends on is hidden here behind a small function, and
:mod:`torch_tree_attn.hf`, :mod:`torch_tree_attn.tree` and the tests use these functions and
nothing version-specific of their own. Differences are detected from the installed
transformers itself (a signature, an attribute, the arguments a mask function receives);
the version number decides only the one behaviour that nothing else shows
(:func:`static_caches_refuse_causal_skip`). Importing this module does not import
transformers (``tree`` uses it too); the version is read when first asked for.

The differences, with the releases that changed them:

* The cache argument of model forwards: ``past_key_values=`` until 5.23, ``cache=`` from
  5.24 (``past_key_values=`` a deprecated alias there). :func:`cache_argument`.
* How ``AttentionMaskInterface`` functions are told where the queries are: by
  ``cache_position`` (a tensor of the queries' cache slots) until 5.3, by ``q_length`` and
  ``q_offset`` from 5.4. :func:`query_span`.
* When transformers refuses its causal skip (``allow_is_causal_skip=False``) for a forward
  into a StaticCache: for every forward until 5.13, for single-token decoding only from
  5.14. :func:`is_plain_causal_call`.
* Where a cache layer keeps its length. Dynamic layers: the key tensor's length, and
  sliding ones an int ``cumulative_length``, throughout. ``StaticLayer``: until 5.3 no
  length at all (``get_seq_length`` counts the key slots that are not all zeros, and the
  model writes at the slots it derives from that), from 5.4 a tensor ``cumulative_length``
  that also decides where the next tokens are written. ``StaticSlidingWindowLayer``: an
  int ``cumulative_length`` until 5.3; from 5.4 the inherited tensor plus an int
  ``cumulative_length_int``. :func:`records_its_length`, :func:`set_layer_length`.
* ``crop``: static layers have none until 5.23; dynamic layers take a negative count of
  tokens to remove throughout (a positive number was a target length in early releases
  and is an error in later ones). :func:`crop`.
"""
import inspect
import re

import torch

__all__ = [
    "cache_argument",
    "cache_kwargs",
    "query_span",
    "static_caches_refuse_causal_skip",
    "is_plain_causal_call",
    "layer_length",
    "records_its_length",
    "set_layer_length",
    "crop",
]


# --------------------------------------------------------------------------------------
# Model forwards
# --------------------------------------------------------------------------------------


def cache_argument(model) -> str:
    """The name under which ``model``'s forward takes the KV cache: ``"cache"`` where the
    forward declares it, else ``"past_key_values"``. A ``torch.compile``'d model is looked
    at through its original module."""
    forward = getattr(model, "_orig_mod", model).forward
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """``{name: cache}`` for ``model(..., **cache_kwargs(model, cache))``."""
    return {cache_argument(model): cache}


# --------------------------------------------------------------------------------------
# Mask functions (AttentionMaskInterface)
# --------------------------------------------------------------------------------------


def query_span(q_length, q_offset, kwargs, device):
    """Where the queries of a mask-function call are, whichever way transformers said it.

    Takes the call's ``q_length`` / ``q_offset`` (None when transformers passed
    ``cache_position`` instead; it is then in ``kwargs``, and is popped from there) and
    returns ``(q_length, q_offset, device, query_args)``: the number of queries, the key
    index of the first one (int or 0-dim tensor), the device to build on, and the keyword
    arguments that describe the queries to this transformers' own ``sdpa_mask``.
    """
    cache_position = kwargs.pop("cache_position", None)
    if q_length is not None:
        q_offset = 0 if q_offset is None else q_offset
        return q_length, q_offset, device, dict(q_length=q_length, q_offset=q_offset)
    if cache_position is None:
        raise TypeError("tree_attention_mask: transformers passed neither q_length nor cache_position")
    return cache_position.shape[0], cache_position[0], cache_position.device, dict(cache_position=cache_position)


def _transformers_release() -> tuple:
    """(major, minor) of the installed transformers, e.g. (5, 17) for "5.17.0" or "5.17.0.dev0"."""
    import transformers  # only here: importing this module must not import transformers

    major, minor = re.match(r"(\d+)\.(\d+)", transformers.__version__).groups()
    return int(major), int(minor)


_static_caches_refuse_skip = None


def static_caches_refuse_causal_skip() -> bool:
    """Whether this transformers builds every mask of a forward into a compileable cache
    (StaticCache) with ``allow_is_causal_skip=False`` (releases before 5.14), not only those
    of single-token decoding (5.14 on).

    No signature shows this, so it is the one behaviour told by the version number. Read
    once (``register`` calls this outside compiled code), then a constant.
    """
    global _static_caches_refuse_skip
    if _static_caches_refuse_skip is None:
        _static_caches_refuse_skip = _transformers_release() < (5, 14)
    return _static_caches_refuse_skip


def is_plain_causal_call(masking_utils, mask_function, local_size, allow_is_causal_skip, use_vmap,
                         attention_mask, q_length, kv_length, kv_offset) -> bool:
    """Whether a mask-function call asks for nothing but transformers' causal mask (with
    the 2D padding and the sliding window of ``local_size``, if any), so that a causal
    spec can stand for it.

    transformers refuses its causal skip (``allow_is_causal_skip=False``) for masks with
    overlays (custom ``or`` / ``and`` mask functions, packed sequences, block overlays),
    and for forwards into a StaticCache: from 5.14 only when decoding single tokens (those
    get the dense mask, as for sdpa), before 5.14 always. There a refused skip alone does
    not tell a StaticCache forward from an overlay, so the call is looked at instead:

    * custom mask functions come with ``use_vmap=True``;
    * full attention's mask function is ``causal_mask_function`` itself, a sliding window's
      is an ``and_masks`` combination (the code of ``sliding_window_causal_mask_function``'s
      result); block overlays are an ``or_masks`` one, any other combination differs too;
    * packed sequences (an ``and_masks`` combination as well) are only looked for in
      forwards without a cache and without a 2D mask, where the keys are the queries:
      ``kv_offset == 0`` and ``kv_length == q_length``. Such calls keep the dense mask
      (also a StaticCache prefill longer than a sliding window: correct, only not compact).
    """
    if allow_is_causal_skip:
        return True
    if not static_caches_refuse_causal_skip() or use_vmap:
        return False
    if local_size is None:
        if mask_function is not masking_utils.causal_mask_function:
            return False
    elif getattr(mask_function, "__code__", None) is not (
        masking_utils.sliding_window_causal_mask_function(local_size).__code__
    ):
        return False
    return attention_mask is not None or kv_offset != 0 or kv_length != q_length


# --------------------------------------------------------------------------------------
# Cache layers
# --------------------------------------------------------------------------------------


def layer_length(layer) -> int:
    """Number of positions written to a cache layer (evicted ones of a sliding layer
    included), as a Python int."""
    return int(layer.get_seq_length())


def records_its_length(layer) -> bool:
    """False for a static layer that keeps no length (transformers before 5.4): it counts
    its key slots that are not all zeros as written, so writing any later slot changes its
    length (and where the model writes next)."""
    return not hasattr(layer, "max_cache_len") or hasattr(layer, "cumulative_length")


def set_layer_length(layer, new_len: int) -> None:
    """Make ``layer`` hold positions ``[0, new_len)``, the K/V already in place: the next
    forward writes at slot ``new_len``. For a DynamicLayer / StaticLayer or their sliding
    variants (before they slide); ``new_len`` must not exceed the current length.

    Static layers keep their buffers (fixed addresses under torch.compile): their length
    is reset in place.
    """
    length = getattr(layer, "cumulative_length", None)
    if not hasattr(layer, "max_cache_len"):  # dynamic: the key tensor's length is the length
        layer.keys = layer.keys[:, :, :new_len]
        layer.values = layer.values[:, :, :new_len]
        if length is not None:  # sliding
            layer.cumulative_length = new_len
        return
    if not records_its_length(layer):
        # The length is the number of written (non-zero) slots: clear the rest.
        layer.keys[:, :, new_len:].zero_()
        layer.values[:, :, new_len:].zero_()
    elif isinstance(length, torch.Tensor):
        length.fill_(new_len)
    else:
        layer.cumulative_length = new_len
    if hasattr(layer, "cumulative_length_int"):
        layer.cumulative_length_int = new_len


def crop(cache, tokens_to_remove: int) -> None:
    """Drop the last ``tokens_to_remove`` positions of every layer of ``cache`` (as
    transformers' ``cache.crop(-tokens_to_remove)`` where every layer has one). A static
    layer keeps its buffers and only forgets the positions. Sliding layers only before
    they slide, as transformers' own crop."""
    if tokens_to_remove < 0:
        raise ValueError(f"crop: tokens_to_remove must be >= 0, got {tokens_to_remove}")
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False) or tokens_to_remove == 0:
            continue
        if callable(getattr(layer, "crop", None)):
            layer.crop(-tokens_to_remove)
            continue
        length = layer_length(layer)
        if getattr(layer, "is_sliding", False) and length > layer.max_cache_len:
            raise RuntimeError(
                f"crop: a {type(layer).__name__} of window {layer.max_cache_len} has slid past ({length} positions "
                "written); the positions before its window are gone"
            )
        set_layer_length(layer, length - tokens_to_remove)
