"""Translate the Metal Shading Language subset used by this project into C++ for the simulator.

setup.py calls translate_file() for shaders/*.metal and tests/sim/csrc/selftest/*.metal at build time
and compiles the result against tests/sim/csrc/msl.h (the MSL prelude) into the test-only extension torch_tree_attn_sim._C (tests/sim/setup.py).

The translation is token-level and keeps every line where it was (the output carries #line
directives), so a C++ compile error points at the .metal line. What it does:

- address spaces: `device T*` / `constant T*` -> metal::device_ptr<T> (checked, counted),
  `threadgroup T*` -> metal::threadgroup_ptr<T>, `device const T&` / `constant T&` -> `const T&`,
  `thread` is dropped, program-scope `constant T x = ...;` -> `static const T x = ...;`;
- `threadgroup T name[N]...;` in a function body -> one shared allocation per threadgroup;
- function-like macros that produce attributes (kernel instantiation tables) are expanded
  by the translator itself, which must read those attributes; so are X-macro tables from
  included project headers invoked with such a macro as argument;
- kernels (`kernel`/`[[kernel]]`) lose their attributes; each non-template kernel and each
  explicit instantiation `template [[host_name("n")]] [[kernel]] void f<...>(...);` gets a
  launcher and a registry entry built from its parameter attributes;
- literals: `1.0h` -> half, `1.0bf` -> bfloat, unsuffixed floating literals -> float (MSL has no
  double).

Anything outside the supported subset (tests/sim/csrc/SUBSET.md) raises TranslationError naming the
file and line, so it can never compile into something that only looks right.
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

__all__ = ["TranslationError", "translate_file", "translate_source"]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


class TranslationError(Exception):
    """A construct outside the simulator's MSL subset (message: 'file:line: ...')."""


# Kernel parameter attributes -> tree_attn::sim::detail::Attr.
POSITION_ATTRIBUTES = {
    "threadgroup_position_in_grid",
    "thread_position_in_threadgroup",
    "thread_index_in_threadgroup",
    "threads_per_threadgroup",
    "threadgroups_per_grid",
    "thread_position_in_grid",
    "threads_per_grid",
    "simdgroup_index_in_threadgroup",
    "thread_index_in_simdgroup",
    "threads_per_simdgroup",
    "simdgroups_per_threadgroup",
}
# Standard C++ attributes that mean the same in MSL and C++.
CXX_ATTRIBUTES = {"maybe_unused", "likely", "unlikely", "nodiscard", "fallthrough"}

# Identifiers whose presence means the source uses something the simulator does not model.
REJECTED_IDENTIFIERS = {
    "double": "double is not an MSL type",
    "imageblock": "imageblocks are not supported",
    "sampler": "textures and samplers are not supported",
    "visible_function_table": "function tables are not supported",
}
REJECTED_PREFIXES = {
    "atomic": "atomics are not supported (the kernels must be deterministic without them)",
    "memory_order": "atomics are not supported (the kernels must be deterministic without them)",
    "texture": "textures are not supported",
    "quad_": "quad-group functions are not supported",
    "packed_": "packed vector types are not supported",
}

ADDRESS_SPACES = {"device", "constant", "threadgroup", "thread"}
TYPE_KEYWORDS = {"const", "volatile", "unsigned", "signed", "long", "short", "int", "char", "struct", "typename"}

_PP_NUMBER = re.compile(r"\.?[0-9](?:[eEpP][+-]|[0-9A-Za-z_.])*")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")
_PUNCT = sorted(
    "<<= >>= ... -> ++ -- << >> <= >= == != && || += -= *= /= %= &= |= ^= :: ## "
    "{ } [ ] ( ) ; : , . ? ~ ! + - * / % ^ & | = < > #".split(),
    key=len,
    reverse=True,
)


@dataclass
class Token:
    kind: str  # id, num, str, punct, pp (a whole directive line), attr ([[...]], text = inside)
    text: str
    line: int
    pre: str = ""  # whitespace and comments before the token, kept verbatim
    out: str | None = None  # replacement text (None: the token itself)
    expanded: bool = False  # a #define the translator expands itself (instantiation macros)

    def emit(self) -> str:
        return self.pre + (self.text if self.out is None else self.out)


@dataclass
class Param:
    msl_type: str  # the type as written in MSL (for messages)
    type_tokens: tuple[int, int]  # token index range of the type
    name: str
    attribute: str | None  # e.g. "buffer(0)"
    line: int


@dataclass
class KernelSignature:
    function: str  # C++ callee, e.g. "attend<half, 128>"
    host_name: str
    params: list[Param]
    line: int
    max_threads: int = 0


@dataclass
class FunctionAttributes:
    is_kernel: bool = False
    host_name: str | None = None
    max_threads: int = 0


class Translator:
    def __init__(self, text: str, filename: str, source_dir: str | None = None):
        self.filename = filename
        self.text = text
        self.source_dir = source_dir  # where `#include "x.h"` looks for table macros (None: nowhere)
        self.tokens: list[Token] = []
        self.trailing = ""  # whitespace and comments after the last token
        self.kernels: list[KernelSignature] = []
        self.instantiations: list[tuple[int, int]] = []  # token ranges, removed from the output
        self.kernel_templates: dict[str, tuple[list[Param], int]] = {}  # name -> (params, max threads)
        self.tg_sites = 0
        self.consumed_attrs: set[int] = set()
        self.function_constants: list[tuple[str, str, int]] = []  # (name, type, index), slot = position

    # ------------------------------------------------------------------ errors / helpers
    def error(self, line: int, message: str):
        raise TranslationError(f"{self.filename}:{line}: error: {message}")

    def tok(self, i: int) -> Token | None:
        return self.tokens[i] if 0 <= i < len(self.tokens) else None

    def is_(self, i: int, text: str) -> bool:
        t = self.tok(i)
        return t is not None and t.kind != "str" and t.text == text and t.kind != "pp"

    def blank(self, i: int):
        self.tokens[i].out = ""

    def match_close(self, i: int) -> int:
        """Index of the bracket closing the one at i ((, [, {, <-as-template handled elsewhere)."""
        pairs = {"(": ")", "[": "]", "{": "}"}
        opening = self.tokens[i].text
        closing = pairs[opening]
        depth = 0
        for j in range(i, len(self.tokens)):
            t = self.tokens[j]
            if t.kind != "punct":
                continue
            if t.text == opening:
                depth += 1
            elif t.text == closing:
                depth -= 1
                if depth == 0:
                    return j
        self.error(self.tokens[i].line, f"unbalanced '{opening}'")

    def match_angle(self, i: int) -> int:
        """Index of the '>' closing the template argument list opened at i."""
        depth = 0
        paren = 0
        for j in range(i, len(self.tokens)):
            t = self.tokens[j]
            if t.kind != "punct":
                continue
            if t.text in "([{":
                paren += 1
            elif t.text in ")]}":
                paren -= 1
                if paren < 0:
                    break
            elif paren == 0 and t.text == "<":
                depth += 1
            elif paren == 0 and t.text in (">", ">>"):
                depth -= len(t.text)
                if depth <= 0:
                    if depth < 0:
                        self.error(t.line, "'>>' closing two template argument lists: write '> >'")
                    return j
            elif paren == 0 and t.text in (";", "{"):
                break
        self.error(self.tokens[i].line, "unbalanced '<' in a template argument list")

    def source_text(self, a: int, b: int, translated: bool = False) -> str:
        """Tokens [a, b) as text on one line (translated: with their replacements)."""
        out = ""
        for t in self.tokens[a:b]:
            s = t.text if not translated or t.out is None else t.out
            if not s:
                continue
            if out and (out[-1].isalnum() or out[-1] in "_>*&") and (s[0].isalnum() or s[0] in "_:"):
                out += " "
            elif out.endswith(","):
                out += " "
            out += s
        return out

    # ------------------------------------------------------------------ tokenizer
    def tokenize(self):
        text, n, i, line = self.text, len(self.text), 0, 1
        pre_start = 0
        at_line_start = True
        while i < n:
            c = text[i]
            if c == "\n":
                line += 1
                i += 1
                at_line_start = True
                continue
            if c in " \t\r\f\v":
                i += 1
                continue
            if text.startswith("\\\n", i):  # a line splice (inside a multi-line #define)
                line += 1
                i += 2
                continue
            if text.startswith("//", i):
                j = text.find("\n", i)
                i = n if j < 0 else j
                continue
            if text.startswith("/*", i):
                j = text.find("*/", i + 2)
                if j < 0:
                    self.error(line, "unterminated comment")
                line += text.count("\n", i, j + 2)
                i = j + 2
                continue
            pre = text[pre_start:i]
            start_line = line
            if c == "#" and at_line_start:
                j = i
                while True:
                    k = text.find("\n", j)
                    if k < 0:
                        k = n
                        break
                    if text[k - 1] == "\\":
                        j = k + 1
                        continue
                    break
                directive = text[i:k]
                line += directive.count("\n")
                self.tokens.append(Token("pp", directive, start_line, pre))
                i = k
                pre_start = i
                continue
            at_line_start = False
            if text.startswith("[[", i):
                depth, j = 0, i
                while j < n:
                    if text[j] == "[":
                        depth += 1
                    elif text[j] == "]":
                        depth -= 1
                        if depth == 0:
                            break
                    j += 1
                if j >= n or text[j - 1] != "]":
                    self.error(line, "unterminated attribute '[['")
                inner = text[i + 2 : j - 1]
                line += inner.count("\n")
                self.tokens.append(Token("attr", " ".join(inner.split()), start_line, pre))
                i = j + 1
                pre_start = i
                continue
            m = _IDENT.match(text, i)
            if m and not (c.isdigit()):
                # u8"..", L'..' prefixes do not occur in MSL; an identifier is an identifier.
                self.tokens.append(Token("id", m.group(), start_line, pre))
                i = m.end()
                pre_start = i
                continue
            m = _PP_NUMBER.match(text, i)
            if m:
                self.tokens.append(Token("num", m.group(), start_line, pre))
                i = m.end()
                pre_start = i
                continue
            if c in "\"'":
                j = i + 1
                while j < n and text[j] != c:
                    if text[j] == "\\":
                        j += 1
                    if j < n and text[j] == "\n":
                        self.error(line, "newline in a literal")
                    j += 1
                self.tokens.append(Token("str", text[i : j + 1], start_line, pre))
                i = j + 1
                pre_start = i
                continue
            for p in _PUNCT:
                if text.startswith(p, i):
                    self.tokens.append(Token("punct", p, start_line, pre))
                    i += len(p)
                    pre_start = i
                    break
            else:
                self.error(line, f"unexpected character {c!r}")
        self.trailing = text[pre_start:]

    # ------------------------------------------------------------------ passes
    def check_identifiers_and_literals(self):
        for t in self.tokens:
            if t.kind == "id":
                if t.text in REJECTED_IDENTIFIERS:
                    self.error(t.line, f"'{t.text}': {REJECTED_IDENTIFIERS[t.text]}")
                for prefix, why in REJECTED_PREFIXES.items():
                    if t.text.startswith(prefix):
                        self.error(t.line, f"'{t.text}': {why}")
            elif t.kind == "num":
                t.out = self.translate_number(t)

    def translate_number(self, t: Token) -> str | None:
        s = t.text
        low = s.lower()
        if low.startswith("0x"):
            if "." in s or "p" in low:
                self.error(t.line, f"hexadecimal floating literal {s} is not supported")
            return None  # integers keep their spelling and suffixes
        is_float = "." in s or "e" in low
        for suffix, ctor in (("bf", "::metal::bfloat"), ("h", "::metal::half")):
            if low.endswith(suffix):
                body = s[: -len(suffix)]
                if not re.fullmatch(r"(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", body):
                    self.error(t.line, f"malformed literal {s}")
                return f"{ctor}({body}{'' if ('.' in body or 'e' in body.lower()) else '.0'}f)"
        if is_float:
            if low.endswith("f"):
                return None
            if low.endswith("l"):
                self.error(t.line, f"long double literal {s} is not MSL")
            if not re.fullmatch(r"(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", s):
                self.error(t.line, f"malformed literal {s}")
            return s + "f"  # MSL has no double: an unsuffixed floating literal is a float
        return None

    def preprocess_directives(self):
        for t in self.tokens:
            if t.kind != "pp":
                continue
            body = t.text[1:].strip()
            m = re.match(r"(\w+)\s*(.*)", body, re.S)
            if not m:
                continue
            name, rest = m.group(1), m.group(2).strip()
            if name == "include":
                if rest in ("<metal_stdlib>", "<metal_simdgroup_matrix>"):
                    t.out = f"// #include {rest}: provided by sim/msl.h"
                elif rest.startswith("<"):
                    self.error(t.line, f"#include {rest}: only <metal_stdlib> is supported (and project headers in quotes)")
                elif rest.startswith('"'):
                    # Project headers are shared with the host C++: include them at global scope,
                    # where they are (outside the translation's namespace), then resynchronise
                    # the line numbers.
                    t.out = (f"}}  // namespace: {rest} is C++ shared with the host\n#include {rest}\n"
                             f'namespace {{\n#line {t.line + 1} "{self.filename}"')
                else:
                    self.error(t.line, f"unsupported #include {rest}")
            elif name == "pragma":
                # Loop-unrolling hints mean nothing on the CPU; anything else would be a guess.
                if re.match(r"(unroll|nounroll|clang\s+loop)\b", rest):
                    t.out = "// " + t.text
                else:
                    self.error(t.line, f"unsupported #pragma {rest}")
            elif name == "define" and not t.expanded:
                t.out = self.translate_define(t)

    # ------------------------------------------------------------------ instantiation macros
    def _placed(self, expansion, invocation, i, end):
        """An instantiation macro's expansion, standing where its invocation (tokens i..end)
        stood: on the invocation's line, with the invocation's newlines kept (line splices,
        multi-line argument lists) so later lines keep their numbers."""
        for k, tok in enumerate(expansion):
            tok.line = invocation.line
            tok.pre = invocation.pre if k == 0 else " "
        newlines = sum(tok.pre.count("\n") for tok in self.tokens[i + 1:end + 1])
        if expansion:
            expansion[-1].pre += "\n" * newlines
        return expansion

    def expand_instantiation_macros(self):
        """Expand the function-like macros that generate kernel instantiations.

        A function-like macro whose body holds an attribute, or invokes such a macro, is an
        instantiation macro: the translator must read the attributes it produces, so it
        expands its invocations itself (C preprocessor rules for `#`, `##`, adjacent string
        literals inside attributes, rescanning) and drops its #define. Its invocations must
        stand at file scope. Other macros are left to the C++ preprocessor.

        Kernel tables: the function-like macros of a project header included with
        `#include "x.h"` (found next to the source) are table macros. An invocation of one
        at file scope with an instantiation macro among its arguments (an X-macro table,
        `TABLE(INSTANTIATE)`) is expanded here too, with every table and instantiation macro
        expanded on rescanning; the header itself stays a C++ include, so host code can
        expand the same table into the list of kernel names.
        """
        macros: dict[str, tuple[list[str], list[Token]]] = {}
        tables: dict[str, tuple[list[str], list[Token]]] = {}
        out: list[Token] = []
        depth = 0
        i = 0
        while i < len(self.tokens):
            t = self.tokens[i]
            if t.kind == "pp":
                inc = re.match(r'#\s*include\s+"([^"]+)"', t.text)
                if inc and self.source_dir is not None:
                    tables.update(self.header_macros(os.path.join(self.source_dir, inc.group(1)), t.line))
                m = re.match(r"#\s*define\s+([A-Za-z_]\w*)\(([^)]*)\)(.*)", t.text, re.S)
                if m:
                    body = Translator(m.group(3), self.filename)
                    body.tokenize()
                    for tok in body.tokens:
                        tok.line = t.line
                    if any(tok.kind == "attr" or (tok.kind == "id" and tok.text in macros) for tok in body.tokens):
                        params = [p.strip() for p in m.group(2).split(",") if p.strip()]
                        if "..." in params:
                            self.error(t.line, "variadic instantiation macros are not supported")
                        macros[m.group(1)] = (params, body.tokens)
                        t.out = f"// #define {m.group(1)}(...): expanded by msl2cpp.py" + "\n" * t.text.count("\n")
                        t.expanded = True
                out.append(t)
                i += 1
                continue
            if t.kind == "punct" and t.text == "{":
                depth += 1
            elif t.kind == "punct" and t.text == "}":
                depth -= 1
            if (t.kind == "id" and t.text in tables and t.text not in macros and depth == 0 and
                    self.is_(i + 1, "(")):
                args, end = self.macro_args(self.tokens, i + 1, t)
                if any(len(a) == 1 and a[0].kind == "id" and a[0].text in macros for a in args):
                    expansion = self.expand_macro({**tables, **macros}, t.text, args, t.line, set())
                    out.extend(self._placed(expansion, t, i, end))
                    i = end + 1
                    continue
            if t.kind == "id" and t.text in macros:
                if depth != 0:
                    self.error(t.line, f"instantiation macro '{t.text}' used inside a function or struct")
                args, end = self.macro_args(self.tokens, i + 1, t)
                expansion = self.expand_macro(macros, t.text, args, t.line, set())
                out.extend(self._placed(expansion, t, i, end))
                i = end + 1
                continue
            out.append(t)
            i += 1
        self.tokens = out

    def header_macros(self, path: str, line: int) -> dict[str, tuple[list[str], list[Token]]]:
        """The function-like macros #defined in a project header (none if it is not there:
        the C++ compiler reports a missing include)."""
        if not os.path.isfile(path):
            return {}
        with open(path, encoding="utf-8") as f:
            header = Translator(f.read(), self.filename)
        header.tokenize()
        found = {}
        for t in header.tokens:
            m = re.match(r"#\s*define\s+([A-Za-z_]\w*)\(([^)]*)\)(.*)", t.text, re.S) if t.kind == "pp" else None
            if m:
                params = [p.strip() for p in m.group(2).split(",") if p.strip()]
                if "..." in params:
                    continue
                body = Translator(m.group(3), self.filename)
                body.tokenize()
                for tok in body.tokens:
                    tok.line = line
                found[m.group(1)] = (params, body.tokens)
        return found

    def macro_args(self, tokens: list[Token], i: int, name: Token) -> tuple[list[list[Token]], int]:
        """Arguments of the invocation whose '(' is tokens[i]; returns them and the ')' index."""
        if i >= len(tokens) or tokens[i].kind != "punct" or tokens[i].text != "(":
            self.error(name.line, f"instantiation macro '{name.text}' used without arguments")
        args: list[list[Token]] = [[]]
        depth = 0
        for j in range(i, len(tokens)):
            t = tokens[j]
            if t.kind == "punct" and t.text == "(":
                depth += 1
                if depth == 1:
                    continue
            elif t.kind == "punct" and t.text == ")":
                depth -= 1
                if depth == 0:
                    return ([] if args == [[]] else args), j
            elif t.kind == "punct" and t.text == "," and depth == 1:
                args.append([])
                continue
            args[-1].append(t)
        self.error(name.line, f"unbalanced '(' in the invocation of '{name.text}'")

    @staticmethod
    def _copy(t: Token) -> Token:
        return Token(t.kind, t.text, t.line, t.pre)

    def expand_macro(self, macros, name: str, args: list[list[Token]], line: int, active: set[str]) -> list[Token]:
        params, body = macros[name]
        if len(args) != len(params):
            self.error(line, f"instantiation macro '{name}' takes {len(params)} arguments, got {len(args)}")
        values = dict(zip(params, args))

        def spelled(tokens: list[Token]) -> str:
            return " ".join(t.text if t.kind != "attr" else f"[[{t.text}]]" for t in tokens)

        result: list[Token] = []
        k = 0
        while k < len(body):
            t = body[k]
            if t.kind == "punct" and t.text == "#" and k + 1 < len(body) and body[k + 1].text in values:
                text = spelled(values[body[k + 1].text]).replace("\\", "\\\\").replace('"', '\\"')
                result.append(Token("str", f'"{text}"', line))
                k += 2
                continue
            if t.kind == "punct" and t.text == "##":
                if not result or k + 1 >= len(body):
                    self.error(line, f"'##' at the edge of macro '{name}'")
                nxt = body[k + 1]
                right = values[nxt.text] if nxt.text in values else [nxt]
                left = result.pop()
                pasted = Translator(left.text + (right[0].text if right else ""), self.filename)
                pasted.tokenize()
                if len(pasted.tokens) != 1:
                    self.error(line, f"'##' in macro '{name}' does not form one token")
                result.append(Token(pasted.tokens[0].kind, pasted.tokens[0].text, line))
                result.extend(self._copy(x) for x in right[1:])
                k += 2
                continue
            if t.kind == "attr":
                result.append(Token("attr", self.expand_in_attribute(macros, name, values, t.text, line), line))
            elif t.kind == "id" and t.text in values:
                result.extend(self._copy(x) for x in values[t.text])
            else:
                result.append(self._copy(t))
            k += 1
        # Rescan for further instantiation macros (not the one being expanded).
        out: list[Token] = []
        k = 0
        while k < len(result):
            t = result[k]
            if t.kind == "id" and t.text in macros and t.text not in active | {name}:
                sub_args, end = self.macro_args(result, k + 1, t)
                out.extend(self.expand_macro(macros, t.text, sub_args, line, active | {name}))
                k = end + 1
                continue
            out.append(t)
            k += 1
        return out

    def expand_in_attribute(self, macros, name: str, values, text: str, line: int) -> str:
        """An attribute in a macro body: substitute its parameters (`#x` too), then join
        adjacent string literals, as the C preprocessor and compiler do."""
        inner = Translator(text, self.filename)
        inner.tokenize()
        fake = (list(values), inner.tokens)
        tokens = self.expand_macro({**macros, "\0attr": fake}, "\0attr", list(values.values()), line, {name})
        joined: list[str] = []
        for t in tokens:
            if t.kind == "str" and joined and joined[-1].startswith('"') and t.text.startswith('"'):
                joined[-1] = joined[-1][:-1] + t.text[1:]
            else:
                joined.append(t.text)
        return "".join(joined)

    def translate_define(self, t: Token) -> str:
        sub = Translator(t.text[1:].strip()[len("define"):], self.filename)
        sub.tokenize()
        for tok in sub.tokens:
            tok.line = t.line
        sub.check_identifiers_and_literals()
        for tok in sub.tokens:
            if tok.kind == "attr":
                self.error(t.line, "attributes inside #define are supported only in function-like "
                                   "instantiation macros, expanded at file scope")
        sub.rewrite_address_spaces(inside_define=True)
        return "#define" + "".join(tok.emit() for tok in sub.tokens) + sub.trailing

    # ------------------------------------------------------------------ function constants
    FUNCTION_CONSTANT_TYPES = ("bool", "char", "uchar", "short", "ushort", "int", "uint", "half", "float")

    def translate_function_constants(self):
        """`constant T name [[function_constant(i)]];` -> a metal::detail::function_constant<T>
        that reads the launch's value when used; a program-scope `constant T x = ...;` whose
        initializer uses one (or is_function_constant_defined) -> a function_constant_expr<T>,
        evaluated at each use (there is no value before a launch)."""
        depth = 0
        i = 0
        n = len(self.tokens)
        dependent = {"is_function_constant_defined"}
        while i < n:
            t = self.tokens[i]
            if t.kind == "punct" and t.text in ("{", "}"):
                depth += 1 if t.text == "{" else -1
            if not (t.kind == "id" and t.text == "constant"):
                i += 1
                continue
            end = i
            while end < n and not self.is_(end, ";") and not self.is_(end, "{"):
                end += 1
            attrs = [k for k in range(i, end) if self.tokens[k].kind == "attr"
                     and re.match(r"function_constant\b", self.tokens[k].text)]
            if attrs:
                self.declare_function_constant(i, end, attrs[0], depth)
                dependent.add(self.function_constants[-1][0])
                i = end + 1
                continue
            eq = next((k for k in range(i, end) if self.is_(k, "=")), None)
            # A declaration statement (not a parameter: no '(' before its '=').
            if depth == 0 and eq is not None and self.is_(end, ";") and not any(
                    self.is_(k, "(") for k in range(i, eq)) and any(
                    self.tokens[k].kind == "id" and self.tokens[k].text in dependent for k in range(eq + 1, end)):
                if any(self.is_(k, "*") or self.is_(k, "&") or self.is_(k, "[") for k in range(i + 1, eq)):
                    self.error(t.line, "a program-scope constant computed from function constants must be a scalar")
                name = self.tokens[eq - 1]
                ctype = self.source_text(i + 1, eq - 1, translated=True).replace("constexpr", "").strip()
                t.out = f"static const ::metal::detail::function_constant_expr<{ctype}>"
                for k in range(i + 1, eq - 1):
                    self.tokens[k].out = ""
                self.tokens[eq].out = f"{{+[]() -> {ctype} {{ return {ctype}("
                self.tokens[end].out = "); }};"
                dependent.add(name.text)
                i = end + 1
                continue
            i += 1

    def declare_function_constant(self, i: int, end: int, attr: int, depth: int):
        line = self.tokens[i].line
        a = self.tokens[attr]
        m = re.fullmatch(r"function_constant\(\s*(\d+)\s*\)", a.text)
        if not m:
            self.error(line, f"[[{a.text}]]: expected [[function_constant(index)]] with an integer index")
        if depth != 0:
            self.error(line, "function constants must be declared at program scope")
        if attr != end - 1 or not self.is_(end, ";") or self.tokens[attr - 1].kind != "id":
            self.error(line, "expected `constant T name [[function_constant(i)]];` (no initializer)")
        name = self.tokens[attr - 1].text
        ctype = self.source_text(i + 1, attr - 1)
        if ctype not in self.FUNCTION_CONSTANT_TYPES:
            self.error(line, f"function constant '{name}': type '{ctype}' is not supported (one of "
                             f"{', '.join(self.FUNCTION_CONSTANT_TYPES)})")
        index = int(m.group(1))
        for other, _, other_index in self.function_constants:
            if other_index == index:
                self.error(line, f"function constants '{other}' and '{name}' share [[function_constant({index})]]")
        slot = len(self.function_constants)
        self.function_constants.append((name, ctype, index))
        self.consumed_attrs.add(attr)
        self.replace_range(i, end, f'static constexpr ::metal::detail::function_constant<{ctype}> {name}{{{slot}, {index}, "{name}"}}')

    def function_constant_table(self) -> str:
        if not self.function_constants:
            return ""
        rows = ",\n    ".join(f'{{"{n}", {i}, ::metal::detail::function_constant_type<{t}>()}}'
                              for n, t, i in self.function_constants)
        return ("constexpr ::tree_attn::sim::detail::FunctionConstantInfo tree_attn_sim_function_constants[] = {\n    "
                + rows + "};\n\n")

    def walk_tokens(self, visit):
        """Calls visit(i, depth) on every token but braces, in order, depth its brace nesting
        (0 at file scope). visit returns the index to go on from (past what it consumed), or
        None to go on with the next token."""
        i, depth = 0, 0
        n = len(self.tokens)
        while i < n:
            t = self.tokens[i]
            if t.kind == "punct" and t.text == "{":
                depth += 1
            elif t.kind == "punct" and t.text == "}":
                depth -= 1
            else:
                resume = visit(i, depth)
                if resume is not None:
                    i = resume
                    continue
            i += 1

    def find_kernels(self):
        """Parse kernel definitions and explicit instantiations at file scope."""
        def visit(i, depth):
            t = self.tokens[i]
            if depth == 0 and t.kind == "id" and t.text == "template" and not self.is_(i + 1, "<"):
                return self.parse_explicit_instantiation(i)
            if depth == 0 and ((t.kind == "id" and t.text == "kernel") or (t.kind == "attr" and t.text == "kernel")):
                return self.parse_kernel_definition(i)
            return None

        self.walk_tokens(visit)

    def absorb_function_attribute(self, k: int, attrs: FunctionAttributes, context: str):
        """Record the function attribute at token k ([[kernel]], [[host_name]], ...) and blank it."""
        a = self.tokens[k]
        host = re.fullmatch(r'host_name\(\s*"([^"]+)"\s*\)', a.text)
        limit = re.fullmatch(r"max_total_threads_per_threadgroup\(\s*(\d+)\s*\)", a.text)
        if a.kind == "id" or a.text == "kernel":
            attrs.is_kernel = True
        elif host:
            attrs.host_name = host.group(1)
        elif limit:
            attrs.max_threads = int(limit.group(1))
        else:
            self.error(a.line, f"unsupported attribute [[{a.text}]] on {context}")
        self.consumed_attrs.add(k)
        self.blank(k)

    def parse_kernel_definition(self, i: int) -> int:
        start_line = self.tokens[i].line
        attrs = FunctionAttributes()
        # Attributes before `kernel` / [[kernel]] ...
        k = i - 1
        while k >= 0 and self.tokens[k].kind == "attr":
            self.absorb_function_attribute(k, attrs, "a kernel")
            k -= 1
        # ... and after it, up to `void name(`.
        j = i
        while self.tokens[j].kind == "attr" or self.is_(j, "kernel"):
            self.absorb_function_attribute(j, attrs, "a kernel")
            j += 1
        if not (self.is_(j, "void") and self.tokens[j + 1].kind == "id" and self.is_(j + 2, "(")):
            self.error(start_line, "a kernel must be declared as `kernel void name(...)`")
        name = self.tokens[j + 1].text
        close = self.match_close(j + 2)
        params = self.parse_params(j + 3, close, kernel=name)
        if not self.is_(close + 1, "{"):
            self.error(start_line, f"kernel '{name}': expected a body")
        body_end = self.match_close(close + 1)
        if not self.is_templated(i):
            self.kernels.append(KernelSignature(name, attrs.host_name or name, params, start_line, attrs.max_threads))
        elif attrs.host_name:
            self.error(start_line, f"kernel template '{name}': put [[host_name]] on each explicit instantiation")
        else:
            self.kernel_templates[name] = (params, attrs.max_threads)
        return body_end + 1

    def is_templated(self, i: int) -> bool:
        """Whether the declaration starting around index i is preceded by `template <...>`."""
        j = i - 1
        while j >= 0 and self.tokens[j].kind == "attr":
            j -= 1
        if j >= 0 and self.is_(j, ">"):
            depth = 0
            while j >= 0:
                t = self.tokens[j]
                if t.kind == "punct" and t.text == ">":
                    depth += 1
                elif t.kind == "punct" and t.text == "<":
                    depth -= 1
                    if depth == 0:
                        return self.is_(j - 1, "template")
                elif t.kind == "punct" and t.text in (";", "{", "}"):
                    return False
                j -= 1
        return False

    def parse_explicit_instantiation(self, i: int) -> int:
        start_line = self.tokens[i].line
        end = i
        while not self.is_(end, ";"):
            if end + 1 >= len(self.tokens):
                self.error(start_line, "explicit instantiation without ';'")
            end += 1
        if not any(self.tokens[k].kind == "attr" or self.is_(k, "kernel") for k in range(i + 1, end)):
            return i + 1  # an ordinary explicit instantiation: plain C++
        attrs = FunctionAttributes()
        j = i + 1
        while self.tokens[j].kind == "attr" or self.is_(j, "kernel"):
            self.absorb_function_attribute(j, attrs, "an explicit instantiation")
            j += 1
        if not attrs.is_kernel:
            self.error(start_line, "[[host_name]] on an instantiation that is not a kernel")
        if not attrs.host_name:
            self.error(start_line, "a kernel instantiation needs [[host_name(\"...\")]]")
        if not (self.is_(j, "void") and self.tokens[j + 1].kind == "id" and self.is_(j + 2, "<")):
            self.error(start_line, "expected `template [[host_name(\"n\")]] [[kernel]] void f<...>(...);`")
        close_angle = self.match_angle(j + 2)
        function = self.source_text(j + 1, close_angle + 1)
        if not self.is_(close_angle + 1, "("):
            self.error(start_line, "expected the parameter list of the instantiated kernel")
        close = self.match_close(close_angle + 1)
        params = self.parse_params(close_angle + 2, close, kernel=attrs.host_name)
        template = self.tokens[j + 1].text
        if template not in self.kernel_templates:
            self.error(start_line, f"'{attrs.host_name}' instantiates '{template}', which is not a kernel template "
                                   "defined above it")
        # The launcher binds arguments by the instantiation's attributes: they must be the
        # template's, parameter by parameter.
        template_params, template_max_threads = self.kernel_templates[template]
        declared = [(p.name, p.attribute) for p in template_params]
        instantiated = [(p.name, p.attribute) for p in params]
        if declared != instantiated:
            self.error(start_line, f"'{attrs.host_name}': the parameters (names and attributes) {instantiated} differ "
                                   f"from those of kernel template '{template}': {declared}")
        max_threads = attrs.max_threads or template_max_threads
        self.kernels.append(KernelSignature(function, attrs.host_name, params, start_line, max_threads))
        self.instantiations.append((i, end))
        return end + 1

    def parse_params(self, a: int, b: int, kernel: str) -> list[Param]:
        params: list[Param] = []
        if a == b or (b - a == 1 and self.is_(a, "void")):
            return params
        start = a
        depth = 0
        for k in range(a, b + 1):
            t = self.tokens[k]
            # Kernel parameters hold no expressions, so '<' and '>' only bracket template arguments.
            if k < b and t.kind == "punct" and t.text in ("(", "[", "{", "<"):
                depth += 1
            if k < b and t.kind == "punct" and t.text in (")", "]", "}", ">"):
                depth -= 1
            if k < b and t.kind == "punct" and t.text == ">>":
                depth -= 2
            if k == b or (depth == 0 and t.kind == "punct" and t.text == ","):
                params.append(self.parse_param(start, k, kernel))
                start = k + 1
        return params

    def parse_param(self, a: int, b: int, kernel: str) -> Param:
        attrs = [k for k in range(a, b) if self.tokens[k].kind == "attr"]
        line = self.tokens[a].line
        if not attrs:
            self.error(line, f"kernel '{kernel}': parameter '{self.source_text(a, b)}' needs an attribute "
                             "([[buffer(i)]], [[threadgroup(i)]] or a position attribute)")
        if len(attrs) > 1:
            self.error(line, f"kernel '{kernel}': one attribute per parameter is supported")
        k = attrs[0]
        if k != b - 1:
            self.error(line, f"kernel '{kernel}': the attribute must follow the parameter name")
        name_tok = self.tokens[k - 1]
        if name_tok.kind != "id":
            self.error(line, f"kernel '{kernel}': every parameter needs a name")
        attribute = self.tokens[k].text
        m = re.fullmatch(r"(buffer|threadgroup)\(\s*(\d+)\s*\)", attribute)
        if not m and attribute not in POSITION_ATTRIBUTES:
            self.error(line, f"kernel '{kernel}': unsupported parameter attribute [[{attribute}]]")
        self.blank(k)
        self.consumed_attrs.add(k)
        return Param(self.source_text(a, k - 1), (a, k - 1), name_tok.text, attribute, line)

    def rewrite_address_spaces(self, inside_define: bool = False):
        def visit(i, depth):
            t = self.tokens[i]
            if t.kind == "id" and t.text in ADDRESS_SPACES and t.out is None:
                return self.rewrite_address_space(i, depth, inside_define)
            return None

        self.walk_tokens(visit)

    def rewrite_address_space(self, i: int, depth: int, inside_define: bool) -> int:
        space = self.tokens[i].text
        line = self.tokens[i].line
        if space == "thread":
            self.blank(i)
            return i + 1
        # Leading cv-qualifiers (`const device T*`) qualify the pointee.
        first = i
        cv = []
        while first - 1 >= 0 and self.tokens[first - 1].kind == "id" and self.tokens[first - 1].text in ("const", "volatile"):
            first -= 1
            cv.append(self.tokens[first].text)
        # The type: keywords, one (qualified, possibly templated) name, trailing cv.
        j = i + 1
        type_start = j
        named = False
        while j < len(self.tokens):
            t = self.tokens[j]
            if t.kind == "id" and t.text in TYPE_KEYWORDS:
                # `unsigned int`, `long long`: builtin keywords name the type themselves.
                named |= t.text in ("unsigned", "signed", "long", "short", "int", "char")
                j += 1
                continue
            if t.kind == "id" and not named and t.text not in ADDRESS_SPACES:
                named = True
                j += 1
                while self.is_(j, "::") and self.tok(j + 1) is not None and self.tokens[j + 1].kind == "id":
                    j += 2
                if self.is_(j, "<"):
                    j = self.match_angle(j) + 1
                continue
            if self.is_(j, "::") and not named:
                j += 1
                continue
            break
        if not named and not any(self.tokens[k].text in TYPE_KEYWORDS - {"const", "volatile", "struct", "typename"} for k in range(type_start, j)):
            self.error(line, f"'{space}' must be followed by a type")
        type_text = " ".join(cv) + (" " if cv else "") + self.source_text(type_start, j, translated=True)
        nxt = self.tok(j)
        if nxt is not None and nxt.kind == "punct" and nxt.text in ("*", "&", "&&"):
            if nxt.text == "&&":
                self.error(line, f"rvalue references to the {space} address space are not supported")
            k = j + 1
            pointer_const = False
            while self.tok(k) is not None and self.tokens[k].kind == "id" and self.tokens[k].text in ("const", "restrict", "__restrict", "volatile"):
                pointer_const |= self.tokens[k].text == "const"
                k += 1
            if self.is_(k, "*") or self.is_(k, "&"):
                self.error(line, f"pointers to pointers in the {space} address space are not supported")
            if nxt.text == "*":
                cls = "::metal::threadgroup_ptr" if space == "threadgroup" else "::metal::device_ptr"
                pointee = type_text if space != "constant" or "const" in type_text.split() else "const " + type_text
                replacement = ("const " if pointer_const else "") + f"{cls}<{pointee}>"
            else:
                is_const = "const" in type_text.split()
                if space == "device" and not is_const:
                    self.error(line, "a non-const device reference is not supported (writes through it could not be "
                                     "checked): use a device pointer")
                if space in ("device", "constant"):
                    replacement = (type_text if is_const else "const " + type_text) + "&"
                else:
                    replacement = type_text + "&"
            # reinterpret_cast<device T*>(p) converts between checked pointer classes, which is
            # a static_cast (the classes' explicit converting constructors reinterpret).
            if first >= 2 and self.is_(first - 1, "<") and self.is_(first - 2, "reinterpret_cast"):
                self.tokens[first - 2].out = "static_cast"
            self.replace_range(first, k, replacement)
            return k
        # No pointer or reference: a variable in that address space.
        if space == "constant":
            # Program-scope constant: plain C++ const data (not device memory).
            self.tokens[i].out = "static const" if not self.is_(i + 1, "constexpr") else "static"
            return i + 1
        if space == "threadgroup":
            if inside_define:
                self.error(line, "threadgroup variables inside #define are not supported")
            if depth == 0:
                self.error(line, "threadgroup variables must be declared inside a kernel")
            return self.rewrite_threadgroup_variable(first, i, j, type_text, line)
        self.error(line, f"a variable in the {space} address space must be a pointer or a reference")

    def rewrite_threadgroup_variable(self, first: int, i: int, j: int, type_text: str, line: int) -> int:
        name_tok = self.tok(j)
        if name_tok is None or name_tok.kind != "id":
            self.error(line, "expected the name of a threadgroup variable")
        k = j + 1
        dims = []
        while self.is_(k, "["):
            close = self.match_close(k)
            if close == k + 1:
                self.error(line, f"threadgroup array '{name_tok.text}' needs an explicit size")
            dims.append(self.source_text(k + 1, close, translated=True))
            k = close + 1
        if not self.is_(k, ";"):
            self.error(line, f"threadgroup variable '{name_tok.text}': one variable per declaration, without an "
                             "initializer (threadgroup memory cannot be initialised in its declaration)")
        self.tg_sites += 1
        site = f"tree_attn_sim_tg_site_{self.tg_sites}"
        decl = f'static constexpr ::tree_attn::sim::detail::TgSite {site}{{"{name_tok.text}"}}; '
        if dims:
            args = ", ".join(f"size_t({d})" for d in dims)
            decl += f"auto {name_tok.text} = ::metal::detail::threadgroup_declare_array<{type_text}, {args}>(&{site})"
        else:
            decl += f"decltype(auto) {name_tok.text} = ::metal::detail::threadgroup_declare_scalar<{type_text}>(&{site})"
        self.replace_range(first, k, decl)
        return k

    def replace_range(self, a: int, b: int, text: str):
        self.tokens[a].out = text
        for k in range(a + 1, b):
            self.tokens[k].out = ""
            # Keep line structure: a removed token's newlines stay, its spaces go.
            self.tokens[k].pre = "\n" * self.tokens[k].pre.count("\n")

    def check_remaining_attributes(self):
        for k, t in enumerate(self.tokens):
            if t.kind != "attr" or k in self.consumed_attrs:
                continue
            name = re.match(r"[\w:]*", t.text).group()
            if name in CXX_ATTRIBUTES:
                t.out = f"[[{t.text}]]"
                continue
            if name in ("buffer", "threadgroup") or name in POSITION_ATTRIBUTES:
                self.error(t.line, f"[[{t.text}]] outside a kernel's parameter list")
            self.error(t.line, f"unsupported attribute [[{t.text}]]")

    def remove_instantiations(self):
        for start, end in self.instantiations:
            self.replace_range(start, end + 1, "/* kernel instantiation: see the launcher below */")

    # ------------------------------------------------------------------ output
    def launcher(self, index: int, k: KernelSignature) -> str:
        args, infos = [], []
        for p in k.params:
            ctype = self.source_text(p.type_tokens[0], p.type_tokens[1], translated=True)
            msl = p.msl_type.replace('"', "'")
            m = re.fullmatch(r"(buffer|threadgroup)\(\s*(\d+)\s*\)", p.attribute)
            if m:
                idx = int(m.group(2))
                args.append(f"::tree_attn::sim::detail::ArgTraits<{ctype}>::make(tta_thread, {idx})")
                infos.append(f'::tree_attn::sim::detail::resource_param<{ctype}, {str(m.group(1) == "threadgroup").lower()}>'
                             f'({idx}, "{p.name}", "{msl}")')
            else:
                args.append(f"::tree_attn::sim::detail::make_attribute<{ctype}>(tta_thread, "
                            f"::tree_attn::sim::detail::Attr::{p.attribute})")
                infos.append(f'::tree_attn::sim::detail::attribute_param("{p.name}", "{msl}")')
        resources = [p for p in k.params if p.attribute and "(" in p.attribute]
        seen = {}
        for p in resources:
            if p.attribute in seen:
                self.error(p.line, f"kernel '{k.host_name}': [[{p.attribute}]] used by both '{seen[p.attribute]}' and '{p.name}'")
            seen[p.attribute] = p.name
        fn = f"tree_attn_sim_launch_{index}"
        table = f"tree_attn_sim_params_{index}"
        joined_args = ",\n      ".join(args)
        lines = [f'#line {k.line} "{self.filename}"',
                 f"void {fn}(::tree_attn::sim::detail::ThreadCtx& tta_thread) {{",
                 f"  {k.function}(" + ("\n      " + joined_args if args else "") + ");",
                 "}"]
        if infos:
            lines.append(f"constexpr ::tree_attn::sim::detail::ParamInfo {table}[] = {{\n    " + ",\n    ".join(infos) + "};")
        lines.append(f"const ::tree_attn::sim::detail::KernelRegistrar tree_attn_sim_register_{index}{{"
                     f'::tree_attn::sim::detail::KernelEntry{{"{k.host_name}", &{fn}, '
                     f"{table if infos else 'nullptr'}, {len(infos)}, {k.max_threads}, \"{self.filename}\", "
                     + (f"tree_attn_sim_function_constants, {len(self.function_constants)}"
                        if self.function_constants else "nullptr, 0") + "}};")
        return "\n".join(lines)

    def translate(self) -> str:
        self.tokenize()
        self.expand_instantiation_macros()
        self.check_identifiers_and_literals()
        self.preprocess_directives()
        self.find_kernels()
        self.translate_function_constants()
        self.check_remaining_attributes()
        self.rewrite_address_spaces()
        names = [k.host_name for k in self.kernels]
        dups = {n for n in names if names.count(n) > 1}
        if dups:
            self.error(1, f"kernel name(s) defined twice: {', '.join(sorted(dups))}")
        # Launchers take their parameter types from the translated tokens: build them before
        # the instantiations are blanked out.
        launchers = self.function_constant_table() + "\n\n".join(self.launcher(i, k) for i, k in enumerate(self.kernels))
        self.remove_instantiations()
        body = "".join(t.emit() for t in self.tokens) + self.trailing
        header = [
            f"// Generated by tests/sim/csrc/msl2cpp.py from {self.filename}. Do not edit.",
            '#include "msl.h"',
            '#include "kernel_registry.h"',
            "",
            "namespace {",
            "using namespace ::metal;",
            "TREE_ATTN_SIM_USING_METAL",
            f'#line 1 "{self.filename}"',
        ]
        return "\n".join(header) + "\n" + body + "\n\n// ---- launchers and registry entries ----\n" + launchers + "\n}  // namespace\n"


def _display_name(filename: str) -> str:
    path = os.path.abspath(filename)
    if path.startswith(REPO_ROOT + os.sep):
        return os.path.relpath(path, REPO_ROOT)
    return filename


def translate_source(text: str, filename: str = "<msl>") -> str:
    """Translate MSL source text to C++ (raises TranslationError outside the subset)."""
    source_dir = os.path.dirname(os.path.abspath(filename)) if os.sep in filename else None
    return Translator(text, _display_name(filename) if os.sep in filename else filename, source_dir).translate()


def translate_file(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return translate_source(f.read(), path)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: msl2cpp.py INPUT.metal OUTPUT.cpp", file=sys.stderr)
        return 2
    try:
        out = translate_file(argv[1])
    except TranslationError as e:
        print(e, file=sys.stderr)
        return 1
    with open(argv[2], "w", encoding="utf-8") as f:
        f.write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
