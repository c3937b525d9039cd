"""Allocation: registered host memory (:func:`alloc_registered`) and device
memory (:func:`device_empty`), from the device's backend."""

from __future__ import annotations

import math
import mmap
from typing import Literal

import torch

from pointerdomain._platform import backend_for, device_holding, memory_device
from pointerdomain._platform.numa import bind_to_node, device_node, node_count
from pointerdomain.devices import Device, validate_device
from pointerdomain.errors import InvalidRegistrationError
from pointerdomain.ladder import RegistrationPolicy, warn_degraded
from pointerdomain.memory import DEFAULT_MAX_CHUNK_BYTES, RegisteredHostMemory, check_granularity
from pointerdomain.strict import strict_alias_enabled

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

    In strict alias mode (:mod:`pointerdomain.strict`) the memory is one memfd mapped
    twice: the owner's ``tensor`` / ``host_va`` is the never-registered mapping and device
    aliases come from the registered one.

    Args:
        nbytes: size in bytes (> 0).
        device: the device whose kernels will read it (``"cuda:0"``, ``"emulated:0"``).
        granularity: chunks are cut on multiples of this many bytes from the start;
            pass the KV page size in bytes so no page spans two registrations.
        max_chunk_bytes: largest single registration call (rounded down to the granularity).
        policy: what to do when the driver refuses (:class:`pointerdomain.ladder.RegistrationPolicy`;
            default: :func:`pointerdomain.ladder.default_policy`, which fails).
        numa: ``"local"`` moves the pages to the device's NUMA node before registering
            (mbind; a no-op on a one-node machine or where the node is unknown, and a
            :class:`~pointerdomain.ladder.RegistrationDegradedWarning` where mbind is refused).

    Raises:
        InvalidRegistrationError: ``nbytes``, ``granularity`` or ``max_chunk_bytes`` not
            positive (a ``ValueError`` too).
        InvalidDeviceError: the device does not exist.
        RegistrationError: (or a subclass) the runtime refused; nothing stays registered.
    """
    if type(nbytes) is not int or nbytes <= 0:
        raise InvalidRegistrationError(f"nbytes must be a positive int: a 0-byte registration is invalid (got {nbytes!r})")
    check_granularity(granularity, max_chunk_bytes)
    if numa is not None and numa != "local":
        raise InvalidRegistrationError(f"numa must be None or 'local', got {numa!r}")
    dev = validate_device(device)
    backend = backend_for(dev)
    registered = None
    if strict_alias_enabled():
        from pointerdomain._platform.strict_alloc import double_map  # imports _C: on first use only

        tensor, registered = double_map(backend, nbytes)
    else:
        tensor = backend.host_alloc(nbytes)
    if numa == "local":
        _place_local(tensor, dev)
    return RegisteredHostMemory(tensor, dev, granularity, max_chunk_bytes, policy=policy, registered=registered,
                                library_owned=True)


def _place_local(tensor: torch.Tensor, dev: Device) -> None:
    """Move the pages to ``dev``'s NUMA node (before pinning: pinned pages do not move)."""
    node = device_node(dev)
    if node is None or node_count() == 1:
        return  # nothing to choose between, or the platform does not say
    why = bind_to_node(tensor.data_ptr(), tensor.numel(), node)
    if why:
        warn_degraded(f"numa:{why}", f"pointerdomain: numa='local' could not place memory on node {node} "
                                     f"for {dev}: {why}; the memory stays where the kernel put it")


def device_empty(shape: tuple[int, ...], dtype: torch.dtype, device: Device | str | torch.device) -> torch.Tensor:
    """Uninitialised device memory: a CUDA tensor, or emulated device memory (a CPU
    tensor tagged with the emulated ordinal, so CPU-only APIs refuse it).

    Raises:
        InvalidDeviceError: the device does not exist.
        ValueError: a negative dimension.
    """
    dev = validate_device(device)
    if any(d < 0 for d in shape):
        raise ValueError(f"negative dimension in {shape}")
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = backend_for(dev).device_alloc(max(nbytes, 1), dev)  # a 0-byte allocation has no address
    return raw[:nbytes].view(dtype).view(shape)


def memory_device_at(address: int, nbytes: int) -> Device | None:
    """The device whose allocation holds ``[address, address + nbytes)`` when that is
    known from the address alone (emulated device memory), else None. CUDA device
    memory is known by its tensor: use :func:`memory_device`.

    Raises:
        ExtensionUnavailableError: the extension does not import.
    """
    return device_holding(address, nbytes)
