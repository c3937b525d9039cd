"""Deferred launch errors: the per-device error word the transfer kernels set.

Design: one ``uint32`` word per device, in that device's memory (emulated devices:
emulated device memory, i.e. host memory), allocated and zeroed ahead of the device's
first launch: when a pool builds its first kernel table on the device
(:mod:`pointerdomain.transfer.pools`), else at the device's first launch plan
(:mod:`pointerdomain.transfer.plan`). The device's kernels are loaded then too
(:meth:`Backend.load_kernels`), outside a graph capture only. The word is kept for the life of
the process, so a captured graph that holds its address never sees it freed. Every
launch plan binds the word's address (``_C.KernelPlan.oob``); a kernel that skips a
slot pair for being outside ``[0, num_slots)`` of its table stores 1 there
(``src/kernels/transfer.h``, ``Transfer.oob``) and copies nothing for that pair.

Reporting:

* synchronous backends (the emulated CPU device): the launch reads the word right
  after the copy and raises :class:`~pointerdomain.errors.IndexValidationError` at once;
* CUDA: nothing is read on the launch path (no host sync; graph capture and replay
  unaffected). :func:`check_errors` or :func:`synchronize` synchronises the device,
  reads the word, clears it, and raises if it was set. The error says that some
  launch on the device since the previous check skipped slots; which one is not
  recorded (one word per device keeps the launch free of extra arguments and writes).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Any

import torch

from pointerdomain._platform import backend_for
from pointerdomain.registration.allocation import device_empty
from pointerdomain.devices import Device, validate_device
from pointerdomain.errors import IndexValidationError

__all__ = ["check_errors", "ensure_error_word", "error_word_address", "host_word", "raise_now", "synchronize", "take"]

_lock = threading.Lock()
_words: dict[Device, torch.Tensor] = {}
_host_views: dict[Device, ctypes.c_uint32] = {}


def ensure_error_word(device: Device) -> int:
    """The address of ``device``'s error word, allocating and zeroing it on first use."""
    word = _words.get(device)
    if word is None:
        with _lock:
            word = _words.get(device)
            if word is None:
                platform = backend_for(device)
                capturing = platform.is_capturing(device)
                if not capturing:
                    # Ahead of the launch where a pool called this: lazy module loading would load
                    # each kernel at the first launch, and loading may wait for all work queued on
                    # the device.
                    platform.load_kernels(device)
                # CUDA: zeroed on a private stream and waited for there, since the caller's
                # streams may hold queued work (a first launch queued behind compute must not
                # wait for it); elsewhere a device sync. Either way the word is zero before
                # any launch on any stream can set it (during capture: ordered in the graph).
                cuda: Any = torch.cuda  # Stream is untyped in torch's stubs
                side = cuda.Stream(device=device.torch_device) if device.type == "cuda" and not capturing else None
                with cuda.stream(side) if side is not None else contextlib.nullcontext():
                    word = device_empty((1,), torch.int32, device)
                    word.zero_()
                if side is not None:
                    side.synchronize()
                elif not capturing:
                    platform.synchronize(device)
                if platform.host_readable:
                    _host_views[device] = ctypes.c_uint32.from_address(word.data_ptr())
                _words[device] = word
    return int(word.data_ptr())


def error_word_address(device: Device) -> int:
    """Alias of :func:`ensure_error_word` for the plan builder (a device's first plan
    makes its word and loads its kernels where no pool did before)."""
    return ensure_error_word(device)


def host_word(device: Device) -> ctypes.c_uint32 | None:
    """A CPU view of the word where the device's memory is host-readable, else None."""
    return _host_views.get(device)


def _message(device: Device) -> str:
    return (
        f"a transfer on {device} since the last check had a slot index outside its table's [0, num_slots): "
        "the kernel skipped those slot pairs (nothing was written outside the tables, and those slots were "
        "not copied). Fix: keep indices in range; launch with validate_indices='host' to find the launch "
        "(a host-side check before each launch)"
    )


def take(device: Device) -> bool:
    """Read and clear the word of ``device`` after synchronising it; True if it was set."""
    word = _words.get(device)
    if word is None:
        return False
    platform = backend_for(device)
    view = _host_views.get(device)
    if view is not None and platform.host_readable:
        if view.value == 0:
            return False
        view.value = 0
        return True
    platform.synchronize(device)
    if int(word.item()) == 0:
        return False
    word.zero_()
    platform.synchronize(device)
    return True


def check_errors(device: Device | str | torch.device | None = None) -> None:
    """Report out-of-range slots that earlier launches skipped.

    Synchronises ``device`` (every device with an error word when None), reads its
    error word and clears it.

    Raises:
        IndexValidationError: a launch since the previous check skipped a slot pair
            whose index was outside ``[0, num_slots)``.
        InvalidDeviceError: ``device`` does not exist.
    """
    devices = list(_words) if device is None else [validate_device(device)]
    for dev in devices:
        if take(dev):
            raise IndexValidationError(_message(dev))


def synchronize(device: Device | str | torch.device | None = None) -> None:
    """Wait for the device's queued work (``cudaDeviceSynchronize``; a no-op on the
    emulated device), then :func:`check_errors`.

    Raises:
        IndexValidationError: as :func:`check_errors`.
        InvalidDeviceError: ``device`` does not exist.
    """
    devices = list(_words) if device is None else [validate_device(device)]
    for dev in devices:
        backend_for(dev).synchronize(dev)
    check_errors(device)


def raise_now(device: Device) -> None:
    """For synchronous launches: raise at once if the word is set (clearing it)."""
    if take(device):
        raise IndexValidationError(_message(device))
