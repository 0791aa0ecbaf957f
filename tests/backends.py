"""The backends the op contract is tested on, and the contract's shared tables as checks.

tests/test_contract.py runs ONE parity-matrix test, ONE forward-vs-forward_with_lse test,
ONE bad-input table and ONE non-finite table on every backend below; tests/conftest.py
parametrises those tests over (backend, table entry), each backend taking its own share of
each table. A backend that is not available here still gets its items, skipped with the
reason, so every machine collects the same ids.

| backend        | what runs                                                                   |
| -------------- | --------------------------------------------------------------------------- |
| cpu            | torch.ops.tree_attn on CPU tensors (the C++ kernel)                         |
| sim            | torch.ops.tree_attn_sim: the Metal shaders under the simulator (tests/sim), |
|                | the plan's own kernel family                                                 |
| sim-vector     | the same with the vector (v1) family forced (the non-finite table only)     |
| triton-interp  | the CUDA backend's Triton kernels on CPU under TRITON_INTERPRET=1, in ONE   |
|                | child process per session (tests/triton_interp_worker.py), which runs the   |
|                | same checks and reports each by name; a share of the parity matrix          |
| cuda           | torch.ops.tree_attn on a CUDA GPU (needs triton)                            |
| mps            | torch.ops.tree_attn on an Apple GPU                                         |

Every check builds its inputs on the CPU (tests/cases.py), runs them through the backend
(which moves them to its device and the results back) and compares with the float64
reference (torch_tree_attn/reference.py).

Environment:
- TREE_ATTN_TEST_BACKENDS=cpu,sim,...  only these backends' items are generated (the
  sanitizer pass, the GPU script);
- TREE_ATTN_TEST_SHARD=i/n  every table keeps every n-th entry from the i-th
  (benchmarks/h200.sh runs the CUDA matrix in parallel processes).
"""
import json
import os
import pathlib
import re
import subprocess
import sys
from typing import Callable, Dict, List, Optional, Tuple

import torch

from tests.cases import (args_of, check_against_reference, check_nonfinite_case, make_inputs, nonfinite_cases,
                         parity_matrix, tree_inputs)

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAN = float("nan")
INF = float("inf")


def shard(items: list) -> list:
    """TREE_ATTN_TEST_SHARD=i/n keeps every n-th item from the i-th."""
    spec = os.environ.get("TREE_ATTN_TEST_SHARD")
    if not spec:
        return items
    i, n = (int(x) for x in spec.split("/"))
    return items[i::n]


# ---------------------------------------------------------------------------------------
# The bad-input table: every rule in csrc/validation.cpp, with the argument named in the
# message. "{device}" in a pattern is the backend's device as the message prints it.

def valid_inputs() -> dict:
    """The valid call every bad input starts from: B=2, Hq=4, Hkv=2, T=3, S=16, D=64,
    offsets [5, 9], a [B, T, T] bool tree mask."""
    return tree_inputs(B=2, Hq=4, Hkv=2, T=3, prefix=(5, 9), D=64, S=16)


BAD_INPUTS = [
    # (id, changes as a function of valid inputs, exception type, message pattern)
    ("query rank", lambda i: dict(query=i["query"][0]), ValueError, r"query must be 4-D .*\[4, 3, 64\]"),
    ("key rank", lambda i: dict(key=i["key"][0]), ValueError, r"key must be 4-D .*\[2, 16, 64\]"),
    ("value rank", lambda i: dict(value=i["value"][None]), ValueError, r"value must be 4-D .*\[1, 2, 2, 16, 64\]"),
    ("mask rank", lambda i: dict(mask=i["mask"][0]), ValueError, r"mask must be 3-D .* got shape \[3, 3\]"),
    ("float64 everywhere", lambda i: {n: i[n].double() for n in ("query", "key", "value")}, TypeError,
     r"query, key and value dtypes must be one of .*got query Double, key Double, value Double"),
    ("key and value differ", lambda i: dict(key=i["key"].half()), TypeError,
     r"got query Float, key Half, value Float"),
    ("value differs", lambda i: dict(value=i["value"].bfloat16()), TypeError, r"got query Float, key Float, value BFloat16"),
    ("half query over float32", lambda i: dict(query=i["query"].half()), TypeError,
     r"got query Half, key Float, value Float"),
    ("bf16 query over f16", lambda i: dict(query=i["query"].bfloat16(), key=i["key"].half(), value=i["value"].half()),
     TypeError, r"got query BFloat16, key Half, value Half"),
    ("f16 query over bf16", lambda i: dict(query=i["query"].half(), key=i["key"].bfloat16(),
                                           value=i["value"].bfloat16()), TypeError, r"got query Half, key BFloat16"),
    ("float64 query over f16", lambda i: dict(query=i["query"].double(), key=i["key"].half(), value=i["value"].half()),
     TypeError, r"got query Double, key Half, value Half"),
    ("int8 cache", lambda i: dict(key=i["key"].to(torch.int8), value=i["value"].to(torch.int8)), TypeError,
     r"got query Float, key Char, value Char"),
    ("head dim", lambda i: {n: i[n][..., :48] for n in ("query", "key", "value")}, ValueError,
     r"query head dim D must be one of 64, 96, 128, 256, 512, got 48"),
    ("head dim 1024", lambda i: {n: i[n].repeat(1, 1, 1, 16) for n in ("query", "key", "value")}, ValueError,
     r"query head dim D must be one of 64, 96, 128, 256, 512, got 1024"),
    ("sinks shape", lambda i: dict(sinks=torch.zeros(2)), ValueError, r"sinks must have shape \[Hq\] = \[4\], got \[2\]"),
    ("sinks rank", lambda i: dict(sinks=torch.zeros(1, 4)), ValueError, r"sinks must have shape \[Hq\] = \[4\], got \[1, 4\]"),
    ("sinks scalar", lambda i: dict(sinks=torch.tensor(0.5)), ValueError, r"sinks must have shape \[Hq\] = \[4\], got \[\]"),
    ("sinks dtype", lambda i: dict(sinks=torch.zeros(4, dtype=torch.int64)), TypeError,
     r"sinks must be a floating tensor .*got Long"),
    ("sinks bool", lambda i: dict(sinks=torch.zeros(4, dtype=torch.bool)), TypeError, r"sinks must be a floating tensor .*got Bool"),
    ("sinks on meta", lambda i: dict(sinks=torch.zeros(4, device="meta")), ValueError,
     r"sinks must be on the query's device {device}, got meta"),
    ("key batch", lambda i: dict(key=i["key"][:1], value=i["value"][:1]), ValueError,
     r"key must be \[B, Hkv, S, D\] = \[2, Hkv, S, 64\].*got \[1, 2, 16, 64\]"),
    ("key head dim", lambda i: dict(key=torch.randn(2, 2, 16, 128), value=torch.randn(2, 2, 16, 128)), ValueError,
     r"key must be \[B, Hkv, S, D\].*got \[2, 2, 16, 128\]"),
    ("value shape", lambda i: dict(value=i["value"][:, :, :15]), ValueError,
     r"value shape must equal key shape \[2, 2, 16, 64\], got \[2, 2, 15, 64\]"),
    ("gqa ratio", lambda i: dict(key=torch.randn(2, 3, 16, 64), value=torch.randn(2, 3, 16, 64)), ValueError,
     r"Hq must be a positive multiple of key/value heads Hkv, got Hq=4 Hkv=3"),
    ("no kv heads", lambda i: dict(key=torch.randn(2, 0, 16, 64), value=torch.randn(2, 0, 16, 64)), ValueError,
     r"Hq=4 Hkv=0 \(query shape \[2, 4, 3, 64\], key shape \[2, 0, 16, 64\]\)"),
    ("no query heads", lambda i: dict(query=i["query"][:, :0], sinks=None, mask=i["mask"]), ValueError,
     r"query must have at least one head \(Hq >= 1 in \[B, Hq, T, D\]\), got shape \[2, 0, 3, 64\]"),
    ("mask dtype", lambda i: dict(mask=i["mask"].to(torch.int32)), TypeError,
     r"mask must be bool \(True = attend\) or floating \(additive bias\), got Int"),
    ("mask batch", lambda i: dict(mask=torch.ones(3, 3, 3, dtype=torch.bool)), ValueError,
     r"mask batch size must be B=2 or 1, got mask shape \[3, 3, 3\]"),
    ("mask heads", lambda i: dict(mask=torch.ones(2, 2, 3, 3, dtype=torch.bool)), ValueError,
     r"mask head size must be 1 or Hq=4, got mask shape \[2, 2, 3, 3\]"),
    ("mask rows", lambda i: dict(mask=torch.ones(2, 4, 3, dtype=torch.bool)), ValueError,
     r"mask query size must be T=3, got mask shape \[2, 4, 3\]"),
    ("mask window", lambda i: dict(mask=torch.ones(2, 3, 17, dtype=torch.bool), mask_offset=None), ValueError,
     r"mask window M=17 exceeds key capacity S=16"),
    ("offset dtype", lambda i: dict(mask_offset=i["mask_offset"].float()), TypeError,
     r"mask_offset must be int32 or int64, got Float"),
    ("offset shape", lambda i: dict(mask_offset=torch.zeros(3, dtype=torch.int64)), ValueError,
     r"mask_offset must have shape \[B\] = \[2\], got \[3\]"),
    ("offset rank", lambda i: dict(mask_offset=torch.zeros(2, 1, dtype=torch.int32)), ValueError,
     r"mask_offset must have shape \[B\] = \[2\], got \[2, 1\]"),
    ("negative offset", lambda i: dict(mask_offset=torch.tensor([3, -1])), ValueError,
     r"mask_offset values must be >= 0, got min -1 in \[3, -1\]"),
    ("offset past cache", lambda i: dict(mask_offset=torch.tensor([13, 14], dtype=torch.int32)), ValueError,
     r"mask_offset \+ M must be <= S=16 for M=3, got max offset 14"),
    ("scale inf", lambda i: dict(scale=INF), ValueError, r"scale must be a finite float32, got inf"),
    ("scale nan", lambda i: dict(scale=NAN), ValueError, r"scale must be a finite float32, got nan"),
    ("scale over float32", lambda i: dict(scale=1e39), ValueError, r"scale must be a finite float32, got 1e\+39"),
    ("scale underflows float32", lambda i: dict(scale=1e-46), ValueError, r"scale 1e-46 rounds to 0 in float32"),
    ("softcap zero", lambda i: dict(softcap=0.0), ValueError, r"softcap must be a positive finite float32 .*got 0"),
    ("softcap negative", lambda i: dict(softcap=-2.0), ValueError, r"softcap must be a positive finite float32 .*got -2"),
    ("softcap inf", lambda i: dict(softcap=INF), ValueError, r"softcap must be a positive finite float32 .*got inf"),
    ("softcap underflows float32", lambda i: dict(softcap=1e-46), ValueError,
     r"softcap must be a positive finite float32 .*got 1e-46"),
    ("softcap over float32", lambda i: dict(softcap=1e39), ValueError, r"softcap must be a positive finite float32"),
    # A meta tensor among the backend's: the dispatcher picks the Meta kernel (the fake),
    # which must refuse rather than return uninitialised memory.
    ("key on meta", lambda i: dict(key=i["key"].to("meta")), ValueError,
     r"query, key, value and mask must be on one device, got query on {device}, key on meta"),
    ("mask on meta", lambda i: dict(mask=i["mask"].to("meta")), ValueError, r"mask on meta"),
    ("offset on meta", lambda i: dict(mask_offset=i["mask_offset"].to("meta")), ValueError,
     r"mask_offset must be on the query's device {device}, got meta"),
    ("query on meta", lambda i: dict(query=i["query"].to("meta")), ValueError, r"got query on meta, key on {device}"),
]
BAD_INPUT = {name: rest for name, *rest in BAD_INPUTS}

# Rules that need the offsets' values on the host. Only the CPU kernel (and the fake, which
# has no values: never) checks them; the device backends clamp each offset to [0, S] in the
# kernel instead (tests/cases.py check_clamped_offsets, in each backend's own file).
VALUE_RULES = frozenset({"negative offset", "offset past cache"})
# Meta tensors: the simulator's ops have a CPU kernel only, no Meta one, so a meta tensor
# among CPU ones finds no kernel to validate it.
META_RULES = frozenset(name for name in BAD_INPUT if name.endswith("on meta"))
OPS = ("forward", "forward_with_lse")


def check_parity(backend, case) -> None:
    """One parity-matrix case: forward_with_lse against the float64 reference."""
    inputs = make_inputs(case)
    out, lse = backend.forward_with_lse(inputs)
    check_against_reference(out, lse, inputs)


def check_forward_matches(backend, case) -> None:
    """forward is forward_with_lse without the lse: right, and bit-identical output."""
    inputs = make_inputs(case)
    out = backend.forward(inputs)
    check_against_reference(out, None, inputs)
    assert torch.equal(out, backend.forward_with_lse(inputs)[0]), "forward and forward_with_lse must give the same output"


def check_bad_input(backend, name: str, op: str) -> None:
    """One bad-input entry through one op: the exception type and a message naming the argument."""
    make_bad, error, pattern = BAD_INPUT[name]
    inputs = valid_inputs()
    inputs.update(make_bad(inputs))
    pattern = pattern.replace("{device}", re.escape(backend.device))
    try:
        backend.call(op, backend.place(args_of(inputs)))
    except error as e:
        assert re.search(pattern, str(e)), f"{type(e).__name__} {str(e)!r} does not match {pattern!r}"
    except Exception as e:  # noqa: BLE001  (reported with what was expected)
        raise AssertionError(f"expected {error.__name__} matching {pattern!r}, got {type(e).__name__}: {e}") from e
    else:
        raise AssertionError(f"no {error.__name__} (expected one matching {pattern!r})")


def check_nonfinite(backend, case, kind: str) -> None:
    check_nonfinite_case(case, kind, backend.forward_with_lse)


# ---------------------------------------------------------------------------------------
# Backends

TABLES = ("parity", "forward", "bad_input", "nonfinite")
Item = Tuple[str, tuple]  # (name, arguments of the table's check after the backend)


class Backend:
    """One backend: how to run the op on it, and its share of each table."""

    name = ""
    device = "cpu"               # as the op's error messages print it
    parity_share = slice(None)   # of parity_matrix()
    forward_every = 7            # forward-vs-forward_with_lse on every n-th parity case (0: none)
    bad_inputs = True
    nonfinite = True
    excluded_rules = VALUE_RULES  # bad inputs this backend does not judge (see VALUE_RULES)

    def unavailable(self) -> Optional[str]:
        """Why this backend cannot run here, or None."""
        return None

    # -- running the op: CPU inputs in, CPU results out
    def place(self, args: tuple) -> tuple:
        """The op's arguments on this backend's device (meta tensors stay meta)."""
        return tuple(a.to(self.device) if isinstance(a, torch.Tensor) and a.device.type == "cpu" else a
                     for a in args)

    def call(self, op: str, args: tuple):
        return getattr(torch.ops.tree_attn, op)(*args)

    def forward_with_lse(self, inputs: dict):
        out, lse = self.call("forward_with_lse", self.place(args_of(inputs)))
        assert out.device.type == lse.device.type == self.device.split(":")[0], (out.device, lse.device)
        return out.cpu(), lse.cpu()

    def forward(self, inputs: dict):
        out = self.call("forward", self.place(args_of(inputs)))
        assert out.device.type == self.device.split(":")[0], out.device
        return out.cpu()

    def verify(self, table: str, name: str, check: Callable[[], None]) -> None:
        """Runs one table entry's check (in this process, by default)."""
        check()

    # -- the tables
    def items(self, table: str) -> List[Item]:
        if table == "parity":
            cases = parity_matrix()[self.parity_share]
            items = [(str(c), (c,)) for c in cases]
        elif table == "forward":
            every = self.forward_every
            items = [(str(c), (c,)) for c in parity_matrix()[::every]] if every else []
        elif table == "bad_input":
            items = [(f"{name}-{op}", (name, op)) for name, *_ in BAD_INPUTS if name not in self.excluded_rules
                     for op in OPS] if self.bad_inputs else []
        elif table == "nonfinite":
            items = [(f"{kind}-{case}", (case, kind)) for case, kind in nonfinite_cases()] if self.nonfinite else []
        else:
            raise ValueError(table)
        return shard(items)


CHECKS = dict(parity=check_parity, forward=check_forward_matches, bad_input=check_bad_input,
              nonfinite=check_nonfinite)


class CPU(Backend):
    name = "cpu"
    forward_every = 1            # the CPU kernel is cheap: every case
    excluded_rules = frozenset()  # the one backend that reads the offsets on the host


class Simulator(Backend):
    """The Metal shaders with the MPS backend's launch plan, under the CPU simulator."""

    name = "sim"
    family = "auto"
    # The simulator is slow: forward-vs-forward_with_lse on every 28th case (it is one
    # kernel with the lse written or not).
    forward_every = 28
    excluded_rules = VALUE_RULES | META_RULES

    def unavailable(self):
        try:
            import torch_tree_attn_sim  # noqa: F401
        except ImportError as e:
            return f"the simulator is not installed (pip install --no-build-isolation ./tests/sim): {e}"
        return None

    def call(self, op, args):
        import torch_tree_attn_sim  # noqa: F401  (registers torch.ops.tree_attn_sim)

        ops = torch.ops.tree_attn_sim
        previous = ops.set_kernel_family(self.family)
        try:
            return getattr(ops, op)(*args)
        finally:
            ops.set_kernel_family(previous)


class SimulatorVector(Simulator):
    """The simulator with the vector (v1) kernel family forced where the plan would pick the
    matrix one: the non-finite table only (tests/test_metal_sim.py forces each family on
    the split cases)."""

    name = "sim-vector"
    family = "vector"
    parity_share = slice(0)
    forward_every = 0
    bad_inputs = False


class TritonInterpreter(Backend):
    """The CUDA backend's Triton kernels on CPU tensors under Triton's interpreter. The
    checks run in one child process per session (TRITON_INTERPRET=1 must be set before
    triton is imported, and this process may have imported it already):
    tests/triton_interp_worker.py runs this backend's items of every table, with the same
    check functions, and reports each by name; verify() looks the result up."""

    name = "triton-interp"
    # A representative share of the parity matrix: every 12th case reaches every (dtype
    # pair, head dim) combination about three times and every mask kind, window and rotation.
    parity_share = slice(3, None, 12)
    forward_every = 0           # the worker's api group compares forward and forward_with_lse
    excluded_rules = VALUE_RULES

    def unavailable(self):
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install -e '.[test]')"
        return None

    def verify(self, table, name, check):
        INTERPRETER.expect(table, name)

    # In the worker process (TRITON_INTERPRET=1): the kernels themselves.
    def call(self, op, args):
        from torch_tree_attn.backends import cuda as cuda_backend

        return getattr(cuda_backend, op)(*args)


class CUDA(Backend):
    name = "cuda"
    device = "cuda:0"
    excluded_rules = VALUE_RULES

    def unavailable(self):
        import importlib.util

        if not torch.cuda.is_available():
            return "CUDA is not available"
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (the CUDA backend's kernels are Triton)"
        return None


class CUDAKernel(CUDA):
    """The CUDA backend with its main kernel forced (cuda_backend.forward_with_lse(kernel=)):
    "triton" keeps the portable Triton kernel proven on sm_90, where the default ("auto", the
    plain cuda backend) puts every call the Hopper kernel covers on it. Validation is shared:
    no bad-input table."""

    forward_every = 0
    bad_inputs = False

    def __init__(self, kernel: str, parity_share: slice = slice(None)):
        self.kernel = kernel
        self.name = f"cuda-{kernel}"
        self.parity_share = parity_share

    def call(self, op, args):
        from torch_tree_attn.backends import cuda as cuda_backend

        out, lse = cuda_backend.forward_with_lse(*args, kernel=self.kernel)
        return (out, lse) if op == "forward_with_lse" else out


class MPS(Backend):
    name = "mps"
    device = "mps:0"
    excluded_rules = VALUE_RULES

    def unavailable(self):
        if not torch.backends.mps.is_available():
            return "MPS is not available (needs an Apple-silicon Mac and a PyTorch build with MPS)"
        return None


ALL_BACKENDS = (CPU(), Simulator(), SimulatorVector(), TritonInterpreter(), CUDA(), CUDAKernel("triton"), MPS())
BY_NAME = {b.name: b for b in ALL_BACKENDS}
TRITON_INTERP = BY_NAME["triton-interp"]


def selected_backends() -> list:
    """ALL_BACKENDS, or those TREE_ATTN_TEST_BACKENDS names."""
    spec = os.environ.get("TREE_ATTN_TEST_BACKENDS")
    if not spec:
        return list(ALL_BACKENDS)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise ValueError(f"TREE_ATTN_TEST_BACKENDS names unknown backends {unknown}; known: {sorted(BY_NAME)}")
    return [BY_NAME[n] for n in names]


# ---------------------------------------------------------------------------------------
# The interpreter's child process: one per session, for tests/test_contract.py's
# triton-interp items and tests/test_triton.py's own groups alike.

class InterpreterRun:
    """Runs ``python -m tests.triton_interp_worker`` (every group) once, on first use, and
    keeps each check's result: {(group, name): error text or None}."""

    TIMEOUT_S = 900

    def __init__(self):
        self._results: Optional[Dict[Tuple[str, str], Optional[str]]] = None
        self._proc = None

    def results(self):
        if self._results is None:
            env = dict(os.environ, TRITON_INTERPRET="1")
            env["PYTHONPATH"] = os.pathsep.join(
                [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
            self._proc = subprocess.run([sys.executable, "-m", "tests.triton_interp_worker"], cwd=str(ROOT), env=env,
                                        capture_output=True, text=True, timeout=self.TIMEOUT_S)
            self._results = {}
            for line in self._proc.stdout.splitlines():
                if line.startswith("{"):
                    r = json.loads(line)
                    self._results[(r["group"], r["name"])] = r["error"]
        return self._results, self._proc

    def group(self, group: str) -> list:
        """[(name, error)] of one group."""
        results, _ = self.results()
        return [(name, error) for (g, name), error in results.items() if g == group]

    def failure_context(self) -> str:
        _, proc = self.results()
        return f"worker rc {proc.returncode}; its stderr ends:\n{proc.stderr[-4000:]}"

    def expect(self, group: str, name: str) -> None:
        """Fails unless the worker ran this check and it passed."""
        results, _ = self.results()
        if (group, name) not in results:
            raise AssertionError(f"the interpreter worker reported no check {group}/{name} ({self.failure_context()})")
        error = results[(group, name)]
        if error:
            raise AssertionError(f"under the Triton interpreter:\n{error}")


INTERPRETER = InterpreterRun()

