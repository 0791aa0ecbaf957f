"""transformers integration: attn_implementation="tree_attn" against eager / sdpa.

Tiny random-initialised models (no downloads), float32 on CPU, or on the device
TREE_ATTN_TEST_DEVICE names (``cuda``, ``mps``: the same tests through that backend; every
tensor is made there, random draws are made on the CPU first so they match): Llama, Qwen3, Mistral,
Gemma 2/3/4 and gpt-oss (Gemma 4 and gpt-oss are skipped on a transformers without them). Every tree verification is
compared with the same weights running transformers' own "eager" (and "sdpa" where the
model supports it) given the equivalent dense 4D additive mask, built here by loops from
the definition: a tree node sees the committed prefix, its ancestors and itself; on
sliding-window layers additionally only keys less than `window` positions behind it.
"""
import math
import os
import warnings

import pytest
import torch
import transformers
from transformers import (
    DynamicCache,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    StaticCache,
    masking_utils,
)

import torch_tree_attn.hf as hf
from torch_tree_attn.hf import attention as hf_attention
from torch_tree_attn.hf.compat import cache_kwargs, crop, records_its_length

hf.register()

DEVICE = torch.device(os.environ.get("TREE_ATTN_TEST_DEVICE", "cpu"))
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("TREE_ATTN_TEST_DEVICE=cuda, but CUDA is not available", allow_module_level=True)
if DEVICE.type == "mps" and not torch.backends.mps.is_available():
    pytest.skip("TREE_ATTN_TEST_DEVICE=mps, but MPS is not available", allow_module_level=True)


@pytest.fixture(autouse=True, scope="module")
def _on_test_device():
    """Every tensor a test makes (models, caches, masks) lives on DEVICE."""
    if DEVICE.type == "cpu":
        yield
        return
    torch.set_default_device(DEVICE)
    try:
        yield
    finally:
        torch.set_default_device(None)


def randint(shape, generator):
    """Token ids drawn on the CPU (so every device sees the same ones), then on DEVICE."""
    return torch.randint(3, VOCAB, shape, generator=generator, device="cpu").to(DEVICE)

VOCAB = 97
WINDOW = 6  # sliding window of the Mistral / Gemma configs: smaller than the prefixes below
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    head_dim=64,
    max_position_embeddings=128,
    # Larger than the default 0.02 so that attention is far from uniform and masking,
    # windows and softcapping change the logits visibly.
    initializer_range=0.2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def _build(kind):
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**COMMON))
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**COMMON))
    if kind == "mistral":  # every layer sliding
        return MistralForCausalLM(MistralConfig(**COMMON, sliding_window=WINDOW))
    if kind == "gemma2":  # sliding + full layers, attention logit softcapping
        config = Gemma2Config(
            **COMMON,
            sliding_window=WINDOW,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=None,
            query_pre_attn_scalar=64,
            layer_types=["sliding_attention", "full_attention"],
        )
        return Gemma2ForCausalLM(config)
    if kind == "gemma3":
        config = Gemma3TextConfig(
            **COMMON,
            sliding_window=WINDOW,
            query_pre_attn_scalar=64,
            layer_types=["sliding_attention", "full_attention"],
        )
        return Gemma3ForCausalLM(config)
    if kind in OPTIONAL_FAMILIES:
        return _build_optional(kind)
    raise AssertionError(kind)


_MODELS = {}


def model_for(kind):
    if kind in OPTIONAL_FAMILIES:
        _classes(kind)  # skips where this transformers lacks the family
    if kind not in _MODELS:
        torch.manual_seed(1234)
        _MODELS[kind] = _build(kind).eval()
    return _MODELS[kind]


def references_for(kind):
    # Gemma 2 (softcapping) and gpt-oss (sinks) declare no sdpa support: only eager there.
    return ["eager"] if kind in ("gemma2", "gpt_oss") else ["eager", "sdpa"]


ALL_KINDS = ["llama", "qwen3", "mistral", "gemma2", "gemma3", "gemma4", "gpt_oss"]
SLIDING_KINDS = ["mistral", "gemma2", "gemma3", "gemma4", "gpt_oss"]


# Gemma 4 (from transformers 5.5 or so) and gpt-oss are looked up, not imported: the
# transformers floor (5.0) may lack them, and their tests then skip.
OPTIONAL_FAMILIES = {
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
}


def _classes(kind):
    names = OPTIONAL_FAMILIES[kind]
    classes = [getattr(transformers, name, None) for name in names]
    if None in classes:
        pytest.skip(f"transformers {transformers.__version__} has no {kind} ({', '.join(names)})")
    return classes


def _build_optional(kind):
    config_class, model_class = _classes(kind)
    common = dict(COMMON, num_hidden_layers=4, hidden_size=64, intermediate_size=64)
    if kind == "gemma4":
        # Sliding layers head_dim 256, full layers global_head_dim 512 with keys as values
        # (attention_k_eq_v) and their own kv-head count; the last two layers reuse the
        # KV of the first two (num_kv_shared_layers); per-layer inputs on; no softcap.
        common.update(head_dim=256)
        config = config_class(
            **common,
            global_head_dim=512,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            num_kv_shared_layers=2,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=VOCAB,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"] * 2,
            final_logit_softcapping=None,
        )
        model = model_class(config)
        with torch.no_grad():
            # Gemma 4 scores unscaled (scaling 1.0) RMS-normed queries and keys: with unit
            # norm weights, scores reach ~70 in these random models and float32 rounding of
            # the softmax, not masking, dominates the comparison. Scores up to ~15 keep
            # attention far from uniform and the comparison at the usual tolerance.
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.fill_(0.45)
        return model
    # gpt-oss: attention sinks, alternating sliding / full layers, D = 64, a small MoE.
    config = config_class(
        **common,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )
    model = model_class(config)
    with torch.no_grad():  # sinks far from 0, so that they visibly change the softmax
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.5)
    return model


# ----------------------------------------------------------------------------------------
# Reference masks, written from the definition with plain loops
# ----------------------------------------------------------------------------------------


def reference_bias(anc, slot, key_len, padding=None, window=None):
    """float32 additive mask [B, 1, T, key_len] for a tree written at cache slot `slot`.

    anc: bool [B, T, T] ancestor-or-self. padding: bool [B, slot] (False = padded) or None.
    The key tensor ends at slot + T when it is shorter than that (a sliding layer that
    evicted old keys): key index j then holds cache slot j + evicted.
    """
    B, T, _ = anc.shape
    evicted = max(0, slot + T - key_len)
    bias = torch.full((B, 1, T, key_len), torch.finfo(torch.float32).min)
    for b in range(B):
        for i in range(T):
            depth = int(anc[b, i].sum()) - 1
            for j in range(key_len):
                a = j + evicted
                if a < slot:
                    ok = padding is None or bool(padding[b, a])
                    if window is not None:
                        ok = ok and (slot + depth) - a < window
                elif a < slot + T:
                    ok = bool(anc[b, i, a - slot])
                    if window is not None:  # both ends at their tree positions
                        ok = ok and depth - (int(anc[b, a - slot].sum()) - 1) < window
                else:
                    ok = False
                if ok:
                    bias[b, 0, i, j] = 0.0
    return bias


def sliding_key_len(cache_kind, prefix_len, tree_len, max_cache_len):
    """Key length transformers' sliding cache layers hand to attention for the tree forward."""
    if cache_kind == "dynamic":
        return min(prefix_len, WINDOW - 1) + tree_len
    capacity = min(WINDOW, max_cache_len)
    if prefix_len >= capacity:
        return capacity - 1 + tree_len
    return max(capacity, prefix_len + tree_len)


def reference_masks(model, anc, slot, cache_kind, max_cache_len, padding=None):
    config = model.config
    full_len = slot + anc.shape[-1] if cache_kind == "dynamic" else max_cache_len
    full = reference_bias(anc, slot, full_len, padding)
    if getattr(config, "sliding_window", None) is None:
        return full
    sliding = reference_bias(
        anc, slot, sliding_key_len(cache_kind, slot, anc.shape[-1], max_cache_len), padding, window=WINDOW
    )
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:  # Mistral: every layer slides
        return sliding
    return {"full_attention": full, "sliding_attention": sliding}


# ----------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------

PARENTS = [
    torch.tensor([-1, 0, 0, 1, 1, 2, 3, 6]),
    torch.tensor([-1, 0, 1, 2, 0, 4, 1, 3]),
]


def ancestor_mask(parents):
    """bool [B, T, T] ancestor-or-self, by walking up the parent pointers."""
    batch, tree_len = parents.shape
    mask = torch.zeros(batch, tree_len, tree_len, dtype=torch.bool)
    for b in range(batch):
        for i in range(tree_len):
            node = i
            while node >= 0:
                mask[b, i, node] = True
                node = int(parents[b, node])
    return mask


def make_cache(kind, model, max_cache_len):
    if kind == "dynamic":
        return DynamicCache(config=model.config)
    if kind == "full-length static":  # sliding layers keep every position (tree_attn applies the window)
        return hf.verification_cache(model, max_cache_len=max_cache_len)
    return StaticCache(config=model.config, max_cache_len=max_cache_len)


def prefill(model, impl, cache, prompt, padding=None):
    model.set_attn_implementation(impl)
    if padding is None:
        with torch.no_grad():
            model(prompt, use_cache=True, **cache_kwargs(model, cache))
        return
    position_ids = (padding.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        model(prompt, attention_mask=padding.long(), position_ids=position_ids, use_cache=True,
              **cache_kwargs(model, cache))


def tree_inputs(batch, slot, padding=None, seed=0, tree_len=8):
    generator = torch.Generator().manual_seed(seed)
    parents = torch.stack([PARENTS[b % len(PARENTS)][:tree_len] for b in range(batch)])
    tokens = randint(parents.shape, generator)
    anc = ancestor_mask(parents)
    depth = anc.sum(-1) - 1
    real_prefix = torch.full((batch,), slot) if padding is None else padding.sum(-1)
    return tokens, parents, anc, real_prefix[:, None] + depth


def prompt_and_padding(batch, prefix_len, left_pads, seed=0):
    generator = torch.Generator().manual_seed(100 + seed)
    prompt = randint((batch, prefix_len), generator)
    if not any(left_pads):
        return prompt, None
    padding = torch.ones(batch, prefix_len, dtype=torch.bool)
    for b, pads in enumerate(left_pads):
        padding[b, :pads] = False
        prompt[b, :pads] = COMMON["pad_token_id"]
    return prompt, padding


def assert_logits_close(actual, expected):
    torch.testing.assert_close(actual, expected, atol=5e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------
# Tree verification parity
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("left_pads", [(0, 0), (0, 3)], ids=["same-prefix", "left-padded"])
def test_tree_verify_matches_eager_and_sdpa(kind, cache_kind, left_pads):
    """One tree forward with tree_attn gives the logits eager / sdpa give with the
    equivalent dense mask, for a batch of 2 (rows with different real prefix lengths are
    left-padded: transformers' caches write every row at the same slot)."""
    model = model_for(kind)
    batch, slot = 2, 9
    prompt, padding = prompt_and_padding(batch, slot, left_pads)
    tokens, parents, anc, position_ids = tree_inputs(batch, slot, padding)
    tree_len = tokens.shape[1]
    max_cache_len = slot + tree_len + 5

    cache = make_cache(cache_kind, model, max_cache_len)
    prefill(model, "tree_attn", cache, prompt, padding)
    if cache_kind == "static" and padding is None:
        # The compact form never reads slots past the tree: poison them. (Poisoned values
        # are enough to show a read: a masked-out slot still multiplies its value by 0. A
        # static layer that keeps no length counts its non-zero key slots as written.)
        for layer in cache.layers:
            if getattr(layer, "keys", None) is not None and not layer.is_sliding:
                layer.values[:, :, slot + tree_len:] = math.nan
                if records_its_length(layer):
                    layer.keys[:, :, slot + tree_len:] = math.nan
    kwargs = {} if padding is None else {"attention_mask": padding.long()}
    with torch.no_grad():
        out = hf.tree_forward(model, tokens, parents, slot, cache, **kwargs).logits
    assert torch.isfinite(out).all()

    for impl in references_for(kind):
        ref_cache = make_cache(cache_kind, model, max_cache_len)
        prefill(model, impl, ref_cache, prompt, padding)
        masks = reference_masks(model, anc, slot, cache_kind, max_cache_len, padding)
        with torch.no_grad():
            ref_kwargs = dict(position_ids=position_ids, attention_mask=masks, **cache_kwargs(model, ref_cache))
            ref = model(tokens, **ref_kwargs).logits
        assert_logits_close(out, ref)
        if cache_kind == "dynamic":
            # The tree's K/V went to the same cache slots as the reference's (the last ones).
            for layer, ref_layer in zip(cache.layers, ref_cache.layers):
                if layer.keys is None:  # Gemma 4's KV-shared layers keep no cache of their own
                    continue
                written = min(tree_len, layer.keys.shape[2])
                # Keys of later layers carry the earlier layers' attention rounding: the
                # logits' tolerance (float32 on a GPU differs in the last bits).
                torch.testing.assert_close(layer.keys[:, :, -written:], ref_layer.keys[:, :, -written:],
                                           atol=5e-5, rtol=1e-5)
    model.set_attn_implementation("tree_attn")


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_tree_verify_with_a_dense_4d_mask_matches_eager(kind, cache_kind):
    """The same tree step given as a dense 4D mask (one per layer type) instead of the
    compact form: tree_attn takes it as final, alone or with the tree arguments on top
    (intersected), and matches eager given the same mask."""
    model = model_for(kind)
    batch, slot = 2, 9
    prompt, _ = prompt_and_padding(batch, slot, (0, 0), seed=21)
    tokens, _, anc, position_ids = tree_inputs(batch, slot, seed=21)
    max_cache_len = slot + tokens.shape[1] + 4
    bias = reference_masks(model, anc, slot, cache_kind, max_cache_len)  # float32 additive
    if isinstance(bias, dict):
        keep = {name: mask > torch.finfo(torch.float32).min for name, mask in bias.items()}  # bool, True = attend
    else:
        keep = bias > torch.finfo(torch.float32).min
    tree_args = dict(tree_mask=anc, mask_offset=torch.tensor([slot] * batch))
    runs = {
        "dense": ("tree_attn", bias, {}),
        "dense and tree": ("tree_attn", keep, tree_args),
        "eager": ("eager", bias, {}),  # eager adds the mask to the scores: float only
    }
    results = {}
    for name, (impl, mask, extra) in runs.items():
        cache = make_cache(cache_kind, model, max_cache_len)
        prefill(model, impl, cache, prompt)
        with torch.no_grad():
            results[name] = model(
                tokens, position_ids=position_ids, attention_mask=mask, **cache_kwargs(model, cache), **extra
            ).logits
    model.set_attn_implementation("tree_attn")
    assert_logits_close(results["dense"], results["eager"])
    assert_logits_close(results["dense and tree"], results["eager"])


# A tree deeper than the window (WINDOW = 6) whose cache slots run far ahead of its depths:
# six children of the root (slots 1-6, depth 1), a chain from the last of them down to
# depth 9 (slots 7-14), and a short branch off node 2. Counting tree keys by slot instead of
# depth shows node 14 its ancestor 6 (depth 1: 8 positions back, outside the window).
DEEP_PARENTS = torch.tensor([-1, 0, 0, 0, 0, 0, 0, 6, 7, 8, 9, 10, 11, 12, 13, 2, 15, 16])


def leaf_paths(parents):
    """Root-to-leaf node lists, by walking up from every node that is nobody's parent."""
    parents = parents.tolist()
    paths = []
    for leaf in range(len(parents)):
        if leaf in parents:
            continue
        path, node = [], leaf
        while node >= 0:
            path.append(node)
            node = parents[node]
        paths.append(path[::-1])
    return paths


def check_tree_against_sequential_paths(model, prompt, tokens, parents, cache_kind):
    """Verify the tree with tree_attn on a cache holding the prompt, then compare the
    logits of every root-to-leaf path with eager's ordinary forward of prompt + path."""
    slot, tree_len = prompt.shape[1], tokens.shape[0]
    cache = make_cache(cache_kind, model, slot + tree_len + 3)
    prefill(model, "tree_attn", cache, prompt)
    with torch.no_grad():
        tree_logits = hf.tree_forward(model, tokens, parents, slot, cache).logits[0]
    model.set_attn_implementation("eager")
    worst = 0.0
    try:
        for path in leaf_paths(parents):
            sequence = torch.cat([prompt[0], tokens[path]])[None]
            with torch.no_grad():
                expected = model(sequence).logits[0, slot:]
            worst = max(worst, float((tree_logits[path] - expected).abs().max()))
            assert_logits_close(tree_logits[path], expected)
    finally:
        model.set_attn_implementation("tree_attn")
    return worst


@pytest.mark.parametrize("cache_kind", ["dynamic", "static", "full-length static"])
@pytest.mark.parametrize("kind", SLIDING_KINDS)
def test_tree_deeper_than_the_window_matches_sequential_paths(kind, cache_kind):
    """On sliding-window layers the window counts tree positions (prefix + depth) for keys
    as for queries: every root-to-leaf path of a tree deeper than the window gives the
    logits of the ordinary forward of that path."""
    model = model_for(kind)
    prompt, _ = prompt_and_padding(1, 7, (0,), seed=31)
    tokens = randint(DEEP_PARENTS.shape, torch.Generator().manual_seed(31))
    check_tree_against_sequential_paths(model, prompt, tokens, DEEP_PARENTS, cache_kind)


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
def test_sliding_window_regression_window_2(cache_kind):
    """The adversarial case that found the slot-counted window: Mistral with window 2,
    prefix [5, 6, 7], tree [8..12] with parents [-1, 0, 0, 2, 3] (node 4 at depth 3 was off
    by 6.09 in logits when tree keys were placed at their cache slots)."""
    torch.manual_seed(1234)
    model = MistralForCausalLM(MistralConfig(**COMMON, sliding_window=2)).eval()
    model.set_attn_implementation("tree_attn")
    check_tree_against_sequential_paths(
        model, torch.tensor([[5, 6, 7]]), torch.tensor([8, 9, 10, 11, 12]), torch.tensor([-1, 0, 0, 2, 3]), cache_kind
    )


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
def test_sliding_window_regression_gemma2_binary_tree(cache_kind):
    """The second adversarial case: Gemma 2 (window 5, softcapping) verifying a 100-node
    binary tree (depth 6) after a 7-token prefix, off by up to 4.6 in logits before;
    every one of its 50 root-to-leaf paths against the sequential forward."""
    torch.manual_seed(1234)
    config = Gemma2Config(
        **COMMON,
        sliding_window=5,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=None,
        query_pre_attn_scalar=64,
        layer_types=["sliding_attention", "full_attention"],
    )
    model = Gemma2ForCausalLM(config).eval()
    model.set_attn_implementation("tree_attn")
    parents = torch.tensor([-1] + [(i - 1) // 2 for i in range(1, 100)])
    tokens = randint((100,), torch.Generator().manual_seed(61))
    prompt, _ = prompt_and_padding(1, 7, (0,), seed=61)
    check_tree_against_sequential_paths(model, prompt, tokens, parents, cache_kind)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_plain_forward_and_decoding_match_eager(kind):
    """Ordinary use: a left-padded prefill longer than the window, then two single-token
    decoding steps, give eager's logits."""
    model = model_for(kind)
    prompt, padding = prompt_and_padding(2, 9, (0, 3), seed=41)
    steps = randint((2, 2), torch.Generator().manual_seed(41))
    results = {}
    for impl in ("tree_attn", "eager"):
        model.set_attn_implementation(impl)
        cache = DynamicCache(config=model.config)
        mask = padding.long()
        logits = []
        with torch.no_grad():
            logits.append(model(prompt, attention_mask=mask, **cache_kwargs(model, cache)).logits)
            for k in range(2):
                mask = torch.cat([mask, mask.new_ones(2, 1)], dim=1)
                logits.append(model(steps[:, k:k + 1], attention_mask=mask, **cache_kwargs(model, cache)).logits)
        results[impl] = torch.cat(logits, dim=1)
    model.set_attn_implementation("tree_attn")
    real = torch.cat([padding, torch.ones(2, 2, dtype=torch.bool)], dim=1)  # padded queries' logits are arbitrary
    assert_logits_close(results["tree_attn"][real], results["eager"][real])


@pytest.mark.parametrize("left_pads", [(0, 0), (0, 3)], ids=["same-prefix", "left-padded"])
def test_gemma4_kv_shared_layers_see_only_the_last_queries(left_pads):
    """With an int logits_to_keep, Gemma 4 runs its KV-shared layers on the last queries
    only, slicing the mask along the queries from the end: the causal spec records where
    the queries end, so those layers still find their queries (they saw key 0 only when it
    recorded the first query's slot)."""
    model = model_for("gemma4")
    prompt, padding = prompt_and_padding(2, 9, left_pads, seed=51)
    mask = None if padding is None else padding.long()
    results = {}
    for impl in ("tree_attn", "eager"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            results[impl] = model(prompt, attention_mask=mask, logits_to_keep=1).logits
            full = model(prompt, attention_mask=mask).logits[:, -1:]
        assert_logits_close(results[impl], full)
    model.set_attn_implementation("tree_attn")
    assert_logits_close(results["tree_attn"], results["eager"])


def test_tree_verify_direct_model_call_with_per_row_prefix_tensor():
    """The documented direct call (no helper), with past_key_values= and a tensor of prefix
    lengths, matches eager."""
    model = model_for("llama")
    batch, slot = 2, 7
    prompt, _ = prompt_and_padding(batch, slot, (0, 0), seed=3)
    tokens, _, anc, position_ids = tree_inputs(batch, slot, seed=3)
    results = {}
    for impl in ("tree_attn", "eager"):
        cache = DynamicCache(config=model.config)
        prefill(model, impl, cache, prompt)
        extra = (
            dict(tree_mask=anc, mask_offset=torch.tensor([slot, slot]))
            if impl == "tree_attn"
            else dict(attention_mask=reference_bias(anc, slot, slot + tokens.shape[1]))
        )
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers >= 5.24 prefers cache=
            results[impl] = model(input_ids=tokens, position_ids=position_ids, past_key_values=cache, **extra).logits
    model.set_attn_implementation("tree_attn")
    assert_logits_close(results["tree_attn"], results["eager"])


def test_tree_mode_intersects_a_user_dense_mask():
    """A dense 4D mask given together with the tree arguments is intersected with the
    tree structure: here it additionally hides two prefix keys of one row."""
    model = model_for("llama")
    batch, slot = 2, 7
    prompt, _ = prompt_and_padding(batch, slot, (0, 0), seed=4)
    tokens, _, anc, position_ids = tree_inputs(batch, slot, seed=4)
    key_len = slot + tokens.shape[1]
    hidden = torch.zeros(batch, 1, 1, key_len, dtype=torch.bool)
    hidden[1, :, :, 2:4] = True
    tree_args = dict(tree_mask=anc, mask_offset=torch.tensor([slot, slot]))
    user_mask = ~hidden.expand(batch, 1, tokens.shape[1], key_len)  # bool, True = attend
    bias = reference_bias(anc, slot, key_len).masked_fill(hidden, torch.finfo(torch.float32).min)
    runs = {
        "with user mask": ("tree_attn", dict(attention_mask=user_mask, **tree_args)),
        "tree only": ("tree_attn", tree_args),
        "eager": ("eager", dict(attention_mask=bias)),
    }
    results = {}
    for name, (impl, extra) in runs.items():
        cache = DynamicCache(config=model.config)
        prefill(model, impl, cache, prompt)
        with torch.no_grad():
            results[name] = model(tokens, position_ids=position_ids, **cache_kwargs(model, cache), **extra).logits
    model.set_attn_implementation("tree_attn")
    assert_logits_close(results["with user mask"], results["eager"])
    # Only the row whose keys the user mask hides changes.
    assert_logits_close(results["with user mask"][0], results["tree only"][0])
    assert not torch.allclose(results["with user mask"][1], results["tree only"][1], atol=1e-3)


def spy_on_compact_calls(monkeypatch, record, dense_error):
    """Every call of the op through transformers first passes (key, mask, mask_offset, sinks)
    to `record`, then runs; building a dense SDPA mask raises AssertionError(dense_error)."""
    hf_tree_attention = hf_attention.tree_attention

    def spy(query, key, value, mask, mask_offset=None, scale=None, softcap=None, sinks=None):
        record(key, mask, mask_offset, sinks)
        return hf_tree_attention(query, key, value, mask, mask_offset, scale, softcap, sinks)

    def no_dense_masks(*args, **kwargs):
        raise AssertionError(dense_error)

    monkeypatch.setattr(hf_attention, "tree_attention", spy)
    monkeypatch.setattr(masking_utils, "sdpa_mask", no_dense_masks)


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
@pytest.mark.parametrize("kind", ["llama", "gemma2", "gemma4", "gpt_oss"])
def test_compact_tree_mode_builds_no_query_by_key_mask(kind, cache_kind, monkeypatch):
    """Without padding, tree mode never builds a [T, S] mask: transformers' dense mask
    builder is not called, and every full-attention layer hands the op the [B, T, T] tree
    mask with the prefix lengths as offsets (and gpt-oss's sinks, one per query head)."""
    model = model_for(kind)
    batch, slot = 2, 2  # prefix + tree within Gemma's window: its sliding layers stay compact too
    tokens, parents, anc, _ = tree_inputs(batch, slot, tree_len=WINDOW - slot)
    tree_len = tokens.shape[1]
    prompt, _ = prompt_and_padding(batch, slot, (0, 0))
    cache = make_cache(cache_kind, model, slot + tree_len + 3)
    prefill(model, "tree_attn", cache, prompt)

    calls, sinks_seen = [], []

    def record(key, mask, mask_offset, sinks):
        calls.append((tuple(key.shape), tuple(mask.shape), None if mask_offset is None else mask_offset.tolist()))
        sinks_seen.append(None if sinks is None else tuple(sinks.shape))

    spy_on_compact_calls(monkeypatch, record, "a dense mask was built in compact tree mode")
    with torch.no_grad():
        hf.tree_forward(model, tokens, parents, slot, cache)
    assert len(calls) == model.config.num_hidden_layers
    for key_shape, mask_shape, offsets in calls:
        assert mask_shape == (batch, tree_len, tree_len), (key_shape, mask_shape)
        assert offsets == [slot] * batch
        assert key_shape[2] >= slot + tree_len
    heads = model.config.num_attention_heads
    assert sinks_seen == [(heads,) if kind == "gpt_oss" else None] * len(calls)


def test_ordinary_decoding_without_padding_uses_compact_causal_masks(monkeypatch):
    """Prefill and decoding without padding need no dense mask either: the op gets a
    [T, T] lower triangle at the first query's cache slot."""
    model = model_for("llama")
    model.set_attn_implementation("tree_attn")
    prompt, _ = prompt_and_padding(2, 6, (0, 0), seed=8)
    calls = []

    def record(key, mask, mask_offset, sinks):
        calls.append((tuple(mask.shape), None if mask_offset is None else mask_offset.tolist()))

    spy_on_compact_calls(monkeypatch, record, "a dense mask was built for a plain causal forward")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt, **cache_kwargs(model, cache))
        model(torch.tensor([[5], [6]]), **cache_kwargs(model, cache))
    layers = model.config.num_hidden_layers
    assert calls == [((1, 1, 6, 6), [0, 0])] * layers + [((1, 1, 1, 1), [6, 6])] * layers


def test_tree_mode_rejects_bad_tree_arguments():
    model = model_for("llama")
    prompt, _ = prompt_and_padding(1, 5, (0,))
    tokens = torch.tensor([[5, 6, 7]])
    chain = torch.ones(1, 3, 3, dtype=torch.bool).tril()

    def call(**tree_args):
        cache = DynamicCache(config=model.config)
        prefill(model, "tree_attn", cache, prompt)
        with torch.no_grad():
            model(tokens, **cache_kwargs(model, cache), **tree_args)

    with pytest.raises(ValueError, match=r"tree_mask must have shape \[B=1 or 1, T=3, T=3\]"):
        call(tree_mask=torch.ones(1, 4, 4, dtype=torch.bool), mask_offset=torch.tensor([5]))
    with pytest.raises(TypeError, match="tree_mask must be bool"):
        call(tree_mask=torch.zeros(1, 3, 3), mask_offset=torch.tensor([5]))
    with pytest.raises(TypeError, match="tree_prefix_lens was renamed mask_offset"):
        call(tree_mask=chain, tree_prefix_lens=torch.tensor([5]))
    with pytest.raises(ValueError, match="needs both tree_mask and mask_offset"):
        call(tree_mask=chain)
    with pytest.raises(ValueError, match=r"mask_offset has 2 entries, expected 1 "):
        call(tree_mask=chain, mask_offset=torch.tensor([5, 5]))
    if DEVICE.type == "cpu":
        # Checked only where reading the offsets cannot sync a device (hf/attention.py).
        with pytest.raises(ValueError, match=r"mask_offset \[4\] does not match the cache: .* slot \[5\]"):
            call(tree_mask=chain, mask_offset=torch.tensor([4]))
    cache = DynamicCache(config=model.config)
    prefill(model, "tree_attn", cache, prompt)
    with pytest.raises(ValueError, match=r"mask_offset \[4\] must equal the cache length 5"):
        hf.tree_forward(model, tokens[0], torch.tensor([-1, 0, 0]), 4, cache)


# ----------------------------------------------------------------------------------------
# Ordinary use: generation and dense masks
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,cache_implementation",
    [
        ("llama", None),
        ("llama", "static"),
        ("qwen3", "static"),
        ("mistral", None),
        ("gemma2", None),
        ("gemma2", "static"),
        ("gemma4", None),
        ("gemma4", "static"),
        ("gpt_oss", None),
        ("gpt_oss", "static"),
    ],
)
def test_greedy_generation_matches_reference(kind, cache_implementation):
    """generate() with a left-padded 2D mask gives the same tokens as eager and sdpa (eager
    only for Gemma 2 and gpt-oss), prompts longer than the sliding window included. (Gemma 4's
    KV-shared layers see only the last query of the prefill there: logits_to_keep.)"""
    model = model_for(kind)
    prompt, padding = prompt_and_padding(2, 9, (0, 3), seed=7)
    outputs = {}
    for impl in ("tree_attn", *references_for(kind)):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            outputs[impl] = model.generate(
                prompt,
                attention_mask=padding.long(),
                max_new_tokens=8,
                do_sample=False,
                cache_implementation=cache_implementation,
                pad_token_id=COMMON["pad_token_id"],
            )
    model.set_attn_implementation("tree_attn")
    ours = outputs.pop("tree_attn")
    assert ours.shape == (2, 9 + 8)
    for impl, theirs in outputs.items():
        assert torch.equal(ours, theirs), impl


def test_ordinary_forward_logits_match_sdpa_with_user_4d_mask():
    """A dense 4D mask passed the usual way reaches the op unchanged."""
    model = model_for("qwen3")
    tokens = randint((2, 6), torch.Generator().manual_seed(5))
    keep = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    keep[1, :, :, 0] = False
    keep[1, :, 0, 0] = True
    bias = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    logits = {}
    for impl in ("tree_attn", "sdpa"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            logits[impl] = model(tokens, attention_mask=bias).logits
    model.set_attn_implementation("tree_attn")
    assert_logits_close(logits["tree_attn"], logits["sdpa"])


# ----------------------------------------------------------------------------------------
# torch.compile: consecutive verify steps, one graph
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "gemma4", "gpt_oss"])
def test_compiled_verify_steps_static_cache_no_graph_break_no_recompile(kind):
    """StaticCache + torch.compile(fullgraph=True): verify steps with changing prefix
    lengths (a tensor), trees and positions reuse one graph and match eager mode."""
    if kind == "gpt_oss" and tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 17):
        # transformers' own gpt-oss code, not the op: before 5.17 it derives cache_position
        # with a data-dependent arange, and its float32 experts call a bf16-only grouped
        # matmul under torch.compile (seen on 5.0; 5.17 and 5.24 pass).
        pytest.skip(f"transformers {transformers.__version__}: gpt-oss does not compile fullgraph before 5.17")
    torch._dynamo.reset()
    model = model_for(kind)
    model.set_attn_implementation("tree_attn")
    batch, tree_len, prefix_len = 1, 8, 6
    # Sliding layers of full length (tree_attn applies the window): transformers' own static
    # sliding layer guards on a Python int length, and cannot crop once past the window.
    cache = hf.verification_cache(model, max_cache_len=40)
    assert all(not getattr(layer, "is_sliding", False) for layer in cache.layers)
    prompt, _ = prompt_and_padding(batch, prefix_len, (0,), seed=11)
    prefill(model, "tree_attn", cache, prompt)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch._dynamo.utils.counters.clear()

    generator = torch.Generator().manual_seed(12)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        for step, accepted in enumerate([3, 1, 4]):
            anc = ancestor_mask(PARENTS[step % 2][None])
            tokens = randint((batch, tree_len), generator)
            inputs = dict(
                input_ids=tokens,
                position_ids=prefix_len + anc.sum(-1) - 1,
                **cache_kwargs(model, cache),
                tree_mask=anc,
                mask_offset=torch.tensor([prefix_len]),
            )
            expected = model(**inputs).logits
            crop(cache, tree_len)
            actual = compiled(**inputs).logits
            assert_logits_close(actual, expected)
            # Keep `accepted` tree slots as if they were the accepted path.
            crop(cache, tree_len - accepted)
            prefix_len += accepted
            assert int(cache.get_seq_length()) == prefix_len
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]
