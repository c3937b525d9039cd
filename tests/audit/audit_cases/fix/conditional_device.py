# A table whose device is chosen at run time: one builder per case, under the same condition.
import torch


def maybe_device(bufs: list[torch.Tensor], device: torch.device | None = None) -> object:
    return torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64, device=device if device else "cpu")


def device_or_cpu(bufs: list[torch.Tensor], device: torch.device | None = None) -> object:
    return torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64, device=device or "cpu")


def when_available(bufs: list[torch.Tensor]) -> object:
    return torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64,
                        device="cuda" if torch.cuda.is_available() else "cpu")


def cpu_either_way(bufs: list[torch.Tensor], pinned: bool) -> object:
    return torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64,
                        device="cpu" if pinned else torch.device("cpu"))


def chosen_by_a_call(bufs: list[torch.Tensor], pick) -> object:
    return torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64, device=pick() or "cpu")
