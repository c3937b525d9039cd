"""The CUDA backend (HIP builds share it: their differences stay in
``src/kernels/gpu_compat.h``), and the torch-cudart stand-in for builds
without the GPU ops (a CPU-only wheel on a GPU machine).

Device memory is torch's (the caching allocator); registered host memory is
``cudaHostRegister(portable | mapped)``; launches and copies are enqueued on the
stream given, asynchronously.
"""

from __future__ import annotations

import ctypes
import glob
import mmap
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from pointerdomain import _C
from pointerdomain._platform.base import DeviceAttributeName, LaunchArgs, LayerWords, RuntimeTraits, StagingArgs
from pointerdomain._platform.batch_copy import batch_allowed, plan_copy_runs
from pointerdomain._platform.cuda_hint import BUILD_HINT
from pointerdomain._platform.host_memory import VmmAllocation, pageable_access
from pointerdomain._platform.graph_holds import CudaGraphHolds, HeldGraph
from pointerdomain._platform.pointer_query import PointerInfo, cuda_pointer_info
from pointerdomain._platform.status import check, check_staged
from pointerdomain.errors import ExtensionUnavailableError, InvalidArgumentError, RuntimeCallError

if TYPE_CHECKING:
    from pointerdomain.devices import Device

__all__ = ["BUILD_HINT", "CudaBackend", "TorchCudartBackend", "install_vmm_query", "load_cudart"]

#: cudaDeviceAttr values (CUDA runtime's driver_types.h) for the torch-cudart stand-in,
#: which calls libcudart directly; the extension maps names itself (attributes_gpu.cu).
_CUDA_ATTRIBUTE_IDS = {
    "CanUseHostPointerForRegisteredMem": 91,
    "PageableMemoryAccess": 88,
    "PageableMemoryAccessUsesHostPageTables": 100,
    "HostRegisterSupported": 99,
    "HostRegisterReadOnlySupported": 113,
    "PciDomainId": 50,
    "PciBusId": 33,
    "PciDeviceId": 34,
}


_holds: list[CudaGraphHolds] = []
_holds_lock = threading.Lock()


def _graph_holds() -> CudaGraphHolds:
    with _holds_lock:
        if not _holds:
            _holds.append(CudaGraphHolds())
        return _holds[0]


def load_cudart() -> Any:
    """libcudart through ctypes: the copy torch ships (or its nvidia wheels), else the system's.

    Raises:
        OSError: no libcudart can be loaded.
    """
    roots = [os.path.dirname(torch.__file__), os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "nvidia")]
    for root in roots:
        for path in sorted(glob.glob(os.path.join(root, "**", "libcudart.so*"), recursive=True)):
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    return ctypes.CDLL("libcudart.so")


def runtime_report() -> dict[str, object]:
    """What the extension's own runtime (CUDA or HIP, the one its kernels use) sees; torch
    may be a CPU build that sees nothing. A runtime with no device (HIP: hipErrorNoDevice
    from hipGetDeviceCount) is reported as ``"no device"``, not as a failure."""
    status, count = _C.gpu_device_count()
    _, version = _C.gpu_runtime_version()
    if status != 0:
        devices = f"no device ({_C.gpu_error_string(status)}, code {status})"
        count = 0
    else:
        devices = f"{count} device(s)" if count else "no device"
    return {"gpu_runtime_version": version, "gpu_device_count": count, "gpu_devices": devices}


#: The driver's VMM query, (address, ordinal) -> allocation or None; installed by
#: :mod:`.cuda_driver` (which loads libcuda) when it is imported.
_vmm_query: Callable[[int, int], VmmAllocation | None] | None = None


def install_vmm_query(query: Callable[[int, int], VmmAllocation | None]) -> None:
    """Make ``query`` the CUDA backends' VMM query (:mod:`.cuda_driver` calls this)."""
    global _vmm_query
    _vmm_query = query


#: No duplicate check (an unchecked launch, or a single pair): no scratch.
_NO_MARKS: tuple[int, bool] = (0, False)

#: torch's current raw stream of a device, where torch has it (no Stream object: ~10x cheaper).
_raw_stream: Any = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class _TorchDevice(RuntimeTraits):
    """What both CUDA backends take from torch: device memory, streams, capture state."""

    host_readable = False

    def device_count(self) -> int:
        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0

    def device_lookup(self, addr: int, nbytes: int) -> int:
        return -1  # CUDA device memory is known by its tensor's device, not by address

    def pointer_info(self, addr: int) -> PointerInfo | None:
        if torch.version.hip is not None:
            return None  # the driver query below is CUDA's; HIP tables are checked by the registry alone
        return cuda_pointer_info(addr)

    def device_name(self, device: Device) -> str:
        return str(torch.cuda.get_device_name(device.ordinal))

    def vmm_allocation(self, addr: int, device: Device) -> VmmAllocation | None:
        """The VMM allocation (``cuMemCreate`` / ``cuMemMap``) at ``addr``, through the driver
        API (:mod:`.cuda_driver` installs the query); None for ordinary memory, on HIP, or
        where libcuda cannot be used."""
        if self.runtime != "cuda" or _vmm_query is None:
            return None  # HIP's VMM query is not wired: its memory registers as usual
        return _vmm_query(addr, device.ordinal)

    def free_device_memory(self, device: Device) -> int | None:
        free, _total = torch.cuda.mem_get_info(device.ordinal)
        return int(free)

    def host_alloc(self, nbytes: int) -> torch.Tensor:
        # Page-aligned start, so chunk cuts on a page-multiple granularity never split an
        # OS page between two cudaHostRegister calls.
        raw = torch.empty(nbytes + mmap.PAGESIZE, dtype=torch.uint8)
        skip = -raw.data_ptr() % mmap.PAGESIZE
        return raw[skip : skip + nbytes]

    def shareable_host_alloc(self, nbytes: int) -> torch.Tensor:
        return _C.strict_shared_alloc(nbytes)

    def device_alloc(self, nbytes: int, device: Device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device.torch_device)

    def current_stream(self, device: Device) -> int:
        if _raw_stream is not None:
            return int(_raw_stream(device.ordinal))
        return int(torch.cuda.current_stream(device.torch_device).cuda_stream)

    def is_capturing(self, device: Device) -> bool:
        if torch.cuda.current_device() == device.ordinal:
            return bool(torch.cuda.is_current_stream_capturing())
        with torch.cuda.device(device.ordinal):  # torch asks the current device's current stream
            return bool(torch.cuda.is_current_stream_capturing())

    def graph_hold(self, device: Device, stream: int) -> HeldGraph | None:
        """The graph ``stream`` is being captured into (:mod:`.graph_holds`; CUDA's driver
        API), or None. HIP: None (not tracked).

        Raises:
            RuntimeCallError: the driver could not be asked.
        """
        if self.runtime != "cuda":
            return None
        try:
            holds = _graph_holds()
            return holds.hold(device, stream)
        except (OSError, RuntimeError) as exc:
            raise RuntimeCallError("cuStreamGetCaptureInfo / cuUserObjectCreate", -1, str(exc)) from None

    def synchronize(self, device: Device) -> None:
        torch.cuda.synchronize(device.ordinal)


class CudaBackend(_TorchDevice):
    """The extension's own runtime calls and kernels (``src/kernels/transfer_gpu.cu``)."""

    has_alias_op = True

    def __init__(self) -> None:
        self.runtime = _C.gpu_runtime
        self.name = self.runtime
        # The staged path's copy stream, events and staging buffer are per device: one call
        # at a time, and a call on another stream waits for the previous one (see staged).
        self._staged_lock = threading.Lock()
        self._staged_last: dict[int, tuple[int, Any]] = {}
        # The launch leases' events (pointerdomain.registration.leases): one per (ordinal, stream), made on
        # first use and kept for the process (a few bytes of driver state per stream used).
        self._events: dict[tuple[int, int], int] = {}
        # The batched copy contract (batch_copy): never the batch call on HIP.
        self._batch = batch_allowed(self.runtime, bool(_C.gpu_has_batch_copy))
        # The duplicate-destination check's scratch (Transfer::marks in transfer.h) per
        # (ordinal, stream): launches on one stream run one after another, so they share it;
        # kept for the process, grown (replaced) for a larger destination. A captured launch
        # gets scratch of its own, held by its graph (_capture_marks).
        self._marks: dict[tuple[int, int], tuple[int, int, torch.Tensor]] = {}

    def _event(self, device: Device, stream: int) -> int:
        status, event = _C.gpu_event_create(device.ordinal)
        check(self, "cudaEventCreateWithFlags", status)
        return self._events.setdefault((device.ordinal, stream), event)  # a racing thread's twin stays unused

    def is_capturing(self, device: Device) -> bool:
        # The runtime's query of the device's current stream (the one torch's query reads
        # with the device current), without making the device current.
        status, capturing = _C.gpu_stream_capturing(device.ordinal, self.current_stream(device))
        check(self, "cudaStreamIsCapturing", status)
        return bool(capturing)

    def graph_hold(self, device: Device, stream: int) -> HeldGraph | None:
        # The extension's capture query first (one native call): launches outside capture,
        # the common case, never reach the driver through ctypes.
        status, capturing = _C.gpu_stream_capturing(device.ordinal, stream)
        check(self, "cudaStreamIsCapturing", status)
        return super().graph_hold(device, stream) if capturing else None

    def register(self, va: int, nbytes: int, device: Device) -> int:
        return _C.gpu_host_register(va, nbytes, device.ordinal)

    def unregister(self, va: int, device: Device) -> int:
        return _C.gpu_host_unregister(va, device.ordinal)

    def describe(self, code: int) -> str:
        return _C.gpu_error_string(code)

    def alias(self, va: int, device: Device) -> tuple[int, int]:
        status, alias = _C.gpu_host_get_device_pointer(va, device.ordinal)
        if status != 0 and self._reads_in_place(va, device):
            return 0, va  # VMM host memory, or pageable memory a coherent part reads: the VA itself
        return status, alias

    def _reads_in_place(self, va: int, device: Device) -> bool:
        found = self.vmm_allocation(va, device)
        if found is not None:
            return found.is_host
        return pageable_access(self, device).coherent

    def pinned_alloc(self, nbytes: int, device: Device) -> tuple[int, torch.Tensor | None]:
        return _C.gpu_pinned_alloc(nbytes, device.ordinal)

    def pinned_release(self, va: int, device: Device) -> None:
        return None  # cudaFreeHost runs when the tensor goes (cudaHostUnregister would be invalid)

    def pointer_is_host(self, ptr: int) -> bool:
        status, is_host = _C.gpu_pointer_is_host(ptr)
        return status == 0 and bool(is_host)

    def can_use_host_pointer(self, device: Device) -> int | None:
        status, value = _C.gpu_can_use_host_pointer_for_registered_mem(device.ordinal)
        return value if status == 0 else None

    def device_attribute(self, name: DeviceAttributeName, device: Device) -> int | None:
        status, value = _C.gpu_device_attribute(_C.DeviceAttribute[name], device.ordinal)
        return value if status == 0 else None

    def load_kernels(self, device: Device) -> None:
        check(self, "cudaFuncGetAttributes (kernel preload)", _C.gpu_preload_kernels(device.ordinal))

    def _stream_marks(self, plan: _C.KernelPlan, device: Device, stream: int) -> tuple[int, bool]:
        """The duplicate check's scratch for a launch of ``plan`` on (``device``, ``stream``)
        and whether it is the stream's shared one: that scratch, large enough for the
        plan's destination, made outside any capture; a first launch on a stream being
        captured gets the capture's own instead (so does any captured launch: the native
        call refuses the shared one then)."""
        words = plan.dst_marks_words
        entry = self._marks.get((device.ordinal, stream))
        if entry is not None and entry[1] >= words:
            return entry[0], True
        status, capturing = _C.gpu_stream_capturing(device.ordinal, stream)
        check(self, "cudaStreamIsCapturing", status)
        if capturing:
            return self._capture_marks(plan, device, stream), False
        scratch = torch.empty((max(words, 1024),), dtype=torch.int32, device=device.torch_device)
        self._marks[(device.ordinal, stream)] = (scratch.data_ptr(), scratch.numel(), scratch)
        return scratch.data_ptr(), True  # its first use zeroes it, ordered on the stream

    def _capture_marks(self, plan: _C.KernelPlan, device: Device, stream: int) -> int:
        """Scratch of a captured launch's own, from the capture's memory pool (allocated on
        the captured stream) and held by its graph: a replay never shares it with launches
        on other streams or with other graphs."""
        cuda: Any = torch.cuda  # ExternalStream is untyped in torch's stubs
        with cuda.stream(cuda.ExternalStream(stream, device=device.torch_device)):
            scratch = torch.empty((plan.dst_marks_words,), dtype=torch.int32, device=device.torch_device)
        held = self.graph_hold(device, stream)
        if held is not None:
            held.keep.append(scratch)
        return int(scratch.data_ptr())

    def launch(self, plan: _C.KernelPlan, args: LaunchArgs) -> None:
        src_idx, dst_idx, n, layer_begin, layer_count, device, stream, max_ctas = args
        # plan.oob: a checked launch, which refuses a destination slot given twice on the device
        marks, shared = self._stream_marks(plan, device, stream) if plan.oob and n > 1 else _NO_MARKS
        status = _C.gpu_transfer(plan, src_idx, dst_idx, n, layer_begin, layer_count, device.ordinal, stream, max_ctas,
                                 marks, shared)
        if status == _C.gpu_marks_per_capture:
            status = _C.gpu_transfer(plan, src_idx, dst_idx, n, layer_begin, layer_count, device.ordinal, stream,
                                     max_ctas, self._capture_marks(plan, device, stream), False)
        if status != 0:
            check(self, "transfer kernel launch", status)

    def launch_recorded(self, plan: _C.KernelPlan, args: LaunchArgs) -> int:
        src_idx, dst_idx, n, layer_begin, layer_count, device, stream, max_ctas = args
        event = self._events.get((device.ordinal, stream)) or self._event(device, stream)
        marks, shared = self._stream_marks(plan, device, stream) if plan.oob and n > 1 else _NO_MARKS
        status = _C.gpu_transfer_recorded(plan, src_idx, dst_idx, n, layer_begin, layer_count, device.ordinal, stream,
                                          max_ctas, event, marks, shared)
        if status == _C.gpu_marks_per_capture:
            status = _C.gpu_transfer_recorded(plan, src_idx, dst_idx, n, layer_begin, layer_count, device.ordinal,
                                              stream, max_ctas, event, self._capture_marks(plan, device, stream),
                                              False)
        return self._recorded(event, status, "transfer kernel launch")

    def record_event(self, device: Device, stream: int) -> int:
        event = self._events.get((device.ordinal, stream)) or self._event(device, stream)
        return self._recorded(event, _C.gpu_event_record(event, device.ordinal, stream), "cudaEventRecord")

    def _recorded(self, event: int, status: int, what: str) -> int:
        """``event`` when the native call recorded it, 0 when it did not (the stream is being
        captured, or there was nothing to launch); a failure raises the typed error."""
        if status == 0:
            return event
        if status == _C.gpu_not_recorded:
            return 0
        check(self, what, status)
        return 0  # not reached: check raised

    def event_done(self, event: int) -> bool:
        status = _C.gpu_event_query(event)
        if status == _C.gpu_not_ready:
            return False
        check(self, "cudaEventQuery", status)
        return True

    def copy_runs(self, dsts: int, srcs: int, sizes: int, count: int, device: Device, stream: int) -> None:
        # Planned before anything is submitted (batch_copy): capped submissions, per-run
        # copies while the stream is captured, the legacy stream through an ordered side stream.
        capturing = False
        if self._batch and count:
            status, captured = _C.gpu_stream_capturing(device.ordinal, stream)
            check(self, "cudaStreamIsCapturing", status)
            capturing = bool(captured)
        for sub in plan_copy_runs(count, stream, batched=self._batch, capturing=capturing):
            skip = 8 * sub.first  # the submission's slice of the three uint64 arrays
            status = _C.gpu_copy_runs(dsts + skip, srcs + skip, sizes + skip, sub.count, device.ordinal, stream,
                                      sub.batched)
            if status != 0:
                check(self, "cudaMemcpyBatchAsync" if sub.batched else "cudaMemcpyAsync (copy runs)", status)

    # the layer pipeline (LayerSignals): one kernel for every layer, whose last CTA per
    # layer writes the layer's flag; waits are cuStreamWaitValue32. Flags are host-mapped
    # pinned memory (the host reads them in place), counters device memory.
    def layer_words(self, device: Device, capacity: int) -> LayerWords:
        status, host = _C.gpu_pinned_alloc(4 * capacity, device.ordinal)
        check(self, "cudaHostAlloc (layer flags)", status)
        assert host is not None  # status 0
        ctypes.memset(host.data_ptr(), 0, 4 * capacity)  # no GPU work has them yet
        status, alias = _C.gpu_host_get_device_pointer(host.data_ptr(), device.ordinal)
        check(self, "cudaHostGetDevicePointer (layer flags)", status)
        # zeroed on the device's current stream, which the load stream waits for before its launch
        counters = torch.zeros(4 * capacity, dtype=torch.uint8, device=device.torch_device)
        return LayerWords(capacity, alias, host.data_ptr(), counters.data_ptr(), (host, counters))

    def capturing(self, device: Device, stream: int) -> bool:
        status, capturing = _C.gpu_stream_capturing(device.ordinal, stream)
        check(self, "cudaStreamIsCapturing", status)
        return bool(capturing)

    def launch_layers(self, plan: _C.KernelPlan, args: LaunchArgs, words: LayerWords, gen: int) -> int:
        src_idx, dst_idx, n, layer_begin, layer_count, device, stream, max_ctas = args
        event = self._events.get((device.ordinal, stream)) or self._event(device, stream)
        # never captured (the native call refuses it): the stream's shared scratch serves
        marks = self._stream_marks(plan, device, stream)[0] if plan.oob and n > 1 else 0
        status = _C.gpu_transfer_layers(plan, src_idx, dst_idx, n, layer_begin, layer_count, device.ordinal, stream,
                                        max_ctas, words.flags, words.counters, gen & 0xFFFFFFFF, event, marks)
        return self._recorded(event, status, "layer pipeline launch")

    def signal_layer(self, words: LayerWords, index: int, gen: int, device: Device, stream: int) -> None:
        status = _C.gpu_stream_write_value(device.ordinal, stream, words.flags + 4 * index, gen & 0xFFFFFFFF)
        if status != 0:
            check(self, "cuStreamWriteValue32 (layer flag)", status)

    def wait_layer(self, words: LayerWords, index: int, gen: int, device: Device, stream: int) -> None:
        status = _C.gpu_stream_wait_value(device.ordinal, stream, words.flags + 4 * index, gen & 0xFFFFFFFF)
        if status != 0:
            check(self, "cuStreamWaitValue32 (layer flag)", status)

    def layer_flag(self, words: LayerWords, index: int) -> int:
        return int(ctypes.c_uint32.from_address(words.host + 4 * index).value)

    def wait_event_done(self, event: int) -> None:
        check(self, "cudaEventSynchronize", _C.gpu_event_synchronize(event))

    def staged_available(self) -> bool:
        return True

    def staged(self, plan: _C.KernelPlan, args: LaunchArgs, staging: StagingArgs) -> None:
        src_idx, dst_idx, n, layer_begin, layer_count, device, stream, max_ctas = args
        cuda = cast(Any, torch.cuda)
        ext = cuda.ExternalStream(stream, device=device.torch_device)
        with cuda.stream(ext):  # the stream given, not only the current one: descriptors read on the host
            capturing = bool(cuda.is_current_stream_capturing())  # must never be baked into a graph
        if capturing:
            raise InvalidArgumentError(
                "backend='staged' reads the indices on the host and cannot be captured in a CUDA graph"
            )
        with self._staged_lock:
            last = self._staged_last.get(device.ordinal)
            if last is not None and last[0] != stream:
                ext.wait_event(last[1])  # the staging ring is free only once the previous call has passed it
            status = _C.gpu_staged_transfer(plan, src_idx, dst_idx, n, layer_begin, layer_count, *staging,
                                            device.ordinal, stream, max_ctas)
            if status == 0:
                done = cuda.Event()
                done.record(ext)
                self._staged_last[device.ordinal] = (stream, done)
        check_staged(self, status)


def _cudart() -> Any:
    return cast(Any, torch.cuda).cudart()


class TorchCudartBackend(_TorchDevice):
    """Registration through torch's cudart binding, for builds without the GPU ops.
    It has no alias op and no kernels: the alias policy decides whether host VAs may
    stand in (pointerdomain.registration.resolve), and launches raise ExtensionUnavailableError."""

    name = "torch-cudart"
    has_alias_op = False

    def __init__(self) -> None:
        self.runtime = "hip" if getattr(torch.version, "hip", None) else "cuda"

    def register(self, va: int, nbytes: int, device: Device) -> int:
        with torch.cuda.device(device.ordinal):
            return int(_cudart().cudaHostRegister(va, nbytes, 1 | 2))  # portable | mapped

    def unregister(self, va: int, device: Device) -> int:
        with torch.cuda.device(device.ordinal):
            return int(_cudart().cudaHostUnregister(va))

    def describe(self, code: int) -> str:
        return str(_cudart().cudaGetErrorString(code))

    def alias(self, va: int, device: Device) -> tuple[int, int]:
        raise ExtensionUnavailableError(f"this pointerdomain build has no cudaHostGetDevicePointer op; {BUILD_HINT}")

    def pointer_is_host(self, ptr: int) -> bool:
        return False  # no cudaPointerGetAttributes without the GPU ops

    def can_use_host_pointer(self, device: Device) -> int | None:
        return self.device_attribute("CanUseHostPointerForRegisteredMem", device)

    def device_attribute(self, name: DeviceAttributeName, device: Device) -> int | None:
        try:
            lib = load_cudart()
            value = ctypes.c_int(0)
            if lib.cudaDeviceGetAttribute(ctypes.byref(value), _CUDA_ATTRIBUTE_IDS[name], device.ordinal) != 0:
                return None
            return int(value.value)
        except (OSError, AttributeError):
            return None

    def load_kernels(self, device: Device) -> None:
        return None  # no kernels in this build (launches raise)

    def launch(self, plan: _C.KernelPlan, args: LaunchArgs) -> None:
        raise ExtensionUnavailableError(f"this pointerdomain build has no GPU kernels; {BUILD_HINT}")

    def launch_recorded(self, plan: _C.KernelPlan, args: LaunchArgs) -> int:
        raise ExtensionUnavailableError(f"this pointerdomain build has no GPU kernels; {BUILD_HINT}")

    def record_event(self, device: Device, stream: int) -> int:
        return 0  # this backend enqueues no GPU work (its launches and copies raise)

    def event_done(self, event: int) -> bool:
        return True

    def copy_runs(self, dsts: int, srcs: int, sizes: int, count: int, device: Device, stream: int) -> None:
        raise ExtensionUnavailableError(f"this pointerdomain build has no GPU copy ops; {BUILD_HINT}")

    def staged_available(self) -> bool:
        return False

    def staged(self, plan: _C.KernelPlan, args: LaunchArgs, staging: StagingArgs) -> None:
        raise ExtensionUnavailableError(f"this pointerdomain build has no staged copy-engine path (not built); {BUILD_HINT}")
