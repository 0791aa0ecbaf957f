"""Shared test apparatus: the ``backend`` parametrisation (tests/backends.py).

A test that takes ``backend`` together with one table argument runs once per (backend,
entry of that table in the backend's share):

- ``parity_case``: a tests/cases.py parity_matrix() case;
- ``forward_case``: a parity case on which forward is compared with forward_with_lse;
- ``bad_input``: (rule name, op) of tests/backends.py's BAD_INPUTS;
- ``nonfinite_case``: (case, kind) of tests/cases.py's nonfinite_cases().

A test that takes ``backend`` alone runs once per backend; one that parametrises a
``backend`` argument itself keeps its own. Ids are ``<backend>-<entry>``;
a backend that is unavailable here (no simulator, no triton, no GPU) gets its items
skipped with the reason. TREE_ATTN_TEST_BACKENDS and TREE_ATTN_TEST_SHARD select
(tests/backends.py).
"""
import pytest

from tests import backends

TABLE_ARGS = {"parity_case": "parity", "forward_case": "forward", "bad_input": "bad_input",
              "nonfinite_case": "nonfinite"}


def _parametrized_by_the_test(metafunc, name):
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        if name in names:
            return True
    return False


def pytest_generate_tests(metafunc):
    # A test that parametrises its own "backend" (tests/test_compile.py) keeps it.
    if "backend" not in metafunc.fixturenames or _parametrized_by_the_test(metafunc, "backend"):
        return
    tables = [arg for arg in TABLE_ARGS if arg in metafunc.fixturenames]
    assert len(tables) <= 1, f"{metafunc.function.__name__}: one table per test, got {tables}"
    params, ids = [], []
    for backend in backends.selected_backends():
        why = backend.unavailable()
        marks = [pytest.mark.skip(reason=f"{backend.name}: {why}")] if why else []
        if not tables:
            params.append(pytest.param(backend, marks=marks))
            ids.append(backend.name)
            continue
        for name, item in backend.items(TABLE_ARGS[tables[0]]):
            params.append(pytest.param(backend, (name, *item), marks=marks))
            ids.append(f"{backend.name}-{name}")
    if tables:
        metafunc.parametrize(["backend", tables[0]], params, ids=ids)
    else:
        metafunc.parametrize("backend", params, ids=ids)


def pytest_configure(config):
    config.addinivalue_line("markers", "wheel: builds the wheel with pip (tests/test_wheel.py); CI runs it")
