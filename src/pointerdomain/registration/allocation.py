"""Allocation: registered host memory (:func:`alloc_registered`) and device
memory (:func:`device_empty`), from the device's backend."""

from __future__ import annotations

import math
import mmap
from typing import Literal

from typing import cast

import torch

from pointerdomain._platform import backend_for, device_holding
from pointerdomain._platform import memory_device as _memory_device
from pointerdomain._platform.numa import bind_to_node, device_node, node_count
from pointerdomain.devices import Device, validate_device
from pointerdomain.errors import InvalidArgumentError, InvalidTypeError, InvalidRegistrationError, OutOfMemoryError, PointerDomainError
from pointerdomain.arguments import check_bool, describe
from pointerdomain.registration.budget import check_allocation, check_registration
from pointerdomain.registration.ladder import RegistrationPolicy, resolve_policy, warn_degraded
from pointerdomain.registration.memory import DEFAULT_MAX_CHUNK_BYTES, RegisteredHostMemory, check_granularity
from pointerdomain.registration.prefault import hugetlb_alloc, hugetlb_pool, prefault
from pointerdomain.registration.strict import strict_alias_enabled

__all__ = ["alloc_registered", "device_empty", "memory_device", "memory_device_at"]


def alloc_registered(
    nbytes: int,
    device: Device | str | torch.device,
    *,
    granularity: int = mmap.PAGESIZE,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    policy: RegistrationPolicy | None = None,
    numa: Literal["local"] | None = None,
) -> RegisteredHostMemory:
    """Allocate ``nbytes`` of page-aligned host memory and register it for ``device``.

    In strict alias mode (:mod:`pointerdomain.registration.strict`) the memory is one memfd mapped
    twice: the owner's ``tensor`` / ``host_va`` is the never-registered mapping and device
    aliases come from the registered one.

    Args:
        nbytes: size in bytes (> 0).
        device: the device whose kernels will read it (``"cuda:0"``, ``"emulated:0"``).
        granularity: chunks are cut on multiples of this many bytes from the start;
            pass the KV page size in bytes so no page spans two registrations.
        max_chunk_bytes: largest single registration call (rounded down to the granularity;
            at least ``granularity``, since a chunk is whole granules).
        policy: what to do when the driver refuses (:class:`pointerdomain.registration.ladder.RegistrationPolicy`;
            default: :func:`pointerdomain.registration.ladder.default_policy`, which fails).
        numa: ``"local"`` moves the pages to the device's NUMA node before registering
            (mbind; a no-op on a one-node machine or where the node is unknown, and a
            :class:`~pointerdomain.registration.ladder.RegistrationDegradedWarning` where mbind is refused);
            with ``policy.prefault_threads`` the prefault threads then run on that node's CPUs.

    Raises:
        InvalidRegistrationError: ``nbytes``, ``granularity`` or ``max_chunk_bytes`` not
            positive, ``max_chunk_bytes`` below ``granularity``, or ``nbytes`` not below 2**64
            (a ``ValueError`` too).
        InvalidDeviceError: the device does not exist.
        BudgetExceededError: (an OutOfMemoryError) more than the memory budget allows
            (:mod:`pointerdomain.registration.budget`: memory available, commit limit,
            RLIMIT_AS, the cgroup's limit; with the default policy also RLIMIT_MEMLOCK where
            it counts, the WSL2 WDDM pool, a device cap): checked before any page is touched.
        RegistrationRefusedError: the platform refuses registration at every size
            (Confidential Computing) and the policy is ``"fail"``.
        OutOfMemoryError: the allocation failed (a ``MemoryError``; the message gives the size, the limit
            and what to do).
        RegistrationError: (or a subclass) the runtime refused; nothing stays registered.
    """
    if type(nbytes) is not int or not 0 < nbytes < _ADDRESS_SPACE:
        why = ": a 0-byte registration is invalid" if nbytes == 0 and type(nbytes) is int else ""
        why = ", below 2**64 (the address space)" if type(nbytes) is int and nbytes > 0 else why
        raise InvalidRegistrationError(f"nbytes must be a positive int (bytes to allocate and register){why}, "
                                       f"got {describe(nbytes)}")
    check_granularity(granularity, max_chunk_bytes)
    if numa is not None and numa != "local":
        raise InvalidRegistrationError(f"numa must be None or 'local', got {describe(numa)}")
    resolve_policy(policy)  # before any page is allocated
    dev = validate_device(device)
    check_registration(nbytes, dev, policy=policy, allocate=True)  # every limit, before any page
    backend = backend_for(dev)
    registered = None
    strict = strict_alias_enabled()  # read once: another thread may switch it meanwhile
    hugetlb = resolve_policy(policy).huge_pages == "hugetlbfs"
    if hugetlb and strict:
        raise InvalidRegistrationError(
            "policy.huge_pages: found 'hugetlbfs' in strict alias mode, expected 'off' or 'thp' there: strict mode "
            "maps the memory twice through a memfd, which huge-page pool memory cannot be. Fix: leave strict alias "
            "mode for this allocation, or use huge_pages='thp'")
    try:
        if hugetlb:
            tensor = _hugetlb(nbytes, dev)
        elif strict:
            from pointerdomain._platform.strict_alloc import double_map  # imports _C: on first use only

            tensor, registered = double_map(backend, nbytes)
        else:
            tensor = backend.host_alloc(nbytes)
    except (MemoryError, RuntimeError) as exc:  # strict mode's double mapping too
        raise _out_of_memory(exc, "host", nbytes, dev) from None
    prefaulted = None
    if numa == "local":
        node = _place_local(tensor, dev)
        chosen = resolve_policy(policy)
        if node is not None and chosen.prefault_threads:  # first touch on the node's CPUs, under its policy
            prefaulted = prefault(tensor if registered is None else registered, chosen.prefault_threads,
                                  chosen.huge_pages, node)
    return RegisteredHostMemory(tensor, dev, granularity, max_chunk_bytes, policy=policy, registered=registered,
                                library_owned=True, prefaulted=prefaulted)


def _hugetlb(nbytes: int, dev: Device) -> torch.Tensor:
    """``nbytes`` from the huge-page pool.

    Raises:
        OutOfMemoryError: the pool is short (its free and total pages named); nothing allocated.
    """
    try:
        return hugetlb_alloc(nbytes)
    except OSError as exc:
        free, total, size = hugetlb_pool()
        need = -(-nbytes // (size or 2 << 20))
        raise OutOfMemoryError(
            f"nbytes: found a request for {nbytes} bytes of huge-page pool memory for {dev} ({need} pages of "
            f"{(size or 2 << 20) >> 20} MiB), expected at most HugePages_Free: {free} (HugePages_Total: {total}, "
            f"/proc/meminfo; mmap(MAP_HUGETLB): {exc.strerror or exc}). Fix: reserve pages (sysctl vm.nr_hugepages="
            f"{max(total, 0) + need}), or use huge_pages='thp'",
            nbytes,
        ) from None


def _place_local(tensor: torch.Tensor, dev: Device) -> int | None:
    """Move the pages to ``dev``'s NUMA node (before pinning: pinned pages do not move);
    the node when they are bound to it, else None."""
    node = device_node(dev)
    if node is None or node_count() == 1:
        return None  # nothing to choose between, or the platform does not say
    why = bind_to_node(tensor.data_ptr(), tensor.numel(), node)
    if why:
        warn_degraded(f"numa:{why}", f"pointerdomain: numa='local' could not place memory on node {node} "
                                     f"for {dev}: {why}; the memory stays where the kernel put it")
        return None
    return node


def _out_of_memory(exc: BaseException, what: str, nbytes: int, device: Device) -> BaseException:
    """``exc`` from an allocator (the extension's ``std::bad_alloc`` arrives as a bare
    ``MemoryError``; torch's allocators raise ``RuntimeError`` / ``torch.OutOfMemoryError``)
    as an :class:`OutOfMemoryError` with the size and what to do; other errors unchanged."""
    if isinstance(exc, PointerDomainError):
        return exc
    text = str(exc)
    if not isinstance(exc, MemoryError) and "alloc" not in text.lower() and "out of memory" not in text.lower():
        return exc
    gib = nbytes / (1 << 30)
    return OutOfMemoryError(
        f"nbytes: could not allocate {nbytes} bytes ({gib:.2f} GiB) of {what} memory for {device} "
        f"(found: {type(exc).__name__}: {text[:160]}), expected an allocation that fits the free memory. Fix: "
        "allocate less (fewer pages or layers per pool), free memory first, or check the process's limits "
        "(ulimit -v, container memory limit)",
        nbytes,
    )


#: Sizes are byte counts of a 64-bit address space.
_ADDRESS_SPACE = 1 << 64


def device_empty(shape: tuple[int, ...], dtype: torch.dtype, device: Device | str | torch.device) -> torch.Tensor:
    """Uninitialised device memory: a CUDA tensor, or emulated device memory (a CPU
    tensor tagged with the emulated ordinal, so CPU-only APIs refuse it).

    Raises:
        InvalidDeviceError: the device does not exist.
        InvalidArgumentError: a negative dimension, or 2**64 bytes or more (a ``ValueError``).
        OutOfMemoryError: the memory could not be allocated, or (emulated device memory,
            which is host memory) more than the machine can back (a ``MemoryError``).
    """
    dev = validate_device(device)
    if not isinstance(cast(object, shape), tuple) or any(type(d) is not int for d in shape):
        raise InvalidTypeError(
            f"shape: found {describe(shape)} ({type(shape).__name__}), expected a tuple of ints. Fix: pass e.g. (4, 128)"
        )
    if not isinstance(dtype, torch.dtype):
        raise InvalidTypeError(
            f"dtype: found {describe(dtype)} ({type(dtype).__name__}), expected a torch.dtype. Fix: pass e.g. torch.bfloat16 "
            "(KVLayout.torch_dtype gives a layout's)"
        )
    if any(d < 0 for d in shape):
        raise InvalidArgumentError(
            f"shape: found a negative dimension in {shape}, expected dimensions >= 0. Fix: pass a valid shape"
        )
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes >= _ADDRESS_SPACE:
        raise InvalidArgumentError(
            f"shape: {shape} of {dtype} is {nbytes} bytes, expected fewer than 2**64 (the address space). "
            "Fix: pass a shape that fits memory"
        )
    if dev.runtime.host_memory:  # this device's memory is host memory: the machine must back it
        check_allocation(nbytes, dev, name="shape", what=f"{dev.type} device")
    try:
        raw = backend_for(dev).device_alloc(max(nbytes, 1), dev)  # a 0-byte allocation has no address
    except (MemoryError, RuntimeError) as exc:
        raise _out_of_memory(exc, "device", nbytes, dev) from None
    return raw[:nbytes].view(dtype).view(shape)


def memory_device(tensor: torch.Tensor, *, whole_storage: bool = False) -> Device | None:
    """The device whose memory holds ``tensor`` (its elements, or with ``whole_storage``
    its whole storage): a CUDA device, an emulated device for emulated device memory,
    or None for host memory.

    Raises:
        InvalidTypeError: ``tensor`` is not a torch.Tensor.
    """
    if not isinstance(tensor, torch.Tensor):
        raise InvalidTypeError(
            f"tensor: found a {type(tensor).__name__}, expected a torch.Tensor. Fix: pass the tensor; for a bare "
            "address use memory_device_at(address, nbytes)"
        )
    return _memory_device(tensor, whole_storage=check_bool("whole_storage", whole_storage))


def memory_device_at(address: int, nbytes: int) -> Device | None:
    """The device whose allocation holds ``[address, address + nbytes)`` when that is
    known from the address alone (emulated device memory), else None. CUDA device
    memory is known by its tensor: use :func:`memory_device`.

    Raises:
        InvalidArgumentError: ``address`` or ``nbytes`` not an int in ``[0, 2**64)``.
        ExtensionUnavailableError: the extension does not import.
    """
    for name, value in (("address", address), ("nbytes", nbytes)):
        if type(value) is not int or not 0 <= value < 1 << 64:
            raise InvalidArgumentError(
                f"{name}: found {describe(value)} ({type(value).__name__}), expected an int in [0, 2**64). Fix: pass the "
                "address and size as plain ints (HostVA.value / DeviceAlias.value)"
            )
    return device_holding(address, nbytes)
