"""Train the built-in target LM and its EAGLE-3 draft (the weights under examples/assets/).

    python examples/train_builtin.py --device cuda        # about 7.5 minutes on one H200
    python examples/train_builtin.py --dump-corpus corpus.txt   # the training text, to train elsewhere

The shipped weights were made on one H200 with ``--device cuda --corpus corpus.txt`` where
corpus.txt was dumped by Python 3.11.7 (whose standard library is the text): 3997 target
steps (held-out loss 0.95 nats/byte) and 3773 draft steps (top-1 agreement with the target
about 0.9 at every unrolled depth). CPU works too, but the wall-clock budgets then buy far
fewer steps and the target stays weak. ``--layers/--hidden/--intermediate/--kv-heads`` train
another size (builtin.TARGET_ARCH is the shipped one); the draft takes the target's widths.

Stage "target": a 12-layer byte-level LlamaForCausalLM trained from scratch on the Python
sources of the CPython standard library (packages included; test suites, idlelib, lib2to3,
turtledemo and site-packages left out) found next to the running interpreter (PSF License
Version 2, which allows derived works to be distributed; the notice is kept in
examples/assets/NOTICE.txt). Stage "draft": an EAGLE-3 draft trained the way EAGLE trains, on the
target's own fused low/mid/high hidden states with the target's output distribution as the
label, on a mix of corpus text and the target's own greedy continuations, unrolled for a few
steps on its own outputs ("training-time test") so that deep tree levels, which see the
draft's hidden state instead of the target's, are trained too.

Both stages stop on a wall-clock budget, so the weights depend on the machine's speed; the
demo's greedy check does not depend on them, only its acceptance length does.
"""
import argparse
import json
import math
import os
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F


def _load_source(name, filename):
    """Import one pure-Python module of the package without importing the package, whose
    __init__ loads the compiled op: training needs no op, and may run where none is built."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch_tree_attn", "speculative", filename)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


builtin = _load_source("tta_builtin", "builtin.py")
eagle3 = _load_source("tta_eagle3", "eagle3.py")


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


SKIPPED_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__", "lib2to3", "turtledemo"}


def stdlib_corpus(path=None) -> bytes:
    """The standard library's Python sources in a fixed order, or a file dumped earlier."""
    if path:
        with open(path, "rb") as f:
            return f.read()
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS and not d.startswith("config-"))
        files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    if not files:
        raise SystemExit(f"no Python sources found under {root}")
    return b"\n".join(open(p, "rb").read() for p in files)


def batches(data: torch.Tensor, batch: int, seq: int, generator: torch.Generator):
    """Random windows of seq bytes from the corpus, each after a BOS token: [batch, seq + 1]."""
    while True:
        starts = torch.randint(0, data.numel() - seq, (batch,), generator=generator)
        rows = data[starts[:, None] + torch.arange(seq)]
        yield torch.cat([torch.full((batch, 1), builtin.ByteTokenizer.bos_token_id), rows], dim=1)


def cosine_lr(peak, progress, warmup=0.03):
    if progress < warmup:
        return peak * progress / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / (1 - warmup)))))


def autocast(device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def load_target(out_dir, device):
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    with open(os.path.join(out_dir, builtin.TARGET_CONFIG)) as f:
        config = LlamaConfig(**json.load(f))
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    model.load_state_dict(load_file(os.path.join(out_dir, builtin.TARGET_WEIGHTS)))
    return model.to(device).eval()


def target_arch(args) -> dict:
    """builtin.TARGET_ARCH with the sizes given on the command line; head_dim stays 64, one
    of the op's supported head sizes."""
    arch = dict(builtin.TARGET_ARCH)
    for key, value in (("num_hidden_layers", args.layers), ("hidden_size", args.hidden),
                       ("intermediate_size", args.intermediate), ("num_key_value_heads", args.kv_heads)):
        if value is not None:
            arch[key] = value
    if arch["hidden_size"] % arch["head_dim"]:
        raise SystemExit(f"--hidden must be a multiple of head_dim {arch['head_dim']}, got {arch['hidden_size']}")
    arch["num_attention_heads"] = arch["hidden_size"] // arch["head_dim"]
    if arch["num_attention_heads"] % arch["num_key_value_heads"]:
        raise SystemExit(f"--kv-heads ({arch['num_key_value_heads']}) must divide the "
                         f"{arch['num_attention_heads']} attention heads")
    return arch


def train_target(args, device):
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    corpus = torch.tensor(list(stdlib_corpus(args.corpus)), dtype=torch.long)
    split = int(corpus.numel() * 0.99)
    train, held_out = corpus[:split], corpus[split:]
    log(f"corpus: {corpus.numel()} bytes ({split} train)")

    arch = target_arch(args)
    config = builtin.target_config(**arch)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).to(device)
    log(f"target: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters on {device}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.target_lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    stream = batches(train, args.batch, args.seq, gen)
    budget = args.target_minutes * 60
    start, step = time.time(), 0
    while time.time() - start < budget:
        for group in opt.param_groups:
            group["lr"] = cosine_lr(args.target_lr, (time.time() - start) / budget)
        tokens = next(stream).to(device, non_blocking=True)
        with autocast(device):
            logits = model(input_ids=tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % args.log_every == 0:
            log(f"target step {step} loss {loss.item():.3f} ({(time.time() - start) / step:.3f} s/step)")

    model.eval()
    with torch.no_grad(), autocast(device):
        rows = held_out[: (held_out.numel() // args.seq) * args.seq].view(-1, args.seq)[:64].to(device)
        logits = model(input_ids=rows[:, :-1]).logits
        held_loss = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten()).item()
    log(f"target done: {step} steps, held-out loss {held_loss:.3f} nats/byte")

    os.makedirs(args.out_dir, exist_ok=True)
    state = {k: v.detach().to(torch.float16).cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(args.out_dir, builtin.TARGET_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(args.out_dir, builtin.TARGET_CONFIG), "w") as f:
        json.dump(arch, f, indent=2)
    log(f"saved the target under {args.out_dir}")


DRAFT_VOCAB = 128
UNROLL_STEPS = 6  # training-time test: draft steps unrolled on the draft's own outputs
UNROLL_WEIGHT = 0.8


@torch.no_grad()
def greedy_continuations(target, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    out = target.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=builtin.ByteTokenizer.pad_token_id)
    return out[:, : prompts.shape[1] + new_tokens]


@torch.no_grad()
def target_labels(target, tokens: torch.Tensor, layer_ids, device, batch: int = 64):
    """Fused-feature inputs and next-token distributions of the target on each sequence."""
    feats, probs = [], []
    for rows in tokens.split(batch):
        out = target(input_ids=rows.to(device), output_hidden_states=True)
        feats.append(eagle3.capture_target_features(out.hidden_states, layer_ids).float())
        probs.append(torch.softmax(out.logits.float(), dim=-1))
    return torch.cat(feats), torch.cat(probs)


def unrolled_loss(draft, tokens, feats, probs):
    """EAGLE-3 training-time test on [B, S + 1] sequences.

    Step 0: position t sees (token t + 1, fused target feature t) and predicts the target's
    distribution at t + 1. Step j > 0: the same position sees token t + 1 + j and the draft's
    own step j - 1 output, sits at position t + j, and attends to the step-0 keys up to t plus
    its own chain of earlier steps, exactly the keys a depth-j tree node sees at inference.
    """
    b, s1 = tokens.shape
    s = s1 - 1
    device = tokens.device
    cfg = draft.config
    groups = cfg.num_attention_heads // cfg.num_key_value_heads
    causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()
    chain = torch.eye(s, dtype=torch.bool, device=device)
    keys, values = [], []

    def attend(q, k, v):
        keys.append(k)
        values.append(v)
        mask = torch.cat([causal] + [chain] * (len(keys) - 1), dim=1)
        kk = torch.cat(keys, dim=2).repeat_interleave(groups, dim=1)
        vv = torch.cat(values, dim=2).repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)

    target_ids = draft.target_ids()
    hidden = draft.fuse(feats[:, :s])
    total, weight, accuracy = 0.0, 1.0, []
    arange = torch.arange(s, device=device)
    for j in range(UNROLL_STEPS):
        valid = arange + 1 + j <= s
        idx = (arange + 1 + j).clamp(max=s)
        hidden = draft.decoder(tokens[:, idx], hidden, (arange + j).expand(b, s), attend)
        logp = torch.log_softmax(draft.draft_logits(hidden).float(), dim=-1)
        p = probs[:, idx][..., target_ids]
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-6)
        loss = -(p * logp).sum(-1)[:, valid].mean()
        total = total + weight * loss
        weight *= UNROLL_WEIGHT
        accuracy.append((logp.argmax(-1) == p.argmax(-1))[:, valid].float().mean().item())
    return total, accuracy


def train_draft(args, device):
    torch.manual_seed(0)
    target = load_target(args.out_dir, device)
    tcfg = target.config
    layer_ids = eagle3.feature_layer_ids(tcfg.num_hidden_layers)
    corpus = torch.tensor(list(stdlib_corpus(args.corpus)), dtype=torch.long)
    gen = torch.Generator().manual_seed(2)
    seq = args.draft_seq
    seqs = next(batches(corpus, args.draft_corpus_seqs, seq, gen))
    prompts = next(batches(corpus, args.draft_generated_seqs, 24, gen))
    start = time.time()
    with autocast(device):
        generated = torch.cat([greedy_continuations(target, rows.to(device), seq + 1 - 25).cpu()
                               for rows in prompts.split(256)])
    log(f"draft data: {len(seqs)} corpus windows + {len(generated)} greedy continuations "
        f"({time.time() - start:.0f} s)")
    tokens = torch.cat([seqs, generated]).to(device)
    with autocast(device):
        feats, probs = target_labels(target, tokens, layer_ids, device)
    log(f"target features {tuple(feats.shape)} ({time.time() - start:.0f} s)")

    # Draft vocabulary: the target ids the target itself predicts most often.
    counts = torch.bincount(probs.argmax(-1).flatten(), minlength=tcfg.vocab_size).float()
    counts += 1e-3 * torch.bincount(tokens.flatten(), minlength=tcfg.vocab_size)
    vocab_ids = counts.topk(DRAFT_VOCAB).indices.sort().values.cpu()

    config = eagle3.Eagle3Config(
        hidden_size=tcfg.hidden_size, num_attention_heads=tcfg.num_attention_heads,
        num_key_value_heads=tcfg.num_key_value_heads, intermediate_size=tcfg.intermediate_size,
        vocab_size=tcfg.vocab_size, draft_vocab_size=DRAFT_VOCAB, rms_norm_eps=tcfg.rms_norm_eps,
        max_position_embeddings=tcfg.max_position_embeddings, rope_theta=builtin.TARGET_ARCH["rope_theta"],
        extra={"bos_token_id": tcfg.bos_token_id, "eos_token_id": tcfg.eos_token_id},
    )
    draft = eagle3.Eagle3Draft(config)
    draft.set_vocab_map(vocab_ids)
    draft.to(device)
    with torch.no_grad():
        # Start from the target's own output end: its final norm, LM head rows and last MLP,
        # with fc passing the middle-layer feature through.
        draft.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        draft.lm_head.weight.copy_(target.lm_head.weight[vocab_ids.to(device)])
        draft.norm.weight.copy_(target.model.norm.weight)
        last = target.model.layers[-1]
        draft.midlayer.mlp.load_state_dict(last.mlp.state_dict())
        draft.midlayer.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
        h = tcfg.hidden_size
        draft.fc.weight.zero_()
        draft.fc.weight[:, h : 2 * h] = torch.eye(h, device=device)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.draft_lr, betas=(0.9, 0.95), weight_decay=0.0)
    budget = args.draft_minutes * 60
    start, step = time.time(), 0
    sampler = torch.Generator(device=device).manual_seed(3)
    while time.time() - start < budget:
        for group in opt.param_groups:
            group["lr"] = cosine_lr(args.draft_lr, (time.time() - start) / budget)
        rows = torch.randint(0, len(tokens), (args.draft_batch,), generator=sampler, device=device)
        with autocast(device):
            loss, accuracy = unrolled_loss(draft, tokens[rows], feats[rows], probs[rows])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % args.log_every == 0:
            acc = " ".join(f"{a:.2f}" for a in accuracy)
            log(f"draft step {step} loss {loss.item():.3f} top-1 agreement with the target per depth {acc}")

    draft.eval()
    scratch = os.path.join(args.out_dir, "draft_tmp")
    eagle3.save_eagle3_draft(draft, scratch, dtype=torch.float16)
    os.replace(os.path.join(scratch, "config.json"), os.path.join(args.out_dir, builtin.DRAFT_CONFIG))
    os.replace(os.path.join(scratch, "model.safetensors"),
               os.path.join(args.out_dir, builtin.DRAFT_WEIGHTS))
    os.rmdir(scratch)
    log(f"saved the draft under {args.out_dir} after {step} steps")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", choices=["target", "draft", "all"], default="all")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--corpus", default=None, help="a corpus file from --dump-corpus (default: this stdlib)")
    parser.add_argument("--dump-corpus", default=None, help="write the corpus to this file and exit")
    parser.add_argument("--out-dir", default=builtin.assets_dir(),
                        help=f"where the weights go (default: ${builtin.ASSETS_ENV} or examples/assets)")
    parser.add_argument("--layers", type=int, default=None, help="target layers (default: builtin.TARGET_ARCH)")
    parser.add_argument("--hidden", type=int, default=None, help="target hidden size, a multiple of 64")
    parser.add_argument("--intermediate", type=int, default=None, help="target MLP width")
    parser.add_argument("--kv-heads", type=int, default=None, help="target key/value heads")
    parser.add_argument("--target-minutes", type=float, default=4.0)
    parser.add_argument("--draft-minutes", type=float, default=2.5)
    parser.add_argument("--target-lr", type=float, default=3e-3)
    parser.add_argument("--draft-lr", type=float, default=2e-3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--draft-batch", type=int, default=32)
    parser.add_argument("--draft-seq", type=int, default=256)
    parser.add_argument("--draft-corpus-seqs", type=int, default=1024)
    parser.add_argument("--draft-generated-seqs", type=int, default=1024)
    parser.add_argument("--log-every", type=int, default=200)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.dump_corpus:
        with open(args.dump_corpus, "wb") as f:
            f.write(stdlib_corpus())
        log(f"wrote {args.dump_corpus}")
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.stage in ("target", "all"):
        train_target(args, device)
    if args.stage in ("draft", "all"):
        train_draft(args, device)


if __name__ == "__main__":
    main()
