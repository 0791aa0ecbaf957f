"""The Metal cost model (benchmarks/metal_cost.py): its arithmetic on a hand-computed
launch, its bounds, its labels, and its counters against the simulator. Modelled, not
measured: nothing here runs on an Apple GPU. The simulator-backed tests skip cleanly when
tests/sim is not built."""
import math
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import metal_cost as mc  # noqa: E402
from apple_chips import CHIPS, Chip, chip  # noqa: E402

# A round-numbered chip: 10 cores at 1 GHz, 128 FMA/cycle/core (1.28e12 FMA/s), 100 GB/s.
TOY = Chip("toy", 10, 1000, 128, 128, 100, source="test")


def test_hand_computed_compute_bound_launch():
    # 20 threadgroups on 10 cores: straggle 1. 1e6 MMAs = 5.12e8 MACs at 0.8 * 1.28e12 = 500 us;
    # 1.28e8 scalar FMAs + 32 * 1e6 shuffles = 1.6e8 lane slots at 1.28e12 = 125 us: math 625 us.
    # Memory: 1e6 B / 100e9 = 10 us. Threadgroup: 1.28e9 B / (10 * 128 * 1e9) = 1000 us.
    work = mc.LaunchWork("k", threadgroups=20, threads_per_threadgroup=256, threadgroup_memory_bytes=16384,
                         device_bytes=10**6, threadgroup_bytes=1_280_000_000, simdgroup_mmas=10**6,
                         scalar_fmas=128_000_000, shuffles=10**6)
    t = mc.launch_time(work, TOY)
    assert t.memory_s == pytest.approx(10e-6)
    assert t.math_s == pytest.approx(625e-6)
    assert t.threadgroup_s == pytest.approx(1000e-6)
    assert t.total_s == pytest.approx(1000e-6 + mc.LAUNCH_OVERHEAD_S)
    assert t.bound == "threadgroup"
    # min(1024 // 256, 65536 // 16384) = 4 resident per core: one wave of 40 slots.
    assert (t.resident_per_core, t.waves) == (4, 1)


def test_straggling_threadgroups_and_per_core_bandwidth():
    # 11 threadgroups on 10 cores: one core runs two, so compute takes 2 * 10 / 11 of even.
    even = mc.LaunchWork("k", 10, 128, 0, device_bytes=0, scalar_fmas=1_280_000_000)
    odd = mc.LaunchWork("k", 11, 128, 0, device_bytes=0, scalar_fmas=1_280_000_000)
    assert mc.launch_time(even, TOY).math_s == pytest.approx(1e-3)
    assert mc.launch_time(odd, TOY).math_s == pytest.approx(1e-3 * 2 * 10 / 11)
    # One threadgroup moves at most 32 B/cycle: 32 GB/s here, not the chip's 100.
    one = mc.LaunchWork("k", 1, 128, 0, device_bytes=32 * 10**6)
    assert mc.launch_time(one, TOY).memory_s == pytest.approx(1e-3)


def test_memory_bound_case_equals_bytes_over_bandwidth():
    work = mc.LaunchWork("k", threadgroups=1000, threads_per_threadgroup=128, threadgroup_memory_bytes=0,
                         device_bytes=400 * 10**6, scalar_fmas=10**6)
    for c in CHIPS:
        t = mc.launch_time(work, c)
        assert t.bound == "memory"
        assert t.total_s - t.overhead_s == pytest.approx(400e6 / (c.bandwidth_gbs * 1e9))


def test_half_matrices_use_the_fp16_rate():
    fast_half = Chip("h", 10, 1000, 128, 256, 100, source="test")
    work = dict(threadgroups=10, threads_per_threadgroup=128, threadgroup_memory_bytes=0, device_bytes=0,
                simdgroup_mmas=10**6)
    f = mc.launch_time(mc.LaunchWork("k", matrix_element="float", **work), fast_half).math_s
    h = mc.launch_time(mc.LaunchWork("k", matrix_element="half", **work), fast_half).math_s
    assert f == pytest.approx(2 * h)


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="threadgroups"):
        mc.LaunchWork("k", 0, 128, 0, 0)
    with pytest.raises(ValueError, match="device_bytes"):
        mc.LaunchWork("k", 1, 128, 0, -1)
    with pytest.raises(ValueError, match="matrix_element"):
        mc.LaunchWork("k", 1, 128, 0, 0, matrix_element="bfloat")
    with pytest.raises(ValueError, match="unknown chip"):
        chip("M9")
    with pytest.raises(ValueError, match="counters"):
        mc.work_of(mc.Problem(Hq=4, Hkv=1, D=64, P=64), counters="guess")


def test_chip_table_is_complete_and_sourced():
    names = [c.name for c in CHIPS]
    for gen in ("M1", "M2", "M3", "M4"):
        for tier in ("", " Pro", " Max"):
            assert gen + tier in names
    for c in CHIPS:
        assert c.source and c.gpu_cores > 0 and c.clock_mhz > 0 and c.bandwidth_gbs > 0
        assert set(c.estimated) <= {f.name for f in c.__dataclass_fields__.values()}
    # The published FP32 figures of philipturner/metal-benchmarks (GFLOPS = 2 * FMA/s).
    for name, gflops in {"M1": 2617, "M1 Max": 10617, "M2 Max": 13600}.items():
        assert 2 * chip(name).fma_per_s("float") / 1e9 == pytest.approx(gflops, rel=2e-3)


def test_labels_say_modelled():
    assert "modelled" in mc.LABEL
    t = mc.plan_time([mc.LaunchWork("k", 1, 32, 0, 100)], TOY, "vector")
    assert "modelled" in t.label and "modelled" in t.launches[0].label and "modelled" in t.as_dict()["label"]


# --- against the simulator ---------------------------------------------------------------

@pytest.fixture(scope="module")
def sim():
    pytest.importorskip("torch_tree_attn_sim", reason="the Metal simulator (tests/sim) is not built")
    return mc


FAMILIES = ["vector", "matrix"]


@pytest.mark.parametrize("family", FAMILIES)
def test_modelled_time_grows_with_the_prefix(sim, family):
    if family != "vector" and not sim.has_family_override():
        pytest.skip("this simulator has no kernel-family override")
    totals = []
    for P in (256, 1024, 4096, 16384):
        times, plan = sim.model(sim.Problem(Hq=32, Hkv=8, D=128, P=P, dtype="float16"), family=family)
        assert plan["modelled_time"]["label"] == sim.LABEL
        assert set(plan["modelled_time"]["per_chip"]) == {c.name for c in CHIPS}
        totals.append({n: t.total_s for n, t in times.items()})
    for smaller, larger in zip(totals, totals[1:]):
        for name in smaller:
            assert larger[name] > smaller[name], name


@pytest.mark.parametrize("family", FAMILIES)
def test_scaled_counters_track_the_simulated_ones(sim, family):
    """Counters scaled from the P=256 proxy run against a full simulated run at P=640:
    device bytes exact, the rest within 3% on the main launch."""
    if family != "vector" and not sim.has_family_override():
        pytest.skip("this simulator has no kernel-family override")
    problem = sim.Problem(Hq=8, Hkv=2, D=64, P=640, dtype="bfloat16")
    _, simulated = sim.work_of(problem, family, "simulator")
    _, scaled = sim.work_of(problem, family, "scaled")
    assert [w.kernel for w in simulated] == [w.kernel for w in scaled]
    for a, b in zip(simulated, scaled):
        assert a.device_bytes == b.device_bytes
    main_sim, main_scaled = simulated[0], scaled[0]
    for key in ("threadgroup_bytes", "simdgroup_mmas", "scalar_fmas", "shuffles"):
        x, y = getattr(main_sim, key), getattr(main_scaled, key)
        assert y == pytest.approx(x, rel=0.03), key
    # The plan's MAC count (K/V bytes staged x block rows / element) is exactly what the
    # matrix kernel's counted MMAs do, 512 MACs each.
    if family == "matrix":
        traffic = sim.traffic_json(problem.args(), family)
        plan = traffic["plan"]
        macs = plan["actual"]["main_reads"]["key_value"] * plan["block_rows"] // 2
        assert traffic["launches"][0]["counters"]["simdgroup_mmas"] * sim.MACS_PER_MMA == macs
    else:
        assert main_sim.scalar_fmas > 0 and main_sim.simdgroup_mmas == 0
