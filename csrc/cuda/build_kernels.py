"""Builds the CUDA backend's prebuilt kernels: every spec of the instantiation table below,
compiled by Triton for each target architecture (no GPU needed), into
torch_tree_attn/backends/cuda/kernels/ as one cubin per spec plus manifest.json, which the package
registers at import (torch_tree_attn.backends.cuda.register) and the C++ launcher loads at first use.

The table: the tiles of csrc/cuda/tile_configs.def (the plan's own table) for the dtypes
users run models in (float16, bfloat16, and float32 for K/V and query alike: the built-in demo
and exactness checks run float32), every row-block size the plan can pick for them (powers of 2
from 16 up to the table's BLOCK_M), both mask kinds, softcap on and off, the window loop
with and without its skip test; pointers and row strides 16-aligned, int32 sizes (what
every cache layout the package builds gives). For sm_90 also the Hopper (Gluon) main kernel's
rows of the table: every head dim it has, float16/bfloat16, both mask kinds, softcap on and
off (where triton has Gluon's Hopper module). Everything else -- a float32 query over a
half cache, another head dim, another architecture, an unaligned or huge call -- is compiled once per process
at run time by the same code (torch_tree_attn/backends/cuda/compiler.py).

    python csrc/cuda/build_kernels.py [--arch 80 90] [--out DIR] [--jobs N] [--list]

setup.py calls build() at install time where torch has CUDA and triton is importable, or
where TORCH_TREE_ATTN_CUDA_ARCHS names architectures ("80;90"; "none" builds nothing).
Rebuilding is skipped while the kernel sources, the table and triton's version are
unchanged (a hash in the manifest).
"""
import argparse
import concurrent.futures
import hashlib
import itertools
import json
import os
import pathlib
import re
import sys
import time
import types

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "torch_tree_attn"
BACKEND = PACKAGE / "backends" / "cuda"   # the CUDA backend's Python side
TABLE = ROOT / "csrc" / "cuda" / "tile_configs.def"
DEFAULT_OUT = BACKEND / "kernels"
DEFAULT_ARCHS = (80, 90)
# The prebuilt instantiations: (dtype, head dims); variants per spec as described above.
PREBUILT_DTYPES = ("bf16", "fp16", "fp32")
PREBUILT_HEAD_DIMS = (64, 128, 256, 512)
HOPPER_DTYPES = ("bf16", "fp16")   # the Hopper kernel's wgmma takes half operands
REDUCE_CHUNK, REDUCE_WARPS, REDUCE_ELEMS = 8, 4, 512   # csrc/cuda/triton_plan.h (a test holds them equal)


def tile_table():
    """{(D, "half"|"f32"): (BLOCK_M, BLOCK_N, num_warps, num_stages, WINDOW_N)} from tile_configs.def."""
    table = {}
    for line in TABLE.read_text().splitlines():
        m = re.match(r"\s*TREE_ATTN_TILE\(([^)]*)\)", line)
        if m:
            d, kind, *nums = [x.strip() for x in m.group(1).split(",")]
            table[(int(d), kind)] = tuple(int(x) for x in nums)
    return table


def _compile_module():
    """torch_tree_attn.backends.cuda.compiler without running the packages' __init__ files
    (the top one and the CUDA backend's load the C++ extension, which this build may not
    have made yet): the three packages stand in as plain namespaces of their folders."""
    for name, folder in (("torch_tree_attn", PACKAGE), ("torch_tree_attn.backends", PACKAGE / "backends"),
                         ("torch_tree_attn.backends.cuda", BACKEND)):
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(folder)]
            sys.modules[name] = pkg
    import torch_tree_attn.backends.cuda.compiler as tc
    return tc


def hopper_table():
    """{D: (CONSUMER_WARPS, BLOCK_N, STAGES)} of the Hopper kernel, from tile_configs.def."""
    table = {}
    for line in TABLE.read_text().splitlines():
        m = re.match(r"\s*TREE_ATTN_HOPPER_TILE\(([^)]*)\)", line)
        if m:
            d, *nums = [int(x.strip()) for x in m.group(1).split(",")]
            table[d] = tuple(nums)
    return table


def have_gluon():
    try:
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except Exception:  # noqa: BLE001 - no triton, or one without Gluon's Hopper module
        return False
    return True


def next_pow2(x):
    return 1 << (max(1, x) - 1).bit_length()


def prebuilt_specs(archs):
    """Every spec of the table, for each architecture."""
    tc = _compile_module()
    table = tile_table()
    specs = []
    for arch, dtype, D in itertools.product(archs, PREBUILT_DTYPES, PREBUILT_HEAD_DIMS):
        bm_max, bn, warps, stages, wn = table[(D, "f32" if dtype == "fp32" else "half")]
        code = tc.DTYPE_CODES[dtype]
        base = dict.fromkeys(tc.SPEC_FIELDS, 0)
        base.update(arch=arch, q_dtype=code, head_dim=D, block_d=next_pow2(D), aligned=1, wide=0)
        bm = 16
        while bm <= bm_max:
            for mask_float, softcap, skip in itertools.product((0, 1), (0, 1), (0, 1)):
                specs.append(dict(base, kind=tc.MAIN, kv_dtype=code, block_m=bm, block_n=bn, window_n=wn,
                                  num_warps=warps, num_stages=stages, mask_float=mask_float, softcap=softcap,
                                  skip_unseen=skip))
            bm *= 2
        specs.append(dict(base, kind=tc.REDUCE, block_r=max(1, REDUCE_ELEMS // next_pow2(D)), chunk=REDUCE_CHUNK,
                          num_warps=REDUCE_WARPS, num_stages=1))
    if 90 in archs and have_gluon():
        import torch_tree_attn.backends.cuda.hopper_kernels as hk   # loaded as tc was (no extension needed)
        for dtype, (D, (cw, bn, stages)) in itertools.product(HOPPER_DTYPES, sorted(hopper_table().items())):
            code = tc.DTYPE_CODES[dtype]
            base = dict.fromkeys(tc.SPEC_FIELDS, 0)
            base.update(kind=tc.HOPPER, arch=90, q_dtype=code, kv_dtype=code, head_dim=D, block_m=hk.block_m_for(D, cw),
                        block_n=bn, block_d=D, num_warps=cw, num_stages=stages, aligned=1, wide=0)
            for mask_float, softcap in itertools.product((0, 1), (0, 1)):
                specs.append(dict(base, mask_float=mask_float, softcap=softcap))
    return specs


def _build_one(args):
    spec, out_dir = args
    tc = _compile_module()
    compiled = tc.compile_spec(spec)
    b = tc.binary_of(compiled)
    name = tc.spec_name(spec) + ".cubin"
    (pathlib.Path(out_dir) / name).write_bytes(b.cubin)
    return dict(spec=spec, file=name, function=b.function, shared=b.shared, num_warps=b.num_warps,
                scratch_args=b.scratch_args, tma=list(b.tma))


def source_hash(archs):
    import triton

    h = hashlib.sha256()
    for p in (BACKEND / "triton_kernels.py", BACKEND / "hopper_kernels.py", BACKEND / "compiler.py", TABLE,
              pathlib.Path(__file__)):
        h.update(p.read_bytes())
    h.update(f"triton {triton.__version__} archs {sorted(archs)} gluon {have_gluon()}".encode())
    return h.hexdigest()


def build(archs=DEFAULT_ARCHS, out_dir=DEFAULT_OUT, jobs=None, log=print, specs=None):
    """Compiles the table (or `specs`) into out_dir (skipped when up to date); returns the manifest."""
    import triton

    out_dir = pathlib.Path(out_dir)
    manifest_path = out_dir / "manifest.json"
    digest = source_hash(archs) + ("" if specs is None else "-" + hashlib.sha256(repr(specs).encode()).hexdigest())
    if manifest_path.is_file():
        old = json.loads(manifest_path.read_text())
        if old.get("source_hash") == digest and all((out_dir / k["file"]).is_file() for k in old["kernels"]):
            log(f"torch_tree_attn: prebuilt CUDA kernels up to date ({len(old['kernels'])} in {out_dir})")
            return old
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("*.cubin"):
        stale.unlink()
    if manifest_path.exists():
        manifest_path.unlink()
    specs = prebuilt_specs(archs) if specs is None else specs
    jobs = jobs or int(os.environ.get("TORCH_TREE_ATTN_BUILD_JOBS", 0)) or os.cpu_count() or 1
    log(f"torch_tree_attn: compiling {len(specs)} CUDA kernels for sm_{', sm_'.join(map(str, archs))} "
        f"with triton {triton.__version__} ({jobs} jobs)")
    t0 = time.time()
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
        kernels = list(pool.map(_build_one, [(s, str(out_dir)) for s in specs]))
    tc = _compile_module()
    manifest = dict(spec_fields=list(tc.SPEC_FIELDS), triton_version=triton.__version__, archs=sorted(archs),
                    source_hash=digest, kernels=kernels)
    manifest_path.write_text(json.dumps(manifest, indent=1))
    log(f"torch_tree_attn: {len(kernels)} kernels in {time.time() - t0:.0f} s, "
        f"{sum((out_dir / k['file']).stat().st_size for k in kernels) / 2**20:.1f} MiB")
    return manifest


def archs_from_env():
    """The architectures setup.py builds for: TORCH_TREE_ATTN_CUDA_ARCHS ("80;90", "none"),
    else DEFAULT_ARCHS where torch has CUDA and triton is importable, else none."""
    env = os.environ.get("TORCH_TREE_ATTN_CUDA_ARCHS", "").strip()
    if env:
        if env.lower() in ("none", "0", "off"):
            return ()
        return tuple(int(a) for a in re.split(r"[;, ]+", env.replace("sm_", "")) if a)
    try:
        import torch
        import triton  # noqa: F401
    except ImportError:
        return ()
    return DEFAULT_ARCHS if torch.version.cuda else ()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, nargs="+", default=list(DEFAULT_ARCHS))
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--list", action="store_true", help="print the table's specs, compile nothing")
    a = ap.parse_args(argv)
    if a.list:
        tc = _compile_module()
        for s in prebuilt_specs(a.arch):
            print(tc.spec_name(s))
        return
    build(a.arch, a.out, a.jobs)


if __name__ == "__main__":
    main()
