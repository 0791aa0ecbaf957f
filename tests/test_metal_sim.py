"""The Metal shaders, run by the CPU simulator with the MPS backend's launch plan.

Everything here goes through ``torch.ops.tree_attn_sim.forward_with_lse`` (the test-only
simulator extension, tests/sim): the
real shader source, translated to C++, executed threadgroup by threadgroup with lock-step
simdgroups, NaN-poisoned threadgroup memory and bounds-checked device buffers. Every call
also checks the device bytes each launch read and wrote against the plan's traffic model
(the op fails otherwise); ``tree_attn_sim.traffic`` returns both figures for the tests below.
The contract's tables (parity matrix, forward vs forward_with_lse, bad inputs, non-finite
values) run here as tests/test_contract.py's sim and sim-vector items; this file holds the
simulator's own tests: plans, families, key splits, traffic, offsets clamping.
"""
import contextlib
import json
import math

import pytest
import torch

import torch_tree_attn  # noqa: F401  (registers the ops)
import torch_tree_attn_sim  # noqa: F401  (registers the simulator's ops: pip install ./tests/sim)
from tests.cases import (SOFTCAPS, check_softcap_at_any_cap, extreme_finite_checks, args_of, Case, check_against_reference,
                         check_nonfinite_case, DTYPE_PAIRS, make_inputs, NONFINITE_KINDS, parity_matrix)
from torch_tree_attn.reference import tree_attention_reference

ops = torch.ops.tree_attn_sim



def sim(inputs):
    return ops.forward_with_lse(*args_of(inputs))


def plan_of(inputs):
    return json.loads(ops.launch_plan(*args_of(inputs)))


def traffic_of(inputs):
    return json.loads(ops.traffic(*args_of(inputs)))


@contextlib.contextmanager
def kernel_family(name):
    """Forces the main kernel family ("vector": v1, "matrix": v2) of every plan inside (the
    plan's internal override, through the simulator)."""
    previous = ops.set_kernel_family(name)
    try:
        yield
    finally:
        ops.set_kernel_family(previous)


MATRIX = parity_matrix()

# Long prefixes: S large enough that the plan splits the keys across threadgroups, with
# offsets that end the visible range inside a split and inside a chunk.
SPLIT_CASES = [
    Case(B=2, Hq=2, Hkv=1, T=5, S=1100, D=64, dtype=torch.float32, mask_kind="bool", seed=101),
    Case(B=2, Hq=4, Hkv=2, T=3, S=900, D=96, dtype=torch.float16, mask_kind="float", seed=102,
         kv_layout="bshd", mask_shape="none", softcap=30.0),
    Case(B=1, Hq=8, Hkv=1, T=4, S=1000, D=128, dtype=torch.bfloat16, mask_kind="float", window="dense",
         offsets="none", seed=103),
    Case(B=2, Hq=1, Hkv=1, T=2, S=700, D=256, dtype=torch.float32, mask_kind="bool", window="empty", seed=104),
    # D = 512 in float32: the K/V tile is staged in two slices of the head dim.
    Case(B=1, Hq=2, Hkv=1, T=3, S=600, D=512, dtype=torch.float32, mask_kind="float", seed=105),
    Case(B=1, Hq=2, Hkv=2, T=2, S=560, D=512, dtype=torch.bfloat16, mask_kind="bool", offsets="same", seed=106),
    # Sinks merged in the reduce pass after several splits.
    Case(B=2, Hq=4, Hkv=2, T=4, S=900, D=64, dtype=torch.float16, mask_kind="bool", sinks=torch.float32, seed=107),
    Case(B=1, Hq=4, Hkv=1, T=3, S=800, D=128, dtype=torch.float32, mask_kind="float", sinks=torch.bfloat16,
         softcap=20.0, seed=108),
    # A float32 query over a half-precision cache.
    Case(B=2, Hq=4, Hkv=2, T=4, S=1000, D=128, dtype=torch.float32, kv_dtype=torch.float16, mask_kind="float",
         kv_layout="bshd", seed=109),
    Case(B=1, Hq=4, Hkv=1, T=5, S=700, D=256, dtype=torch.float32, kv_dtype=torch.bfloat16, mask_kind="bool",
         sinks=torch.float32, seed=110),
]


@pytest.mark.parametrize("family", ["vector", "matrix"])
@pytest.mark.parametrize("case", SPLIT_CASES, ids=str)
def test_long_prefix_split_across_threadgroups(case, family):
    inputs = make_inputs(case)
    with kernel_family(family):
        plan = plan_of(inputs)
        assert plan["n_splits"] >= 4, plan
        assert plan["family"] == family
        out, lse = sim(inputs)
    check_against_reference(out, lse, inputs)


# ---------------------------------------------------------------------------------------
# The plan's choice of main kernel: matrix (v2) where a kv head has more than 8 rows,
# vector (v1) elsewhere; both exist at every D.
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("case, family", [
    (Case(B=2, Hq=4, Hkv=4, T=5, S=70, D=64, seed=51), "vector"),                         # G*T = 5
    (Case(B=1, Hq=2, Hkv=1, T=4, S=90, D=128, dtype=torch.float16, mask_kind="float", seed=52), "vector"),  # 8
    (Case(B=1, Hq=2, Hkv=1, T=5, S=90, D=128, dtype=torch.bfloat16, seed=53), "matrix"),  # 10
    (Case(B=1, Hq=4, Hkv=1, T=20, S=120, D=512, dtype=torch.float16, seed=54), "matrix"),  # 80: 16 simdgroups
    (Case(B=2, Hq=2, Hkv=1, T=4, S=60, D=512, dtype=torch.float32, mask_kind="float", seed=56), "vector"),  # 8
    (Case(B=2, Hq=8, Hkv=2, T=20, S=150, D=256, dtype=torch.float32, kv_dtype=torch.bfloat16, seed=55), "matrix"),
], ids=str)
def test_the_plan_keeps_the_vector_kernel_where_the_heuristic_says(case, family):
    inputs = make_inputs(case)
    plan = plan_of(inputs)
    assert plan["family"] == family
    assert plan["block_rows"] == {"vector": 32, "matrix": 64}[family]
    assert plan["launches"][0]["kernel"].startswith({"vector": "tree_attn_main_", "matrix": "tree_attn_mma_"}[family])
    check_against_reference(*sim(inputs), inputs)


def test_matrix_kernel_scalar_loads_for_unaligned_rows():
    """K/V rows that do not start at a multiple of 4 elements: the matrix kernel loads
    them element by element (kv_aligned4 = 0); aligned ones as 4-vectors."""
    B, Hq, Hkv, T, S, D = 1, 8, 2, 6, 80, 96
    gen = torch.Generator().manual_seed(61)
    q = torch.randn(B, Hq, T, D, generator=gen, dtype=torch.float16)
    flat = torch.randn(2 * B * Hkv * S * D + 1, generator=gen).to(torch.float16)
    k = flat[1:1 + B * Hkv * S * D].view(B, Hkv, S, D)
    v = flat[1 + B * Hkv * S * D:].view(B, Hkv, S, D)
    mask = torch.rand(B, T, T, generator=gen) < 0.6
    inputs = dict(query=q, key=k, value=v, mask=mask, mask_offset=torch.tensor([S - T]), scale=None, softcap=None)
    plan = plan_of(inputs)
    assert plan["family"] == "matrix" and plan["kv_aligned4"] == 0
    check_against_reference(*sim(inputs), inputs)
    inputs["key"], inputs["value"] = k.clone(), v.clone()
    assert plan_of(inputs)["kv_aligned4"] == 1


def test_deterministic():
    inputs = make_inputs(SPLIT_CASES[0])
    first, second = sim(inputs), sim(inputs)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_every_kernel_instantiation_is_exercised():
    shipped = {name for name in ops.kernels() if name.startswith("tree_attn_")}
    # (query, K/V) pairs: one dtype, or a float32 query over a half-precision cache.
    pairs = ("f32", "f16", "bf16", "f32_f16", "f32_bf16")
    dims = (64, 96, 128, 256, 512)
    expected = {f"tree_attn_main_{t}_d{d}_{m}" for t in pairs for d in dims for m in ("bool", "float")}
    expected |= {f"tree_attn_mma_{t}_d{d}_{m}" for t in pairs for d in dims for m in ("bool", "float")}
    expected |= {f"tree_attn_reduce_{t}_d{d}" for t in ("f32", "f16", "bf16") for d in dims}
    assert len(expected) == 50 + 50 + 15
    assert shipped == expected
    # The parity matrix, with the plan's own choice of family, runs every kernel.
    used = {launch["kernel"] for case in MATRIX for launch in plan_of(make_inputs(case))["launches"]}
    assert used == shipped, f"never run: {sorted(shipped - used)}"


def test_every_name_the_plan_can_emit_is_instantiated():
    """The plan's names come from the shader's instantiation table
    (shaders/tree_attn_kernels.h): each exists in the simulator's registry, and the
    registry holds no kernel the plan cannot name."""
    names = ops.plan_kernel_names()
    assert len(names) == len(set(names)) == 115
    shipped = {name for name in ops.kernels() if name.startswith("tree_attn_")}
    assert set(names) == shipped


def test_the_family_override_is_checked():
    inputs = make_inputs(Case(D=512))
    # Both families exist at every D of the contract, so either may be forced.
    for family in ("vector", "matrix"):
        with kernel_family(family):
            assert plan_of(inputs)["family"] == family
    with pytest.raises(ValueError, match="expected 'auto', 'vector' or 'matrix'"):
        ops.set_kernel_family("v3")
    G, T = inputs["query"].shape[1] // inputs["key"].shape[1], inputs["query"].shape[2]
    assert plan_of(inputs)["family"] == ("matrix" if G * T > 8 else "vector")  # the override is reset


# ---------------------------------------------------------------------------------------
# Offsets are clamped in the kernel, never checked on the host (as on MPS).
# ---------------------------------------------------------------------------------------
def clamped_reference(inputs):
    """The contract under clamping: off = clamp(off_b, 0, S), keys [0, min(off + M, S))
    visible, window columns that fall at or past S dropped. Built as an in-range call on
    K/V padded with M zero keys whose mask columns are masked."""
    q, k, v, mask, offsets = (inputs[n] for n in ("query", "key", "value", "mask", "mask_offset"))
    B, Hkv, S, D = k.shape
    M = mask.shape[-1]
    off = offsets.long().clamp(0, S)
    pad = torch.zeros(B, Hkv, M, D, dtype=k.dtype)
    k_ext, v_ext = torch.cat([k, pad], 2), torch.cat([v, pad], 2)
    cols = torch.arange(M)
    mask_ext = mask.expand(B, *mask.shape[1:]).clone()
    for b in range(B):
        beyond = off[b] + cols >= S
        if mask.dtype == torch.bool:
            mask_ext[b, ..., beyond] = False
        else:
            mask_ext[b, ..., beyond] = -math.inf
    return tree_attention_reference(q, k_ext, v_ext, mask_ext, off, inputs["scale"], inputs["softcap"])


@pytest.mark.parametrize("kv_storage", ["exact", "nan_padded"])
@pytest.mark.parametrize("offset_dtype", [torch.int64, torch.int32])
def test_offsets_out_of_range_are_clamped(kv_storage, offset_dtype):
    B, Hq, Hkv, T, S, D = 5, 4, 2, 6, 45, 64
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(B, Hq, T, D, generator=gen)
    if kv_storage == "exact":
        # The last (b, h) row ends the allocation: a read at key S faults in the simulator.
        k = torch.randn(B, Hkv, S, D, generator=gen)
        v = torch.randn(B, Hkv, S, D, generator=gen)
    else:
        # Keys past S exist in storage but hold NaN: a read past S poisons the result.
        k = torch.randn(B, Hkv, S + 40, D, generator=gen)
        v = torch.randn(B, Hkv, S + 40, D, generator=gen)
        k[:, :, S:] = v[:, :, S:] = float("nan")
        k, v = k[:, :, :S], v[:, :, :S]
    mask = torch.rand(B, T, T, generator=gen) < 0.7
    big = 2**40 if offset_dtype == torch.int64 else 2**31 - 1
    offsets = torch.tensor([-3, S - 2, S + 5, big, 40], dtype=offset_dtype)
    inputs = dict(query=q, key=k, value=v, mask=mask, mask_offset=offsets, scale=None, softcap=None)
    out, lse = sim(inputs)
    ref_out, ref_lse = clamped_reference(inputs)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)
    # Offsets at or past S leave the window empty: the prefix is all S keys.
    plan = plan_of(inputs)
    assert plan["actual"]["visible_end"] == [T, S, S, S, min(40 + T, S)]


def test_unused_slots_hold_nan_and_the_last_chunk_is_partial():
    # Visible ends at 37 and 45: inside a 32-key chunk, followed by NaN keys.
    case = Case(B=2, Hq=4, Hkv=1, T=5, S=77, D=128, dtype=torch.float32, offsets="varied", seed=3)
    inputs = make_inputs(case)
    inputs["mask_offset"] = torch.tensor([32, 40])
    gen = torch.Generator().manual_seed(5)
    for name in ("key", "value"):
        inputs[name] = torch.randn(inputs[name].shape, generator=gen)
        for b, end in enumerate((37, 45)):
            inputs[name][b, :, end:] = float("nan")
    out, lse = sim(inputs)
    check_against_reference(out, lse, inputs)


# ---------------------------------------------------------------------------------------
# Non-finite values (README, "Non-finite values"): NaN exactly in the rows that see one.
# tests/test_contract.py runs tests/cases.py's nonfinite_cases() here as the sim (plan's
# family) and sim-vector (vector family forced) backends.
# ---------------------------------------------------------------------------------------

# D = 512 (tests.cases.nonfinite_cases has none): every kind over every dtype pair, with
# and without key splits, the plan's family (matrix: 16 simdgroups, two per 8 rows) and
# the vector kernel forced.
def _nonfinite_cases_d512():
    shapes = [dict(B=2, Hq=4, Hkv=1, T=5, S=70, D=512),
              dict(B=1, Hq=4, Hkv=2, T=6, S=600, D=512, kv_layout="bshd", softcap=25.0)]  # splits
    pairs = []
    for i, kind in enumerate(NONFINITE_KINDS):
        dtype, kv_dtype = DTYPE_PAIRS[i % len(DTYPE_PAIRS)]
        mask_kind = "float" if kind.startswith("bias") or i % 2 else "bool"
        window = "dense" if i % 3 == 0 and not kind.startswith("prefix") else "compact"
        sinks = torch.float32 if kind.startswith("sink") or i % 2 else None
        pairs.append((Case(dtype=dtype, kv_dtype=kv_dtype, mask_kind=mask_kind, window=window, seed=7000 + i,
                           sinks=sinks, **shapes[i % 2]), kind))
    return pairs


@pytest.mark.parametrize("family", ["auto", "vector"])
@pytest.mark.parametrize("case, kind", _nonfinite_cases_d512(), ids=lambda x: str(x))
def test_nonfinite_values_poison_exactly_the_rows_that_see_them_at_d512(case, kind, family):
    with kernel_family(family):
        assert plan_of(make_inputs(case))["family"] == {"auto": "matrix", "vector": "vector"}[family]
        check_nonfinite_case(case, kind, lambda inputs: sim(inputs))


def _split_of(plan, key):
    return key // plan["split_keys"]


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_nonfinite_key_in_one_split_poisons_only_the_rows_that_see_it(mask_kind):
    """Key splits: each bad value lies in one split, so a poisoned row merges one poisoned
    partial with clean ones, and rows spared by the mask merge only clean partials. NaN and
    inf also sit in keys no row sees and in keys only some rows see, in other splits."""
    B, Hq, Hkv, T, S, D = 2, 4, 2, 6, 1200, 64
    gen = torch.Generator().manual_seed(31)
    q = torch.randn(B, Hq, T, D, generator=gen)
    k = torch.randn(B, Hkv, S, D, generator=gen)
    v = torch.randn(B, Hkv, S, D, generator=gen)
    seen = torch.rand(B, Hq, T, S, generator=gen) < 0.7
    inputs = dict(query=q, key=k, value=v, mask=seen, mask_offset=None, scale=None, softcap=None)
    plan = plan_of(inputs)
    assert plan["n_splits"] >= 4, plan
    # (batch row, kv head, key, tensor, value, who sees it); the keys lie in distinct splits.
    spots = [(0, 0, 40, k, math.nan, "some"), (0, 1, 700, v, math.inf, "some"),
             (1, 1, 1150, k, -math.inf, "some"), (1, 0, 333, v, math.nan, "none"),
             (0, 0, 1000, v, math.nan, "none"), (1, 1, 520, k, math.inf, "none")]
    assert len({_split_of(plan, key) for _, _, key, *_ in spots}) == len(spots)
    G = Hq // Hkv
    for b, h, key, tensor, bad, who in spots:
        tensor[b, h, key, 5] = bad
        heads = slice(h * G, (h + 1) * G)
        if who == "none":
            seen[b, heads, :, key] = False
        else:
            seen[b, heads, :, key] = torch.rand(G, T, generator=gen) < 0.5
            seen[b, h * G, 0, key], seen[b, h * G, 1, key] = True, False
    if mask_kind == "float":
        bias = torch.randn(seen.shape, generator=gen) * 0.5
        inputs["mask"] = torch.where(seen, bias, torch.tensor(-math.inf))
    out, lse = sim(inputs)
    check_against_reference(out, lse, inputs)
    poisoned = torch.isnan(lse)
    assert poisoned.any() and not poisoned.all()
    assert not poisoned[1, 0:G].any(), "kv head 0 of batch row 1 sees no bad value"


def test_nonfinite_value_poisons_a_row_that_sees_its_key_at_weight_zero():
    """A seen key whose probability underflows to 0 still poisons the row through a
    non-finite value (0 * NaN): seen means the bias is not -inf, not that the weight is
    positive. A NaN query poisons nothing in a row that sees no key."""
    B, Hq, T, S, D = 1, 2, 4, 70, 64
    gen = torch.Generator().manual_seed(41)
    q, k, v = torch.randn(B, Hq, T, D, generator=gen), torch.randn(B, 1, S, D, generator=gen), \
        torch.randn(B, 1, S, D, generator=gen)
    bias = torch.randn(B, Hq, T, S, generator=gen)
    bias[..., 50] = -1e30                # seen, weight exactly 0 in float32
    bias[:, 1, :, 50] = -math.inf        # ... by query head 0 only
    v[0, 0, 50, 7] = math.nan
    bias[:, :, 3] = -math.inf            # node 3 sees nothing ...
    q[0, :, 3, 0] = math.nan             # ... so its NaN query is harmless
    k[0, 0, 60:] = math.inf              # keys nobody sees
    v[0, 0, 60:] = math.nan
    bias[..., 60:] = -math.inf
    inputs = dict(query=q, key=k, value=v, mask=bias, mask_offset=None, scale=None, softcap=None)
    out, lse = sim(inputs)
    check_against_reference(out, lse, inputs)
    assert torch.isnan(lse[0, 0, :3]).all() and not torch.isnan(lse[0, 1]).any()
    assert torch.isneginf(lse[0, :, 3]).all() and (out[0, :, 3] == 0).all()


# ---------------------------------------------------------------------------------------
# Rows that see nothing.
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_rows_that_see_no_key_give_zero_and_neg_inf(mask_kind):
    B, Hq, T, S, D = 2, 2, 5, 40, 64
    q, k, v = torch.randn(B, Hq, T, D), torch.randn(B, 1, S, D), torch.randn(B, 1, S, D)
    mask = torch.rand(B, T, S) < 0.5
    mask[:, 1] = False
    mask[1] = False  # batch row 1 sees nothing at all
    if mask_kind == "float":
        mask = torch.zeros(mask.shape).masked_fill(~mask, -math.inf)
    inputs = dict(query=q, key=k, value=v, mask=mask, mask_offset=None, scale=None, softcap=None)
    out, lse = sim(inputs)
    check_against_reference(out, lse, inputs)
    assert torch.isneginf(lse[:, :, 1]).all() and (out[:, :, 1] == 0).all()
    assert torch.isneginf(lse[1]).all() and (out[1] == 0).all()


def test_empty_cache_gives_zero_and_neg_inf():
    q = torch.randn(1, 4, 3, 96, dtype=torch.float16)
    kv = torch.empty(1, 2, 0, 96, dtype=torch.float16)
    mask = torch.ones(1, 3, 0, dtype=torch.bool)
    out, lse = ops.forward_with_lse(q, kv, kv, mask, None, None, None)
    assert (out == 0).all() and torch.isneginf(lse).all()


# ---------------------------------------------------------------------------------------
# Buffer byte offsets and strides.
# ---------------------------------------------------------------------------------------
def test_views_with_storage_offsets_and_strided_mask():
    B, Hq, Hkv, T, S, D = 2, 4, 2, 5, 50, 96
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(B, Hq, T + 3, D, generator=gen, dtype=torch.float64).to(torch.bfloat16)[:, :, 2:2 + T]
    kv_store = torch.randn(2, B, S + 4, Hkv, D, generator=gen).to(torch.bfloat16)
    k = kv_store[0, :, 3:3 + S].transpose(1, 2)
    v = kv_store[1, :, 1:1 + S].transpose(1, 2)
    mask = (torch.rand(3, B, T, 2 * T, generator=gen) < 0.6)[1, :, :, ::2]
    offsets = torch.tensor([9, 0, 20, 44, 7], dtype=torch.int32)[2:4]
    assert all(t.storage_offset() > 0 for t in (q, k, v, mask, offsets))
    inputs = dict(query=q, key=k, value=v, mask=mask, mask_offset=offsets, scale=0.2, softcap=None)
    plan = plan_of(inputs)
    offsets_bound = {b["role"]: b["byte_offset"] for b in plan["launches"][0]["buffers"]}
    assert offsets_bound["query"] == q.storage_offset() * 2
    assert offsets_bound["value"] == v.storage_offset() * 2
    assert offsets_bound["mask_offset"] == offsets.storage_offset() * 4
    out, lse = sim(inputs)
    check_against_reference(out, lse, inputs)


# ---------------------------------------------------------------------------------------
# Traffic: counted by the simulator, modelled by the plan.
# ---------------------------------------------------------------------------------------
def _kv_bound(plan, traffic_key="actual"):
    rows = plan["rows_per_kv_head"]
    return math.ceil(rows / plan["block_rows"]) * plan[traffic_key]["minimum_key_value"]


@pytest.mark.parametrize("case", [
    Case(B=2, Hq=8, Hkv=2, T=20, S=300, D=64, dtype=torch.float16, seed=21),
    Case(B=1, Hq=4, Hkv=1, T=64, S=200, D=128, dtype=torch.bfloat16, mask_kind="float", seed=22),
    SPLIT_CASES[0],
], ids=str)
@pytest.mark.parametrize("family", ["vector", "matrix"])
def test_counted_bytes_equal_the_model_and_the_bound_holds(case, family):
    inputs = make_inputs(case)
    with kernel_family(family):
        traffic = traffic_of(inputs)
    assert traffic["plan"]["family"] == family
    for launch in traffic["launches"]:
        assert launch["counted_read"] == launch["modelled_read"], launch
        assert launch["counted_written"] == launch["modelled_written"], launch
        # Every launch also reports its counters (runtime.h counter_items), the device bytes
        # among them identical to the counted figures.
        counters = launch["counters"]
        assert sorted(counters) == sorted(["device_bytes_read", "device_bytes_written", "threadgroup_bytes_read",
                                           "threadgroup_bytes_written", "simdgroup_mmas", "scalar_fmas", "shuffles"])
        assert counters["device_bytes_read"] == launch["counted_read"]
        assert counters["device_bytes_written"] == launch["counted_written"]
    main = traffic["launches"][0]["counters"]
    assert main["shuffles"] > 0 and main["threadgroup_bytes_written"] > 0 and main["threadgroup_bytes_read"] > 0
    plan = traffic["plan"]
    main_kv = plan["actual"]["main_reads"]["key_value"]
    assert main_kv <= _kv_bound(plan)
    assert plan["actual"]["skipped_keys"] > 0 or main_kv == _kv_bound(plan)


def _masked_window_inputs(B, Hq, T, S, D, hidden, seed):
    """A dense window of S keys, keys `hidden` (a range) hidden from every row and NaN."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, length, D, generator=gen) for n, length in ((Hq, T), (1, S), (1, S)))
    mask = torch.rand(B, T, S, generator=gen) < 0.5
    mask[..., hidden] = False
    k[..., hidden, :] = v[..., hidden, :] = float("nan")
    return dict(query=q, key=k, value=v, mask=mask, mask_offset=None, scale=None, softcap=None)


@pytest.mark.parametrize("inputs_of, hidden_chunks", [
    # 8 simdgroups, several splits and row blocks, a partial last chunk.
    (lambda: make_inputs(Case(B=2, Hq=8, Hkv=2, T=20, S=300, D=128, dtype=torch.float16, seed=23)), None),
    # 16 simdgroups (D = 512), splits, a float32 query over a bfloat16 cache.
    (lambda: make_inputs(Case(B=1, Hq=4, Hkv=2, T=20, S=400, D=512, dtype=torch.float32, kv_dtype=torch.bfloat16,
                              mask_kind="float", seed=24)), None),
    # D = 512, two row blocks, window chunks [64, 128) hidden from every row: skipped.
    (lambda: _masked_window_inputs(B=1, Hq=4, T=20, S=170, D=512, hidden=slice(64, 128), seed=25), 2),
], ids=["d128", "d512_splits", "d512_skipped_chunks"])
def test_counted_simdgroup_mmas_equal_the_analytic_count(inputs_of, hidden_chunks):
    """The matrix kernel's simdgroup_multiply_accumulate calls, as the simulator counts
    them: per threadgroup and visited chunk, each simdgroup multiplies its 8 rows' query
    by K^T over its share of the head dims (D / 8 / parts products of 8 dims x 8 keys, x 4
    key blocks) and P by V (as many); parts = simdgroups / 8 (2 at D = 512). The traffic
    model's count (traffic.h, modelled_main_simdgroup_mmas) is the same number, for a cost
    model to rely on."""
    inputs = inputs_of()
    traffic = traffic_of(inputs)
    plan = traffic["plan"]
    main_launch = plan["launches"][0]
    assert plan["family"] == "matrix"
    D = inputs["query"].shape[-1]
    Hkv = inputs["key"].shape[1]
    simdgroups = main_launch["threads"][0] // 32
    parts = simdgroups // 8
    assert parts == (2 if D == 512 else 1)
    per_chunk_per_simdgroup = 2 * (D // 8 // parts) * (32 // 8)
    # Chunks each threadgroup (split, row block, batch row x kv head) walks, from the splits.
    walked = 0
    for visible_end in plan["actual"]["visible_end"]:
        for split in range(plan["n_splits"]):
            begin = split * plan["split_keys"]
            keys = max(0, min(begin + plan["split_keys"], visible_end) - begin)
            walked += Hkv * plan["n_row_blocks"] * math.ceil(keys / 32)
    visited = walked - plan["actual"]["skipped_chunks"]
    analytic = visited * simdgroups * per_chunk_per_simdgroup
    assert analytic == visited * 8 * D
    assert plan["actual"]["main_chunks"] == visited
    assert plan["actual"]["main_simdgroup_mmas"] == analytic
    assert traffic["launches"][0]["counters"]["simdgroup_mmas"] == analytic
    assert traffic["launches"][1]["counters"]["simdgroup_mmas"] == 0  # reduce
    if hidden_chunks is not None:
        assert plan["actual"]["skipped_chunks"] == hidden_chunks * plan["n_row_blocks"] > 0
    check_against_reference(*sim(inputs), inputs)
    # The vector kernel multiplies no matrices.
    with kernel_family("vector"):
        vector = traffic_of(inputs)
    assert vector["launches"][0]["counters"]["simdgroup_mmas"] == 0 == vector["plan"]["actual"]["main_simdgroup_mmas"]


@pytest.mark.parametrize("family", ["vector", "matrix"])
def test_fully_masked_window_chunks_are_not_fetched(family):
    # A dense window of 160 keys; keys [64, 128) are hidden from every row: two chunks
    # whose K/V the kernel must skip.
    B, Hq, T, S, D = 1, 2, 8, 160, 64
    q, k, v = torch.randn(B, Hq, T, D), torch.randn(B, 1, S, D), torch.randn(B, 1, S, D)
    mask = torch.rand(B, T, S) < 0.5
    mask[..., 64:128] = False
    # The skipped keys hold NaN: fetching them would poison every row.
    k[..., 64:128, :] = v[..., 64:128, :] = float("nan")
    inputs = dict(query=q, key=k, value=v, mask=mask, mask_offset=None, scale=None, softcap=None)
    with kernel_family(family):
        traffic = traffic_of(inputs)
        check_against_reference(*sim(inputs), inputs)
    assert traffic["plan"]["family"] == family
    plan = traffic["plan"]
    assert plan["actual"]["skipped_keys"] == 64
    assert plan["actual"]["main_reads"]["key_value"] == (S - 64) * 2 * D * 4
    main = traffic["launches"][0]
    assert main["counted_read"] == main["modelled_read"]


def test_reference_shape_traffic_against_minimum_and_seed():
    """B=1, Hq=32, Hkv=8, D=128, T=64 tree after a 4096-key prefix: the plan picks the
    matrix kernel, whose K/V bytes each serve 64 query rows, so the main pass reads
    ceil(G*T/64) = 4 x the minimum; the vector kernel (32 rows) reads 8 x, the seed's
    one-threadgroup-per-(query, head) design G*T = 256 x. The simulator runs the call and
    counts exactly the modelled bytes."""
    B, Hq, Hkv, D, T, P = 1, 32, 8, 128, 64, 4096
    S = P + T
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, Hq, T, D, generator=gen)
    kv = torch.randn(B, Hkv, S, D, generator=gen)
    from tests.cases import random_tree_mask
    mask = random_tree_mask(T, gen)[None]
    inputs = dict(query=q, key=kv, value=kv, mask=mask, mask_offset=torch.tensor([P]), scale=None, softcap=None)
    G = Hq // Hkv
    plans = {}
    for family in ("vector", "matrix"):
        with kernel_family(family):
            plans[family] = plan_of(inputs)
    plan = plan_of(inputs)
    assert plan["family"] == "matrix" and plan["launches"][0]["kernel"] == "tree_attn_mma_f32_d128_bool"
    assert plan == plans["matrix"]
    minimum = plan["worst_case"]["minimum_key_value"]
    assert minimum == plan["actual"]["minimum_key_value"] == 2 * Hkv * S * D * 4
    ratios = {f: p["worst_case"]["main_reads"]["key_value"] / minimum for f, p in plans.items()}
    assert ratios == {"vector": 8, "matrix": 4}
    assert ratios["matrix"] <= 4 == math.ceil(G * T / 64)
    # The tree's keys form two chunks; nodes 0..31 (parents first) see none of nodes
    # 32..63, so the blocks holding only such rows skip the second chunk.
    actual = {}
    for f, p in plans.items():
        skipped = p["actual"]["skipped_keys"]
        actual[f] = p["actual"]["main_reads"]["key_value"]
        assert actual[f] == ratios[f] * minimum - skipped * 2 * D * 4
    assert plans["vector"]["actual"]["skipped_keys"] > 0
    seed_kv = G * T * minimum
    print(f"\nreference shape: minimum K/V {minimum / 2**20:.2f} MiB; modelled worst case "
          f"v1 (vector, 32 rows) {ratios['vector']:.0f} x, v2 (matrix, 64 rows) {ratios['matrix']:.0f} x; "
          f"with this tree's skipped chunks v1 {actual['vector'] / minimum:.2f} x, v2 {actual['matrix'] / minimum:.2f} x; "
          f"seed design {G * T} x ({seed_kv / 2**20:.0f} MiB); v2: {plan['n_splits']} splits, "
          f"grid {plan['launches'][0]['grid']}")
    # Run it: counted bytes equal the model (the op fails otherwise) and the result is right.
    traffic = traffic_of(inputs)
    for launch in traffic["launches"]:
        assert launch["counted_read"] == launch["modelled_read"], launch
    assert traffic["launches"][0]["modelled_read"] == plan["actual"]["main_reads"]["total"]
    check_against_reference(*sim(inputs), inputs)


@pytest.mark.parametrize("dtype, kv_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                             (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16),
                                             (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("D", [64, 96, 128, 256, 512])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("family", ["vector", "matrix"])
def test_plan_geometry(dtype, kv_dtype, D, with_sinks, family):
    B, Hq, Hkv, T, S = 2, 8, 2, 9, 2000
    q = torch.zeros(B, Hq, T, D, dtype=dtype)
    kv = torch.zeros(B, Hkv, S, D, dtype=kv_dtype)
    sinks = torch.zeros(Hq) if with_sinks else None
    inputs = dict(query=q, key=kv, value=kv, mask=torch.ones(B, T, T, dtype=torch.bool),
                  mask_offset=torch.tensor([5, 1000]), scale=None, softcap=None, sinks=sinks)
    # G * T = 36: the plan's own choice is the matrix kernel.
    assert plan_of(inputs)["family"] == "matrix"
    with kernel_family(family):
        plan = plan_of(inputs)
    main, reduce = plan["launches"]
    tag = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
    pair = tag[dtype] if dtype == kv_dtype else f"{tag[dtype]}_{tag[kv_dtype]}"
    prefix = {"vector": "tree_attn_main", "matrix": "tree_attn_mma"}[family]
    assert main["kernel"] == f"{prefix}_{pair}_d{D}_bool"
    assert reduce["kernel"] == f"tree_attn_reduce_{tag[dtype]}_d{D}"
    element = torch.finfo(kv_dtype).bits // 8
    if family == "vector":
        # One chunk of 32 K (then V) rows in the K/V dtype, staged in slices of the head
        # dim (two only for float32 at D = 512): at most 32 KiB, a multiple of 16.
        slice_dims = D // 2 if D * element * 32 > 32768 else D
        assert main["threadgroup_memory_bytes"] == 32 * slice_dims * element <= 32768
        assert main["threads"] == [{64: 128, 96: 128, 128: 128, 256: 256, 512: 512}[D], 1, 1]
        block_rows = 32
    else:
        # Float tiles, rows padded by 4 floats: K/V [32][min(D, 128) + 4], scores [64][36],
        # 32 key flags, at D = 512 a float per row exchanged between the two simdgroups of
        # each 8 rows; 8 simdgroups, 16 at D = 512.
        floats = 32 * (min(D, 128) + 4) + 64 * 36 + 32 + (64 if D == 512 else 0)
        assert main["threadgroup_memory_bytes"] == 4 * floats <= 32768
        assert main["threadgroup_memory_bytes"] % 16 == 0
        assert main["threads"] == [512 if D == 512 else 256, 1, 1]
        block_rows = 64
    assert plan["block_rows"] == block_rows and plan["kv_aligned4"] == 1
    rows = (Hq // Hkv) * T
    assert plan["n_row_blocks"] == math.ceil(rows / block_rows)
    assert main["grid"] == [plan["n_splits"], plan["n_row_blocks"], B * Hkv]
    # Splits: ~256 threadgroups, >= 4 chunks of 32 keys each, <= 32 splits, covering S.
    assert plan["split_keys"] % 32 == 0 and plan["split_keys"] >= 4 * 32
    assert (plan["n_splits"] - 1) * plan["split_keys"] < S <= plan["n_splits"] * plan["split_keys"]
    chunks = math.ceil(S / 32)
    wanted = min(32, chunks // 4, math.ceil(256 / (B * Hkv * plan["n_row_blocks"])))
    assert plan["n_splits"] == math.ceil(chunks / math.ceil(chunks / wanted))
    assert reduce["grid"] == [math.ceil(B * Hq * T / 4), 1, 1] and reduce["threads"] == [128, 1, 1]
    slots = B * Hq * T * plan["n_splits"]
    assert plan["scratch_bytes"] >= slots * (D + 2) * 4
    assert {b["role"] for b in main["buffers"]} == {"params", "query", "key", "value", "mask", "mask_offset",
                                                    "partial_o", "partial_m", "partial_l"}
    assert [b["index"] for b in reduce["buffers"]] == list(range(7))
    # No sinks: the sinks slot gets a read-only region the kernel never reads.
    assert reduce["buffers"][6]["role"] == ("sinks" if with_sinks else "partial_m")
    assert not reduce["buffers"][6]["writable"]


@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_softcap_is_accurate_at_any_cap(softcap, scale):
    check_softcap_at_any_cap(sim, softcap, scale)


@pytest.mark.parametrize("name", [name for name, _ in extreme_finite_checks(None)])
def test_finite_extremes_stay_finite(name):
    # Sinks, biases and scores up to float32's max: the contract's finite answer.
    dict(extreme_finite_checks(sim))[name]()
