"""The CUDA backend's Triton kernels on CPU tensors, under Triton's interpreter.

Run once per pytest session in a child process (tests/backends.py InterpreterRun;
TRITON_INTERPRET=1 must be set before triton is imported, and the parent pytest process may
already have imported it). Prints one JSON line per check: {"group": ..., "name": ...,
"error": null or the failure}. The groups "parity", "forward", "bad_input" and "nonfinite"
are the contract's tables (tests/backends.py: the triton-interp backend's share, the same
check functions and names as tests/test_contract.py's items, which look them up); the
others are this backend's own checks, reported through tests/test_triton.py.

    TRITON_INTERPRET=1 python -m tests.triton_interp_worker [group ...]
"""
import json
import os
import sys
import traceback

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 (before triton is imported)"

import torch  # noqa: E402

import torch_tree_attn  # noqa: E402,F401
from torch_tree_attn.backends import cuda as tb  # noqa: E402
from tests import backends  # noqa: E402
from tests.cases import (SOFTCAPS, Case, check_clamped_offsets, check_softcap_at_any_cap, extreme_finite_checks,  # noqa: E402
                         args_of, check_against_reference, make_inputs)


def run(inputs, **kw):
    return tb.forward_with_lse(*args_of(inputs), **kw)


def table(name):
    """The contract table's entries of the triton-interp backend, as tests/test_contract.py names them."""
    def entries():
        backend = backends.TRITON_INTERP
        for item_name, args in backend.items(name):
            yield item_name, lambda args=args: backends.CHECKS[name](backend, *args)
    return entries


# Long prefixes: the keys split across programs (forced counts too), the reduce pass merges
# them; every slot at or beyond off_b + M holds NaN (make_inputs), masked window keys too.
SPLIT_CASES = [
    Case(B=2, Hq=8, Hkv=2, T=16, S=700, D=64, dtype=torch.bfloat16, mask_kind="bool", seed=201),
    Case(B=2, Hq=8, Hkv=2, T=5, S=900, D=64, dtype=torch.float32, mask_kind="float", seed=202,
         kv_layout="bshd", mask_shape="none", softcap=30.0, sinks=torch.float32),
    Case(B=1, Hq=4, Hkv=1, T=20, S=500, D=128, dtype=torch.float16, mask_kind="float", window="dense",
         offsets="none", seed=203),
    Case(B=2, Hq=4, Hkv=2, T=7, S=600, D=96, dtype=torch.float32, kv_dtype=torch.bfloat16, seed=204,
         sinks=torch.bfloat16),
    # A negative scale (the launcher negates Q, the kernels take |scale|), with softcap; a
    # zero scale.
    Case(B=2, Hq=4, Hkv=2, T=6, S=400, D=64, dtype=torch.float16, mask_kind="float", scale=-0.2, softcap=15.0,
         seed=205),
    Case(B=1, Hq=4, Hkv=1, T=9, S=300, D=64, dtype=torch.bfloat16, scale=0.0, seed=206),
    # More tree nodes than a block's rows (D=512: 32 rows): the window loop's skip test.
    Case(B=1, Hq=2, Hkv=1, T=40, S=300, D=512, dtype=torch.bfloat16, seed=207),
]


def splits():
    for case in SPLIT_CASES:
        for num_splits in (None, 1, 3, 7, 19):
            def check(case=case, num_splits=num_splits):
                inputs = make_inputs(case)
                out, lse = run(inputs, num_splits=num_splits)
                check_against_reference(out, lse, inputs)
            yield f"splits{num_splits}-{case}", check


def unused_slots():
    """NaN and inf in every slot a row does not see (masked window keys, the whole cache past
    off_b + M, including inside the last tile) must not reach any row."""
    def check():
        case = Case(B=2, Hq=8, Hkv=2, T=9, S=200, D=64, dtype=torch.float16, mask_kind="float", seed=211)
        inputs = make_inputs(case)
        mask = inputs["mask"]
        k, v = inputs["key"], inputs["value"]
        offs = inputs["mask_offset"].tolist()
        # Window columns no row of a kv head sees: poison their K/V.
        seen = ~torch.isneginf(mask.float())  # [B, T, M]
        for b in range(case.B):
            for col in range(case.M):
                if not seen[b, :, col].any():
                    k[b, :, offs[b] + col] = float("nan")
                    v[b, :, offs[b] + col] = float("inf")
        out, lse = run(inputs)
        check_against_reference(out, lse, inputs)
        assert not torch.isnan(out).any(), "a slot no row sees leaked into the output"
    yield "masked-window-and-past-end", check


def clamped_offsets():
    """Offsets are never read on the host; the kernel clamps each to [0, S] and reads no key
    outside [0, S): a negative offset acts as 0; one past S makes the whole cache the prefix."""
    for offset_dtype in (torch.int32, torch.int64):
        def check(offset_dtype=offset_dtype):
            check_clamped_offsets(run, offset_dtype)
        yield str(offset_dtype), check


def extremes():
    """Softcap at every cap (float32 relative accuracy), and finite sinks, biases and scores
    up to float32's max: the contract's finite answer, not inf or NaN."""
    for softcap in SOFTCAPS:
        for scale in (None, 0.3):
            yield f"softcap{softcap:g}-scale{scale}", lambda c=softcap, s=scale: check_softcap_at_any_cap(run, c, s)
    for splits in (None, 3):
        for name, check in extreme_finite_checks(lambda inputs, n=splits: run(inputs, num_splits=n)):
            yield f"{name}-splits{splits}", check


def api():
    def forward_matches():
        inputs = make_inputs(Case(B=2, Hq=8, Hkv=2, T=6, S=50, D=96, mask_kind="float", seed=303))
        out, lse = run(inputs)
        assert torch.equal(tb.forward(*args_of(inputs)), out)
        check_against_reference(out, lse, inputs)
    yield "forward-equals-forward_with_lse", forward_matches

    def empty():
        q = torch.randn(1, 4, 0, 64)
        kv = torch.randn(1, 2, 10, 64)
        out, lse = tb.forward_with_lse(q, kv, kv, torch.ones(1, 0, 3, dtype=torch.bool))
        assert out.shape == (1, 4, 0, 64) and lse.shape == (1, 4, 0)
        # S = 0, M = 0: every row sees nothing.
        q = torch.randn(1, 2, 3, 64)
        kv = torch.randn(1, 1, 0, 64)
        out, lse = tb.forward_with_lse(q, kv, kv, torch.ones(1, 3, 0, dtype=torch.bool))
        assert (out == 0).all() and torch.isneginf(lse).all()
    yield "empty-problems", empty

    def validation():
        q = torch.randn(1, 4, 5, 64)
        kv = torch.randn(1, 2, 10, 64)
        mask = torch.ones(1, 5, 5, dtype=torch.bool)
        for call, exc, words in [
            (lambda: tb.forward(q[..., :32], kv[..., :32], kv[..., :32], mask), ValueError, "head dim"),
            (lambda: tb.forward(q.half(), kv, kv, mask), TypeError, "dtypes"),
            (lambda: tb.forward(q, kv, kv, mask, torch.tensor([0, 1])), ValueError, "mask_offset"),
            (lambda: tb.forward(q, kv, kv, mask, None, None, None, torch.zeros(3)), ValueError, "sinks"),
        ]:
            try:
                call()
            except exc as e:
                assert words in str(e), str(e)
            else:
                raise AssertionError(f"no {exc.__name__} mentioning {words!r}")
    yield "validation-is-the-shared-prepare", validation

    def registration():
        # Registering needs no GPU: the CUDA dispatch key exists in every torch build.
        tb.register()
        for op in ("tree_attn::forward", "tree_attn::forward_with_lse"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA"), op
    yield "register-cuda-kernels", registration


GROUPS = dict(parity=table("parity"), forward=table("forward"), bad_input=table("bad_input"),
              nonfinite=table("nonfinite"), splits=splits, unused_slots=unused_slots,
              clamped_offsets=clamped_offsets, extremes=extremes, api=api)


def main(argv):
    for group in argv or list(GROUPS):
        for name, check in GROUPS[group]():
            try:
                check()
                error = None
            except Exception:  # noqa: BLE001  (reported to the parent test)
                error = traceback.format_exc(limit=4)[-3000:]
            print(json.dumps(dict(group=group, name=name, error=error)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
