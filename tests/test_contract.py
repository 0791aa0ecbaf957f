"""The op contract (README, "The op contract") on every backend: ONE parity matrix, ONE
forward-vs-forward_with_lse comparison, ONE bad-input table and ONE non-finite table.

tests/conftest.py parametrises each test over the backends of tests/backends.py (cpu, sim,
sim-vector, triton-interp, cuda, mps) and the backend's share of the table; the checks
themselves are tests/backends.py's, against the float64 reference. Each backend's own
tests (key splits, plans, CUDA graphs, torch.compile, the simulator's internals) stay in
its own file.

    python -m pytest -q tests/test_contract.py -k "cpu-"          # one backend
    TREE_ATTN_TEST_BACKENDS=cuda python -m pytest -q tests/test_contract.py
"""
import torch

from tests import backends
from tests.cases import DTYPE_PAIRS, HEAD_DIMS, parity_matrix


def test_parity_matrix(backend, parity_case):
    name, case = parity_case
    backend.verify("parity", name, lambda: backends.check_parity(backend, case))


def test_forward_equals_forward_with_lse(backend, forward_case):
    name, case = forward_case
    backend.verify("forward", name, lambda: backends.check_forward_matches(backend, case))


def test_bad_input_is_refused_naming_the_argument(backend, bad_input):
    name, rule, op = bad_input
    backend.verify("bad_input", name, lambda: backends.check_bad_input(backend, rule, op))


def test_nonfinite_values_poison_exactly_the_rows_that_see_them(backend, nonfinite_case):
    name, case, kind = nonfinite_case
    backend.verify("nonfinite", name, lambda: backends.check_nonfinite(backend, case, kind))


# ---------------------------------------------------------------------------------------
# The tables themselves.

MATRIX = parity_matrix()


def test_matrix_covers_the_contract():
    seen = lambda attr: {getattr(c, attr) for c in MATRIX}  # noqa: E731
    assert {(c.dtype, c.cache_dtype) for c in MATRIX} == set(DTYPE_PAIRS) and seen("D") == set(HEAD_DIMS)
    # Sinks (both sink dtypes) meet every dtype pair, D, mask kind and window (M = 0
    # included); fully masked rows come with every case (make_inputs).
    with_sinks = [c for c in MATRIX if c.sinks is not None]
    assert {c.sinks for c in with_sinks} == {torch.float32, torch.bfloat16}
    for attr in ("mask_kind", "window"):
        combos = lambda cases: {(c.dtype, c.cache_dtype, c.D, getattr(c, attr)) for c in cases}  # noqa: E731
        assert combos(with_sinks) == combos(MATRIX), attr
    assert {c.Hq // c.Hkv for c in MATRIX} == {1, 4, 8} and seen("T") == {1, 5, 64, 100}
    assert seen("mask_kind") == {"bool", "float", "float_min"}
    assert seen("window") == {"compact", "dense", "empty"}
    assert seen("kv_layout") == {"contiguous", "bshd"}
    assert seen("mask_shape") == {"3d", "none", "batch", "heads"}
    assert any(c.softcap for c in MATRIX) and any(c.B > 1 and c.offsets == "varied" for c in MATRIX)


def test_table_names_are_unique_and_shares_are_what_they_say():
    # Results of the interpreter's worker are looked up by name: a name must be one entry.
    for backend in backends.ALL_BACKENDS:
        for table in backends.TABLES:
            names = [name for name, _ in backend.items(table)]
            assert len(names) == len(set(names)), (backend.name, table)
    full = len(MATRIX)
    assert len(backends.BY_NAME["cpu"].items("parity")) == full
    assert len(backends.BY_NAME["sim"].items("parity")) == full
    assert len(backends.TRITON_INTERP.items("parity")) == len(MATRIX[3::12])
    # Every backend but the simulator (which clamps offsets and has no Meta kernel) and
    # the vector variant (non-finite only) checks every rule it can judge, through both ops.
    rules = len(backends.BAD_INPUTS)
    assert len(backends.BY_NAME["cpu"].items("bad_input")) == 2 * rules
    for name in ("triton-interp", "cuda", "mps"):
        assert len(backends.BY_NAME[name].items("bad_input")) == 2 * (rules - len(backends.VALUE_RULES))
