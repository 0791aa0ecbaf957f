"""The Objective-C++ MPS backend (csrc/metal/*.mm), checked without a Mac.

clang parses every .mm in Objective-C++ mode with ARC and blocks, against the real
PyTorch headers (including ATen/mps/MPSStream.h's Objective-C half) and the minimal
Apple declarations in tests/objc/apple_sdk/, which spell every selector and argument type
as Apple's SDK does. Under these flags a misspelt or undeclared selector, a wrong
argument type, an implicit signed-to-NSUInteger conversion, or a call to an API the
backend must not use (ending PyTorch's encoder, opening our own) is an error. The
negative tests prove that: the real backend with one deliberate mistake, and small
snippets, must each fail with the expected diagnostic.

What this cannot prove (a Mac runs tests/test_mps.py for that): that the shaders
compile under Metal, that the kernels are right on a GPU, and that the declarations in
tests/objc/apple_sdk/ match the SDK (they are reviewed against Apple's documentation).

clang comes from Debian's `clang` package (`.ci/run` installs it); without it the test is
skipped locally and fails under CI, where a skip would hide the check.
"""
import functools
import os
import pathlib
import shutil
import subprocess
import sysconfig

import pytest
from torch.utils import cpp_extension

ROOT = pathlib.Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
METAL = CSRC / "metal"
APPLE_SDK = ROOT / "tests" / "objc" / "apple_sdk"
MM_SOURCES = sorted(METAL.glob("*.mm"))
BACKEND = METAL / "tree_attn_mps.mm"

# -fobjc-arc: a selector declared nowhere is an error (not a warning) under ARC.
# -fobjc-runtime=macosx-14.0: the Apple runtime, as on the Macs PyTorch supports.
# -Wall -Wextra -Wconversion -Werror: every warning in our code is an error, including
# sign and width conversions into NSUInteger arguments (a negative byte offset). Torch
# and the Apple declarations are -isystem, so only our own code is held to this.
CLANG_FLAGS = [
    "-x", "objective-c++", "-fsyntax-only", "-fobjc-arc", "-fblocks", "-fobjc-runtime=macosx-14.0",
    "-Wall", "-Wextra", "-Wconversion", "-Werror",
]
# BuildExtension compiles with -std=c++20 when setup.py names no standard; the issue's
# check names c++17. The backend must parse under both.
STANDARDS = ("c++17", "c++20")


@functools.lru_cache(maxsize=None)
def clang() -> str:
    for name in ["clang++"] + [f"clang++-{v}" for v in range(20, 13, -1)]:
        path = shutil.which(name)
        if path:
            return path
    reason = "clang++ is not installed (Debian: apt-get install -y clang)"
    if os.environ.get("CI"):
        pytest.fail(reason + "; CI must run this check, .ci/run installs clang", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def generated_dir(tmp_path_factory) -> pathlib.Path:
    """build/generated from setup.py when the extension was built; otherwise a stand-in
    shader_source.h with the same declaration (a syntax check never reads the source)."""
    built = ROOT / "build" / "generated"
    if (built / "shader_source.h").exists():
        return built
    stand_in = tmp_path_factory.mktemp("generated")
    (stand_in / "shader_source.h").write_text(
        "#pragma once\nnamespace tree_attn { inline constexpr const char* kShaderSource = \"\"; }\n")
    return stand_in


def clang_command(source: pathlib.Path, generated: pathlib.Path, std: str = "c++20") -> list:
    # -iquote csrc/metal: a copy of a backend file elsewhere still finds its neighbours.
    include = ["-iquote", str(METAL), "-isystem", str(APPLE_SDK)]
    for path in cpp_extension.include_paths():
        include += ["-isystem", path]
    include += ["-isystem", sysconfig.get_paths()["include"]]
    include += ["-I", str(CSRC), "-I", str(ROOT / "shaders"), "-I", str(generated)]
    return [clang(), *CLANG_FLAGS, f"-std={std}", *include, str(source)]


def run_clang(source: pathlib.Path, generated: pathlib.Path, std: str = "c++20") -> subprocess.CompletedProcess:
    return subprocess.run(clang_command(source, generated, std), capture_output=True, text=True, timeout=300)


def test_backend_sources_exist():
    names = {p.name for p in MM_SOURCES}
    assert "tree_attn_mps.mm" in names, f"no MPS backend among csrc/metal/*.mm: {sorted(names)}"


@pytest.mark.parametrize("std", STANDARDS)
@pytest.mark.parametrize("source", MM_SOURCES, ids=lambda p: p.name)
def test_mm_parses_as_objective_cxx(source, std, generated_dir):
    result = run_clang(source, generated_dir, std)
    assert result.returncode == 0, (
        f"clang rejected {source.relative_to(ROOT)}:\n$ {' '.join(clang_command(source, generated_dir, std))}\n"
        f"{result.stderr}")
    assert result.stderr == "", result.stderr


# The real backend with one deliberate mistake each: (id, text to replace, replacement,
# a fragment of the diagnostic clang must give). The replaced text must occur exactly
# once, so a refactor of the backend fails here loudly instead of testing nothing.
BACKEND_MUTATIONS = [
    ("misspelt-selector", "[encoder dispatchThreadgroups:", "[encoder dispatchThreadgroup:",
     "dispatchThreadgroup:threadsPerThreadgroup:"),
    ("setBytes-by-value", "[encoder setBytes:params length:", "[encoder setBytes:*params length:",
     "no viable conversion from 'const TreeAttnParams' to 'const void *"),
    ("setBuffer-raw-pointer", "[encoder setBuffer:bound.buffer offset:",
     "[encoder setBuffer:(__bridge void*)bound.buffer offset:", "cannot initialize a parameter of type 'id<MTLBuffer>"),
    ("ends-pytorch-encoder", "[encoder dispatchThreadgroups:launch.grid threadsPerThreadgroup:launch.threads];",
     "[encoder dispatchThreadgroups:launch.grid threadsPerThreadgroup:launch.threads]; [encoder endEncoding];",
     "endEncoding"),
]


@pytest.mark.parametrize("original,broken,diagnostic", [m[1:] for m in BACKEND_MUTATIONS],
                         ids=[m[0] for m in BACKEND_MUTATIONS])
def test_broken_backend_is_rejected(original, broken, diagnostic, generated_dir, tmp_path):
    text = BACKEND.read_text()
    assert text.count(original) == 1, f"update this mutation: {original!r} occurs {text.count(original)} times"
    mutant = tmp_path / BACKEND.name
    mutant.write_text(text.replace(original, broken))
    result = run_clang(mutant, generated_dir)
    assert result.returncode != 0, f"clang accepted the backend with {broken!r}"
    assert "error:" in result.stderr and diagnostic in result.stderr, result.stderr


# Small snippets against the Apple declarations alone (fast). CONTROL must parse; each
# broken variant swaps one statement of its body.
SNIPPET = """
#include <Metal/Metal.h>
#include <cstdint>
void encode(id<MTLDevice> device, id<MTLComputeCommandEncoder> encoder, id<MTLCommandBuffer> commandBuffer,
            id<MTLBuffer> buffer, id<MTLComputePipelineState> pipeline, int64_t signedOffset) {
  struct { float scale; } params = {1.0f};
  (void)device; (void)commandBuffer; (void)signedOffset;
  MTLCompileOptions* options = [[MTLCompileOptions alloc] init];
  options.languageVersion = MTLLanguageVersion3_1;
  options.fastMathEnabled = NO;
  [encoder setComputePipelineState:pipeline];
  [encoder setBytes:&params length:sizeof(params) atIndex:0];
  [encoder setBuffer:buffer offset:16 atIndex:1];
  [encoder setThreadgroupMemoryLength:4096 atIndex:0];
  STATEMENT
}
"""
CONTROL_STATEMENT = "[encoder dispatchThreadgroups:MTLSizeMake(4, 1, 1) threadsPerThreadgroup:MTLSizeMake(128, 1, 1)];"
BROKEN_STATEMENTS = {
    "misspelt-selector": ("[encoder dispatchThreadgroup:MTLSizeMake(4, 1, 1) threadsPerThreadgroup:MTLSizeMake(128, 1, 1)];",
                          "dispatchThreadgroup:threadsPerThreadgroup:"),
    "wrong-keyword": ("[encoder setBytes:&params length:sizeof(params) index:0];", "setBytes:length:index:"),
    "setBytes-int-for-pointer": ("[encoder setBytes:0x10 length:sizeof(params) atIndex:0];",
                                 "cannot initialize a parameter of type 'const void *"),
    "setBytes-pointer-for-length": ("[encoder setBytes:&params length:&params atIndex:0];",
                                    "cannot initialize a parameter of type 'NSUInteger'"),
    "grid-as-integers": ("[encoder dispatchThreadgroups:4 threadsPerThreadgroup:128];",
                         "no viable conversion from 'int' to 'MTLSize'"),
    "signed-offset": ("[encoder setBuffer:buffer offset:signedOffset atIndex:1];", "-Wsign-conversion"),
    "own-encoder": ("id<MTLComputeCommandEncoder> mine = [commandBuffer computeCommandEncoder]; (void)mine;",
                    "computeCommandEncoder"),
    "unknown-property": ("options.fastMath = NO;", "fastMath"),
    "pipeline-for-buffer": ("[encoder setComputePipelineState:buffer];",
                            "cannot initialize a parameter of type 'id<MTLComputePipelineState>"),
}


def compile_snippet(statement: str, tmp_path: pathlib.Path, generated: pathlib.Path) -> subprocess.CompletedProcess:
    source = tmp_path / "snippet.mm"
    source.write_text(SNIPPET.replace("STATEMENT", statement))
    return run_clang(source, generated)


def test_snippet_control_parses(tmp_path, generated_dir):
    result = compile_snippet(CONTROL_STATEMENT, tmp_path, generated_dir)
    assert result.returncode == 0 and result.stderr == "", result.stderr


@pytest.mark.parametrize("name", sorted(BROKEN_STATEMENTS))
def test_broken_snippet_is_rejected(name, tmp_path, generated_dir):
    statement, diagnostic = BROKEN_STATEMENTS[name]
    result = compile_snippet(statement, tmp_path, generated_dir)
    assert result.returncode != 0, f"clang accepted {statement!r}"
    assert "error:" in result.stderr and diagnostic in result.stderr, result.stderr


def test_embedded_shader_source_is_self_contained():
    """newLibraryWithSource: compiles the embedded source with no include path, so it
    may include only Metal's own headers (<...>): each quoted include of a header in
    shaders/ must have been inlined by setup.py when it embedded the source."""
    header = ROOT / "build" / "generated" / "shader_source.h"
    if not header.exists():
        pytest.skip("build/generated/shader_source.h is written by setup.py; build the extension first")
    quoted = [line.strip() for line in header.read_text().splitlines()
              if line.lstrip().startswith("#") and "include" in line and '"' in line]
    assert not quoted, f"the embedded shader source still has quoted includes Metal cannot resolve: {quoted}"
