"""A raw int becomes an address only through HostVA.unsafe_from_int /
DeviceAlias.unsafe_from_int: the plain constructors are static errors under mypy and
pyright (a keyword that cannot be given), also when the int is Any (tolist(),
json.loads) or was narrowed from an untyped value with isinstance. Not executed."""

from __future__ import annotations

import json
from typing import Any

import torch

from pointerdomain import Address, BufferInfo, Device, DeviceAlias, HostVA
from pointerdomain.adapters import mooncake, nixl


def rewrap(va: HostVA, alias: DeviceAlias, device: Device, t: torch.Tensor) -> None:
    HostVA(t.data_ptr())  # type: ignore[call-arg]
    HostVA(alias.value)  # type: ignore[call-arg]
    DeviceAlias(va.value, device)  # type: ignore[call-arg]
    DeviceAlias(t.data_ptr(), alias.device)  # type: ignore[call-arg]
    Address(0x1000)  # type: ignore[call-arg]
    HostVA(0x1000, use_unsafe_from_int=0x1000)  # type: ignore[arg-type]


def untyped(rows: torch.Tensor, text: str, device: Device, engine: mooncake.HostTransferEngine) -> None:
    # Any passes every parameter type, but not a missing keyword
    HostVA(rows.tolist()[0])  # type: ignore[call-arg]
    HostVA(json.loads(text))  # type: ignore[call-arg]
    DeviceAlias(rows.tolist()[0], device)  # type: ignore[call-arg]
    raw: Any = json.loads(text)
    if isinstance(raw, int):
        engine.register_memory(HostVA(raw), 64)  # type: ignore[call-arg]
    if isinstance(raw, object):
        engine.register_memory(raw, 64)  # type: ignore[call-overload]
        nixl.dram_desc(raw, 64)  # type: ignore[arg-type]
    BufferInfo(address=HostVA(raw), nbytes=64, item_bytes=64)  # type: ignore[call-arg]
    [DeviceAlias(v, device) for v in rows.tolist()]  # type: ignore[call-arg]


def unsafe_spelling(alias: DeviceAlias, va: HostVA, device: Device) -> None:
    HostVA.unsafe_from_int(alias)  # type: ignore[arg-type]
    HostVA.unsafe_from_int("0x1000")  # type: ignore[arg-type]
    HostVA.unsafe_from_int(0x1000, device)  # type: ignore[call-arg]
    DeviceAlias.unsafe_from_int(va, device)  # type: ignore[arg-type]
    DeviceAlias.unsafe_from_int(0x1000)  # type: ignore[call-arg]
    DeviceAlias.unsafe_from_int(0x1000, "cuda:0")  # type: ignore[arg-type]
    a: DeviceAlias = HostVA.unsafe_from_int(0x1000)  # type: ignore[assignment]
    del a
