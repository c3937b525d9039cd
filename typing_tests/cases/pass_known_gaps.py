"""Known static gaps: misuse the current annotations let through, each with the
runtime check that catches it (where there is one).

This file locks the gaps in. If an annotation in src/ is tightened so that one
of these lines becomes a static error, this file fails under mypy: move the
line into a fail_*.py file with its ``# type: ignore[code]`` and drop it here.
See docs/typing.md, "Known gaps".
"""

from __future__ import annotations

from _support import raises
from typing_extensions import assert_type

from pointerdomain import (
    Address,
    Device,
    DeviceAlias,
    HostVA,
)
from pointerdomain.errors import DomainError

va = HostVA(0x10_0000)
alias = DeviceAlias(0x20_0000, Device("emulated", 0))

# G1. Address is abstract only at runtime.
with raises(TypeError, "Address is abstract"):
    Address(0x1000)


# G2. Once an address is widened to Address (a plain class, so this is legal),
#     Self is Address and any other address is accepted by - and <.
def distance(a: Address, b: Address) -> int:
    return a - b


with raises(DomainError, "a distance is only defined inside one domain"):
    assert_type(distance(va, alias), int)

# G3. bool is an int: a flag added to an address type-checks.
with raises(DomainError, "only a byte count (int) can be added"):
    assert_type(va + True, HostVA)
