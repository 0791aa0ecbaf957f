"""Front-end check of Metal Shading Language source with clang, without a Mac.

clang-19 parses a .metal file, unmodified on disk, as C++ for OpenCL 2021 against our own
MSL 3.1 declarations (tests/msl/metal_stdlib), so the type checker checks the kernels:
address spaces (device, threadgroup, constant, thread are OpenCL's __global, __local,
__constant, __private), the argument types of every
library call, attributes, and every kernel instantiation of the macro table, since
parsing the file instantiates each template with its real types.

    check(path, msl_version="3.1") -> Result      # Result.ok, Result.diagnostics
    python tests/msl/check.py shaders/tree_attention.metal [--msl 3.0|3.1]

Why a small rewrite before clang, and only these: some MSL spellings are not C++ for
OpenCL and cannot be reached by macros in the header (a macro cannot tell an attribute
name from the same word in type position, nor move tokens). The driver rewrites them on a
copy in a temporary folder (`#line 1` names the original file, no edit adds or removes a
line, so every diagnostic points at the real file and line; columns may shift) and
changes nothing else:
  0. MSL's function qualifier `kernel void f(...)` is spelt as the attribute `[[kernel]]
     void f(...)`, which MSL accepts too (`kernel` is OpenCL's keyword).
  1. Attributes on an explicit instantiation, `template [[host_name("x")]] [[kernel]] void
     f<A>(...)`, which clang rejects ("an attribute list cannot appear here"), move behind
     the declarator-id, `template void f<A> [[host_name("x")]] [[kernel]] (...)`, where
     clang accepts and checks them (host_name's argument must be a string literal; a
     misspelt attribute is unknown). The driver itself requires that every explicit
     instantiation of a [[kernel]] template (or carrying [[kernel]]) has [[host_name]]:
     Metal gives such a kernel no name the host can look up. This works on the source text,
     macro bodies included (the shaders' instantiations live in one macro table); an
     instantiation spelt through token pasting would escape it.
  2. The attribute [[threadgroup(n)]] is spelt [[__metal_threadgroup_index(n)]]: the word
     is also the address-space keyword (a macro for __local).
  3. A program-scope `constant T name [[function_constant(n)]];` is made `extern`: its
     value is set when the pipeline is built, and OpenCL requires an initializer otherwise.
  4. A vector constructor with several arguments, `float4(a, b)`, becomes OpenCL's vector
     literal `(float4)(a, b)`, which has MSL's composition rules; clang's C++ has no
     multi-argument functional cast to a vector type. One with a single argument,
     `float4(x)`, becomes `__metal_vector_convert<float4>(x)` (metal_stdlib): MSL converts
     a vector of the same length element by element (float4(half4)) and splats a scalar,
     where OpenCL's `(float4)(x)` would reinterpret the bits of a same-size vector and
     reject a different-size one. `float4()` stays. Arguments are counted by top-level
     commas; a template argument list with a comma inside one argument would miscount.
Headers the file includes are parsed as they are. Rewriting macros in metal_stdlib was
the alternative for (1); it cannot work, since the attribute tokens of an explicit
instantiation are rejected wherever a macro puts them before the declarator.

clang flags: -Wall -Wextra -Werror (so an unknown attribute such as [[bufer(0)]] is an
error), -Wno-c++11-narrowing only because OpenCL vector literals treat `ulong2(0, i)`
with an int i as narrowing list-initialisation, which MSL's constructors are not. The
target is x86_64 (spir64 has no __bf16, our bfloat); clang's address-space checks are the
language's, not the target's. OpenCL's own builtin declarations are not included
(no -finclude-default-header): a function MSL lacks (expf, __syncthreads, get_global_id)
is undeclared. double is off (MSL has none). OpenCL's generic address space stays on:
clang cannot construct class temporaries (simdgroup_float8x8(2.0f)) without it; so a
pointer or reference spelt without an address space accepts any (MSL requires one).

What this cannot prove: that Apple's compiler accepts the file (our declarations are
reviewed against the specification, not Apple's headers), nor anything at run time.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
MSL_VERSIONS = {"3.0": 300, "3.1": 310}
CLANG_NAMES = ("clang-19",)

CLANG_FLAGS = [
    "-x", "cl", "-cl-std=clc++2021", "--target=x86_64-unknown-linux-gnu", "-fsyntax-only",
    "-nostdinc", "-cl-no-stdinc", "-Xclang",
    "-cl-ext=-cl_khr_fp64,-__opencl_c_fp64",
    "-Wall", "-Wextra", "-Werror", "-Wno-c++11-narrowing", "-ferror-limit=0",
    "-fno-color-diagnostics",
]


class MslCheckError(Exception):
    """The input cannot be checked (missing file, unknown MSL version, no clang)."""


@dataclasses.dataclass
class Result:
    ok: bool
    diagnostics: str  # clang's output and the driver's own errors
    command: list[str]


def find_clang() -> str | None:
    for name in CLANG_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


# ---- Source scanning --------------------------------------------------------------------

def _mask(text: str) -> str:
    """text with comments and the insides of string and character literals blanked
    (newlines and backslashes kept), so patterns below only see code."""
    out = list(text)
    i, n = 0, len(text)

    def blank(a: int, b: int) -> None:
        for j in range(a, b):
            if out[j] not in "\n\\":
                out[j] = " "

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            blank(i, j)
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            blank(i + 1, min(j, n))
            i = j + 1
        else:
            i += 1
    return "".join(out)


_SPACE = r"(?:\s|\\\n)*"


def _attribute_specs(masked: str, pos: int) -> tuple[list[tuple[int, int]], int]:
    """The [[...]] specifiers starting at pos (after blanks): their spans and the end."""
    specs = []
    while True:
        m = re.compile(_SPACE).match(masked, pos)
        start = m.end()
        if not masked.startswith("[[", start):
            return specs, pos
        end = masked.find("]]", start)
        if end < 0:
            return specs, pos
        specs.append((start, end + 2))
        pos = end + 2


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _skeleton(s: str) -> str:
    """s with everything but backslash-newlines and newlines blanked: a replacement that
    keeps the line structure."""
    return re.sub(r"[^\\\n]", " ", s)


def _flatten(s: str) -> str:
    return re.sub(r"\\\n|\n", " ", s)


def _top_level_args(masked: str, open_paren: int) -> int:
    """The number of arguments in the parentheses opening at open_paren (0 if empty or
    unbalanced): top-level commas, nested (), [] and {} skipped."""
    depth, commas, i = 0, 0, open_paren
    while i < len(masked):
        c = masked[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                inner = masked[open_paren + 1:i]
                return 0 if not re.sub(r"\s|\\", "", inner) else commas + 1
        elif c == "," and depth == 1:
            commas += 1
        i += 1
    return 0


def _attribute_spans(masked: str) -> list[tuple[int, int]]:
    spans, pos = [], 0
    while (start := masked.find("[[", pos)) >= 0:
        end = masked.find("]]", start)
        if end < 0:
            break
        spans.append((start, end + 2))
        pos = end + 2
    return spans


def _kernel_prefix_to_attribute(text: str) -> str:
    """(0) MSL's function qualifier `kernel void f(...)` becomes `[[kernel]] void f(...)`."""
    masked = _mask(text)
    spans = _attribute_spans(masked)
    out, pos = [], 0
    for m in re.finditer(r"\bkernel\b", masked):
        if any(a <= m.start() < b for a, b in spans):
            continue
        out += [text[pos:m.start()], "[[kernel]]"]
        pos = m.end()
    return "".join(out + [text[pos:]])


def rewrite(text: str, path: str = "<source>") -> tuple[str, list[str]]:
    """The source clang parses, and the driver's own errors (see the module docstring)."""
    text = _kernel_prefix_to_attribute(text)
    masked = _mask(text)
    edits: list[tuple[int, int, str]] = []  # (start, end, replacement), disjoint
    errors: list[str] = []

    # (2) [[threadgroup(n)]] inside any attribute specifier.
    for m in re.finditer(r"\[\[", masked):
        end = masked.find("]]", m.start())
        if end < 0:
            continue
        for a in re.finditer(r"\bthreadgroup(?=\s*\()", masked[m.start():end]):
            s = m.start() + a.start()
            edits.append((s, s + len("threadgroup"), "__metal_threadgroup_index"))

    # Kernel templates: template <...> [[... kernel ...]] ... name(
    kernel_templates = set()
    for m in re.finditer(r"\btemplate" + _SPACE + "<", masked):
        depth, i = 0, m.end() - 1
        while i < len(masked):
            depth += {"<": 1, ">": -1}.get(masked[i], 0)
            i += 1
            if depth == 0:
                break
        specs, after = _attribute_specs(masked, i)
        if any(re.search(r"\bkernel\b", masked[a:b]) for a, b in specs):
            name = re.match(r"[^;{(]*?(\w+)" + _SPACE + r"\(", masked[after:], re.S)
            if name:
                kernel_templates.add(name.group(1))

    # (1) Explicit instantiations: `template` not followed by `<` (nor `x.template f<>`).
    for m in re.finditer(r"\btemplate\b(?!" + _SPACE + "<)", masked):
        before = masked[:m.start()].rstrip()
        if before.endswith((".", "->", "::")):
            continue
        specs, after = _attribute_specs(masked, m.end())
        stop = re.compile(r"[;(]").search(masked, after)
        if not stop or masked[stop.start()] == ";":
            continue  # not a function: left to clang
        head = masked[after:stop.start()]
        name = re.search(r"(\w+)" + _SPACE + r"(<[^;{}]*>)?" + _SPACE + r"$", head, re.S)
        if not name:
            errors.append(f"{path}:{_line(text, m.start())}: error: cannot find the function "
                          "name of this explicit instantiation")
            continue
        attrs = [masked[a:b] for a, b in specs]
        is_kernel = name.group(1) in kernel_templates or any(
            re.search(r"\bkernel\b", a) for a in attrs)
        if is_kernel and not any(re.search(r"\bhost_name\b", a) for a in attrs):
            errors.append(
                f"{path}:{_line(text, m.start())}: error: explicit instantiation of kernel "
                f"'{name.group(1)}' without [[host_name(\"...\")]]: Metal gives it no name "
                "the host can look up")
        if specs:
            first, last = specs[0][0], specs[-1][1]
            edits.append((first, last, _skeleton(text[first:last])))
            moved = " ".join(_flatten(text[a:b]) for a, b in specs)
            edits.append((stop.start(), stop.start(), " " + moved + " "))

    # (3) Function constants at program scope become extern declarations.
    depth_at = []
    depth = 0
    for c in masked:
        depth_at.append(depth)
        depth += {"{": 1, "}": -1}.get(c, 0)
    for m in re.finditer(r"\bconstant\b[^;{}=]*\[\[" + _SPACE + r"function_constant\b", masked):
        if depth_at[m.start()] == 0:
            edits.append((m.start(), m.start(), "extern "))

    # (4) Vector constructors: several arguments compose (OpenCL's vector literal), one
    # converts (element-wise, or a scalar splat), none value-initialises (left as is).
    vector = r"\b((?:u?char|u?short|u?int|u?long|half|float|bfloat|bool)[234])" + _SPACE + r"\("
    for m in re.finditer(vector, masked):
        if masked[:m.start()].rstrip().endswith(("::", ".", "->")):
            continue
        args = _top_level_args(masked, m.end() - 1)
        if args == 0:
            continue
        if args == 1:
            edits.append((m.start(), m.end(1), f"__metal_vector_convert<{m.group(1)}>"))
        else:
            edits.append((m.start(), m.end(1), f"({m.group(1)})"))

    edits.sort()
    out, pos = [], 0
    for start, end, new in edits:
        if start < pos:
            raise AssertionError(f"overlapping rewrites at offset {start}")
        out.append(text[pos:start])
        out.append(new)
        pos = end
    out.append(text[pos:])
    result = "".join(out)
    assert result.count("\n") == text.count("\n"), "the rewrite must keep every line"
    return result, errors


# ---- The check --------------------------------------------------------------------------

def check(path: str | os.PathLike, msl_version: str = "3.1", *, clang: str | None = None,
          include_dirs: tuple[str, ...] = ()) -> Result:
    """Front-end check of one .metal file; Result.ok is False on any error or warning."""
    path = pathlib.Path(path).resolve()
    if not path.is_file():
        raise MslCheckError(f"no such file: {path}")
    if msl_version not in MSL_VERSIONS:
        raise MslCheckError(f"unknown MSL version {msl_version!r}; expected one of {sorted(MSL_VERSIONS)}")
    clang = clang or find_clang()
    if clang is None:
        raise MslCheckError("clang-19 is not installed (Debian: apt-get install -y clang-19)")
    text = path.read_text()
    source, errors = rewrite(text, str(path))
    with tempfile.TemporaryDirectory(prefix="msl_check_") as tmp:
        copy = pathlib.Path(tmp) / path.name
        copy.write_text(f'#line 1 "{path}"\n' + source)
        command = [clang, *CLANG_FLAGS, f"-D__METAL_VERSION__={MSL_VERSIONS[msl_version]}",
                   "-I", str(HERE), "-iquote", str(path.parent),
                   *(f"-I{d}" for d in include_dirs), str(copy)]
        proc = subprocess.run(command, capture_output=True, text=True)
    diagnostics = "\n".join(errors + [proc.stdout + proc.stderr]).strip()
    ok = proc.returncode == 0 and not errors and not re.search(r"\bwarning:", diagnostics)
    return Result(ok=ok, diagnostics=diagnostics, command=command)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help=".metal files")
    parser.add_argument("--msl", default="3.1", choices=sorted(MSL_VERSIONS), help="MSL version")
    args = parser.parse_args(argv)
    status = 0
    for p in args.paths:
        try:
            result = check(p, args.msl)
        except MslCheckError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if result.diagnostics:
            print(result.diagnostics)
        print(f"{p}: {'ok' if result.ok else 'FAILED'} (MSL {args.msl})")
        status = status or (0 if result.ok else 1)
    return status


if __name__ == "__main__":
    sys.exit(main())
