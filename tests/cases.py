"""The op contract's parity matrix and non-finite table, shared by every backend's tests
(tests/test_contract.py runs them on each backend of tests/backends.py; the fuzzer and the
GPU scripts use them too).

A `Case` describes one call; `make_inputs` builds its tensors with NaN in every cache
slot the contract says is never read; `check_against_reference` compares a backend's
output with the float64 reference.
"""
import dataclasses
import itertools
import math
import random
from typing import Optional

import torch

from torch_tree_attn.reference import dense_bias, tree_attention_reference
from torch_tree_attn.tree import ancestor_mask

# The op's positional argument order (README, "The op contract").
ARG_ORDER = ("query", "key", "value", "mask", "mask_offset", "scale", "softcap", "sinks")


def args_of(inputs: dict) -> tuple:
    """The op's positional arguments from an inputs dict (absent optional ones are None)."""
    return tuple(inputs.get(name) for name in ARG_ORDER)


DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (query dtype, key/value dtype): one dtype, or a float32 query over half K/V.
DTYPE_PAIRS = tuple((t, t) for t in DTYPES) + ((torch.float32, torch.float16), (torch.float32, torch.bfloat16))
HEAD_DIMS = (64, 96, 128, 256, 512)

# Output error is bounded by the inputs' rounding (q/k/v are stored in `dtype`, the
# reference sees exactly those values) plus float32 accumulation and the rounding of
# the result to `dtype`.
TOLERANCE = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
LSE_TOLERANCE = dict(atol=1e-4, rtol=1e-5)


@dataclasses.dataclass(frozen=True)
class Case:
    B: int = 1
    Hq: int = 4
    Hkv: int = 1
    T: int = 5
    S: int = 48
    D: int = 64
    dtype: torch.dtype = torch.float32          # the query's (and output's)
    kv_dtype: Optional[torch.dtype] = None      # key/value; None: the query's
    # "bool", "float" (0 / -inf bias plus small finite biases), "float_min" (finfo.min as
    # the masked value, in the query dtype, as Hugging Face builds it)
    mask_kind: str = "bool"
    # "compact": M = T tree window after a prefix; "dense": M = S with offsets 0;
    # "empty": M = 0, prefix only
    window: str = "compact"
    # "none" (mask_offset=None), "same", "varied" (different per batch row)
    offsets: str = "varied"
    # "contiguous" [B, Hkv, S, D] or "bshd" ([B, S, Hkv, D] storage passed transposed)
    kv_layout: str = "contiguous"
    # "none" full [B, Hq, T, M]; "batch" [1, T, M]; "heads" [B, 1, T, M]; "3d" [B, T, M]
    mask_shape: str = "3d"
    softcap: Optional[float] = None
    scale: Optional[float] = None
    offset_dtype: torch.dtype = torch.int64
    # attention sinks: None, or the dtype of a random [Hq] sinks tensor (one head's sink -inf)
    sinks: Optional[torch.dtype] = None
    seed: int = 0

    @property
    def M(self) -> int:
        return {"compact": self.T, "dense": self.S, "empty": 0}[self.window]

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.dtype if self.kv_dtype is None else self.kv_dtype

    def __str__(self):
        dtype = str(self.dtype).replace("torch.", "")
        if self.kv_dtype not in (None, self.dtype):
            dtype += "-over-" + str(self.kv_dtype).replace("torch.", "")
        parts = [f"B{self.B}", f"H{self.Hq}/{self.Hkv}", f"T{self.T}", f"S{self.S}", f"D{self.D}",
                 dtype, self.mask_kind, self.window, f"off-{self.offsets}",
                 self.kv_layout, f"mask-{self.mask_shape}"]
        if self.softcap is not None:
            parts.append(f"cap{self.softcap}")
        if self.scale is not None:
            parts.append(f"scale{self.scale}")
        if self.sinks is not None:
            parts.append("sinks-" + str(self.sinks).replace("torch.", ""))
        return "-".join(parts)


def random_tree_mask(T: int, gen: torch.Generator) -> torch.Tensor:
    """Ancestor-or-self mask of a random tree whose nodes are ordered parents first."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, T)]
    return ancestor_mask(torch.tensor(parents))


def tree_inputs(B=1, Hq=4, Hkv=1, T=8, prefix=(40,), D=64, dtype=torch.float32, S=None, seed=0):
    """Compact tree form: prefix_b committed keys, then T tree keys, NaN after them."""
    gen = torch.Generator().manual_seed(seed)
    S = S if S is not None else max(prefix) + T
    q = torch.randn(B, Hq, T, D, generator=gen).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=gen).to(dtype)
    for b, off in enumerate(prefix):
        k[b, :, off + T:] = float("nan")
        v[b, :, off + T:] = float("nan")
    mask = torch.stack([random_tree_mask(T, gen) for _ in range(B)])
    off = torch.tensor(prefix, dtype=torch.int64)
    return dict(query=q, key=k, value=v, mask=mask, mask_offset=off, scale=None, softcap=None)


def _offsets(case: Case, gen: torch.Generator) -> Optional[torch.Tensor]:
    if case.window == "dense" or case.offsets == "none":
        return None
    hi = case.S - case.M
    if case.offsets == "same":
        vals = [hi // 2] * case.B
    else:
        # Cover the edges: an empty prefix and a window ending exactly at S.
        vals = [int(torch.randint(0, hi + 1, (1,), generator=gen)) for _ in range(case.B)]
        if case.B >= 2:
            vals[0], vals[1] = 0, hi
    return torch.tensor(vals, dtype=case.offset_dtype)


def make_inputs(case: Case, device="cpu") -> dict:
    """Tensors for one call; every key slot at or beyond off_b + M holds NaN."""
    gen = torch.Generator().manual_seed(case.seed)
    B, Hq, Hkv, T, S, D, M = case.B, case.Hq, case.Hkv, case.T, case.S, case.D, case.M
    query = torch.randn(B, Hq, T, D, generator=gen).to(case.dtype)
    kv = case.cache_dtype
    if case.kv_layout == "bshd":
        key = torch.randn(B, S, Hkv, D, generator=gen).to(kv).transpose(1, 2)
        value = torch.randn(B, S, Hkv, D, generator=gen).to(kv).transpose(1, 2)
    else:
        key = torch.randn(B, Hkv, S, D, generator=gen).to(kv)
        value = torch.randn(B, Hkv, S, D, generator=gen).to(kv)

    offsets = _offsets(case, gen)
    offs = [0] * B if offsets is None else offsets.tolist()
    for b, off in enumerate(offs):
        key[b, :, off + M:] = float("nan")
        value[b, :, off + M:] = float("nan")

    # Window visibility: a tree for compact windows, a causal-plus-random mask for dense.
    mb = 1 if case.mask_shape == "batch" else B
    mh = Hq if case.mask_shape == "none" else 1
    if case.window == "compact":
        vis = torch.stack([random_tree_mask(T, gen) for _ in range(mb * mh)]).view(mb, mh, T, M)
    else:
        vis = torch.rand(mb, mh, T, M, generator=gen) < 0.6
    if T > 1 and M > 0 and case.mask_kind != "float_min":
        # One row that sees nothing in the window. Not with finfo.min masks: a row whose
        # every key carries finfo.min is not empty but a softmax over scores quantised by
        # the huge bias, which no float32 kernel reproduces.
        vis[..., -1, :] = False
    if case.mask_kind == "bool":
        mask = vis
    else:
        fill = torch.finfo(case.dtype).min if case.mask_kind == "float_min" else -math.inf
        bias = torch.randn(vis.shape, generator=gen) * 0.5
        mask = torch.where(vis, bias, torch.tensor(fill)).to(case.dtype if case.mask_kind == "float_min" else torch.float32)
    if case.mask_shape in ("3d", "batch"):
        mask = mask[:, 0]
    sinks = None
    if case.sinks is not None:
        # Sinks comparable to the scores (so they matter), one head without a sink.
        sinks = torch.randn(Hq, generator=gen) * 2.0 + 1.0
        sinks[Hq // 2] = -math.inf
        sinks = sinks.to(case.sinks).to(device)
    query, key, value, mask = (t.to(device) for t in (query, key, value, mask))
    return dict(query=query, key=key, value=value, mask=mask,
                mask_offset=None if offsets is None else offsets.to(device),
                scale=case.scale, softcap=case.softcap, sinks=sinks)


def check_against_reference(out: torch.Tensor, lse: Optional[torch.Tensor], inputs: dict) -> None:
    """out (and lse, if given) against the float64 reference: equal within the dtype's
    tolerance; NaN exactly in the rows the contract poisons (every element of them), 0 and
    the lse of no key (-inf, or the head's sink) exactly in the rows that see no key."""
    q = inputs["query"]
    ref_out, ref_lse = tree_attention_reference(**inputs)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    out = out.detach().cpu()
    poisoned = torch.isnan(ref_lse)
    got_nan = torch.isnan(out)
    assert torch.equal(got_nan.any(dim=-1), poisoned), (
        f"NaN rows {got_nan.any(dim=-1).nonzero().tolist()} != rows that see a non-finite value "
        f"{poisoned.nonzero().tolist()}")
    assert got_nan[poisoned].all(), "a poisoned row must be NaN in every element"
    clean = ~poisoned
    # float32 rounding of a score is relative to sum_d |q_d k_d|, and a score's error
    # becomes the same relative error of its softmax weight: rows with large scores (D =
    # 512, a large scale) get a wider absolute bound, row by row.
    tol = TOLERANCE[q.dtype]
    atol = tol["atol"] + 4 * 2.0**-24 * score_magnitude(inputs)[..., None]
    want = ref_out.to(q.dtype).double()
    excess = ((out.double() - want).abs() - atol - tol["rtol"] * want.abs())[clean]
    assert excess.numel() == 0 or excess.max() <= 0, (
        f"output differs from the reference beyond tolerance at {excess.argmax().item()} of {excess.numel()}: "
        f"max |out - ref| {(out.double() - want).abs()[clean].max().item():.3g} (atol {tol['atol']} + score term, "
        f"rtol {tol['rtol']})")
    if lse is not None:
        assert lse.shape == q.shape[:-1] and lse.dtype == torch.float32
        lse = lse.detach().cpu().double()
        assert torch.equal(torch.isnan(lse), poisoned), "lse must be NaN exactly in the poisoned rows"
        empty = torch.isneginf(ref_lse)
        assert torch.equal(torch.isneginf(lse), empty), "rows that see no key (and no sink) must give lse -inf"
        assert (out[empty] == 0).all(), "rows that see no key must give output 0"
        if inputs.get("sinks") is not None:
            # A row that sees no key: output 0 and lse = its head's sink, exactly.
            sink = inputs["sinks"].detach().cpu().float().double()[None, :, None].expand_as(lse)
            sees_none = _sees_no_key(inputs) & clean
            assert (out[sees_none] == 0).all(), "rows that see no key must give output 0"
            assert torch.equal(lse[sees_none], sink[sees_none]), "rows that see no key must give lse = sink"
        lse_tol = dict(LSE_TOLERANCE)
        if q.dtype != torch.float32:
            lse_tol = dict(atol=2e-3, rtol=1e-3)
        ok = clean & ~empty
        torch.testing.assert_close(lse[ok], ref_lse[ok], **lse_tol)


def score_magnitude(inputs: dict) -> torch.Tensor:
    """float64 [B, Hq, T]: per row, the largest scale * sum_d |q_d k_d| over the keys it
    sees, times the largest |v| among them (at least 1): what float32 rounding of its
    scores is relative to."""
    q, k, v = (inputs[n].detach().cpu().double() for n in ("query", "key", "value"))
    B, Hq, T, D = q.shape
    S = k.shape[2]
    if q.numel() == 0 or S == 0:
        return torch.zeros(B, Hq, T, dtype=torch.float64)
    G = Hq // k.shape[1]
    finite = lambda t: torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0).abs()  # noqa: E731
    q, k, v = finite(q), finite(k).repeat_interleave(G, dim=1), finite(v).repeat_interleave(G, dim=1)
    scale = D ** -0.5 if inputs.get("scale") is None else abs(inputs["scale"])
    seen = ~torch.isneginf(dense_bias(inputs["mask"], inputs["mask_offset"], B, Hq, T, S))
    mag = torch.where(seen, q @ k.transpose(-1, -2) * scale, 0.0).amax(dim=-1)
    vmax = torch.where(seen, v.amax(dim=-1)[:, :, None, :], 0.0).amax(dim=-1)
    return mag * vmax.clamp(min=1.0)


def _sees_no_key(inputs: dict) -> torch.Tensor:
    """bool [B, Hq, T]: rows with no prefix key and no window key visible."""
    B, Hq, T = inputs["query"].shape[:3]
    offs = torch.zeros(B) if inputs["mask_offset"] is None else inputs["mask_offset"].cpu()
    return (offs[:, None, None] == 0) & ~_seen_window(inputs).any(dim=-1)


def parity_matrix() -> list:
    """The contract's matrix: every dtype x D x GQA ratio x T x mask kind x window (a
    float32 query over half K/V with fewer GQA x T shapes), with the remaining dimensions
    (offsets, K/V layout, mask broadcast, softcap, scale, sinks) rotated through so each
    value meets each dtype pair, D and mask kind (5 rotations against 4 mask kinds)."""
    cases = []
    rotate = itertools.cycle([
        dict(offsets="varied", kv_layout="contiguous", mask_shape="3d"),
        dict(offsets="same", kv_layout="bshd", mask_shape="none", softcap=20.0, sinks=torch.bfloat16),
        dict(offsets="none", kv_layout="contiguous", mask_shape="batch", offset_dtype=torch.int32),
        dict(offsets="varied", kv_layout="bshd", mask_shape="heads", scale=0.07),
        dict(offsets="varied", kv_layout="contiguous", mask_shape="none", sinks=torch.float32),
    ])
    rng = random.Random(1234)
    seed = 0
    shapes = list(itertools.product((1, 4, 8), (1, 5, 64, 100)))
    mixed_shapes = [(1, 5), (4, 64), (8, 1), (4, 100)]
    for (dtype, kv_dtype), D in itertools.product(DTYPE_PAIRS, HEAD_DIMS):
        for G, T in (shapes if dtype == kv_dtype else mixed_shapes):
            for mask_kind, window in (("bool", "compact"), ("float", "dense"), ("float_min", "compact"),
                                      (rng.choice(["bool", "float"]), "empty")):
                extra = dict(next(rotate))
                Hkv = rng.choice([1, 2]) if G * T <= 256 else 1
                B = 2 if T <= 64 else 1
                S = T + rng.choice([0, 3, 37, 70]) if window != "empty" else rng.choice([1, 33, 70])
                if window == "dense":
                    S = max(S, T)
                seed += 1
                cases.append(Case(B=B, Hq=G * Hkv, Hkv=Hkv, T=T, S=S, D=D, dtype=dtype, kv_dtype=kv_dtype,
                                  mask_kind=mask_kind, window=window, seed=seed, **extra))
    return cases


# ---------------------------------------------------------------------------------------
# Non-finite values (README, "Non-finite values"): a row is poisoned (NaN output, NaN lse)
# exactly when something it sees is not finite; what it does not see never matters.

NONFINITE_KINDS = (
    "query_nan", "query_inf",              # one query element
    "prefix_key_nan", "prefix_value_inf",  # a prefix key/value element: every row of its kv head
    "window_key_inf", "window_value_nan",  # a window key some rows see and others don't
    "masked_key_nan", "masked_value_inf",  # a window key no row sees: harmless
    "bias_nan", "bias_inf",                # a seen float-mask entry (float masks only)
    "sink_nan", "sink_inf",                # one head's sink: every row of that head
    "prefix_key_inf",                      # an infinite prefix key element: raw scores +inf and
)                                          # -inf alike (last: keeps the rotation of the others)


def _seen_window(inputs: dict) -> torch.Tensor:
    """bool [B, Hq, T, M]: which window entries the mask lets each row see."""
    mask = inputs["mask"]
    mask = mask[:, None] if mask.dim() == 3 else mask
    B, Hq, T = inputs["query"].shape[:3]
    mask = mask.expand(B, Hq, T, mask.shape[-1])
    return mask if mask.dtype == torch.bool else ~torch.isneginf(mask.float())


def inject_nonfinite(inputs: dict, kind: str, seed: int = 0) -> bool:
    """Puts one non-finite value of `kind` into `inputs` (in place). Returns False when the
    case has no place for it (e.g. no prefix, or a bool mask for a bias kind)."""
    rng = random.Random(seed)
    q, k, v, mask = inputs["query"], inputs["key"], inputs["value"], inputs["mask"]
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    M = mask.shape[-1]
    offs = [0] * B if inputs["mask_offset"] is None else [int(o) for o in inputs["mask_offset"]]
    bad = {"nan": math.nan, "inf": math.inf}[kind.rsplit("_", 1)[1]]
    d = rng.randrange(D)
    if kind.startswith("query"):
        q[rng.randrange(B), rng.randrange(Hq), rng.randrange(T), d] = bad
        return True
    if kind.startswith("sink"):
        if inputs.get("sinks") is None:
            return False
        inputs["sinks"][rng.randrange(Hq)] = bad
        return True
    if kind.startswith("prefix"):
        rows = [b for b in range(B) if offs[b] > 0]
        if not rows:
            return False
        b = rng.choice(rows)
        target = k if "key" in kind else v
        target[b, rng.randrange(Hkv), rng.randrange(offs[b]), d] = -bad if rng.random() < 0.5 else bad
        return True
    if M == 0:
        return False
    seen = _seen_window(inputs)  # [B, Hq, T, M]
    if kind.startswith("bias"):
        if mask.dtype == torch.bool:
            return False
        spots = seen.nonzero().tolist()
        if not spots:
            return False
        b, h, t, col = rng.choice(spots)
        index = [min(b, mask.shape[0] - 1)] + ([min(h, mask.shape[1] - 1)] if mask.dim() == 4 else []) + [t, col]
        mask[tuple(index)] = bad
        return True
    # Window keys, per (batch row, kv head): how many of its G * T rows see each column.
    per_head = seen.reshape(B, Hkv, G * T, M).sum(dim=2)
    want_masked = kind.startswith("masked")
    spots = [(b, h, col) for b in range(B) for h in range(Hkv) for col in range(M)
             if (per_head[b, h, col] == 0) == want_masked and (want_masked or per_head[b, h, col] < G * T)]
    if not spots:
        return False
    b, h, col = rng.choice(spots)
    target = k if "key" in kind else v
    target[b, h, offs[b] + col, d] = bad
    return True


def check_clamped_offsets(run, offset_dtype: torch.dtype) -> None:
    """Backends that never read offsets on the host (MPS, CUDA) clamp each to [0, S] and
    read no key outside [0, S): a negative offset acts as 0; one past S makes the whole
    cache the prefix and leaves no window. `run(inputs) -> (out, lse)` on CPU tensors."""
    case = Case(B=2, Hq=4, Hkv=1, T=5, S=40, D=64, offsets="same", seed=302)
    inputs = make_inputs(case)
    gen = torch.Generator().manual_seed(7)
    # No NaN slots here: with these offsets every key may legitimately be read.
    inputs["key"] = torch.randn(inputs["key"].shape, generator=gen)
    inputs["value"] = torch.randn(inputs["value"].shape, generator=gen)
    inputs["mask_offset"] = torch.tensor([-5, 1000], dtype=offset_dtype)
    out, lse = run(inputs)

    def row(b, **overrides):
        one = {n: t[b:b + 1] if isinstance(t, torch.Tensor) else t for n, t in inputs.items()}
        return tree_attention_reference(**dict(one, **overrides))

    ref_out, ref_lse = row(0, mask_offset=torch.tensor([0]))
    torch.testing.assert_close(out[:1].double(), ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse[:1].double(), ref_lse, atol=1e-4, rtol=1e-5)
    ref_out, ref_lse = row(1, mask_offset=torch.tensor([case.S]), mask=inputs["mask"][1:, :, :0])
    torch.testing.assert_close(out[1:].double(), ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse[1:].double(), ref_lse, atol=1e-4, rtol=1e-5)


def check_empty_problem(device: str) -> None:
    """A GPU backend (CUDA, MPS) answers a query of no rows with empty outputs on its device."""
    q = torch.randn(1, 4, 0, 64, device=device)
    kv = torch.randn(1, 2, 10, 64, device=device)
    mask = torch.ones(1, 0, 3, dtype=torch.bool, device=device)
    out, lse = torch.ops.tree_attn.forward_with_lse(q, kv, kv, mask, None, None, None)
    assert out.shape == (1, 4, 0, 64) and lse.shape == (1, 4, 0) and out.device.type == device


def check_validation_errors(device: str):
    """The errors a GPU backend (CUDA, MPS) raises for arguments the op refuses on every
    device, each naming the argument; returns (q, kv, mask) on the device (q: 1x4x5x64, kv:
    1x2x10x64, mask: 1x5x5 bool) for the backend's own checks."""
    import pytest  # (this module serves scripts without pytest too: tests/gpu_hopper_check.py)

    q = torch.randn(1, 4, 5, 64, device=device)
    kv = torch.randn(1, 2, 10, 64, device=device)
    mask = torch.ones(1, 5, 5, dtype=torch.bool, device=device)
    forward = torch.ops.tree_attn.forward
    with pytest.raises(ValueError, match="mask_offset must be on the query's device"):
        forward(q, kv, kv, mask, torch.tensor([0]), None, None)
    with pytest.raises(ValueError, match="head dim"):
        forward(q[..., :32], kv[..., :32], kv[..., :32], mask, None, None, None)
    return q, kv, mask


def check_sliced_inputs(device: str) -> None:
    """A GPU backend (CUDA, MPS) reads tensors that start inside their storage
    (storage_offset != 0) from that offset: query, key, value, mask and offsets are each a
    slice of a larger tensor on the device; binding them at 0 would read the wrong rows."""
    case = Case(B=2, Hq=8, Hkv=2, T=6, S=50, D=96, dtype=torch.float32, mask_kind="float", seed=303)
    inputs = make_inputs(case)
    pad = 3
    sliced = {}
    for name in ("query", "key", "value"):
        t = inputs[name]
        big = torch.randn(t.shape[0], t.shape[1], t.shape[2] + pad, t.shape[3], dtype=t.dtype)
        big[:, :, pad:] = t
        sliced[name] = big.to(device)[:, :, pad:]
        assert sliced[name].storage_offset() != 0
    big_mask = torch.zeros(inputs["mask"].shape[0] + 1, *inputs["mask"].shape[1:], dtype=inputs["mask"].dtype)
    big_mask[1:] = inputs["mask"]
    sliced["mask"] = big_mask.to(device)[1:]
    # int32, so the offsets reach the kernel as given (MPS would convert int64 ones to a fresh tensor).
    sliced["mask_offset"] = torch.cat([torch.tensor([99]), inputs["mask_offset"]]).int().to(device)[1:]
    sliced.update(scale=None, softcap=None)
    assert sliced["mask"].storage_offset() != 0 and sliced["mask_offset"].storage_offset() != 0
    out, lse = torch.ops.tree_attn.forward_with_lse(*args_of(sliced))
    check_against_reference(out.cpu(), lse.cpu(), inputs)


def check_nonfinite_case(case: Case, kind: str, run) -> None:
    """One `nonfinite_cases()` pair through a backend: `run(inputs) -> (out, lse)` must put
    NaN exactly in the rows the reference poisons, and the injection must be meaningful."""
    inputs = make_inputs(case)
    assert inject_nonfinite(inputs, kind, case.seed), f"{kind} has no place in {case}"
    out, lse = run(inputs)
    check_against_reference(out, lse, inputs)
    ref_out, _ = tree_attention_reference(**inputs)
    poisoned = torch.isnan(ref_out).any(dim=-1)
    if kind.startswith("masked"):
        assert not poisoned.any(), "a key no row sees must not poison anything"
    else:
        assert poisoned.any() and not poisoned.all() or kind.startswith(("prefix", "query")), \
            "the injection must poison some rows and spare others"


def nonfinite_cases() -> list:
    """(case, kind) pairs: every kind over each dtype, mask kind and window, with splits."""
    pairs = []
    seed = 5000
    shapes = [
        dict(B=2, Hq=4, Hkv=2, T=5, S=40, D=64),
        dict(B=2, Hq=8, Hkv=1, T=16, S=300, D=128, kv_layout="bshd"),
        dict(B=1, Hq=2, Hkv=1, T=7, S=1500, D=96, softcap=30.0),   # long prefix: key splits
    ]
    for i, kind in enumerate(NONFINITE_KINDS):
        for j, dtype in enumerate(DTYPES):
            shape = shapes[(i + j) % len(shapes)]
            mask_kind = "float" if kind.startswith("bias") or (i + j) % 2 else "bool"
            window = "dense" if (i + 2 * j) % 3 == 0 and not kind.startswith("prefix") else "compact"
            seed += 1
            # Sinks in the sink kinds and in every other case of the rest.
            sinks = torch.float32 if kind.startswith("sink") or (i + j) % 2 else None
            pairs.append((Case(dtype=dtype, mask_kind=mask_kind, window=window, seed=seed, sinks=sinks, **shape),
                          kind))
    return pairs


# ---------------------------------------------------------------------------------------
# Extremes every backend must get right: softcap at any cap, and finite inputs near the
# top of float32's range (the contract: finite in, finite and correct out).

SOFTCAPS = (1.0, 30.0, 1e4, 1e5, 1e7)


def check_softcap_at_any_cap(run, softcap: float, scale: Optional[float], device="cpu") -> None:
    """cap * tanh(s / cap) keeps float32 relative accuracy at every cap (an absolute error
    of tanh near 0 would be multiplied by the cap), in prefix tiles (several of them) and
    window tiles alike; the scores are checked through lse at float32 accuracy."""
    case = Case(B=2, Hq=8, Hkv=2, T=16, S=720, D=64, mask_kind="bool", seed=17, softcap=softcap, scale=scale)
    inputs = make_inputs(case, device)
    out, lse = run(inputs)
    check_against_reference(out, lse, inputs)
    _, ref_lse = tree_attention_reference(**inputs)
    lse = lse.detach().cpu().double()
    seen = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[seen], ref_lse[seen], atol=2e-5, rtol=2e-5)


def _huge_inputs(device, *, S=300, T=6, mask_kind="float", seed=23):
    """A small float32 tree problem (one kv head, 4 query heads, a prefix of (S - T) // 2
    keys, NaN in the cache past the tree)."""
    return make_inputs(Case(B=1, Hq=4, Hkv=1, T=T, S=S, D=64, mask_kind=mask_kind, offsets="same", seed=seed),
                       device)


def plant_huge_score(inputs: dict, where: str, value: float, scale: float) -> int:
    """Gives row (head 1, node 3) of a B=1, Hkv=1 problem (offset past 37) a huge score
    `value` for one key, a prefix key (37) for where="prefix", the tree's root for "window";
    returns that key. scale * q.k = value exactly, q.k itself finite: q = (1, 0, ...), k =
    (value / scale, 0, ...) as the cache's dtype rounds it. The other rows' first dim is 0,
    so their scores stay ordinary. Sets inputs["scale"]."""
    q, k = inputs["query"], inputs["key"]
    off = int(inputs["mask_offset"][0])
    key = 37 if where == "prefix" else off
    inputs["scale"] = scale
    q[..., 0] = 0.0
    q[0, 1, 3] = 0.0
    q[0, 1, 3, 0] = 1.0
    k[0, 0, key] = 0.0
    k[0, 0, key, 0] = value / scale
    return key


def _expect_one_hot(out, lse, inputs, rows, key, top_score, others_must_match=True):
    """Rows (h, i) whose score for `key` (top_score, finite and huge) dwarfs every other:
    output = V[key] and lse = top_score, both to float32; the other rows match the
    reference."""
    v = inputs["value"][0, 0, key].detach().cpu().double()
    out_c, lse_c = out.detach().cpu().double(), lse.detach().cpu().double()
    assert torch.isfinite(out_c).all() and torch.isfinite(lse_c).all(), "finite inputs gave a non-finite result"
    for h, i in rows:
        torch.testing.assert_close(out_c[0, h, i], v, atol=1e-6, rtol=1e-6)
        assert abs(lse_c[0, h, i].item() - top_score) <= 1e-6 * abs(top_score), (lse_c[0, h, i].item(), top_score)
    if others_must_match:
        ref_out, ref_lse = tree_attention_reference(**inputs)
        keep = torch.ones_like(ref_lse, dtype=torch.bool)
        for h, i in rows:
            keep[0, h, i] = False
        torch.testing.assert_close(out_c[keep], ref_out[keep], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse_c[keep], ref_lse[keep], atol=1e-4, rtol=1e-5)


def extreme_finite_checks(run, device="cpu"):
    """(name, check) pairs: sinks, biases and scores of finite magnitude up to float32's
    max, in prefix and window keys, each giving the contract's finite answer."""
    FMAX = torch.finfo(torch.float32).max

    def sink(value):
        def check():
            inputs = _huge_inputs(device)
            sinks = torch.zeros(4, device=device)
            sinks[1] = value
            inputs["sinks"] = sinks
            out, lse = run(inputs)
            if value > 0:
                # The huge sink takes all the weight of head 1: lse is the sink exactly.
                lse_c = lse.detach().cpu()
                assert torch.equal(lse_c[0, 1], sinks[1].cpu().expand_as(lse_c[0, 1])), lse_c[0, 1]
            _expect_one_hot(out, lse, inputs, [], 0, 0.0)
        return check

    def bias(value):
        def check():
            inputs = _huge_inputs(device)
            mask = inputs["mask"]      # [1, T, T] float32 bias, -inf where unseen
            # Row 2 sees window key 0 (its tree's root) with a huge bias; rows 3 and 4 too.
            for i in (2, 3, 4):
                mask[0, i, 0] = value
            out, lse = run(inputs)
            key = inputs["mask_offset"][0].item()
            if value > 0:
                qk = (inputs["query"][0, :, :, :].double() @ inputs["key"][0, 0, key].double()) * 64 ** -0.5
                rows = [(h, i) for h in range(4) for i in (2, 3, 4)]
                # lse = bias + score for key 0 (the score is ~1, below the bias's ulp).
                _expect_one_hot(out, lse, inputs, rows, key, value + qk[0, 2].item())
            else:
                _expect_one_hot(out, lse, inputs, [], key, 0.0)
        return check

    def score(value, where, scale=1.0):
        def check():
            inputs = _huge_inputs(device, mask_kind="bool")
            key = plant_huge_score(inputs, where, value, scale)   # row (head 1, node 3) sees the key
            out, lse = run(inputs)
            _expect_one_hot(out, lse, inputs, [(1, 3)] if value > 0 else [], key, value)
        return check

    return [
        ("sink+2.5e38", sink(2.5e38)), ("sink+FMAX", sink(FMAX)), ("sink-3e38", sink(-3e38)),
        ("bias+3e38", bias(3e38)), ("bias-3e38", bias(-3e38)),
        ("score+2.88e38-prefix", score(2.88e38, "prefix")), ("score+2.88e38-window", score(2.88e38, "window")),
        ("score+2.88e38-scaled-prefix", score(2.88e38, "prefix", scale=2.0)),
        ("score-2.88e38-prefix", score(-2.88e38, "prefix")), ("score-2.88e38-window", score(-2.88e38, "window")),
        ("score+FMAX-prefix", score(FMAX, "prefix")),
    ]
