"""A per-chip cost model of the Metal launch plan: modelled, not measured.

No Apple GPU exists where this project is built; every number this module produces is a
model's estimate from counted work and published per-chip figures (benchmarks/apple_chips.py),
and is labelled MODELLED wherever it is printed or stored. Benchmark apparatus, not the product.

Inputs, per launch of the plan (LaunchWork):
- the launch geometry (grid, threads per threadgroup, threadgroup memory) from the plan JSON
  (`torch.ops.tree_attn_sim.launch_plan`);
- device bytes read + written: the plan's traffic model (the simulator checks every launch's
  counted bytes against it, so this equals what the shader reads);
- the simulator's per-launch counters (`torch.ops.tree_attn_sim.traffic`, keys of
  tests/sim/csrc/runtime.h `counter_items`): threadgroup_bytes_read/written, simdgroup_mmas,
  scalar_fmas, shuffles.

Where the counters come from (`work_of`):
- "simulator": run the shaders at the asked shape and take the counters as counted. Exact,
  but the simulator takes seconds per 256 keys; the default for small shapes.
- "scaled": run the simulator at the same shape with a short proxy prefix (PROXY_PREFIX) and
  scale each launch's counters by the ratio of that launch's modelled device bytes read
  (target over proxy); device bytes are the target plan's own. Counter work grows with the
  K/V bytes a launch stages, so this is exact up to per-threadgroup fixed work
  (tests/test_cost_model.py bounds the error against a simulated run).
- Either way, the MACs of Q.K^T and P.V are also derived from the plan: each K/V byte a
  block stages meets block_rows rows, so MACs = key_value_bytes * block_rows / kv_element.
  The matrix (v2) kernel does them as 8x8x8 simdgroup MMAs (512 MACs each; this equals the
  counted simdgroup_mmas); the vector (v1) kernel writes them as `a * b + c`, which the
  simulator does not count (it counts fma() calls only), so the vector kernel's scalar FMAs
  are taken as max(counted scalar_fmas, MACs).

The model, per launch on a chip (LaunchTime):
    time = max(memory, math, threadgroup memory) + LAUNCH_OVERHEAD_S
    memory = device bytes / min(bandwidth, active cores * CORE_IO_BYTES_PER_CYCLE * clock)
    math   = straggle * (MMA MACs / (MATRIX_EFFICIENCY * peak FMA/s of the matrix element type)
                         + (scalar FMAs + SHUFFLE_LANE_SLOTS * shuffles) / peak FP32 FMA/s)
    threadgroup memory = straggle * threadgroup bytes / (cores * TG_BYTES_PER_CYCLE * clock)
Assumptions (each a named constant below):
- Work is spread evenly over a launch's threadgroups, threadgroups are dealt to cores round
  robin, and a core's ALUs and threadgroup memory are shared by the threadgroups resident on
  it: a core holding k threadgroups takes k times one's time. So compute-like terms carry
  straggle = ceil(threadgroups / cores) * cores / threadgroups (1 when the grid divides
  evenly; 8 for one threadgroup on an 8-core GPU).
- Memory: one core moves at most CORE_IO_BYTES_PER_CYCLE (32 B/cycle, philipturner/
  metal-benchmarks: "its I/O bus width is the same (32 bytes)"), so a grid of few
  threadgroups cannot reach the chip's bandwidth. Caches are not modelled: every counted
  device byte is DRAM traffic (K/V re-reads by other row blocks may hit the system-level
  cache on a real chip, so memory-bound times are upper bounds in that respect).
- Math: simdgroup_matrix products reach MATRIX_EFFICIENCY = 80% of the ALU peak
  (philipturner/metal-benchmarks, facts.md); the kernels' matrices are simdgroup_float8x8,
  so they run at the FP32 rate for every input dtype. Scalar math runs at the FP32 peak
  (the kernels compute in float). Only FMAs and simd-group collectives are counted:
  exp, max, compares, conversions and address arithmetic are not (a lower bound on math).
  A collective costs SHUFFLE_LANE_SLOTS = 32 lane slots (one SIMD instruction), an estimate.
- Threadgroup memory: TG_BYTES_PER_CYCLE = 128 bytes per core per cycle, an estimate (no
  published figure was found); bank conflicts are not modelled.
- Occupancy is reported (threadgroups resident per core from MAX_THREADS_PER_CORE and
  TG_MEMORY_PER_CORE, and the waves that gives) but does not change the time: latency hiding
  is not modelled.
- LAUNCH_OVERHEAD_S = 2 us per dispatch, an estimate for a dispatch into PyTorch's open,
  coalesced compute encoder.
- The bound of a launch is the largest of its three terms; a plan's bound is its longest
  launch's.
"""
import dataclasses
import functools
import json
import math

from apple_chips import CHIPS, Chip

LABEL = "modelled, not measured"

MATRIX_EFFICIENCY = 0.8          # simdgroup_matrix fraction of ALU peak (philipturner/metal-benchmarks)
MACS_PER_MMA = 8 * 8 * 8         # one simdgroup_multiply_accumulate of 8x8 matrices
CORE_IO_BYTES_PER_CYCLE = 32     # per-core memory bus (philipturner/metal-benchmarks)
TG_BYTES_PER_CYCLE = 128         # threadgroup memory per core per cycle: ESTIMATE
SHUFFLE_LANE_SLOTS = 32          # lane slots per simd-group collective: ESTIMATE
LAUNCH_OVERHEAD_S = 2e-6         # per dispatch: ESTIMATE
MAX_THREADS_PER_CORE = 1024      # resident threads per core (768-3072 by register use): ESTIMATE
TG_MEMORY_PER_CORE = 64 * 1024   # threadgroup memory per core (philipturner/metal-benchmarks)
PROXY_PREFIX = 256               # prefix of the proxy run of the "scaled" counters

COUNTER_KEYS = ("threadgroup_bytes_read", "threadgroup_bytes_written", "simdgroup_mmas", "scalar_fmas", "shuffles")
ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclasses.dataclass(frozen=True)
class LaunchWork:
    """What one launch does: geometry and counted work, independent of the chip."""
    kernel: str
    threadgroups: int
    threads_per_threadgroup: int
    threadgroup_memory_bytes: int
    device_bytes: int
    threadgroup_bytes: int = 0
    simdgroup_mmas: int = 0
    scalar_fmas: int = 0
    shuffles: int = 0
    matrix_element: str = "float"  # element type of the simdgroup matrices: "float" or "half"
    counters: str = "given"        # where the counters came from

    def __post_init__(self):
        for name in ("threadgroups", "threads_per_threadgroup"):
            if getattr(self, name) < 1:
                raise ValueError(f"LaunchWork.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("threadgroup_memory_bytes", "device_bytes", "threadgroup_bytes", "simdgroup_mmas",
                     "scalar_fmas", "shuffles"):
            if getattr(self, name) < 0:
                raise ValueError(f"LaunchWork.{name} must be >= 0, got {getattr(self, name)}")
        if self.matrix_element not in ("float", "half"):
            raise ValueError(f"LaunchWork.matrix_element must be 'float' or 'half', got {self.matrix_element!r}")


@dataclasses.dataclass(frozen=True)
class LaunchTime:
    kernel: str
    memory_s: float
    math_s: float
    threadgroup_s: float
    overhead_s: float
    resident_per_core: int
    waves: int
    label: str = LABEL

    @property
    def total_s(self):
        return max(self.memory_s, self.math_s, self.threadgroup_s) + self.overhead_s

    @property
    def bound(self):
        terms = {"memory": self.memory_s, "compute": self.math_s, "threadgroup": self.threadgroup_s}
        return max(terms, key=terms.get)


@dataclasses.dataclass(frozen=True)
class PlanTime:
    chip: str
    family: str
    launches: tuple
    label: str = LABEL

    @property
    def total_s(self):
        return sum(t.total_s for t in self.launches)

    @property
    def total_us(self):
        return self.total_s * 1e6

    @property
    def bound(self):
        return max(self.launches, key=lambda t: t.total_s).bound

    def as_dict(self):
        return dict(label=self.label, chip=self.chip, family=self.family, modelled_us=self.total_us,
                    bound=self.bound,
                    launches=[dict(kernel=t.kernel, modelled_us=t.total_s * 1e6, bound=t.bound,
                                   memory_us=t.memory_s * 1e6, math_us=t.math_s * 1e6,
                                   threadgroup_us=t.threadgroup_s * 1e6, overhead_us=t.overhead_s * 1e6,
                                   resident_per_core=t.resident_per_core, waves=t.waves) for t in self.launches])


def launch_time(work: LaunchWork, chip: Chip) -> LaunchTime:
    """The modelled time of one launch on one chip (see the module docstring)."""
    cores, clock = chip.gpu_cores, chip.clock_hz
    tgs = work.threadgroups
    straggle = math.ceil(tgs / cores) * cores / tgs
    active = min(cores, tgs)
    bandwidth = min(chip.bandwidth_bytes_per_s, active * CORE_IO_BYTES_PER_CYCLE * clock)
    memory_s = work.device_bytes / bandwidth
    mma_s = work.simdgroup_mmas * MACS_PER_MMA / (MATRIX_EFFICIENCY * chip.fma_per_s(work.matrix_element))
    scalar_s = (work.scalar_fmas + SHUFFLE_LANE_SLOTS * work.shuffles) / chip.fma_per_s("float")
    math_s = straggle * (mma_s + scalar_s)
    threadgroup_s = straggle * work.threadgroup_bytes / (cores * TG_BYTES_PER_CYCLE * clock)
    by_threads = MAX_THREADS_PER_CORE // work.threads_per_threadgroup
    by_memory = TG_MEMORY_PER_CORE // work.threadgroup_memory_bytes if work.threadgroup_memory_bytes else by_threads
    resident = max(1, min(by_threads, by_memory))
    waves = math.ceil(tgs / (cores * resident))
    return LaunchTime(work.kernel, memory_s, math_s, threadgroup_s, LAUNCH_OVERHEAD_S, resident, waves)


def plan_time(works, chip: Chip, family: str) -> PlanTime:
    return PlanTime(chip.name, family, tuple(launch_time(w, chip) for w in works))


# --- counters from the plan and the simulator ------------------------------------------

def _ops():
    import torch
    import torch_tree_attn_sim  # noqa: F401  (registers torch.ops.tree_attn_sim)

    return torch.ops.tree_attn_sim


def has_family_override():
    """Whether the simulator's plan takes a forced kernel family (set_kernel_family: the v2
    branch's internal override). Without it only the plan's own choice can be modelled."""
    return hasattr(_ops(), "set_kernel_family")


FAMILIES = {"v1": "vector", "v2": "matrix"}


class _Family:
    """Forces the main kernel family of every plan inside the block (and restores it)."""

    def __init__(self, family):
        if family not in (None, "auto", *FAMILIES.values()):
            raise ValueError(f"family must be 'auto', 'vector' or 'matrix', got {family!r}")
        self.family = family

    def __enter__(self):
        self.previous = None
        if self.family not in (None, "auto"):
            if not has_family_override():
                raise RuntimeError("this simulator build has no set_kernel_family: only the plan's own "
                                   "choice (family 'auto') can be modelled")
            self.previous = _ops().set_kernel_family(self.family)

    def __exit__(self, *exc):
        if self.previous is not None:
            _ops().set_kernel_family(self.previous)


def plan_json(args, family=None):
    with _Family(family):
        return json.loads(_ops().launch_plan(*args))


def traffic_json(args, family=None):
    with _Family(family):
        return json.loads(_ops().traffic(*args))


def _launch_reads(plan, index):
    actual = plan["actual"]
    return actual["main_reads"]["total"] if index == 0 else actual["reduce_reads"]


def _launch_writes(plan, index):
    actual = plan["actual"]
    return actual["main_writes"] if index == 0 else actual["reduce_writes"]


def _macs(plan, kv_element_bytes):
    return plan["actual"]["main_reads"]["key_value"] * plan.get("block_rows", 32) // kv_element_bytes


def works_from(plan, counters_per_launch, kv_element_bytes, source):
    """LaunchWork of every launch of `plan` (the plan JSON) from per-launch counter dicts."""
    if len(counters_per_launch) != len(plan["launches"]):
        raise ValueError(f"{len(counters_per_launch)} counter sets for {len(plan['launches'])} launches")
    works = []
    for i, (launch, counters) in enumerate(zip(plan["launches"], counters_per_launch)):
        missing = [k for k in COUNTER_KEYS if k not in counters]
        if missing:
            raise ValueError(f"launch {launch['kernel']}: counters lack {missing}")
        mmas, scalar = int(counters["simdgroup_mmas"]), int(counters["scalar_fmas"])
        if i == 0:
            macs = _macs(plan, kv_element_bytes)
            if plan.get("family", "vector") == "matrix":
                mmas = max(mmas, math.ceil(macs / MACS_PER_MMA))
            else:
                scalar = max(scalar, macs)
        works.append(LaunchWork(
            kernel=launch["kernel"], threadgroups=math.prod(launch["grid"]),
            threads_per_threadgroup=math.prod(launch["threads"]),
            threadgroup_memory_bytes=launch["threadgroup_memory_bytes"],
            device_bytes=_launch_reads(plan, i) + _launch_writes(plan, i),
            threadgroup_bytes=int(counters["threadgroup_bytes_read"]) + int(counters["threadgroup_bytes_written"]),
            simdgroup_mmas=mmas, scalar_fmas=scalar, shuffles=int(counters["shuffles"]), counters=source))
    return works


@functools.lru_cache(maxsize=None)
def _proxy_traffic(proxy, family):
    return traffic_json(proxy.args(), family)


def work_of(problem, family=None, counters="scaled"):
    """(plan JSON, [LaunchWork]) of a Problem under `family` (None/'auto': the plan's choice;
    'vector' = v1, 'matrix' = v2). counters: 'simulator' or 'scaled' (module docstring)."""
    if counters not in ("simulator", "scaled"):
        raise ValueError(f"counters must be 'simulator' or 'scaled', got {counters!r}")
    args = problem.args()
    kv_bytes = ELEMENT_BYTES[problem.dtype]
    if counters == "simulator":
        traffic = traffic_json(args, family)
        plan = traffic["plan"]
        return plan, works_from(plan, [l["counters"] for l in traffic["launches"]], kv_bytes, "simulator")
    plan = plan_json(args, family)
    proxy = dataclasses.replace(problem, P=min(problem.P, PROXY_PREFIX))
    traffic = _proxy_traffic(proxy, family)
    proxy_plan = traffic["plan"]
    scaled = []
    for i, (mine, theirs) in enumerate(zip(plan["launches"], traffic["launches"])):
        if mine["kernel"] != theirs["kernel"]:
            raise RuntimeError(f"proxy run chose {theirs['kernel']}, the plan {mine['kernel']}")
        ratio = _launch_reads(plan, i) / _launch_reads(proxy_plan, i)
        scaled.append({k: round(theirs["counters"][k] * ratio) for k in COUNTER_KEYS})
    return plan, works_from(plan, scaled, kv_bytes, f"scaled from P={proxy.P}")


@dataclasses.dataclass(frozen=True)
class Problem:
    """A tree-verify call: B=1, random T-node tree after a P-key prefix, one dtype."""
    Hq: int
    Hkv: int
    D: int
    P: int
    T: int = 64
    dtype: str = "bfloat16"
    seed: int = 0

    def args(self):
        import torch

        from torch_tree_attn.tree import ancestor_mask

        if self.dtype not in ELEMENT_BYTES:
            raise ValueError(f"dtype must be one of {sorted(ELEMENT_BYTES)}, got {self.dtype!r}")
        gen = torch.Generator().manual_seed(self.seed)
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, self.T)]
        tree = ancestor_mask(torch.tensor(parents))[None]
        dt = getattr(torch, self.dtype)
        S = self.P + self.T
        q = torch.randn(1, self.Hq, self.T, self.D, generator=gen).to(dt)
        kv = torch.randn(1, self.Hkv, S, self.D, generator=gen).to(dt)
        return (q, kv, kv, tree, torch.tensor([self.P]), None, None, None)


def model(problem, chips=CHIPS, family=None, counters="scaled"):
    """{chip name: PlanTime} and the plan JSON with its modelled times added under
    "modelled_time" (each entry labelled 'modelled, not measured')."""
    plan, works = work_of(problem, family, counters)
    times = {c.name: plan_time(works, c, plan.get("family", "vector")) for c in chips}
    plan = dict(plan, modelled_time=dict(label=LABEL, counters=works[0].counters if works else None,
                                         per_chip={n: t.as_dict() for n, t in times.items()}))
    return times, plan
