"""The CUDA backend's host side without a GPU: the C++ plan and kernel specs of a call
(csrc/cuda/launch.h, through _C.cuda_plan_launch), the prebuilt table's coverage of the
calls users make, the kernel registry (prebuilt / compiled once / missing), the build of
prebuilt kernels and their manifest, and the driver declarations against cuda.h.

tests/test_cuda.py runs the launches themselves on a GPU.
"""
import importlib.util
import json
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

import torch_tree_attn  # noqa: F401
from torch_tree_attn import _C
from torch_tree_attn.backends import cuda as cuda_backend
from torch_tree_attn.backends.cuda import plan as heur

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "csrc" / "cuda"))
import build_kernels  # noqa: E402

HAVE_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install -e '.[test]')")


def _spec_fields():
    # The compiler module imports no triton at module level: its field list is checkable anywhere.
    from torch_tree_attn.backends.cuda import compiler

    return compiler


def test_spec_fields_and_constants_agree_across_languages():
    tc = _spec_fields()
    assert tuple(_C.cuda_spec_fields()) == tc.SPEC_FIELDS
    assert (build_kernels.REDUCE_CHUNK, build_kernels.REDUCE_WARPS, build_kernels.REDUCE_ELEMS) == (
        heur.REDUCE_CHUNK, heur.REDUCE_WARPS, heur.REDUCE_ELEMS)
    # The build reads the plan's own table.
    assert build_kernels.tile_table() == dict(heur.CONFIGS)
    # Dtype codes: what the C++ launcher writes into a spec.
    for dtype, name in ((torch.float32, "fp32"), (torch.float16, "fp16"), (torch.bfloat16, "bf16")):
        q = torch.randn(1, 4, 8, 64, dtype=dtype)
        _, spec, _ = _C.cuda_plan_launch(q, q, q, torch.ones(1, 8, 8, dtype=torch.bool), arch=90, num_sms=132)
        assert spec["q_dtype"] == spec["kv_dtype"] == tc.DTYPE_CODES[name]


def _call(B=1, Hq=32, Hkv=8, T=64, P=4096, D=128, dtype=torch.bfloat16, mask="bool", softcap=None, sinks=False,
          offset_dtype=torch.int64, extra_slots=0):
    """A verify call as the package's users make it: a static cache [B, Hkv, S, D] holding
    P prefix keys (plus unused slots), a [B, T, T] tree mask after them."""
    S = P + T + extra_slots
    q = torch.randn(B, Hq, T, D, dtype=dtype)
    k = torch.randn(B, Hkv, S, D, dtype=dtype)
    tree = torch.tril(torch.ones(T, T, dtype=torch.bool))[None].expand(B, T, T).contiguous()
    m = tree if mask == "bool" else torch.where(tree, 0.0, float("-inf")).to(torch.float32)
    off = torch.full((B,), P, dtype=offset_dtype)
    sk = torch.zeros(Hq) if sinks else None
    return (q, k, k, m, off, None, softcap, sk)


# The model families the package integrates (README), at the shapes of a tree verify step.
USER_CALLS = {
    "llama3-8b": dict(),
    "llama3-8b-fp16-eagle60": dict(dtype=torch.float16, T=60),
    "llama3-8b-T16-long": dict(T=16, P=65536),
    "llama3-8b-batch8": dict(B=8, P=16384),
    "qwen3-int32-offsets": dict(Hq=32, Hkv=8, T=32, P=1024, offset_dtype=torch.int32),
    "mistral-static-cache": dict(P=2048, extra_slots=3000),
    "gemma2-softcap": dict(Hq=16, Hkv=8, D=256, softcap=50.0, mask="float", T=48),
    "gemma3-D256": dict(Hq=8, Hkv=4, D=256, T=64, P=8192),
    "gemma4-global-D512": dict(Hq=8, Hkv=2, D=512, T=64, P=4096),
    "gpt-oss-sinks": dict(Hq=64, Hkv=8, D=64, sinks=True, T=64),
    "decode-step": dict(T=1, P=4000),
    # The built-in EAGLE-3 demo (float32 by default, so that it can check exactness): its
    # target's tree verify and its drafter's steps.
    "builtin-demo-verify": dict(dtype=torch.float32, Hq=4, Hkv=2, D=64, T=60, P=40),
    "builtin-demo-draft": dict(dtype=torch.float32, Hq=4, Hkv=2, D=64, T=10, P=300),
    "float32-llama": dict(dtype=torch.float32, T=64, P=4096),
}


@pytest.mark.parametrize("arch", build_kernels.DEFAULT_ARCHS)
@pytest.mark.parametrize("name", USER_CALLS)
def test_prebuilt_table_covers_user_calls(name, arch):
    """No compilation on a user's first call: every kernel such a call launches is in the
    prebuilt table (the table the build compiles, by spec)."""
    table = {tuple(sorted(s.items())) for s in build_kernels.prebuilt_specs([arch])}
    for kernel in ("triton", "auto"):
        plan, main, reduce = _C.cuda_plan_launch(*_call(**USER_CALLS[name]), arch=arch,
                                                 num_sms=132 if arch == 90 else 108, kernel=kernel)
        if main["kind"] == 2 and not build_kernels.have_gluon():
            continue    # this triton cannot build the Hopper kernels (the table has none)
        assert tuple(sorted(main.items())) in table, f"main kernel not prebuilt: {main}"
        if plan.num_splits > 1:
            assert tuple(sorted(reduce.items())) in table, f"reduce kernel not prebuilt: {reduce}"


def test_default_kernel_is_auto():
    """The process default is "auto": on sm_90 the Hopper kernel for a call it covers, else the
    Triton kernel; an install that can neither load nor compile the Hopper kernel falls back to
    the Triton kernel."""
    import os

    assert cuda_backend.DEFAULT_KERNEL == "auto"
    if not os.environ.get("TORCH_TREE_ATTN_CUDA_KERNEL"):
        available = cuda_backend.hopper_available(cuda_backend.load_manifest())
        assert _C.cuda_kernel_choice() == ("auto" if available else "triton")
        plan, _, _ = _C.cuda_plan_launch(*_call(), arch=90, num_sms=132)
        assert plan.kernel == ("hopper" if available else "triton")
        plan, _, _ = _C.cuda_plan_launch(*_call(), arch=80, num_sms=108)
        assert plan.kernel == "triton"
    assert cuda_backend.hopper_available([dict(spec=dict(kind=2))])
    assert cuda_backend.hopper_available([]) == build_kernels.have_gluon()


def test_plan_launch_is_the_plan_and_flags_what_the_kernels_need():
    plan, main, reduce = _C.cuda_plan_launch(*_call(P=16384), arch=90, num_sms=132, kernel="triton")
    ref = heur.choose(128, True, 4 * 64, 8, 16384 + 64, 64, 132, T=64)
    assert (plan.block_m, plan.block_n, plan.num_splits, plan.window_units) == (
        ref.block_m, ref.block_n, ref.num_splits, ref.window_units)
    assert main["aligned"] == 1 and main["wide"] == 0 and main["skip_unseen"] == 0 and reduce["kind"] == 1
    # One split: no reduce kernel.
    plan, _, reduce = _C.cuda_plan_launch(*_call(P=64), arch=80, num_sms=132)
    assert plan.num_splits == 1 and reduce is None
    # Forced splits and tiles reach the plan; a bad config is a ValueError naming it.
    plan, main, _ = _C.cuda_plan_launch(*_call(), arch=90, num_sms=132, num_splits=5, config=[32, 64, 4, 2])
    assert plan.num_splits == 5 and main["block_m"] == 32 and main["num_stages"] == 2
    with pytest.raises(ValueError, match="window sub-tile"):
        _C.cuda_plan_launch(*_call(), arch=90, num_sms=132, config=[64, 64, 4, 3, 24])


@pytest.mark.parametrize("D", [64, 128])
def test_plan_refuses_the_float32_tiles_triton_miscompiles(D):
    """A float32 dot at BLOCK_M 64 with 8 warps gives wrong results under Triton 3.6 (H100,
    tests/gpu_config_probe.py): a config naming it is a ValueError with the tile; a larger
    block clamped to a small row count keeps 128 rows instead; 16-bit dots and 4 warps are
    unaffected."""
    call = _call(D=D, dtype=torch.float32)
    for bn, stages in ((32, 2), (16, 2), (64, 3)):
        with pytest.raises(ValueError, match=rf"float32 dot at BLOCK_M 64 with 8 warps .*got \(64, {bn}, 8, {stages}\)"):
            _C.cuda_plan_launch(*call, arch=90, num_sms=132, kernel="triton", config=[64, bn, 8, stages])
    plan, main, _ = _C.cuda_plan_launch(*call, arch=90, num_sms=132, kernel="triton", config=[64, 32, 4, 3])
    assert main["block_m"] == 64 and main["num_warps"] == 4
    # 64 rows a kv head (G = 1, T = 64): (128, 32, 8, 2) would clamp to 64; it stays 128.
    small = _call(Hq=8, Hkv=8, T=64, D=D, dtype=torch.float32)
    plan, main, _ = _C.cuda_plan_launch(*small, arch=90, num_sms=132, kernel="triton", config=[128, 32, 8, 2])
    assert main["block_m"] == 128 and plan.row_blocks == 1
    plan, main, _ = _C.cuda_plan_launch(*small, arch=90, num_sms=132, kernel="triton", config=[128, 32, 4, 2])
    assert main["block_m"] == 64
    # The 16-bit dot at the same tile is not affected.
    plan, main, _ = _C.cuda_plan_launch(*_call(D=D), arch=90, num_sms=132, kernel="triton", config=[64, 32, 8, 2])
    assert main["block_m"] == 64 and main["num_warps"] == 8
    # A query row stride not divisible by 16 elements: the unaligned variant.
    q, k, v, m, off, *rest = _call(T=8, D=64, Hq=4, Hkv=1, P=100)
    q_odd = torch.randn(1, 4, 8, 72, dtype=q.dtype)[..., :64]
    _, main, _ = _C.cuda_plan_launch(q_odd, k, v, m, off, *rest, arch=90, num_sms=132, kernel="triton")
    assert main["aligned"] == 0
    # A tree mask of any T is fine for the aligned variant (the mask is not specialised).
    _, main, _ = _C.cuda_plan_launch(*_call(T=61), arch=90, num_sms=132, kernel="triton")
    assert main["aligned"] == 1
    # The contract's validation runs first, with its messages.
    q, k, v, m, *_ = _call()
    with pytest.raises(ValueError, match="mask query size"):
        _C.cuda_plan_launch(q, k, v, m[:, :5], arch=90, num_sms=132)


# ---------------------------------------------------------------------------------------
# The Hopper (sm_90, Gluon) main kernel: when the plan chooses it, its plan, its specs.

def test_hopper_table_is_the_kernels_and_the_builds():
    from torch_tree_attn.backends.cuda import hopper_kernels as hk

    assert _C.hopper_table() == hk.DEFAULT_CONFIG == build_kernels.hopper_table()
    assert _C.HOPPER_WINDOW_COST == hk.WINDOW_COST
    assert sorted(hk.HEAD_DIMS) == sorted(hk.DEFAULT_CONFIG)


@pytest.mark.parametrize("D, config", [(D, c) for D in (64, 128, 256) for c in
                                       [(4, 64, 2), (4, 64, 3), (4, 64, 4), (4, 32, 3), (4, 32, 4), (8, 64, 2),
                                        (8, 64, 3)]] + [(512, (8, 16, 4)), (512, (8, 32, 2))])
def test_hopper_programs_per_sm_is_one_rule(D, config):
    """The C++ plan's programs per SM (the split count depends on it) and the build's (the
    register cap depends on it) are one rule: two programs where four consumer warps' shared
    memory fits twice into the SM's 228 KiB, else one."""
    from torch_tree_attn.backends.cuda import hopper_kernels as hk

    cw, bn, stages = config
    per_sm = _C.hopper_programs_per_sm(D, cw, bn, stages)
    assert per_sm == hk.programs_per_sm(D, cw, bn, stages)
    shared = 2 * (hk.block_m_for(D, cw) * D + 2 * stages * bn * D)
    assert per_sm == (2 if cw == 4 and 2 * (shared + 1024) <= 228 * 1024 else 1)
    # The register cap leaves every program its share of the SM's 64K registers.
    assert per_sm * (cw + 4) * 32 * hk.maxnreg_for(cw, per_sm) <= 65536


def test_hopper_block_m_is_one_rule():
    """The C++ plan's BLOCK_M (the grid) and the build's (the compiled kernel) are one rule:
    16 rows per consumer warp, over the two warpgroups that split D above D=256; a D split
    with other than 8 consumer warps is refused by name."""
    from torch_tree_attn.backends.cuda import hopper_kernels as hk

    for D, (cw, bn, stages) in hk.DEFAULT_CONFIG.items():
        plan = _C.hopper_plan(D, 256, 8, 4096 + 64, 64, 132, None)
        assert plan.block_m == hk.block_m_for(D, cw) == (64 if D == 512 else 16 * cw)
    with pytest.raises(ValueError, match="head dim 512 needs 8 consumer warps .*got 4"):
        hk.block_m_for(512, 4)


@pytest.mark.parametrize("name", USER_CALLS)
def test_hopper_is_chosen_on_sm90_for_what_it_covers(name):
    """auto: the Hopper kernel on sm_90 for float16/bfloat16 calls with D in its table (and
    K/V that TMA can address), the Triton kernel everywhere else; 'triton' forces the
    portable kernel; 'hopper' raises for a call it does not cover, naming why."""
    call = _call(**USER_CALLS[name])
    q = call[0]
    covered = q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in _C.hopper_table()
    plan, main, _ = _C.cuda_plan_launch(*call, arch=90, num_sms=132, kernel="auto")
    assert (plan.kernel, main["kind"]) == (("hopper", 2) if covered else ("triton", 0))
    assert (_C.cuda_hopper_why_not(*call) == "") == covered
    for arch in (80, 89, 100):
        plan, main, _ = _C.cuda_plan_launch(*call, arch=arch, num_sms=132, kernel="auto")
        assert (plan.kernel, main["kind"]) == ("triton", 0)
        assert "sm_90" in _C.cuda_hopper_why_not(*call, arch=arch)
    plan, main, _ = _C.cuda_plan_launch(*call, arch=90, num_sms=132, kernel="triton")
    assert (plan.kernel, main["kind"]) == ("triton", 0)
    if covered:
        # A Triton tile override implies the Triton kernel.
        plan, _, _ = _C.cuda_plan_launch(*call, arch=90, num_sms=132, config=[64, 64, 4, 3])
        assert plan.kernel == "triton"
    else:
        with pytest.raises(ValueError, match="the Hopper kernel does not cover this call: (query|head dim)"):
            _C.cuda_plan_launch(*call, arch=90, num_sms=132, kernel="hopper")


def test_hopper_falls_back_where_tma_cannot_address_the_cache():
    q, k, v, m, off, *rest = _call(P=1000)
    assert _C.cuda_hopper_why_not(q, k, v, m, off) == ""
    # K rows 129 elements apart (258 bytes): not a 16-byte multiple.
    k_odd = torch.randn(k.shape[0], k.shape[1], k.shape[2], 129, dtype=k.dtype)[..., :128]
    why = _C.cuda_hopper_why_not(q, k_odd, v, m, off)
    assert "key's strides" in why and "16-byte" in why
    plan, main, _ = _C.cuda_plan_launch(q, k_odd, v, m, off, *rest, arch=90, num_sms=132, kernel="auto")
    assert plan.kernel == "triton" and main["kind"] == 0
    # A base one element past a 16-byte boundary.
    flat = torch.randn(k.numel() + 8, dtype=k.dtype)
    v_off = flat[1:1 + k.numel()].view(k.shape)
    assert "value's data pointer is not 16-byte aligned" in _C.cuda_hopper_why_not(q, k, v_off, m, off)
    # Mixed dtypes (a float32 query over a bf16 cache) and empty caches.
    assert "query Float" in _C.cuda_hopper_why_not(q.float(), k, v, m, off)
    with pytest.raises(ValueError, match="kernel must be 'auto', 'triton' or 'hopper', got 'cutlass'"):
        _C.cuda_plan_launch(q, k, v, m, off, arch=90, num_sms=132, kernel="cutlass")


@pytest.mark.parametrize("P,B,T,Hq", [(64, 1, 64, 32), (1024, 1, 64, 32), (4096, 1, 64, 32), (16384, 1, 64, 32),
                                      (65536, 1, 64, 32), (16384, 8, 64, 32), (16384, 1, 16, 32), (300, 2, 7, 8)])
def test_hopper_plan_is_the_kernels_model(P, B, T, Hq):
    """The C++ Hopper plan (splits, window units, grid) is the one hopper_kernels' Python launcher
    and its CPU tiling model use (hopper_kernels.choose_splits), and every key is covered."""
    from torch_tree_attn.backends.cuda import hopper_kernels as hk

    call = _call(B=B, T=T, P=P, Hq=Hq)
    plan, main, reduce = _C.cuda_plan_launch(*call, arch=90, num_sms=132, kernel="auto")
    cw, bn, stages = hk.DEFAULT_CONFIG[128]
    S, M, G = P + T, T, Hq // 8
    assert (plan.kernel, plan.block_m, plan.block_n, plan.num_warps, plan.num_stages) == ("hopper", 16 * cw, bn, cw,
                                                                                          stages)
    assert plan.row_blocks == -(-G * T // (16 * cw))
    splits, window_units = hk.choose_splits(S, M, plan.row_blocks * B * 8, 132, bn, per_sm=hk.programs_per_sm(128, cw, bn, stages))
    assert (plan.num_splits, plan.window_units) == (splits, window_units)
    assert main == dict(main, kind=2, block_m=16 * cw, block_n=bn, block_d=128, window_n=0, num_warps=cw,
                        num_stages=stages, skip_unseen=0, aligned=1, wide=0)
    assert (reduce is None) == (splits == 1)
    covered = []
    for split in range(plan.num_splits):
        t_lo, t_hi, _, kend = hk.program_tiles(P, S, M, split, plan.num_splits, plan.window_units, bn)
        covered += list(range(t_lo, t_hi))
    assert covered == list(range(-(-S // bn)))


def test_hopper_ptx_parameters_are_the_launchers(tmp_path):
    """The Hopper kernel's parameter list, as ptxas sees it, is what csrc/cuda/tree_attn_cuda.cpp
    passes: Q, K's tensor map (128 bytes, 64-aligned) with 4 int32 dims and 4 int64 strides,
    V's likewise, 8 pointers, Q's 3 and the mask's 4 strides, 11 sizes, 2 floats, Triton's
    scratch pointers; and the build records the tensor maps' encoding in the manifest."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    import re

    tc = _spec_fields()
    for wide in (0, 1):
        spec = dict.fromkeys(tc.SPEC_FIELDS, 0)
        spec.update(kind=tc.HOPPER, arch=90, q_dtype=tc.DTYPE_CODES["fp16"], kv_dtype=tc.DTYPE_CODES["fp16"],
                    head_dim=64, block_m=128, block_n=64, block_d=64, num_warps=8, num_stages=4, aligned=1,
                    wide=wide)
        compiled = tc.compile_spec(spec)
        ptx = compiled.asm["ptx"]
        entry = ptx[ptx.index(".entry"):ptx.index(")", ptx.index(".entry"))]
        kinds = re.findall(r"\.param (\.u64 \.ptr|\.align 64 \.b8|\.u32|\.u64|\.f32)", entry)
        i = "u64" if wide else "u32"
        desc = [".align 64 .b8"] + [".u32"] * 4 + [".u64"] * 4
        want = ([".u64 .ptr"] + desc + desc + [".u64 .ptr"] * 8 + ["." + i] * (3 + 4 + 11) + [".f32"] * 2
                + [".u64 .ptr"] * tc.binary_of(compiled).scratch_args)
        assert kinds == want
        b = tc.binary_of(compiled)
        assert b.num_warps == 12 and b.function == "_tree_attn_main_sm90"
        assert [t["data_type"] for t in b.tma] == [6, 6]      # CU_TENSOR_MAP_DATA_TYPE_FLOAT16
        assert all(t["swizzle"] == 3 and t["elem_size"] == 2 and t["block"] == [1, 1, 64, 64] for t in b.tma)
    bf = dict(spec, q_dtype=tc.DTYPE_CODES["bf16"], kv_dtype=tc.DTYPE_CODES["bf16"], wide=0)
    manifest = build_kernels.build([90], tmp_path, jobs=1, log=lambda *_: None, specs=[bf])
    (entry,) = manifest["kernels"]
    assert entry["file"].startswith("hopper_sm90_bf16_bf16_d64")
    assert [t["data_type"] for t in entry["tma"]] == [9, 9]   # CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
    _C.cuda_register_kernel(entry["spec"], b"", str(tmp_path / entry["file"]), entry["function"], entry["shared"],
                            entry["num_warps"], entry["scratch_args"], True, entry["tma"])
    assert _C.cuda_kernel_origin(entry["spec"]) == "prebuilt"
    with pytest.raises(ValueError, match="block must have 4 dims"):
        _C.cuda_register_kernel(dict(entry["spec"], num_stages=9), b"\0", "", "f", 0, 12, 2, False,
                                [dict(data_type=9, elem_size=2, swizzle=3, block=[64, 64])])


def test_prebuilt_table_has_the_hopper_kernels():
    specs = build_kernels.prebuilt_specs([90])
    hopper = [s for s in specs if s["kind"] == 2]
    if not build_kernels.have_gluon():
        assert hopper == []
        pytest.skip("triton without Gluon's Hopper module: no Hopper kernels to prebuild")
    assert len(hopper) == 2 * len(_C.hopper_table()) * 4
    assert not [s for s in build_kernels.prebuilt_specs([80]) if s["kind"] == 2]


def test_cuda_entry_rejects_cpu_tensors():
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        _C.cuda_forward_with_lse(*_call(P=64))


def _unique_spec(**over):
    tc = _spec_fields()
    spec = dict.fromkeys(tc.SPEC_FIELDS, 0)
    spec.update(kind=tc.MAIN, arch=1, head_dim=64, block_m=16, block_n=16, block_d=64, window_n=16, num_warps=1,
                num_stages=1)
    spec.update(over)
    return spec


def test_registry_origin_and_stats():
    spec = _unique_spec(num_stages=7)
    assert _C.cuda_kernel_origin(spec) == "missing"
    before = _C.cuda_registry_stats()
    _C.cuda_register_kernel(spec, b"", "/nonexistent.cubin", "f", 0, 4, 2, True)
    assert _C.cuda_kernel_origin(spec) == "prebuilt"
    assert _C.cuda_registry_stats()["prebuilt"] == before["prebuilt"] + 1
    _C.cuda_register_kernel(spec, b"\0", "", "f", 0, 4, 2, False)
    assert _C.cuda_kernel_origin(spec) == "compiled"
    with pytest.raises(ValueError, match="lacks field 'wide'"):
        _C.cuda_kernel_origin({k: v for k, v in spec.items() if k != "wide"})
    with pytest.raises(ValueError, match="cubin or a path"):
        _C.cuda_register_kernel(_unique_spec(num_stages=8), b"", "", "f", 0, 4, 2, True)


@needs_triton
def test_build_manifest_and_registration(tmp_path, monkeypatch):
    """The build compiles specs for sm_90 without a GPU into cubins plus a manifest the
    package registers; an up-to-date build is skipped; a manifest of other spec fields is
    refused with a clear error."""
    pytest.importorskip("triton.backends.nvidia")
    tc = _spec_fields()
    specs = [s for s in build_kernels.prebuilt_specs([90])
             if s["head_dim"] == 64 and s["q_dtype"] == tc.DTYPE_CODES["fp16"] and s["block_m"] == 16
             and not (s["mask_float"] or s["softcap"] or s["skip_unseen"])]
    specs += [s for s in build_kernels.prebuilt_specs([90]) if s["kind"] == tc.REDUCE and s["head_dim"] == 64
              and s["q_dtype"] == tc.DTYPE_CODES["fp16"]]
    assert len(specs) == 2
    logs = []
    manifest = build_kernels.build([90], tmp_path, jobs=1, log=logs.append, specs=specs)
    assert [k["spec"] for k in manifest["kernels"]] == specs
    for k in manifest["kernels"]:
        assert (tmp_path / k["file"]).stat().st_size > 1000
        assert k["function"] in ("_tree_attn_main", "_tree_attn_reduce") and k["scratch_args"] in (1, 2)
    build_kernels.build([90], tmp_path, jobs=1, log=logs.append, specs=specs)
    assert "up to date" in logs[-1]
    entries = cuda_backend.load_manifest(tmp_path / "manifest.json")
    for entry in entries:
        _C.cuda_register_kernel(entry["spec"], b"", str(tmp_path / entry["file"]), entry["function"],
                                entry["shared"], entry["num_warps"], entry["scratch_args"], True)
        assert _C.cuda_kernel_origin(entry["spec"]) == "prebuilt"
    bad = json.loads((tmp_path / "manifest.json").read_text())
    bad["spec_fields"] = bad["spec_fields"][:-1]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(RuntimeError, match="rebuild the package"):
        cuda_backend.load_manifest(tmp_path / "bad.json")


def test_archs_from_env(monkeypatch):
    monkeypatch.setenv("TORCH_TREE_ATTN_CUDA_ARCHS", "sm_80; 90")
    assert build_kernels.archs_from_env() == (80, 90)
    monkeypatch.setenv("TORCH_TREE_ATTN_CUDA_ARCHS", "none")
    assert build_kernels.archs_from_env() == ()
    monkeypatch.delenv("TORCH_TREE_ATTN_CUDA_ARCHS")
    assert build_kernels.archs_from_env() == (build_kernels.DEFAULT_ARCHS if torch.version.cuda and HAVE_TRITON
                                              else ())


def test_compile_hook_without_triton_names_the_spec(monkeypatch):
    """Without triton, a spec outside the prebuilt table raises naming it and the fix."""
    monkeypatch.setitem(sys.modules, "triton", None)   # import triton -> ImportError
    with pytest.raises(RuntimeError, match="no prebuilt CUDA kernel fits .* pip install 'triton>=3.6'"):
        cuda_backend.compile_for_launcher(_unique_spec())


CUDA_H = [p for p in (pathlib.Path("/usr/local/cuda/include/cuda.h"), pathlib.Path("/usr/include/cuda.h"))
          if p.is_file()]


@pytest.mark.skipif(not CUDA_H or shutil.which("c++") is None, reason="no cuda.h (CUDA toolkit) or no C++ compiler")
def test_driver_declarations_match_cuda_h(tmp_path):
    """csrc/cuda/driver.h declares the driver API by hand (the extension needs no CUDA
    headers): its constants and function types must be cuda.h's."""
    names = ["CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT", "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR",
             "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR", "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN",
             "CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES", "CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES", "CU_FUNC_ATTRIBUTE_NUM_REGS",
             "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES", "CU_FUNC_CACHE_PREFER_SHARED",
             "CU_TENSOR_MAP_DATA_TYPE_FLOAT16", "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16", "CU_TENSOR_MAP_INTERLEAVE_NONE",
             "CU_TENSOR_MAP_SWIZZLE_128B", "CU_TENSOR_MAP_L2_PROMOTION_L2_128B", "CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE"]
    funcs = ["cuInit", "cuGetErrorString", "cuDeviceGet", "cuDeviceGetAttribute", "cuDevicePrimaryCtxRetain",
             "cuCtxGetCurrent", "cuCtxSetCurrent", "cuModuleLoadData", "cuModuleGetFunction", "cuFuncGetAttribute",
             "cuFuncSetAttribute", "cuFuncSetCacheConfig", "cuLaunchKernel", "cuTensorMapEncodeTiled"]
    src = ['#include <cuda.h>', '#include <type_traits>', '#include "cuda/driver.h"',
           'namespace d = tree_attn::cuda_driver;']
    src += [f'static_assert(int(::{n}) == d::{n}, "{n}");' for n in names]
    src += ['static_assert(sizeof(d::CUdeviceptr) == sizeof(::CUdeviceptr), "CUdeviceptr");',
            'static_assert(sizeof(d::CUdevice) == sizeof(::CUdevice), "CUdevice");',
            'static_assert(sizeof(d::CUtensorMap) == sizeof(::CUtensorMap), "CUtensorMap size");',
            'static_assert(alignof(d::CUtensorMap) == alignof(::CUtensorMap), "CUtensorMap alignment");',
            'static_assert(std::is_same_v<std::underlying_type_t<::CUresult>, unsigned> || sizeof(::CUresult) == sizeof(d::CUresult), "CUresult");']
    # Each function pointer type has the real function's arity and parameter sizes.
    src += ['template <class R, class... A> constexpr int arity(R (*)(A...)) { return sizeof...(A); }']
    src += [f'static_assert(arity(&::{f}) == arity(d::Driver{{}}.{f}), "{f}");' for f in funcs]
    (tmp_path / "abi.cpp").write_text("\n".join(src) + "\n")
    r = subprocess.run(["c++", "-std=c++17", "-fsyntax-only", f"-I{CUDA_H[0].parent}", f"-I{ROOT / 'csrc'}",
                        str(tmp_path / "abi.cpp")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
