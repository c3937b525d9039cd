"""The audit's rule catalogue and its finding record.

Codes are stable: a code is never reused for another check, so baselines,
suppressions and CI filters keep their meaning across releases. ``PD0xx`` rules run
on Python sources (libcst, qualified names and scopes), ``PD1xx`` on C++/CUDA
sources, ``PD9xx`` report problems with the audit's own input (a suppression with no
reason, a file that does not parse).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

__all__ = ["OPT_IN", "RULES", "Finding", "Level", "Rule", "rule", "source_lines"]

_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")


def source_lines(text: str, keepends: bool = False) -> list[str]:
    """The lines of ``text`` as Python's tokenizer (and a C++ compiler) counts them: ended by
    ``\\n``, ``\\r\\n`` or ``\\r`` only. :meth:`str.splitlines` also breaks at a form feed,
    ``\\x0b``, ``\\x1c``-``\\x1e``, ``\\x85``, U+2028 and U+2029, which would shift every
    later line number."""
    lines = _LINE.findall(text)
    return lines if keepends else [line.rstrip("\r\n") for line in lines]

Level = Literal["error", "warning", "note"]


@dataclasses.dataclass(frozen=True)
class Rule:
    """One check: its stable ``code``, a short ``name`` (kebab-case, SARIF ``rule.name``),
    a one-line ``summary`` of what it finds, the ``fix`` it suggests and its SARIF ``level``."""

    code: str
    name: str
    summary: str
    fix: str
    level: Level = "error"


_RULE_LIST = (
    Rule("PD001", "raw-pointer-table",
         "pointer table built from data_ptr() ints (torch.tensor/as_tensor of addresses)",
         "pointerdomain.make_kernel_ptr_table(tensors, device) for a kernel table (device aliases), "
         "pointerdomain.host_ptr_table(tensors) for a host table (host VAs); `pointerdomain audit --fix` "
         "rewrites the comprehension form"),
    Rule("PD002", "data-ptr-arithmetic",
         "data_ptr() address used in arithmetic or collected into a list/dict/tuple/set",
         "keep addresses typed: HostVA(...).offset(n) / DeviceAlias offsets stay in their domain; build "
         "tables with make_kernel_ptr_table / host_ptr_table instead of lists of ints"),
    Rule("PD003", "host-registration-call",
         "raw host-memory registration (cudaHostRegister, cuMemHostRegister, hipHostRegister, "
         "transfer-engine register_memory/register_buffer)",
         "pointerdomain.register_host_tensor(t, device) or alloc_registered(...) (chunked, rolled back on "
         "failure, 712 handled); for transfer engines pass HostVA metadata (pointerdomain.adapters.mooncake."
         "HostTransferEngine.register_memory)"),
    Rule("PD004", "transfer-call-with-ints",
         "transfer-engine transfer or descriptor call fed raw integer addresses",
         "pass BufferInfo / HostVA metadata (pointerdomain.buffer_infos, adapters.mooncake.HostTransferEngine."
         "transfer_sync_*); for NIXL pass tensors, not (addr, len, dev) int tuples"),
    Rule("PD005", "triton-int-pointer-table",
         "@triton.jit kernel casts a loaded integer to a pointer (tl.load(...).to(tl.pointer_type(...)))",
         "Triton translates only tensors passed directly: pass the buffers as kernel arguments, or build the "
         "table with make_kernel_ptr_table so it holds device aliases (faults on ROCm otherwise, vLLM PR #49836)"),
    Rule("PD006", "c-void-p-to-gpu-runtime",
         "ctypes.c_void_p of an address passed to a CUDA/HIP entry point",
         "call through pointerdomain (register_host_tensor, resolve_alias) so the address carries its domain; "
         "a host VA where a device pointer is expected faults when the alias differs"),
    Rule("PD007", "kernel-op-without-pointer-table",
         "kernel op named in [tool.pointerdomain.audit] kernel_ops called without a PointerTable argument",
         "build the table with pointerdomain.make_kernel_ptr_table and pass it (or its as_uint64_tensor())"),
    Rule("PD008", "raw-address-to-call",
         "data_ptr()/addressof/.ctypes.data address passed as an int (or a ctypes pointer, or inside a tuple) "
         "to a native op, a collective or a peer, or returned as a ctypes pointer",
         "say the domain in the type: HostVA for host memory read by CPU code or engines, the device address "
         "(the tensor itself, or make_kernel_ptr_table) for device memory and kernels"),
    Rule("PD101", "cpp-data-ptr-as-integer",
         "C++/CUDA: data_ptr<uintptr_t/intptr_t/uint64_t>() reads a tensor as a table of integer addresses",
         "type the table as the pointers it holds and build it with make_kernel_ptr_table (device aliases)"),
    Rule("PD102", "cpp-reinterpret-cast-data-ptr",
         "C++/CUDA: reinterpret_cast or C-style integer cast of data_ptr()",
         "keep the pointer typed (static_cast<T*>(t.data_ptr())); never turn a host pointer into an integer "
         "a kernel will dereference"),
    Rule("PD103", "cpp-integer-address-field",
         "C++/CUDA: address held in an integer field/variable (uintptr_t x; uint64_t *_ptr/*_addr)",
         "hold a typed pointer, or document the domain (host VA vs device alias) in the type"),
    Rule("PD104", "cpp-int-table-to-pointer",
         "C++/CUDA: integer read from a table cast to a pointer (reinterpret_cast<T*>(table[i]))",
         "the table must hold device aliases (make_kernel_ptr_table); prefer passing typed pointers"),
    Rule("PD900", "suppression-without-reason",
         "`# pointerdomain: ignore[...]` with no reason (or no code)",
         "write why the site is safe after the bracket: `# pointerdomain: ignore[PD001] host-only table`"),
    Rule("PD901", "parse-error", "the file could not be parsed, so it was not audited",
         "fix the syntax, or exclude the file in [tool.pointerdomain.audit] exclude", "warning"),
)

#: All rules by code.
RULES: dict[str, Rule] = {r.code: r for r in _RULE_LIST}


#: Rules that run only when ``select`` names them in full: their findings are mostly an
#: engine's own descriptor fields and copies of vendor ABI structs (PD103 was 11 % right on
#: Mooncake/NIXL/vllm-ascend, docs/audit.md), worth a look when planning a migration, not a CI gate.
OPT_IN: frozenset[str] = frozenset({"PD103"})


def rule(code: str) -> Rule:
    """The rule for ``code``. Raises KeyError for an unknown code."""
    return RULES[code]


@dataclasses.dataclass(frozen=True, order=True)
class Finding:
    """One site. ``line`` and ``col`` are 1-based, ``col`` in Unicode code points (SARIF
    ``columnKind: unicodeCodePoints``); ``path`` is relative to the configuration root when
    the file is under it, else as given (POSIX separators). ``snippet`` is the
    stripped source line, the part of the baseline fingerprint that survives line moves."""

    path: str
    line: int
    col: int
    code: str
    message: str
    fix: str = ""
    snippet: str = ""
    end_line: int = 0
    end_col: int = 0

    @property
    def rule(self) -> Rule:
        return RULES[self.code]
