"""One kernel variant of the CUDA backend, from its spec to a cubin (the Triton main and
reduce kernels, and the Hopper Gluon main kernel of hopper_kernels.py): the build's prebuilt
kernels (csrc/cuda/build_kernels.py) and the runtime's compile-once fallback
(torch_tree_attn.backends.cuda.compile_for_launcher) both go through `compile_spec`, so a prebuilt kernel
and a fallback one of the same spec are the same binary with the same parameter list.

A spec is a dict of ints whose keys are ``SPEC_FIELDS`` (csrc/cuda/kernel_registry.h's
``kSpecFields``, in the same order; a test holds them equal). The C++ launcher builds the
spec of each launch, looks it up among the registered binaries, and on a miss asks this
module (through the hook torch_tree_attn.backends.cuda installs) to compile it, once per process; Triton
keeps the result in its on-disk cache too.

Kernel parameters are the Triton kernel's non-constexpr arguments in order, then Triton's
scratch pointers (``scratch_args`` of them, passed as null: the kernels need none). What
is specialised: pointers of Q/K/V/outputs/partials and the row strides of Q/K/V divisible
by 16 where ``aligned`` (as Triton's JIT would for a typical call: vector loads,
and the key loops get pipelined); sizes and strides int32, or int64 where ``wide``.
"""
import dataclasses
import inspect
from typing import Dict, Tuple

# The spec's fields, in order. kind: 0 main pass (Triton), 1 reduce pass, 2 main pass (Hopper,
# Gluon: num_warps = its consumer warps, num_stages = its K/V ring slots). Dtypes by DTYPE_CODES.
SPEC_FIELDS = ("kind", "arch", "q_dtype", "kv_dtype", "head_dim", "block_m", "block_n", "block_d", "window_n",
               "block_r", "chunk", "num_warps", "num_stages", "mask_float", "softcap", "skip_unseen", "aligned",
               "wide")
MAIN, REDUCE, HOPPER = 0, 1, 2
DTYPE_CODES = {"fp32": 0, "fp16": 1, "bf16": 2}
DTYPE_NAMES = {v: k for k, v in DTYPE_CODES.items()}
# The kernels ask for FP fusion explicitly (each prefix exponent is one FMA) whatever
# triton's default, which 3.9 announces will turn to no contraction in 3.10.
FP_FUSION = True


@dataclasses.dataclass(frozen=True)
class Binary:
    """What the C++ registry needs to load and launch a compiled kernel."""
    cubin: bytes
    function: str
    shared: int
    num_warps: int
    scratch_args: int
    n_regs: int = -1      # from ptxas where known (-1: not reported)
    n_spills: int = -1
    # One per tensor-descriptor parameter (the Hopper kernel's K and V): how the launcher
    # encodes its CUtensorMap: {"data_type" (host CUtensorMapDataType), "elem_size",
    # "swizzle", "block" (box dims, outermost first)}.
    tma: tuple = ()


def spec_name(spec: Dict[str, int]) -> str:
    """A file name for a spec: every field, so distinct specs never collide."""
    if spec["kind"] in (MAIN, HOPPER):
        head = (f"{'main' if spec['kind'] == MAIN else 'hopper'}_sm{spec['arch']}_{DTYPE_NAMES[spec['q_dtype']]}_{DTYPE_NAMES[spec['kv_dtype']]}"
                f"_d{spec['head_dim']}_m{spec['block_m']}n{spec['block_n']}w{spec['window_n']}")
    else:
        head = f"reduce_sm{spec['arch']}_{DTYPE_NAMES[spec['q_dtype']]}_d{spec['head_dim']}_r{spec['block_r']}c{spec['chunk']}"
    flags = "".join(f"_{f}{spec[f]}" for f in ("num_warps", "num_stages", "mask_float", "softcap", "skip_unseen",
                                                "aligned", "wide"))
    return head + f"_bd{spec['block_d']}" + flags


def _kernel_and_types(spec):
    from . import triton_kernels as tk

    q = DTYPE_NAMES[spec["q_dtype"]]
    if spec["kind"] == MAIN:
        kv = DTYPE_NAMES[spec["kv_dtype"]]
        ptrs = dict(Q=q, K=kv, V=kv, MASK="fp32" if spec["mask_float"] else "u8", OFF="i32", SINK="fp32", OUT=q,
                    LSE="fp32", PO="fp32", PM="fp32", PL="fp32")
        # Not the mask: tree masks are [B, T, T] with any T (EAGLE's 60-node trees), and its
        # loads (a window row per query) gain little from alignment.
        aligned_ptrs = {"Q", "K", "V", "OUT", "LSE", "PO", "PM", "PL"}
        aligned_ints = {"sq0", "sq1", "sq2", "sk0", "sk1", "sk2", "sv0", "sv1", "sv2"}
        floats = {"scale_abs", "softcap"}
        half = q != "fp32"
        constexprs = dict(D=spec["head_dim"], BLOCK_M=spec["block_m"], BLOCK_N=spec["block_n"],
                          BLOCK_D=spec["block_d"], WINDOW_N=spec["window_n"], MASK_FLOAT=bool(spec["mask_float"]),
                          HAS_SOFTCAP=bool(spec["softcap"]), HALF_DOT=half, UPCAST=False,
                          SKIP_UNSEEN=bool(spec["skip_unseen"]))
        return tk._tree_attn_main, ptrs, aligned_ptrs, aligned_ints, floats, constexprs
    ptrs = dict(PO="fp32", PM="fp32", PL="fp32", SINK="fp32", OUT=q, LSE="fp32")
    constexprs = dict(D=spec["head_dim"], BLOCK_R=spec["block_r"], BLOCK_D=spec["block_d"], CHUNK=spec["chunk"])
    return tk._tree_attn_reduce, ptrs, {"PO", "PM", "PL", "OUT", "LSE"}, set(), set(), constexprs


def triton_signature(spec: Dict[str, int]) -> Tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of the spec's kernel for triton.compile."""
    fn, ptrs, aligned_ptrs, aligned_ints, floats, constexprs = _kernel_and_types(spec)
    int_type = "i64" if spec["wide"] else "i32"
    sig, attrs = {}, {}
    for index, name in enumerate(inspect.signature(fn.fn).parameters):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = "*" + ptrs[name]
            if spec["aligned"] and name in aligned_ptrs:
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif name in floats:
            sig[name] = "fp32"
        else:
            sig[name] = int_type
            if spec["aligned"] and name in aligned_ints:
                attrs[(index,)] = [["tt.divisibility", 16]]
    missing = set(constexprs) - set(sig)
    assert not missing, f"spec constexprs not in the kernel: {missing}"
    return sig, constexprs, attrs


def compile_spec(spec: Dict[str, int]):
    """The spec's kernel, compiled by Triton for sm_<arch> (no GPU needed): triton's
    CompiledKernel, whose .asm holds cubin/ptx/ttgir."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if spec["kind"] == HOPPER:
        from . import hopper_kernels

        return hopper_kernels.compile_variant(
            DTYPE_NAMES[spec["q_dtype"]], spec["head_dim"], bool(spec["mask_float"]), bool(spec["softcap"]),
            consumer_warps=spec["num_warps"], block_n=spec["block_n"], stages=spec["num_stages"], arch=spec["arch"],
            wide=bool(spec["wide"]), aligned=bool(spec["aligned"]))
    fn = _kernel_and_types(spec)[0]
    sig, constexprs, attrs = triton_signature(spec)
    options = dict(num_warps=spec["num_warps"], num_stages=max(1, spec["num_stages"]), enable_fp_fusion=FP_FUSION)
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", spec["arch"], 32), options=options)


def binary_of(compiled) -> Binary:
    md = compiled.metadata
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        raise RuntimeError(f"{md.name}: the kernel asks for Triton scratch memory, which the launcher does not pass")
    # Triton 3.5+ appends two scratch pointers (global, profile); earlier releases one.
    scratch_args = 2 if hasattr(md, "profile_scratch_size") else 1
    tma = tuple(_tma_entry(meta) for meta in (getattr(md, "tensordesc_meta", None) or ()))
    return Binary(cubin=compiled.asm["cubin"], function=md.name, shared=int(md.shared), num_warps=int(md.num_warps),
                  scratch_args=scratch_args, n_regs=int(getattr(compiled, "n_regs", -1) or -1),
                  n_spills=int(getattr(compiled, "n_spills", -1) or -1), tma=tma)


# Triton's tensordesc metadata names the element type by the device-side (PTX) numbering;
# cuTensorMapEncodeTiled takes the host enum, which differs for these three codes (triton's
# nvidia driver.py, TMA_DTYPE_DEVICE_TO_HOST).
_TMA_DEVICE_TO_HOST = {8: 10, 9: 8, 10: 9}


def _tma_entry(meta) -> dict:
    if meta.get("fp4_padded"):
        raise RuntimeError("fp4-padded tensor descriptors are not supported by the launcher")
    return dict(data_type=_TMA_DEVICE_TO_HOST.get(int(meta["elem_type"]), int(meta["elem_type"])),
                elem_size=int(meta["elem_size"]), swizzle=int(meta["swizzle"]),
                block=[int(b) for b in meta["block_size"]])
