"""The timing the benchmarks share (bench_op.py, bench_e2e.py, bench_launch.py, tune_cuda.py,
and tests/gpu_hopper_check.py's bench): device syncs, CUDA-graph capture, graph replays timed
with CUDA events, single calls timed one by one, and matplotlib for the plots.

The scripts run as ``python benchmarks/<name>.py``, which puts this folder on sys.path:
they ``import timing``; tests/gpu_hopper_check.py, with the repository root on sys.path,
imports ``benchmarks.timing``.
"""
import statistics
import time

import torch


def synchronize(device) -> None:
    """Waits for the device's queued work (CUDA, MPS); nothing to wait for on the CPU."""
    kind = torch.device(device).type
    if kind == "cuda":
        torch.cuda.synchronize()
    elif kind == "mps":
        torch.mps.synchronize()


def graphed(fn, warmup: int = 3, prepare=None):
    """fn captured in a CUDA graph: `warmup` calls first on a side stream (compilation, lazy
    allocations; as PyTorch's CUDA-graph docs prescribe), then the capture. prepare(), when
    given, runs before each warm-up call and before the capture, outside it (e.g. resetting
    a cache's length). Returns (graph, the capture's output: the static buffer each replay
    rewrites)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            if prepare is not None:
                prepare()
            fn()
    torch.cuda.current_stream().wait_stream(side)
    if prepare is not None:
        prepare()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


def replay_us(replay, iters: int, repeats: int = 7) -> float:
    """µs per call of replay (a graph's replay): after one untimed call, `repeats` samples of
    `iters` back-to-back calls between two CUDA events, each sample their mean; the median
    sample."""
    replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(samples)


def median_ms(fn, device, iters: int, *, warmup: int = 0, before=None, max_seconds=None) -> float:
    """Median ms of `iters` calls of fn timed one by one, after `warmup` calls made the same
    way and not counted. Each call: before(i) if given (i counts the calls from 0, warm-up
    included), a device sync, then fn() alone is timed: between CUDA events on a CUDA
    device, else by perf_counter up to a device sync. max_seconds: stop early once that long
    has passed since the first counted call, with 3 counted at least."""
    cuda = torch.device(device).type == "cuda"
    times = []
    started = None
    i = 0
    while len(times) < iters:
        if i == warmup:
            started = time.perf_counter()
        if max_seconds is not None and len(times) >= 3 and time.perf_counter() - started >= max_seconds:
            break
        if before is not None:
            before(i)
        synchronize(device)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
        i += 1
    return statistics.median(times)


def pyplot(option: str):
    """matplotlib.pyplot on a headless backend (Agg), or None without matplotlib (saying so,
    under the name of the `option` that asked for a plot)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"{option}: matplotlib is not installed, no plot written")
        return None
    return plt
