"""Which Triton main-kernel tiles run correctly on this GPU: each (dtype, D, config, splits)
in its own process (an illegal memory access poisons the CUDA context), checked against the
float64 reference. Prints one line per probe: ok / mismatch / error (with the error's last
line). GPU apparatus, not a pytest module; usage: python -m tests.gpu_config_probe [--dims D ...] [--dtypes ...]
[--splits N ...] [--jobs J]

Found by it (H100, triton 3.6): float32 tiles of BLOCK_M 64 with 8 warps are miscompiled; the
plan refuses them (csrc/cuda/triton_plan.cpp choose()).
"""
import argparse
import concurrent.futures
import json
import subprocess
import sys

# (BLOCK_M, BLOCK_N, num_warps, num_stages): 8-warp float32 tiles and controls.
CONFIGS = [(64, 32, 8, 2), (64, 32, 8, 3), (64, 16, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2), (32, 32, 8, 1),
           (32, 32, 4, 2), (64, 32, 4, 3), (128, 32, 4, 2)]


def _one(dtype_name, D, cfg, splits):
    import torch
    from tests.cases import Case, args_of, check_against_reference, make_inputs
    from tests.gpu_hopper_check import _to
    from torch_tree_attn.backends import cuda as cuda_backend

    dtype = getattr(torch, dtype_name)
    case = Case(B=1, Hq=8, Hkv=2, T=64, S=64 + 700, D=D, dtype=dtype, seed=D + splits)
    inputs = make_inputs(case)
    cuda = _to(inputs, "cuda")
    out, lse = cuda_backend.forward_with_lse(*args_of(cuda), num_splits=splits, config=tuple(cfg), kernel="triton")
    torch.cuda.synchronize()
    check_against_reference(out.cpu(), lse.cpu(), inputs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--jobs", type=int, default=4, help="probes at once (each its own process)")
    args = ap.parse_args()
    if args.one:
        dtype_name, D, cfg, splits = json.loads(args.one)
        _one(dtype_name, D, cfg, splits)
        return
    probes = [(dtype_name, D, cfg, splits) for dtype_name in args.dtypes for D in args.dims for cfg in CONFIGS
              for splits in args.splits]

    def run(probe):
        try:
            r = subprocess.run([sys.executable, "-m", "tests.gpu_config_probe", "--one", json.dumps(probe)],
                               capture_output=True, text=True, timeout=240)
        except subprocess.TimeoutExpired:
            return "error: timed out"
        if r.returncode == 0:
            return "ok"
        last = [ln for ln in (r.stderr or r.stdout).splitlines() if ln.strip()][-1:]
        kind = "mismatch" if "AssertionError" in r.stderr else "error"
        return f"{kind}: {last[0][:160] if last else r.returncode}"

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for (dtype_name, D, cfg, splits), verdict in zip(probes, pool.map(run, probes)):
            print(f"{dtype_name:9s} D={D:<4d} config={tuple(cfg)} splits={splits}: {verdict}", flush=True)

if __name__ == "__main__":
    main()
