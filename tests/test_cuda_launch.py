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
from torch_tree_attn import _C, triton_backend
from torch_tree_attn import triton_heuristics as heur

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "csrc" / "cuda"))
import build_kernels  # noqa: E402

HAVE_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install -e '.[test]')")


def _spec_fields():
    # triton_compile imports no triton at module level: its field list is checkable anywhere.
    from torch_tree_attn import triton_compile

    return triton_compile


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
}


@pytest.mark.parametrize("arch", build_kernels.DEFAULT_ARCHS)
@pytest.mark.parametrize("name", USER_CALLS)
def test_prebuilt_table_covers_user_calls(name, arch):
    """No compilation on a user's first call: every kernel such a call launches is in the
    prebuilt table (the table the build compiles, by spec)."""
    table = {tuple(sorted(s.items())) for s in build_kernels.prebuilt_specs([arch])}
    plan, main, reduce = _C.cuda_plan_launch(*_call(**USER_CALLS[name]), arch=arch, num_sms=132 if arch == 90 else 108)
    assert tuple(sorted(main.items())) in table, f"main kernel not prebuilt: {main}"
    if plan.num_splits > 1:
        assert tuple(sorted(reduce.items())) in table, f"reduce kernel not prebuilt: {reduce}"


def test_plan_launch_is_the_plan_and_flags_what_the_kernels_need():
    plan, main, reduce = _C.cuda_plan_launch(*_call(P=16384), arch=90, num_sms=132)
    ref = heur.choose(128, True, 4 * 64, 8, 16384 + 64, 64, 132, T=64)
    assert (plan.block_m, plan.block_n, plan.num_splits, plan.window_units) == (
        ref.block_m, ref.block_n, ref.num_splits, ref.window_units)
    assert main["aligned"] == 1 and main["wide"] == 0 and main["skip_unseen"] == 0 and reduce["kind"] == 1
    # One split: no reduce kernel.
    plan, _, reduce = _C.cuda_plan_launch(*_call(P=64), arch=90, num_sms=132)
    assert plan.num_splits == 1 and reduce is None
    # Forced splits and tiles reach the plan; a bad config is a ValueError naming it.
    plan, main, _ = _C.cuda_plan_launch(*_call(), arch=90, num_sms=132, num_splits=5, config=[32, 64, 4, 2])
    assert plan.num_splits == 5 and main["block_m"] == 32 and main["num_stages"] == 2
    with pytest.raises(ValueError, match="window sub-tile"):
        _C.cuda_plan_launch(*_call(), arch=90, num_sms=132, config=[64, 64, 4, 3, 24])
    # A query row stride not divisible by 16 elements: the unaligned variant.
    q, k, v, m, off, *rest = _call(T=8, D=64, Hq=4, Hkv=1, P=100)
    q_odd = torch.randn(1, 4, 8, 72, dtype=q.dtype)[..., :64]
    _, main, _ = _C.cuda_plan_launch(q_odd, k, v, m, off, *rest, arch=90, num_sms=132)
    assert main["aligned"] == 0
    # A tree mask of any T is fine for the aligned variant (the mask is not specialised).
    _, main, _ = _C.cuda_plan_launch(*_call(T=61), arch=90, num_sms=132)
    assert main["aligned"] == 1
    # The contract's validation runs first, with its messages.
    q, k, v, m, *_ = _call()
    with pytest.raises(ValueError, match="mask query size"):
        _C.cuda_plan_launch(q, k, v, m[:, :5], arch=90, num_sms=132)


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
    entries = triton_backend.load_manifest(tmp_path / "manifest.json")
    for entry in entries:
        _C.cuda_register_kernel(entry["spec"], b"", str(tmp_path / entry["file"]), entry["function"],
                                entry["shared"], entry["num_warps"], entry["scratch_args"], True)
        assert _C.cuda_kernel_origin(entry["spec"]) == "prebuilt"
    bad = json.loads((tmp_path / "manifest.json").read_text())
    bad["spec_fields"] = bad["spec_fields"][:-1]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(RuntimeError, match="rebuild the package"):
        triton_backend.load_manifest(tmp_path / "bad.json")


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
        triton_backend.compile_for_launcher(_unique_spec())


CUDA_H = [p for p in (pathlib.Path("/usr/local/cuda/include/cuda.h"), pathlib.Path("/usr/include/cuda.h"))
          if p.is_file()]


@pytest.mark.skipif(not CUDA_H or shutil.which("c++") is None, reason="no cuda.h (CUDA toolkit) or no C++ compiler")
def test_driver_declarations_match_cuda_h(tmp_path):
    """csrc/cuda/driver.h declares the driver API by hand (the extension needs no CUDA
    headers): its constants and function types must be cuda.h's."""
    names = ["CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT", "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR",
             "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR", "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN",
             "CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES", "CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES", "CU_FUNC_ATTRIBUTE_NUM_REGS",
             "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES", "CU_FUNC_CACHE_PREFER_SHARED"]
    funcs = ["cuInit", "cuGetErrorString", "cuDeviceGet", "cuDeviceGetAttribute", "cuDevicePrimaryCtxRetain",
             "cuCtxGetCurrent", "cuCtxSetCurrent", "cuModuleLoadData", "cuModuleGetFunction", "cuFuncGetAttribute",
             "cuFuncSetAttribute", "cuFuncSetCacheConfig", "cuLaunchKernel"]
    src = ['#include <cuda.h>', '#include <type_traits>', '#include "cuda/driver.h"',
           'namespace d = tree_attn::cuda_driver;']
    src += [f'static_assert(int(::{n}) == d::{n}, "{n}");' for n in names]
    src += ['static_assert(sizeof(d::CUdeviceptr) == sizeof(::CUdeviceptr), "CUdeviceptr");',
            'static_assert(sizeof(d::CUdevice) == sizeof(::CUdevice), "CUdevice");',
            'static_assert(std::is_same_v<std::underlying_type_t<::CUresult>, unsigned> || sizeof(::CUresult) == sizeof(d::CUresult), "CUresult");']
    # Each function pointer type has the real function's arity and parameter sizes.
    src += ['template <class R, class... A> constexpr int arity(R (*)(A...)) { return sizeof...(A); }']
    src += [f'static_assert(arity(&::{f}) == arity(d::Driver{{}}.{f}), "{f}");' for f in funcs]
    (tmp_path / "abi.cpp").write_text("\n".join(src) + "\n")
    r = subprocess.run(["c++", "-std=c++17", "-fsyntax-only", f"-I{CUDA_H[0].parent}", f"-I{ROOT / 'csrc'}",
                        str(tmp_path / "abi.cpp")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
