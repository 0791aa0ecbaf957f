"""Differential fuzzer of the op contract (README, "The op contract") against the float64
reference (``torch_tree_attn.reference``).

Every case is a pure function of (base seed, stream, case index): ``draw_params`` turns
them into a flat dict of parameters (printed on failure), ``build`` turns that into the
call's tensors and what the contract expects of it, ``run_case`` calls the op and checks.

Three streams:

- ``cpu``: ``FUZZ_CASES`` cases (default 40000, about 2.5 minutes on 2 idle cores) through
  ``torch.ops.tree_attn``, split into ``CPU_CHUNKS`` pytest tests so that a failure
  localises. About 12 % are deliberately invalid calls that must raise ValueError /
  TypeError naming the offending argument; about 20 % carry one injected non-finite value
  (or garbage in keys no row sees), whose effect is checked exactly: poisoned rows all NaN
  (output and lse), others untouched.
- ``sim``: ``FUZZ_SIM_CASES`` cases (default 300, the simulator is ~100x slower a call)
  through ``torch.ops.tree_attn_sim`` (the Metal shaders under the MPS launch plan): valid
  calls, calls with out-of-range offsets (which the kernels clamp: checked against the
  equivalent in-range call per batch row), non-finite injections and a few invalid calls.
- ``cuda``: ``FUZZ_CUDA_CASES`` cases (default 2000) through ``torch.ops.tree_attn`` on a
  CUDA device, drawn as the cpu stream's except that offsets may be out of range (the CUDA
  backend clamps them, as the simulator's) and no invalid call breaks a rule of offset
  values. ``run_batched`` runs them: each case is built on the host, copied to the device
  with its layout (``to_device``), and a group of cases is launched before one sync; the
  float64 reference then checks each on the host. ``warm_cuda`` compiles first, in
  parallel, the kernel specs the cases meet that the prebuilt table lacks. The same runner
  with device cpu (the stream's cases minus the clamped ones) is a CPU test.

Environment:

- ``FUZZ_SEED`` (default 20261202, fixed so CI is deterministic). Set another value, e.g.
  ``FUZZ_SEED=$RANDOM``, to explore new cases; a failure prints its seed.
- ``FUZZ_CASES``, ``FUZZ_SIM_CASES``, ``FUZZ_CUDA_CASES``: case counts.
- ``FUZZ_NONFINITE`` (default "1"): "0" turns the non-finite injections off (the cases
  still run, as valid cases without the injected value).
- ``FUZZ_OVERFLOW`` (default "0"): "1" adds score-overflow injections (see NONFINITE_KINDS).
- ``FUZZ_HUGE_SOFTCAP`` (default "1"): "0" draws no softcap above 100 (those cases get
  one in [20, 100] instead). Large caps are nearly the identity; a tanh whose error is
  absolute rather than relative shows there as a score error of about cap x 1e-7.

Reproduce one case (a failure prints this line)::

    python -m tests.test_fuzz --seed 20261202 --case 1234 [--sim | --cuda]

or a range: ``python -m tests.test_fuzz --first 0 --count 2000 [--sim | --cuda [--device cpu]]``.
"""
import argparse
import dataclasses
import json
import logging
import math
import os
import random
import re
import sys
import time
import traceback
from typing import Callable, List, Optional

import pytest
import torch

import torch_tree_attn
from tests.cases import args_of, check_against_reference

try:
    import torch_tree_attn_sim  # noqa: F401  (registers torch.ops.tree_attn_sim)
    HAVE_SIM = True
except ImportError:  # pragma: no cover - CI always builds it (README, "Run the tests")
    HAVE_SIM = False


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


DEFAULT_SEED = 20261202
BASE_SEED = _env_int("FUZZ_SEED", DEFAULT_SEED)
N_CPU = _env_int("FUZZ_CASES", 40000)
N_SIM = _env_int("FUZZ_SIM_CASES", 300)
N_CUDA = _env_int("FUZZ_CUDA_CASES", 2000)
N_BATCHED_CPU = 300  # the cuda stream's cases run on CPU by the batched runner (a CPU test)
GROUP = 64  # cases launched between two syncs by run_batched
NONFINITE = os.environ.get("FUZZ_NONFINITE", "1").strip() != "0"
HUGE_SOFTCAP = os.environ.get("FUZZ_HUGE_SOFTCAP", "1").strip() != "0"
CPU_CHUNKS = 20
SIM_CHUNKS = 6
MAX_REPORTED = 8  # failures printed per chunk (all are counted)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MASK_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
               "float64": torch.float64}
C10_NAME = {torch.float32: "Float", torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float64: "Double",
            torch.int32: "Int", torch.int64: "Long", torch.int8: "Char", torch.uint8: "Byte"}
FMAX = torch.finfo(torch.float32).max
NAN, INF = math.nan, math.inf


# =======================================================================================
# Parameters: (seed, stream, index) -> flat dict of plain values
# =======================================================================================

def _rng(seed: int, stream: str, index: int) -> random.Random:
    # String seeds are hashed with SHA-512 by random.Random: stable across runs/platforms.
    return random.Random(f"tree-attn-fuzz/{seed}/{stream}/{index}")


def _edge_offset(rng: random.Random, hi: int) -> int:
    """An offset in [0, hi], the edges 0 and hi weighted up."""
    r = rng.random()
    if r < 0.3:
        return 0
    if r < 0.6:
        return hi
    return rng.randint(0, hi)


# Work budget of one case, in units of B * Hq * S * (D + 8 T): the float64 reference
# expands K/V to every query head and the bias to [B, Hq, T, S], so this is what a case
# costs. Shapes over budget shrink (batch, heads, prefix, then tree) until they fit.
BUDGET = {"cpu": {"small": 150_000, "medium": 600_000, "long": 900_000},
          "sim": {"small": 60_000, "medium": 150_000, "long": 300_000}}
BUDGET["cuda"] = BUDGET["cpu"]
# Streams whose backend clamps out-of-range offsets instead of checking them on the host.
CLAMPING = {"sim", "cuda"}


def _window_and_cache(rng: random.Random, window: str, T: int, prefix: int, extra: int):
    """(M, S) for a window kind, T tree nodes, a prefix of `prefix` keys."""
    if window == "compact":
        return T, T + prefix
    if window == "dense":
        S = prefix + min(extra, T)
        return S, S
    if window == "empty":
        return 0, prefix
    return extra, extra + prefix


def _draw_shape(rng: random.Random, p: dict, stream: str) -> None:
    size = rng.choices(["small", "medium", "long"], [0.6, 0.34, 0.06])[0]
    p["size"] = size
    p["dtype"] = rng.choice(list(DTYPES))
    # A float32 query over a half-precision cache (the contract's one mixed form).
    p["kv_dtype"] = p["dtype"]
    if p["dtype"] == "float32" and rng.random() < 0.35:
        p["kv_dtype"] = rng.choice(["float16", "bfloat16"])
    D = p["D"] = rng.choice([64, 96, 128, 256, 512])
    G = rng.choice([1, 1, 2, 3, 4, 5, 6, 7, 8])
    if size == "small":
        B, Hkv, T, prefix = rng.randint(1, 3), rng.choice([1, 1, 2, 3]), rng.randint(1, 12), rng.randint(0, 40)
    elif size == "medium":
        B, Hkv, T, prefix = rng.randint(1, 2), rng.choice([1, 1, 2]), rng.randint(13, 70), rng.randint(0, 150)
    else:  # long prefixes: several key blocks, key splits across threads / threadgroups
        B, Hkv, T = rng.randint(1, 2), 1, rng.randint(1, 6)
        prefix = rng.randint(200, rng.choice([700, 1500]))
    window = rng.choices(["compact", "dense", "empty", "arbitrary"], [0.4, 0.2, 0.1, 0.3])[0]
    extra = rng.choice([rng.randint(0, T + 24), rng.randint(1, 4), T + rng.randint(0, 40)])
    if window == "empty" and rng.random() < 0.03:
        prefix = 0  # S = 0: an empty cache is legal
    budget = BUDGET[stream][size]
    while True:
        M, S = _window_and_cache(rng, window, T, prefix, extra)
        if B * G * Hkv * S * (D + 8 * T) <= budget:
            break
        if B > 1:
            B -= 1
        elif Hkv > 1:
            Hkv -= 1
        elif prefix > 8 and rng.random() < 0.5:
            prefix //= 2
        elif G > 1 and rng.random() < 0.5:
            G -= 1
        elif T > 1:
            T = max(1, T * 3 // 4)
            extra = min(extra, T + 40)
        else:
            prefix //= 2
            extra //= 2
    if stream != "sim" and rng.random() < 0.004:
        # Empty problems are legal: no batch rows, or no tree nodes.
        if rng.random() < 0.5:
            B = 0
        else:
            T = 0
            M, S = _window_and_cache(rng, window, T, prefix, extra)
    p.update(B=B, Hkv=Hkv, Hq=G * Hkv, T=T, window=window, M=M, S=S)


def _draw_offsets(rng: random.Random, p: dict, stream: str) -> None:
    B, M, S = p["B"], p["M"], p["S"]
    p["offset_dtype"] = rng.choice(["int32", "int64"])
    p["offset_layout"] = rng.choices(["contiguous", "strided"], [0.8, 0.2])[0]
    if p["window"] == "dense":
        p["offsets"] = None if rng.random() < 0.75 else [0] * B
    else:
        p["offsets"] = None if rng.random() < 0.15 else [_edge_offset(rng, S - M) for _ in range(B)]
    p["clamp"] = False
    if stream in CLAMPING and p["offsets"] is not None and B > 0 and rng.random() < 0.3:
        # Out of range: the MPS/simulator kernels clamp (README, "Offsets").
        p["clamp"] = True
        big = [2**31 - 1] if p["offset_dtype"] == "int32" else [2**31 - 1, 2**40, 2**62]
        neg = [-(2**31)] if p["offset_dtype"] == "int32" else [-(2**31), -(2**40)]
        choices = [-1, -rng.randint(2, 50), S - M + 1, S - M + rng.randint(1, max(1, M)), S, S + 1,
                   S + rng.randint(2, 100)] + big + neg
        offs = list(p["offsets"])
        for b in rng.sample(range(B), rng.randint(1, B)):
            offs[b] = rng.choice(choices)
        p["offsets"] = offs


def _draw_mask(rng: random.Random, p: dict) -> None:
    B, Hq = p["B"], p["Hq"]
    p["mask_kind"] = rng.choices(["bool", "float", "float_min"], [0.4, 0.35, 0.25])[0]
    if p["mask_kind"] == "float":
        p["mask_dtype"] = rng.choices(list(MASK_DTYPES), [0.7, 0.1, 0.1, 0.1])[0]
    elif p["mask_kind"] == "float_min":
        # Hugging Face: finfo(dtype).min of the model dtype, in that dtype (or float32).
        p["mask_dtype"] = p["dtype"] if rng.random() < 0.7 else "float32"
    else:
        p["mask_dtype"] = "bool"
    p["mask_rank"] = rng.choice([3, 4])
    p["mask_batch"] = rng.choice([B, 1]) if B > 0 else 0
    p["mask_heads"] = rng.choice([1, Hq]) if p["mask_rank"] == 4 else 1
    # "expand": the logical mask is a stride-0 broadcast of a smaller one (size > 1 dims
    # with stride 0); "transposed": window column as the slow dimension; "sliced": a
    # strided view with a storage offset into a larger NaN-filled buffer.
    p["mask_layout"] = rng.choices(["contiguous", "expand", "transposed", "sliced"], [0.55, 0.15, 0.15, 0.15])[0]
    if p["window"] == "compact":
        p["pattern"] = rng.choices(["tree", "random"], [0.8, 0.2])[0]
    elif p["window"] == "dense":
        p["pattern"] = rng.choices(["causal", "random"], [0.5, 0.5])[0]
    else:
        p["pattern"] = "random"
    p["density"] = rng.choice([0.0, 0.05, 0.3, 0.6, 0.95, 1.0])
    p["empty_row"] = rng.random() < 0.25  # one row that sees nothing in the window
    p["bias"] = rng.choices(["normal", "zero", "very_negative"], [0.6, 0.25, 0.15])[0]


KV_LAYOUTS = ["contiguous", "bshd", "padded", "inner_stride", "expand_batch", "expand_heads", "expand_d", "kv_pair"]
KV_WEIGHTS = [0.35, 0.2, 0.12, 0.08, 0.06, 0.06, 0.03, 0.1]
Q_LAYOUTS = ["contiguous", "bthd", "padded", "inner_stride", "expand_batch", "expand_heads", "expand_d"]
Q_WEIGHTS = [0.5, 0.15, 0.12, 0.08, 0.05, 0.07, 0.03]


def _draw_layouts(rng: random.Random, p: dict) -> None:
    p["q_layout"] = rng.choices(Q_LAYOUTS, Q_WEIGHTS)[0]
    kl = rng.choices(KV_LAYOUTS, KV_WEIGHTS)[0]
    if kl == "kv_pair":  # K and V: two planes of one [2, B, S + pad, Hkv, D] cache
        p["k_layout"] = p["v_layout"] = "kv_pair"
    else:
        p["k_layout"] = kl
        p["v_layout"] = kl if rng.random() < 0.6 else rng.choice([x for x in KV_LAYOUTS if x != "kv_pair"])
    # Unused cache slots (at or past off_b + M) are never read: any value is legal there.
    p["unused_fill"] = rng.choices(["nan", "inf", "-inf", "max"], [0.7, 0.1, 0.1, 0.1])[0]


def _draw_scalars(rng: random.Random, p: dict) -> None:
    r = rng.random()
    if r < 0.5:
        p["scale"] = None
    elif r < 0.55:
        p["scale"] = 0.0
    elif r < 0.6:
        p["scale"] = -10 ** rng.uniform(-3, math.log10(0.5))  # negative scales are legal
    else:
        p["scale"] = 10 ** rng.uniform(-3, math.log10(0.5))
    r = rng.random()
    if r < 0.6:
        p["softcap"] = None
    elif r < 0.8:
        p["softcap"] = 10 ** rng.uniform(math.log10(0.3), math.log10(5))  # bites hard
    elif r < 0.95 or not HUGE_SOFTCAP:
        p["softcap"] = 10 ** rng.uniform(math.log10(20), 2)  # Gemma-2 uses 50 (and 30)
    else:
        p["softcap"] = 10 ** rng.uniform(2, 6)  # up to nearly the identity
    for name in ("scale", "softcap"):
        if p[name] is not None:
            p[name] = float(f"{p[name]:.6g}")
    # Attention sinks: none, finite logits (some large enough to dominate), or with one
    # head's sink -inf (no sink); in any float dtype (read as float32).
    p["sinks"] = rng.choices([None, "finite", "with_neg_inf", "dominant"], [0.6, 0.2, 0.1, 0.1])[0]
    p["sinks_dtype"] = rng.choices(list(MASK_DTYPES), [0.7, 0.1, 0.1, 0.1])[0]


# "overflow" (finite inputs of ~1e21 whose float32 scores overflow) is off by default: it
# finds a known violation in the CPU kernel's bfloat16 path, where rows that see the huge
# key but whose scores stay finite come out NaN (reproduce: FUZZ_OVERFLOW=1 python -m
# tests.test_fuzz --seed 20261202 --case 930). FUZZ_OVERFLOW=1 turns it on.
OVERFLOW = os.environ.get("FUZZ_OVERFLOW", "0").strip() != "0"
NONFINITE_KINDS = ["query", "key", "value", "bias", "masked_garbage", "sink"] + (["overflow"] if OVERFLOW else [])


def _draw_nonfinite(rng: random.Random, p: dict) -> None:
    kinds = list(NONFINITE_KINDS)
    weight = {"query": 0.15, "key": 0.22, "value": 0.22, "bias": 0.16, "masked_garbage": 0.13, "sink": 0.08,
              "overflow": 0.12}
    weights = [weight[k] for k in kinds]
    p["nonfinite"] = rng.choices(kinds, weights)[0]
    p["nonfinite_value"] = rng.choice(["nan", "inf", "-inf"])
    # Where a key/value value goes: a prefix key, a window key some rows see, or a
    # window key no row of its kv head sees (must be harmless).
    p["nonfinite_where"] = rng.choice(["prefix", "window_seen", "window_unseen"])
    p["nonfinite_seen"] = rng.random() < 0.8  # overflow / bias: on a seen entry or not
    p["nonfinite_pick"] = rng.getrandbits(32)


INVALID_KINDS = [
    "query_rank", "key_rank", "value_rank", "mask_rank", "query_dtype", "key_dtype", "value_dtype",
    "head_dim", "key_batch", "key_head_dim", "value_shape", "gqa", "mask_dtype", "mask_batch",
    "mask_heads", "mask_rows", "mask_window", "offset_dtype", "offset_shape", "offset_negative",
    "offset_past", "scale", "softcap", "device", "dtype_pair", "sinks_shape", "sinks_dtype", "sinks_device",
]
# Not asked of the simulator: it clamps offsets instead of checking them (as MPS does),
# and it has no fake (Meta) kernel, so a meta tensor reaches no validation there.
NOT_IN_SIM = {"offset_negative", "offset_past", "device", "sinks_device"}
# Rules that need tensor values: a fake tensor has none, so only the kernel checks them.
VALUE_RULES = {"offset_negative", "offset_past"}
# The CUDA backend never reads offsets on the host: it clamps them (README, "Offsets").
NOT_IN = {"cpu": set(), "sim": NOT_IN_SIM, "cuda": VALUE_RULES}
# Where an invalid call's expected message names the query's device (a regex, filled in
# with the device the call runs on).
DEVICE = "<device>"


def draw_params(seed: int, index: int, stream: str) -> dict:
    rng = _rng(seed, stream, index)
    p = {"seed": seed, "index": index, "stream": stream, "tensor_seed": rng.getrandbits(62)}
    r = rng.random()
    if stream != "sim":
        p["role"] = "invalid" if r < 0.12 else "nonfinite" if r < 0.32 else "valid"
    else:
        p["role"] = "invalid" if r < 0.05 else "nonfinite" if r < 0.25 else "valid"
    _draw_shape(rng, p, stream)
    _draw_offsets(rng, p, stream)
    _draw_mask(rng, p)
    _draw_layouts(rng, p)
    _draw_scalars(rng, p)
    p["api"] = rng.choices(["with_lse", "both", "python"], [0.7, 0.2, 0.1])[0] if stream != "sim" else "with_lse"
    p["threads"] = rng.choices([None, 1, 3], [0.8, 0.1, 0.1])[0] if stream == "cpu" else None
    p["check_inputs_unchanged"] = rng.random() < 0.1
    if p["role"] == "nonfinite":
        _draw_nonfinite(rng, p)
        # Give the injection somewhere to go: a float mask for a bias, a dtype and scale
        # that can hold an overflowing score.
        if p["nonfinite"] == "bias" and p["mask_kind"] == "bool":
            p["mask_kind"], p["mask_dtype"] = "float", "float32"
        if p["nonfinite"] == "sink" and p["sinks"] is None:
            p["sinks"] = "finite"
        if p["nonfinite"] == "overflow":
            if "float16" in (p["dtype"], p["kv_dtype"]):
                p["dtype"] = p["kv_dtype"] = rng.choice(["float32", "bfloat16"])
            if p["scale"] == 0:
                p["scale"] = None
    if p["role"] == "invalid":
        kinds = [k for k in INVALID_KINDS if k not in NOT_IN[stream]]
        p["invalid"] = rng.choice(kinds)
        p["invalid_pick"] = rng.getrandbits(32)
        p["clamp"] = False
    return p


# =======================================================================================
# Building the call
# =======================================================================================

@dataclasses.dataclass
class Built:
    inputs: dict                                  # the op's arguments by name
    notes: List[str]                              # what was injected / mutated
    error: Optional[tuple] = None                 # invalid: (exception type(s), regex)
    clamped: Optional[list] = None                # clamp: [(b, equivalent in-range inputs)]


def clamped_window(off: int, M: int, S: int):
    """README, "Offsets": off clamped to [0, S], the window end to S. Returns (off, L):
    the clamped offset and how many window columns remain inside the cache."""
    off_c = min(max(off, 0), S)
    return off_c, min(off_c + M, S) - off_c


def _ancestor_rows(T: int, rng: random.Random) -> List[List[bool]]:
    """Ancestor-or-self matrix of a random tree ordered parents first (own generator:
    node bit sets as Python ints)."""
    anc = []
    for i in range(T):
        parent = rng.randrange(i) if i else -1
        anc.append((anc[parent] if parent >= 0 else 0) | (1 << i))
    return [[bool(a >> j & 1) for j in range(T)] for a in anc]


def _visibility(p: dict, shape, rng: random.Random, gen: torch.Generator) -> torch.Tensor:
    """bool base mask [bB, bH, T, M] (True = the window key is seen)."""
    bB, bH, T, M = shape
    if p["pattern"] == "tree" and M == T:
        same = rng.random() < 0.3
        trees = [_ancestor_rows(T, rng)] * (bB * bH) if same else [_ancestor_rows(T, rng) for _ in range(bB * bH)]
        vis = torch.tensor(trees, dtype=torch.bool).view(bB, bH, T, M) if T else torch.zeros(shape, dtype=torch.bool)
    elif p["pattern"] == "causal":
        # HF dense causal form: row i sees keys [0, end_i), ends increasing.
        ends = sorted(rng.randint(0, M) for _ in range(T))
        vis = (torch.arange(M)[None, :] < torch.tensor(ends, dtype=torch.long)[:, None]).expand(bB, bH, T, M).clone()
    else:
        vis = torch.rand(shape, generator=gen) < p["density"]
    if p["empty_row"] and T > 0 and M > 0:
        vis[..., rng.randrange(T), :] = False
    return vis


def _mask_tensor(p: dict, rng: random.Random, gen: torch.Generator, offs_clamped: List[int]):
    """(base mask [bB, bH, T, M] in the mask dtype, function base -> the mask passed)."""
    B, Hq, T, M = p["B"], p["Hq"], p["T"], p["M"]
    mB, mH = p["mask_batch"], p["mask_heads"]
    layout = p["mask_layout"]
    bB, bH = (1 if layout == "expand" else mB), (1 if layout == "expand" else mH)
    vis = _visibility(p, (bB, bH, T, M), rng, gen)
    kind = p["mask_kind"]
    fill_dtype = DTYPES[p["dtype"]]
    if kind == "float_min" and M > 0 and any(o == 0 for o in offs_clamped):
        # A row that sees only finfo.min keys is left out (each row gets one ordinary
        # key): for float16 (-65504) it is a softmax over scores quantised in float32,
        # which no float32 kernel matches to tolerance; for float32/bfloat16 (~-3.4e38)
        # the float64 reference itself is wrong there (its lse absorbs log(n), so the
        # weights exp(score - lse) sum to n, not 1).
        rows = ~vis.any(dim=-1)
        for idx in rows.nonzero().tolist():
            vis[tuple(idx) + (rng.randrange(M),)] = True
    if kind == "bool":
        base = vis
    else:
        mdt = MASK_DTYPES[p["mask_dtype"]]
        if p["bias"] == "zero":
            bias = torch.zeros(vis.shape)
        elif p["bias"] == "very_negative":
            bias = -torch.rand(vis.shape, generator=gen) * 60 - 20
        else:
            bias = torch.randn(vis.shape, generator=gen) * 0.5
        masked = torch.finfo(fill_dtype).min if kind == "float_min" else -INF
        base = torch.where(vis, bias.double(), torch.tensor(masked, dtype=torch.float64)).to(mdt)

    def finish(base: torch.Tensor) -> torch.Tensor:
        m = base.expand(mB, mH, T, M)
        if layout == "transposed":
            m = m.transpose(-1, -2).contiguous().transpose(-1, -2)
        elif layout == "sliced":
            big_fill = False if m.dtype == torch.bool else NAN
            big = torch.full((mB + 1, mH, T + 2, 2 * M + 3), big_fill, dtype=m.dtype)
            view = big[1:, :, 1:T + 1, 3::2]
            view.copy_(m)
            m = view
        if p["mask_rank"] == 3:
            m = m[:, 0]
        return m

    return base, finish


def _base_shape(full, layout):
    B, H, N, D = full
    if layout == "expand_batch":
        return (1, H, N, D)
    if layout == "expand_heads":
        return (B, 1, N, D)
    if layout == "expand_d":
        return (B, H, N, 1)
    return full


def _materialise(base: torch.Tensor, full, layout: str) -> torch.Tensor:
    """The same logical values as base.expand(full), in the given memory layout. Storage
    around padded views holds NaN, so a read outside the view is caught."""
    B, H, N, D = full
    if layout.startswith("expand"):
        return base.expand(full)
    if layout in ("bshd", "bthd"):
        return base.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "padded":
        big = torch.full((B + 1, H + 1, N + 3, D + 16), NAN, dtype=base.dtype)
        view = big[1:, 1:, 2:N + 2, 8:D + 8]
        view.copy_(base)
        return view
    if layout == "inner_stride":
        if (B * H * N * D) % 2:  # either way stride(-1) != 1: the op must copy
            return base.transpose(-1, -2).contiguous().transpose(-1, -2)
        big = torch.full((B, H, N, 2 * D), NAN, dtype=base.dtype)
        view = big[..., 1::2]
        view.copy_(base)
        return view
    return base


def _kv_pair(kb: torch.Tensor, vb: torch.Tensor, full):
    """K and V as the two planes of one [2, B, S + 5, Hkv, D] cache, sliced at key 2."""
    B, H, S, D = full
    store = torch.full((2, B, S + 5, H, D), NAN, dtype=kb.dtype)
    k = store[0, :, 2:S + 2].transpose(1, 2)
    v = store[1, :, 2:S + 2].transpose(1, 2)
    k.copy_(kb)
    v.copy_(vb)
    return k, v


def _seen(p: dict, mask_logical: torch.Tensor, offs: List[int]) -> torch.Tensor:
    """bool [B, Hq, T, S]: which keys each row sees, from the contract (offs clamped)."""
    B, Hq, T, S, M = p["B"], p["Hq"], p["T"], p["S"], p["M"]
    m = mask_logical if mask_logical.dim() == 4 else mask_logical[:, None]
    win = m.expand(B, Hq, T, M)
    win = win if win.dtype == torch.bool else ~torch.isneginf(win.float())
    seen = torch.zeros(B, Hq, T, S, dtype=torch.bool)
    for b, off in enumerate(offs):
        off_c, L = clamped_window(off, M, S)
        seen[b, :, :, :off_c] = True
        seen[b, :, :, off_c:off_c + L] = win[b, :, :, :L]
    return seen


def build(p: dict) -> Built:
    gen = torch.Generator().manual_seed(p["tensor_seed"])
    rng = random.Random(p["tensor_seed"])
    B, Hq, Hkv, T, S, D, M = (p[n] for n in ("B", "Hq", "Hkv", "T", "S", "D", "M"))
    dtype, kv_dtype = DTYPES[p["dtype"]], DTYPES[p["kv_dtype"]]
    offs = [0] * B if p["offsets"] is None else list(p["offsets"])
    clamped = [clamped_window(o, M, S) for o in offs]
    offs_c = [c[0] for c in clamped]
    ends = [o + L for o, L in clamped]  # first key never read, per batch row
    notes = []

    q_full, kv_full = (B, Hq, T, D), (B, Hkv, S, D)
    # expand_d rows are constant along D, so q.k = D q0 k0: scale them by D^-1/4 to keep
    # scores as spread as with random rows (sharper softmaxes only measure float32).
    q_amp = D ** -0.25 if p["q_layout"] == "expand_d" else 1.0
    k_amp = D ** -0.25 if p["k_layout"] == "expand_d" else 1.0
    qb = (torch.randn(_base_shape(q_full, p["q_layout"]), generator=gen) * q_amp).to(dtype)
    kb = (torch.randn(_base_shape(kv_full, p["k_layout"]), generator=gen) * k_amp).to(kv_dtype)
    vb = torch.randn(_base_shape(kv_full, p["v_layout"]), generator=gen).to(kv_dtype)
    fill = {"nan": NAN, "inf": INF, "-inf": -INF, "max": torch.finfo(kv_dtype).max}[p["unused_fill"]]
    for base in (kb, vb):
        for bb in range(base.shape[0]):
            # A base row broadcast over the batch is read up to the largest end.
            end = max(ends) if base.shape[0] == 1 and B > 1 else (ends[bb] if B else 0)
            base[bb, :, end:] = fill

    mask_base, finish_mask = _mask_tensor(p, rng, gen, offs_c)

    sinks = None
    if p["sinks"] is not None:
        spread = 12.0 if p["sinks"] == "dominant" else 2.0
        sinks = torch.randn(Hq, generator=gen, dtype=torch.float64) * spread
        if p["sinks"] == "with_neg_inf" and Hq:
            sinks[rng.randrange(Hq)] = -INF
        sinks = sinks.to(MASK_DTYPES[p["sinks_dtype"]])

    if p["role"] == "nonfinite" and NONFINITE:
        notes.append(_inject(p, rng, qb, kb, vb, mask_base, finish_mask, offs, sinks))

    if p["k_layout"] == "kv_pair":
        key, value = _kv_pair(kb, vb, kv_full)
    else:
        key, value = _materialise(kb, kv_full, p["k_layout"]), _materialise(vb, kv_full, p["v_layout"])
    query = _materialise(qb, q_full, p["q_layout"])
    mask = finish_mask(mask_base)
    offset = None
    if p["offsets"] is not None:
        odt = torch.int32 if p["offset_dtype"] == "int32" else torch.int64
        if p["offset_layout"] == "strided":  # a strided view with a storage offset
            store = torch.full((2 * B + 1,), -7, dtype=odt)
            offset = store[1::2]
            offset.copy_(torch.tensor(offs, dtype=odt))
        else:
            offset = torch.tensor(offs, dtype=odt)
    inputs = dict(query=query, key=key, value=value, mask=mask, mask_offset=offset,
                  scale=p["scale"], softcap=p["softcap"], sinks=sinks)
    built = Built(inputs=inputs, notes=notes)
    if p["role"] == "invalid":
        _mutate(p, built)
    elif p["clamp"]:
        built.clamped = []
        for b, (off_c, L) in enumerate(clamped):
            mb = mask[b:b + 1] if mask.shape[0] == B else mask[:1]
            built.clamped.append((b, dict(
                query=query[b:b + 1], key=key[b:b + 1], value=value[b:b + 1], mask=mb[..., :L],
                mask_offset=torch.tensor([off_c], dtype=torch.int64), scale=p["scale"], softcap=p["softcap"],
                sinks=sinks)))
    return built


# ---------------------------------------------------------------------------------------
# Non-finite injection (README, "Non-finite values"). The reference decides which rows
# are poisoned; the injection only aims the value at an interesting place.

def _inject(p, rng, qb, kb, vb, mask_base, finish_mask, offs, sinks) -> str:
    B, Hq, Hkv, T, S, D, M = (p[n] for n in ("B", "Hq", "Hkv", "T", "S", "D", "M"))
    G = Hq // Hkv if Hkv else 1
    pick = random.Random(p["nonfinite_pick"])
    bad = {"nan": NAN, "inf": INF, "-inf": -INF}[p["nonfinite_value"]]
    kind = p["nonfinite"]
    if B == 0 or T == 0:
        return f"{kind}: no room (empty problem)"
    seen = _seen(p, finish_mask(mask_base), offs)          # [B, Hq, T, S]
    kv_seen = seen.view(B, Hkv, G * T, S).any(dim=2)       # [B, Hkv, S]: seen by some row of the kv head

    def reduce(base, idx):  # logical index -> index into a (possibly broadcast) base
        return tuple(0 if base.shape[d] == 1 else i for d, i in enumerate(idx))

    if kind == "query":
        idx = (pick.randrange(B), pick.randrange(Hq), pick.randrange(T), pick.randrange(D))
        qb[reduce(qb, idx)] = bad
        return f"query{list(idx)} = {bad}"

    if kind == "sink":
        # NaN or +inf poisons the head's rows; -inf is no sink (nothing poisoned).
        h = pick.randrange(Hq)
        sinks[h] = bad
        return f"sinks[{h}] = {bad}"

    if kind in ("key", "value"):
        # The place asked for, else the others (a case may have no prefix, say).
        wheres = [p["nonfinite_where"]] + [w for w in ("prefix", "window_seen", "window_unseen")
                                           if w != p["nonfinite_where"]]
        for where in wheres:
            spots = []
            for b in range(B):
                off_c, L = clamped_window(offs[b], M, S)
                cols = range(off_c) if where == "prefix" else range(off_c, off_c + L)
                for h in range(Hkv):
                    for j in cols:
                        if where == "prefix" or bool(kv_seen[b, h, j]) == (where == "window_seen"):
                            spots.append((b, h, j))
            if spots:
                break
        else:
            return f"{kind}: no key at all"
        b, h, j = pick.choice(spots)
        base = kb if kind == "key" else vb
        idx = (b, h, j, pick.randrange(D))
        base[reduce(base, idx)] = bad
        return f"{kind}{list(idx)} ({where}) = {bad}"

    if kind == "masked_garbage":
        # Every window key no row of its kv head sees gets a non-finite K and V row.
        n = 0
        for b in range(B):
            off_c, L = clamped_window(offs[b], M, S)
            for h in range(Hkv):
                for j in range(off_c, off_c + L):
                    if not kv_seen[b, h, j]:
                        for base in (kb, vb):
                            ib = (0 if base.shape[0] == 1 else b, 0 if base.shape[1] == 1 else h, j)
                            # A broadcast base row is shared: only if no sharer sees it.
                            bs = range(B) if base.shape[0] == 1 else [b]
                            hs = range(Hkv) if base.shape[1] == 1 else [h]
                            if not any(kv_seen[b2, h2, j] for b2 in bs for h2 in hs):
                                base[ib] = bad
                                n += 1
        return f"masked window keys' K/V rows = {bad} ({n} rows)"

    if kind == "bias":
        if mask_base.dtype == torch.bool or mask_base.numel() == 0:
            return "bias: bool or empty mask"
        value = bad
        if bad == -INF:
            # -inf only masks the entry (legal, nothing poisoned); in a float64 mask use
            # 1e39 half the time instead: finite there, +inf as the float32 the op reads.
            if mask_base.dtype == torch.float64 and pick.random() < 0.5:
                value = 1e39
            elif p["mask_kind"] == "float_min":
                # Masking the one ordinary key of a finfo.min row would leave the row the
                # generator rules out (see _make_mask): poison it with NaN instead.
                value = math.nan
        want_seen = p["nonfinite_seen"]
        finite = ~torch.isneginf(mask_base.float())
        spots = (finite if want_seen else ~finite).nonzero().tolist() or finite.nonzero().tolist() \
            or (~finite).nonzero().tolist()
        idx = tuple(pick.choice(spots))
        mask_base[idx] = value
        return f"mask base{list(idx)} = {value} (was {'seen' if finite[idx] else 'masked'})"

    if kind == "overflow":
        # One (row, key) pair whose score is ~1e4 x FLOAT32_MAX, every other score of the
        # row and of the key far below it. float16 cannot hold such values; with scale 0
        # there is no score (the order q.k * 0 vs (q * 0).k is not the contract's).
        scale = p["scale"] if p["scale"] is not None else D ** -0.5
        scale = float(torch.tensor(scale, dtype=torch.float32))
        if torch.float16 in (qb.dtype, kb.dtype) or scale == 0:
            return "overflow: impossible in float16 / with scale 0"
        want_seen = p["nonfinite_seen"] or qb.dtype != torch.float32  # unseen: float32 only (no ties)
        # Unseen pairs only among keys that are read at all (before the clamped end).
        readable = torch.zeros_like(seen)
        for b in range(B):
            readable[b, ..., :sum(clamped_window(offs[b], M, S))] = True
        spots = (seen if want_seen else ~seen & readable).nonzero().tolist()
        if not spots:
            return "overflow: no such (row, key)"
        b, h, i, j = pick.choice(spots)
        d = pick.randrange(D)
        big = math.sqrt(1e4 * FMAX / abs(scale))
        sign = 1.0 if pick.random() < 0.5 else -1.0
        qb[reduce(qb, (b, h, i, d))] = big
        kb[reduce(kb, (b, h // G, j, d))] = sign * big
        return f"overflow: query[{b},{h},{i},{d}] = {big:.3g}, key[{b},{h // G},{j},{d}] = {sign * big:.3g}"
    raise AssertionError(kind)


# ---------------------------------------------------------------------------------------
# Invalid calls: one rule of csrc/validation.cpp broken; the op must raise the right
# exception type with a message naming the argument.

def _mutate(p: dict, built: Built) -> None:
    i = built.inputs
    B, Hq, Hkv, T, S, D, M = (p[n] for n in ("B", "Hq", "Hkv", "T", "S", "D", "M"))
    pick = random.Random(p["invalid_pick"])
    dtype, kv_dtype = DTYPES[p["dtype"]], DTYPES[p["kv_dtype"]]
    kind = p["invalid"]
    q, k, v, mask = i["query"], i["key"], i["value"], i["mask"]

    def set_(note, exc, pattern, **changes):
        i.update(changes)
        built.notes.append(note)
        built.error = (exc, pattern)

    if kind in ("query_rank", "key_rank", "value_rank"):
        name = kind.split("_")[0]
        t = i[name]
        options = [t[None], t.reshape(-1), t.flatten(0, 1)]
        new = pick.choice(options)
        set_(f"{name} shape {list(new.shape)}", ValueError, rf"{name} must be 4-D", **{name: new})
    elif kind == "mask_rank":
        m4 = mask if mask.dim() == 4 else mask[:, None]
        new = pick.choice([m4[:, 0, 0] if m4.shape[1] and m4.shape[2] else m4.reshape(-1), m4[None], m4.reshape(-1)])
        set_(f"mask shape {list(new.shape)}", ValueError, r"mask must be 3-D .* or 4-D", mask=new)
    elif kind == "query_dtype":
        bad = pick.choice([torch.float64, torch.int32, torch.int64, torch.int8, torch.uint8])
        to = {n: i[n].to(bad) for n in ("query", "key", "value")} if pick.random() < 0.5 else {"query": q.to(bad)}
        set_(f"query dtype {bad}", TypeError,
             rf"query, key and value dtypes must be one of .*got query {C10_NAME[bad]}", **to)
    elif kind in ("key_dtype", "value_dtype"):
        name = kind.split("_")[0]
        bad = pick.choice([t for t in (torch.float32, torch.float16, torch.bfloat16, torch.float64) if t != kv_dtype])
        set_(f"{name} dtype {bad}", TypeError, rf"dtypes must be one of .*got query \w+, .*{name} {C10_NAME[bad]}",
             **{name: i[name].to(bad)})
    elif kind == "head_dim":
        Dn = pick.choice([0, 1, 16, 32, 48, 63, 65, 80, 100, 112, 160, 192, 255, 257, 384, 511, 513, 1024])
        new = {n: torch.zeros(*i[n].shape[:3], Dn, dtype=dtype) for n in ("query", "key", "value")}
        set_(f"D={Dn}", ValueError, rf"query head dim D must be one of 64, 96, 128, 256, 512, got {Dn}", **new)
    elif kind == "key_batch":
        Bn = pick.choice([x for x in (0, 1, 2, B + 1, B + 2) if x != B])
        kv = torch.zeros(Bn, Hkv, S, D, dtype=kv_dtype)
        set_(f"key/value batch {Bn}", ValueError, r"key must be \[B, Hkv, S, D\]", key=kv, value=kv.clone())
    elif kind == "key_head_dim":
        Dn = pick.choice([x for x in (64, 96, 128, 256, 512, 32) if x != D])
        kv = torch.zeros(B, Hkv, S, Dn, dtype=kv_dtype)
        set_(f"key/value D {Dn}", ValueError, r"key must be \[B, Hkv, S, D\]", key=kv, value=kv.clone())
    elif kind == "value_shape":
        shape = list(v.shape)
        dim = pick.choice([0, 1, 2, 3])
        shape[dim] += pick.choice([1, 2]) if shape[dim] == 0 or pick.random() < 0.5 else -1
        set_(f"value shape {shape}", ValueError, r"value shape must equal key shape", value=torch.zeros(shape, dtype=kv_dtype))
    elif kind == "gqa":
        options = [0] + [h for h in range(1, Hq + 3) if Hq % h != 0] if Hq > 0 else [0]
        Hn = pick.choice(options)
        kv = torch.zeros(B, Hn, S, D, dtype=kv_dtype)
        set_(f"Hkv={Hn} for Hq={Hq}", ValueError,
             rf"query heads Hq must be a positive multiple of key/value heads Hkv, got Hq={Hq} Hkv={Hn}",
             key=kv, value=kv.clone())
    elif kind == "mask_dtype":
        bad = pick.choice([torch.int32, torch.int64, torch.int8, torch.uint8, torch.int16])
        set_(f"mask dtype {bad}", TypeError, r"mask must be bool \(True = attend\) or floating", mask=mask.to(bad))
    elif kind == "mask_batch":
        Bn = pick.choice([x for x in (0, 2, 3, B + 1) if x not in (1, B)])
        new = torch.ones((Bn,) + tuple(mask.shape[1:]), dtype=mask.dtype)
        set_(f"mask batch {Bn}", ValueError, rf"mask batch size must be B={B} or 1", mask=new)
    elif kind == "mask_heads":
        Hn = pick.choice([x for x in (0, 2, 3, Hq + 1, 2 * Hq) if x not in (1, Hq)])
        new = torch.ones(mask.shape[0], Hn, T, M, dtype=mask.dtype)
        set_(f"mask heads {Hn}", ValueError, rf"mask head size must be 1 or Hq={Hq}", mask=new)
    elif kind == "mask_rows":
        Tn = pick.choice([x for x in (0, 1, T - 1, T + 1, 2 * T + 1) if x != T and x >= 0])
        shape = list(mask.shape)
        shape[-2] = Tn
        set_(f"mask rows {Tn}", ValueError, rf"mask query size must be T={T}", mask=torch.ones(shape, dtype=mask.dtype))
    elif kind == "mask_window":
        Mn = S + pick.choice([1, 2, 17])
        shape = list(mask.shape)
        shape[-1] = Mn
        set_(f"mask window {Mn} > S={S}", ValueError, rf"mask window M={Mn} exceeds key capacity S={S}",
             mask=torch.ones(shape, dtype=mask.dtype))
    elif kind == "offset_dtype":
        bad = pick.choice([torch.float32, torch.float64, torch.int16, torch.int8, torch.uint8, torch.bool])
        set_(f"offset dtype {bad}", TypeError, r"mask_offset must be int32 or int64",
             mask_offset=torch.zeros(B, dtype=bad))
    elif kind == "offset_shape":
        odt = torch.int32 if p["offset_dtype"] == "int32" else torch.int64
        shape = pick.choice([(B + 1,), (B, 1), (), (1, B), (2 * B + 2,)])
        set_(f"offset shape {list(shape)}", ValueError, rf"mask_offset must have shape \[B\] = \[{B}\]",
             mask_offset=torch.zeros(shape, dtype=odt))
    elif kind in ("offset_negative", "offset_past"):
        odt = torch.int32 if p["offset_dtype"] == "int32" else torch.int64
        if B == 0:
            # Nothing to check without batch rows: the call is valid (a zero-size result).
            built.notes.append("no batch rows: offsets have no values")
            return
        offs = [0] * B if i["mask_offset"] is None else [int(x) for x in i["mask_offset"]]
        b = pick.randrange(B)
        if kind == "offset_negative":
            offs[b] = pick.choice([-1, -2, -S - 1, -(2**31)] + ([-(2**40), -(2**63)] if odt == torch.int64 else []))
            exc, pattern = ValueError, r"mask_offset values must be >= 0"
        else:
            offs = [min(max(o, 0), S - M) for o in offs]
            offs[b] = pick.choice([x for x in (S - M + 1, S - M + 2, S, S + 1, 2**31 - 1) if x > S - M]
                                  + ([2**40, 2**63 - 1] if odt == torch.int64 else []))
            exc, pattern = ValueError, rf"mask_offset \+ M must be <= S={S} for M={M}"
        set_(f"offsets {offs} ({odt})", exc, pattern, mask_offset=torch.tensor(offs, dtype=odt))
    elif kind == "scale":
        bad = pick.choice([INF, -INF, NAN, 1e39, -1e39, 1e-46, -1e-46, 1e300])
        set_(f"scale {bad}", ValueError, r"scale", scale=bad)
    elif kind == "softcap":
        bad = pick.choice([0.0, -0.0, -1.0, -30.0, INF, -INF, NAN, 1e-46, 1e39])
        set_(f"softcap {bad}", ValueError, r"softcap must be a positive finite float32", softcap=bad)
    elif kind == "device":
        name = pick.choice(["query", "key", "value", "mask", "mask_offset"])
        if name == "mask_offset":
            odt = torch.int32 if p["offset_dtype"] == "int32" else torch.int64
            set_("mask_offset on meta", ValueError, rf"mask_offset must be on the query's device {DEVICE}, got meta",
                 mask_offset=torch.zeros(B, dtype=odt, device="meta"))
        else:
            pattern = (r"must be on one device, got query on meta" if name == "query"
                       else rf"must be on one device, got query on {DEVICE}.*{name} on meta")
            set_(f"{name} on meta", ValueError, pattern, **{name: i[name].to("meta")})
    elif kind == "dtype_pair":
        # Key and value agree, but the query is neither their dtype nor float32 over half.
        qd, kd = pick.choice([(torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                              (torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16),
                              (torch.float64, torch.float16), (torch.float32, torch.float64)])
        set_(f"query {qd} over key/value {kd}", TypeError,
             rf"dtypes must be one of .*got query {C10_NAME[qd]}, key {C10_NAME[kd]}, value {C10_NAME[kd]}",
             query=q.to(qd), key=k.to(kd), value=v.to(kd))
    elif kind == "sinks_shape":
        shape = pick.choice([(Hq + 1,), (Hq, 1), (), (1, Hq), (max(Hq // 2, 1) if Hq != 1 else 2,)])
        set_(f"sinks shape {list(shape)}", ValueError, rf"sinks must have shape \[Hq\] = \[{Hq}\]",
             sinks=torch.zeros(shape))
    elif kind == "sinks_dtype":
        bad = pick.choice([torch.int32, torch.int64, torch.int8, torch.bool])
        set_(f"sinks dtype {bad}", TypeError, r"sinks must be a floating tensor", sinks=torch.zeros(Hq, dtype=bad))
    elif kind == "sinks_device":
        set_("sinks on meta", ValueError, rf"sinks must be on the query's device {DEVICE}, got meta",
             sinks=torch.zeros(Hq, device="meta"))
    else:
        raise AssertionError(kind)
    if kind == "scale":
        # The message names scale and the value; "rounds to 0" for the tiny ones.
        built.error = (ValueError, r"scale must be a finite float32, got|scale .* rounds to 0 in float32")


# =======================================================================================
# Running and checking
# =======================================================================================

def _ops(stream: str):
    return torch.ops.tree_attn_sim if stream == "sim" else torch.ops.tree_attn


def _args(inputs: dict) -> tuple:
    return args_of(inputs)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == torch.bool or not a.is_floating_point():
        return torch.equal(a, b)
    both_nan = torch.isnan(a) & torch.isnan(b)
    return bool(((a == b) | both_nan).all())


class num_threads:
    def __init__(self, n):
        self.n = n

    def __enter__(self):
        self.before = torch.get_num_threads()
        if self.n is not None:
            torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.before)


def _call(p: dict, inputs: dict):
    ops = _ops(p["stream"])
    with num_threads(p["threads"]):
        if p["api"] == "python":
            return torch_tree_attn.tree_attention(**inputs, return_lse=True)
        out, lse = ops.forward_with_lse(*_args(inputs))
        if p["api"] == "both":
            alone = ops.forward(*_args(inputs))
            assert _bits_equal(alone, out), "forward and forward_with_lse outputs differ"
        return out, lse


def _expect_error(call, exc, pattern) -> Optional[str]:
    try:
        call()
    except (ValueError, TypeError) as e:
        if not isinstance(e, exc):
            return f"raised {type(e).__name__} instead of {exc.__name__}: {e}"
        if not re.search(pattern, str(e)):
            return f"message does not match {pattern!r}: {type(e).__name__}: {e}"
        return None
    except Exception as e:
        return f"raised {type(e).__name__} (want {exc.__name__} matching {pattern!r}): {e}"
    return f"returned instead of raising {exc.__name__} matching {pattern!r}"


def _call_fake(p: dict, inputs: dict):
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    fake = {n: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for n, t in inputs.items()}
    # FakeTensorMode logs every exception a fake raises; here raising is the point.
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        with mode:
            return _ops(p["stream"]).forward_with_lse(*_args(fake))
    finally:
        log.setLevel(level)


def to_device(inputs: dict, device) -> dict:
    """The inputs on `device`, each tensor a copy of its whole storage viewed with the same
    sizes, strides and storage offset: padding (NaN), stride-0 and strided views and K/V
    sharing one cache stay as built. Meta tensors (invalid calls) and non-tensors stay."""
    copies, out = {}, {}
    for name, t in inputs.items():
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            out[name] = t
            continue
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes(), t.dtype)
        if key not in copies:
            whole = torch.empty(0, dtype=t.dtype).set_(storage)
            copies[key] = whole.to(device, copy=True)
        out[name] = copies[key].as_strided(t.shape, t.stride(), t.storage_offset())
    return out


@dataclasses.dataclass
class Pending:
    """A valid call launched (possibly asynchronously), waiting for its check."""
    p: dict
    built: Built
    inputs: dict       # what the op was called with (on the run's device)
    before: dict       # clones of those inputs, if the case checks they are unchanged
    out: torch.Tensor  # the op's results, on the host (copies started without a sync)
    lse: torch.Tensor


def _start(p: dict, device=None):
    """Builds and calls one case: (failure, None) when it is decided already (an invalid
    call, a build error, a raising call), else (None, Pending). device None: the built
    tensors themselves (the cpu and sim streams); else copies on that device."""
    try:
        built = build(p)
    except Exception:  # a fuzzer bug, not a kernel bug: still report it
        return "building the case failed:\n" + traceback.format_exc(), None
    inputs = built.inputs if device is None else to_device(built.inputs, device)
    if built.error is not None:
        exc, pattern = built.error
        where = str(torch.empty(0, device=device).device) if device is not None else "cpu"
        error = (exc, pattern.replace(DEVICE, re.escape(where)))
        failure = _expect_error(lambda: _call(p, inputs), *error)
        if failure is None and p["stream"] == "cpu" and p["invalid"] not in VALUE_RULES:
            # The fake (torch.compile's tracing) refuses the call with the same error.
            failure = _expect_error(lambda: _call_fake(p, inputs), *error)
            failure = None if failure is None else "under FakeTensorMode: " + failure
        return failure, None

    before = {n: t.clone() for n, t in inputs.items() if isinstance(t, torch.Tensor)} \
        if p["check_inputs_unchanged"] else {}
    try:
        out, lse = _call(p, inputs)
    except Exception as e:
        return f"valid call raised {type(e).__name__}: {e}", None
    if out.device.type != "cpu":
        # Into pinned host memory, queued behind the kernel: the caller syncs once.
        out, lse = out.to("cpu", non_blocking=True), lse.to("cpu", non_blocking=True)
    return None, Pending(p, built, inputs, before, out, lse)


def _finish(pending: Pending) -> Optional[str]:
    """Checks a launched case (its device synced) against the float64 reference, which
    reads the host tensors the case was built from."""
    p, built, out, lse = pending.p, pending.built, pending.out, pending.lse
    for n, t in pending.before.items():
        if not _bits_equal(t, pending.inputs[n]):
            return f"the op modified its input {n}"
    inputs = built.inputs
    try:
        if built.clamped is None:
            check_against_reference(out, lse, inputs)
        else:
            assert out.shape == inputs["query"].shape and out.is_contiguous()
            for b, call in built.clamped:
                try:
                    check_against_reference(out[b:b + 1], lse[b:b + 1], call)
                except AssertionError as e:
                    raise AssertionError(f"batch row {b} (clamped offset {int(call['mask_offset'][0])}, "
                                         f"window {call['mask'].shape[-1]} of M={p['M']}): {e}") from None
    except AssertionError as e:
        return f"{type(e).__name__}: {e}"
    return None


def run_case(p: dict, device=None) -> Optional[str]:
    """Runs one case; returns None if it honours the contract, else a description."""
    failure, pending = _start(p, device)
    if pending is not None:
        _sync(device)
        failure = _finish(pending)
    return failure


def _sync(device) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def describe(p: dict) -> str:
    skip = {"seed", "index", "stream", "tensor_seed", "nonfinite_pick", "invalid_pick"}
    if p["role"] != "nonfinite":
        skip |= {k for k in p if k.startswith("nonfinite")}
    return ", ".join(f"{k}={v}" for k, v in p.items() if k not in skip)


def reproducer(p: dict) -> str:
    env = "" if NONFINITE else "FUZZ_NONFINITE=0 "
    sim = {"cpu": "", "sim": " --sim", "cuda": " --cuda"}[p["stream"]]
    return f"{env}python -m tests.test_fuzz --seed {p['seed']} --case {p['index']}{sim}"


def report(p: dict, failure: str) -> str:
    notes = ""
    try:
        notes = "; ".join(build(p).notes)
    except Exception:
        pass
    lines = failure.strip().splitlines()
    if len(lines) > 12:
        lines = lines[:12] + [f"... ({len(lines) - 12} more lines)"]
    return (f"case {p['index']} (seed {p['seed']}, {p['stream']}, {p['role']}): {describe(p)}\n"
            + (f"  injected/mutated: {notes}\n" if notes else "")
            + "".join(f"  | {line}\n" for line in lines)
            + f"  reproduce: {reproducer(p)}")


def run_range(stream: str, indices, seed: int = BASE_SEED) -> List[str]:
    failures = []
    for index in indices:
        p = draw_params(seed, index, stream)
        failure = run_case(p)
        if failure is not None:
            failures.append(report(p, failure))
    return failures


def run_batched(stream: str, indices, device, seed: int = BASE_SEED, group: int = GROUP):
    """Runs cases on `device` a group at a time: each is built on the host and launched,
    then one sync, then each is checked. Returns (failures, cases run). On a device that
    checks offsets on the host (cpu) a clamped case is skipped: there it is an error."""
    failures, ran = [], 0
    host_checks = torch.device(device).type == "cpu"
    indices = list(indices)
    for start in range(0, len(indices), group):
        pending = []
        for index in indices[start:start + group]:
            p = draw_params(seed, index, stream)
            if p["clamp"] and host_checks:
                continue
            ran += 1
            failure, launched = _start(p, device)
            if failure is not None:
                failures.append(report(p, failure))
            elif launched is not None:
                pending.append(launched)
        _sync(device)
        for launched in pending:
            failure = _finish(launched)
            if failure is not None:
                failures.append(report(launched.p, failure))
    return failures, ran


def cuda_specs(stream: str, indices, seed: int = BASE_SEED, arch: int = 90, num_sms: int = 132) -> dict:
    """The distinct kernel specs (main and reduce, JSON -> spec) the valid calls of these
    cases launch on a GPU of `arch` with `num_sms` SMs, from the C++ plan (no GPU needed).
    A spec depends on the call's dtypes, D, mask kind, softcap, layout alignment and tiles."""
    from torch_tree_attn import _C

    specs = {}
    for index in indices:
        built = build(draw_params(seed, index, stream))
        if built.error is not None:
            continue
        try:
            _, main, reduce = _C.cuda_plan_launch(*_args(built.inputs), arch=arch, num_sms=num_sms)
        except (ValueError, TypeError, RuntimeError):  # an empty problem launches nothing
            continue
        for spec in (main, reduce):
            if spec is not None:
                specs.setdefault(json.dumps(spec, sort_keys=True), spec)
    return specs


def warm_cuda(indices, seed: int = BASE_SEED, jobs: Optional[int] = None) -> tuple:
    """Compiles, in parallel, the cuda stream's specs outside the prebuilt table (as
    tests/warm_cuda_kernels.py does for the parity matrix), so no case waits for Triton.
    Returns (specs met, specs compiled, seconds)."""
    import concurrent.futures
    import multiprocessing

    from tests.warm_cuda_kernels import _compile
    from torch_tree_attn.backends import cuda as cuda_backend

    t0 = time.perf_counter()
    major, minor = torch.cuda.get_device_capability()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    specs = cuda_specs("cuda", indices, seed, major * 10 + minor, num_sms)
    prebuilt = {json.dumps(e["spec"], sort_keys=True) for e in cuda_backend.load_manifest()}
    todo = [spec for key, spec in specs.items() if key not in prebuilt]
    if todo:
        # Spawned workers: this process has initialised CUDA, which a forked child must not inherit.
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(jobs or os.cpu_count(), mp_context=ctx) as pool:
            list(pool.map(_compile, todo))
    return len(specs), len(todo), time.perf_counter() - t0


def _chunk(n: int, chunks: int, k: int) -> range:
    return range(n * k // chunks, n * (k + 1) // chunks)


def _fail_chunk(stream, indices, failures):
    shown = "\n\n".join(failures[:MAX_REPORTED])
    more = f"\n\n... and {len(failures) - MAX_REPORTED} more" if len(failures) > MAX_REPORTED else ""
    pytest.fail(f"{len(failures)} of {len(indices)} {stream} cases (indices {indices.start}..{indices.stop - 1}, "
                f"FUZZ_SEED={BASE_SEED}) break the contract:\n\n{shown}{more}", pytrace=False)


def _check_chunk(stream: str, n: int, chunks: int, chunk: int) -> None:
    """Run the `chunk`-th of `chunks` slices of the stream's first n cases; fail with a report
    of those that break the contract."""
    indices = _chunk(n, chunks, chunk)
    failures = run_range(stream, indices)
    if failures:
        _fail_chunk(stream, indices, failures)


# =======================================================================================
# pytest entry points
# =======================================================================================

@pytest.mark.parametrize("chunk", range(CPU_CHUNKS))
def test_cpu_op_against_reference(chunk):
    _check_chunk("cpu", N_CPU, CPU_CHUNKS, chunk)


@pytest.mark.skipif(not HAVE_SIM, reason="torch_tree_attn_sim not built (pip install ./tests/sim)")
@pytest.mark.parametrize("chunk", range(SIM_CHUNKS))
def test_metal_simulator_against_reference(chunk):
    _check_chunk("sim", N_SIM, SIM_CHUNKS, chunk)


HAVE_CUDA = torch.cuda.is_available()


def _cuda_run(count: int, device="cuda") -> tuple:
    """(failures, cases run, seconds) of the cuda stream's first `count` cases on `device`."""
    start = time.perf_counter()
    failures, ran = run_batched("cuda", range(count), device)
    return failures, ran, time.perf_counter() - start


@pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA device")
def test_fuzz_cuda():
    specs, compiled, warm_s = warm_cuda(range(N_CUDA))
    # Every kernel now compiled (or loaded from Triton's cache) before the timed run.
    run_batched("cuda", range(min(N_CUDA, 2 * GROUP)), "cuda")
    failures, ran, seconds = _cuda_run(N_CUDA)
    print(f"cuda fuzz: {ran} cases in {seconds:.1f} s ({ran / seconds:.0f} cases/s); {specs} kernel specs, "
          f"{compiled} compiled outside the prebuilt table in {warm_s:.1f} s")
    if failures:
        _fail_chunk("cuda", range(N_CUDA), failures)


def test_batched_runner_on_cpu():
    # The cuda stream's logic (layout-keeping copies, launches grouped before one sync,
    # checks afterwards) on the CPU kernel, over the stream's own cases.
    failures, ran, seconds = _cuda_run(N_BATCHED_CPU, device="cpu")
    if failures:
        _fail_chunk("cuda on cpu", range(N_BATCHED_CPU), failures)
    assert ran > 0.6 * N_BATCHED_CPU  # the clamped cases (CPU checks offsets instead) are few
    print(f"cuda stream on cpu: {ran} cases in {seconds:.1f} s")


def test_to_device_keeps_layout_and_sharing():
    # A K/V pair cache (two planes of one storage), a padded query and a sliced mask.
    p = next(q for q in (draw_params(BASE_SEED, i, "cuda") for i in range(2000))
             if q["role"] == "valid" and q["k_layout"] == "kv_pair" and q["q_layout"] == "padded"
             and q["mask_layout"] == "sliced" and q["B"] > 0 and q["T"] > 0 and q["S"] > 0)
    inputs = build(p).inputs
    moved = to_device(inputs, "cpu")
    for name in ("query", "key", "value", "mask"):
        a, b = inputs[name], moved[name]
        assert b.data_ptr() != a.data_ptr(), f"{name} is not a copy"
        assert (b.shape, b.stride(), b.storage_offset(), b.dtype) == (a.shape, a.stride(), a.storage_offset(), a.dtype)
        assert _bits_equal(a, b) and b.untyped_storage().nbytes() == a.untyped_storage().nbytes()
    # The NaN padding around the views came along, and K and V still share one storage.
    assert torch.isnan(torch.empty(0, dtype=moved["query"].dtype).set_(moved["query"].untyped_storage())).any()
    assert moved["key"].untyped_storage().data_ptr() == moved["value"].untyped_storage().data_ptr()


def test_cuda_stream_distribution():
    ps = [draw_params(BASE_SEED, i, "cuda") for i in range(min(N_CUDA, 2000))]
    assert {p["role"] for p in ps} == {"valid", "nonfinite", "invalid"}
    assert {p["invalid"] for p in ps if p["role"] == "invalid"} == set(INVALID_KINDS) - VALUE_RULES
    assert any(p["clamp"] for p in ps) and {p["dtype"] for p in ps} == set(DTYPES)
    # Its cases are its own, not the cpu stream's.
    assert draw_params(BASE_SEED, 3, "cuda")["tensor_seed"] != draw_params(BASE_SEED, 3, "cpu")["tensor_seed"]


def test_case_distribution():
    # The fuzzer covers what its docstring promises (on the first cases of the stream).
    ps = [draw_params(BASE_SEED, i, "cpu") for i in range(min(N_CPU, 2000))]
    values = lambda key: {str(p.get(key)) for p in ps}  # noqa: E731
    assert values("dtype") == set(DTYPES) and values("D") == {"64", "96", "128", "256", "512"}
    assert {(p["dtype"], p["kv_dtype"]) for p in ps} == {(t, t) for t in DTYPES} | {
        ("float32", "float16"), ("float32", "bfloat16")}
    assert values("sinks") == {"None", "finite", "with_neg_inf", "dominant"}
    assert {p["sinks_dtype"] for p in ps if p["sinks"]} == set(MASK_DTYPES)
    assert values("window") == {"compact", "dense", "empty", "arbitrary"}
    assert values("mask_kind") == {"bool", "float", "float_min"}
    assert {p["Hq"] // p["Hkv"] for p in ps} == set(range(1, 9))
    assert values("q_layout") == set(Q_LAYOUTS) and values("k_layout") == set(KV_LAYOUTS)
    assert values("mask_layout") == {"contiguous", "expand", "transposed", "sliced"}
    assert values("offset_dtype") == {"int32", "int64"} and "None" in values("offsets")
    assert {p["invalid"] for p in ps if p["role"] == "invalid"} == set(INVALID_KINDS)
    assert {p["nonfinite"] for p in ps if p["role"] == "nonfinite"} == set(NONFINITE_KINDS)
    assert any(p["scale"] == 0 for p in ps) and any(p["softcap"] for p in ps)
    assert max(p["T"] for p in ps) >= 60 and max(p["S"] for p in ps) >= 1000
    # Cases are a pure function of (seed, stream, index).
    assert draw_params(BASE_SEED, 7, "cpu") == draw_params(BASE_SEED, 7, "cpu")


# =======================================================================================
# python -m tests.test_fuzz --seed S --case N [--sim]
# =======================================================================================

def _explain(p: dict, device=None) -> None:
    """Prints the case, the call's result and its difference from the reference."""
    from torch_tree_attn.reference import tree_attention_reference

    built = build(p)
    print(f"case {p['index']} (seed {p['seed']}, {p['stream']}, {p['role']}):\n  {describe(p)}")
    for note in built.notes:
        print(f"  injected/mutated: {note}")
    inputs = built.inputs
    for n in ("query", "key", "value", "mask", "mask_offset"):
        t = inputs[n]
        if isinstance(t, torch.Tensor):
            print(f"  {n}: shape {list(t.shape)} stride {list(t.stride())} storage_offset {t.storage_offset()} {t.dtype}")
    if inputs["mask_offset"] is not None:
        print(f"  mask_offset values: {inputs['mask_offset'].tolist()}")
    if built.error is None:
        try:
            out, lse = _call(p, inputs if device is None else to_device(inputs, device))
            out, lse = out.cpu(), lse.cpu()
        except Exception as e:
            print(f"  the op raised {type(e).__name__}: {e}")
        else:
            calls = built.clamped or [(None, inputs)]
            for b, call in calls:
                o, l_ = (out, lse) if b is None else (out[b:b + 1], lse[b:b + 1])
                ref_out, ref_lse = tree_attention_reference(**call)
                label = "" if b is None else f" batch row {b} (as the in-range call it clamps to)"
                want_nan, got_nan = torch.isnan(ref_lse), torch.isnan(o.float()).any(-1)
                print(f"  rows{label}: {want_nan.numel()}, reference poisons {int(want_nan.sum())}, "
                      f"output has NaN in {int(got_nan.sum())}")
                for name, mism in (("NaN in output but not poisoned", got_nan & ~want_nan),
                                   ("poisoned but not NaN in output", want_nan & ~got_nan)):
                    if mism.any():
                        print(f"    {name} [b, h, i]: {mism.nonzero().tolist()[:12]}")
                clean = ~want_nan & ~got_nan
                if clean.any():
                    err = (o.double().cpu() - ref_out)[clean].abs()
                    print(f"    max |out - ref| over rows both think clean: {err.max().item():.3g}")
                    lerr = (l_.double() - ref_lse)[clean]
                    lerr = torch.where(torch.isneginf(ref_lse[clean]) & torch.isneginf(l_.double()[clean]), 0.0, lerr)
                    print(f"    max |lse - ref| over those rows: {lerr.abs().max().item():.3g}")
    failure = run_case(p, device)
    print("PASS" if failure is None else "FAIL\n" + failure)
    if failure is not None:
        print(f"reproduce: {reproducer(p)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=BASE_SEED)
    parser.add_argument("--case", type=int, help="one case: print it, run it, show the difference")
    parser.add_argument("--first", type=int, default=0, help="a range of cases from this index")
    parser.add_argument("--count", type=int, help="... this many")
    parser.add_argument("--sim", action="store_true", help="the simulator stream (tree_attn_sim)")
    parser.add_argument("--cuda", action="store_true", help="the cuda stream, batched (kernels warmed first)")
    parser.add_argument("--device", default="cuda", help="--cuda: the device to run it on (cpu: a CPU check)")
    args = parser.parse_args(argv)
    stream = "sim" if args.sim else "cuda" if args.cuda else "cpu"
    device = args.device if args.cuda else None
    if args.case is not None:
        p = draw_params(args.seed, args.case, stream)
        _explain(p, device)
        return 0 if run_case(p, device) is None else 1
    count = args.count if args.count is not None else {"cpu": N_CPU, "sim": N_SIM, "cuda": N_CUDA}[stream]
    indices = range(args.first, args.first + count)
    if args.cuda:
        if torch.device(device).type == "cuda":
            specs, compiled, warm_s = warm_cuda(indices, args.seed)
            run_batched(stream, indices[:2 * GROUP], device, args.seed)  # loads every kernel once
            print(f"warm: {specs} kernel specs, {compiled} compiled outside the prebuilt table ({warm_s:.1f} s)")
        start = time.perf_counter()
        failures, ran = run_batched(stream, indices, device, args.seed)
    else:
        start = time.perf_counter()
        failures, ran = run_range(stream, indices, args.seed), count
    seconds = time.perf_counter() - start
    for f in failures:
        print(f, end="\n\n")
    print(f"{len(failures)} of {ran} {stream} cases failed ({seconds:.1f} s, {ran / max(seconds, 1e-9):.0f} cases/s"
          + (f" on {device}" if device else "") + ")")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
