"""The CUDA backend (Triton kernels, and on sm_90 the Hopper Gluon kernel, launched from C++,
csrc/cuda/) on a real GPU.

Skipped without CUDA (and triton). On the H200: benchmarks/h200.sh runs this file first,
then tests/test_contract.py's cuda items (the whole parity matrix, forward vs
forward_with_lse, the bad-input and non-finite tables) in parallel shards.
What this file proves beyond tests/test_triton.py (the same kernels under Triton's
interpreter): key splits and forced split counts, that a call
never syncs with the host, CUDA-graph capture and replay with new offsets, torch.compile
without recompiles, opcheck, the launch on the caller's stream, and that a fresh process
compiles nothing for a call the prebuilt table covers while one it does not is compiled
once per process. References are float64 on the CPU from the same inputs.
"""
import importlib.util
import os

import pytest
import torch

import torch_tree_attn
from tests.cases import (SOFTCAPS, Case, check_clamped_offsets, check_empty_problem, check_sliced_inputs,
                         check_softcap_at_any_cap, check_validation_errors, extreme_finite_checks, args_of,
                         check_against_reference, make_inputs, random_tree_mask)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
    reason="needs CUDA and triton (the CUDA backend's kernels are Triton)")

ops = torch.ops.tree_attn


def to_cuda(inputs: dict) -> dict:
    return {n: t.cuda() if isinstance(t, torch.Tensor) else t for n, t in inputs.items()}


def run_cuda(cpu_inputs: dict):
    out, lse = ops.forward_with_lse(*args_of(to_cuda(cpu_inputs)))
    assert out.is_cuda and lse.is_cuda
    return out.cpu(), lse.cpu()


def test_registered():
    from torch_tree_attn import _C
    from torch_tree_attn.backends import cuda as cuda_backend

    assert cuda_backend._registered
    for op in ("tree_attn::forward", "tree_attn::forward_with_lse"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA"), op
    assert cuda_backend.load_manifest(), "no prebuilt CUDA kernels: the install did not build them"
    assert _C.cuda_registry_stats()["prebuilt"] == len(cuda_backend.load_manifest())


FRESH_PROCESS = r"""
import json, torch, torch_tree_attn
from torch_tree_attn import _C
from tests.cases import Case, args_of, check_against_reference, make_inputs
cases = [Case(B=1, Hq=32, Hkv=8, T=64, S=1024 + 64, D=128, dtype=torch.bfloat16, seed=1),
         Case(B=2, Hq=32, Hkv=8, T=60, S=3000, D=128, dtype=torch.float16, seed=2),
         Case(B=1, Hq=16, Hkv=8, T=48, S=2000, D=256, dtype=torch.bfloat16, mask_kind="float", softcap=50.0, seed=3),
         Case(B=1, Hq=64, Hkv=8, T=64, S=1500, D=64, dtype=torch.bfloat16, sinks=torch.float32, seed=4)]
for case in cases:
    inputs = make_inputs(case)
    cuda = {n: t.cuda() if isinstance(t, torch.Tensor) else t for n, t in inputs.items()}
    out, lse = torch.ops.tree_attn.forward_with_lse(*args_of(cuda))
    check_against_reference(out.cpu(), lse.cpu(), inputs)
print(json.dumps(_C.cuda_registry_stats()))
"""


def test_fresh_process_compiles_nothing_for_prebuilt_calls():
    """Llama/Qwen (bf16, fp16, EAGLE's 60-node tree), Gemma 2 (D=256, softcap) and gpt-oss
    (D=64, sinks) verify calls in a new process: right, and no kernel compiled."""
    import json
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, "-c", FRESH_PROCESS], cwd=str(root), env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    assert stats["compiled"] == 0 and stats["loaded"] >= 4, stats


def test_fallback_compiles_once_per_process():
    """A call outside the prebuilt table (float32 query, D=96) is compiled once, then reused."""
    from torch_tree_attn import _C

    case = Case(B=1, Hq=4, Hkv=2, T=9, S=300, D=96, dtype=torch.float32, seed=11)
    inputs = make_inputs(case)
    before = _C.cuda_registry_stats()["compiled"]
    out, lse = run_cuda(inputs)
    check_against_reference(out, lse, inputs)
    after = _C.cuda_registry_stats()["compiled"]
    assert after <= before + 2    # its main pass and, if the keys split, its reduce pass
    out2, _ = run_cuda(inputs)
    assert _C.cuda_registry_stats()["compiled"] == after and torch.equal(out, out2)


def test_launches_on_the_current_stream():
    """The kernels run on the caller's current stream: work queued on a side stream before
    the call is seen by it, and the result is ready when that stream is."""
    case = LONG_CASES[0]
    inputs = make_inputs(case)
    cuda = to_cuda(inputs)
    side = torch.cuda.Stream()
    q_side = torch.zeros_like(cuda["query"])
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)                      # keep the side stream busy
        q_side.copy_(cuda["query"])                        # only then is q_side the query
        cuda_side = dict(cuda, query=q_side)
        out, lse = ops.forward_with_lse(*args_of(cuda_side))
    side.synchronize()
    check_against_reference(out.cpu(), lse.cpu(), inputs)


def _arch():
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def _run_kernel(kernel):
    from torch_tree_attn.backends import cuda as cuda_backend

    def run(cpu_inputs):
        out, lse = cuda_backend.forward_with_lse(*args_of(to_cuda(cpu_inputs)), kernel=kernel)
        return out.cpu(), lse.cpu()
    return run


def test_hopper_kernel_is_chosen_on_sm90_and_agrees_with_triton():
    """(tests/test_contract.py's cuda backend runs the parity matrix on the default kernel choice,
    "auto": on sm_90 the Hopper kernel wherever it covers; cuda-triton on the Triton kernel.) On sm_90 a bf16/fp16 D=64/128/256/512 verify call takes the Hopper kernel (else the Triton
    kernel), both match the reference and each other; forcing 'hopper' on a call it does not
    cover raises with the reason."""
    from torch_tree_attn import _C

    for case in (Case(B=1, Hq=32, Hkv=8, T=64, S=4096 + 64, D=128, dtype=torch.bfloat16, seed=31),
                 Case(B=2, Hq=16, Hkv=4, T=60, S=3000, D=64, dtype=torch.float16, mask_kind="float", softcap=30.0,
                      sinks=torch.float32, seed=32),
                 Case(B=1, Hq=16, Hkv=8, T=64, S=2000, D=256, dtype=torch.bfloat16, mask_kind="float", softcap=50.0,
                      seed=34),  # Gemma 2's shape: one program per SM
                 Case(B=1, Hq=8, Hkv=2, T=64, S=1500, D=512, dtype=torch.bfloat16, mask_kind="float", softcap=30.0,
                      sinks=torch.float32, seed=35)):  # Gemma 4's global layers: two warpgroups split D
        inputs = make_inputs(case)
        cuda = to_cuda(inputs)
        plan, main, _ = _C.cuda_plan_launch(*args_of(cuda), arch=_arch(), kernel="auto",
                                            num_sms=torch.cuda.get_device_properties(0).multi_processor_count)
        assert plan.kernel == ("hopper" if _arch() == 90 else "triton")
        out_t, lse_t = _run_kernel("triton")(inputs)
        check_against_reference(out_t, lse_t, inputs)
        out_a, lse_a = _run_kernel("auto")(inputs)
        check_against_reference(out_a, lse_a, inputs)
        if _arch() == 90:
            out_h, lse_h = _run_kernel("hopper")(inputs)
            assert torch.equal(out_h, out_a) and torch.equal(lse_h, lse_a)
            torch.testing.assert_close(out_h.float(), out_t.float(), atol=3e-2, rtol=0)
            # (rows that see no key have lse -inf in both: assert_close holds equal infinities equal)
            torch.testing.assert_close(lse_h, lse_t, atol=1e-3, rtol=0)
    if _arch() == 90:
        inputs = make_inputs(Case(B=1, Hq=4, Hkv=2, T=8, S=200, D=96, dtype=torch.bfloat16, seed=33))
        with pytest.raises(ValueError,
                           match=r"Hopper kernel does not cover this call: head dim 96 \(covered: 64, 128, 256, 512\)"):
            _run_kernel("hopper")(inputs)


def test_kernel_choice_from_the_environment():
    """TORCH_TREE_ATTN_CUDA_KERNEL sets the process default; a bad value is a clear error."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    code = "import torch_tree_attn; from torch_tree_attn import _C; print(_C.cuda_kernel_choice())"
    for value, want in (("triton", "triton"), ("hopper", "hopper"), ("auto", "auto"), ("", "auto")):
        env = dict(os.environ, PYTHONPATH=str(root), TORCH_TREE_ATTN_CUDA_KERNEL=value)
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == want, proc.stderr[-2000:]
    env = dict(os.environ, PYTHONPATH=str(root), TORCH_TREE_ATTN_CUDA_KERNEL="cutlass")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "TORCH_TREE_ATTN_CUDA_KERNEL" in proc.stderr and "cutlass" in proc.stderr


# Long prefixes: keys split across programs and merged by the reduce pass; the visible range
# ends inside a split and inside a tile; every slot past off_b + M holds NaN.
LONG_CASES = [
    Case(B=2, Hq=32, Hkv=8, T=64, S=4096 + 64, D=128, dtype=torch.bfloat16, mask_kind="bool", seed=201),
    Case(B=2, Hq=8, Hkv=2, T=5, S=3000, D=64, dtype=torch.float32, mask_kind="float", seed=202,
         kv_layout="bshd", mask_shape="none", softcap=30.0, sinks=torch.float32),
    Case(B=1, Hq=8, Hkv=1, T=40, S=2500, D=256, dtype=torch.float16, mask_kind="float", window="dense",
         offsets="none", seed=203),
    Case(B=1, Hq=8, Hkv=2, T=16, S=3000, D=512, dtype=torch.bfloat16, seed=204, sinks=torch.bfloat16),
    Case(B=3, Hq=4, Hkv=1, T=9, S=5000, D=96, dtype=torch.float32, kv_dtype=torch.float16, seed=205),
    # A negative scale (Q negated by the launcher), with softcap; a zero scale.
    Case(B=2, Hq=8, Hkv=2, T=12, S=2000, D=128, dtype=torch.bfloat16, mask_kind="float", scale=-0.11,
         softcap=25.0, seed=207),
    Case(B=1, Hq=4, Hkv=1, T=9, S=1500, D=64, dtype=torch.float16, scale=0.0, seed=208),
    # More tree nodes than a block's rows: the window loop's skip test.
    Case(B=1, Hq=4, Hkv=2, T=100, S=1200, D=512, dtype=torch.bfloat16, seed=209),
]


@pytest.mark.parametrize("case", LONG_CASES, ids=str)
def test_long_prefix(case):
    inputs = make_inputs(case)
    out, lse = run_cuda(inputs)
    check_against_reference(out, lse, inputs)


@pytest.mark.parametrize("num_splits", [1, 2, 5, 64])
def test_forced_splits(num_splits):
    from torch_tree_attn.backends import cuda as cuda_backend

    inputs = make_inputs(LONG_CASES[0])
    out, lse = cuda_backend.forward_with_lse(*args_of(to_cuda(inputs)), num_splits=num_splits)
    check_against_reference(out.cpu(), lse.cpu(), inputs)


def test_nan_in_unused_cache_slots():
    """A static cache far larger than what is used, NaN/inf in every slot past off_b + M and
    in window keys no row sees: nothing of it reaches the output."""
    case = Case(B=2, Hq=16, Hkv=4, T=24, S=6000, D=128, dtype=torch.bfloat16, mask_kind="float", seed=206)
    inputs = make_inputs(case)
    offs = inputs["mask_offset"].tolist()
    seen = ~torch.isneginf(inputs["mask"].float())
    for b in range(case.B):
        inputs["value"][b, :, offs[b] + case.M:] = float("inf")
        for col in range(case.M):
            if not seen[b, :, col].any():
                inputs["key"][b, :, offs[b] + col] = float("nan")
    out, lse = run_cuda(inputs)
    check_against_reference(out, lse, inputs)
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_softcap_is_accurate_at_any_cap(softcap, scale):
    check_softcap_at_any_cap(run_cuda, softcap, scale)


def _run_cuda_split(num_splits):
    from torch_tree_attn.backends import cuda as cuda_backend

    def run(cpu_inputs):
        out, lse = cuda_backend.forward_with_lse(*args_of(to_cuda(cpu_inputs)), num_splits=num_splits)
        return out.cpu(), lse.cpu()
    return run


@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("name", [name for name, _ in extreme_finite_checks(None)])
def test_finite_extremes_stay_finite(name, num_splits):
    # Sinks, biases and scores up to float32's max: the contract's finite answer.
    dict(extreme_finite_checks(_run_cuda_split(num_splits)))[name]()


@pytest.mark.parametrize("offset_dtype", [torch.int32, torch.int64])
def test_out_of_range_offsets_are_clamped(offset_dtype):
    check_clamped_offsets(run_cuda, offset_dtype)


def test_no_host_sync():
    """A call never synchronises with the device (offsets are clamped in the kernel)."""
    case = Case(B=2, Hq=8, Hkv=2, T=7, S=3000, D=128, dtype=torch.bfloat16, sinks=torch.float32,
                offset_dtype=torch.int64, seed=307)
    m = to_cuda(make_inputs(case))
    ops.forward_with_lse(*args_of(m))  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.forward_with_lse(*args_of(m))
        ops.forward(*args_of(m))
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_sliced_inputs_use_their_storage_offset():
    check_sliced_inputs("cuda")


def test_deterministic():
    m = to_cuda(make_inputs(Case(B=1, Hq=32, Hkv=8, T=64, S=8192 + 64, D=128, dtype=torch.float16, seed=304)))
    first = ops.forward_with_lse(*args_of(m))
    second = ops.forward_with_lse(*args_of(m))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def _verify_step_inputs(B, P_max, T, gen, dtype=torch.bfloat16, Hq=8, Hkv=2, D=128):
    S = P_max + T
    q = torch.randn(B, Hq, T, D, generator=gen).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=gen).to(dtype)
    mask = torch.stack([random_tree_mask(T, gen) for _ in range(B)])
    return q, k, v, mask


def test_cuda_graph_capture_and_replay_with_new_offsets():
    gen = torch.Generator().manual_seed(11)
    B, T, P_max = 2, 16, 3000
    q, k, v, mask = _verify_step_inputs(B, P_max, T, gen)
    sinks = torch.randn(8, generator=gen)
    static = [t.cuda() for t in (q, k, v, mask, sinks)]
    offsets = torch.tensor([100, 2000], dtype=torch.int64, device="cuda")
    sq, sk, sv, smask, ssinks = static

    def step():
        return ops.forward_with_lse(sq, sk, sv, smask, offsets, None, None, ssinks)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = step()
    for new in ([100, 2000], [0, P_max], [2999, 7], [-3, 10 ** 6]):
        offsets.copy_(torch.tensor(new))
        sq.copy_(torch.randn(q.shape, generator=gen).to(q.dtype))
        graph.replay()
        torch.cuda.synchronize()
        eager_out, eager_lse = step()
        assert torch.equal(g_out, eager_out) and torch.equal(g_lse, eager_lse), f"replay differs at offsets {new}"
        if min(new) >= 0 and max(new) <= P_max:
            inputs = dict(query=sq.cpu(), key=sk.cpu(), value=sv.cpu(), mask=smask.cpu(), mask_offset=offsets.cpu(),
                          scale=None, softcap=None, sinks=ssinks.cpu())
            check_against_reference(g_out.cpu(), g_lse.cpu(), inputs)


def test_torch_compile_fullgraph_no_recompiles():
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(12)
    B, T, P_max = 2, 12, 1000
    q, k, v, mask = (t.cuda() for t in _verify_step_inputs(B, P_max, T, gen))

    @torch.compile(fullgraph=True)
    def layer(q, k, v, mask, offsets):
        out, lse = torch_tree_attn.tree_attention(torch.sin(q), k, v, mask, offsets, return_lse=True)
        return out * 2, lse

    offsets = torch.tensor([10, 500], device="cuda")
    layer(q, k, v, mask, offsets)
    with torch.compiler.set_stance("fail_on_recompile"):
        for new in ([0, 900], [333, 1], [P_max, P_max]):
            offsets = torch.tensor(new, device="cuda")
            out, lse = layer(q, k, v, mask, offsets)
            inputs = dict(query=torch.sin(q.float()).to(q.dtype).cpu(), key=k.cpu(), value=v.cpu(), mask=mask.cpu(),
                          mask_offset=offsets.cpu(), scale=None, softcap=None, sinks=None)
            check_against_reference((out / 2).cpu(), lse.cpu(), inputs)
    torch._dynamo.reset()


OPCHECK_CASES = [
    Case(B=2, Hq=4, Hkv=1, T=5, S=30, D=64, seed=307),
    Case(B=2, Hq=8, Hkv=2, T=5, S=400, D=128, dtype=torch.bfloat16, mask_kind="float", window="dense",
         sinks=torch.float32, softcap=20.0),
    Case(B=1, Hq=4, Hkv=4, T=3, S=20, D=96, dtype=torch.float32, kv_dtype=torch.float16, offset_dtype=torch.int32),
]


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=str)
def test_opcheck(case):
    args = args_of(to_cuda(make_inputs(case)))
    torch.library.opcheck(ops.forward.default, args)
    torch.library.opcheck(ops.forward_with_lse.default, args)


def test_validation_errors_name_the_argument():
    q, kv, mask = check_validation_errors("cuda")
    with pytest.raises(TypeError, match="dtypes"):
        ops.forward(q.half(), kv, kv, mask, None, None, None)  # (f32 over half K/V is legal)
    with pytest.raises(ValueError, match="sinks must be on the query's device"):
        ops.forward(q, kv, kv, mask, None, None, None, torch.zeros(4))


def test_empty_problem():
    check_empty_problem("cuda")


@pytest.mark.parametrize("op_name", ["forward", "forward_with_lse"])
def test_inputs_that_require_grad(op_name):
    """Defect 3 on the GPU: with inputs that require grad the forward works, eager and under
    torch.compile(fullgraph=True), and equals the no-grad call; backward raises naming the
    op and the input."""
    torch._dynamo.reset()
    inputs = to_cuda(make_inputs(Case(B=2, Hq=8, Hkv=2, T=9, S=700, D=128, dtype=torch.bfloat16, seed=41)))
    q = inputs["query"].clone().requires_grad_(True)
    op = getattr(ops, op_name)

    def f(query):
        return op(query, *args_of(inputs)[1:])

    expected = f(inputs["query"])
    for got in (f(q), torch.compile(f, fullgraph=True)(q)):
        out = got[0] if isinstance(got, tuple) else got
        assert out.requires_grad
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        with pytest.raises(RuntimeError, match=rf"tree_attn\.{op_name} has no backward \(asked for the gradient of 'query'\)"):
            out.float().sum().backward()
    torch._dynamo.reset()


def test_python_offsets_and_empty_heads():
    """Defect 4 on the GPU: tree_attention() takes a Python int or a list of ints as the
    offsets (same answer as the tensor); Hq = 0 or Hkv = 0 is rejected naming the shapes."""
    inputs = to_cuda(make_inputs(Case(B=2, Hq=8, Hkv=2, T=6, S=300, D=64, dtype=torch.float16, offsets="same",
                                      seed=42)))
    args = args_of(inputs)
    expected = ops.forward(*args)
    off = inputs["mask_offset"].tolist()
    for python_offsets in (off[0], off, tuple(off)):
        got = torch_tree_attn.tree_attention(*args[:4], python_offsets)
        assert torch.equal(got, expected), python_offsets
    q, k = inputs["query"], inputs["key"]
    with pytest.raises(ValueError, match=r"query must have at least one head \(Hq >= 1"):
        ops.forward(q[:, :0], k, k, inputs["mask"], inputs["mask_offset"])
    with pytest.raises(ValueError, match="got Hq=8 Hkv=0"):
        ops.forward(q, k[:, :0], k[:, :0], inputs["mask"], inputs["mask_offset"])
