"""The command line of examples/eagle3_verify.py (torch_tree_attn.speculative.cli): bad input gives
one clear line and a non-zero exit status, never a traceback, and the reported numbers match
what was actually emitted; the built-in models' assets directory is found, or named.

Everything runs in-process through ``main([...])`` on the built-in models with small budgets;
tests/test_eagle3.py runs the example script itself as a subprocess.
"""
import os
import re

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from torch_tree_attn.speculative import builtin  # noqa: E402
from torch_tree_attn.speculative import cli as demo  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = "eagle3_verify.py: error: "


@pytest.fixture(autouse=True)
def restore_threads():
    # main() sets one torch thread for the built-in models on CPU; give the default back.
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def offline(monkeypatch):
    """No network here: make hub look-ups fail at once instead of after connection retries."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def exit_of(argv, capsys):
    """main(argv)'s SystemExit code and its stderr."""
    with pytest.raises(SystemExit) as info:
        demo.main(argv)
    return info.value.code, capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# Bad flags: argparse's usage error, status 2, the last line naming the flag and the value
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv,flag,seen", [
    (["--max-new-tokens", "0"], "--max-new-tokens", "'0'"),
    (["--max-new-tokens", "-3"], "--max-new-tokens", "'-3'"),
    (["--max-new-tokens", "2.5"], "--max-new-tokens", "'2.5'"),
    (["--total-tokens", "0"], "--total-tokens", "'0'"),
    (["--depth", "-1"], "--depth", "'-1'"),
    (["--top-k", "0"], "--top-k", "'0'"),
    (["--top-k", "two"], "--top-k", "'two'"),
    (["--top-p", "0"], "--top-p", "'0'"),
    (["--top-p", "1.5"], "--top-p", "'1.5'"),
    (["--top-p", "nan"], "--top-p", "'nan'"),
    (["--top-p", "-0.5"], "--top-p", "'-0.5'"),
    (["--temperature", "-1"], "--temperature", "'-1'"),
    (["--temperature", "nan"], "--temperature", "'nan'"),
    (["--temperature", "inf"], "--temperature", "'inf'"),
    (["--temperature", "1e-300"], "--temperature", "'1e-300'"),  # overflows float32 logits / T
    (["--temperature", "warm"], "--temperature", "'warm'"),
    (["--threads", "0"], "--threads", "'0'"),
    (["--threads", "-2"], "--threads", "'-2'"),
    (["--seed", str(2**64)], "--seed", repr(str(2**64))),
    (["--device", "tpu"], "--device", "'tpu'"),
    (["--dtype", "float64"], "--dtype", "'float64'"),
    (["--check", "--temperature", "0.7"], "--check", "0.7"),
    (["--target", "some-org/some-model"], "--draft", "'some-org/some-model'"),
    (["--prompt", "caf\udce9"], "--prompt", "'caf\\udce9'"),  # undecodable byte from the shell
])
def test_bad_flag_is_a_usage_error(argv, flag, seen, capsys):
    code, err = exit_of(argv, capsys)
    assert code == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"{PREFIX}argument {flag}:"), err
    assert seen in last, err
    assert "Traceback" not in err


def test_parse_args_accepts_the_edges():
    args = demo.parse_args(["--max-new-tokens", "1", "--total-tokens", "1", "--depth", "0", "--top-k", "1",
                            "--top-p", "1", "--temperature", "1e-4", "--threads", "1", "--seed", "-1"])
    assert (args.max_new_tokens, args.total_tokens, args.depth, args.top_k) == (1, 1, 0, 1)
    assert (args.top_p, args.temperature, args.threads, args.seed) == (1.0, 1e-4, 1, -1)
    assert demo.parse_args(["--temperature", "-0"]).temperature == 0  # greedy, not a negative value
    # The tree-shape defaults: small for the built-in pair on CPU, EAGLE's elsewhere.
    small = demo.parse_args([])
    assert (small.total_tokens, small.depth, small.top_k) == (16, 6, 2)
    eagle = demo.parse_args(["--device", "cuda"])
    assert (eagle.total_tokens, eagle.depth, eagle.top_k) == (60, 7, 10)


def test_top_p_with_greedy_is_noted(capsys):
    demo.parse_args(["--top-p", "0.9"])
    assert "--top-p 0.9 has no effect with --temperature 0" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# Environment and model problems: one line, status 1
# --------------------------------------------------------------------------------------------


def assert_one_line(code, err, flag, *parts):
    assert code == 1
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"{PREFIX}{flag} "), err
    for part in parts:
        assert part in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_unavailable(capsys):
    assert_one_line(*exit_of(["--device", "cuda"], capsys), "--device", "CUDA is not available")


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="MPS is available here")
def test_mps_unavailable(capsys):
    assert_one_line(*exit_of(["--device", "mps"], capsys), "--device", "MPS is not available")


@pytest.mark.parametrize("flag", ["--target", "--draft"])
def test_missing_local_path(flag, tmp_path, capsys):
    for missing in (str(tmp_path / "no" / "such" / "model"), "./no-such-model-dir/"):
        argv = ["--target", missing, "--draft", missing] if flag == "--target" else ["--draft", missing]
        assert_one_line(*exit_of(argv, capsys), flag, repr(missing), "no such directory")


@pytest.mark.parametrize("flag", ["--target", "--draft"])
def test_file_instead_of_directory(flag, tmp_path, capsys):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"")
    argv = ["--target", str(path), "--draft", str(path)] if flag == "--target" else ["--draft", str(path)]
    assert_one_line(*exit_of(argv, capsys), flag, repr(str(path)), "is a file")


@pytest.mark.parametrize("flag", ["--target", "--draft"])
def test_directory_without_a_checkpoint(flag, tmp_path, capsys):
    argv = ["--target", str(tmp_path), "--draft", str(tmp_path)] if flag == "--target" else ["--draft", str(tmp_path)]
    assert_one_line(*exit_of(argv, capsys), flag, repr(str(tmp_path)), "cannot load it")


@pytest.mark.parametrize("flag", ["--target", "--draft"])
def test_hub_id_that_cannot_be_fetched(flag, offline, capsys):
    # Looks like a hub id and is no local directory: the download is tried, and fails here.
    argv = ["--target", "no-such-org/no-such-model", "--draft", "no-such-org/no-such-draft"]
    if flag == "--draft":
        argv = ["--draft", "no-such-org/no-such-draft"]
    source = argv[argv.index(flag) + 1]
    assert_one_line(*exit_of(argv, capsys), flag, repr(source), "fetching it from the Hugging Face Hub failed")


# --------------------------------------------------------------------------------------------
# Flags only the loaded model can judge: the prompt and the budget against the context
# --------------------------------------------------------------------------------------------

CONTEXT = builtin.TARGET_ARCH["max_position_embeddings"]


def test_prompt_longer_than_the_context(capsys):
    code, err = exit_of(["--prompt", "x" * CONTEXT], capsys)  # + BOS: one token too many
    assert code == 2
    assert err.strip().splitlines()[-1] == (f"{PREFIX}argument --prompt: {CONTEXT + 1} tokens, longer than the "
                                            f"target's context of {CONTEXT} positions")


def test_prompt_that_encodes_to_nothing(monkeypatch, capsys):
    # The byte tokenizer always adds BOS; a tokenizer without one turns "" into no tokens.
    monkeypatch.setattr(demo, "encode_prompt", lambda tok, prompt, device: torch.zeros(1, 0, dtype=torch.long))
    code, err = exit_of(["--prompt", ""], capsys)
    assert code == 2
    assert err.strip().splitlines()[-1] == f"{PREFIX}argument --prompt: '' encodes to no tokens; the target needs at least one"


def test_budget_beyond_the_context(capsys):
    prompt_len = len(demo.DEFAULT_PROMPT) + 1  # bytes + BOS
    fits = CONTEXT - prompt_len - 7 + 1  # default built-in tree: depth 6 + the root step = 7 levels
    code, err = exit_of(["--max-new-tokens", str(fits + 1)], capsys)
    assert code == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"{PREFIX}argument --max-new-tokens: {fits + 1} does not fit"), last
    assert last.endswith(f"the most that fits is {fits}"), last


def test_budget_at_the_context_edge_runs_within_it(monkeypatch, capsys):
    # A prompt that leaves room for 6 new tokens with the default tree; record every position
    # the target is given (tree rounds pass them; the other forwards follow the cache).
    prompt = "x" * (CONTEXT - 1 - 7 + 1 - 6)
    fits = CONTEXT - (len(prompt) + 1) - 7 + 1
    assert fits == 6
    code, err = exit_of(["--prompt", prompt, "--max-new-tokens", str(fits + 1)], capsys)
    assert code == 2 and "the most that fits is 6" in err

    highest = []
    real_load = demo.load_models

    def load_models(*a, **kw):
        target, draft, tokenizer = real_load(*a, **kw)

        def hook(module, args, kwargs):
            cache = kwargs.get("past_key_values", kwargs.get("cache"))
            ids, pos = kwargs["input_ids"], kwargs.get("position_ids")
            highest.append(int(pos.max()) if pos is not None else cache.get_seq_length() + ids.shape[1] - 1)

        target.register_forward_pre_hook(hook, with_kwargs=True)
        return target, draft, tokenizer

    monkeypatch.setattr(demo, "load_models", load_models)
    assert demo.main(["--prompt", prompt, "--max-new-tokens", str(fits), "--no-progress"]) == 0
    assert "same tokens as plain greedy decoding: True" in capsys.readouterr().out
    assert max(highest) <= CONTEXT - 1


# --------------------------------------------------------------------------------------------
# Runs that succeed: the numbers reported are those of the tokens emitted
# --------------------------------------------------------------------------------------------


@pytest.fixture
def recorder(monkeypatch):
    """Record main()'s decoder runs: each speculative_decode() run's Run, the tokens each of its
    verify rounds produced (accepted draft tokens + bonus, before any cut: the library's
    Stats.accept_lengths) and the target forwards a hook on the target counted during it (all,
    and those with a tree); each plain_greedy() run's Run. The measured runs are the last ones
    (after the cold-start ones)."""
    runs = {"spec": [], "greedy": []}
    counted = {"forwards": 0, "trees": 0}
    real_spec, real_greedy, real_load = demo.speculative_decode, demo.plain_greedy, demo.load_models

    def load_models(*a, **kw):
        target, draft, tokenizer = real_load(*a, **kw)

        def hook(module, args, kwargs):
            counted["forwards"] += 1
            counted["trees"] += kwargs.get("tree_mask") is not None

        target.register_forward_pre_hook(hook, with_kwargs=True)
        return target, draft, tokenizer

    def speculative_decode(*a, **kw):
        before = dict(counted)
        run = real_spec(*a, **kw)
        runs["spec"].append({"run": run, "rounds": [row[0] for row in run.stats.accept_lengths],
                             "forwards": counted["forwards"] - before["forwards"],
                             "trees": counted["trees"] - before["trees"]})
        return run

    def plain_greedy(*a, **kw):
        runs["greedy"].append(real_greedy(*a, **kw))
        return runs["greedy"][-1]

    monkeypatch.setattr(demo, "load_models", load_models)
    monkeypatch.setattr(demo, "speculative_decode", speculative_decode)
    monkeypatch.setattr(demo, "plain_greedy", plain_greedy)
    return runs


REPORT = re.compile(r"eagle-3 tree decoding: (\d+) tokens? in .* = .* tokens/s, (\d+) target forwards? "
                    r"\(prefill \+ (\d+) verify rounds?;")
ACCEPT = re.compile(r"mean acceptance length ([\d.]+) = (\d+) tokens? emitted by (\d+) verify rounds?")
GREEDY = re.compile(r"plain greedy decoding: (\d+) tokens? in .* tokens/s, (\d+) target forwards?;")
COLD = re.compile(r"cold start \(each decoder's first call, nothing warmed up\): eagle-3 (\d+) tokens? in ([\d.]+) s "
                  r".*plain greedy (\d+) tokens? in ([\d.]+) s; speedup ([\d.]+)x; process start to eagle-3's last "
                  r"token ([\d.]+) s \(imports and model load ([\d.]+) s\)")


def check_run(runs, out, max_new_tokens):
    """The measured run's numbers, checked against the rounds' recorded outputs, the forwards the
    hook counted, and greedy."""
    assert len(runs["spec"]) == 2 and len(runs["greedy"]) == 2  # cold start, then steady state
    record = runs["spec"][-1]
    spec, sizes = record["run"], record["rounds"]
    stats = spec.stats
    n = len(spec.tokens)
    # Emitted: the first token from the prefill, then the rounds' tokens up to the budget (the
    # built-in model emits no end-of-sequence this early). Rounds stop once the budget is met.
    assert n == max_new_tokens
    assert stats.rounds == len(sizes) == record["trees"]  # one tree forward per round
    assert record["forwards"] == 1 + stats.rounds == spec.forwards == stats.forwards  # + the prefill
    if sizes:
        assert sum(sizes[:-1]) < n - 1 <= sum(sizes)
    else:
        assert n == 1
    assert stats.produced == n - 1
    assert stats.cut == sum(sizes) - (n - 1)

    shown = REPORT.search(out)
    assert shown, out
    assert [int(g) for g in shown.groups()] == [n, 1 + len(sizes), len(sizes)]
    accept = ACCEPT.search(out)
    if sizes:
        assert accept, out
        assert accept.group(1) == f"{(n - 1) / len(sizes):.2f}"
        assert [int(accept.group(2)), int(accept.group(3))] == [n - 1, len(sizes)]
        assert stats.mean_acceptance_length == (n - 1) / len(sizes)
    else:
        assert accept is None and "mean acceptance length n/a" in out
        assert stats.mean_acceptance_length is None
    greedy = runs["greedy"][-1]
    assert [int(g) for g in GREEDY.search(out).groups()] == [len(greedy.tokens), len(greedy.tokens)]
    cold = COLD.search(out)
    assert cold, out
    cold_spec, cold_greedy = runs["spec"][0]["run"], runs["greedy"][0]
    assert [int(cold.group(1)), int(cold.group(3))] == [len(cold_spec.tokens), len(cold_greedy.tokens)]
    assert cold.group(2) == f"{cold_spec.total_s:.2f}" and cold.group(4) == f"{cold_greedy.total_s:.2f}"
    speedup = (len(cold_spec.tokens) / cold_spec.total_s) / (len(cold_greedy.tokens) / cold_greedy.total_s)
    assert cold.group(5) == f"{speedup:.2f}"
    # From process start: the model load, then at least the cold call itself.
    assert float(cold.group(6)) >= float(cold.group(7)) + cold_spec.total_s - 0.01
    return spec, sizes


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 10, 20])
def test_small_budgets_report_what_was_emitted(max_new_tokens, recorder, capsys):
    assert demo.main(["--max-new-tokens", str(max_new_tokens), "--no-progress"]) == 0
    out = capsys.readouterr().out
    spec, _ = check_run(recorder, out, max_new_tokens)
    # Both decoders count the same tokens the same way: the prefill's token included.
    assert recorder["greedy"][-1].tokens == spec.tokens == recorder["spec"][0]["run"].tokens
    assert "same tokens as plain greedy decoding: True" in out


def test_tokens_cut_at_the_budget_are_not_counted(recorder, capsys):
    # With a budget of 3 the built-in pair's first round produces more than the 2 that fit.
    assert demo.main(["--max-new-tokens", "3", "--no-progress"]) == 0
    out = capsys.readouterr().out
    spec, sizes = check_run(recorder, out, 3)
    assert sizes and sum(sizes) > 2 and spec.stats.cut == sum(sizes) - 2
    assert f"mean acceptance length {2 / len(sizes):.2f} = 2 tokens emitted" in out
    assert f"{spec.stats.cut} tokens produced past the budget or end-of-sequence" in out


def test_sampling_small_budget(recorder, capsys):
    argv = ["--temperature", "0.8", "--top-p", "0.9", "--seed", "3", "--max-new-tokens", "12", "--no-progress"]
    assert demo.main(argv) == 0
    check_run(recorder, capsys.readouterr().out, 12)


def test_progress_bar_small_budget(recorder, capsys):
    assert demo.main(["--max-new-tokens", "6"]) == 0
    check_run(recorder, capsys.readouterr().out, 6)


def test_empty_prompt_starts_from_bos(recorder, capsys):
    assert demo.main(["--prompt", "", "--max-new-tokens", "4", "--no-progress"]) == 0
    check_run(recorder, capsys.readouterr().out, 4)


def test_check_passes_on_a_small_budget(capsys):
    assert demo.main(["--check", "--max-new-tokens", "16", "--no-progress"]) == 0
    assert "check: OK, the output equals plain greedy decoding (16 tokens)" in capsys.readouterr().out


def test_check_failure_is_one_line(monkeypatch, capsys):
    real = demo.plain_greedy

    def wrong_greedy(*a, **kw):
        stats = real(*a, **kw)
        stats.tokens[-1] = (stats.tokens[-1] + 1) % 256
        return stats

    monkeypatch.setattr(demo, "plain_greedy", wrong_greedy)
    code, err = exit_of(["--check", "--max-new-tokens", "5", "--no-progress"], capsys)
    assert code == 1
    assert err.startswith(f"{PREFIX}check FAILED: outputs differ from token 4") and len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------------------------------
# Other targets: a tiny random Gemma 4 and gpt-oss saved to disk, with a synthetic EAGLE-3 draft
# --------------------------------------------------------------------------------------------

TINY_VOCAB = 64


def _tiny_target(kind):
    import transformers

    names = {"gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM"), "gpt_oss": ("GptOssConfig", "GptOssForCausalLM")}
    config_class, model_class = (getattr(transformers, name, None) for name in names[kind])
    if config_class is None or model_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {kind}")
    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=None,
                  sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2)
    torch.manual_seed(5)
    if kind == "gemma4":
        config = config_class(**common, head_dim=256, global_head_dim=512, num_global_key_value_heads=1,
                              attention_k_eq_v=True, num_kv_shared_layers=2, hidden_size_per_layer_input=8,
                              vocab_size_per_layer_input=TINY_VOCAB, final_logit_softcapping=None,
                              tie_word_embeddings=False)  # tied random embeddings echo the input token
    else:
        config = config_class(**common, head_dim=64, num_local_experts=4, num_experts_per_tok=2)
    model = model_class(config).eval()
    if kind == "gemma4":
        with torch.no_grad():  # scores of ~10, not ~70 (scaling 1.0 over RMS-normed q, k): less degenerate output
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.fill_(0.3)
    if kind == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.5)
    return model


def _word_tokenizer():
    """A word-level tokenizer over the tiny vocabulary ("t0" ... "t63"), built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(TINY_VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t3", pad_token="t0", bos_token="t1")


@pytest.mark.parametrize("kind", ["gemma4", "gpt_oss"])
def test_check_passes_on_a_gemma4_and_a_gpt_oss_target(kind, tmp_path, capsys):
    """The loop on a sliding-window target (window 4, shorter than the tree and the output),
    with sinks for gpt-oss and KV-shared layers for Gemma 4: --check asserts that EAGLE-3
    tree decoding emits exactly plain greedy decoding's tokens."""
    from torch_tree_attn.speculative.eagle3 import Eagle3Config, Eagle3Draft, save_eagle3_draft

    target = _tiny_target(kind)
    target_dir, draft_dir = tmp_path / "target", tmp_path / "draft"
    target.save_pretrained(str(target_dir))
    _word_tokenizer().save_pretrained(str(target_dir))
    torch.manual_seed(6)
    draft = Eagle3Draft(Eagle3Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                     intermediate_size=96, vocab_size=TINY_VOCAB, draft_vocab_size=32,
                                     target_hidden_size=64, max_position_embeddings=256))
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0.0, 0.2)
    draft.set_vocab_map(torch.randperm(TINY_VOCAB, generator=torch.Generator().manual_seed(6))[:32])
    save_eagle3_draft(draft, str(draft_dir))
    assert sorted(os.listdir(draft_dir)) == ["config.json", "model.safetensors"]

    argv = ["--target", str(target_dir), "--draft", str(draft_dir), "--check", "--max-new-tokens", "12",
            "--total-tokens", "8", "--depth", "4", "--top-k", "2", "--prompt", "t5 t9 t12 t20 t33 t41",
            "--no-progress", "--threads", "1"]
    assert demo.main(argv) == 0
    out = capsys.readouterr().out
    assert "check: OK, the output equals plain greedy decoding (12 tokens)" in out, out


# --------------------------------------------------------------------------------------------
# Defects found as a new user: the flag named in an error, the tree reported
# --------------------------------------------------------------------------------------------


def test_missing_target_is_reported_as_the_target(capsys):
    # With the built-in draft left as it is, the target that does not exist is the problem, not
    # the draft that would not fit it.
    assert_one_line(*exit_of(["--target", "/nonexistent"], capsys), "--target", "'/nonexistent'", "no such directory")


@pytest.mark.parametrize("argv,size", [
    ([], 16),  # the built-in CPU default: 16 tokens, depth 6, top-k 2
    (["--total-tokens", "100", "--depth", "1", "--top-k", "2"], 7),  # root + 2 children + 2 x 2 grandchildren
    (["--total-tokens", "5", "--depth", "3", "--top-k", "3"], 5),
])
def test_summary_reports_the_tree_actually_built(argv, size, monkeypatch, capsys):
    """The summary names the tree the verify forwards got (their token count, seen by a hook),
    not the --total-tokens asked for."""
    seen = []
    real_load = demo.load_models

    def load_models(*a, **kw):
        target, draft, tokenizer = real_load(*a, **kw)

        def hook(module, args, kwargs):
            if kwargs.get("tree_mask") is not None:
                seen.append(kwargs["input_ids"].shape[1])

        target.register_forward_pre_hook(hook, with_kwargs=True)
        return target, draft, tokenizer

    monkeypatch.setattr(demo, "load_models", load_models)
    assert demo.main(argv + ["--max-new-tokens", "12", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert seen and set(seen) == {size}
    args = demo.parse_args(argv)
    line = f"tree: {size} tokens, depth {args.depth}, top-k {args.top_k}"
    assert line in out, out
    asked_more = f"--total-tokens {args.total_tokens} asked for more than depth {args.depth} and top-k {args.top_k} grow"
    assert (asked_more in out) == (size < args.total_tokens), out


# --------------------------------------------------------------------------------------------
# Where the built-in weights are read from (torch_tree_attn.speculative.builtin.assets_dir)
# --------------------------------------------------------------------------------------------


def test_assets_default_to_the_checkouts_examples_assets(monkeypatch):
    monkeypatch.delenv(builtin.ASSETS_ENV, raising=False)
    expected = os.path.join(ROOT, "examples", "assets")
    assert builtin.assets_dir() == builtin.checkout_assets_dir() == expected
    assert builtin.find_assets() == expected and builtin.builtin_assets_present()
    assert sorted(builtin.ASSET_FILES) == sorted(n for n in os.listdir(expected) if n.startswith("builtin_"))


def test_assets_argument_and_environment_override_the_default(monkeypatch, tmp_path):
    env_dir, arg_dir = tmp_path / "env", tmp_path / "arg"
    monkeypatch.setenv(builtin.ASSETS_ENV, str(env_dir))
    assert builtin.assets_dir() == str(env_dir)
    assert builtin.assets_dir(str(arg_dir)) == str(arg_dir)  # the argument wins over the variable
    monkeypatch.setenv(builtin.ASSETS_ENV, "")
    assert builtin.assets_dir() == builtin.checkout_assets_dir()  # empty: unset
    # A copy of the assets elsewhere loads from there, through the variable and the argument.
    env_dir.mkdir()
    for name in builtin.ASSET_FILES:
        (env_dir / name).write_bytes(open(os.path.join(builtin.checkout_assets_dir(), name), "rb").read())
    monkeypatch.setenv(builtin.ASSETS_ENV, str(env_dir))
    assert builtin.find_assets() == str(env_dir)
    target = builtin.load_builtin_target()
    monkeypatch.delenv(builtin.ASSETS_ENV)
    again = builtin.load_builtin_target(assets=str(env_dir))
    assert all(torch.equal(a, b) for a, b in zip(target.state_dict().values(), again.state_dict().values()))
    assert builtin.load_builtin_draft(target, assets=str(env_dir)) is not None


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_missing_assets_name_where_they_were_looked_for(how, monkeypatch, tmp_path):
    (tmp_path / builtin.TARGET_CONFIG).write_text("{}")  # one file of four present
    if how == "environment":
        monkeypatch.setenv(builtin.ASSETS_ENV, str(tmp_path))
        kw, source = {}, f"${builtin.ASSETS_ENV}"
    else:
        monkeypatch.delenv(builtin.ASSETS_ENV, raising=False)
        kw, source = dict(assets=str(tmp_path)), "the directory passed as assets"
    assert not builtin.builtin_assets_present(**kw)
    for call in (lambda: builtin.find_assets(**kw), lambda: builtin.load_builtin_target(**kw)):
        with pytest.raises(FileNotFoundError) as info:
            call()
        message = str(info.value)
        assert f"looked in {tmp_path} ({source})" in message, message
        assert builtin.TARGET_WEIGHTS in message and builtin.DRAFT_CONFIG in message, message
        assert f"missing {builtin.TARGET_CONFIG}" not in message  # the one present is not listed


def test_cli_names_the_assets_directory_when_it_is_empty(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(builtin.ASSETS_ENV, str(tmp_path))
    assert_one_line(*exit_of(["--no-progress"], capsys), "--target", f"looked in {tmp_path}",
                    builtin.ASSETS_ENV)
