"""Known static gaps: misuse the current annotations let through, each with the
runtime check that catches it (where there is one).

This file locks the gaps in. If an annotation in src/ is tightened so that one
of these lines becomes a static error, this file fails under mypy: move the
line into a fail_*.py file with its ``# type: ignore[code]`` and drop it here.
See docs/typing.md, "Known gaps" and "What static checking cannot catch".
"""

from __future__ import annotations

import json
from typing import Any

from _support import raises
from typing_extensions import assert_type

from pointerdomain import (
    Device,
    DeviceAlias,
    HostVA,
)
from pointerdomain.errors import DomainError

va = HostVA.unsafe_from_int(0x10_0000)
alias = DeviceAlias.unsafe_from_int(0x20_0000, Device("emulated", 0))

# (G1, "Address(...) is abstract only at runtime", is closed: its constructor, like
#  HostVA's and DeviceAlias's, takes a keyword that cannot be given, so a call is a
#  static error (fail_unsafe_wrap.py); at run time it still raises DomainError.)

# (G2, "a helper typed with the base Address mixes domains in `a - b` / `a < b`", is
#  closed: fail_typing_gaps.py. Generic helpers use AddressT.)

# G3. bool is an int: a flag added to an address type-checks.
with raises(DomainError, "only a byte count (int) can be added"):
    assert_type(va + True, HostVA)

# G4. typeshed's min / max / sorted take SupportsRichComparison (SupportsDunderLT[Any]):
#     the other operand is Any, so two domains given as separate arguments, or in a
#     tuple, type-check (a list of both is caught: its item type has no __lt__). The
#     comparison itself raises.
with raises(DomainError, "cannot order"):
    min(va, alias)
with raises(DomainError, "cannot order"):
    sorted((va, alias))

# G5. Any (json.loads, untyped libraries; mypy also types torch's tolist() as Any,
#     pyright strict reports it as Unknown) is accepted everywhere: the address
#     methods' own checks raise.
raw: Any = json.loads(str(alias.value))
with raises(DomainError, "cannot order HostVA against int"):
    ordered: bool = va < raw
with raises(DomainError, "an address is built from an int"):
    HostVA.unsafe_from_int(json.loads('"0x1000"'))

# G6. f-string format specs are not type-checked: an address has no __format__
#     (only .value does), so a spec raises.
with raises(TypeError, "unsupported format string"):
    assert_type(f"{va:#x}", str)
assert f"{va.value:#x}" == "0x100000"
