"""The MPS backend on a real Apple GPU: our Metal kernels, encoded into PyTorch's MPS
stream by csrc/metal/tree_attn_mps.mm.

Skipped wherever MPS is unavailable (Linux, CI): there the Objective-C++ is checked by
tests/test_objc_syntax.py and the shaders by the simulator (tests/test_metal_sim.py).
What only this file and tests/test_contract.py's mps items (the parity matrix, forward vs
forward_with_lse, the bad-input and non-finite tables) prove: that Metal compiles the
shaders, that the kernels are right on a GPU, and that the op coexists with PyTorch's own
kernels in one command encoder.

On an Apple-silicon Mac (macOS 14+), after the README's set-up command:

    .venv/bin/python -m pytest -q tests/test_mps.py tests/test_contract.py -k "mps"
    .venv/bin/python benchmarks/bench_op.py --device mps   # timings against SDPA on MPS

Every reference is computed in float64 on the CPU from the same inputs (MPS has no
float64).
"""
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

import torch_tree_attn
from tests.cases import (args_of, Case, check_clamped_offsets, check_against_reference, check_empty_problem,
                         check_sliced_inputs, check_validation_errors, make_inputs)
from torch_tree_attn.reference import tree_attention_reference

pytestmark = pytest.mark.skipif(
    not torch.backends.mps.is_available(),
    reason="MPS is not available (needs an Apple-silicon Mac and a PyTorch build with MPS)")

ROOT = pathlib.Path(__file__).resolve().parents[1]
ops = torch.ops.tree_attn


def to_mps(inputs: dict) -> dict:
    return {name: value.to("mps") if isinstance(value, torch.Tensor) else value for name, value in inputs.items()}



def run_mps(cpu_inputs: dict):
    out, lse = ops.forward_with_lse(*args_of(to_mps(cpu_inputs)))
    assert out.device.type == "mps" and lse.device.type == "mps"
    return out.cpu(), lse.cpu()


# Long prefixes, so the plan splits the keys across threadgroups and the reduce pass
# merges several splits; the visible range ends inside a split and inside a chunk.
SPLIT_CASES = [
    Case(B=2, Hq=32, Hkv=8, T=64, S=4096 + 64, D=128, dtype=torch.bfloat16, mask_kind="bool", seed=201),
    Case(B=2, Hq=8, Hkv=2, T=5, S=3000, D=64, dtype=torch.float32, mask_kind="float", seed=202,
         kv_layout="bshd", mask_shape="none", softcap=30.0),
    Case(B=1, Hq=8, Hkv=1, T=40, S=2500, D=256, dtype=torch.float16, mask_kind="float", window="dense",
         offsets="none", seed=203),
    # D = 512: the matrix kernel (G*T > 8) with 16 simdgroups, two per 8 rows (512 threads per threadgroup).
    Case(B=1, Hq=16, Hkv=4, T=32, S=3000, D=512, dtype=torch.float32, mask_kind="bool", seed=204),
    Case(B=1, Hq=8, Hkv=2, T=16, S=2000, D=512, dtype=torch.bfloat16, mask_kind="float", seed=205),
    # Sinks (gpt-oss) and a float32 query over a half-precision cache.
    Case(B=2, Hq=16, Hkv=2, T=24, S=3000, D=64, dtype=torch.bfloat16, mask_kind="bool", sinks=torch.float32,
         seed=206),
    Case(B=1, Hq=8, Hkv=2, T=20, S=2500, D=128, dtype=torch.float32, kv_dtype=torch.float16, mask_kind="float",
         kv_layout="bshd", sinks=torch.bfloat16, seed=207),
    Case(B=1, Hq=8, Hkv=8, T=8, S=2200, D=256, dtype=torch.float32, kv_dtype=torch.bfloat16, mask_kind="bool",
         seed=208),
]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=str)
def test_long_prefix(case):
    inputs = make_inputs(case)
    out, lse = run_mps(inputs)
    check_against_reference(out, lse, inputs)


@pytest.mark.parametrize("offset_dtype", [torch.int32, torch.int64])
def test_offsets_on_device(offset_dtype):
    case = Case(B=3, Hq=8, Hkv=2, T=7, S=90, D=128, dtype=torch.float16, offsets="varied",
                offset_dtype=offset_dtype, seed=301)
    inputs = make_inputs(case)
    assert inputs["mask_offset"].dtype == offset_dtype
    out, lse = run_mps(inputs)
    check_against_reference(out, lse, inputs)


@pytest.mark.parametrize("offset_dtype", [torch.int32, torch.int64])
def test_out_of_range_offsets_are_clamped(offset_dtype):
    """(int32 offsets reach the kernel as given, int64 ones are saturated to int32 first.)"""
    check_clamped_offsets(run_mps, offset_dtype)


def test_sliced_inputs_use_their_storage_offset():
    check_sliced_inputs("mps")


def test_deterministic():
    case = Case(B=1, Hq=32, Hkv=8, T=64, S=2048 + 64, D=128, dtype=torch.float16, seed=304)
    mps_inputs = to_mps(make_inputs(case))
    first = ops.forward_with_lse(*args_of(mps_inputs))
    second = ops.forward_with_lse(*args_of(mps_inputs))
    assert torch.equal(first[0].cpu(), second[0].cpu()) and torch.equal(first[1].cpu(), second[1].cpu())


def test_public_api_on_mps():
    case = Case(B=2, Hq=4, Hkv=2, T=5, S=30, D=64, dtype=torch.bfloat16, seed=305)
    inputs = make_inputs(case)
    m = to_mps(inputs)
    out, lse = torch_tree_attn.tree_attention(m["query"], m["key"], m["value"], m["mask"], m["mask_offset"],
                                              return_lse=True)
    check_against_reference(out.cpu(), lse.cpu(), inputs)


def test_empty_problem():
    check_empty_problem("mps")


def test_validation_errors_name_the_argument():
    q, kv, mask = check_validation_errors("mps")
    with pytest.raises(TypeError, match="share one dtype"):
        ops.forward(q, kv.half(), kv.half(), mask, None, None, None)


def test_torch_compile_fullgraph():
    case = Case(B=2, Hq=8, Hkv=2, T=5, S=40, D=128, dtype=torch.float16, mask_kind="float", seed=306)
    inputs = make_inputs(case)
    m = to_mps(inputs)

    @torch.compile(fullgraph=True)
    def layer(q, k, v, mask, offsets):
        out, lse = torch_tree_attn.tree_attention(torch.sin(q), k, v, mask, offsets, return_lse=True)
        return out * 2, lse

    out, lse = layer(m["query"], m["key"], m["value"], m["mask"], m["mask_offset"])
    expected = dict(inputs, query=torch.sin(inputs["query"].float()).to(case.dtype))
    ref_out, ref_lse = tree_attention_reference(**expected)
    torch.testing.assert_close((out.cpu() / 2).double(), ref_out.to(case.dtype).double(), atol=4e-3, rtol=4e-3)
    torch.testing.assert_close(lse.cpu().double(), ref_lse, atol=2e-3, rtol=1e-3)


def test_opcheck():
    case = Case(B=2, Hq=4, Hkv=1, T=5, S=30, D=64, seed=307)
    args = args_of(to_mps(make_inputs(case)))
    torch.library.opcheck(ops.forward.default, args)
    torch.library.opcheck(ops.forward_with_lse.default, args)


# Runs in a child process: if our encoding clashed with PyTorch's encoder, Metal would
# abort the whole process ("A command encoder is already encoding to this command
# buffer"), which must show as a failure here rather than kill the test run.
INTERLEAVING_SCRIPT = textwrap.dedent("""
    import torch
    import torch_tree_attn
    from tests.cases import Case, make_inputs
    from torch_tree_attn.reference import tree_attention_reference

    case = Case(B=2, Hq=8, Hkv=2, T=6, S=70, D=128, dtype=torch.float32, mask_kind="bool", seed=308)
    cpu = make_inputs(case)
    m = {k: v.to("mps") if isinstance(v, torch.Tensor) else v for k, v in cpu.items()}
    ref, _ = tree_attention_reference(**dict(cpu, query=torch.sin(cpu["query"])))
    outs = []
    for step in range(20):
        # PyTorch kernels before and after ours, all coalesced into one encoder, with no
        # synchronisation in between; the first call also compiles the pipelines.
        q = torch.sin(m["query"])
        out = torch.ops.tree_attn.forward(q, m["key"], m["value"], m["mask"], m["mask_offset"], None, None)
        outs.append(torch.sin(out) + step)
        if step % 5 == 4:
            torch.mps.synchronize()
    torch.mps.synchronize()
    for step, o in enumerate(outs):
        expected = torch.sin(ref.float()) + step
        torch.testing.assert_close(o.cpu(), expected, atol=1e-4, rtol=1e-4)
    print("interleaving ok")
""")


def test_interleaving_with_pytorch_mps_kernels():
    result = subprocess.run([sys.executable, "-c", INTERLEAVING_SCRIPT], capture_output=True, text=True,
                            timeout=600, cwd=str(ROOT))
    assert "already encoding" not in result.stderr, result.stderr
    assert result.returncode == 0 and "interleaving ok" in result.stdout, result.stdout + result.stderr
