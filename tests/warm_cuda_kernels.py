"""Compiles, in parallel, every kernel spec the GPU tests need that the prebuilt table lacks,
so Triton's on-disk cache holds them before the tests run.

tests/test_contract.py's cuda items (the parity matrix, the non-finite table) run in parallel shards (benchmarks/h200.sh); a spec the
prebuilt table lacks (a float32 query, D=96, mixed dtypes) would otherwise be compiled by
every shard that meets it, one after another inside each. Here each is compiled once, by a
pool of processes, through the same spec -> cubin path as the run-time fallback
(torch_tree_attn/backends/cuda/compiler.py), whose results Triton caches on disk.

    python -m tests.warm_cuda_kernels [--jobs N]
"""
import argparse
import concurrent.futures
import json
import multiprocessing
import os
import time


def needed_specs(arch: int, num_sms: int) -> list:
    """The distinct kernel specs (main and reduce) of the GPU tests' cases on this GPU, minus
    the prebuilt ones."""
    import torch_tree_attn  # noqa: F401
    from torch_tree_attn import _C
    from torch_tree_attn.backends import cuda as cuda_backend
    from tests.cases import args_of, make_inputs, nonfinite_cases, parity_matrix

    prebuilt = {json.dumps(e["spec"], sort_keys=True) for e in cuda_backend.load_manifest()}
    cases = parity_matrix() + [case for case, _ in nonfinite_cases()]
    seen = {}
    for case in cases:
        args = args_of(make_inputs(case))
        # The default choice (on sm_90 the Hopper kernel where it covers) and the Triton
        # kernel the parity share forces.
        for kernel in ("auto", "triton"):
            _, main, reduce = _C.cuda_plan_launch(*args, arch=arch, num_sms=num_sms, kernel=kernel)
            for spec in (main, reduce):
                if spec is not None:
                    seen.setdefault(json.dumps(spec, sort_keys=True), spec)
    return [spec for key, spec in seen.items() if key not in prebuilt]


def _compile(spec: dict) -> float:
    from torch_tree_attn.backends.cuda import compiler

    t0 = time.perf_counter()
    compiler.binary_of(compiler.compile_spec(spec))
    return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    args = ap.parse_args(argv)
    import torch

    major, minor = torch.cuda.get_device_capability()
    specs = needed_specs(major * 10 + minor, torch.cuda.get_device_properties(0).multi_processor_count)
    t0 = time.perf_counter()
    # Spawned workers: the parent has initialised CUDA, which a forked child must not inherit.
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
        times = list(pool.map(_compile, specs))
    print(f"compiled {len(specs)} kernel specs outside the prebuilt table in {time.perf_counter() - t0:.1f} s "
          f"({args.jobs} processes; slowest {max(times, default=0):.1f} s)")


if __name__ == "__main__":
    main()
