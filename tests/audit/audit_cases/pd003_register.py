# Cases for PD003 (registration calls).
import ctypes

import torch
import torch.nn as nn
from cuda.bindings import driver
from hip import hip
from mooncake.engine import TransferEngine
from nixl._api import nixl_agent


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cos", torch.zeros(4))  # negative: nn.Module.register_buffer
        self.register_buffer("sin", torch.zeros(4), persistent=False)


def register(t: torch.Tensor, nbytes: int) -> None:
    torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)  # expect[PD003]
    cudart = torch.cuda.cudart()
    cudart.cudaHostUnregister(t.data_ptr())  # expect[PD003]
    driver.cuMemHostRegister(t.data_ptr(), nbytes, 0)  # expect[PD003]
    hip.hipHostRegister(t.data_ptr(), nbytes, 0)  # expect[PD003]


class Store:
    def __init__(self) -> None:
        self.engine = TransferEngine()
        self.agent = nixl_agent("a")

    def setup(self, t: torch.Tensor, n: int, addr: int) -> None:
        self.engine.register_memory(t.data_ptr(), n)  # expect[PD003]
        self.engine.register_memory(addr, n)  # expect[PD003]
        self.agent.register_memory(t, "VRAM")  # negative: NIXL given a tensor

    def other(self, registry: object, t: torch.Tensor) -> None:
        registry.register_memory(t)  # negative: not an engine, no int
