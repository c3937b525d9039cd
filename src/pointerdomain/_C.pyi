"""
pointerdomain kernels and runtime calls (private; use the pointerdomain package)
"""

from collections.abc import Sequence
import enum
from typing import Annotated

import torch


gpu_built: bool = True

class KernelPlan:
    """
    Tables and geometry of one launch plan (see pointerdomain.transfer.plan).
    """

    def __init__(self, src_table: int, src_geometry: Sequence[int], dst_table: int, dst_geometry: Sequence[int], page_size: int, num_kv: int, item_bytes: int, vec_bytes: int, oob: int = 0) -> None: ...

    @property
    def src_table(self) -> int: ...

    @property
    def dst_table(self) -> int: ...

    @property
    def src_geometry(self) -> list[int]: ...

    @property
    def dst_geometry(self) -> list[int]: ...

    @property
    def page_size(self) -> int: ...

    @property
    def num_kv(self) -> int: ...

    @property
    def item_bytes(self) -> int: ...

    @property
    def vec_bytes(self) -> int: ...

    @property
    def oob(self) -> int:
        """Address of the uint32 error word (0: none)."""

    @property
    def dst_marks_words(self) -> int:
        """
        uint32 words of the duplicate-destination scratch for this plan's destination (marks_words).
        """

def cpu_transfer(plan: KernelPlan, src_idx: int, dst_idx: int, n: int, layer_begin: int, layer_count: int, num_threads: int, marks: int = 0) -> None:
    """
    Copy KV items between two tables of CPU addresses. marks: 0, or the address of a scratch of marks_words(dst num_slots) uint32 words for the duplicate-destination check (a slot given twice: nothing copied, error bit 2 set).
    """

def marks_words(num_slots: int) -> int:
    """
    uint32 words of the duplicate-destination scratch for a destination of num_slots slots.
    """

def cpu_transfer_layers(plan: KernelPlan, src_idx: int, dst_idx: int, n: int, layer_begin: int, layer_count: int, flags: int, gen: int, num_threads: int) -> None:
    """
    cpu_transfer one layer at a time, storing gen to the uint32 word flags[l] after layer l.
    """

def cpu_copy_runs(dsts: int, srcs: int, sizes: int, count: int) -> None:
    """memcpy runs: addresses of uint64 arrays of dst, src, bytes."""

def words_differ(addresses: int, expected: int, count: int) -> int:
    """
    Index of the first i with *addresses[i] != expected[i] (uint64 arrays by address), or -1.
    """

def host_slots_problem(src_idx: int, dst_idx: int, n: int, src_slots: int, dst_slots: int) -> int:
    """
    0, or 1 / 2: a src / dst slot outside [0, slots), 3: a dst slot twice (int64 host arrays by address).
    """

def index_words_set(offsets: Sequence[int], tensor_type: object) -> None:
    """
    Word offsets: tensor storage, storage offset, dim, size 0, stride 0, numel, dtype word; storage data, storage size; tensor object in the Python object. tensor_type: the Python type read.
    """

def version_words_set(counter: int, version: int) -> None:
    """
    Word offsets: the version counter in the tensor object, the version in the counter object.
    """

def tensors_words(tensors: object, out: int, compare: bool) -> bool:
    """
    For a tuple of tensors (exactly the type set): five words each (storage object, storage offset, dtype word, storage data pointer, version), written to out (5 uint64 each) or, with compare, compared with those there. False where a tensor is not read (or, comparing, differs).
    """

def index_pair(src: object | None, dst: object | None, meta: int, ordinal: int) -> object:
    """
    (numel, numel, data pointer, data pointer, host) of two tensors of exactly the type set that are 1-D, stride 1, with the dtype word meta and a storage holding the view; else None. ordinal >= 0: each must be host memory or emulated device memory of that ordinal (else None), host: one is host memory; ordinal < 0: not looked up (host True).
    """

def read_words(address: int, count: int) -> list[int]:
    """count uint64 words from address (of a live object)."""

def emu_host_alloc(nbytes: int) -> Annotated[torch.Tensor, dict(dtype='uint8', shape=(None,), order='C', device='cpu')]:
    """Page-aligned, memfd-backed host memory as a uint8 tensor."""

def emu_device_alloc(nbytes: int, ordinal: int) -> Annotated[torch.Tensor, dict(dtype='uint8', shape=(None,), order='C', device='cpu')]:
    """Emulated device memory of one device ordinal, as a uint8 tensor."""

def emu_device_lookup(addr: int, nbytes: int) -> int:
    """Ordinal of the emulated device allocation holding the range, or -1."""

def emu_device_frees() -> int:
    """
    Emulated device allocations released since the process started (only grows).
    """

def emu_register(va: int, nbytes: int) -> tuple[int, int]:
    """Map a host range a second time: (status, alias)."""

def emu_unregister(va: int) -> int:
    """Drop the alias mapping: status."""

def emu_prepare(va: int, nbytes: int) -> int:
    """Back a host range by one memfd before a chunked registration: status."""

def emu_get_device_pointer(va: int) -> tuple[int, int]:
    """Alias of a registered host address: (status, alias)."""

def strict_shared_alloc(nbytes: int) -> Annotated[torch.Tensor, dict(dtype='uint8', shape=(None,), order='C', device='cpu')]:
    """
    Page-aligned memfd-backed MAP_SHARED host memory (strict alias mode), a uint8 tensor.
    """

def strict_mirror(va: int, nbytes: int) -> Annotated[torch.Tensor, dict(dtype='uint8', shape=(None,), order='C', device='cpu')]:
    """A second mapping of the shared pages at va (strict alias mode)."""

def strict_twin(va: int, nbytes: int) -> Annotated[torch.Tensor, dict(dtype='uint8', shape=(None,), order='C', device='cpu')]:
    """
    A further mapping of the shared pages at va, inside guard pages at a random gap (strict alias mode: one chunk's registered mapping).
    """

def emu_get_device_pointer_on(va: int, ordinal: int) -> tuple[int, int]:
    """
    Alias of a registered host address on one emulated device (each device its own mapping): (status, alias).
    """

def emu_alias_lookup(addr: int, nbytes: int) -> int:
    """
    Ordinal of the emulated device whose alias mapping holds the range, or -1.
    """

gpu_runtime: str = 'cuda'

def gpu_runtime_version() -> tuple[int, int]: ...

def gpu_device_count() -> tuple[int, int]:
    """(status, number of devices)"""

def gpu_host_register(va: int, nbytes: int, device: int) -> int:
    """cudaHostRegister(portable | mapped): status."""

def gpu_host_unregister(va: int, device: int) -> int:
    """cudaHostUnregister: status."""

def gpu_host_get_device_pointer(va: int, device: int) -> tuple[int, int]:
    """cudaHostGetDevicePointer: (status, alias)."""

def gpu_can_use_host_pointer_for_registered_mem(device: int) -> tuple[int, int]:
    """(status, cudaDevAttrCanUseHostPointerForRegisteredMem)"""

def gpu_pointer_is_host(ptr: int) -> tuple[int, int]:
    """(status, 1 if the runtime reports registered/pinned host memory)"""

def gpu_multiprocessor_count(device: int) -> tuple[int, int]:
    """(status, number of SMs)"""

class DeviceAttribute(enum.Enum):
    """
    Portable device attribute ids for gpu_device_attribute (mapped to the runtime's).
    """

    CanUseHostPointerForRegisteredMem = 0

    PageableMemoryAccess = 1

    PageableMemoryAccessUsesHostPageTables = 2

    HostRegisterSupported = 3

    HostRegisterReadOnlySupported = 4

    PciDomainId = 5

    PciBusId = 6

    PciDeviceId = 7

def gpu_device_attribute(attribute: DeviceAttribute, device: int) -> tuple[int, int]:
    """cudaDeviceGetAttribute / hipDeviceGetAttribute: (status, value)."""

def gpu_error_string(code: int) -> str: ...

def gpu_pinned_alloc(nbytes: int, device: int) -> tuple[int, Annotated[torch.Tensor, dict(dtype='uint8', shape=(None,), order='C', device='cpu')] | None]:
    """
    cudaHostAlloc(portable | mapped): (status, uint8 tensor or None), freed with the tensor.
    """

def gpu_preload_kernels(device: int) -> int:
    """
    Load every transfer kernel into the device's context now (lazy loading would load each at its first launch, which may synchronise the context): status.
    """

def gpu_transfer(plan: KernelPlan, src_idx: int, dst_idx: int, n: int, layer_begin: int, layer_count: int, device: int, stream: int, max_ctas: int, marks: int = 0, shared_marks: bool = False) -> int:
    """
    Launch the KV transfer kernel on a stream: status (tables and indices in device memory; max_ctas <= 0: the whole GPU). marks: 0, or a device scratch of marks_words(dst num_slots) uint32 words only this stream uses: a validation pass first refuses a destination slot given twice (nothing copied, error bit 2 set). shared_marks: marks is the stream's own scratch, refused while the stream is captured (gpu_marks_per_capture, nothing launched).
    """

def gpu_transfer_recorded(plan: KernelPlan, src_idx: int, dst_idx: int, n: int, layer_begin: int, layer_count: int, device: int, stream: int, max_ctas: int, event: int, marks: int = 0, shared_marks: bool = False) -> int:
    """
    gpu_transfer (marks, shared_marks: as there), then record event (from gpu_event_create) on the stream unless it is being captured: 0 (recorded), gpu_not_recorded (capturing, or nothing launched) or a runtime error.
    """

def gpu_event_create(device: int) -> tuple[int, int]:
    """
    cudaEventCreateWithFlags(DisableTiming) on a device: (status, event), never destroyed.
    """

def gpu_event_record(event: int, device: int, stream: int) -> int:
    """
    Record the event on the stream unless it is being captured: 0, gpu_not_recorded or a runtime error.
    """

def gpu_event_query(event: int) -> int:
    """
    cudaEventQuery: 0 (done, or never recorded), gpu_not_ready, or a runtime error.
    """

def gpu_stream_capturing(device: int, stream: int) -> tuple[int, int]:
    """(status, 1 while the stream of the device is being captured)"""

def gpu_transfer_layers(plan: KernelPlan, src_idx: int, dst_idx: int, n: int, layer_begin: int, layer_count: int, device: int, stream: int, max_ctas: int, flags: int, counters: int, gen: int, event: int, marks: int = 0) -> int:
    """
    One launch for every layer, gen written to flags[l] (uint32, device address) once layer l is done; counters: as many zeroed uint32 words of device memory; event (nonzero): recorded after the kernel; marks: 0, or the duplicate-destination scratch (as gpu_transfer: a slot given twice copies nothing). 0, gpu_not_recorded or a runtime error (invalid value while the stream is captured).
    """

def gpu_stream_wait_value(device: int, stream: int, addr: int, value: int) -> int:
    """
    cuStreamWaitValue32 GEQ (cyclic) on a uint32 word: status (a CUresult).
    """

def gpu_stream_write_value(device: int, stream: int, addr: int, value: int) -> int:
    """
    cuStreamWriteValue32 of a uint32 word after the stream's earlier work: status.
    """

def gpu_event_synchronize(event: int) -> int:
    """cudaEventSynchronize: status."""

gpu_not_recorded: int = -3

gpu_marks_per_capture: int = -4

gpu_not_ready: int = 600

def gpu_copy_runs(dsts: int, srcs: int, sizes: int, count: int, device: int, stream: int, use_batch: bool) -> int:
    """
    Copy-engine copies: addresses of host uint64/int64 arrays of dst, src, bytes; status. use_batch: cudaMemcpyBatchAsync (CUDA >= 12.8), else a cudaMemcpyAsync loop.
    """

gpu_has_batch_copy: bool = True

def gpu_staged_transfer(plan: KernelPlan, src_idx: int, dst_idx: int, n: int, layer_begin: int, layer_count: int, host_is_src: bool, host_table: int, host_idx: int, staging: int, staging_bytes: int, ring: int, device: int, stream: int, max_ctas: int) -> int:
    """
    Staged copy-engine transfer: status (0, a runtime error, gpu_staged_not_applicable or gpu_staged_bad_index). host_table / host_idx: host uint64 / int64 arrays; staging: device buffer.
    """

gpu_staged_not_applicable: int = -1

gpu_staged_bad_index: int = -2
