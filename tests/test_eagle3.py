"""The EAGLE-3 draft, its checkpoint layout, and the speculative loop (torch_tree_attn.speculative,
which examples/eagle3_verify.py runs through torch_tree_attn.speculative.cli).

The loop is checked for exact greedy equivalence with token-by-token decoding; the draft's
cached tree expansion against an independent float64 sequential recomputation of each path;
the loader against checkpoints written by hand in the public EAGLE-3 layout.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from torch_tree_attn import hf, speculative  # noqa: E402
from torch_tree_attn.speculative import builtin  # noqa: E402
from torch_tree_attn.speculative.cli import plain_greedy  # noqa: E402
from torch_tree_attn.speculative.eagle3 import (  # noqa: E402
    Eagle3Config,
    Eagle3Draft,
    Eagle3Drafter,
    capture_target_features,
    feature_layer_ids,
    load_eagle3_draft,
    save_eagle3_draft,
)
from torch_tree_attn.tree import build_dynamic_tree  # noqa: E402
from tests.speculative_pair import load_builtin_pair, one_torch_thread  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "examples", "eagle3_verify.py")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with one_torch_thread():
        yield

# A small pair: target hidden 160 differs from the draft's 128, and the draft vocabulary
# (40 ids) is a strict subset of the target's (96), so fc's 3·Ht input and d2t both matter.
VOCAB, DRAFT_VOCAB, TARGET_HIDDEN = 96, 40, 160


def tiny_target(seed=0, hidden=TARGET_HIDDEN):
    hf.register()
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=256, num_hidden_layers=5,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512)
    cfg._attn_implementation = "tree_attn"
    return LlamaForCausalLM(cfg).eval()


def tiny_draft_config(**overrides):
    kw = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=192,
              vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, target_hidden_size=TARGET_HIDDEN,
              rms_norm_eps=1e-6, max_position_embeddings=512)
    kw.update(overrides)
    return Eagle3Config(**kw)


def tiny_draft(seed=1, config=None):
    torch.manual_seed(seed)
    draft = Eagle3Draft(config or tiny_draft_config())
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0.0, 0.2)
        for norm in (draft.norm, draft.midlayer.hidden_norm, draft.midlayer.input_layernorm,
                     draft.midlayer.post_attention_layernorm):
            norm.weight.uniform_(0.5, 1.5)
    draft.set_vocab_map(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:DRAFT_VOCAB])
    return draft.eval()


# --------------------------------------------------------------------------------------------
# Checkpoint layout
# --------------------------------------------------------------------------------------------


def public_layout_shapes(cfg: dict):
    """Names and shapes of the public EAGLE-3 state dict, from the config alone."""
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // heads
    ht = cfg.get("target_hidden_size") or h
    inter = cfg["intermediate_size"]
    return {
        "fc.weight": (h, 3 * ht),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, heads * hd),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "norm.weight": (h,),
        "lm_head.weight": (cfg["draft_vocab_size"], h),
        "d2t": (cfg["draft_vocab_size"],),
        "t2d": (cfg["vocab_size"],),
    }


PUBLIC_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 192,
    "max_position_embeddings": 512, "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "rope_scaling": None, "tie_word_embeddings": False, "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB,
    "target_hidden_size": TARGET_HIDDEN, "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2,
}


def write_public_checkpoint(directory, fmt, seed=0, config=PUBLIC_CONFIG, with_embeddings=False):
    """A checkpoint written by hand, the way the public releases lay it out (embed_tokens
    only when asked: releases whose draft is narrower than the target must ship it)."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    shapes = dict(public_layout_shapes(config))
    if with_embeddings:
        shapes["embed_tokens.weight"] = (config["vocab_size"], config["hidden_size"])
    for name, shape in shapes.items():
        if name == "d2t":
            ids = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values
            state[name] = ids - torch.arange(DRAFT_VOCAB)
        elif name == "t2d":
            t2d = torch.zeros(VOCAB, dtype=torch.bool)
            t2d[state["d2t"] + torch.arange(DRAFT_VOCAB)] = True
            state[name] = t2d
        else:
            state[name] = (torch.randn(shape, generator=g) * 0.1).to(torch.float16)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    if fmt == "bin":
        torch.save(state, os.path.join(directory, "pytorch_model.bin"))
    else:
        from safetensors.torch import save_file

        save_file(state, os.path.join(directory, "model.safetensors"))
    return state


SAME_WIDTH_CONFIG = {k: v for k, v in PUBLIC_CONFIG.items() if k != "target_hidden_size"}


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
@pytest.mark.parametrize("narrow_draft", [False, True])
def test_loads_public_layout_checkpoint(tmp_path, fmt, narrow_draft):
    config = PUBLIC_CONFIG if narrow_draft else SAME_WIDTH_CONFIG
    state = write_public_checkpoint(str(tmp_path), fmt, config=config, with_embeddings=narrow_draft)
    target = tiny_target(hidden=TARGET_HIDDEN if narrow_draft else 128)
    draft = load_eagle3_draft(str(tmp_path), target)
    loaded = draft.state_dict()
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor.to(loaded[name].dtype)), name
    if not narrow_draft:  # absent from the checkpoint: taken from the target
        assert torch.equal(draft.embed_tokens.weight, target.get_input_embeddings().weight)
    assert draft.config.target_hidden_size == (TARGET_HIDDEN if narrow_draft else 128)
    assert draft.fc.weight.shape == (128, 3 * draft.config.target_hidden_size) and draft.config.head_dim == 64
    assert torch.equal(draft.target_ids(), state["d2t"] + torch.arange(DRAFT_VOCAB))


def test_narrow_draft_without_embeddings_is_refused(tmp_path):
    write_public_checkpoint(str(tmp_path), "safetensors")
    with pytest.raises(ValueError, match=r"target embeddings are \(96, 160\), the draft expects \(96, 128\)"):
        load_eagle3_draft(str(tmp_path), tiny_target())


@pytest.mark.parametrize("safetensors", [True, False])
def test_save_writes_public_layout_and_round_trips(tmp_path, safetensors):
    target = tiny_target(hidden=128)
    draft = tiny_draft(config=tiny_draft_config(target_hidden_size=128))
    path = save_eagle3_draft(draft, str(tmp_path), safetensors=safetensors)
    assert os.path.basename(path) == ("model.safetensors" if safetensors else "pytorch_model.bin")
    with open(tmp_path / "config.json") as f:
        cfg = json.load(f)
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB and cfg["target_hidden_size"] == 128
    if safetensors:
        from safetensors.torch import load_file

        saved = load_file(path)
    else:
        saved = torch.load(path, weights_only=True)
    shapes = {k: tuple(v.shape) for k, v in saved.items()}
    assert shapes == public_layout_shapes(cfg)  # exactly these names; embed_tokens left out
    assert saved["d2t"].dtype == torch.int64 and saved["t2d"].dtype == torch.bool

    with torch.no_grad():
        target.get_input_embeddings().weight.copy_(draft.embed_tokens.weight)
    loaded = load_eagle3_draft(str(tmp_path), target)
    features = torch.randn(1, 7, 3 * 128)
    ids = torch.randint(0, VOCAB, (1, 7))
    trees = []
    for d in (draft, loaded):
        drafter = Eagle3Drafter(d)
        drafter.commit(ids[0], features[0])
        trees.append(build_dynamic_tree(int(ids[0, -1]), drafter.expand, total_tokens=16, depth=3, top_k=4))
    assert torch.equal(trees[0].tokens, trees[1].tokens) and torch.equal(trees[0].parents, trees[1].parents)
    torch.testing.assert_close(trees[1].scores, trees[0].scores, rtol=0, atol=0)


def test_loader_rejects_wrong_shapes_and_warns_on_unknown_names(tmp_path):
    target = tiny_target(hidden=128)
    state = write_public_checkpoint(str(tmp_path), "bin", config=SAME_WIDTH_CONFIG)
    state["midlayer.self_attn.q_proj.weight"] = torch.zeros(128, 128)  # 1H inputs: an EAGLE-2 shape
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"q_proj.weight has shape \(128, 128\).*\(128, 256\)"):
        load_eagle3_draft(str(tmp_path), target)

    state = write_public_checkpoint(str(tmp_path), "bin", config=SAME_WIDTH_CONFIG)
    state["layers.0.extra.weight"] = torch.zeros(3)
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.warns(UserWarning, match="layers.0.extra.weight"):
        load_eagle3_draft(str(tmp_path), target)

    del state["lm_head.weight"], state["layers.0.extra.weight"]
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_eagle3_draft(str(tmp_path), target)


def test_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="missing keys.*intermediate_size"):
        Eagle3Config.from_dict({"hidden_size": 8, "num_attention_heads": 2, "vocab_size": 10})
    with pytest.raises(ValueError, match="draft_vocab_size"):
        tiny_draft_config(draft_vocab_size=VOCAB + 1)


# --------------------------------------------------------------------------------------------
# Vocabulary mapping and features
# --------------------------------------------------------------------------------------------


def test_d2t_maps_draft_ids_to_target_ids():
    draft = tiny_draft()
    hidden = torch.randn(5, 128)
    logp = draft.target_logprobs(hidden)
    draft_logits = draft.lm_head(draft.norm(hidden)).double()
    draft_logp = draft_logits - draft_logits.logsumexp(-1, keepdim=True)
    expected = torch.full((5, VOCAB), float("-inf"), dtype=torch.float64)
    for draft_id in range(DRAFT_VOCAB):
        target_id = draft_id + int(draft.d2t[draft_id])
        assert bool(draft.t2d[target_id])
        expected[:, target_id] = draft_logp[:, draft_id]
    assert int(draft.t2d.sum()) == DRAFT_VOCAB
    torch.testing.assert_close(logp.double(), expected, rtol=1e-5, atol=1e-5)


def test_set_vocab_map_rejects_duplicates():
    draft = tiny_draft()
    with pytest.raises(ValueError, match="distinct"):
        draft.set_vocab_map(torch.zeros(DRAFT_VOCAB, dtype=torch.long))


def test_features_are_inputs_of_low_mid_high_layers():
    target = tiny_target()
    ids = torch.randint(0, VOCAB, (1, 6))
    out = target(input_ids=ids, output_hidden_states=True)
    layers = feature_layer_ids(5)
    assert layers == [2, 2, 2]  # 2, 5 // 2, 5 - 3
    assert feature_layer_ids(32) == [2, 16, 29]
    # hidden_states[i] is the input of decoder layer i: check it with a forward hook.
    seen = {}
    hooks = [layer.register_forward_pre_hook(lambda m, a, kw, i=i: seen.__setitem__(i, (a[0] if a else kw["hidden_states"])),
                                             with_kwargs=True)
             for i, layer in enumerate(target.model.layers)]
    target(input_ids=ids)
    for h in hooks:
        h.remove()
    feats = capture_target_features(out.hidden_states, [2, 3, 4])
    torch.testing.assert_close(feats, torch.cat([seen[2], seen[3], seen[4]], dim=-1))


# --------------------------------------------------------------------------------------------
# The draft's cached tree expansion against a sequential float64 recomputation
# --------------------------------------------------------------------------------------------


def sequential_path_logprobs(draft, commit_ids, commit_features, path_tokens):
    """Draft log-probs after each node of a root-to-node path, computed one position at a time
    in float64 with plain attention over [committed positions, path so far]."""
    d = Eagle3Draft(draft.config).double()
    d.load_state_dict(draft.state_dict())
    keys, values = [], []
    groups = d.config.num_attention_heads // d.config.num_key_value_heads

    def attend(q, k, v):
        keys.append(k)
        values.append(v)
        kk = torch.cat(keys, 2).repeat_interleave(groups, 1)
        vv = torch.cat(values, 2).repeat_interleave(groups, 1)
        scores = q @ kk.transpose(-1, -2) / q.shape[-1] ** 0.5
        return scores.softmax(-1) @ vv

    hidden = d.fuse(commit_features.double())
    outs = []
    for t in range(commit_ids.numel()):  # committed positions, one at a time (causal)
        h = d.decoder(commit_ids[t].view(1, 1), hidden[t].view(1, 1, -1), torch.tensor([[t]]), attend)
        outs.append(h)
    h = outs[-1]
    result = [d.target_logprobs(h[0, 0])]
    root_pos = commit_ids.numel() - 1
    for depth, tok in enumerate(path_tokens, start=1):
        h = d.decoder(torch.tensor([[tok]]), h, torch.tensor([[root_pos + depth]]), attend)
        result.append(d.target_logprobs(h[0, 0]))
    return result


def test_decoder_broadcasts_one_position_over_a_frontier():
    # The drafter passes one [1, 1] position for a whole frontier; it must equal giving every
    # node that position, and differ from giving them other positions (rotary is in play).
    d = tiny_draft().double()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (1, 5), generator=g)
    hidden = torch.randn(1, 5, d.config.hidden_size, generator=g, dtype=torch.float64)

    def attend(q, k, v):  # each query sees every key: positions matter only through rotary
        kk, vv = (t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
        return (q @ kk.transpose(-1, -2) / q.shape[-1] ** 0.5).softmax(-1) @ vv

    per_node = d.decoder(ids, hidden, torch.full((1, 5), 41), attend)
    shared = d.decoder(ids, hidden, torch.full((1, 1), 41), attend)
    torch.testing.assert_close(shared, per_node, rtol=0, atol=1e-12)
    staggered = d.decoder(ids, hidden, torch.arange(41, 46)[None], attend)
    assert not torch.allclose(staggered, per_node, atol=1e-6)


@pytest.mark.parametrize("rounds", [1, 2])
def test_tree_expansion_matches_sequential_paths(rounds):
    draft = tiny_draft()
    drafter = Eagle3Drafter(draft, capacity=8)  # small: forces the cache to grow
    g = torch.Generator().manual_seed(3)
    all_ids = torch.randint(0, VOCAB, (12,), generator=g)
    all_feats = torch.randn(12, 3 * TARGET_HIDDEN, generator=g)
    cut = 7 if rounds == 2 else 12
    drafter.commit(all_ids[:cut], all_feats[:cut])
    if rounds == 2:  # a first tree, then more committed positions, as in the loop
        build_dynamic_tree(int(all_ids[cut - 1]), drafter.expand, total_tokens=12, depth=3, top_k=3)
        drafter.end_tree()
        drafter.commit(all_ids[cut:], all_feats[cut:])

    recorded = []

    def expand(step):
        out = drafter.expand(step)
        recorded.append((step, out))
        return out

    tree = build_dynamic_tree(int(all_ids[-1]), expand, total_tokens=20, depth=4, top_k=3)
    drafter.end_tree()
    assert drafter.cache.length == 12 and len(tree) == 20

    # Walk every expanded node back to the root through parents_in_tree.
    parents_of, token_of, logp_of = [], [], []
    for step, out in recorded:
        for i in range(step.tokens.numel()):
            parents_of.append(int(step.parents_in_tree[i]))
            token_of.append(int(step.tokens[i]))
            logp_of.append(out[i])
    assert len(recorded) >= 3
    for node in range(1, len(parents_of)):
        path, n = [], node
        while n > 0:
            path.append(token_of[n])
            n = parents_of[n]
        path.reverse()
        ref = sequential_path_logprobs(draft, all_ids, all_feats, path)[-1]
        finite = torch.isfinite(ref)
        assert torch.equal(finite, torch.isfinite(logp_of[node]))
        torch.testing.assert_close(logp_of[node][finite].double(), ref[finite], rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------
# The loop: greedy equivalence
# --------------------------------------------------------------------------------------------


def run_pair(target, draft, prompt_ids, max_new, total_tokens, depth, top_k):
    tree = speculative.TreeConfig(total_tokens=total_tokens, depth=depth, top_k=top_k)
    spec = speculative.generate(target, Eagle3Drafter(draft), prompt_ids, max_new, tree=tree, stop=())
    base = plain_greedy(target, prompt_ids, max_new, set())
    return spec, base


@pytest.mark.parametrize("total_tokens,depth,top_k", [(60, 7, 10), (8, 3, 2), (24, 5, 4), (2, 1, 1)])
def test_loop_equals_greedy_random_pair(total_tokens, depth, top_k):
    target, draft = tiny_target(), tiny_draft()
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(total_tokens))
    spec, base = run_pair(target, draft, prompt, 24, total_tokens, depth, top_k)
    assert spec.tolist()[0] == base.tokens


@pytest.fixture(scope="module")
def builtin_pair():
    return (*load_builtin_pair(), builtin.ByteTokenizer())


@pytest.mark.parametrize("prompt,shape", [
    ("import os\nimport sys\n\n\ndef main(argv):\n    ", (60, 7, 10)),
    ("class Parser:\n    def __init__(self, text):\n", (30, 5, 6)),
    ("    for line in lines:\n", (12, 3, 3)),
])
def test_loop_equals_greedy_builtin(builtin_pair, prompt, shape):
    target, draft, tok = builtin_pair
    ids = torch.tensor([tok.encode(prompt)])
    spec, base = run_pair(target, draft, ids, 64, *shape)
    assert spec.tolist()[0] == base.tokens
    # The trained draft must actually be predicting the target (features wired right).
    assert spec.stats.mean_acceptance_length > 1.5


def test_demo_check_mode_subprocess():
    proc = subprocess.run(
        [sys.executable, DEMO, "--check", "--max-new-tokens", "48", "--no-progress"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "check: OK" in proc.stdout
    assert "mean acceptance length" in proc.stdout and "plain greedy decoding" in proc.stdout


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0},
                                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_draft_rotary_matches_transformers_llama(scaling):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from torch_tree_attn.speculative.eagle3 import Rotary

    shape = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                 vocab_size=10, max_position_embeddings=512)
    params = {"rope_type": "default", **(scaling or {}), "rope_theta": 5e5}
    reference = LlamaRotaryEmbedding(LlamaConfig(**shape, rope_parameters=params))
    positions = torch.arange(0, 300)[None]
    cos_ref, sin_ref = reference(torch.zeros(1, 300, 64), positions)
    cos, sin = Rotary(Eagle3Config(**shape, rope_theta=5e5, rope_scaling=scaling))(positions)
    # transformers derives the frequencies in float32, this module in float64: the angles at
    # position 300 differ by a few float32 ulps.
    torch.testing.assert_close(cos, cos_ref, rtol=0, atol=1e-4)
    torch.testing.assert_close(sin, sin_ref, rtol=0, atol=1e-4)
