# The device held in a name: followed where it is bound once, refused where it may be the CPU.
import torch

HOST = "cpu"


class HostPool:
    def __init__(self, bufs: list[torch.Tensor]) -> None:
        self.device = "cpu"
        self.ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64, device=self.device)


class MovedPool:
    def __init__(self, bufs: list[torch.Tensor]) -> None:
        self.device = "cpu"
        self.ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64, device=self.device)

    def move(self) -> None:
        self.device = "cuda"


def default_cpu(bufs: list[torch.Tensor], device: str = "cpu") -> object:
    return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64, device=device)


def local_cpu(bufs: list[torch.Tensor]) -> object:
    dev = "cpu"
    return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64, device=dev)


def module_cpu(bufs: list[torch.Tensor]) -> object:
    return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64, device=HOST)


def local_torch_device(bufs: list[torch.Tensor]) -> object:
    dev = torch.device("cpu")
    return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64, device=dev)


def reassigned(bufs: list[torch.Tensor], on_gpu: bool) -> object:
    dev = "cpu"
    if on_gpu:
        dev = "cuda"
    return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64, device=dev)


def local_cuda(bufs: list[torch.Tensor]) -> object:
    dev = "cuda"
    return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64, device=dev)


def literal_cpu(bufs: list[torch.Tensor]) -> object:
    return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64, device="cpu")


def caller_device(bufs: list[torch.Tensor], device: torch.device) -> object:
    return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64, device=device)
