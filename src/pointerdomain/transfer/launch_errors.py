"""Deferred launch errors: the per-device error word the transfer kernels set.

Design: one ``uint32`` word per device, in that device's memory (emulated devices:
emulated device memory, i.e. host memory), allocated and zeroed ahead of the device's
first launch: when a pool builds its first kernel table on the device
(:mod:`pointerdomain.transfer.pools`), else at the device's first launch plan
(:mod:`pointerdomain.transfer.plan`). The device's kernels are loaded then too
(:meth:`Backend.load_kernels`), outside a graph capture only. The word is kept for the life of
the process, so a captured graph that holds its address never sees it freed. Every
launch plan binds the word's address (``_C.KernelPlan.oob``); a kernel that skips a
slot pair for being outside ``[0, num_slots)`` of its table sets bit :data:`OUT_OF_RANGE`
there (``src/kernels/transfer.h``, ``Transfer.oob``) and copies nothing for that pair.

Where the indices are not read on the host before the launch (CUDA with
``validate_indices=True``, graph replays on every device), a launch of a checked plan
refuses a destination slot given twice on the device: a validation pass ahead of the copy,
on the same stream, marks each destination slot in a scratch bitmap (one bit per slot of
the destination, ``Transfer.marks``) and, on a slot marked twice, sets bit
:data:`DUPLICATE` and has the copy write nothing at all (two writes to one slot race on a
GPU; which would land is chance). No host sync, and it is captured into a graph like the
copy (a memset, a small kernel). The scratch is per stream (launches on one stream run in
order); a captured launch gets scratch of its own, held by its graph. Cost on CUDA: a
memset of ``num_slots / 8`` bytes of the destination and a kernel of one thread per index
pair, two more launches per transfer (about 4 us of host time; not measured yet on a
GPU). ``validate_indices=False`` skips it, as it skips the range report.

Reporting:

* synchronous backends (the emulated CPU device): the launch reads the word right
  after the copy and raises :class:`~pointerdomain.errors.IndexValidationError` at once;
* CUDA: nothing is read on the launch path (no host sync; graph capture and replay
  unaffected). :func:`check_errors` or :func:`synchronize` synchronises the device,
  reads the word, clears it, and raises if it was set: :class:`~pointerdomain.errors.OverlapError`
  for a duplicate destination slot, else ``IndexValidationError``. The error says that
  some launch on the device since the previous check skipped slots or copied nothing; which
  one is not recorded (one word per device keeps the launch free of extra arguments and writes).
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
from pointerdomain.errors import IndexValidationError, OverlapError

__all__ = ["DUPLICATE", "OUT_OF_RANGE", "check_errors", "ensure_error_word", "error_word_address", "host_word", "raise_now", "synchronize", "take", "take_bits"]

#: Bits of the error word (``kOutOfRange``, ``kDuplicate`` in ``src/kernels/transfer.h``).
OUT_OF_RANGE = 1
DUPLICATE = 2

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
                side = cuda.Stream(device=device.torch_device) if device.runtime.streams and not capturing else None
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


def _duplicate_message(device: Device, also_range: bool) -> str:
    return (
        f"a transfer on {device} since the last check had a destination slot twice in dst_indices: two writes to "
        "one slot race on a GPU, so that launch copied nothing (its validation pass found it before any byte was "
        "written)" + ("; also, a launch skipped slot pairs outside its tables" if also_range else "") + ". Fix: give "
        "each destination slot once per call; launch with validate_indices='host' to find the launch"
    )


def take_bits(device: Device) -> int:
    """Read and clear the word of ``device`` after synchronising it: its bits
    (:data:`OUT_OF_RANGE`, :data:`DUPLICATE`), 0 when clear."""
    word = _words.get(device)
    if word is None:
        return 0
    platform = backend_for(device)
    view = _host_views.get(device)
    if view is not None and platform.host_readable:
        bits = int(view.value)
        if bits:
            view.value = 0
        return bits
    platform.synchronize(device)
    bits = int(word.item()) & 0xFFFFFFFF
    if bits == 0:
        return 0
    word.zero_()
    platform.synchronize(device)
    return bits


def take(device: Device) -> bool:
    """Read and clear the word of ``device`` after synchronising it; True if it was set."""
    return take_bits(device) != 0


def _raise_for(device: Device, bits: int) -> None:
    if bits & DUPLICATE:
        raise OverlapError(_duplicate_message(device, bool(bits & OUT_OF_RANGE)))
    if bits:
        raise IndexValidationError(_message(device))


def check_errors(device: Device | str | torch.device | None = None) -> None:
    """Report out-of-range slots that earlier launches skipped.

    Synchronises ``device`` (every device with an error word when None), reads its
    error word and clears it.

    Raises:
        IndexValidationError: a launch since the previous check skipped a slot pair
            whose index was outside ``[0, num_slots)``.
        OverlapError: a launch since the previous check had a destination slot twice and
            copied nothing (see the module docstring).
        InvalidDeviceError: ``device`` does not exist.
    """
    devices = list(_words) if device is None else [validate_device(device)]
    for dev in devices:
        _raise_for(dev, take_bits(dev))


def synchronize(device: Device | str | torch.device | None = None) -> None:
    """Wait for the device's queued work (``cudaDeviceSynchronize``; a no-op on the
    emulated device), then :func:`check_errors`.

    Raises:
        IndexValidationError: as :func:`check_errors`.
        OverlapError: as :func:`check_errors`.
        InvalidDeviceError: ``device`` does not exist.
    """
    devices = list(_words) if device is None else [validate_device(device)]
    for dev in devices:
        backend_for(dev).synchronize(dev)
    check_errors(device)


def raise_now(device: Device) -> None:
    """For synchronous launches: raise at once if the word is set (clearing it)."""
    _raise_for(device, take_bits(device))
