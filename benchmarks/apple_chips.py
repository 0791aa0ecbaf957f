"""Published per-chip GPU figures of Apple M-series chips, for the Metal cost model
(benchmarks/metal_cost.py). Benchmark apparatus, not the product.

One row per chip, its largest GPU configuration (the binned variants have fewer cores and,
for M3 Max / M4 Max, less bandwidth). Fields:

- gpu_cores: GPU cores (Apple's spec pages).
- clock_mhz: the GPU's peak clock. Apple does not publish it; M1/M2 figures are
  philipturner/metal-benchmarks' (the per-chip FP32 GFLOPS there equal
  cores x 256 x clock); M3/M4 figures are a third-party database's (hmc-tech.com GPU pages,
  whose FP32 TFLOPS likewise equal cores x 256 x clock), not measured by a public benchmark,
  so those rows mark the clock `estimated`; M4 Pro's is interpolated.
- fp32_fma_per_cycle_per_core, fp16_fma_per_cycle_per_core: 128 each (128 ALUs per core,
  one FMA each per cycle: 256 FLOPs per core per cycle for FP32 and for FP16,
  philipturner/metal-benchmarks; FP16 is not faster than FP32 on Apple GPUs). Assumed
  unchanged for M3 and M4 (no public microbenchmark says otherwise): marked estimated there.
- bandwidth_gbs: unified-memory bandwidth, GB/s (Apple's spec pages / press releases).
- estimated: the names of the fields above that are estimates, not published figures.

Values that had to be estimated are listed per row in `estimated` and the source comment
says why; nothing here is measured by this project.
"""
import dataclasses


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    gpu_cores: int
    clock_mhz: float
    fp32_fma_per_cycle_per_core: int
    fp16_fma_per_cycle_per_core: int
    bandwidth_gbs: float
    source: str
    estimated: tuple = ()

    @property
    def clock_hz(self):
        return self.clock_mhz * 1e6

    @property
    def bandwidth_bytes_per_s(self):
        return self.bandwidth_gbs * 1e9

    def fma_per_s(self, element="float"):
        """Peak FMAs (lane operations) per second over all cores, for float or half math."""
        per_cycle = {"float": self.fp32_fma_per_cycle_per_core, "half": self.fp16_fma_per_cycle_per_core}
        if element not in per_cycle:
            raise ValueError(f"fma_per_s: element must be 'float' or 'half', got {element!r}")
        return self.gpu_cores * per_cycle[element] * self.clock_hz


_FMA = dict(fp32_fma_per_cycle_per_core=128, fp16_fma_per_cycle_per_core=128)
_M3M4_EST = ("clock_mhz", "fp32_fma_per_cycle_per_core", "fp16_fma_per_cycle_per_core")

CHIPS = [
    # M1: 8-core GPU, 68.25 GB/s (Apple M1 spec); 1278 MHz, 2617 FP32 GFLOPS (philipturner/metal-benchmarks).
    Chip("M1", 8, 1278, **_FMA, bandwidth_gbs=68.25, source="Apple spec; philipturner/metal-benchmarks"),
    # M1 Pro: 16-core GPU, 200 GB/s (Apple); 1296 MHz, 5308 GFLOPS (philipturner/metal-benchmarks).
    Chip("M1 Pro", 16, 1296, **_FMA, bandwidth_gbs=200, source="Apple spec; philipturner/metal-benchmarks"),
    # M1 Max: 32-core GPU, 400 GB/s (Apple); 1296 MHz, 10617 GFLOPS (philipturner/metal-benchmarks).
    Chip("M1 Max", 32, 1296, **_FMA, bandwidth_gbs=400, source="Apple spec; philipturner/metal-benchmarks"),
    # M2: 10-core GPU, 100 GB/s (Apple); 1398 MHz, 3579 GFLOPS (philipturner/metal-benchmarks).
    Chip("M2", 10, 1398, **_FMA, bandwidth_gbs=100, source="Apple spec; philipturner/metal-benchmarks"),
    # M2 Pro: 19-core GPU, 200 GB/s (Apple); 1398 MHz, 6800 GFLOPS (philipturner/metal-benchmarks).
    Chip("M2 Pro", 19, 1398, **_FMA, bandwidth_gbs=200, source="Apple spec; philipturner/metal-benchmarks"),
    # M2 Max: 38-core GPU, 400 GB/s (Apple); 1398 MHz, 13600 GFLOPS (philipturner/metal-benchmarks).
    Chip("M2 Max", 38, 1398, **_FMA, bandwidth_gbs=400, source="Apple spec; philipturner/metal-benchmarks"),
    # M3: 10-core GPU, 100 GB/s (Apple); clock 1398 MHz as hmc-tech lists for the M3 family (third party).
    Chip("M3", 10, 1398, **_FMA, bandwidth_gbs=100, source="Apple spec; hmc-tech.com (clock)", estimated=_M3M4_EST),
    # M3 Pro: 18-core GPU, 150 GB/s (Apple); 1398 MHz, 6.44 FP32 TFLOPS (hmc-tech.com, third party).
    Chip("M3 Pro", 18, 1398, **_FMA, bandwidth_gbs=150, source="Apple spec; hmc-tech.com (clock)",
         estimated=_M3M4_EST),
    # M3 Max: 40-core GPU, 400 GB/s (Apple; the 30-core part has 300); 1398 MHz, 14.32 TFLOPS (hmc-tech.com).
    Chip("M3 Max", 40, 1398, **_FMA, bandwidth_gbs=400, source="Apple spec; hmc-tech.com (clock)",
         estimated=_M3M4_EST),
    # M4: 10-core GPU, 120 GB/s (Apple); 1470 MHz (hmc-tech.com's M4 entry, third party).
    Chip("M4", 10, 1470, **_FMA, bandwidth_gbs=120, source="Apple spec; hmc-tech.com (clock)", estimated=_M3M4_EST),
    # M4 Pro: 20-core GPU, 273 GB/s (Apple). Clock: no figure found; 1578 MHz is the midpoint of the
    # M4 (1470) and M4 Max (1678) figures of the same database -- an estimate.
    Chip("M4 Pro", 20, 1578, **_FMA, bandwidth_gbs=273, source="Apple spec; clock interpolated (estimate)",
         estimated=_M3M4_EST),
    # M4 Max: 40-core GPU, 546 GB/s (Apple; the 32-core part has 410); 1678 MHz, 13.74 TFLOPS at 32 cores
    # (hmc-tech.com, third party).
    Chip("M4 Max", 40, 1678, **_FMA, bandwidth_gbs=546, source="Apple spec; hmc-tech.com (clock)",
         estimated=_M3M4_EST),
]

BY_NAME = {chip.name: chip for chip in CHIPS}


def chip(name):
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown chip {name!r}; known: {', '.join(BY_NAME)}") from None
