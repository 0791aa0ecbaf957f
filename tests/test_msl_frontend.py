"""The MSL front-end check (tests/msl/check.py): clang-19 type-checks every shaders/*.metal,
unmodified, against our MSL 3.1 declarations (tests/msl/metal_stdlib), every kernel of
the macro table instantiated with its real types (bfloat included: MSL 3.1, as the MPS
backend compiles). Deliberately broken copies, made from the real source by one textual
edit each, must fail with the expected diagnostic, so the check is shown able to fail.

clang-19 comes from Debian's clang-19 package (.ci/run installs it); without it the test
is skipped locally and fails under CI, where a skip would hide the check.
"""
import os
import pathlib
import shutil
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "msl"))
import check as msl  # noqa: E402

SHADERS = sorted((ROOT / "shaders").glob("*.metal"))
MAIN_SHADER = ROOT / "shaders" / "tree_attention.metal"
SAMPLES = sorted((ROOT / "tests" / "msl" / "samples").glob("*.metal"))


@pytest.fixture(scope="module")
def clang():
    path = msl.find_clang()
    if path is None:
        reason = "clang-19 is not installed (Debian: apt-get install -y clang-19)"
        if os.environ.get("CI"):
            pytest.fail(reason + "; CI must run this check, .ci/run installs clang-19", pytrace=False)
        pytest.skip(reason)
    return path


def test_shaders_exist():
    assert MAIN_SHADER in SHADERS


@pytest.mark.parametrize("path", SHADERS + SAMPLES, ids=lambda p: p.name)
def test_source_passes_without_warnings(clang, path):
    result = msl.check(path, "3.1", clang=clang)
    assert result.ok, result.diagnostics
    assert result.diagnostics == "", result.diagnostics  # not even a warning


def broken_copy(tmp_path, old, new, count=1):
    """The real shader (and the headers beside it) with `old` replaced by `new`."""
    text = MAIN_SHADER.read_text()
    assert text.count(old) == count, f"the edit's anchor {old!r} must occur {count}x in the shader"
    for header in MAIN_SHADER.parent.glob("*.h"):
        shutil.copy(header, tmp_path / header.name)
    path = tmp_path / MAIN_SHADER.name
    path.write_text(text.replace(old, new))
    return path


BROKEN = {
    # A threadgroup pointer where a device pointer is expected (the instantiation no
    # longer matches the template's signature).
    "threadgroup_for_device": (
        "device const float* partial_o [[buffer(1)]],\n    device const float* partial_m [[buffer(2)]],",
        "threadgroup const float* partial_o [[buffer(1)]],\n    device const float* partial_m [[buffer(2)]],",
        ("error: explicit instantiation of 'tree_attn_reduce' does not refer to a function template",
         "__local float *__private, const __global float *__private, const __global float *__private, __global")),
    # A device pointer passed where a thread pointer is expected.
    "device_for_thread": (
        "raw[r] += simd_transpose_sum(partial, lane);", "raw[r] += simd_transpose_sum(partial_o, lane);",
        "cannot pass pointer to address space '__global' as a pointer to address space '__private'"),
    # device const T* assigned to device T*.
    "drop_const": (
        "  const float m_split = my_split ? partial_m[row * n_splits + lane] : -INFINITY;",
        "  device float* writable = partial_m;\n"
        "  const float m_split = my_split ? writable[row * n_splits + lane] : -INFINITY;",
        "cannot initialize a variable of type '__global float *__private' with an lvalue of "
        "type 'const __global float *__private'"),
    # simd_shuffle_xor with a pointer mask, and with a struct value.
    "shuffle_pointer_mask": (
        "simd_shuffle_xor(give, w)", "simd_shuffle_xor(give, &x[0])",
        "no matching function for call to 'simd_shuffle_xor'"),
    "shuffle_struct_value": (
        "simd_shuffle_xor(give, w)", "simd_shuffle_xor(TreeAttnParams(), w)",
        "no matching function for call to 'simd_shuffle_xor'"),
    # A kernel instantiation without host_name.
    "no_host_name": (
        "[[host_name(TREE_ATTN_REDUCE_KERNEL_NAME(TAG, D))]] ", "",
        "explicit instantiation of kernel 'tree_attn_reduce' without [[host_name"),
    # A misspelt attribute: an error, not a warning.
    "misspelt_attribute": (
        "device float* lse [[buffer(5)]],  // [B, Hq, T] contiguous",
        "device float* lse [[bufer(5)]],  // [B, Hq, T] contiguous",
        "error: unknown attribute 'bufer' ignored [-Werror,-Wunknown-attributes]"),
    # Functions MSL lacks.
    "expf": (
        "weight = exp(m_all - row_lse);", "weight = expf(m_all - row_lse);",
        "use of undeclared identifier 'expf'"),
    "syncthreads": (
        "  if (row >= rows) return;", "  __syncthreads();\n  if (row >= rows) return;",
        "use of undeclared identifier '__syncthreads'"),
    # v2 (simdgroup-matrix kernel) mistakes.
    # simdgroup_load reads device or threadgroup memory, never a thread array.
    "simdgroup_load_from_thread": (
        "simdgroup_load(v_tile, kv_tile + j * 8 * LD_KV + part_dim0 + i * 8, LD_KV);",
        "float local_tile[64] = {};\n          simdgroup_load(v_tile, local_tile, 8);",
        "no matching function for call to 'simdgroup_load'"),
    # A threadgroup pointer where a matrix operand is expected.
    "mma_pointer_operand": (
        "simdgroup_multiply_accumulate(s[j], q[slice * PART_DT + i], k_t, s[j]);",
        "simdgroup_multiply_accumulate(s[j], q[slice * PART_DT + i], kv_tile, s[j]);",
        "no matching function for call to 'simdgroup_multiply_accumulate'"),
    # The whole array of query matrices instead of one.
    "mma_array_operand": (
        "simdgroup_multiply_accumulate(s[j], q[slice * PART_DT + i], k_t, s[j]);",
        "simdgroup_multiply_accumulate(s[j], q, k_t, s[j]);",
        "no matching function for call to 'simdgroup_multiply_accumulate'"),
    # Metal's simdgroup matrices are 8 x 8.
    "matrix_not_8x8": (
        "s[j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);",
        "s[j] = make_filled_simdgroup_matrix<float, 8, 4>(0.0f);",
        "simdgroup_matrix: only 8 x 8 matrices are supported"),
    # A bool vector is no float vector (MSL has no implicit conversion between them).
    "bool4_to_float4": (
        "v = select(float4(0.0f), v, finite);", "v = finite;",
        "assigning to 'float4' (vector of 4 'float' values) from incompatible type "
        "'const __private bool4' (vector of 4 '__metal_bool' values)"),
    # isfinite of a vector is a bool vector, not a bool.
    "vector_isfinite_as_bool": (
        "const bool4 finite = isfinite(v);", "const bool finite = isfinite(v);",
        "cannot initialize a variable of type 'const __private bool' with an rvalue of type 'bool4'"),
    # select's condition must be a bool vector of the operands' length (a scalar bool
    # would be splat, as MSL converts a scalar to a vector implicitly).
    "select_short_condition": (
        "v = select(float4(0.0f), v, finite);", "v = select(float4(0.0f), v, finite.xy);",
        "no matching function for call to 'select'"),
    # float4(v) of a 2-vector: a conversion needs as many elements (a copy of 2 of 4 is
    # no constructor MSL has).
    "convert_wrong_length": (
        "v = float4(*((device const vec<KVT, 4>*)at));", "v = float4(*((device const vec<KVT, 2>*)at));",
        "vector constructor: a vector argument must have as many elements as the vector built"),
    # A conversion constructor from a pointer.
    "convert_pointer": (
        "v = float4(*((device const vec<KVT, 4>*)at));", "v = float4(at);",
        "vector constructor: the single argument must be a scalar or a vector of the same length"),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_copy_fails(clang, tmp_path, name):
    old, new, expected = BROKEN[name]
    result = msl.check(broken_copy(tmp_path, old, new), "3.1", clang=clang)
    assert not result.ok
    for text in (expected,) if isinstance(expected, str) else expected:
        assert text in result.diagnostics, result.diagnostics


def test_bfloat_needs_msl_3_1(clang):
    # bfloat exists from MSL 3.1 on; the shader uses it, so under 3.0 it must fail.
    result = msl.check(MAIN_SHADER, "3.0", clang=clang)
    assert not result.ok
    assert "use of undeclared identifier 'bfloat'" in result.diagnostics


def test_diagnostics_point_at_the_real_file_and_line(clang, tmp_path):
    path = broken_copy(tmp_path, "weight = exp(m_all - row_lse);", "weight = expf(m_all - row_lse);")
    line = next(i for i, l in enumerate(path.read_text().splitlines(), 1) if "expf(" in l)
    result = msl.check(path, "3.1", clang=clang)
    assert f"{path}:{line}:" in result.diagnostics, result.diagnostics


def test_rewrite_keeps_lines_and_moves_instantiation_attributes():
    src = ('template <typename T> [[kernel]] void k(device T* p [[buffer(0)]]) {}\n'
           'template [[host_name("k_f32")]] [[kernel]] void k<float>(\\\n'
           '    device float* p [[buffer(0)]]);\n'
           'void f(threadgroup float* t [[threadgroup(1)]]) { float4 v = float4(1.0f, t[0], 2.0f, 3.0f); }\n')
    out, errors = msl.rewrite(src)
    assert errors == []
    assert out.count("\n") == src.count("\n")
    assert 'void k<float> [[host_name("k_f32")]] [[kernel]] (' in out
    assert "[[__metal_threadgroup_index(1)]]" in out and "threadgroup float* t" in out
    assert "(float4)(1.0f" in out
    out, _ = msl.rewrite("float4 a = float4(h), b = float4(f(x, y)), c = float4(), d = half2(p[0], q);")
    assert "__metal_vector_convert<float4>(h)" in out and "__metal_vector_convert<float4>(f(x, y))" in out
    assert "float4()" in out and "(half2)(p[0], q)" in out
    out, errors = msl.rewrite('template <typename T> kernel void k(device T* p [[buffer(0)]]) {}\n'
                              'template [[host_name("k_f32")]] kernel void k<float>(device float* p [[buffer(0)]]);\n'
                              'kernel void plain() {} // kernel\n')
    assert errors == []
    assert "template <typename T> [[kernel]] void k(" in out and "[[kernel]] void plain()" in out
    assert 'void k<float> [[host_name("k_f32")]] [[kernel]] (' in out and "// kernel" in out
    _, errors = msl.rewrite(src.replace('[[host_name("k_f32")]] ', ""))
    assert len(errors) == 1 and ":2: error: explicit instantiation of kernel 'k'" in errors[0]


def test_bad_input():
    with pytest.raises(msl.MslCheckError, match="no such file"):
        msl.check(ROOT / "shaders" / "missing.metal")
    with pytest.raises(msl.MslCheckError, match="unknown MSL version"):
        msl.check(MAIN_SHADER, "2.4")
