"""Misuse as engineers write it: engines that do not meet TransferEngineLike, a generic
helper given two domains, the wrong branch of has_domain, an optional engine call
without narrowing. Not executed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic

from pointerdomain import AddressT, DeviceAlias, HostVA, PointerTable, has_domain
from pointerdomain.adapters import mooncake, nixl


class NoWrite:
    def register_memory(self, addr: int, length: int) -> int:
        return 0

    def unregister_memory(self, addr: int) -> int:
        return 0

    def transfer_sync_read(self, target: str, buffer: int, peer: int, length: int) -> int:
        return 0


class TypedAddresses(NoWrite):
    def transfer_sync_write(self, target: str, buffer: HostVA, peer: HostVA, length: int) -> int:
        return 0


class NoReturnCode(NoWrite):
    def transfer_sync_write(self, target: str, buffer: int, peer: int, length: int) -> None:
        return None


def engines(wrapper: mooncake.HostTransferEngine) -> None:
    mooncake.HostTransferEngine(NoWrite(), "127.0.0.1")  # type: ignore[arg-type]
    mooncake.HostTransferEngine(TypedAddresses(), "127.0.0.1")  # type: ignore[arg-type]
    mooncake.HostTransferEngine(NoReturnCode(), "127.0.0.1")  # type: ignore[arg-type]
    wrapper.engine.batch_transfer_sync_read("peer:1", [0], [0], [64])  # type: ignore[attr-defined]
    wrapper.engine.get_rpc_port()  # type: ignore[attr-defined]
    b: mooncake.BatchTransferEngineLike = wrapper.engine  # type: ignore[assignment]
    del b


@dataclass(frozen=True)
class Region(Generic[AddressT]):
    start: AddressT
    end: AddressT


def span(lo: AddressT, hi: AddressT) -> int:
    return hi - lo


def generic(va: HostVA, alias: DeviceAlias, t: PointerTable[HostVA]) -> None:
    Region(va, alias)  # type: ignore[type-var]
    span(t[0], alias)  # type: ignore[type-var]


def narrowing(t: PointerTable[HostVA] | PointerTable[DeviceAlias]) -> None:
    if has_domain(t, DeviceAlias):
        a: PointerTable[HostVA] = t  # type: ignore[assignment]
        del a
    else:
        b: PointerTable[DeviceAlias] = t  # type: ignore[assignment]
        del b
    if has_domain(t, HostVA):
        t.device.ordinal  # type: ignore[attr-defined]


class HalfNixlAgent:
    """Registration only: no transfer calls."""

    def register_memory(self, reg_list: list[tuple[int, int, int, str]], mem_type: str, backends: list[str]) -> int:
        return 1

    def deregister_memory(self, handle: int) -> None:
        return None


def nixl_agents(agent: nixl.HostNixlAgent) -> None:
    nixl.HostNixlAgent("a", agent=HalfNixlAgent())  # type: ignore[arg-type]
    nixl.HostNixlAgent("a", agent=object())  # type: ignore[arg-type]
    agent.agent.no_such_call()  # type: ignore[attr-defined]
