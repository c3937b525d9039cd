"""A backend profile whose device aliases have the top bit set (addresses >= 2**63), as
Intel XPU USM hands out: every path that carries an address (uint64 tables, the
``int64`` Triton view, ``BufferInfo`` / ``HostVA`` JSON, the C++ ``Address``) must keep
all 64 bits. Wraps the emulated backend: :meth:`TopBitAliases.alias` returns the inner
alias with bit 63 set, and a launch translates its tables back to the inner aliases for
the CPU kernel (in place, restored after the synchronous launch), so the bytes that
move are exactly those of the real mappings. Installed with
:func:`pointerdomain._platform.testing.install_backend`::

    with install_backend(TopBitAliases(backend_for(dev)), "emulated"):
        ...
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from pointerdomain._platform.base import Backend, LaunchArgs, LayerWords, StagingArgs
from pointerdomain._platform.delegating import DelegatingBackend
from pointerdomain._platform.graph_holds import emulated_capture
from pointerdomain.errors import InvalidArgumentError

if TYPE_CHECKING:
    from pointerdomain._C import KernelPlan
    from pointerdomain.devices import Device

__all__ = ["TOP_BIT", "TopBitAliases"]

#: Bit 63: set on every alias this profile hands out.
TOP_BIT = 1 << 63


class TopBitAliases(DelegatingBackend):
    """``inner`` (the emulated backend) with every device alias at ``inner's alias | 2**63``.

    Attributes:
        translated: table entries translated back for launches so far (a test can see
            that the kernel got top-bit addresses).
    """

    def __init__(self, inner: Backend) -> None:
        if not inner.host_readable:
            raise InvalidArgumentError(f"TopBitAliases needs a backend whose tables the CPU reads, got {inner.name}")
        super().__init__(inner, "top-bit")
        self._lock = threading.Lock()
        self.translated = 0

    def alias(self, va: int, device: Device) -> tuple[int, int]:
        status, alias = self.inner.alias(va, device)
        if status != 0 or alias & TOP_BIT:
            return status, alias
        return status, alias | TOP_BIT

    def alias_device(self, addr: int, nbytes: int) -> int:
        """The emulated device whose alias mapping holds the range (see the emulated backend)."""
        lookup = getattr(self.inner, "alias_device", None)
        return -1 if lookup is None else int(lookup(addr & ~TOP_BIT if addr & TOP_BIT else addr, nbytes))

    @contextmanager
    def _untagged(self, *tables: int) -> Iterator[None]:
        """The tables at these addresses (emulated device memory) with bit 63 cleared in
        each entry for the duration of the block, then restored."""
        arrays = []
        for table in tables:
            info = self.pointer_info(table)
            if info is not None:
                arrays.append((table, (info.start + info.size - table) // 8))
        with self._cleared(arrays):
            yield

    @contextmanager
    def _cleared(self, arrays: list[tuple[int, int]]) -> Iterator[None]:
        """``(address, count)`` arrays of ``uint64`` addresses with bit 63 cleared in each
        entry for the duration of the block, then restored."""
        saved: list[tuple[ctypes.Array[ctypes.c_uint64], list[int]]] = []
        with self._lock:
            try:
                for address, count in arrays:
                    entries = (ctypes.c_uint64 * count).from_address(address)
                    before = list(entries)
                    saved.append((entries, before))
                    for i, value in enumerate(before):
                        if value & TOP_BIT:
                            entries[i] = value & ~TOP_BIT
                            self.translated += 1
                yield
            finally:
                for entries, before in saved:
                    for i, value in enumerate(before):
                        entries[i] = value

    def _refuse_capture(self, args: LaunchArgs) -> None:
        # a replay runs the recorded launch later, with the tables tagged again: the CPU
        # kernel would read addresses with bit 63 set
        if emulated_capture(args.device) is not None:
            raise InvalidArgumentError(
                f"the top-bit profile does not capture graphs on {args.device}: a replay would hand the CPU kernel "
                "addresses with bit 63 set; nothing was recorded. Fix: capture without TopBitAliases installed")

    def launch(self, plan: KernelPlan, args: LaunchArgs) -> None:
        self._refuse_capture(args)
        with self._untagged(plan.src_table, plan.dst_table):
            self.inner.launch(plan, args)

    def copy_runs(self, dsts: int, srcs: int, sizes: int, count: int, device: Device, stream: int) -> None:
        # the copy engine takes the same addresses the kernels do: translated back alike
        with self._cleared([(dsts, count), (srcs, count)]):
            self.inner.copy_runs(dsts, srcs, sizes, count, device, stream)

    def staged(self, plan: KernelPlan, args: LaunchArgs, staging: StagingArgs) -> None:
        with self._untagged(plan.src_table, plan.dst_table):
            super().staged(plan, args, staging)

    def launch_layers(self, plan: KernelPlan, args: LaunchArgs, words: LayerWords, gen: int) -> int:
        self._refuse_capture(args)
        with self._untagged(plan.src_table, plan.dst_table):
            return super().launch_layers(plan, args, words, gen)
