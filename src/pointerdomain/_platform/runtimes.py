"""Each device type's :class:`~pointerdomain.devices.DeviceRuntime`: the device state
(the calling thread's current device, the device count) and the capabilities the layers
above ask instead of branching on a runtime's name. Neither needs the extension: CUDA
devices are torch's, emulated devices are this process's.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, cast

from pointerdomain.arguments import describe
from pointerdomain.errors import InvalidDeviceError

if TYPE_CHECKING:
    import torch

    from pointerdomain.devices import DeviceRuntime

__all__ = ["EMULATED_CURRENT", "CudaRuntime", "EmulatedRuntime", "runtimes"]

#: The calling thread's current emulated device (``ordinal``; 0 where unset): the emulated
#: runtime's state, read directly by the emulated backend's launch check.
class _EmulatedCurrent(threading.local):
    ordinal = 0  # every thread's until it sets its own: read without a getattr default


EMULATED_CURRENT = _EmulatedCurrent()


class CudaRuntime:
    """CUDA devices (HIP devices too: ROCm builds of torch name them ``cuda``), as torch sees them."""

    host_memory = False
    streams = True
    launch_sets_device = True

    def count(self) -> int:
        import torch

        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0

    def current_ordinal(self) -> int:
        import torch

        return int(torch.cuda.current_device())

    def set_ordinal(self, ordinal: int) -> None:
        import torch

        torch.cuda.set_device(ordinal)

    def bare_ordinal(self, text: str) -> int:
        import torch

        if not torch.cuda.is_available():  # torch would raise AssertionError / RuntimeError
            raise InvalidDeviceError(
                f"device {describe(text)}: found no CUDA device (torch.cuda.is_available() is False: a CPU build of "
                "torch, or no GPU visible), expected one to pick the current CUDA device from. Fix: pass "
                "'emulated:0' (or 'cpu') on a machine without a GPU, or an explicit 'cuda:N' where one exists"
            )
        return int(torch.cuda.current_device())

    def torch_device(self, ordinal: int) -> torch.device:
        import torch

        return torch.device("cuda", ordinal)

    def tensor_on(self, tensor: torch.Tensor, ordinal: int) -> bool:
        return tensor.get_device() == ordinal  # -1 for CPU tensors

    def external_stream(self, stream: int, ordinal: int) -> Any:
        import torch

        return cast(Any, torch.cuda).ExternalStream(stream, device=self.torch_device(ordinal))


class EmulatedRuntime:
    """The emulated devices: CPU memory, synchronous launches, a current device per thread."""

    host_memory = True
    streams = False
    launch_sets_device = False

    def count(self) -> int:
        from pointerdomain.devices import emulated_device_count

        return emulated_device_count()

    def current_ordinal(self) -> int:
        return EMULATED_CURRENT.ordinal

    def set_ordinal(self, ordinal: int) -> None:
        EMULATED_CURRENT.ordinal = ordinal

    def bare_ordinal(self, text: str) -> int:
        return 0

    def torch_device(self, ordinal: int) -> torch.device:
        import torch

        return torch.device("cpu")

    def tensor_on(self, tensor: torch.Tensor, ordinal: int) -> bool:
        return not (tensor.is_cuda or tensor.is_meta)  # attributes: ~10x cheaper than tensor.device

    def external_stream(self, stream: int, ordinal: int) -> Any:
        return None  # synchronous launches: nothing to order against


def runtimes() -> dict[str, DeviceRuntime]:
    """A runtime per device type, for :func:`pointerdomain.devices.install_runtimes`."""
    return {"cuda": CudaRuntime(), "emulated": EmulatedRuntime()}


def names_one_device(spec: object) -> bool:
    """A device argument (str or torch.device) that names one device whatever the current
    device is: it has an ordinal, or it is ``"cpu"`` (the emulated device 0's other name)."""
    text = str(spec)
    return ":" in text or text == "cpu"
