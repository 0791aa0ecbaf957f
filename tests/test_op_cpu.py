"""The CPU kernel behind ``torch.ops.tree_attn.forward`` / ``forward_with_lse``.

Everything is compared with the float64 reference (``torch_tree_attn.reference``), which
is written from the contract and shares no code with the kernel. Inputs come from
``tests/cases.py``: every cache slot the contract says is never read holds NaN, so a
kernel that reads one fails loudly. The contract's tables (parity matrix, bad inputs,
non-finite values) run on this kernel as tests/test_contract.py's cpu items; here: property
tests, thread counts and key splits, the fake (torch.compile's tracing) against the same
bad-input table, and targeted behaviour.
"""
import contextlib
import importlib
import math
import platform
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torch_tree_attn
from tests.backends import BAD_INPUTS, VALUE_RULES, valid_inputs
from tests.cases import (SOFTCAPS, args_of, DTYPE_PAIRS, DTYPES, HEAD_DIMS, TOLERANCE, check_against_reference,
                         check_softcap_at_any_cap, extreme_finite_checks, tree_inputs)
from torch_tree_attn.reference import tree_attention_reference

ops = torch.ops.tree_attn
NAN = float("nan")



@contextlib.contextmanager
def num_threads(n):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def random_qkv(gen, B, Hq, Hkv, T, S, D):
    """Float32 query [B, Hq, T, D], then key and value [B, Hkv, S, D], drawn from gen."""
    q = torch.randn(B, Hq, T, D, generator=gen)
    k = torch.randn(B, Hkv, S, D, generator=gen)
    v = torch.randn(B, Hkv, S, D, generator=gen)
    return q, k, v


def mask_of_kind(visible, mask_kind):
    """The bool mask `visible` ("bool"), or its float form ("float": 0 where visible, -inf elsewhere)."""
    return visible if mask_kind == "bool" else torch.zeros(visible.shape).masked_fill(~visible, -math.inf)


# ---------------------------------------------------------------------------------------
# Property tests: random shapes, strides, masks and offsets against the reference.

def _strided(t, layout, gen):
    """The same values as `t` ([B, H, S, D]) in another memory layout."""
    if layout == "bshd":  # a [B, S, H, D] cache passed as a transposed view
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "padded":  # rows and heads padded in a larger buffer, with a storage offset
        B, H, S, D = t.shape
        big = torch.randn(B, H + 1, S + 3, D + 16, generator=gen).to(t.dtype)
        view = big[:, 1:, 2:S + 2, 8:D + 8]
        view.copy_(t)
        return view
    if layout == "dim_major":  # stride(-1) != 1: the op must copy, not misread
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    return t


@st.composite
def problems(draw):
    dtype, kv_dtype = draw(st.sampled_from(DTYPE_PAIRS))
    D = draw(st.sampled_from(HEAD_DIMS))
    Hkv = draw(st.integers(1, 3))
    G = draw(st.sampled_from([1, 2, 3, 4, 8]))
    B = draw(st.integers(1, 3))
    T = draw(st.integers(1, 40))
    M = draw(st.sampled_from([0, T, T + draw(st.integers(0, 20))]))
    S = M + draw(st.integers(0, 300))
    offsets = [draw(st.integers(0, S - M)) for _ in range(B)]
    kind = draw(st.sampled_from(["bool", "float"]))
    mask_shape = draw(st.sampled_from(["3d", "batch", "heads", "full", "transposed"]))
    layouts = [draw(st.sampled_from(["contiguous", "bshd", "padded", "dim_major"])) for _ in range(3)]
    use_offsets = draw(st.booleans()) or any(offsets)
    softcap = draw(st.sampled_from([None, None, 5.0, 30.0]))
    scale = draw(st.sampled_from([None, None, 0.03, 0.4]))
    density = draw(st.sampled_from([0.0, 0.1, 0.5, 1.0]))
    sinks = draw(st.sampled_from([None, None, "finite", "with_neg_inf"]))
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(dtype=dtype, kv_dtype=kv_dtype, sinks=sinks, D=D, Hkv=Hkv, Hq=G * Hkv, B=B, T=T, M=M, S=S, offsets=offsets, kind=kind,
                mask_shape=mask_shape, layouts=layouts, use_offsets=use_offsets, softcap=softcap, scale=scale,
                density=density, seed=seed)


def build(pr):
    gen = torch.Generator().manual_seed(pr["seed"])
    B, Hq, Hkv, T, M, S, D = (pr[n] for n in ("B", "Hq", "Hkv", "T", "M", "S", "D"))
    offsets = pr["offsets"] if pr["use_offsets"] else [0] * B
    q = torch.randn(B, Hq, T, D, generator=gen).to(pr["dtype"])
    k = torch.randn(B, Hkv, S, D, generator=gen).to(pr["kv_dtype"])
    v = torch.randn(B, Hkv, S, D, generator=gen).to(pr["kv_dtype"])
    for b, off in enumerate(offsets):
        k[b, :, off + M:] = NAN
        v[b, :, off + M:] = NAN
    q, k, v = (_strided(t, layout, gen) for t, layout in zip((q, k, v), pr["layouts"]))
    mb, mh = {"3d": (B, 1), "batch": (1, 1), "heads": (B, 1), "full": (B, Hq), "transposed": (B, Hq)}[pr["mask_shape"]]
    visible = torch.rand(mb, mh, T, M, generator=gen) < pr["density"]
    if pr["kind"] == "bool":
        mask = visible
    else:
        mask = torch.where(visible, torch.randn(visible.shape, generator=gen), torch.tensor(-math.inf))
    if pr["mask_shape"] in ("3d", "batch"):
        mask = mask[:, 0]
    elif pr["mask_shape"] == "transposed":  # window column as the slow dimension
        mask = mask.transpose(-1, -2).contiguous().transpose(-1, -2)
    off = torch.tensor(offsets, dtype=torch.int32) if pr["use_offsets"] else None
    sinks = None
    if pr["sinks"] is not None:
        sinks = torch.randn(Hq, generator=gen) * 3.0
        if pr["sinks"] == "with_neg_inf":
            sinks[0] = -math.inf
    return dict(query=q, key=k, value=v, mask=mask, mask_offset=off, scale=pr["scale"], softcap=pr["softcap"],
                sinks=sinks)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_random_problems_match_reference(pr):
    inputs = build(pr)
    out, lse = ops.forward_with_lse(**inputs)
    check_against_reference(out, lse, inputs)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.sampled_from([1, 3, 5]))
def test_result_does_not_depend_on_thread_count(pr, threads):
    # Thread counts change the work split (key-range splits and their merge).
    inputs = build(pr)
    with num_threads(threads):
        out, lse = ops.forward_with_lse(**inputs)
    check_against_reference(out, lse, inputs)


# ---------------------------------------------------------------------------------------
# Targeted behaviour.

@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inspects the ELF extension")
@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("ldd") is None, reason="needs Linux ldd")
@pytest.mark.parametrize("module", ["torch_tree_attn._C", "torch_tree_attn_sim._C"])
def test_extension_uses_the_shared_cpp_runtime(module):
    # A static copy of libstdc++ inside the extension (some g++ wrappers link one) crashes
    # on the first formatted error message: csrc/build_flags.py must have prevented it.
    path = importlib.import_module(module).__file__
    needed = subprocess.run(["ldd", path], capture_output=True, text=True, check=True).stdout
    assert "libstdc++.so" in needed, f"{path} does not link the shared libstdc++:\n{needed}"


def test_kernel_is_compiled_with_openmp():
    # at::parallel_for is a header template: compiled without -fopenmp it silently runs
    # every work item on one thread, whatever torch.set_num_threads says.
    with open(torch_tree_attn._C.__file__, "rb") as f:
        binary = f.read()
    # The OpenMP runtime's entry for a parallel region: libgomp (GCC) or libomp (Clang).
    assert b"GOMP_parallel" in binary or b"__kmpc_fork_call" in binary, (
        "torch_tree_attn._C was built without -fopenmp: the CPU kernel runs on one thread")


# The kernel's vectors and register tiles follow the ISA it is built for (IsaTraits in
# csrc/cpu/tree_attn_cpu.cpp); this build exercises one of them. The others must at least
# compile, with their static_asserts (tiles within the register file, every head dim a whole
# number of value tiles) holding: 4 lanes / 16 registers (SSE2), AVX2, AVX-512 with BF16.
# (AArch64 NEON takes the 32-register tiles of AVX-512 at 4 lanes; there is no AArch64 C++
# library here to check it against.)
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("c++") is None,
                    reason="needs an x86 C++ compiler")
@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3", "sapphirerapids"])
def test_kernel_compiles_for_every_isa(march):
    from torch.utils import cpp_extension

    root = Path(__file__).resolve().parents[1]
    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}",
                                                                    f"-I{root / 'csrc'}"]
    r = subprocess.run(["c++", "-std=c++17", "-fsyntax-only", "-w", "-fopenmp", f"-march={march}", *includes,
                        str(root / "csrc" / "cpu" / "tree_attn_cpu.cpp")], capture_output=True, text=True)
    if "-march=" in r.stderr and r.returncode != 0 and "error: bad value" in r.stderr:
        pytest.skip(f"this compiler does not know -march={march}")
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_long_prefix_with_key_splits(dtype, threads):
    # One (batch, kv head) tile and thousands of keys: with more than one thread the key
    # range is split and the partial softmax states are merged.
    inputs = tree_inputs(B=1, Hq=8, Hkv=1, T=16, prefix=(2000,), D=128, dtype=dtype, S=2100)
    with num_threads(threads):
        out, lse = ops.forward_with_lse(**inputs)
    check_against_reference(out, lse, inputs)


@pytest.mark.parametrize("threads", [1, 3])
def test_dense_causal_mask_over_long_cache(threads):
    # Dense HF form (M = S, no offsets) with a causal mask: early rows see only the first
    # key blocks, so whole blocks (and whole splits) are fully masked for some rows, and
    # row 0 sees no key at all in any split.
    gen = torch.Generator().manual_seed(3)
    B, Hq, Hkv, T, S, D = 1, 4, 2, 6, 1500, 64
    q, k, v = random_qkv(gen, B, Hq, Hkv, T, S, D)
    ends = torch.tensor([0, 300, 700, 1100, 1499, 1500])
    mask = (torch.arange(S)[None, :] < ends[:, None])[None]
    inputs = dict(query=q, key=k, value=v, mask=mask, mask_offset=None, scale=None, softcap=None)
    with num_threads(threads):
        out, lse = ops.forward_with_lse(**inputs)
    check_against_reference(out, lse, inputs)


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_fully_masked_key_blocks_are_not_read(mask_kind):
    # Window keys that no row of a kv head sees, spanning whole key blocks (blocks are at
    # most 512 keys and start at multiples of their size), are skipped without a read:
    # NaN there must not reach the result.
    gen = torch.Generator().manual_seed(5)
    B, Hq, Hkv, T, S, D = 1, 2, 1, 3, 4096, 128
    q, k, v = random_qkv(gen, B, Hq, Hkv, T, S, D)
    visible = torch.ones(B, T, S, dtype=torch.bool)
    visible[..., 600:3600] = False
    k[:, :, 1024:3072] = NAN
    v[:, :, 1024:3072] = NAN
    mask = mask_of_kind(visible, mask_kind)
    inputs = dict(query=q, key=k, value=v, mask=mask, mask_offset=None, scale=None, softcap=None)
    out, lse = ops.forward_with_lse(**inputs)
    check_against_reference(out, lse, inputs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_unused_slots_do_not_change_the_result(dtype):
    inputs = tree_inputs(B=3, Hq=4, Hkv=2, T=7, prefix=(0, 33, 90), D=64, dtype=dtype, S=120)
    out_nan, lse_nan = ops.forward_with_lse(**inputs)
    for t in (inputs["key"], inputs["value"]):
        t[torch.isnan(t)] = 1e4
    out_big, lse_big = ops.forward_with_lse(**inputs)
    assert not torch.isnan(out_nan).any()
    assert torch.equal(out_nan, out_big) and torch.equal(lse_nan, lse_big)


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_rows_that_see_no_key_give_zero_and_neg_inf(mask_kind):
    gen = torch.Generator().manual_seed(7)
    B, Hq, Hkv, T, S, D = 2, 4, 2, 5, 20, 96
    q, k, v = random_qkv(gen, B, Hq, Hkv, T, S, D)
    visible = torch.rand(B, Hq, T, S, generator=gen) < 0.5
    visible[0, :, 1] = False  # one row of every head of batch row 0
    visible[1] = False  # every row of batch row 1
    mask = mask_of_kind(visible, mask_kind)
    out, lse = ops.forward_with_lse(q, k, v, mask)
    assert torch.equal(out[0, :, 1], torch.zeros(Hq, D)) and torch.isneginf(lse[0, :, 1]).all()
    assert torch.equal(out[1], torch.zeros(Hq, T, D)) and torch.isneginf(lse[1]).all()
    check_against_reference(out, lse, dict(query=q, key=k, value=v, mask=mask, mask_offset=None))


def test_no_keys_at_all():
    # M = 0 and offset 0: nothing is visible, and S = 0 is a legal (empty) cache.
    for S in (0, 9):
        q = torch.randn(2, 4, 3, 64)
        k = torch.full((2, 2, S, 64), NAN)
        mask = torch.ones(2, 3, 0, dtype=torch.bool)
        out, lse = ops.forward_with_lse(q, k, k, mask, torch.zeros(2, dtype=torch.int32))
        assert torch.equal(out, torch.zeros_like(q)) and torch.isneginf(lse).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefix_only_window(dtype):
    # M = 0: every row sees exactly the prefix [0, off_b).
    inputs = tree_inputs(B=2, Hq=8, Hkv=2, T=4, prefix=(50, 300), D=128, dtype=dtype, S=310)
    inputs["mask"] = torch.ones(2, 4, 0, dtype=torch.bool)
    for b, off in enumerate((50, 300)):
        inputs["key"][b, :, off:] = NAN
        inputs["value"][b, :, off:] = NAN
    out, lse = ops.forward_with_lse(**inputs)
    check_against_reference(out, lse, inputs)
    q, k, v = (inputs[n][0].double() for n in ("query", "key", "value"))
    expected = torch.softmax(q @ k[:, :50].repeat_interleave(4, 0).mT / 128 ** 0.5, -1) @ v[:, :50].repeat_interleave(4, 0)
    torch.testing.assert_close(out[0].double(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_single_query_decode(dtype):
    # T = 1 with a one-key window: ordinary decoding over the prefix plus the new token.
    inputs = tree_inputs(B=2, Hq=8, Hkv=1, T=1, prefix=(17, 64), D=256, dtype=dtype, S=80)
    out, lse = ops.forward_with_lse(**inputs)
    check_against_reference(out, lse, inputs)


@pytest.mark.parametrize("shape", [(0, 4, 5, 64), (2, 4, 0, 64)])
def test_empty_inputs(shape):
    B, Hq, T, D = shape
    q = torch.randn(shape)
    k = torch.randn(B, max(Hq // 2, 1), 9, D)
    mask = torch.ones(B, T, 9, dtype=torch.bool)
    out, lse = ops.forward_with_lse(q, k, k, mask)
    assert out.shape == shape and lse.shape == shape[:3] and lse.dtype == torch.float32
    assert ops.forward(q, k, k, mask, torch.zeros(B, dtype=torch.int64), None, None).shape == shape


def test_positional_call_and_python_api():
    inputs = tree_inputs(B=2, Hq=4, Hkv=2, T=5, prefix=(10, 30), D=64)
    q, k, v, mask, off = (inputs[n] for n in ("query", "key", "value", "mask", "mask_offset"))
    positional = ops.forward(q, k, v, mask, off, None, None)
    out, lse = torch_tree_attn.tree_attention(q, k, v, mask, mask_offset=off, return_lse=True)
    assert torch.equal(positional, out)
    assert torch.equal(torch_tree_attn.tree_attention(q, k, v, mask, off), out)
    check_against_reference(out, lse, inputs)
    sinks = torch.randn(4)
    with_sinks = ops.forward(q, k, v, mask, off, None, None, sinks)
    assert torch.equal(with_sinks, torch_tree_attn.tree_attention(q, k, v, mask, off, sinks=sinks))
    assert not torch.equal(with_sinks, out)


def test_sinks_join_the_denominator_only():
    # out = sum_j e^s_j v_j / (sum_j e^s_j + e^sink), lse = log(sum_j e^s_j + e^sink), by
    # hand from float64 softmax; softcap caps the scores, never the sink; a bf16 sink is
    # read as float32; -inf is no sink.
    inputs = tree_inputs(B=2, Hq=4, Hkv=2, T=5, prefix=(10, 30), D=64, seed=3)
    sinks = torch.tensor([0.5, -math.inf, 60.0, -2.0])
    out, lse = ops.forward_with_lse(*args_of(dict(inputs, softcap=5.0, sinks=sinks)))
    plain_out, plain_lse = tree_attention_reference(**dict(inputs, softcap=5.0))
    sink = sinks.double()[None, :, None]
    want_lse = torch.logaddexp(plain_lse, sink)
    want_out = plain_out * torch.exp(plain_lse - want_lse)[..., None]
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(out.double(), want_out, **TOLERANCE[torch.float32])
    # A sink of 60 beyond the cap of 5 dominates: that head's output is almost 0.
    assert out[:, 2].abs().max() < 1e-20
    assert torch.equal(ops.forward(*args_of(dict(inputs, sinks=sinks.bfloat16()))),
                       ops.forward(*args_of(dict(inputs, sinks=sinks.bfloat16().float()))))
    no_sink = ops.forward(*args_of(inputs))
    assert torch.equal(out[:, 1], ops.forward(*args_of(dict(inputs, softcap=5.0)))[:, 1])
    assert not torch.equal(out[:, 0], no_sink[:, 0])


@pytest.mark.parametrize("sink", [-1.5, -math.inf])
def test_rows_that_see_no_key_give_zero_and_their_sink(sink):
    inputs = tree_inputs(B=2, Hq=2, Hkv=1, T=4, prefix=(0, 6), D=64)
    inputs["mask"][0] = False  # batch row 0: no prefix, nothing in the window
    sinks = torch.tensor([sink, 2.0])
    out, lse = ops.forward_with_lse(*args_of(dict(inputs, sinks=sinks)))
    assert (out[0] == 0).all()
    assert torch.equal(lse[0], sinks[:, None].expand(2, 4))
    check_against_reference(out, lse, dict(inputs, sinks=sinks))


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 512])
def test_float32_query_over_half_cache_keeps_float32_precision(kv_dtype, D):
    # The float32 query is not rounded to the cache dtype: the result equals (to float32
    # accumulation error) the all-float32 call on the same, exactly widened K/V values,
    # and is far closer to it than the all-half call.
    inputs = tree_inputs(B=2, Hq=8, Hkv=2, T=9, prefix=(70, 300), D=D, dtype=kv_dtype, seed=5)
    q32 = torch.randn(inputs["query"].shape, generator=torch.Generator().manual_seed(9))
    mixed = ops.forward(*args_of(dict(inputs, query=q32)))
    assert mixed.dtype == torch.float32
    widened = dict(inputs, query=q32, key=inputs["key"].float(), value=inputs["value"].float())
    torch.testing.assert_close(mixed, ops.forward(*args_of(widened)), atol=2e-6, rtol=2e-6)
    check_against_reference(mixed, None, dict(inputs, query=q32))


@pytest.mark.parametrize("D", [256, 512])
@pytest.mark.parametrize("contiguous", [False, True])
def test_float32_scores_of_alike_terms_stay_within_float32_bound(D, contiguous):
    # Issue 23: query and key rows constant along D (stride-0 views, as the fuzzer's
    # expand_d layouts make them, or copies) of a large magnitude. Every q_d k_d of a score
    # is the same number, so the roundings of one running float32 sum over D add up
    # coherently (about D/4 ulp of the score): one sum gave 1.9x (D = 256) and 5.5x
    # (D = 512) the bound here; blocks of 32 head dims stay within about half of it.
    gen = torch.Generator().manual_seed(1)
    B, Hq, Hkv, T, P = 1, 4, 1, 8, 292
    q = (torch.randn(B, Hq, T, 1, generator=gen) * 4 * D ** -0.25).expand(B, Hq, T, D)
    k = (torch.randn(B, Hkv, P + T, 1, generator=gen) * 4 * D ** -0.25).expand(B, Hkv, P + T, D)
    v = torch.randn(B, Hkv, P + T, D, generator=gen)
    if contiguous:
        q, k = q.contiguous(), k.contiguous()
    for scale in (None, 0.5):
        inputs = dict(query=q, key=k, value=v, mask=torch.ones(B, T, T, dtype=torch.bool),
                      mask_offset=torch.tensor([P]), scale=scale, softcap=None)
        out, lse = ops.forward_with_lse(*args_of(inputs))
        check_against_reference(out, lse, inputs)


def test_scale_and_softcap_are_applied_in_contract_order():
    inputs = tree_inputs(B=1, Hq=2, Hkv=1, T=6, prefix=(20,), D=64)
    inputs["mask"] = torch.where(inputs["mask"], torch.randn(inputs["mask"].shape), -math.inf)
    inputs.update(scale=0.3, softcap=2.0)  # a cap that bites: |scale * q.k| is often > 2
    out, lse = ops.forward_with_lse(**inputs)
    check_against_reference(out, lse, inputs)
    ref_out, _ = tree_attention_reference(**dict(inputs, softcap=None))
    assert (out.double() - ref_out).abs().max() > 1e-2, "softcap had no effect"


@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_softcap_is_accurate_at_any_cap(softcap, scale):
    check_softcap_at_any_cap(lambda inputs: ops.forward_with_lse(*args_of(inputs)), softcap, scale)


@pytest.mark.parametrize("name", [name for name, _ in extreme_finite_checks(None)])
def test_finite_extremes_stay_finite(name):
    # Sinks, biases and scores up to float32's max: the contract's finite answer.
    dict(extreme_finite_checks(lambda inputs: ops.forward_with_lse(*args_of(inputs))))[name]()


def test_non_contiguous_query_and_output_layout():
    inputs = tree_inputs(B=2, Hq=4, Hkv=2, T=5, prefix=(10, 30), D=64)
    q = inputs["query"].transpose(1, 2).contiguous().transpose(1, 2)  # [B, T, Hq, D] storage
    assert not q.is_contiguous()
    out, lse = ops.forward_with_lse(**dict(inputs, query=q))
    assert out.is_contiguous() and lse.is_contiguous()
    check_against_reference(out, lse, dict(inputs, query=q))
    sliced = torch.randn(2, 4, 5, 200)[..., 10:74]  # row stride 200, storage offset
    out2, lse2 = ops.forward_with_lse(**dict(inputs, query=sliced))
    check_against_reference(out2, lse2, dict(inputs, query=sliced))


def test_float16_and_int32_offsets_and_half_masks():
    inputs = tree_inputs(B=2, Hq=8, Hkv=2, T=9, prefix=(5, 70), D=96, dtype=torch.float16)
    inputs["mask_offset"] = inputs["mask_offset"].to(torch.int32)
    inputs["mask"] = torch.where(inputs["mask"], 0.0, torch.finfo(torch.float16).min).to(torch.float16)
    out, lse = ops.forward_with_lse(**inputs)
    check_against_reference(out, lse, inputs)


def test_deterministic():
    inputs = tree_inputs(B=2, Hq=8, Hkv=2, T=16, prefix=(700, 100), D=128, dtype=torch.bfloat16)
    first = ops.forward_with_lse(**inputs)
    for _ in range(3):
        again = ops.forward_with_lse(**inputs)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


# ---------------------------------------------------------------------------------------
# Validation under tracing: tests/backends.py's BAD_INPUTS (every rule in
# csrc/validation.cpp), which tests/test_contract.py runs through the kernel, through the fake.

_ok = valid_inputs


@pytest.mark.parametrize("op", ["forward", "forward_with_lse"])
@pytest.mark.parametrize("make_bad, error, pattern", [b[1:] for b in BAD_INPUTS if b[0] not in VALUE_RULES],
                         ids=[b[0] for b in BAD_INPUTS if b[0] not in VALUE_RULES])
def test_fake_checks_the_same_rules(op, make_bad, error, pattern):
    # Tracing (torch.compile's FakeTensorMode) raises what the kernel raises, from the
    # contract's one rule set in C++.
    from torch._subclasses.fake_tensor import FakeTensorMode

    inputs = _ok()
    inputs.update(make_bad(inputs))
    mode = FakeTensorMode()
    fake = {n: (mode.from_tensor(t) if isinstance(t, torch.Tensor) else t) for n, t in inputs.items()}
    with mode, pytest.raises(error, match=pattern.replace("{device}", "cpu")):
        getattr(ops, op)(*args_of(fake))


def test_fake_accepts_valid_calls_with_exact_metadata():
    from torch._subclasses.fake_tensor import FakeTensorMode

    inputs = _ok()
    real_out, real_lse = ops.forward_with_lse(*args_of(inputs))
    mode = FakeTensorMode()
    fake = {n: (mode.from_tensor(t) if isinstance(t, torch.Tensor) else t) for n, t in inputs.items()}
    with mode:
        out, lse = ops.forward_with_lse(*args_of(fake))
    for got, want in ((out, real_out), (lse, real_lse)):
        assert (got.shape, got.stride(), got.dtype, got.device) == (want.shape, want.stride(), want.dtype, want.device)


@pytest.mark.parametrize("op", ["forward", "forward_with_lse"])
def test_backward_raises_instead_of_returning_no_gradients(op):
    inputs = _ok()
    inputs["query"].requires_grad_(True)
    inputs["key"].requires_grad_(True)
    result = getattr(ops, op)(*args_of(inputs))
    out = result[0] if isinstance(result, tuple) else result
    assert out.requires_grad
    with pytest.raises(RuntimeError, match=r"tree_attn\.%s has no backward" % op):
        out.sum().backward()
    # Inference under no_grad is unaffected.
    with torch.no_grad():
        check_against_reference(ops.forward(*args_of(inputs)), None, inputs)


def test_valid_edges_are_accepted():
    # The boundaries of the rules above are legal: offset exactly S - M, offset 0,
    # broadcast mask dims, an int64 offset at the edge, M = S with no offsets.
    inputs = _ok()
    for off in ([13, 0], [0, 13]):
        inputs["mask_offset"] = torch.tensor(off)
        inputs["key"][:] = torch.randn(inputs["key"].shape)
        inputs["value"][:] = torch.randn(inputs["value"].shape)
        check_against_reference(ops.forward(*args_of(inputs)), None, inputs)
    dense = dict(inputs, mask=torch.ones(1, 1, 3, 16, dtype=torch.bool), mask_offset=None)
    check_against_reference(ops.forward(*args_of(dense)), None, dense)


def test_inner_stride_is_copied_not_misread():
    # stride(-1) != 1 is accepted by copying: same answer as the contiguous tensors.
    inputs = _ok()
    inputs["key"][:] = torch.randn(inputs["key"].shape)
    inputs["value"][:] = torch.randn(inputs["value"].shape)
    expected = ops.forward(*args_of(inputs))
    odd = {n: inputs[n].transpose(-1, -2).contiguous().transpose(-1, -2) for n in ("query", "key", "value")}
    assert all(t.stride(-1) != 1 for t in odd.values())
    assert torch.equal(ops.forward(*args_of(dict(inputs, **odd))), expected)


# ---------------------------------------------------------------------------------------
# Non-finite values beyond tests/test_contract.py's table: NaN exactly in the rows that see
# one, nothing else touched.

@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # float16 cannot overflow a score
def test_score_overflow_poisons_exactly_its_rows(dtype, softcap, threads):
    # Finite inputs whose raw score overflows float32, to +inf and to -inf: in a prefix key
    # (the hot path, where -inf must not pass for a masked key, and key splits with 3
    # threads) and in a window key that some rows of a head see and others do not.
    # softcap must not hide it.
    inputs = tree_inputs(B=1, Hq=4, Hkv=1, T=6, prefix=(1200,), D=64, dtype=dtype, S=1206, seed=11)
    q, k = inputs["query"], inputs["key"]
    q.mul_(1e-3)
    k[0, 0, 700, :32] = 2e38   # a prefix key in the second block: first half of the dims
    k[0, 0, 1203, 32:] = 2e38  # window key 3: second half
    q[0, 0, 1, :32] = 1.0      # scale * q.k = +8e38 with key 700
    q[0, 1, 2, :32] = -1.0     # -8e38 with key 700
    q[0, 2, :, 32:] = -1.0     # -8e38 with key 1203, in the rows of head 2 that see it
    inputs.update(softcap=softcap)
    with num_threads(threads):
        out, lse = ops.forward_with_lse(**inputs)
    check_against_reference(out, lse, inputs)
    poisoned = torch.isnan(lse[0])
    assert poisoned[0, 1] and poisoned[1, 2]
    assert poisoned[2].any() and not poisoned[2].all(), "the window key must poison only the rows that see it"


def _set_element(t, flat_index, value):
    t[tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_index % t.numel()), t.shape))] = value


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(),
       st.lists(st.tuples(st.sampled_from(["query", "key", "value", "mask"]), st.integers(0, 2**31 - 1),
                          st.sampled_from([NAN, math.inf, -math.inf])), min_size=1, max_size=3),
       st.sampled_from([1, 2, 3]))
def test_random_nonfinite_values_match_reference(pr, spots, threads):
    # NaN / +-inf anywhere (query, key, value, float mask; used slots or not), any shape,
    # layout, mask kind and thread count: NaN exactly in the rows that see one.
    inputs = build(pr)
    for name, where, value in spots:
        t = inputs[name]
        if t.numel() and t.dtype != torch.bool:
            _set_element(t, where, value)
    with num_threads(threads):
        out, lse = ops.forward_with_lse(**inputs)
    check_against_reference(out, lse, inputs)
