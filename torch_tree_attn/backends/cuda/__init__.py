"""The CUDA backend's Python side: the prebuilt kernels' registration, the compile-once
fallback, and the interpreter launcher.

The CUDA op itself is C++ (csrc/cuda/): prepare, plan, kernel lookup and cuLaunchKernel on
the current stream, with no Python per call. What this module adds:

- ``register()`` (called when the package is imported): registers the prebuilt cubins of
  ``torch_tree_attn/backends/cuda/kernels/manifest.json`` (built by setup.py, csrc/cuda/build_kernels.py)
  with the C++ registry, which loads each at its first use, and installs the run-time
  compiler for a kernel spec the table lacks (another GPU architecture, a float32 query, an
  unaligned or 64-bit-strided call...): ``compile_for_launcher``, which Triton compiles
  once per process (and caches on disk). Without triton installed, prebuilt kernels still
  run; a spec outside the table then raises, naming it.
- ``forward_with_lse(...)``: the op's semantics with the plan's splits or tiles overridden
  (tests, tuning): on CUDA tensors through the C++ launcher, on CPU tensors under
  ``TRITON_INTERPRET=1`` (set before triton is imported) through Triton's interpreter,
  with the same plan and the same kernel arguments as the C++ launcher passes.
"""
import json
import os
import pathlib
from typing import Optional, Tuple

import torch

from ... import _C

KERNELS_DIR = pathlib.Path(__file__).resolve().parent / "kernels"
MANIFEST = KERNELS_DIR / "manifest.json"
# The main kernel a process uses unless TORCH_TREE_ATTN_CUDA_KERNEL says otherwise: "auto",
# the Hopper kernel (hopper_kernels.py) on sm_90 for the calls it covers, else the portable
# Triton kernel.
DEFAULT_KERNEL = "auto"
INTERPRETER_SMS = 4   # a small pretend GPU under the interpreter: long key ranges split


def compile_for_launcher(spec: dict) -> tuple:
    """The C++ registry's compiler hook: (cubin, function, shared, num_warps, scratch_args)."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"tree_attn: no prebuilt CUDA kernel fits this call ({spec}) and triton, which would "
                           f"compile one, is not importable: {e}. pip install 'triton>=3.6'.") from e
    from . import compiler

    b = compiler.binary_of(compiler.compile_spec(spec))
    return b.cubin, b.function, b.shared, b.num_warps, b.scratch_args, list(b.tma)


def load_manifest(path: pathlib.Path = MANIFEST) -> list:
    """The prebuilt kernels' entries ({"spec", "file", "function", "shared", "num_warps",
    "scratch_args", "tma"}), or [] where none were built."""
    if not path.is_file():
        return []
    with open(path) as f:
        manifest = json.load(f)
    fields = tuple(_C.cuda_spec_fields())
    if tuple(manifest.get("spec_fields", ())) != fields:
        raise RuntimeError(f"{path}: built for kernel spec fields {manifest.get('spec_fields')}, this build has "
                           f"{fields}: rebuild the package (pip install --no-build-isolation -e .)")
    return manifest["kernels"]


_registered = False


def register() -> None:
    """Registers the prebuilt kernels and the run-time compiler with the C++ registry
    (idempotent)."""
    global _registered
    if _registered:
        return
    # TORCH_TREE_ATTN_NO_PREBUILT=1: every kernel through the compile-once fallback
    # (benchmarks/bench_launch.py's cold-start comparison).
    prebuilt = os.environ.get("TORCH_TREE_ATTN_NO_PREBUILT", "0") in ("", "0")
    entries = load_manifest() if prebuilt else []
    for entry in entries:
        _C.cuda_register_kernel(entry["spec"], b"", str(KERNELS_DIR / entry["file"]), entry["function"],
                                entry["shared"], entry["num_warps"], entry["scratch_args"], True,
                                entry.get("tma", []))
    _C.cuda_set_compiler(compile_for_launcher)
    # TORCH_TREE_ATTN_CUDA_KERNEL: the main kernel on sm_90: "auto" (DEFAULT_KERNEL: the
    # Hopper kernel for the calls it covers), "triton" (the portable kernel everywhere),
    # "hopper" (raise for a call it does not cover).
    choice = os.environ.get("TORCH_TREE_ATTN_CUDA_KERNEL", DEFAULT_KERNEL).strip().lower() or DEFAULT_KERNEL
    try:
        _C.cuda_set_kernel_choice(choice)
    except ValueError as e:
        raise ValueError(f"TORCH_TREE_ATTN_CUDA_KERNEL: {e}") from None
    if choice == "auto" and not hopper_available(entries):
        _C.cuda_set_kernel_choice("triton")
    _registered = True


def hopper_available(entries: list) -> bool:
    """Whether this install can run the Hopper kernel: prebuilt (the manifest has it), or
    compilable at run time (triton with Gluon's Hopper module). Without either, "auto" is the
    Triton kernel everywhere."""
    if any(e["spec"].get("kind") == 2 for e in entries):
        return True
    try:
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except Exception:  # noqa: BLE001 - no triton, or one without Gluon's Hopper module
        return False
    return True


def _interpret(query, key, value, mask, mask_offset, scale, softcap, sinks, num_splits, config):
    """The C++ launcher's two launches, in Python, for Triton's interpreter (CPU tensors)."""
    from . import triton_kernels as tk
    from .launch_prologue import prepare_call

    prepared, q, out, lse = prepare_call(query, key, value, mask, mask_offset, scale, softcap, sinks)
    pb = prepared.problem
    k, v, m = prepared.key, prepared.value, prepared.mask
    if pb.empty:
        return out, lse
    plan, spec, reduce_spec = _C.cuda_plan_launch(query, key, value, mask, mask_offset, scale, softcap, sinks,
                                                  arch=90, num_sms=INTERPRETER_SMS, num_splits=num_splits,
                                                  config=list(config) if config is not None else None,
                                                  kernel="triton")
    if (plan.block_n - 1) * max(pb.k_stride[2], pb.v_stride[2]) + plan.block_d >= 2**31:
        k, v = k.contiguous(), v.contiguous()

    def strides(t):
        return [0 if t.size(i) == 1 else t.stride(i) for i in range(3)]

    R, total_rows = pb.G * pb.T, pb.B * pb.Hq * pb.T
    dummy = out
    off = prepared.mask_offset
    off_kind = 0 if off is None else (2 if off.dtype == torch.int64 else 1)
    split = plan.num_splits > 1
    if split:
        po = torch.empty((plan.num_splits, total_rows, pb.D), dtype=torch.float32, device=q.device)
        pm = torch.empty((plan.num_splits, total_rows), dtype=torch.float32, device=q.device)
        pl = torch.empty((plan.num_splits, total_rows), dtype=torch.float32, device=q.device)
    else:
        po = pm = pl = lse
    sink = prepared.sinks if prepared.sinks is not None else dummy
    tk._tree_attn_main[(plan.row_blocks, pb.B * pb.Hkv, plan.num_splits)](
        q, k if k.numel() else dummy, v if v.numel() else dummy,
        (m if pb.mask_float else m.view(torch.uint8)) if m.numel() else dummy,
        off if off is not None else dummy, sink, out, lse, po, pm, pl,
        *strides(q), *strides(k), *strides(v), *pb.mask_stride,
        pb.Hkv, pb.G, pb.T, pb.S, pb.M, R, total_rows, plan.num_splits, plan.window_units, off_kind,
        int(pb.has_sinks), abs(pb.scale), pb.softcap if pb.softcap is not None else 1.0,
        D=pb.D, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_D=plan.block_d, WINDOW_N=plan.window_n,
        MASK_FLOAT=bool(spec["mask_float"]), HAS_SOFTCAP=bool(spec["softcap"]), HALF_DOT=spec["q_dtype"] != 0,
        UPCAST=True, SKIP_UNSEEN=bool(spec["skip_unseen"]), num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    if split:
        block_r = reduce_spec["block_r"]
        tk._tree_attn_reduce[(-(-total_rows // block_r),)](
            po, pm, pl, sink, out, lse, total_rows, pb.T, pb.Hq, plan.num_splits, int(pb.has_sinks),
            D=pb.D, BLOCK_R=block_r, BLOCK_D=plan.block_d, CHUNK=reduce_spec["chunk"], num_warps=4,
        )
    return out, lse


def forward_with_lse(query, key, value, mask, mask_offset=None, scale=None, softcap=None, sinks=None, *,
                     num_splits: Optional[int] = None, config: Optional[tuple] = None,
                     kernel: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The op's semantics with the plan overridden: `num_splits` key splits, `config` =
    (BLOCK_M, BLOCK_N, num_warps, num_stages[, WINDOW_N]) Triton tiles, `kernel` = "auto",
    "triton" or "hopper" (the main kernel; None: the process default). CUDA tensors go
    through the C++ launcher; CPU tensors need TRITON_INTERPRET=1 (the Triton kernel).
    Never syncs with the device."""
    if query.device.type == "cuda":
        return _C.cuda_forward_with_lse(query, key, value, mask, mask_offset, scale, softcap, sinks,
                                        num_splits=num_splits, config=list(config) if config is not None else None,
                                        kernel=kernel)
    if kernel == "hopper":
        raise ValueError("torch_tree_attn.backends.cuda.forward_with_lse: the Hopper kernel runs on sm_90 GPUs only, not under "
                         "the interpreter")
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise RuntimeError("torch_tree_attn.backends.cuda.forward_with_lse: CPU tensors run only under TRITON_INTERPRET=1 "
                           f"(set before triton is imported); got query on {query.device}")
    return _interpret(query, key, value, mask, mask_offset, scale, softcap, sinks, num_splits, config)


def forward(query, key, value, mask, mask_offset=None, scale=None, softcap=None, sinks=None) -> torch.Tensor:
    return forward_with_lse(query, key, value, mask, mask_offset, scale, softcap, sinks)[0]
