"""The emulated backend: a CPU stand-in for a GPU whose device aliases differ
from host VAs (as on MI355X or WSL2).

Registered host memory gets a second virtual mapping of the same pages
(``src/kernels/emulation.cpp``), emulated device memory is anonymous memory
tagged with an ordinal, and launches run the CPU reference kernel. Each
emulated device has its own alias mapping of a registration (so one registration
has a different alias per device, and one device's alias is not mapped for
another), and a launch runs on the calling thread's current emulated device as a
kernel runs on the current GPU: it is refused unless the launch path has made the
tables' device current (``DeviceGuard.for_launch``). The mappings are not pinned; with ``POINTERDOMAIN_EMULATE_MEMLOCK=1`` registered
bytes are counted against RLIMIT_MEMLOCK as ``cudaHostRegister`` in an
unprivileged container counts them.

Profiles (``POINTERDOMAIN_EMULATED_PROFILE``, or the ``profile`` argument) emulate the
host-memory kinds of other platforms, so each kind is tested on CPU:

* ``distinct`` (default): the above; registration works, aliases differ from host VAs;
* ``coherent``: a GH200 / GB10-like part: the device reads pageable memory in place
  (``PageableMemoryAccess`` and ``...UsesHostPageTables`` are 1) and registration is
  refused with ``NotSupported`` (801); the device address of host memory is its VA
  (:meth:`EmulatedBackend.alias` answers it for any address the runtime's own
  pinned allocations do not cover);
* ``vmm-host``: host allocations are VMM handles (``cuMemCreate`` with a host NUMA
  location): :meth:`EmulatedBackend.vmm_allocation` reports them, registering over
  one is refused (status 1), as the driver refuses it, and their device address is the VA.
"""

from __future__ import annotations

import collections
import ctypes
import resource
import threading
import weakref
from typing import TYPE_CHECKING

import torch

from pointerdomain import _C, env
from pointerdomain._platform.base import DeviceAttributeName, LaunchArgs, LayerWords, RuntimeTraits, StagingArgs
from pointerdomain._platform.host_memory import NOT_SUPPORTED, VmmAllocation
from pointerdomain._platform.batch_copy import Submission, batch_allowed, plan_copy_runs
from pointerdomain._platform.graph_holds import EMULATED_CAPTURES, HeldGraph, emulated_capture
from pointerdomain._platform.pointer_query import PointerInfo, span_by_lookup
from pointerdomain._platform.status import MEMLOCK_EXCEEDED, OUT_OF_MEMORY
from pointerdomain._platform.runtimes import EMULATED_CURRENT
from pointerdomain.errors import InvalidArgumentError, RuntimeCallError

if TYPE_CHECKING:
    from pointerdomain.devices import Device

__all__ = ["PROFILES", "EmulatedBackend", "profile_from_env"]

#: The emulated platform profiles (see the module docstring).
PROFILES = ("distinct", "coherent", "vmm-host")


def profile_from_env() -> str:
    """``POINTERDOMAIN_EMULATED_PROFILE`` (unset: ``distinct``; another value warns and is ``distinct``)."""
    return env.choice(env.EMULATED_PROFILE, PROFILES, "distinct")

# What the emulation does: registration works (a second mapping), the alias is never the
# host VA, an unregistered VA is not "device-readable" (the CPU kernels read whatever
# address they get, but checked mode refuses it), no read-only registration flag, no PCI.
_ATTRIBUTES: dict[str, int | None] = {
    "CanUseHostPointerForRegisteredMem": 0,
    "PageableMemoryAccess": 0,
    "PageableMemoryAccessUsesHostPageTables": 0,
    "HostRegisterSupported": 1,
    "HostRegisterReadOnlySupported": 0,
}

_MESSAGES = {
    1: "invalid value",
    2: "out of memory or address space: the second (alias) mapping could not be made (mmap/memfd failed; "
    "check ulimit -v and free memory)",
    3: "the pages could not be mapped a second time: they share a page with memory registered separately "
    "(allocate with alloc_registered, or register page-aligned tensors)",
    MEMLOCK_EXCEEDED: "RLIMIT_MEMLOCK exceeded (POINTERDOMAIN_EMULATE_MEMLOCK=1 counts registered bytes)",
    NOT_SUPPORTED: "operation not supported (emulated coherent profile: host registration is refused; the device "
    "reads pageable memory in place)",
    712: "host memory already registered",
    713: "host memory not registered",
}


#: Copy submissions the emulated backend keeps (the latest; older ones drop off).
_RECORDED = 1 << 16

#: cudaErrorInvalidDevice: the status of emulated work for a device that is not current.
_WRONG_DEVICE = 101

#: cudaErrorNotReady: the status of an emulated stream wait whose flag nothing will set.
_WAIT_UNSATISFIED = 600


def _require_current(device: Device, what: str) -> None:
    """The emulated form of "a kernel runs on the current device": work for ``device``
    while another emulated device is current would use that device's mappings."""
    ordinal = EMULATED_CURRENT.ordinal
    if ordinal != device.ordinal:
        current = f"emulated:{ordinal}"
        raise RuntimeCallError(
            f"emulated {what}", _WRONG_DEVICE,
            f"work for {device} while {current} is the calling thread's current device: the launch path must "
            "make the tables' device current (DeviceGuard.for_launch), as the C++ guard does on CUDA",
        )


class EmulatedBackend(RuntimeTraits):
    """See the module docstring.

    Attributes:
        copy_submissions: each submission of :meth:`copy_runs` as the batched copy
            contract plans it (:mod:`.batch_copy`: descriptors, attributes, stream, batch
            call or per-run copies), the latest ``2**16``; the emulated device stands in
            for a runtime with the batch call, so the CPU suite checks the plan.
    """

    name = "emulated"
    runtime = "emulated"
    has_alias_op = True
    host_readable = True
    #: every stand-in capture opens and closes through EmulatedGraph.capture, which counts them
    graph_captures = EMULATED_CAPTURES

    def __init__(self, device_count: int, profile: str | None = None) -> None:
        self._device_count = device_count
        self._lock = threading.Lock()
        self._pinned: dict[int, int] = {}
        self.profile = profile_from_env() if profile is None else profile
        if self.profile not in PROFILES:
            raise InvalidArgumentError(f"profile: found {self.profile!r}, expected one of {PROFILES}. Fix: pass one "
                                       "of them (or set POINTERDOMAIN_EMULATED_PROFILE)")
        self._attributes = dict(_ATTRIBUTES)
        if self.profile == "coherent":
            self._attributes.update(PageableMemoryAccess=1, PageableMemoryAccessUsesHostPageTables=1,
                                    CanUseHostPointerForRegisteredMem=1)
        self._vmm: dict[int, tuple[int, int]] = {}  # vmm-host profile: base -> (nbytes, handle)
        self._handles = 0
        self.copy_submissions: collections.deque[Submission] = collections.deque(maxlen=_RECORDED)
        # the launch path asks it for every index tensor: the native call itself, no Python frame
        self.device_lookup = _C.emu_device_lookup  # type: ignore[method-assign]
        self.memory_generation = _C.emu_device_frees  # type: ignore[method-assign]

    def vmm_allocation(self, addr: int, device: Device) -> VmmAllocation | None:
        """The emulated VMM allocation holding ``addr`` (``vmm-host`` profile), or None."""
        with self._lock:
            for base, (nbytes, handle) in self._vmm.items():
                if base <= addr < base + nbytes:
                    return VmmAllocation(base, nbytes, "host_numa", 0, handle)
        return None

    def _forget_vmm(self, base: int) -> None:
        with self._lock:
            self._vmm.pop(base, None)

    def register(self, va: int, nbytes: int, device: Device) -> int:
        if self.profile == "coherent":
            return NOT_SUPPORTED
        if self.profile == "vmm-host" and any(
                b < va + nbytes and va < b + n for b, (n, _h) in list(self._vmm.items())):
            return 1  # the driver refuses to register VMM-mapped memory (invalid value)
        return self._register(va, nbytes)

    def _register(self, va: int, nbytes: int) -> int:
        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        limited = env.flag(env.EMULATE_MEMLOCK) and soft != resource.RLIM_INFINITY
        with self._lock:
            if limited and sum(self._pinned.values()) + nbytes > soft:
                return MEMLOCK_EXCEEDED
            status, _alias = _C.emu_register(va, nbytes)
            if status == 0:
                self._pinned[va] = nbytes
        return status

    def prepare(self, va: int, nbytes: int) -> int:
        """Back ``[va, va + nbytes)`` by one memfd before it is registered in chunks, so
        chunks sharing a page (a tensor starting mid-page) can each be mapped, as CUDA
        registers them: the runtime status (0 = ok, 3 = pages shared with another registration)."""
        with self._lock:
            return _C.emu_prepare(va, nbytes)

    def unregister(self, va: int, device: Device) -> int:
        with self._lock:
            status = _C.emu_unregister(va)
            if status == 0:
                self._pinned.pop(va, None)
        return status

    def pinned_bytes(self) -> int:
        """Bytes counted against RLIMIT_MEMLOCK (registered and not unregistered)."""
        with self._lock:
            return sum(self._pinned.values())

    def describe(self, code: int) -> str:
        return _MESSAGES.get(code, "unknown")

    def alias(self, va: int, device: Device) -> tuple[int, int]:
        status, alias = _C.emu_get_device_pointer_on(va, device.ordinal)
        if status != 0 and (self.profile == "coherent" or self.vmm_allocation(va, device) is not None):
            return 0, va  # the device reads this memory in place: its device address is the VA
        return status, alias

    def alias_device(self, addr: int, nbytes: int) -> int:
        """Ordinal of the emulated device whose alias mapping holds ``[addr, addr + nbytes)``,
        or -1 (a host VA, device memory, or nothing registered): which device an alias is for."""
        return _C.emu_alias_lookup(addr, max(nbytes, 1))

    def pointer_is_host(self, ptr: int) -> bool:
        return False  # no runtime pins memory behind pointerdomain's back here

    def device_lookup(self, addr: int, nbytes: int) -> int:
        return _C.emu_device_lookup(addr, nbytes)

    def memory_generation(self) -> int:
        """Emulated device allocations released so far (a native counter)."""
        return _C.emu_device_frees()

    def pointer_info(self, addr: int) -> PointerInfo | None:
        # Only device memory: no runtime pins host memory behind pointerdomain's back here.
        ordinal = _C.emu_device_lookup(addr, 1)
        if ordinal < 0:
            return None
        start, size = span_by_lookup(addr, lambda a, n: _C.emu_device_lookup(a, n) == ordinal)
        return PointerInfo("device", ordinal, start, size)

    def device_count(self) -> int:
        return self._device_count

    def can_use_host_pointer(self, device: Device) -> int | None:
        return self._attributes["CanUseHostPointerForRegisteredMem"]

    def device_attribute(self, name: DeviceAttributeName, device: Device) -> int | None:
        return self._attributes.get(name)

    def device_name(self, device: Device) -> str:
        what = {"distinct": "distinct alias mappings", "coherent": "coherent profile: reads pageable memory in place",
                "vmm-host": "vmm-host profile: host allocations are VMM handles"}[self.profile]
        return f"emulated device {device.ordinal} (CPU memory, {what})"

    def free_device_memory(self, device: Device) -> int | None:
        return None  # emulated device memory is host memory

    def host_alloc(self, nbytes: int) -> torch.Tensor:
        tensor = _C.emu_host_alloc(nbytes)
        if self.profile == "vmm-host":
            with self._lock:
                self._handles += 1
                self._vmm[tensor.data_ptr()] = (nbytes, self._handles)
            weakref.finalize(tensor, self._forget_vmm, tensor.data_ptr())  # the handle goes with the memory
        return tensor

    def shareable_host_alloc(self, nbytes: int) -> torch.Tensor:
        return self.host_alloc(nbytes)  # already a memfd, and the emulated registration needs its own

    def pinned_alloc(self, nbytes: int, device: Device) -> tuple[int, torch.Tensor | None]:
        """The emulated cudaHostAlloc: memfd memory registered (aliased) at once."""
        tensor = _C.emu_host_alloc(nbytes)
        status = self._register(tensor.data_ptr(), nbytes)  # the runtime's own allocation: every profile
        return (status, tensor) if status == 0 else (status, None)

    def pinned_release(self, va: int, device: Device) -> None:
        self.unregister(va, device)

    def device_alloc(self, nbytes: int, device: Device) -> torch.Tensor:
        return _C.emu_device_alloc(nbytes, device.ordinal)

    def current_stream(self, device: Device) -> int:
        return 0

    def is_capturing(self, device: Device) -> bool:
        """True while the calling thread captures ``device`` into an
        :class:`~pointerdomain._platform.graph_holds.EmulatedGraph` (the stand-in for
        stream capture: launches are recorded, not run)."""
        return emulated_capture(device) is not None

    def graph_hold(self, device: Device, stream: int) -> HeldGraph | None:
        graph = emulated_capture(device)
        return None if graph is None else graph.held

    def load_kernels(self, device: Device) -> None:
        return None  # the CPU kernels are in the extension already

    def launch(self, plan: _C.KernelPlan, args: LaunchArgs) -> None:
        src_idx, dst_idx, n, layer_begin, layer_count, device, _stream, _ctas = args
        _require_current(device, "transfer kernel launch")
        graph = emulated_capture(device)
        if graph is not None:  # captured: runs at each replay, with these addresses
            graph.record(plan, (src_idx, dst_idx, n, layer_begin, layer_count))
            return
        _C.cpu_transfer(plan, src_idx, dst_idx, n, layer_begin, layer_count, torch.get_num_threads())

    def launch_recorded(self, plan: _C.KernelPlan, args: LaunchArgs) -> int:
        # launch's body, not a call to it: every public launch takes this one (a frame less)
        src_idx, dst_idx, n, layer_begin, layer_count, device, _stream, _ctas = args
        _require_current(device, "transfer kernel launch")
        graph = emulated_capture(device)
        if graph is not None:  # captured: runs at each replay, with these addresses
            graph.record(plan, (src_idx, dst_idx, n, layer_begin, layer_count))
            return 0
        _C.cpu_transfer(plan, src_idx, dst_idx, n, layer_begin, layer_count, torch.get_num_threads())
        return 0  # synchronous: the copy is done when the call returns

    def record_event(self, device: Device, stream: int) -> int:
        return 0  # synchronous launches: nothing left to wait for

    def event_done(self, event: int) -> bool:
        return True

    def copy_runs(self, dsts: int, srcs: int, sizes: int, count: int, device: Device, stream: int) -> None:
        _require_current(device, "copy-engine runs")
        plan = plan_copy_runs(count, stream, batched=batch_allowed(self.runtime, True),
                              capturing=self.is_capturing(device))
        for sub in plan:  # each submission's slice of the three uint64 arrays
            skip = 8 * sub.first
            _C.cpu_copy_runs(dsts + skip, srcs + skip, sizes + skip, sub.count)
        self.copy_submissions.extend(plan)

    def staged_available(self) -> bool:
        return False  # no copy engine to stage through: staged() runs the kernel path

    def staged(self, plan: _C.KernelPlan, args: LaunchArgs, staging: StagingArgs) -> None:
        # The same bytes through the CPU kernel (emulated indices are host memory already).
        _C.cpu_transfer(plan, args.src_idx, args.dst_idx, args.n, args.layer_begin, args.layer_count,
                        torch.get_num_threads())

    # the layer pipeline (LayerSignals): the CPU kernel walks the layers and sets each
    # layer's flag after its bytes are written, in one native call; a stream wait is a
    # check that the flag is set (synchronous: a flag left unset would never be set, where
    # a GPU stream would wait forever).
    def layer_words(self, device: Device, capacity: int) -> LayerWords:
        memory = _C.emu_device_alloc(8 * capacity, device.ordinal)  # flags, then counters (unused here)
        base = memory.data_ptr()
        ctypes.memset(base, 0, 8 * capacity)
        return LayerWords(capacity, base, base, base + 4 * capacity, (memory,))

    def capturing(self, device: Device, stream: int) -> bool:
        return emulated_capture(device) is not None

    def launch_layers(self, plan: _C.KernelPlan, args: LaunchArgs, words: LayerWords, gen: int) -> int:
        src_idx, dst_idx, n, layer_begin, layer_count, device, _stream, _ctas = args
        _require_current(device, "layer pipeline launch")
        _C.cpu_transfer_layers(plan, src_idx, dst_idx, n, layer_begin, layer_count, words.flags, gen & 0xFFFFFFFF,
                               torch.get_num_threads())
        return 0  # synchronous: every layer is done

    def signal_layer(self, words: LayerWords, index: int, gen: int, device: Device, stream: int) -> None:
        ctypes.c_uint32.from_address(words.flags + 4 * index).value = gen & 0xFFFFFFFF

    def wait_layer(self, words: LayerWords, index: int, gen: int, device: Device, stream: int) -> None:
        flag = ctypes.c_uint32.from_address(words.flags + 4 * index).value
        if (flag - gen) & 0xFFFFFFFF >= 1 << 31:
            raise RuntimeCallError(
                "emulated stream wait on a layer flag", _WAIT_UNSATISFIED,
                f"flag {index} holds {flag}, not generation {gen} or later, and nothing queued will set it: a GPU "
                "stream would wait forever",
            )

    def layer_flag(self, words: LayerWords, index: int) -> int:
        return int(ctypes.c_uint32.from_address(words.host + 4 * index).value)

    def wait_event_done(self, event: int) -> None:
        return None  # synchronous: nothing in flight

    def synchronize(self, device: Device) -> None:
        return None
