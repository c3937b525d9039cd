"""Two writes to one destination slot in one launch race on a GPU: refused with
OverlapError before anything is copied, on every backend that reads indices on the host."""

from __future__ import annotations

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.transfer.overlap import check_distinct_destinations
from tests.reference import DEV, fill_random, model_layout


@pytest.mark.parametrize("backend", ["auto", "kernel", "copy_engine", "staged"])
@pytest.mark.parametrize("kind", ["page_first", "page_head"])
def test_duplicate_destination_slots_are_refused(backend: str, kind: str) -> None:
    device = pd.DeviceKVPool(model_layout("layer_first"), DEV)
    fill_random(torch.stack([b.view(torch.uint8) for b in device.buffers]), 3)
    with pd.HostKVPool(model_layout(kind), DEV) as host:
        fill_random(host.buffer.view(torch.uint8), 4)
        before = host.buffer.view(torch.uint8).clone()
        src = torch.tensor([0, 1, 2], dtype=torch.int64)
        dst = torch.tensor([5, 9, 5], dtype=torch.int64)
        with pytest.raises(errors.OverlapError, match="slot 5"):
            host.backup(device, src, dst, backend=backend)  # type: ignore[arg-type]
        assert torch.equal(host.buffer.view(torch.uint8), before)
        host.backup(device, src, torch.tensor([5, 9, 6]), backend=backend)  # type: ignore[arg-type]
        with pytest.raises(errors.OverlapError):
            host.load(device, torch.tensor([0, 1]), torch.tensor([7, 7]), backend=backend)  # type: ignore[arg-type]


def test_large_index_sets() -> None:
    dst = torch.arange(10_000, dtype=torch.int64)
    check_distinct_destinations(dst)
    dst[7_777] = 42
    with pytest.raises(errors.OverlapError, match="slot 42"):
        check_distinct_destinations(dst[torch.randperm(10_000)])
