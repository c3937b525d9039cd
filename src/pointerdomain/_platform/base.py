"""The :class:`Backend` protocol: everything the library asks of a platform.

A backend speaks raw ints (addresses, ordinals, status codes) and torch
tensors; the typed layer above wraps them in :class:`~pointerdomain.HostVA` /
:class:`~pointerdomain.DeviceAlias`. Launches and copies raise the typed errors
themselves (through :mod:`pointerdomain._platform.status`); registration calls
return the runtime's status, because the registration layer names the chunk and
rolls back before it raises.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol, get_args, runtime_checkable

from pointerdomain._platform.status import StatusTable, status_table

if TYPE_CHECKING:
    import torch

    from pointerdomain._C import KernelPlan
    from pointerdomain._platform.pointer_query import PointerInfo
    from pointerdomain.devices import Device

__all__ = [
    "DEVICE_ATTRIBUTES",
    "Backend",
    "DeviceAttributeName",
    "LaunchArgs",
    "LayerSignals",
    "LayerWords",
    "PinnedAllocator",
    "PointerQuery",
    "RuntimeTraits",
    "StagedCopy",
    "StagingArgs",
]

#: Device attributes a backend answers (:meth:`Backend.device_attribute`): the CUDA
#: runtime's ``cudaDevAttr<Name>`` (HIP: ``hipDeviceAttribute<Name>``; HIP has no
#: HostRegister*Supported). Read by ``pointerdomain doctor`` and the NUMA lookup.
DeviceAttributeName = Literal[
    "CanUseHostPointerForRegisteredMem",
    "PageableMemoryAccess",
    "PageableMemoryAccessUsesHostPageTables",
    "HostRegisterSupported",
    "HostRegisterReadOnlySupported",
    "PciDomainId",
    "PciBusId",
    "PciDeviceId",
]
DEVICE_ATTRIBUTES: tuple[DeviceAttributeName, ...] = get_args(DeviceAttributeName)


class LaunchArgs(NamedTuple):
    """One launch's per-call arguments, bound once by the launch path and handed to the
    backend whole: ``backend.launch(plan, args)``, ``backend.launch_recorded(plan, args)``,
    ``backend.staged(plan, args, staging)`` (the runtime's own call, ``_C.gpu_transfer``,
    takes them flat)."""

    src_idx: int  #: address of the ``n`` source slots (``int64``)
    dst_idx: int  #: address of the ``n`` destination slots (``int64``)
    n: int  #: slot pairs
    layer_begin: int
    layer_count: int
    device: Device
    stream: int  #: the stream as an int (0 where streams do not exist)
    max_ctas: int  #: the CTA budget; <= 0 is the whole GPU


class StagingArgs(NamedTuple):
    """The staged path's arguments beside :class:`LaunchArgs` (:meth:`StagedCopy.staged`)."""

    host_is_src: bool  #: the host pool is the source (H2D); else the destination (D2H)
    host_table: int  #: address of the host side's table values in HOST memory (``uint64``)
    host_idx: int  #: address of the host side's ``n`` slot indices in HOST memory (``int64``)
    staging: int  #: address of the device staging buffer
    staging_bytes: int  #: its size in bytes
    ring: int  #: ring slots it is cut into


class Backend(Protocol):
    """One platform (emulated CPU, CUDA/HIP runtime, ...). See the module docstring.

    Attributes:
        name: short name for messages (``"emulated"``, ``"cuda"``, ``"hip"``, ``"torch-cudart"``).
        runtime: ``"emulated"``, ``"cuda"`` or ``"hip"``.
        has_alias_op: the backend can ask the runtime for a device alias
            (``cudaHostGetDevicePointer``); False means the alias policy may fall back.
        host_readable: the device's memory (kernel tables, indices) is readable from
            the CPU without a synchronisation (true only for the emulated backend).

    What follows from the runtime alone (:class:`RuntimeTraits`): ``staged_auto``,
    ``driver_attributes``, ``alias_is_mapping``, ``status``.
    """

    name: str
    runtime: str
    has_alias_op: bool
    host_readable: bool

    @property
    def staged_auto(self) -> bool:
        """``backend="auto"`` may pick the staged path (its crossover was measured on this
        runtime: CUDA); elsewhere it runs only when asked."""
        ...

    @property
    def driver_attributes(self) -> bool:
        """``PageableMemoryAccess`` and its kin are read through the CUDA driver (strict
        alias mode's capability, :mod:`.cuda_driver`)."""
        ...

    @property
    def alias_is_mapping(self) -> bool:
        """A device alias is this process's second mapping of the host pages (the emulated
        driver), not an address the runtime hands out."""
        ...

    @property
    def status(self) -> StatusTable:
        """The runtime's status codes and their names (:mod:`.status`): a HIP failure
        reads as ``hipError...``, a CUDA one as ``cudaError...``."""
        ...

    # registration ------------------------------------------------------------
    def register(self, va: int, nbytes: int, device: Device) -> int:
        """Register ``[va, va + nbytes)`` for ``device``: the runtime status (0 = success)."""
        ...

    def unregister(self, va: int, device: Device) -> int:
        """Undo :meth:`register` of the range starting at ``va``: the runtime status."""
        ...

    def describe(self, code: int) -> str:
        """The runtime's text for status ``code``."""
        ...

    # addresses ---------------------------------------------------------------
    def alias(self, va: int, device: Device) -> tuple[int, int]:
        """(status, device alias) of registered host address ``va``."""
        ...

    def pointer_is_host(self, ptr: int) -> bool:
        """True when the runtime knows ``ptr`` as pinned / registered host memory."""
        ...

    def device_lookup(self, addr: int, nbytes: int) -> int:
        """Ordinal of this backend's device allocation holding ``[addr, addr + nbytes)``, or -1."""
        ...

    # device attributes -------------------------------------------------------
    def device_count(self) -> int:
        """Number of devices this backend sees."""
        ...

    def can_use_host_pointer(self, device: Device) -> int | None:
        """``CanUseHostPointerForRegisteredMem`` of ``device``, or None if unreadable."""
        ...

    def device_name(self, device: Device) -> str:
        """The device's product name (for ``pointerdomain doctor``)."""
        ...

    def device_attribute(self, name: DeviceAttributeName, device: Device) -> int | None:
        """The runtime's device attribute ``name`` of ``device``, or None where the
        runtime does not define it or the query fails (``pointerdomain doctor``)."""
        ...

    def free_device_memory(self, device: Device) -> int | None:
        """Free bytes of the device's own memory, or None where device memory is host
        memory (the emulated backend: count it against host memory instead)."""
        ...

    # allocation --------------------------------------------------------------
    def host_alloc(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of page-aligned host memory that :meth:`register` accepts (a uint8 tensor)."""
        ...

    def shareable_host_alloc(self, nbytes: int) -> torch.Tensor:
        """As :meth:`host_alloc`, backed by a memfd that ``_C.strict_mirror`` can map a second
        time (strict alias mode's registered mapping, :mod:`._platform.strict_alloc`)."""
        ...

    def device_alloc(self, nbytes: int, device: Device) -> torch.Tensor:
        """``nbytes`` of device memory of ``device`` (a flat uint8 tensor)."""
        ...

    # launches ----------------------------------------------------------------
    def current_stream(self, device: Device) -> int:
        """The device's current stream as an int (0 where streams do not exist)."""
        ...

    def is_capturing(self, device: Device) -> bool:
        """True while the current stream of ``device`` is being captured into a graph
        (whatever the calling thread's current device)."""
        ...

    def load_kernels(self, device: Device) -> None:
        """Load the transfer kernels into ``device``'s context ahead of the first launch
        (CUDA: under lazy module loading, the default since CUDA 12.2, a kernel's first
        launch loads it, which may synchronise the context and so wait for work queued on
        every stream; nothing elsewhere). Called once per device, outside graph capture.

        Raises:
            RuntimeCallError: the load failed.
        """
        ...

    def launch(self, plan: KernelPlan, args: LaunchArgs) -> None:
        """Run the transfer kernel of ``plan`` on the call ``args``: ``args.n`` slot pairs
        (index arrays by address), its layer range, on ``args.stream`` of ``args.device``,
        at most ``args.max_ctas`` CTAs (<= 0: the whole GPU).

        Raises:
            RuntimeCallError: the launch failed.
        """
        ...

    def launch_recorded(self, plan: KernelPlan, args: LaunchArgs) -> int:
        """:meth:`launch`, then :meth:`record_event` on the same stream (CUDA: one native
        call). The launch leases use it (:mod:`pointerdomain.registration.leases`).

        Returns:
            The event to wait on with :meth:`event_done`, or 0 where there is nothing to
            wait for (a synchronous backend, or the stream is being captured into a graph).

        Raises:
            RuntimeCallError: the launch (or the record after it) failed.
        """
        ...

    def record_event(self, device: Device, stream: int) -> int:
        """Record the backend's one event of (``device``, ``stream``) on the stream, so
        waiting on it waits for the work enqueued there so far; not while the stream is
        being captured. Returns the event (an opaque nonzero int, the same for every
        record on that stream), or 0 (nothing recorded: synchronous backend, capture).

        Raises:
            RuntimeCallError: the record failed.
        """
        ...

    def event_done(self, event: int) -> bool:
        """True once the work before the last record of ``event`` (from :meth:`record_event`
        or :meth:`launch_recorded`) is done.

        Raises:
            RuntimeCallError: the query failed (e.g. a kernel fault left the context unusable).
        """
        ...

    def copy_runs(self, dsts: int, srcs: int, sizes: int, count: int, device: Device, stream: int) -> None:
        """``count`` copies ``dsts[i] <- srcs[i]`` of ``sizes[i]`` bytes (host uint64 arrays by address).

        Raises:
            RuntimeCallError: the copy failed.
        """
        ...

    def synchronize(self, device: Device) -> None:
        """Wait for the device's work (a no-op where launches are synchronous)."""
        ...


class RuntimeTraits:
    """The :class:`Backend` capabilities that follow from its ``runtime`` alone (a mixin of
    every backend, so a wrapper that takes another runtime's name takes its traits too)."""

    runtime: str

    @property
    def staged_auto(self) -> bool:
        return self.runtime == "cuda"

    @property
    def driver_attributes(self) -> bool:
        return self.runtime == "cuda"

    @property
    def alias_is_mapping(self) -> bool:
        return self.runtime == "emulated"

    @property
    def status(self) -> StatusTable:
        return status_table(self.runtime)

    def memory_generation(self) -> int:
        """A count that grows whenever device memory this backend tracks is released, so
        that an address resolved before may since name other memory or none
        (:func:`pointerdomain._platform.memory_generation`); 0 where the backend sees no
        releases (CUDA: torch's caching allocator reuses its blocks without the driver
        seeing a free)."""
        return 0


@runtime_checkable
class StagedCopy(Protocol):
    """A backend with the staged copy-engine path (``src/kernels/staged_gpu.cu``), or one that
    stands in for it (the emulated device runs the plain kernel). Optional: without it,
    ``backend="staged"`` raises ExtensionUnavailableError and ``"auto"`` never picks it."""

    def staged_available(self) -> bool:
        """True where :meth:`staged` runs the staged copy-engine path
        (``src/kernels/staged_gpu.cu``); False where it runs the plain kernel instead
        (the emulated device) or raises ExtensionUnavailableError (not built)."""
        ...

    def staged(self, plan: KernelPlan, args: LaunchArgs, staging: StagingArgs) -> None:
        """The staged copy-engine transfer of the call ``args`` (as for :meth:`Backend.launch`:
        ``args.src_idx`` / ``args.dst_idx`` are index arrays the kernel stage reads): the copy
        engine moves whole contiguous host runs between the host side and a device staging
        ring of ``staging.ring`` slots in ``staging.staging`` (``staging.staging_bytes`` of
        device memory), a kernel of at most ``args.max_ctas`` CTAs moves the items between the
        ring and the device side; ``staging.host_table`` / ``staging.host_idx``: the host
        side's table values and slot indices in HOST memory.

        Raises:
            IndexValidationError: a host slot out of range (nothing was launched).
            InvalidArgumentError: the layout or staging buffer does not allow it, or the
                stream is being captured.
            ExtensionUnavailableError: this build has no staged path.
            RuntimeCallError: a runtime call failed.
        """
        ...


class LayerWords:
    """The completion words of a layer pipeline (:mod:`pointerdomain.transfer.layers`):
    ``capacity`` uint32 flags, word ``l`` set to a load's generation once its layer ``l``
    is done, and as many counters the launch's CTAs count their arrivals in (0 between
    launches; device memory).

    Attributes:
        capacity: words of each kind.
        flags: the flags' address for kernels and stream waits (a device address).
        host: the flags' host address (the host reads them in place).
        counters: the counters' address (device memory; unused where launches are synchronous).
        keep: the memory under them, kept alive with this object.
    """

    __slots__ = ("capacity", "flags", "host", "counters", "keep")

    def __init__(self, capacity: int, flags: int, host: int, counters: int, keep: tuple[object, ...]) -> None:
        self.capacity = capacity
        self.flags = flags
        self.host = host
        self.counters = counters
        self.keep = keep


@runtime_checkable
class LayerSignals(Protocol):
    """A backend with the layer pipeline's native half (optional: without it
    ``load_layers`` raises ExtensionUnavailableError). Flags compare cyclically: a flag
    ``f`` satisfies generation ``g`` when ``(f - g) mod 2**32 < 2**31``.

    Raises (every method):
        RuntimeCallError: a runtime call failed.
    """

    def layer_words(self, device: Device, capacity: int) -> LayerWords:
        """New words for ``capacity`` layers, zeroed (on the device's current stream where
        that takes device work)."""
        ...

    def capturing(self, device: Device, stream: int) -> bool:
        """Whether ``stream`` of ``device`` is being captured into a graph now."""
        ...

    def launch_layers(self, plan: KernelPlan, args: LaunchArgs, words: LayerWords, gen: int) -> int:
        """Every layer of ``args`` in one launch, flag ``l`` set to ``gen`` once layer
        ``args.layer_begin + l`` is done (never while capturing: a captured graph could
        order a stream wait on a flag ahead of the kernel that sets it). Returns the event
        recorded after the launch (for :meth:`wait_event_done`), or 0 (synchronous)."""
        ...

    def signal_layer(self, words: LayerWords, index: int, gen: int, device: Device, stream: int) -> None:
        """Set flag ``index`` to ``gen`` once the work queued on ``stream`` so far is done."""
        ...

    def wait_layer(self, words: LayerWords, index: int, gen: int, device: Device, stream: int) -> None:
        """Make ``stream`` wait, on the device, until flag ``index`` satisfies ``gen``.

        Raises:
            RuntimeCallError: also on a synchronous device whose flag is not set (a GPU
                stream would wait forever).
        """
        ...

    def layer_flag(self, words: LayerWords, index: int) -> int:
        """Flag ``index`` as the host reads it now."""
        ...

    def wait_event_done(self, event: int) -> None:
        """Block the host until the work before ``event``'s last record is done."""
        ...


@runtime_checkable
class PinnedAllocator(Protocol):
    """A backend that can allocate pinned host memory itself (``cudaHostAlloc`` /
    ``hipHostMalloc``): the third rung of the registration ladder
    (:mod:`pointerdomain.registration.ladder`). Optional: a backend without it skips that rung."""

    def pinned_alloc(self, nbytes: int, device: Device) -> tuple[int, torch.Tensor | None]:
        """(status, a uint8 tensor of ``nbytes`` pinned, device-mapped bytes or None); the
        memory is freed with the tensor (after :meth:`pinned_release`)."""
        ...

    def pinned_release(self, va: int, device: Device) -> None:
        """Called once when the registration over :meth:`pinned_alloc` memory closes."""
        ...


@runtime_checkable
class PointerQuery(Protocol):
    """A backend that can say what memory a bare address is (:mod:`.pointer_query`):
    used to check raw ``data_ptr()`` tables (:mod:`pointerdomain.compat`). Optional: a
    backend without it knows bare addresses only through this library's registry."""

    def pointer_info(self, addr: int) -> PointerInfo | None:
        """The allocation holding ``addr`` (host or device memory, its range), or None."""
        ...
