"""The C++/CUDA pass: rules PD101-PD104 on ``.cpp/.cc/.cu/.cuh/.h/.hpp`` sources.

No C++ parser is involved (libclang would need the project's build flags and headers):
comments and string literals are blanked position for position, then token-level
patterns find the sites. Each pattern is narrow on purpose, so a hit is a real integer
address, not a typed pointer cast:

* PD101 ``data_ptr<uintptr_t|intptr_t>()``, and ``data_ptr<int64_t|uint64_t>()`` bound to
  or read from a name that says it holds pointers (``*ptr*``, ``*addr*``): a tensor read
  as a table of integer addresses;
* PD102 ``reinterpret_cast<T**>(x.data_ptr())`` (a tensor read as a pointer table) or a
  cast of ``data_ptr()`` (also ``mutable_data_ptr()``, ``const_data_ptr()``) to an integer type (``reinterpret_cast<uintptr_t>``,
  ``(uint64_t)t.data_ptr()``). ``reinterpret_cast<uint8_t*>(t.data_ptr())`` is a typed
  pointer cast and is not reported;
* PD103 an address held in an integer declaration: ``uintptr_t x``, or
  ``uint64_t/int64_t/size_t/unsigned long long`` named ``*_ptr``/``*_addr``/...;
* PD104 ``reinterpret_cast<T*>(table[i])`` where ``table`` is an integer-pointer
  variable of the file or is named like one.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterator

from pointerdomain.audit.rules import RULES, Finding, source_lines
from pointerdomain.audit.suppressions import MARKER, Suppression, parse_comment

__all__ = ["CPP_SUFFIXES", "audit_cpp_source", "cpp_statement_spans", "cpp_suppressions", "strip_comments_and_strings"]

#: File name endings the pass reads by default.
CPP_SUFFIXES = (".cpp", ".cc", ".cxx", ".cu", ".cuh", ".h", ".hpp", ".hh")

_INT_T = r"(?:std::)?(?:u?int64_t|u?intptr_t|size_t|unsigned\s+long(?:\s+long)?|long\s+long)"
# `dst_addr`, `multicast_ptr`, `kv_ptrs`: the address word ends the name (`ptrs_needed`,
# `num_ptrs` are counts).
_ADDR_NAME_RE = re.compile(r"(?i)^(?!num_|n_)\w*(?:ptr|ptrs|addr|addrs|address|addresses|pointer|pointers)$")
# A table of addresses is named in the plural (`key_cache_ptrs`); `*_ptr` alone names any typed pointer.
_TABLE_NAME_RE = re.compile(r"(?i)^\w*(?:ptrs|addrs|pointers|addresses|ptr_table|addr_table)\w*$")
# Opaque handles held as integers are not memory addresses a kernel dereferences.
_HANDLE_NAME_RE = re.compile(r"(?i)(?:stream|handle|event|comm|fd\b|_fn\b|reqh|backend|mvh|_side\b|^side_|agent|"
                             r"\bh_|_h\b|key\b|_id\b|^id_)")

_DATA_PTR_INT = re.compile(r"\b(?:mutable_|const_)?data_ptr\s*<\s*(?:std::)?(?P<t>u?intptr_t|u?int64_t)\s*>\s*\(\s*\)")
_REINTERPRET = re.compile(r"\breinterpret_cast\s*<(?P<t>[^<>;]*(?:<[^<>;]*>[^<>;]*)?)>\s*\(")
# `data_ptr()` and ATen's `mutable_data_ptr()` / `const_data_ptr()`: the same address
_ANY_DATA_PTR = r"(?:mutable_|const_)?data_ptr"
_C_CAST_INT = re.compile(rf"\(\s*{_INT_T}\s*\)\s*\(?\s*[\w.\->]+?\s*(?:\.|->)\s*{_ANY_DATA_PTR}\s*(?:<[^>]*>)?\s*\(")
_INT_DECL = re.compile(
    rf"(?<![\w:<,(*&])(?:(?:const|static|volatile|constexpr|__device__|__host__|inline)\s+)*"
    rf"(?P<t>{_INT_T})\s+(?P<name>\w+)\s*(?=[;=,)\[{{])"
)
_INT_PTR_DECL = re.compile(
    rf"\b{_INT_T}\s*(?:const\s*)?(?:\*+\s*(?:const\s+|__restrict__\s+)?(?P<name>\w+)|\s+(?P<arr>\w+)\s*\[)"
    rf"|vector\s*<\s*{_INT_T}\s*>\s*&?\s*(?P<vec>\w+)"
)
# `void* ptrs[N]`, and `void** ptrs` / `T** ptrs` (parameters and members): arrays of typed pointers
_PTR_ARRAY_DECL = re.compile(r"\*\s*(?P<name>\w+)\s*\[|\*\s*(?:const\b\s*|__restrict__\b\s*)?\*\s*"
                             r"(?:const\b\s*|__restrict__\b\s*)?(?P<pp>\w+)\b"
                             r"|(?:array|vector)\s*<\s*[\w:]+(?:\s+const)?\s*\*+\s*(?:const\s*)?(?:,[^>]*)?>\s*&?\s*(?P<arr>\w+)")
_DEVICE_CODE = re.compile(r"__global__|__device__")
# `const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data_ptr())`: the ends of a range for an overlap check
_RANGE_NAME = re.compile(r"(?i)^(?:begin|end|start|stop|lo|hi|lower|upper|first|last)\w*$|\w*_(?:begin|end|start|lo|hi)$")
# a host statement that hands the pointer to device code: a CUDA/HIP runtime call, a launch, kernel params
_TO_DEVICE = re.compile(r"\b(?:cuda|hip)[A-Z]\w*\s*\(|\bcu[A-Z]\w*\s*\(|<<<|\bparams?\b|\bargs\.|ipc|peer")
_TABLE_INDEX = re.compile(r"\s*(?P<name>\w+)\s*\[")
_INT_TYPE_ONLY = re.compile(rf"^\s*(?:const\s+)?{_INT_T}\s*$")


def strip_comments_and_strings(text: str) -> tuple[str, list[tuple[int, str]]]:
    """``text`` with every comment and string/char literal replaced by spaces (newlines
    kept, so offsets, lines and columns are unchanged), and the comments found as
    ``(offset, text)``."""
    out = list(text)
    comments: list[tuple[int, str]] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        nxt = text[i + 1] if i + 1 < n else ""
        if c == "/" and nxt == "/":
            j = text.find("\n", i)
            # a backslash ending the line splices the next one into the comment (translation phase 2)
            while j > 0 and text[i:j].rstrip("\r").endswith("\\"):
                j = text.find("\n", j + 1)
            j = n if j < 0 else j
            comments.append((i, text[i:j]))
            for k in range(i, j):
                if out[k] != "\n":
                    out[k] = " "
            i = j
        elif c == "/" and nxt == "*":
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            comments.append((i, text[i:j]))
            for k in range(i, j):
                if out[k] != "\n":
                    out[k] = " "
            i = j
        elif c == "R" and nxt == '"' and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'R"([^(\s]{0,16})\(', text[i:])
            if m is None:
                i += 1
                continue
            end = text.find(")" + m.group(1) + '"', i)
            j = n if end < 0 else end + len(m.group(1)) + 2
            for k in range(i + 1, j):
                if out[k] != "\n":
                    out[k] = " "
            i = j
        elif c in "\"'":
            if c == "'" and i > 0 and text[i - 1].isalnum() and nxt.isalnum():
                i += 1  # C++14 digit separator (1'000'000)
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            for k in range(i + 1, j - 1):
                out[k] = " "
            i = j
        else:
            i += 1
    return "".join(out), comments


class _Lines:
    def __init__(self, text: str) -> None:
        self.starts = [0] + [m.end() for m in re.finditer("\n", text)]

    def pos(self, offset: int) -> tuple[int, int]:
        i = bisect.bisect_right(self.starts, offset) - 1
        return i + 1, offset - self.starts[i] + 1


def cpp_suppressions(text: str, comments: list[tuple[int, str]] | None = None) -> list[Suppression]:
    """Suppressions written in ``//`` or ``/* */`` comments."""
    if MARKER not in text:
        return []
    if comments is None:
        _, comments = strip_comments_and_strings(text)
    lines = _Lines(text)
    out = []
    for offset, body in comments:
        if MARKER not in body:
            continue
        line, col = lines.pos(offset)
        line_start = lines.starts[line - 1]
        standalone = not text[line_start:offset].strip()
        s = parse_comment(body, line, col, standalone)
        if s is not None:
            out.append(s)
    return out


def cpp_statement_spans(text: str) -> list[tuple[int, int]]:
    """(first line, last line) of each C++ statement written over several lines: from the
    first code after a ``;``, ``{`` or ``}`` to the next of them (lexical, like the rules:
    a ``for (;;)`` header counts as pieces; preprocessor lines are left out)."""
    code, _ = strip_comments_and_strings(text)
    lines = _Lines(code)
    spans: list[tuple[int, int]] = []
    start = 0
    for m in re.finditer(r"[;{}]|^[ \t]*#[^\n]*", code, re.M):
        first = re.search(r"\S", code[start: m.start() + 1])
        if first is not None and m.group().strip()[:1] != "#":  # a preprocessor line ends no statement
            a = lines.pos(start + first.start())[0]
            b = lines.pos(m.start())[0]
            if b > a:
                spans.append((a, b))
        start = m.end()
    return spans


def _balanced_arg(code: str, open_paren: int) -> str:
    """The text inside the parenthesis opened at ``open_paren`` (up to 2 KiB)."""
    depth = 0
    for j in range(open_paren, min(len(code), open_paren + 2048)):
        ch = code[j]
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return code[open_paren + 1: j]
    return code[open_paren + 1: open_paren + 2048]


def _device_blocks(code: str) -> list[tuple[int, int]]:
    """(open, close) offsets of the brace blocks of comment-free ``code`` whose header (the
    text since the previous ``;``, ``{`` or ``}``) names ``__global__``/``__device__``: the
    bodies of kernels, device functions and device lambdas. A site is device code when one
    of them encloses it; code after a kernel's closing brace is host code again."""
    out: list[tuple[int, int]] = []
    stack: list[tuple[int, bool]] = []
    last_stop = 0
    for m in re.finditer(r"[{};]", code):
        ch, i = m.group(), m.start()
        if ch == "{":
            header = code[last_stop:i]
            stack.append((i, _DEVICE_CODE.search(header) is not None))
        elif ch == "}" and stack:
            start, device = stack.pop()
            if device:
                out.append((start, i))
        last_stop = i + 1
    out.extend((start, len(code)) for start, device in stack if device)  # unbalanced: to the end
    return out


def _in_blocks(blocks: list[tuple[int, int]], offset: int) -> bool:
    return any(start < offset < end for start, end in blocks)


# where an integer address is only compared for identity, hashed or printed, never used as memory
_IDENTITY_AFTER = re.compile(r"\s*\)*\s*(?:==|!=)")
_IDENTITY_BEFORE = re.compile(r"(?:==|!=)\s*\(*\s*$")
_HASHED_BEFORE = re.compile(r"\bhash\s*<[^<>;]*>\s*(?:\{\s*\}|\(\s*\))\s*\(\s*(?:\(\s*[\w:\s]+\)\s*)?$")
_FORMAT_SINK = re.compile(r"\b(?:\w*printf|(?:std::)?(?:cout|cerr|clog)|\w*(?:stream|ss|os)\s*<<|(?:std::|fmt::)"
                          r"(?:format|print|to_string)|std::to_string|TORCH_WARN\w*|D?V?LOG\w*)\s*[(<]")


def _not_an_address_use(code: str, start: int, end: int) -> bool:
    """A cast of ``data_ptr()`` at ``code[start:end]`` that only compares two addresses for
    identity (``==``, ``!=``), hashes one (``std::hash<uintptr_t>{}(...)``) or prints one
    (``printf``, an iostream ``<<``, ``fmt::format``, a log macro)."""
    before = code[max(0, start - 120): start]
    if _IDENTITY_AFTER.match(code, end) or _IDENTITY_BEFORE.search(before) or _HASHED_BEFORE.search(before):
        return True
    stmt_start = max(code.rfind(ch, 0, start) for ch in ";{}") + 1
    return _FORMAT_SINK.search(code, stmt_start, start) is not None


def _sites(code: str) -> Iterator[tuple[int, str, str]]:
    """(offset, code, message) for each site in comment-free ``code``."""
    device_blocks: list[tuple[int, int]] | None = None
    int_tables = {m.group("name") or m.group("arr") or m.group("vec") for m in _INT_PTR_DECL.finditer(code)}
    pointer_arrays = {m.group("name") or m.group("pp") or m.group("arr")
                      for m in _PTR_ARRAY_DECL.finditer(code)} - int_tables
    for m in _DATA_PTR_INT.finditer(code):
        t = m.group("t")
        # `int64_t* key_ptrs = key_ptrs_t.data_ptr<int64_t>()`: the receiver and the bound name
        recv = re.search(r"(\w+)\s*(?:\.|->)\s*$", code[max(0, m.start() - 200): m.start()])
        stmt_start = max(code.rfind(ch, 0, m.start()) for ch in ";{}(,") + 1
        bound = re.search(r"(\w+)\s*=\s*$", code[stmt_start: recv.start() + max(0, m.start() - 200)]) if recv else None
        names = [x.group(1) for x in (recv, bound) if x is not None]
        if "intptr" in t or any(_TABLE_NAME_RE.match(x) for x in names):
            yield m.start(), "PD101", f"data_ptr<{t}>() reads a tensor as integer addresses"
    for m in _REINTERPRET.finditer(code):
        target = m.group("t").strip()
        arg = _balanced_arg(code, m.end() - 1)
        if re.search(rf"\b{_ANY_DATA_PTR}\s*(?:<[^>]*>)?\s*\(", arg):
            rest = code[m.end() - 1 + len(arg) + 2: m.end() + len(arg) + 40].lstrip()
            bound = re.search(r"(\w+)\s*=\s*$", code[max(0, m.start() - 80): m.start()])
            before = code[max(0, m.start() - 40): m.start()].rstrip()
            alignment = rest.startswith(("%", "|")) or (rest.startswith("&") and not rest.startswith("&&")) or (
                before.endswith("|") and not before.endswith("||")) or (
                bound is not None and (re.search(rf"\b{bound.group(1)}\s*(?:%|&(?!&))", code) is not None
                                       or _RANGE_NAME.match(bound.group(1)) is not None))
            if _INT_TYPE_ONLY.match(target) and _not_an_address_use(code, m.start(), m.end() + len(arg) + 1):
                continue
            if target.replace(" ", "").endswith("**") or (_INT_TYPE_ONLY.match(target) and not alignment):
                kind = "a pointer table" if target.replace(" ", "").endswith("**") else "an integer"
                yield m.start(), "PD102", f"reinterpret_cast<{target}> of data_ptr() reads it as {kind}"
            continue
        idx = _TABLE_INDEX.match(arg)
        table = idx.group("name") if idx else ""
        if idx and target.rstrip().endswith("*") and (table in int_tables or (
                _TABLE_NAME_RE.match(table) and table not in pointer_arrays)):
            if device_blocks is None:
                device_blocks = _device_blocks(code)
            if _in_blocks(device_blocks, m.start()):
                yield m.start(), "PD104", f"integer {table}[...] cast to {target} in device code: the table must " \
                    "hold device aliases"
            else:
                stmt = code[max(code.rfind(";", 0, m.start()), code.rfind("{", 0, m.start())) + 1:
                            code.find(";", m.start()) + 1]
                if _TO_DEVICE.search(stmt):
                    yield m.start(), "PD104", f"integer {table}[...] cast to {target} in host code and handed to " \
                        "the GPU runtime or a kernel's parameters: the table must hold device addresses"
                else:
                    yield m.start(), "PD104", f"integer {table}[...] cast to {target} in host code: a table read " \
                        "on the CPU must hold host VAs"
    for m in _C_CAST_INT.finditer(code):
        end = code.find(")", m.end()) + 1
        if end > 0 and _not_an_address_use(code, m.start(), end + (code[end:end + 1] == ")")):
            continue
        yield m.start(), "PD102", "C-style integer cast of data_ptr()"
    for m in _INT_DECL.finditer(code):
        t, name = m.group("t"), m.group("name")
        if ("intptr" in t or _ADDR_NAME_RE.match(name)) and not _HANDLE_NAME_RE.search(name):
            yield m.start("t"), "PD103", f"address held in integer `{' '.join(t.split())} {name}`"


def audit_cpp_source(path: str, text: str, enabled: frozenset[str]) -> list[Finding]:
    """Run the enabled PD1xx rules on C++/CUDA ``text`` (the content of ``path``).
    Suppressions are not applied here."""
    if not any(w in text for w in ("data_ptr", "intptr", "int64", "size_t", "long", "reinterpret_cast")):
        return []
    code, _ = strip_comments_and_strings(text)
    lines = _Lines(code)
    src_lines = source_lines(text)
    seen: set[tuple[int, str]] = set()
    out = []
    for offset, rule_code, message in _sites(code):
        if rule_code not in enabled or (offset, rule_code) in seen:
            continue
        seen.add((offset, rule_code))
        line, col = lines.pos(offset)
        snippet = src_lines[line - 1].strip() if 0 < line <= len(src_lines) else ""
        fix = RULES[rule_code].fix
        if rule_code == "PD104" and "host code:" in message:
            fix = ("a table read on the CPU holds host VAs: build it with host_ptr_table (PointerTable[HostVA]); "
                   "only a table read by kernels holds device aliases (make_kernel_ptr_table)")
        out.append(Finding(path, line, col, rule_code, message, fix, snippet))
    return sorted(out)
