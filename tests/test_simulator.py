"""Tests of the Metal Shading Language simulator itself (tests/sim): the translator, the
lock-step simd-group and barrier semantics, threadgroup-memory poisoning, half/bfloat rounding,
fault detection and byte counting, through the self-test kernels in tests/sim/csrc/selftest/.

Expected values are computed independently here (float64 / torch conversions), never by the
simulator.
"""
import os
import re
import struct
import sys

import pytest
import torch

import torch_tree_attn_sim  # noqa: F401  (registers the simulator's ops: pip install ./tests/sim)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "sim", "csrc"))
import msl2cpp  # noqa: E402

def launch(kernel, grid, threads, buffers, threadgroup_memory=()):
    return torch.ops.tree_attn_sim.launch(kernel, list(grid), list(threads), list(threadgroup_memory), buffers)


def exact_values(n, seed):
    """Multiples of 1/64 in [0, 1): sums of up to 32 of them are exact in float32, so the
    simulator's reduction order cannot matter and results must match exactly."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (n,), generator=g).to(torch.float32) / 64


# ---------------------------------------------------------------------------------------------
# Registry and launch validation
# ---------------------------------------------------------------------------------------------
def test_selftest_kernels_are_registered():
    names = set(torch.ops.tree_attn_sim.kernels())
    for name in ["selftest_simd_collectives", "selftest_barrier_reverse", "selftest_poison",
                 "selftest_lowp_numerics", "selftest_scale_float", "selftest_scale_half",
                 "selftest_scale_bfloat", "selftest_oob_read", "selftest_copy"]:
        assert name in names
    assert "selftest_scale" not in names  # a template is registered only through its instantiations


@pytest.mark.parametrize(
    "threads, tg_memory, message",
    [
        ([48], [], "multiple of 32"),
        ([2048], [], "at most 1024"),
        ([32, 33], [], "multiple of 32"),
        ([256], [40000], "exceeds the 32768-byte limit"),
        ([256], [1000], "not a multiple of 16"),
        ([256], [], "threadgroup(0)"),
    ],
)
def test_bad_launch_geometry_is_rejected(threads, tg_memory, message):
    x = torch.zeros(4096)
    with pytest.raises(RuntimeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        launch("selftest_barrier_reverse", [1], threads, [x, x.clone()], tg_memory)


def test_missing_binding_and_unknown_kernel_are_rejected():
    with pytest.raises(RuntimeError, match=r"missing binding: parameter 'out' \(device float\*\) is \[\[buffer\(1\)\]\]"):
        launch("selftest_copy", [1], [32], [torch.zeros(32)])
    with pytest.raises(RuntimeError, match="no kernel named 'no_such_kernel'.*selftest_copy"):
        launch("no_such_kernel", [1], [32], [torch.zeros(1)])


def test_constant_reference_binding_too_small_is_rejected():
    x = torch.zeros(64)
    with pytest.raises(RuntimeError, match="'n' .* holds 2 bytes past its offset, the parameter needs 4"):
        launch("selftest_lowp_numerics", [1], [64], [x, torch.zeros(64 * 8, dtype=torch.int16),
                                                      torch.zeros(1, dtype=torch.int16)])


# ---------------------------------------------------------------------------------------------
# Lock-step SIMD-group semantics and barriers
# ---------------------------------------------------------------------------------------------
def expected_collectives(values, threads_per_group):
    out = []
    v = values.tolist()
    for t in range(len(v)):
        local = t % threads_per_group
        lane, simd = local % 32, local // 32
        base = t - lane
        sg = v[base:base + 32]
        prefix = sum(sg[:lane])
        out.append([
            sum(sg), max(sg), min(sg), sg[lane ^ 5], sg[simd % 32], prefix,
            sg[lane + 3] if lane + 3 < 32 else sg[lane],
            sg[lane - 2] if lane >= 2 else sg[lane],
            sg[0], float(any(x > 0.9 for x in sg)), float(all(x >= 0 for x in sg)), sg[(lane * 7) % 32],
        ])
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("threads", [32, 128, 1024])
def test_simd_collectives_are_lockstep(threads):
    groups = 3
    values = exact_values(groups * threads, seed=threads)
    out = torch.full((groups * threads, 12), -7.0)
    launch("selftest_simd_collectives", [groups], [threads], [values, out])
    torch.testing.assert_close(out.double(), expected_collectives(values, threads), rtol=0, atol=0)


def test_collectives_exclude_lanes_that_returned():
    out = torch.full((64 * 2,), -1.0)
    launch("selftest_partial_simdgroup", [1], [64], [out])
    out = out.view(64, 2)
    lane = torch.arange(64) % 32
    live = lane < 16
    assert (out[live, 0] == 16).all()
    assert torch.equal(out[live, 1], (lane[live] * (lane[live] - 1) / 2).float())
    assert (out[~live] == -1).all()


def test_barrier_orders_threadgroup_memory():
    n, groups = 1024, 3
    values = torch.randn(groups * n)
    out = torch.zeros(groups * n)
    launch("selftest_barrier_reverse", [groups], [n], [values, out], [4 * n])
    # Thread t reads what thread n-1-t wrote twice over: the block comes back in order, doubled,
    # plus the 1.0 of the 2-D array.
    torch.testing.assert_close(out, values * 2 + 1, rtol=0, atol=0)


def test_threadgroup_memory_is_poisoned():
    out = torch.zeros(64 * 3)
    launch("selftest_poison", [1], [64], [out])
    assert torch.isnan(out[0::3]).all()  # float
    assert torch.isnan(out[1::3]).all()  # half
    assert (out[2::3] == 1).all()  # uint: all ones


def test_results_do_not_depend_on_the_number_of_os_threads(monkeypatch):
    values = exact_values(8 * 256, seed=5)
    results = []
    for workers in ("1", "2", "3"):
        monkeypatch.setenv("TREE_ATTN_SIM_THREADS", workers)
        out = torch.zeros(8 * 256, 12)
        launch("selftest_simd_collectives", [8], [256], [values, out])
        results.append(out)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


# ---------------------------------------------------------------------------------------------
# half / bfloat: conversions and per-operation rounding, bit-exact against torch
# ---------------------------------------------------------------------------------------------
def interesting_floats():
    g = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-(2**31), 2**31 - 1, (20000,), generator=g, dtype=torch.int64).to(torch.int32)
    specials = torch.tensor(
        [0.0, -0.0, 1.0, -1.0, 65504.0, 65519.99, 65520.0, 65536.0, -65520.0, 2.0**-14, 2.0**-24,
         2.0**-25, 2.0**-25 * 1.0001, 3 * 2.0**-26, 2.0**-26, 1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-8,
         1 + 3 * 2.0**-8, 3.3895313892515355e38, float("inf"), float("-inf"), float("nan"), 1e-45, 1e38],
        dtype=torch.float32,
    )
    scaled = torch.randn(20000, generator=g) * torch.exp2(torch.randint(-30, 20, (20000,), generator=g).float())
    return torch.cat([random_bits.view(torch.float32), specials, scaled])


def same_bits(actual, expected):
    """Bit equality, where any NaN matches any NaN (payloads are not part of the contract)."""
    a = actual.view(torch.int16)
    e = expected.view(torch.int16)
    return (a == e) | (torch.isnan(actual.float()) & torch.isnan(expected.float()))


def test_half_and_bfloat_round_like_torch():
    x = interesting_floats()
    n = x.numel()
    out = torch.zeros(n, 8, dtype=torch.int16)
    launch("selftest_lowp_numerics", [(n + 255) // 256], [256], [x, out, torch.tensor([n], dtype=torch.int32)])
    y = torch.roll(x, -1)
    hx, hy = x.to(torch.float16), y.to(torch.float16)
    bx, by = x.to(torch.bfloat16), y.to(torch.bfloat16)

    def f16(t):
        return t.to(torch.float16)

    def bf16(t):
        return t.to(torch.bfloat16)

    expected = {
        0: hx,
        1: bx,
        2: f16(hx.double() * hy.double()),
        3: f16(hx.double() + hy.double()),
        4: f16(hx.double() / hy.double()),
        5: bf16(bx.double() * by.double()),
        6: bf16(bx.double() + by.double()),
        7: f16(f16(hx.double() * 2).double() - 1),
    }
    for column, want in expected.items():
        got = out[:, column].view(want.dtype)
        ok = same_bits(got, want)
        assert ok.all(), (column, x[~ok][:5], got[~ok][:5], want[~ok][:5])


@pytest.mark.parametrize("dtype, name", [(torch.float32, "float"), (torch.float16, "half"), (torch.bfloat16, "bfloat")])
def test_template_instantiations_round_each_operation(dtype, name):
    n = 100  # not a multiple of the 64 threads: the tail guard runs
    x = torch.randn(n).to(dtype)
    y = torch.full((128,), 7.0, dtype=dtype)
    scale, bias = 1.3, -0.7
    params = torch.frombuffer(bytearray(struct.pack("<ffI4x", scale, bias, n)), dtype=torch.uint8)
    read, written = launch(f"selftest_scale_{name}", [2], [64], [x, y, params])
    s, b = torch.tensor(scale).to(dtype).double(), torch.tensor(bias).to(dtype).double()
    want = ((x.double() * s).to(dtype).double() + b).to(dtype)
    assert torch.equal(y[:n], want)
    assert (y[n:] == 7).all()
    assert read == n * x.element_size() and written == n * x.element_size()


def test_vector_types_and_math():
    n = 64
    v = torch.randn(n, 4)
    out = torch.zeros(n * 4, 4)
    launch("selftest_vector_math", [1], [n], [v, out])
    out = out.view(n, 4, 4).double()
    x, y, z, w = (v[:, k].double() for k in range(4))
    h = v.to(torch.float16).double()
    r = h * 2 + torch.stack([x, y, torch.full_like(x, 0.5), torch.ones_like(x)], 1)
    r = r + torch.stack([x, w, x, w], 1)
    torch.testing.assert_close(out[:, 0], r.float().double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[:, 1], torch.stack([x.exp(), torch.exp2(y), torch.maximum(z, w), x.clamp(-0.5, 0.5)], 1),
                               rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[:, 2], torch.where(v < 0, 0.0, v).double(), rtol=0, atol=0)
    assert (out[:, 3, 0] == float("inf")).all()
    assert (out[:, 3, 1] == torch.finfo(torch.float32).min).all()
    torch.testing.assert_close(out[:, 3, 2], (x * 10).float().trunc().abs().double() + 3, rtol=0, atol=0)
    torch.testing.assert_close(out[:, 3, 3], 1 / (w.abs() + 1).sqrt(), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Faults
# ---------------------------------------------------------------------------------------------
def test_out_of_bounds_read_names_kernel_buffer_index_and_thread():
    x, out = torch.arange(64, dtype=torch.float32), torch.zeros(64)
    with pytest.raises(RuntimeError) as info:
        launch("selftest_oob_read", [1], [64], [x, out])
    message = str(info.value)
    assert "kernel 'selftest_oob_read'" in message
    assert "out-of-bounds device read of buffer(0) 'buffers[0]' (kernel parameter 'in')" in message
    assert "element 64 of 4 bytes (byte 256 of a 256-byte allocation" in message
    assert "threadgroup (0,0,0), thread (63,0,0)" in message
    # The simulator is usable after a fault.
    assert launch("selftest_copy", [1], [64], [x, out]) == [256, 256]
    assert torch.equal(out, x)


def test_bounds_are_those_of_the_allocation_not_the_view():
    storage = torch.arange(100, dtype=torch.float32)
    view = storage[10:74]  # 64 elements, 26 more in the allocation after it
    out = torch.zeros(64)
    launch("selftest_oob_read", [1], [64], [view, out])
    assert torch.equal(out, storage[11:75])
    tail = storage[36:]  # 64 elements at the end of the allocation: element 64 is outside
    with pytest.raises(RuntimeError, match=r"element 64 of 4 bytes \(byte 400 of a 400-byte allocation; the binding starts at byte 144\)"):
        launch("selftest_oob_read", [1], [64], [tail, out])


@pytest.mark.parametrize(
    "kernel, message",
    [
        ("selftest_divergent_simd", r"divergent simd-group ops: this lane reached simd_max \(tests/sim/csrc/selftest/faults.metal:\d+:\d+\) "
                                    r"while lanes \{0-15\} wait at simd_sum"),
        ("selftest_divergent_barrier", r"returned while 32 thread\(s\) wait at threadgroup_barrier"),
        ("selftest_deadlock", r"divergent simdgroup: this lane reached simd_sum .* while lanes \{0-7\} wait at threadgroup_barrier"),
        ("selftest_shuffle_from_returned_lane", r"simd_shuffle_xor: lane 0 reads lane 16, which is not active \(returned\)"),
        ("selftest_threadgroup_oob", r"out-of-bounds threadgroup memory .* in 'tile': byte 128 \(4-byte element, index 32\)"),
    ],
)
def test_divergence_and_threadgroup_faults_raise(kernel, message):
    out = torch.zeros(64)
    with pytest.raises(RuntimeError, match=message) as info:
        launch(kernel, [1], [64], [out])
    assert f"kernel '{kernel}'" in str(info.value)
    assert "threadgroup (0,0,0), thread (" in str(info.value)


def test_threadgroup_memory_race_is_detected():
    out = torch.zeros(128)
    with pytest.raises(RuntimeError, match=r"threadgroup memory race on 'exchange' byte 128: this thread stores to "
                                           r"bytes that thread 0 \(simdgroup 0\) loaded since the last threadgroup_barrier"):
        launch("selftest_race_missing_barrier", [1], [128], [out])


def test_ordered_exchange_is_not_a_race():
    n = 128
    out = torch.zeros(n)
    launch("selftest_ordered_exchange", [1], [n], [out])
    t = torch.arange(n)
    neighbour = (t ^ 1) + (t + 32) % n + 7.0
    torch.testing.assert_close(out, neighbour.flip(0).float(), rtol=0, atol=0)


def test_device_store_race_is_detected():
    out = torch.zeros(64)
    with pytest.raises(RuntimeError, match=r"kernel 'selftest_store_race': device memory race: buffer\(0\) 'buffers\[0\]' "
                                           r"byte 0 is stored to by threadgroup \(0,0,0\) thread index 0 and stored to by "
                                           r"threadgroup \(1,0,0\) thread index 0"):
        launch("selftest_store_race", [2], [64], [out])


def test_device_load_race_is_detected_only_when_buffers_alias():
    x = torch.arange(3 * 64, dtype=torch.float32)
    out = torch.zeros(3 * 64)
    launch("selftest_load_race", [3], [64], [x, out])
    assert torch.equal(out, x.roll(-64) + 1)
    with pytest.raises(RuntimeError, match=r"device memory race: buffer\(\d\) 'buffers\[\d\]' byte \d+ is stored to by "
                                           r"threadgroup \(\d,0,0\) thread index \d+ and loaded by threadgroup"):
        launch("selftest_load_race", [3], [64], [x, x])


def test_ordered_device_stores_are_not_a_race():
    out = torch.zeros(3 * 64)
    assert launch("selftest_ordered_stores", [3], [64], [out]) == [3 * 64 * 4, 3 * 64 * 4 * 3]
    assert (out == 3).all()


def test_fault_in_a_later_threadgroup_is_reported_with_its_position():
    x, out = torch.arange(64 * 5, dtype=torch.float32), torch.zeros(64 * 5)
    with pytest.raises(RuntimeError, match=r"threadgroup \(4,0,0\), thread \(63,0,0\)"):
        launch("selftest_oob_read", [5], [64], [x, out])


# ---------------------------------------------------------------------------------------------
# Byte counting
# ---------------------------------------------------------------------------------------------
def test_device_bytes_are_counted_exactly():
    n = 4096
    x = torch.randn(n)
    assert launch("selftest_copy", [n // 256], [256], [x, torch.zeros(n)]) == [4 * n, 4 * n]
    values, out = exact_values(2 * 128, seed=1), torch.zeros(2 * 128, 12)
    assert launch("selftest_simd_collectives", [2], [128], [values, out]) == [4 * 256, 12 * 4 * 256]
    # Threadgroup memory traffic is not device traffic.
    assert launch("selftest_barrier_reverse", [2], [256], [torch.randn(512), torch.zeros(512)], [1024]) == [2048, 2048]


# ---------------------------------------------------------------------------------------------
# simdgroup_matrix
# ---------------------------------------------------------------------------------------------
def matrix_slot(lane):
    """The documented lane layout (msl.h simdgroup_matrix_slot): the lane's first element."""
    q = lane // 4
    return (q & 4) + (lane // 2) % 4, (q & 2) * 2 + (lane % 2) * 2


def test_matrix_lane_layout_covers_every_element_once():
    cells = sorted((r, c + k) for lane in range(32) for k in (0, 1) for r, c in [matrix_slot(lane)])
    assert cells == [(r, c) for r in range(8) for c in range(8)]


MMA_KERNELS = [("float", torch.float32, torch.float32), ("half", torch.float16, torch.float16),
               ("half_float", torch.float16, torch.float32), ("bfloat_float", torch.bfloat16, torch.float32)]


@pytest.mark.parametrize("name, dtype, acc", MMA_KERNELS)
def test_simdgroup_multiply_is_exact_on_small_integers(name, dtype, acc):
    # Integers in [-4, 4]: every product, sum and conversion is exact in each type, so any
    # error in the layout, the operand order or the accumulation shows as a mismatch.
    groups, simds = 3, 2
    n = groups * simds
    g = torch.Generator().manual_seed(11)
    a = torch.randint(-4, 5, (n, 8, 8), generator=g).to(dtype)
    b = torch.randint(-4, 5, (n, 8, 8), generator=g).to(dtype)
    c = torch.randint(-4, 5, (n, 8, 8), generator=g).to(acc)
    d = torch.full((n, 8, 8), float("nan"), dtype=acc)
    p = torch.full((n, 8, 8), float("nan"), dtype=acc)
    counted = launch(f"selftest_mma_{name}", [groups], [32 * simds], [a, b, c, d, p])
    product = a.double() @ b.double()
    assert torch.equal(d.double(), product + c.double())
    assert torch.equal(p.double(), product)
    # Device bytes: every simdgroup loads three matrices and stores two, 64 elements each.
    esize, asize = a.element_size(), c.element_size()
    assert counted == [n * 64 * (2 * esize + asize), n * 2 * 64 * asize]


@pytest.mark.parametrize("name, dtype, acc", MMA_KERNELS)
def test_simdgroup_multiply_accumulates_in_float(name, dtype, acc):
    n = 4
    g = torch.Generator().manual_seed(12)
    a = torch.randn(n, 8, 8, generator=g).to(dtype)
    b = torch.randn(n, 8, 8, generator=g).to(dtype)
    c = torch.randn(n, 8, 8, generator=g).to(acc)
    d, p = torch.zeros(n, 8, 8, dtype=acc), torch.zeros(n, 8, 8, dtype=acc)
    launch(f"selftest_mma_{name}", [n], [32], [a, b, c, d, p])
    want = a.double() @ b.double() + c.double()
    # Products and sums in float32: at most 9 roundings of 2^-24 relative to the magnitudes
    # involved, then one rounding to the accumulator's type.
    magnitude = a.double().abs() @ b.double().abs() + c.double().abs()
    out_eps = {torch.float32: 0.0, torch.float16: 2.0**-11}[acc]
    bound = 9 * 2.0**-24 * magnitude + out_eps * want.abs() + 1e-30
    assert ((d.double() - want).abs() <= bound).all()
    # Not trivially satisfied: the bound is far below the error of a float16 accumulation.
    assert bound.max() < 0.01


def test_simdgroup_multiply_mixes_half_and_float_operands():
    g = torch.Generator().manual_seed(13)
    a = torch.randn(8, 8, generator=g).to(torch.float16)
    b = torch.randn(8, 8, generator=g)
    d = torch.zeros(8, 8)
    launch("selftest_mma_mixed", [1], [32], [a, b, d])
    want = a.double() @ b.double() + 0.5
    assert ((d.double() - want).abs() <= 9 * 2.0**-24 * (a.double().abs() @ b.double().abs() + 0.5)).all()


TRANSFER_FIELDS = ["load_row_elements", "load_col", "load_row", "load_transpose", "store_row_elements",
                   "store_col", "store_row", "store_transpose", "through_threadgroup", "elements"]


def transfer_args(**kw):
    return torch.tensor([kw[f] for f in TRANSFER_FIELDS], dtype=torch.int32)


def expected_transfer(src, dst, kw):
    """float64 reference of simdgroup_load (origin = (column, row) of the source, transpose:
    matrix rows are source columns) followed by simdgroup_store with its own parameters."""
    src, dst = src.double().tolist(), dst.double().clone()
    m = [[0.0] * 8 for _ in range(8)]
    for r in range(8):
        for c in range(8):
            sr, sc = (c, r) if kw["load_transpose"] else (r, c)
            m[r][c] = src[(kw["load_row"] + sr) * kw["load_row_elements"] + kw["load_col"] + sc]
    for r in range(8):
        for c in range(8):
            dr, dc = (c, r) if kw["store_transpose"] else (r, c)
            dst[(kw["store_row"] + dr) * kw["store_row_elements"] + kw["store_col"] + dc] = m[r][c]
    return dst


@pytest.mark.parametrize("through_threadgroup", [0, 1])
@pytest.mark.parametrize("load, store", [
    ((8, 0, 0, 0), (8, 0, 0, 0)),
    ((20, 3, 2, 0), (12, 4, 1, 1)),
    ((11, 2, 5, 1), (9, 0, 3, 0)),
    ((16, 8, 0, 1), (16, 5, 2, 1)),
])
def test_simdgroup_load_store_strides_origins_transpose(through_threadgroup, load, store):
    n = 400
    kw = dict(zip(TRANSFER_FIELDS, load + store + (through_threadgroup, n)))
    src = torch.arange(n, dtype=torch.float32) * 0.25 - 7
    dst = torch.full((n,), -1.0)
    want = expected_transfer(src, dst, kw)
    counted = launch("selftest_matrix_transfer", [1], [32], [src, dst, transfer_args(**kw)])
    assert torch.equal(dst.double(), want)
    if not through_threadgroup:
        assert counted == [64 * 4, 64 * 4]  # exactly the 64 elements loaded and stored
    else:
        assert counted == [2 * n * 4, n * 4]  # the element-wise copies in and out


def test_matrix_thread_elements_layout():
    out = torch.full((256,), float("nan"))
    launch("selftest_matrix_layout", [1], [32], [out])
    stored, loaded = out[:64].view(8, 8), out[64:128].view(32, 2)
    for lane in range(32):
        r, c = matrix_slot(lane)
        assert stored[r, c] == lane and stored[r, c + 1] == lane + 0.5
        assert loaded[lane].tolist() == [r * 8 + c, r * 8 + c + 1]
    assert torch.equal(out[128:192].view(8, 8), 3 * torch.eye(8))
    assert (out[192:] == -2).all()


@pytest.mark.parametrize("mode, message", [
    (0, r"divergent simd-group ops: this lane reached simdgroup_store \(tests/sim/csrc/selftest/simdgroup_matrix.metal:\d+:\d+\) "
        r"while lanes \{0-15\} wait at simdgroup_store"),
    (1, r"simdgroup_store \(tests/sim/csrc/selftest/simdgroup_matrix.metal:\d+\) outside uniform simd-group control flow: only lanes with mask 0x0000ffff reached it"),
    (2, r"simdgroup_load \(tests/sim/csrc/selftest/simdgroup_matrix.metal:\d+\) with a non-uniform pointer: lane 16 passes a different value from lane 0"),
    (3, r"simdgroup_load \(tests/sim/csrc/selftest/simdgroup_matrix.metal:\d+\) with a non-uniform elements_per_row: lane 1 "),
    (4, r"simdgroup_store \(tests/sim/csrc/selftest/simdgroup_matrix.metal:\d+\) with a non-uniform transpose_matrix: lane 7 "),
    (5, r"simdgroup_load \(tests/sim/csrc/selftest/simdgroup_matrix.metal:\d+\) with a non-uniform matrix_origin: lane 31 "),
])
def test_simdgroup_matrix_misuse_is_reported(mode, message):
    buf = torch.zeros(256)
    with pytest.raises(RuntimeError, match=message) as info:
        launch("selftest_matrix_misuse", [1], [64], [buf, torch.tensor([mode], dtype=torch.int32)])
    assert "kernel 'selftest_matrix_misuse'" in str(info.value)
    assert "threadgroup (0,0,0), thread (" in str(info.value)
    lane = re.search(r"lane (\d+) passes", str(info.value))
    if lane:  # a non-uniform argument is reported as the lane that passed it
        assert str(info.value).endswith(f"lane {lane.group(1)}]")


def test_simdgroup_load_out_of_bounds_names_the_owning_lane():
    # Origin row 1 of an 8x8 source: matrix row 7 is source row 8, one past the end. Lane 22
    # owns (7, 0), the first element outside.
    kw = dict(zip(TRANSFER_FIELDS, (8, 0, 1, 0, 8, 0, 0, 0, 0, 64)))
    with pytest.raises(RuntimeError, match=r"out-of-bounds device read of buffer\(0\) 'buffers\[0\]' \(kernel parameter "
                                           r"'src'\): element 64 of 4 bytes .* thread \(22,0,0\) \[index 22, simdgroup 0, lane 22\]"):
        launch("selftest_matrix_transfer", [1], [32], [torch.zeros(64), torch.zeros(64), transfer_args(**kw)])
    # Through threadgroup memory: rows of 128 elements from row 2 leave the 1024-element tile at
    # matrix row 6, first owned by lane 20.
    kw = dict(zip(TRANSFER_FIELDS, (128, 0, 2, 0, 8, 0, 0, 0, 1, 64)))
    with pytest.raises(RuntimeError, match=r"out-of-bounds threadgroup memory access in 'in_tile': byte 4096 .* "
                                           r"\[index 20, simdgroup 0, lane 20\]"):
        launch("selftest_matrix_transfer", [1], [32], [torch.zeros(64), torch.zeros(64), transfer_args(**kw)])
    # A store into a binding too small for the matrix.
    kw = dict(zip(TRANSFER_FIELDS, (8, 0, 0, 0, 8, 0, 0, 1, 0, 64)))
    with pytest.raises(RuntimeError, match=r"out-of-bounds device write of buffer\(1\)"):
        launch("selftest_matrix_transfer", [1], [32], [torch.zeros(64), torch.zeros(63), transfer_args(**kw)])


COUNTER_KEYS = ["device_bytes_read", "device_bytes_written", "threadgroup_bytes_read", "threadgroup_bytes_written",
                "simdgroup_mmas", "scalar_fmas", "shuffles"]


def launch_counters(kernel, grid, threads, buffers, threadgroup_memory=()):
    return torch.ops.tree_attn_sim.launch_counters(kernel, list(grid), list(threads), list(threadgroup_memory), buffers)


@pytest.mark.parametrize("groups, threads", [(1, 32), (2, 128), (3, 1024)])
def test_counters_are_exact(groups, threads):
    simds = threads // 32
    x = exact_values(groups * threads, seed=threads)
    out, out_matrix = torch.zeros(groups * threads), torch.zeros(groups * simds * 64)
    counters = launch_counters("selftest_counters", [groups], [threads], [x, out, out_matrix])
    assert list(counters.keys()) == COUNTER_KEYS  # stable, documented names (runtime.h)
    per_thread = dict(device_bytes_read=8, device_bytes_written=4, threadgroup_bytes_read=6,
                      threadgroup_bytes_written=6, simdgroup_mmas=0, scalar_fmas=3, shuffles=0)
    per_simdgroup = dict(device_bytes_read=0, device_bytes_written=256, threadgroup_bytes_read=256,
                         threadgroup_bytes_written=256, simdgroup_mmas=2, scalar_fmas=0, shuffles=4)
    want = {k: groups * (threads * per_thread[k] + simds * per_simdgroup[k]) for k in COUNTER_KEYS}
    assert dict(counters) == want
    assert (out_matrix == 648).all()
    # The same launch through `launch` reports the same device bytes.
    assert launch("selftest_counters", [groups], [threads], [x, out, out_matrix]) == [
        want["device_bytes_read"], want["device_bytes_written"]]


def test_counters_of_simd_collectives_and_matrix_transfers():
    # 12 collectives per simdgroup, no threadgroup memory.
    values, out = exact_values(2 * 128, seed=1), torch.zeros(2 * 128, 12)
    c = launch_counters("selftest_simd_collectives", [2], [128], [values, out])
    assert c["shuffles"] == 2 * 4 * 12 and c["threadgroup_bytes_read"] == 0 and c["scalar_fmas"] == 0
    # Through threadgroup memory: n elements copied in (plus n of dst), 64 loaded and 64
    # stored by the matrix ops, n copied out.
    n = 400
    kw = dict(zip(TRANSFER_FIELDS, (20, 3, 2, 0, 12, 4, 1, 1, 1, n)))
    c = launch_counters("selftest_matrix_transfer", [1], [32],
                        [torch.zeros(n), torch.zeros(n), transfer_args(**kw)])
    assert c["threadgroup_bytes_written"] == 4 * (2 * n + 64)
    assert c["threadgroup_bytes_read"] == 4 * (64 + n)
    assert c["simdgroup_mmas"] == 0 and c["shuffles"] == 0


# ---------------------------------------------------------------------------------------------
# Function constants
# ---------------------------------------------------------------------------------------------
def launch_with_constants(constants, x):
    out = torch.full_like(x, float("nan"))
    torch.ops.tree_attn_sim.launch("selftest_function_constants", [1], [x.numel()], [], [x, out], constants)
    return out


@pytest.mark.parametrize("constants, expected", [
    (["0:uint=3", "1:bool=true", "2:float=0.25", "3:half=1.5"], lambda x: x * 3 + 0.25 + 1.5),
    (["0:uint=3", "1:bool=false", "2:float=0.25", "3:half=1.5"], lambda x: x * 3 + 1.5),
    # No bias given: is_function_constant_defined(bias) is false and bias is never read.
    (["0:uint=7", "1:bool=true", "3:half=-2"], lambda x: x * 7 - 2),
    # A half constant is rounded to half: 0.1 -> 0.0999755859375.
    (["3:half=0.1", "0:uint=1", "1:bool=false", "7:ushort=5"], lambda x: x + 0.0999755859375),
])
def test_function_constants_specialise_the_kernel(constants, expected):
    x = exact_values(64, seed=3)
    out = launch_with_constants(constants, x)
    torch.testing.assert_close(out.double(), expected(x.double()), rtol=0, atol=0)


@pytest.mark.parametrize("constants, message", [
    (["1:bool=true", "3:half=0"], r"function constant 'scale' \[\[function_constant\(0\)\]\] is used but the launch "
                                  r"gives it no value .* at threadgroup \(0,0,0\), thread \(0,0,0\)"),
    (["0:uint=1", "3:half=0"], r"function constant 'use_bias' \[\[function_constant\(1\)\]\] is used"),
    (["0:float=1"], r"function constant index 0 is given as float, but 'scale' is declared uint"),
    (["5:uint=1"], r"function constant index 5 \(uint\) is given, but tests/sim/csrc/selftest/function_constants.metal "
                   r"declares no \[\[function_constant\(5\)\]\]; it declares: scale \(0, uint\), use_bias \(1, bool\)"),
    (["0:uint=1", "0:uint=2"], r"function constant index 0 is given twice"),
    (["0:uint=-1"], r"'0:uint=-1': value is not a uint"),
    (["0=uint:1"], r"is not written index:type=value"),
])
def test_function_constant_errors(constants, message):
    with pytest.raises((RuntimeError, ValueError), match=message) as info:
        launch_with_constants(constants, torch.zeros(32))
    if "given" in message:
        assert "kernel 'selftest_function_constants'" in str(info.value)


def test_a_kernel_without_function_constants_rejects_values():
    with pytest.raises(RuntimeError, match=r"declares no \[\[function_constant\(0\)\]\]; it declares: none"):
        torch.ops.tree_attn_sim.launch("selftest_copy", [1], [32], [], [torch.zeros(32), torch.zeros(32)], ["0:uint=1"])


def test_translation_of_function_constants():
    cpp = translate("constant uint n [[function_constant(4)]];\n"
                    "constant bool has_n = is_function_constant_defined(n);\n"
                    "constant uint plain = 3;\n"
                    "kernel void f(device float* x [[buffer(0)]], constant uint& m [[buffer(1)]]) { x[0] = has_n ? n : m; }\n")
    assert 'static constexpr ::metal::detail::function_constant<uint> n{0, 4, "n"};' in cpp
    assert "static const ::metal::detail::function_constant_expr<bool>  has_n {+[]() -> bool { return bool( " \
           "is_function_constant_defined(n)); }};" in cpp
    assert "static const uint plain = 3;" in cpp
    assert '{"n", 4, ::metal::detail::function_constant_type<uint>()}' in cpp
    assert "tree_attn_sim_function_constants, 1}" in cpp


@pytest.mark.parametrize("source, message", [
    ("constant float2 v [[function_constant(0)]];\n", r"type 'float2' is not supported"),
    ("constant uint a [[function_constant(0)]];\nconstant uint b [[function_constant(0)]];\n",
     r"'a' and 'b' share \[\[function_constant\(0\)\]\]"),
    ("constant uint a [[function_constant(0)]] = 3;\n", r"no initializer"),
    ("constant uint a [[function_constant(x)]];\n", r"with an integer index"),
    ("kernel void f(device float* x [[buffer(0), function_constant(has_x)]]) {}\n", r"unsupported parameter attribute"),
])
def test_translator_rejects_bad_function_constants(source, message):
    with pytest.raises(msl2cpp.TranslationError, match=message):
        translate(source)


# ---------------------------------------------------------------------------------------------
# The translator
# ---------------------------------------------------------------------------------------------
KERNEL_PREFIX = "#include <metal_stdlib>\nusing namespace metal;\n"


def translate(body):
    return msl2cpp.translate_source(KERNEL_PREFIX + body, "snippet.metal")


def test_translation_of_address_spaces_literals_and_instantiations():
    cpp = translate(
        "constant float kScale = 0.5;\n"
        "template <typename T>\n"
        "kernel void f(device const T* x [[buffer(0)]], device T* y [[buffer(1)]],\n"
        "              constant uint& n [[buffer(2)]], uint i [[thread_position_in_grid]]) {\n"
        "  threadgroup float tile[64];\n"
        "  device const T* row = x + i;\n"
        "  thread float* local = nullptr;\n"
        "  y[i] = T(row[0] * 1.5h + kScale);\n"
        "}\n"
        'template [[host_name("f_half")]] [[kernel]] void f<half>(device const half* x [[buffer(0)]],\n'
        "    device half* y [[buffer(1)]], constant uint& n [[buffer(2)]], uint i [[thread_position_in_grid]]);\n"
    )
    assert "static const float kScale = 0.5f;" in cpp
    assert "::metal::device_ptr<const T> x" in cpp and "::metal::device_ptr<T> y" in cpp
    assert "const uint& n" in cpp
    assert "::metal::device_ptr<const T> row = x + i;" in cpp
    assert " float* local" in cpp
    assert "::metal::half(1.5f)" in cpp
    assert "threadgroup_declare_array<float, size_t(64)>" in cpp
    assert 'KernelEntry{"f_half", ' in cpp
    assert "f<half>(" in cpp
    assert '#line 1 "snippet.metal"' in cpp
    # Lines stay where they were: `row` is declared on line 8 of the snippet.
    body = cpp.split('#line 1 "snippet.metal"\n', 1)[1]
    assert body.splitlines()[7].strip().startswith("::metal::device_ptr<const T> row")


def test_macros_get_the_same_rewriting():
    cpp = translate(
        "#define SCALED(p, i) \\\n    (float((p)[i]) * 2.0)\n"
        "#define ROW(T) device const T*\n"
        "#include \"tree_attn_params.h\"\n"
        "kernel void f(device const half* x [[buffer(0)]]) {}\n"
    )
    assert "#define SCALED(p, i) \\\n    (float((p)[i]) * 2.0f)" in cpp
    assert "#define ROW(T) ::metal::device_ptr<const T>" in cpp
    # Project headers are included where they stand, outside the translation's namespace, and the
    # line numbering resumes after them.
    assert '}  // namespace: "tree_attn_params.h" is C++ shared with the host\n#include "tree_attn_params.h"\n' \
           'namespace {\n#line 7 "snippet.metal"' in cpp


@pytest.mark.parametrize(
    "source, message",
    [
        ("kernel void f(device atomic_int* c [[buffer(0)]]) { atomic_fetch_add_explicit(c, 1, memory_order_relaxed); }",
         r"snippet.metal:3: error: 'atomic_int': atomics are not supported"),
        ("kernel void f(device float* x [[buffer(0)]] [[unknown_thing]]) {}", r"snippet.metal:3: error: "),
        ("kernel void f(device float* x [[buffer(0)]]) { x[0] = 1.0f; } [[visible]] void g() {}",
         r"snippet.metal:3: error: unsupported attribute \[\[visible\]\]"),
        ("kernel void f(device float* x [[sample_id]]) {}", r"unsupported parameter attribute \[\[sample_id\]\]"),
        ("kernel void f(device float* x) {}", r"parameter 'device float\* x' needs an attribute"),
        ("kernel void f(device float& x [[buffer(0)]]) {}", r"non-const device reference is not supported"),
        ("kernel void f(device float* x [[buffer(0)]]) { threadgroup float t[4] = {0}; }",
         r"one variable per declaration, without an initializer"),
        ("kernel void f(device double* x [[buffer(0)]]) {}", r"'double': double is not an MSL type"),
        ("#include <metal_atomic>\n", r"only <metal_stdlib> is supported"),
        ('#define NAMED [[host_name("f")]]\n', r"attributes inside #define"),
        ("template <typename T> kernel void f(device T* x [[buffer(0)]]) {}\n"
         '#define INST(T) template [[host_name("f_" #T)]] [[kernel]] void f<T>(device T* x [[buffer(0)]]);\n'
         "INST(float, half)\n", r"'INST' takes 1 arguments, got 2"),
        ("template <typename T> kernel void f(device T* x [[buffer(0)]]) {}\n"
         '#define INST(T) template [[host_name("f_" #T)]] [[kernel]] void f<T>(device T* x [[buffer(0)]]);\n'
         "void g() { INST(float) }\n", r"'INST' used inside a function"),
        ("kernel void f(device float** x [[buffer(0)]]) {}", r"pointers to pointers"),
        ("threadgroup float shared_at_file_scope[4];\n", r"must be declared inside a kernel"),
        ("template <typename T> kernel void f(device T* x [[buffer(0)]]) {}\n"
         "template [[kernel]] void f<float>(device float* x [[buffer(0)]]);",
         r"needs \[\[host_name"),
        ("template <typename T> kernel void f(device T* x [[buffer(0)]], device T* y [[buffer(1)]]) {}\n"
         'template [[host_name("f_float")]] [[kernel]] void f<float>(device float* x [[buffer(1)]], device float* y [[buffer(0)]]);',
         r"'f_float': the parameters \(names and attributes\) .* differ from those of kernel template 'f'"),
        ('template [[host_name("g_float")]] [[kernel]] void g<float>(device float* x [[buffer(0)]]);',
         r"instantiates 'g', which is not a kernel template defined above it"),
    ],
)
def test_translator_rejects_constructs_outside_the_subset(source, message):
    with pytest.raises(msl2cpp.TranslationError, match=message):
        translate(source)


def test_translator_accepts_simdgroup_matrix():
    cpp = translate("#include <metal_simdgroup_matrix>\n"
                    "kernel void f(device float* x [[buffer(0)]]) {\n"
                    "  simdgroup_float8x8 m;\n  simdgroup_load(m, x, 8, ulong2(0, 0), true);\n  simdgroup_store(m, x);\n}\n")
    assert "// #include <metal_simdgroup_matrix>: provided by sim/msl.h" in cpp
    assert "simdgroup_float8x8 m;" in cpp


def test_translator_expands_instantiation_macros():
    # `#`, `##`, adjacent string literals in [[host_name]], nested macros: C preprocessor rules.
    cpp = translate("template <typename T, int N> kernel void f(device T* x [[buffer(0)]]) { x[0] = T(N); }\n"
                    '#define INST(T, TAG, N) template [[host_name("f_" #TAG "_n" #N)]] [[kernel]] void \\\n'
                    "  f<T, N>(device T* x [[buffer(0)]]);\n"
                    "#define BOTH(N) INST(float, f32, N) INST(half, f##16, N)\n"
                    "BOTH(1)\nBOTH(2)\n")
    names = re.findall(r'KernelEntry\{"([^"]+)"', cpp)
    assert names == ["f_f32_n1", "f_f16_n1", "f_f32_n2", "f_f16_n2"]


def test_translator_expands_kernel_tables_from_included_headers(tmp_path):
    # An X-macro table in a project header (shared with host C++): invoked at file scope
    # with an instantiation macro, it is expanded like the source's own macros, name macros
    # from the header included; a header macro used elsewhere is left to the C++ compiler.
    (tmp_path / "table.h").write_text(
        '#define NAME(TAG, N) "f_" #TAG "_n" #N\n'
        "#define PAIRS(X, N) X(float, f32, N) X(half, f16, N)\n"
        "#define TABLE(X) PAIRS(X, 1) PAIRS(X, 2)\n"
        "#define TWICE(x) (2 * (x))\n")
    source = tmp_path / "k.metal"
    source.write_text('#include "table.h"\n'
                      "template <typename T, int N> kernel void f(device T* x [[buffer(0)]]) { x[0] = T(TWICE(N)); }\n"
                      "#define INST(T, TAG, N) template [[host_name(NAME(TAG, N))]] [[kernel]] void \\\n"
                      "  f<T, N>(device T* x [[buffer(0)]]);\n"
                      "TABLE(INST)\n")
    cpp = msl2cpp.translate_file(str(source))
    assert re.findall(r'KernelEntry\{"([^"]+)"', cpp) == ["f_f32_n1", "f_f16_n1", "f_f32_n2", "f_f16_n2"]
    assert "TWICE(N)" in cpp and '#include "table.h"' in cpp


def test_translator_reports_the_line_of_the_problem():
    with pytest.raises(msl2cpp.TranslationError, match=r"^bad.metal:4: error: 'atomic_uint'"):
        msl2cpp.translate_source("#include <metal_stdlib>\n\nkernel void f(\n  device atomic_uint* c [[buffer(0)]]) {}\n",
                                 "bad.metal")


def test_the_project_shaders_translate():
    shaders = sorted(f for f in os.listdir(os.path.join(ROOT, "shaders")) if f.endswith(".metal"))
    assert shaders
    for name in shaders:
        cpp = msl2cpp.translate_file(os.path.join(ROOT, "shaders", name))
        assert "KernelRegistrar" in cpp
