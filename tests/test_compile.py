"""torch.compile and torch.library support of the ops, on CPU.

- ``torch.library.opcheck``: schema, fake (meta) implementation, dispatch and
  functionalization agree with the real CPU kernel.
- ``torch.compile(fullgraph=True)``: a function calling the op compiles with no graph break
  and returns what eager returns.
- A verify loop over a static cache with a changing ``mask_offset`` tensor compiles once:
  after the first call a recompilation raises (``torch.compiler.set_stance("fail_on_recompile")``).
"""
import contextlib

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

import torch_tree_attn
from tests.cases import args_of, Case, check_against_reference, make_inputs, random_tree_mask

ops = torch.ops.tree_attn



@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


OPCHECK_CASES = [
    Case(),  # bool [B, T, M] tree mask, int64 offsets
    Case(B=2, Hq=8, Hkv=2, T=5, S=40, dtype=torch.bfloat16, mask_kind="float", window="dense"),  # no offsets
    Case(B=2, Hq=4, Hkv=4, T=3, S=20, D=96, dtype=torch.float16, mask_kind="float_min", kv_layout="bshd",
         mask_shape="none", offset_dtype=torch.int32),
    Case(B=1, Hq=2, Hkv=1, T=4, S=9, D=128, window="empty", mask_shape="heads", softcap=10.0, scale=0.2),
    # The contract for real models: sinks (gpt-oss), D=512 (Gemma 4), a float32 query over
    # a half cache.
    Case(B=2, Hq=4, Hkv=2, T=5, S=30, D=64, sinks=torch.float32, mask_kind="float"),
    Case(B=1, Hq=4, Hkv=1, T=3, S=12, D=512, dtype=torch.bfloat16, sinks=torch.bfloat16),
    Case(B=2, Hq=4, Hkv=2, T=4, S=20, D=128, dtype=torch.float32, kv_dtype=torch.bfloat16, kv_layout="bshd"),
    Case(B=1, Hq=2, Hkv=1, T=4, S=16, D=256, dtype=torch.float32, kv_dtype=torch.float16, sinks=torch.float32,
         softcap=20.0),
]


@pytest.mark.parametrize("op_name", ["forward", "forward_with_lse"])
@pytest.mark.parametrize("case", OPCHECK_CASES, ids=str)
def test_opcheck(op_name, case):
    torch.library.opcheck(getattr(ops, op_name), args_of(make_inputs(case)))


def test_fake_outputs_match_real_outputs():
    inputs = make_inputs(Case(B=2, Hq=8, Hkv=2, kv_layout="bshd", dtype=torch.bfloat16))
    real_out, real_lse = ops.forward_with_lse(*args_of(inputs))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args_of(inputs)]
        fake_out, fake_lse = ops.forward_with_lse(*fake_args)
    for real, fake in ((real_out, fake_out), (real_lse, fake_lse)):
        assert fake.shape == real.shape and fake.stride() == real.stride() and fake.dtype == real.dtype


@pytest.mark.parametrize("case", OPCHECK_CASES[4:], ids=str)
def test_fullgraph_compile_with_sinks_and_mixed_dtypes(case):
    inputs = make_inputs(case)

    def attend(q, k, v, mask, off, sinks):
        return torch_tree_attn.tree_attention(q, k, v, mask, off, softcap=case.softcap, sinks=sinks,
                                              return_lse=True)

    args = (inputs["query"], inputs["key"], inputs["value"], inputs["mask"], inputs["mask_offset"], inputs["sinks"])
    counter = CompileCounterWithBackend("inductor")
    got = torch.compile(attend, backend=counter, fullgraph=True)(*args)
    expected = attend(*args)
    assert counter.frame_count == 1
    assert got[0].dtype == case.dtype
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_bad_calls_raise_while_tracing():
    # The fake checks the new rules too: a compiled function with a bad sinks tensor or
    # dtype pair fails at trace time with the contract's message.
    inputs = make_inputs(Case(B=1, Hq=4, Hkv=1, T=3, S=10))

    def attend(q, k, v, mask, off, sinks):
        return torch_tree_attn.tree_attention(q, k, v, mask, off, sinks=sinks)

    q, k, v, mask, off = (inputs[n] for n in ("query", "key", "value", "mask", "mask_offset"))
    with pytest.raises(Exception, match=r"sinks must have shape \[Hq\] = \[4\], got \[3\]"):
        torch.compile(attend, backend="aot_eager", fullgraph=True)(q, k, v, mask, off, torch.zeros(3))
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"got query Half, key Float, value Float"):
        torch.compile(attend, backend="aot_eager", fullgraph=True)(q.half(), k, v, mask, off, None)


def test_fullgraph_compile_matches_eager():
    inputs = make_inputs(Case(B=2, Hq=8, Hkv=2, T=5, S=48, D=64, softcap=30.0))

    def attend(q, k, v, mask, off):
        # Something around the op, so the graph is more than a single call.
        out, lse = torch.ops.tree_attn.forward_with_lse(q * 1.0, k, v, mask, off, None, 30.0)
        return out.transpose(1, 2).flatten(2), lse.exp()

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(attend, backend=counter, fullgraph=True)
    args = args_of(inputs)[:5]
    got = compiled(*args)
    expected = attend(*args)
    assert counter.frame_count == 1
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-6, atol=1e-6)


def test_python_api_compiles_without_graph_break():
    inputs = make_inputs(Case(B=1, Hq=4, Hkv=1, T=6, S=30, dtype=torch.bfloat16))

    def attend(q, k, v, mask, off):
        return torch_tree_attn.tree_attention(q, k, v, mask, off, return_lse=True)

    counter = CompileCounterWithBackend("aot_eager")
    got = torch.compile(attend, backend=counter, fullgraph=True)(*args_of(inputs)[:5])
    expected = attend(*args_of(inputs)[:5])
    assert counter.frame_count == 1 and counter.op_count >= 1
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_verify_loop_with_changing_offsets_compiles_once(backend):
    # A static cache: fixed capacity S, the tree's K/V written at [off, off + T) each round,
    # and the committed prefix growing. Only tensor *values* change, never shapes.
    B, Hq, Hkv, T, S, D = 2, 8, 2, 6, 160, 64
    gen = torch.Generator().manual_seed(0)
    cache_k = torch.randn(B, Hkv, S, D, generator=gen)
    cache_v = torch.randn(B, Hkv, S, D, generator=gen)
    mask = torch.stack([random_tree_mask(T, gen) for _ in range(B)])

    def verify_step(q, k_new, v_new, cache_k, cache_v, mask, off):
        # Write the tree's K/V into the cache at each row's offset, then attend.
        pos = off[:, None] + torch.arange(T)
        idx = pos[:, None, :, None].expand(B, Hkv, T, D)
        cache_k.scatter_(2, idx, k_new)
        cache_v.scatter_(2, idx, v_new)
        return torch.ops.tree_attn.forward(q, cache_k, cache_v, mask, off, None, None)

    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(verify_step, backend=counter, fullgraph=True, dynamic=False)
    prefix = torch.tensor([10, 37])
    for step in range(4):
        q = torch.randn(B, Hq, T, D, generator=gen)
        k_new = torch.randn(B, Hkv, T, D, generator=gen)
        v_new = torch.randn(B, Hkv, T, D, generator=gen)
        eager_k, eager_v = cache_k.clone(), cache_v.clone()
        expected = verify_step(q, k_new, v_new, eager_k, eager_v, mask, prefix)
        # After the first call any recompilation is an error, not a silent slowdown.
        guard = torch.compiler.set_stance("fail_on_recompile") if step > 0 else contextlib.nullcontext()
        with guard:
            got = compiled(q, k_new, v_new, cache_k, cache_v, mask, prefix.clone())
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        assert torch.equal(cache_k, eager_k) and torch.equal(cache_v, eager_v)
        prefix = prefix + torch.tensor([3, 5])  # accepted tokens: a new offsets tensor
    assert counter.frame_count == 1


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph-breaks-allowed"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("op_name", ["forward", "forward_with_lse"])
def test_compile_with_inputs_that_require_grad(op_name, backend, fullgraph):
    """Inputs that require grad (a training-mode model verifying a tree): the compiled
    forward works and equals eager and the float64 reference; running the backward
    raises, naming the op and the input."""
    inputs = make_inputs(Case(B=2, Hq=4, Hkv=2, T=5, S=30, seed=7))
    q = inputs["query"].clone().requires_grad_(True)
    k = inputs["key"].clone().requires_grad_(True)
    args = dict(inputs, query=q, key=k)
    op = getattr(ops, op_name)

    def f(query, key):
        return op(query, key, *args_of(args)[2:])

    counter = CompileCounterWithBackend(backend)
    got = torch.compile(f, backend=counter, fullgraph=fullgraph)(q, k)
    assert counter.frame_count == 1
    out, lse = got if isinstance(got, tuple) else (got, None)
    assert out.requires_grad
    check_against_reference(out, lse, inputs)
    expected = f(q, k)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for result in (out, expected[0] if isinstance(expected, tuple) else expected):  # compiled and eager
        with pytest.raises(RuntimeError,
                           match=rf"tree_attn\.{op_name} has no backward \(asked for the gradient of 'query'\)"):
            result.sum().backward(retain_graph=True)
    # Only the key requires grad: still an error, never a silent None gradient.
    k2 = inputs["key"].clone().requires_grad_(True)
    got2 = torch.compile(f, backend=backend, fullgraph=fullgraph)(inputs["query"], k2)
    out2 = got2[0] if isinstance(got2, tuple) else got2
    assert torch.equal(out2, out)
    with pytest.raises(RuntimeError, match=rf"tree_attn\.{op_name} has no backward \(asked for the gradient of 'key'\)"):
        out2.sum().backward()
    assert k2.grad is None


def test_lse_only_backward_raises():
    inputs = make_inputs(Case(seed=8))
    q = inputs["query"].clone().requires_grad_(True)
    _, lse = ops.forward_with_lse(q, *args_of(inputs)[1:])
    with pytest.raises(RuntimeError, match="has no backward"):
        lse.sum().backward()


def test_python_api_takes_int_offsets():
    """tree_attention(): a Python int or a list of ints is the int64 offsets tensor."""
    inputs = make_inputs(Case(B=2, Hq=4, Hkv=2, T=5, S=30, offsets="same", seed=9))
    off = inputs["mask_offset"]
    base = torch_tree_attn.tree_attention(*args_of(inputs))
    as_int = torch_tree_attn.tree_attention(*args_of(dict(inputs, mask_offset=int(off[0]))))
    as_list = torch_tree_attn.tree_attention(*args_of(dict(inputs, mask_offset=off.tolist())))
    assert torch.equal(base, as_int) and torch.equal(base, as_list)
    check_against_reference(as_int, None, inputs)
    # Under torch.compile too, and one offset per row that differ (a tuple).
    varied = make_inputs(Case(B=2, Hq=4, Hkv=2, T=5, S=30, offsets="varied", seed=9))
    assert varied["mask_offset"][0] != varied["mask_offset"][1]
    as_tuple = tuple(int(o) for o in varied["mask_offset"])
    compiled = torch.compile(lambda q, k, v, m: torch_tree_attn.tree_attention(q, k, v, m, as_tuple, return_lse=True),
                             backend="aot_eager", fullgraph=True)
    out, lse = compiled(*args_of(varied)[:4])
    check_against_reference(out, lse, varied)
    # A verify loop passing the prefix length as a changing Python int (dynamo may make it
    # a symbolic int after the first call): still accepted, still right.
    step = torch.compile(lambda q, k, v, m, off: torch_tree_attn.tree_attention(q, k, v, m, off),
                         backend="aot_eager", fullgraph=True)
    for prefix in (3, 7, 11):
        got = step(*args_of(inputs)[:4], prefix)
        check_against_reference(got, None, dict(inputs, mask_offset=torch.tensor([prefix, prefix])))
    for bad in (1.5, True, [1, "a"]):
        with pytest.raises(TypeError, match="mask_offset must be an int32/int64 tensor"):
            torch_tree_attn.tree_attention(*args_of(dict(inputs, mask_offset=bad)))
    with pytest.raises(ValueError, match=r"mask_offset must have shape \[B\] = \[2\], got \[3\]"):
        torch_tree_attn.tree_attention(*args_of(dict(inputs, mask_offset=[1, 2, 3])))
    # The raw op wants a tensor: torch's own parse error names the argument.
    # (torch.ops parses the arguments against the schema before any of this package's code
    # runs, so that message is torch's: it names the argument, the type wanted and the type seen.)
    with pytest.raises(RuntimeError, match=r"mask_offset.*int"):
        ops.forward(*args_of(dict(inputs, mask_offset=int(off[0]))))


def test_no_heads_raise_while_tracing():
    """Hq = 0 or Hkv = 0 is rejected by the fake with the contract's ValueError (naming the
    argument and its shape), as eagerly; B = 0 and T = 0 stay empty calls."""
    inputs = make_inputs(Case(B=2, Hq=4, Hkv=2, T=5, S=30))
    q, k, v, mask, off = (inputs[n] for n in ("query", "key", "value", "mask", "mask_offset"))

    def attend(q, k, v, mask, off):
        return torch.ops.tree_attn.forward(q, k, v, mask, off, None, None, None)

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError, match=r"query must have at least one head \(Hq >= 1 in \[B, Hq, T, D\]\), "
                                         r"got shape \[2, 0, 5, 64\]"):
        attend(q[:, :0], k, v, mask, off)
    with pytest.raises(Exception, match=r"query must have at least one head .*got shape \[2, 0, 5, 64\]"):
        compiled(q[:, :0], k, v, mask, off)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"Hkv=0 \(query shape \[2, 4, 5, 64\], key shape \[2, 0, 30, 64\]\)"):
        compiled(q, k[:, :0], v[:, :0], mask, off)
    torch._dynamo.reset()
    for b, t in ((0, 5), (2, 0)):
        args = (q[:b, :, :t], k[:b], v[:b], mask[:b, :t], off[:b])
        got = compiled(*args)
        assert got.shape == (b, 4, t, 64) and torch.equal(got, attend(*args))
