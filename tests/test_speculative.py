"""torch_tree_attn.speculative: EAGLE-3 tree speculative decoding as a library.

References, each independent of the module under test:

- greedy: transformers' own ``generate(do_sample=False)`` on the same target;
- the draft trees: :func:`torch_tree_attn.tree.build_dynamic_tree` driven by the batch-1
  :class:`~torch_tree_attn.speculative.eagle3.Eagle3Drafter` (which commits from a plain forward's features);
- sampling: the exact joint distribution of the first tokens, enumerated from the target's
  logits, against the empirical one of many rows (chi-squared); the same test rejects two
  deliberately wrong acceptance rules;
- batching: each row generated alone.

CPU tests use the built-in pair (and tiny random models for the statistics); the CUDA tests at
the end (graph capture and replay, no host sync in a round, the cold-start CLI) skip without
CUDA.
"""
import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

from torch_tree_attn import hf, speculative  # noqa: E402
from torch_tree_attn.hf import compat  # noqa: E402
from torch_tree_attn.speculative import builtin  # noqa: E402
from torch_tree_attn.speculative import engine as spec_engine  # noqa: E402
from torch_tree_attn.speculative.eagle3 import (  # noqa: E402
    Eagle3Config,
    Eagle3Draft,
    Eagle3Drafter,
    capture_target_features,
    feature_layer_ids,
)
from torch_tree_attn.speculative import TreeConfig  # noqa: E402
from torch_tree_attn.tree import build_dynamic_tree, sampling_probs  # noqa: E402
from tests.speculative_pair import load_builtin_pair, one_torch_thread  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv):\n    ",
    "class Parser:\n    def __init__(self, text):\n",
    "    for line in lines:\n",
    "def read(path):\n    with open(path) as f:\n        return",
]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with one_torch_thread():
        yield
    speculative.release()


@pytest.fixture(scope="module")
def pair():
    return load_builtin_pair()


TOKENIZER = builtin.ByteTokenizer()


def encode(prompt):
    return TOKENIZER.encode(prompt)


def hf_greedy(target, row, max_new_tokens, stop=()):
    """transformers' own greedy decoding of one prompt: the reference."""
    ids = torch.tensor([row], device=target.device)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=builtin.ByteTokenizer.pad_token_id,
                              eos_token_id=list(stop) or None)
    with torch.no_grad():
        out = target.generate(ids, generation_config=config, attention_mask=torch.ones_like(ids))
    tokens = out[0, len(row):].tolist()
    for i, t in enumerate(tokens):  # generate pads a finished row; stop at the stop token
        if t in stop:
            return tokens[: i + 1]
    return tokens


# --------------------------------------------------------------------------------------------
# TreeConfig
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config,vocab", [((60, 7, 10), 128), ((100, 1, 2), 128), ((5, 3, 3), 128), ((1, 7, 10), 128),
                                          ((2, 7, 1), 128), ((60, 7, 10), 3), ((30, 0, 4), 128), ((16, 6, 2), 128)])
def test_tree_size_is_the_tree_build_dynamic_tree_builds(config, vocab):
    g = torch.Generator().manual_seed(0)

    def expand(step):  # random log-probs: the size depends only on the shape
        return torch.log_softmax(torch.randn(step.tokens.shape[0], vocab, generator=g), -1)

    tree = build_dynamic_tree(0, expand, *config)
    shape = TreeConfig(*config).shape(vocab)
    assert shape.size == len(tree) == TreeConfig(*config).size(vocab)
    assert shape.path - 1 >= int(tree.depths.max())  # room for the deepest path


@pytest.mark.parametrize("field,value", [("total_tokens", 0), ("depth", -1), ("top_k", 0), ("top_k", 2.0),
                                         ("depth", True)])
def test_tree_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=rf"TreeConfig\.{field} must be an int >= \d, got {value!r}"):
        TreeConfig(**{field: value})


# --------------------------------------------------------------------------------------------
# The draft trees: build_dynamic_tree's, for every row at once
# --------------------------------------------------------------------------------------------


def reference_tree(target, draft, sequence, root, tree):
    """The tree build_dynamic_tree grows with a batch-1 Eagle3Drafter that committed
    ``sequence`` (prompt + tokens so far, the root excluded) from a plain forward's features."""
    layer_ids = feature_layer_ids(target.config.num_hidden_layers, draft.config)
    with torch.no_grad():
        out = target(torch.tensor([sequence]), output_hidden_states=True)
        features = capture_target_features(out.hidden_states, layer_ids)[0]
        drafter = Eagle3Drafter(draft)
        drafter.commit(torch.tensor(sequence[1:] + [root]), features)
        return build_dynamic_tree(root, drafter.expand, tree.total_tokens, tree.depth, tree.top_k)


@pytest.mark.parametrize("shape", [(24, 8, 4), (60, 7, 10), (5, 3, 1)])
def test_batched_trees_equal_build_dynamic_tree(pair, shape):
    """Three prompts of different lengths, two rounds: every row's tree (tokens and parents) is
    the one build_dynamic_tree grows for that row alone."""
    target, draft = pair
    tree = TreeConfig(*shape)
    rows = [encode(p) for p in PROMPTS[:3]]
    engine = spec_engine._Engine(target, draft, len(rows), 128, tree, torch.device("cpu"))
    engine.begin(64, [], 0)
    with torch.no_grad():
        first = engine.prefill(rows, 0.0, 1.0).tolist()
        outputs = [[f] for f in first]
        for _ in range(2):
            engine.draft_step()
            for b, row in enumerate(rows):
                ref = reference_tree(target, draft, row + outputs[b][:-1], outputs[b][-1], tree)
                assert engine.tree_tokens[b].tolist() == ref.tokens.tolist(), b
                assert engine.tree_parents[b].tolist() == ref.parents.tolist(), b
            engine.verify_step()
            engine.accept_step(0.0, 1.0)
            for b, (emit, _, _, *new) in enumerate(engine.result.tolist()):
                outputs[b] += new[:emit]
    assert all(len(o) > 3 for o in outputs)  # the second round grew from accepted tokens


# --------------------------------------------------------------------------------------------
# Greedy: plain greedy decoding token for token
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(60, 7, 10), (16, 6, 2), (2, 1, 1), (1, 0, 1), (9, 0, 8)])
def test_greedy_equals_transformers_greedy(pair, shape):
    target, draft = pair
    for prompt in PROMPTS[:2]:
        row = encode(prompt)
        out = speculative.generate(target, draft, torch.tensor([row]), 40, tree=TreeConfig(*shape), stop=())
        assert out.tolist() == [hf_greedy(target, row, 40)]
        stats = out.stats
        assert out.lengths.tolist() == [40] and stats.emitted == [40]
        assert stats.forwards == 1 + stats.rounds and stats.produced == 39
        assert sum(row[0] for row in stats.accept_lengths) - stats.cut == 39
        if shape[0] == 1:  # the root alone: one token per round
            assert stats.rounds == 39 and stats.mean_acceptance_length == 1.0
        elif shape == (60, 7, 10):  # the trained draft predicts the target
            assert stats.mean_acceptance_length > 3


def test_drafter_object_and_one_dimensional_prompt(pair):
    target, draft = pair
    row = encode(PROMPTS[2])
    a = speculative.generate(target, Eagle3Drafter(draft), torch.tensor(row), 24, stop=())
    assert a.tolist() == [hf_greedy(target, row, 24)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_bfloat16_follows_the_tie_rule(device):
    """bfloat16: wherever the output leaves plain greedy's, greedy's two candidates were within
    the documented tie tolerance; and the logits the verify rounds computed at each round's root
    are within half of it of the token-by-token ones (the rule's premise, measured)."""
    target, draft = load_builtin_pair(device=device, dtype=torch.bfloat16)
    tolerance = speculative.tie_tolerance(torch.bfloat16)
    roots = []  # logits the tree forwards gave their root: the first token of a round

    def hook(module, args, kwargs, output):
        if kwargs.get("tree_mask") is not None:
            roots.append(output.logits[:, 0].float().cpu())

    handle = target.register_forward_hook(hook, with_kwargs=True)
    try:
        for prompt in PROMPTS:
            row = encode(prompt)
            roots.clear()
            # Eager rounds: a hook sees no replayed forward.
            out = speculative.generate(target, draft, [row], 48, stop=(), tree=TreeConfig(24, 8, 4), cuda_graphs=False)
            tokens = out.tolist()[0]
            # Plain greedy's logits at every step, token by token, along the speculative output.
            steps = [s.cpu() for s in step_logits(target, row, tokens)]
            # Round i's root predicts the output's token 1 + (what rounds 0 .. i-1 produced).
            starts = [1 + sum(r[0] for r in out.stats.accept_lengths[:i]) for i in range(len(roots))]
            assert len(roots) == out.stats.rounds
            for logits, start in zip(roots, starts):
                scale = steps[start].abs().max()
                assert (logits[0] - steps[start]).abs().max() <= tolerance / 2 * scale
            for i, (got, s) in enumerate(zip(tokens, steps)):
                want = int(s.argmax())
                if got != want:
                    assert s[want] - s[got] <= tolerance * s.abs().max(), (prompt, i)
                    break
    finally:
        handle.remove()
        speculative.release(target)


def step_logits(target, row, tokens):
    """The target's next-token logits after row + tokens[:i], one decoding step at a time."""
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    kwargs = compat.cache_kwargs(target, cache)
    with torch.no_grad():
        out = target(input_ids=torch.tensor([row], device=target.device), use_cache=True, **kwargs)
        steps = [out.logits[0, -1].float()]
        for t in tokens[:-1]:
            out = target(input_ids=torch.tensor([[t]], device=target.device), use_cache=True, **kwargs)
            steps.append(out.logits[0, -1].float())
    return steps


# --------------------------------------------------------------------------------------------
# Batches: a tree per row, rows of different lengths finishing at different times
# --------------------------------------------------------------------------------------------


def test_batch_equals_each_row_alone(pair):
    target, draft = pair
    rows = [encode(p) for p in PROMPTS]
    tree = TreeConfig(24, 8, 4)
    alone = [hf_greedy(target, row, 56) for row in rows]
    # A stop token that ends one row early, well inside the budget: the first new token of
    # row 1 that no other row emits before its position in row 1.
    stop = next(t for i, t in enumerate(alone[1]) if i > 8 and all(t not in a[: i + 1] for a in alone[:1] + alone[2:]))
    expected = []
    for a in alone:
        expected.append(a[: a.index(stop) + 1] if stop in a else a)
    assert len(expected[1]) < 56 and len({len(e) for e in expected}) > 1

    width = max(len(r) for r in rows)
    left = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    right = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask_left = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    mask_right = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    outputs = [
        speculative.generate(target, draft, rows, 56, tree=tree, stop=[stop]),
        speculative.generate(target, draft, left, 56, tree=tree, stop=[stop], attention_mask=mask_left),
        speculative.generate(target, draft, right, 56, tree=tree, stop=[stop], attention_mask=mask_right),
    ]
    for out in outputs:
        assert out.tolist() == expected
        assert out.lengths.tolist() == [len(e) for e in expected]
        # The padding: -1 after each row's tokens.
        assert all(bool((out.tokens[b, len(e):] == -1).all()) for b, e in enumerate(expected))
    stats = outputs[0].stats
    # The rows really differed: accepted lengths within one round, and when they finished.
    assert any(len({n for n in lengths if n}) > 1 for lengths in stats.accept_lengths)
    assert len(set(stats.row_rounds)) > 1
    assert stats.rounds == max(stats.row_rounds)
    assert stats.emitted == [len(e) for e in expected]
    assert stats.produced == sum(stats.emitted) - len(rows)
    for b, e in enumerate(expected):  # each row alone, through the library too
        single = speculative.generate(target, draft, [rows[b]], 56, tree=tree, stop=[stop])
        assert single.tolist() == [e]
        assert single.stats.rounds == stats.row_rounds[b]


def tiny_sliding_target(kind):
    """A tiny random Gemma 4 (KV-shared layers, per-layer inputs) or gpt-oss (sinks, experts):
    sliding window 4, shorter than the trees and the outputs."""
    import transformers

    names = {"gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM"), "gpt_oss": ("GptOssConfig", "GptOssForCausalLM")}
    config_class, model_class = (getattr(transformers, name, None) for name in names[kind])
    if config_class is None or model_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {kind}")
    hf.register()
    common = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, pad_token_id=0,
                  bos_token_id=1, eos_token_id=None, sliding_window=4,
                  layer_types=["sliding_attention", "full_attention"] * 2)
    torch.manual_seed(5)
    if kind == "gemma4":
        config = config_class(**common, head_dim=256, global_head_dim=512, num_global_key_value_heads=1,
                              attention_k_eq_v=True, num_kv_shared_layers=2, hidden_size_per_layer_input=8,
                              vocab_size_per_layer_input=64, final_logit_softcapping=None, tie_word_embeddings=False)
    else:
        config = config_class(**common, head_dim=64, num_local_experts=4, num_experts_per_tok=2)
    config._attn_implementation = "tree_attn"
    model = model_class(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if kind == "gemma4":
                layer.self_attn.q_norm.weight.fill_(0.3)
            else:
                layer.self_attn.sinks.normal_(0.0, 1.5)
    torch.manual_seed(6)
    draft = Eagle3Draft(Eagle3Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                     intermediate_size=96, vocab_size=64, draft_vocab_size=32, target_hidden_size=64))
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0.0, 0.2)
    draft.set_vocab_map(torch.randperm(64, generator=torch.Generator().manual_seed(6))[:32])
    return model, draft.eval()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("kind", ["gemma4", "gpt_oss"])
def test_sliding_window_targets_in_a_batch(kind, device):
    """Per-row prefixes on sliding-window layers (the window counted by tree position, per row):
    every row of a batch is transformers' greedy decoding of that row. On CUDA, Gemma 4's rounds
    are graph-replayed; gpt-oss's may not be (transformers' eager experts route with `nonzero`,
    which no graph captures): then the rounds run eagerly, and a warning says why."""
    import warnings

    target, draft = tiny_sliding_target(kind)
    target, draft = target.to(device), draft.to(device)
    rows = [[1, 5, 9, 12, 20, 33, 41], [1, 7], [1, 30, 2, 8, 17]]
    # A wide tree: with half the vocabulary as children, even a random draft gets tokens accepted.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = speculative.generate(target, draft, rows, 14, tree=TreeConfig(40, 3, 16), stop=())
    capture_warnings = [w for w in caught if "CUDA-graph capture failed" in str(w.message)]
    if device == "cuda":
        assert out.stats.cuda_graphs or kind == "gpt_oss", [str(w.message) for w in capture_warnings]
        assert out.stats.cuda_graphs == (not capture_warnings)
    else:
        assert not out.stats.cuda_graphs and not capture_warnings
    for b, row in enumerate(rows):
        ids = torch.tensor([row], device=device)
        config = GenerationConfig(max_new_tokens=14, do_sample=False, pad_token_id=0, eos_token_id=None)
        with torch.no_grad():
            reference = target.generate(ids, generation_config=config, attention_mask=torch.ones_like(ids))
        if device == "cpu":
            assert out.tolist()[b] == reference[0, len(row):].tolist(), b
        else:
            assert_greedy(target, row, out.tolist()[b], reference[0, len(row):].tolist())
    assert sum(n >= 2 for lengths in out.stats.accept_lengths for n in lengths) >= 3  # draft tokens accepted


def test_stream_yields_what_generate_returns(pair):
    target, draft = pair
    rows = [encode(p) for p in PROMPTS[:3]]
    out = speculative.generate(target, draft, rows, 30, stop=())
    chunks = list(speculative.stream(target, draft, rows, 30, stop=()))
    assert [len(t) for t in chunks[0].tokens] == [1, 1, 1]  # the prefill's token of every row
    assert len(chunks) == 1 + chunks[-1].stats.rounds
    joined = [sum((c.tokens[b] for c in chunks), []) for b in range(3)]
    assert joined == out.tolist()
    stats = chunks[-1].stats
    assert all(c.stats is stats for c in chunks)
    for i, chunk in enumerate(chunks[1:]):  # each round's tokens: at most what it produced
        assert all(len(t) <= n for t, n in zip(chunk.tokens, stats.accept_lengths[i]))
    for previous, chunk in zip(chunks, chunks[1:]):  # a finished row stays finished, silent
        for b in range(3):
            assert not previous.done[b] or (chunk.done[b] and chunk.tokens[b] == [])
    assert chunks[-1].done == [True] * 3
    assert stats.total_s >= stats.prefill_s + stats.draft_s + stats.verify_s > 0


def test_buffers_are_reused_and_freed_with_the_target(tiny_pair):
    import gc
    import weakref

    _, draft = tiny_pair
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=64, max_position_embeddings=64)
    config._attn_implementation = "tree_attn"
    target = LlamaForCausalLM(config).eval()
    out = speculative.generate(target, draft, [PROMPT], 5, stop=())
    engine = spec_engine._ENGINES[target]
    assert out.stats.setup_s > 0
    again = speculative.generate(target, draft, [PROMPT], 5, stop=())
    assert spec_engine._ENGINES[target] is engine and again.stats.setup_s == 0  # the same buffers
    assert again.tolist() == out.tolist()
    engine = weakref.ref(engine)
    del target
    gc.collect()
    assert engine() is None  # the buffers do not keep the target alive, nor outlive it


# --------------------------------------------------------------------------------------------
# Budget and stop tokens
# --------------------------------------------------------------------------------------------


def test_budget_of_one_is_the_prefill_token(pair):
    target, draft = pair
    row = encode(PROMPTS[0])
    out = speculative.generate(target, draft, [row], 1, stop=())
    assert out.tolist() == [hf_greedy(target, row, 1)]
    assert out.stats.rounds == 0 and out.stats.forwards == 1 and out.stats.mean_acceptance_length is None


def test_budget_at_and_past_a_round_boundary(pair):
    target, draft = pair
    row = encode(PROMPTS[1])
    tree = TreeConfig(24, 8, 4)
    free = speculative.generate(target, draft, [row], 80, tree=tree, stop=())
    sizes = [lengths[0] for lengths in free.stats.accept_lengths]
    assert len(sizes) >= 3 and sizes[2] > 1
    boundary = 1 + sizes[0] + sizes[1]  # the prefill's token, then two whole rounds
    at = speculative.generate(target, draft, [row], boundary, tree=tree, stop=())
    assert at.tolist() == [free.tolist()[0][:boundary]]
    assert (at.stats.rounds, at.stats.cut) == (2, 0)
    past = speculative.generate(target, draft, [row], boundary + 1, tree=tree, stop=())
    assert past.tolist() == [free.tolist()[0][: boundary + 1]]
    assert (past.stats.rounds, past.stats.cut) == (3, sizes[2] - 1)


def test_stop_tokens(pair, monkeypatch):
    target, draft = pair
    row = encode(PROMPTS[0])
    tree = TreeConfig(24, 8, 4)
    free = speculative.generate(target, draft, [row], 80, tree=tree, stop=())
    tokens = free.tolist()[0]
    sizes = [lengths[0] for lengths in free.stats.accept_lengths]
    # The prefill's token as the stop token: nothing else.
    first = speculative.generate(target, draft, [row], 80, tree=tree, stop=tokens[0])
    assert first.tolist() == [tokens[:1]] and first.stats.rounds == 0
    # A token inside the second round that did not occur before: the output ends with it, and
    # the rest of the round is cut.
    start = 1 + sizes[0]
    position = next(i for i in range(start, start + sizes[1] - 1) if tokens[i] not in tokens[:i])
    unused = next(t for t in range(256) if t not in tokens)
    inside = speculative.generate(target, draft, [row], 80, tree=tree, stop={tokens[position], unused})
    assert inside.tolist() == [tokens[: position + 1]]
    assert inside.stats.rounds == 2 and inside.stats.cut == start + sizes[1] - position - 1 > 0
    # stop=None: the target's generation_config.eos_token_id.
    monkeypatch.setattr(target.generation_config, "eos_token_id", tokens[position])
    assert speculative.generate(target, draft, [row], 80, tree=tree).tolist() == [tokens[: position + 1]]
    monkeypatch.setattr(target.generation_config, "eos_token_id", [unused, tokens[position]])
    assert speculative.generate(target, draft, [row], 80, tree=tree).tolist() == [tokens[: position + 1]]


# --------------------------------------------------------------------------------------------
# Sampling: the target's distribution, exactly
# --------------------------------------------------------------------------------------------

VOCAB = 6
PROMPT = [1, 2, 3]
ROWS = 12000


@pytest.fixture(scope="module")
def tiny_pair():
    """A target over 6 tokens whose next-token distributions are far from uniform and from a
    point mass, and a random EAGLE-3 draft for it."""
    hf.register()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=64, max_position_embeddings=64,
                         initializer_range=0.15, bos_token_id=0, eos_token_id=None, pad_token_id=None)
    config._attn_implementation = "tree_attn"
    target = LlamaForCausalLM(config).eval()
    draft = Eagle3Draft(Eagle3Config(hidden_size=64, num_attention_heads=1, num_key_value_heads=1, head_dim=64,
                                     intermediate_size=64, vocab_size=VOCAB, target_hidden_size=64))
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0.0, 0.3)
    return target, draft.eval()


def exact_joint(target, temperature, top_p):
    """P(t1, t2, t3) of sampling the target token by token, [V, V, V]."""
    V = VOCAB
    pairs = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # [V * V, 2]
    seqs = torch.cat([torch.tensor(PROMPT).expand(V * V, -1), pairs], dim=1).to(target.device)
    with torch.no_grad():
        logits = target(seqs).logits.cpu()  # [V * V, L + 2, V]
    probs = sampling_probs(logits[:, len(PROMPT) - 1:].double(), temperature, top_p).double()
    p1 = probs[0, 0]  # [V]
    p2 = probs[:, 1].view(V, V, V)[:, 0]  # [t1, t2]
    p3 = probs[:, 2].view(V, V, V)  # [t1, t2, t3]
    return p1[:, None, None] * p2[:, :, None] * p3


def chi_squared_p(observed, expected):
    """p-value of Pearson's chi-squared test; cells expecting fewer than 5 are pooled. A cell of
    probability 0 (outside top-p) must never be observed."""
    observed, expected = observed.flatten().double(), expected.flatten().double()
    impossible = expected == 0
    assert observed[impossible].sum() == 0, "sampled a sequence of probability 0"
    observed, expected = observed[~impossible], expected[~impossible]
    small = expected < 5
    if small.any():
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    statistic = ((observed - expected) ** 2 / expected).sum()
    df = observed.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), statistic / 2))


def sample_joint(target, draft, temperature, top_p, device="cpu", **kwargs):
    out = speculative.generate(target, draft, [PROMPT] * ROWS, 3, temperature=temperature, top_p=top_p,
                               tree=TreeConfig(10, 3, 3), stop=(), generator=torch.Generator().manual_seed(1234),
                               **kwargs)
    assert out.lengths.eq(3).all()
    t = out.tokens
    counts = torch.bincount(t[:, 0] * VOCAB * VOCAB + t[:, 1] * VOCAB + t[:, 2], minlength=VOCAB ** 3)
    return counts.view(VOCAB, VOCAB, VOCAB), out.stats


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.8, 0.9)])
def test_sampling_preserves_the_target_distribution(tiny_pair, temperature, top_p):
    target, draft = tiny_pair
    joint = exact_joint(target, temperature, top_p)
    assert 0.05 < float(joint.sum(dim=(1, 2)).max()) < 0.9  # neither a point mass nor uniform
    counts, stats = sample_joint(target, draft, temperature, top_p)
    # The tree mattered: many rows accepted a draft token in round 1, some two.
    first_round = torch.tensor(stats.accept_lengths[0])
    assert float((first_round >= 2).float().mean()) > 0.15 and int((first_round >= 3).sum()) > 100
    assert chi_squared_p(counts, ROWS * joint) > 1e-3


def _no_zeroing(real):
    def trials(p, kid_tokens, is_kid, draws):
        success, _ = real(p, kid_tokens, is_kid, draws)
        return success, p  # WRONG: a rejected child stays in the residual
    return trials


def _independent_trials(real):
    def trials(p, kid_tokens, is_kid, draws):
        _, residual = real(p, kid_tokens, is_kid, draws)
        kid_mass = torch.where(is_kid, p.gather(1, kid_tokens), 0.0)
        return (draws < kid_mass) & is_kid, residual  # WRONG: p not renormalised after a rejection
    return trials


@pytest.mark.parametrize("wrong", [_no_zeroing, _independent_trials])
def test_the_sampling_test_rejects_a_wrong_rule(tiny_pair, monkeypatch, wrong):
    """The same statistics, with the acceptance rule replaced by a plausible wrong one: the
    test must reject it, so it has the power to catch a wrong rule."""
    target, draft = tiny_pair
    monkeypatch.setattr(spec_engine, "_sibling_trials", wrong(spec_engine._sibling_trials))
    counts, _ = sample_joint(target, draft, 1.0, 1.0)
    assert chi_squared_p(counts, ROWS * exact_joint(target, 1.0, 1.0)) < 1e-6


def test_sampling_is_reproducible(pair):
    target, draft = pair
    rows = [encode(p) for p in PROMPTS[:2]]
    runs = [speculative.generate(target, draft, rows, 24, temperature=0.8, top_p=0.9, stop=(),
                                 generator=torch.Generator().manual_seed(s)).tolist() for s in (5, 5, 6)]
    assert runs[0] == runs[1] != runs[2]


# --------------------------------------------------------------------------------------------
# Bad arguments: a clear exception naming the argument and the value
# --------------------------------------------------------------------------------------------

GOOD_ROW = [256, 105, 109]


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(max_new_tokens=0), ValueError, "max_new_tokens must be an int >= 1, got 0"),
    (dict(max_new_tokens=2.5), ValueError, "max_new_tokens must be an int >= 1, got 2.5"),
    (dict(max_new_tokens=True), ValueError, "max_new_tokens must be an int >= 1, got True"),
    (dict(temperature=-1), ValueError, "temperature must be a finite number >= 0 (0 = greedy), got -1"),
    (dict(temperature=float("nan")), ValueError, "temperature must be a finite number >= 0 (0 = greedy), got nan"),
    (dict(temperature=float("inf")), ValueError, "got inf"),
    (dict(temperature=1e-9), ValueError, "temperature must be 0 (greedy) or >= 1e-4"),
    (dict(temperature="hot"), ValueError, "got 'hot'"),
    (dict(top_p=0), ValueError, "top_p must be in (0, 1], got 0"),
    (dict(top_p=1.5), ValueError, "top_p must be in (0, 1], got 1.5"),
    (dict(tree=(24, 8, 4)), TypeError, "tree must be a TreeConfig, got tuple"),
    (dict(stop="eos"), TypeError, "stop must hold int token ids, got ['e', 'o', 's']"),
    (dict(stop=[300]), ValueError, "stop holds ids outside the target's vocabulary [0, 264): [300]"),
    (dict(stop=3.0), TypeError, "stop must be None, a token id or an iterable of token ids, got float"),
    (dict(input_ids=torch.tensor([[1.0, 2.0]])), ValueError, "input_ids must be an int64 tensor [B, L] or [L], got torch.float32"),
    (dict(input_ids=torch.zeros(1, 2, 3, dtype=torch.long)), ValueError, "of shape (1, 2, 3)"),
    (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), ValueError, "input_ids row 0 has no tokens"),
    (dict(input_ids=torch.zeros(0, 3, dtype=torch.long)), ValueError, "input_ids has no rows, shape (0, 3)"),
    (dict(input_ids=[]), ValueError, "input_ids has no rows"),
    (dict(input_ids=[[1, 2], []]), ValueError, "input_ids row 1 has no tokens"),
    (dict(input_ids=[[1, 264]]), ValueError, "input_ids row 0 holds ids outside the target's vocabulary [0, 264): [264]"),
    (dict(input_ids=[[1, "a"]]), ValueError, "input_ids row 0 must hold ints, got [1, 'a']"),
    (dict(input_ids="hello"), TypeError, "input_ids must be an int64 tensor [B, L] or a list of token-id lists, got str"),
    (dict(input_ids=torch.tensor([GOOD_ROW]), attention_mask=torch.ones(1, 2, dtype=torch.long)), ValueError,
     "attention_mask must be a tensor shaped like input_ids (1, 3), got (1, 2)"),
    (dict(input_ids=torch.tensor([GOOD_ROW]), attention_mask=torch.tensor([[1, 0, 1]])), ValueError,
     "attention_mask row 0 has padding between tokens"),
    (dict(input_ids=torch.tensor([GOOD_ROW]), attention_mask=torch.tensor([[1, 2, 1]])), ValueError,
     "attention_mask must hold 0 (padding) and 1 (token), got values [1, 2]"),
    (dict(input_ids=torch.tensor([GOOD_ROW]), attention_mask=torch.tensor([[0, 0, 0]])), ValueError,
     "input_ids row 0 has no tokens"),
    (dict(attention_mask=torch.ones(1, 3, dtype=torch.long)), ValueError, "attention_mask goes with a tensor input_ids"),
    (dict(generator=42), TypeError, "generator must be a torch.Generator or None, got int"),
    (dict(cuda_graphs="yes"), TypeError, "cuda_graphs must be None (auto), True or False, got 'yes'"),
    (dict(drafter=object()), TypeError, "drafter must be an Eagle3Draft or an Eagle3Drafter, got object"),
    (dict(target=object()), TypeError, "target must be a transformers causal LM, got object"),
])
def test_bad_arguments(pair, kwargs, error, message):
    target, draft = pair
    call = dict(target=target, drafter=draft, input_ids=[GOOD_ROW], max_new_tokens=4)
    call.update(kwargs)
    with pytest.raises(error) as info:
        speculative.generate(call.pop("target"), call.pop("drafter"), call.pop("input_ids"), call.pop("max_new_tokens"),
                             **call)
    assert message in str(info.value)
    # stream() checks at the call, before the first chunk is asked for.
    with pytest.raises(error):
        call = dict(target=target, drafter=draft, input_ids=[GOOD_ROW], max_new_tokens=4)
        call.update(kwargs)
        speculative.stream(call.pop("target"), call.pop("drafter"), call.pop("input_ids"), call.pop("max_new_tokens"),
                           **call)


@pytest.mark.skipif(CUDA, reason="CUDA is available here")
def test_cuda_graphs_need_cuda(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA target, got one on cpu"):
        speculative.generate(target, draft, [GOOD_ROW], 4, cuda_graphs=True)


def test_target_without_tree_attn_and_mismatched_draft(pair):
    target, draft = pair
    sdpa = builtin.load_builtin_target(attn_implementation="sdpa")
    with pytest.raises(ValueError, match="target must run attn_implementation='tree_attn'.*got 'sdpa'"):
        speculative.generate(sdpa, draft, [GOOD_ROW], 4)
    other = Eagle3Draft(Eagle3Config(hidden_size=64, num_attention_heads=1, num_key_value_heads=1, head_dim=64,
                                     intermediate_size=64, vocab_size=264, target_hidden_size=128))
    with pytest.raises(ValueError, match="drafter reads target hidden states of size 128, the target's hidden_size is 256"):
        speculative.generate(target, other, [GOOD_ROW], 4)


# --------------------------------------------------------------------------------------------
# CUDA: the same, and graph capture and replay (skipped without CUDA)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda_pair():
    if not CUDA:
        pytest.skip("needs a CUDA device")
    return load_builtin_pair(device="cuda")


def assert_greedy(target, row, tokens, reference):
    """tokens == reference, or they part where plain greedy's two candidates are a tie
    (speculative.tie_tolerance): on the GPU the kernels round differently by shape."""
    if tokens == reference:
        return
    i = next(i for i, (a, b) in enumerate(zip(tokens + [None], reference + [None])) if a != b)
    steps = step_logits(target, row, reference[: i + 1])
    s = steps[i].cpu()
    tolerance = speculative.tie_tolerance(next(target.parameters()).dtype)
    assert s[reference[i]] - s[tokens[i]] <= tolerance * s.abs().max(), f"token {i}: {tokens[i]} vs {reference[i]}"


@needs_cuda
@pytest.mark.parametrize("graphs", [True, False])
def test_cuda_greedy_and_batch(cuda_pair, graphs):
    target, draft = cuda_pair
    rows = [encode(p) for p in PROMPTS]
    out = speculative.generate(target, draft, rows, 64, stop=(), cuda_graphs=graphs)
    assert out.stats.cuda_graphs == graphs
    for row, tokens in zip(rows, out.tolist()):
        assert_greedy(target, row, tokens, hf_greedy(target, row, 64))
    for b, row in enumerate(rows[:2]):
        assert speculative.generate(target, draft, [row], 64, stop=(), cuda_graphs=graphs).tolist() == [out.tolist()[b]]


@needs_cuda
def test_cuda_graphs_are_captured_once_and_replayed(cuda_pair):
    target, draft = cuda_pair
    speculative.release(target)
    row = encode(PROMPTS[0])
    first = speculative.generate(target, draft, [row], 96, stop=())
    engine = spec_engine._ENGINES[target]
    graphs = dict(engine.graphs)
    assert first.stats.cuda_graphs and first.stats.capture_s > 0 and len(graphs) == 3
    again = speculative.generate(target, draft, [row], 96, stop=())
    assert again.tolist() == first.tolist()
    assert_greedy(target, row, first.tolist()[0], hf_greedy(target, row, 96))
    assert again.stats.capture_s == 0 and spec_engine._ENGINES[target] is engine
    assert all(engine.graphs[k] is g for k, g in graphs.items())  # replayed, not captured again
    eager = speculative.generate(target, draft, [row], 96, stop=(), cuda_graphs=False)
    assert eager.tolist() == first.tolist()
    assert (again.stats.rounds, again.stats.accept_lengths) == (eager.stats.rounds, eager.stats.accept_lengths)


@needs_cuda
@pytest.mark.parametrize("graphs", [True, False])
def test_cuda_round_does_not_synchronize(cuda_pair, graphs):
    """A round (draft, verify, accept) runs without a host synchronisation: torch's sync debug
    mode raises on any; the round's one read happens after it."""
    target, draft = cuda_pair
    rows = [encode(p) for p in PROMPTS[:2]]
    for temperature in (0.0, 0.8):
        chunks = speculative.stream(target, draft, rows, 200, temperature=temperature, stop=(), cuda_graphs=graphs)
        next(chunks)  # the prefill
        next(chunks)  # the first round (with graphs: the warm-up round, then the capture)
        engine = spec_engine._ENGINES[target]
        timer = spec_engine._Timer(torch.device("cuda"))
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                timer.start()  # the timer holds one round's events
                engine.round(temperature, 1.0, graphs, timer)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


@needs_cuda
def test_cuda_sampling_with_graphs_preserves_the_distribution(tiny_pair):
    target, draft = tiny_pair
    target, draft = target.cuda(), draft.cuda()
    try:
        counts, stats = sample_joint(target, draft, 1.0, 1.0)
        assert stats.cuda_graphs
        assert chi_squared_p(counts.cpu(), ROWS * exact_joint(target, 1.0, 1.0).cpu()) > 1e-3
    finally:
        target.cpu(), draft.cpu()
        speculative.release(target)


@needs_cuda
def test_cuda_cold_start_cli_is_twice_plain_greedy():
    """The README's demo on CUDA in a fresh process: from a cold start (first calls, graph capture
    included) and in the steady state, at least 2x plain greedy decoding."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "eagle3_verify.py"), "--device", "cuda",
                           "--check", "--no-progress"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cold = re.search(r"cold start .*; speedup ([\d.]+)x", proc.stdout)
    steady = re.search(r"speedup ([\d.]+)x \(steady state\)", proc.stdout)
    assert cold and steady, proc.stdout
    assert float(cold.group(1)) >= 2.0 and float(steady.group(1)) >= 2.0, proc.stdout
