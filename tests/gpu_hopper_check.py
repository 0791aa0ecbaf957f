"""GPU check of the Hopper Gluon main pass (torch_tree_attn/backends/cuda/hopper_kernels.py): correctness
against the float64 reference, then its time against the Triton path, under CUDA graphs.

    python tests/gpu_hopper_check.py            # all phases, at most 5 minutes (each phase has a limit)
    python tests/gpu_hopper_check.py --phase smoke|parity|bench

Needs an sm_90 GPU, triton 3.6 (Gluon), and the package installed (its _C extension and
prebuilt Triton kernels). Each phase runs in a child process with a time limit, so a hung
kernel (a pipeline deadlock would hang, not fail) is reported and the next phase still
runs; inside a phase every case catches its own exception.

Phases:
- smoke: two tiny calls (one split, two splits) against the reference, through the C++
  launcher (kernel="hopper": prebuilt cubin, tensor maps encoded in C++) and through
  hopper_kernels' Python launcher.
- parity: every case of tests/cases.py's parity matrix that covers() accepts, with the
  plan's splits and with 3 forced splits; the non-finite matrix; long prefixes with many
  splits; the 4-consumer-warp variant and 3 stages on a subset.
- bench: B=1, Hq=32, Hkv=8, D=128, a random 64-node tree after P = 1024 / 4096 / 16384 /
  65536 keys, bf16: the Gluon kernel (default config (8 consumer warps, 64-key tiles, 3 stages), and 2 / 4 stages, 4 consumer warps) and the Triton path
  (torch_tree_attn.backends.cuda.forward_with_lse, the C++ launcher), each captured in a
  CUDA graph, median of replays; prints us and the ratio, and each output's max difference
  from the Triton path's.
"""
import argparse
import os
import pathlib
import subprocess
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PHASE_LIMITS = {"smoke": 60, "parity": 90, "bench": 150}  # 5 minutes in all, even if a phase hangs


def _to(inputs, device):
    import torch

    return {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in inputs.items()}


def _check(case, num_splits=None, config=None, inject=None, python_launcher=False):
    """One case against the reference: through the C++ launcher (kernel="hopper", the
    prebuilt cubins) by default, through hopper_kernels' Python launcher for a config or when
    asked."""
    from tests.cases import args_of, check_against_reference, inject_nonfinite, make_inputs
    from torch_tree_attn.backends.cuda import hopper_kernels as hk
    from torch_tree_attn.backends import cuda as cuda_backend

    inputs = make_inputs(case)
    if inject is not None and not inject_nonfinite(inputs, inject, case.seed):
        return None
    cuda = _to(inputs, "cuda")
    if config is None and not python_launcher:
        out, lse = cuda_backend.forward_with_lse(*args_of(cuda), num_splits=num_splits, kernel="hopper")
    else:
        out, lse = hk.forward_with_lse_hopper(*args_of(cuda), num_splits=num_splits, config=config)
    check_against_reference(out.cpu(), lse.cpu(), inputs)
    return True


class Tally:
    def __init__(self, name):
        self.name, self.ok, self.failed, self.skipped, self.t0 = name, 0, [], 0, time.time()

    def run(self, label, fn):
        try:
            r = fn()
            if r is None:
                self.skipped += 1
            else:
                self.ok += 1
        except Exception as e:  # noqa: BLE001 - report every failure, keep going
            msg = f"{type(e).__name__}: {e}"
            self.failed.append((label, msg))
            if len(self.failed) <= 8:
                print(f"  FAIL {label}\n    {msg[:600]}", flush=True)
                if len(self.failed) <= 2:
                    traceback.print_exc(limit=3)

    def report(self):
        print(f"[{self.name}] {self.ok} passed, {len(self.failed)} failed, {self.skipped} skipped "
              f"({time.time() - self.t0:.1f} s)", flush=True)
        for label, msg in self.failed[8:20]:
            print(f"  FAIL {label}: {msg[:200]}")


def phase_smoke():
    import torch
    from tests.cases import Case

    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name()}, "
          f"capability {torch.cuda.get_device_capability()}", flush=True)
    import triton

    print(f"triton {triton.__version__}", flush=True)
    t = Tally("smoke")
    small = Case(B=2, Hq=8, Hkv=2, T=5, S=90, D=128, dtype=torch.bfloat16, seed=1)
    t.run("tiny, 1 split, C++ launcher", lambda: _check(small, num_splits=1))
    t.run("tiny, 2 splits, C++ launcher", lambda: _check(small, num_splits=2))
    t.run("tiny, 1 split, Python launcher", lambda: _check(small, num_splits=1, python_launcher=True))
    t.run("tiny, 2 splits, Python launcher", lambda: _check(small, num_splits=2, python_launcher=True))
    torch.cuda.synchronize()
    t.report()
    return not t.failed


def phase_parity():
    import torch
    from tests.cases import Case, args_of, make_inputs, nonfinite_cases, parity_matrix
    from torch_tree_attn.backends.cuda import hopper_kernels as hk

    cases = [c for c in parity_matrix() if hk.covers(*args_of(make_inputs(c)))]
    print(f"{len(cases)} covered parity cases", flush=True)
    t = Tally("parity, plan's splits")
    for c in cases:
        t.run(str(c), lambda c=c: _check(c))
    t.report()
    t = Tally("parity, 3 splits")
    for c in cases:
        t.run(str(c), lambda c=c: _check(c, num_splits=3))
    t.report()
    t = Tally("non-finite")
    for c, kind in nonfinite_cases():
        if c.dtype in hk.DTYPES and c.D in hk.HEAD_DIMS:
            t.run(f"{kind} {c}", lambda c=c, kind=kind: _check(c, num_splits=None, inject=kind))
            t.run(f"{kind} {c} 4 splits", lambda c=c, kind=kind: _check(c, num_splits=4, inject=kind))
    t.report()
    t = Tally("long prefixes")
    for i, (D, dt, mk, extra) in enumerate([(128, torch.bfloat16, "bool", {}), (64, torch.float16, "float", {}),
                                            (128, torch.float16, "bool", dict(softcap=30.0, sinks=torch.float32)),
                                            (128, torch.bfloat16, "float", dict(kv_layout="bshd"))]):
        c = Case(B=2, Hq=16, Hkv=4, T=37, S=5000, D=D, dtype=dt, mask_kind=mk, seed=900 + i, **extra)
        for s in (None, 1, 7, 40):
            t.run(f"{c} splits={s}", lambda c=c, s=s: _check(c, num_splits=s))
    t.report()
    t = Tally("parity, configs (8, 64, 3) and (4, 64, 4) (the table is DEFAULT_CONFIG)")
    subset = [c for c in cases if c.dtype == torch.bfloat16 and c.D == 128][::3]
    for c in subset:
        t.run(f"cw8 {c}", lambda c=c: _check(c, num_splits=2, config=(8, 64, 3)))
        t.run(f"st4 {c}", lambda c=c: _check(c, config=(4, 64, 4)))
    for c in [c for c in cases if c.D == 512][::4]:
        t.run(f"d512 (8, 16, 4) {c}", lambda c=c: _check(c, num_splits=2, config=(8, 16, 4)))
    t.report()
    torch.cuda.synchronize()


def phase_bench():
    import torch
    from benchmarks.timing import graphed, replay_us   # ROOT is on sys.path (above)
    from tests.cases import random_tree_mask
    from torch_tree_attn.backends.cuda import hopper_kernels as hk
    from torch_tree_attn.backends import cuda as cuda_backend

    B, Hq, Hkv, T = 1, 32, 8, 64

    def time_us(graph, iters=50, repeats=7):
        """µs per replay of a captured graph: the median of `repeats` means of `iters` replays."""
        return replay_us(graph.replay, iters, repeats)

    # Other configurations beside the table's (hopper_kernels.DEFAULT_CONFIG), per head dim.
    others = {128: [(8, 64, 3), (8, 64, 4), (4, 64, 3), (4, 64, 4)], 64: [(8, 64, 4), (4, 64, 2), (4, 64, 4)],
              256: [(4, 32, 4)], 512: [(8, 16, 4), (8, 16, 3)]}
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"bench: B={B}, Hq={Hq}, Hkv={Hkv}, T={T} random tree, bf16, CUDA graphs, device "
          f"{torch.cuda.get_device_name()}; table config (consumer warps, BLOCK_N, stages) = {hk.DEFAULT_CONFIG}",
          flush=True)
    print(f"{'D':>4} {'P':>6} {'triton us':>10} {'gluon us':>10} {'tri/glu':>7}  others (config: us)   "
          f"max|gluon - triton|", flush=True)
    for D, P in [(128, 1024), (128, 4096), (128, 16384), (128, 65536), (64, 4096), (64, 16384), (256, 16384),
                 (512, 16384)]:
        try:
            gen = torch.Generator().manual_seed(P)
            S = P + T
            q = torch.randn(B, Hq, T, D, generator=gen).to(torch.bfloat16).cuda()
            k = torch.randn(B, Hkv, S, D, generator=gen).to(torch.bfloat16).cuda()
            v = torch.randn(B, Hkv, S, D, generator=gen).to(torch.bfloat16).cuda()
            mask = random_tree_mask(T, gen)[None].cuda()
            off = torch.tensor([P], device="cuda")
            args = (q, k, v, mask, off, None, None, None)
            g_tri, (o_tri, l_tri) = graphed(lambda: cuda_backend.forward_with_lse(*args, kernel="triton"))
            t_tri = time_us(g_tri)
            results = {}
            diffs = {}
            for name, cfg in [("default", None), ("python", "python")] + [(str(c), c) for c in others[D]]:
                try:
                    if cfg is None:   # the C++ launcher, as users get it
                        g, (o, l) = graphed(lambda: cuda_backend.forward_with_lse(*args, kernel="hopper"))
                    else:
                        g, (o, l) = graphed(lambda cfg=cfg: hk.forward_with_lse_hopper(
                            *args, config=None if cfg == "python" else cfg))
                    results[name] = time_us(g)
                    diffs[name] = (o.float() - o_tri.float()).abs().max().item()
                    dl = (l - l_tri).abs().max().item()
                    if not (diffs[name] < 3e-2 and dl < 1e-2):
                        print(f"  P={P} {name}: MISMATCH vs triton: max|out| diff {diffs[name]:.3g}, "
                              f"max|lse| diff {dl:.3g}", flush=True)
                    del g
                except Exception as e:  # noqa: BLE001
                    print(f"  P={P} {name}: {type(e).__name__}: {str(e)[:400]}", flush=True)
            t_g = results.get("default", float("nan"))
            listed = ", ".join(f"{n}: {u:.1f}" for n, u in results.items() if n != "default")
            print(f"{D:>4} {P:>6} {t_tri:>10.1f} {t_g:>10.1f} {t_tri / t_g:>6.2f}x  {listed:<34} "
                  f"{max(diffs.values()) if diffs else float('nan'):.3g}", flush=True)
            # The plan's split count, and a small sweep around it (the table's config).
            cw, bn, stages = hk.DEFAULT_CONFIG[D]
            R = (Hq // Hkv) * T
            splits, wu = hk.choose_splits(S, T, -(-R // hk.block_m_for(D, cw)) * B * Hkv, num_sms, bn,
                                          per_sm=hk.programs_per_sm(D, cw, bn, stages))
            sweep = []
            for s in sorted({max(1, splits // 2), splits, splits * 2}):
                try:
                    g, _ = graphed(lambda s=s: cuda_backend.forward_with_lse(*args, num_splits=s, kernel="hopper"))
                    sweep.append(f"s={s}: {time_us(g, iters=20, repeats=5):.1f}")
                    del g
                except Exception as e:  # noqa: BLE001
                    sweep.append(f"s={s}: {type(e).__name__}")
            print(f"        gluon split sweep (plan: {splits}): " + ", ".join(sweep), flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"  P={P}: {type(e).__name__}: {str(e)[:400]}", flush=True)
            traceback.print_exc(limit=4)


PHASES = {"smoke": phase_smoke, "parity": phase_parity, "bench": phase_bench}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=["all"] + list(PHASES), default="all")
    args = ap.parse_args()
    if args.phase != "all":
        PHASES[args.phase]()
        return
    started = time.time()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    for name, limit in PHASE_LIMITS.items():
        print(f"=== phase {name} (limit {limit} s)", flush=True)
        try:
            rc = subprocess.run([sys.executable, __file__, "--phase", name], cwd=str(ROOT), env=env,
                                timeout=limit).returncode
            if rc != 0:
                print(f"=== phase {name} exited with {rc}", flush=True)
        except subprocess.TimeoutExpired:
            print(f"=== phase {name} TIMED OUT after {limit} s (a hung kernel, e.g. a pipeline deadlock, "
                  f"looks like this)", flush=True)
    print(f"=== done in {time.time() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
