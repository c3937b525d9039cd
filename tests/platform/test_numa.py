"""NUMA records (pointerdomain._platform.numa): each registration records its node;
numa="local" places memory on the device's node (a no-op, tested, on one node)."""

from __future__ import annotations

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain._platform import numa
from tests.reference import DEV, model_layout


def test_registration_records_a_node() -> None:
    with pd.alloc_registered(1 << 16, DEV) as mem:
        assert mem.numa_node is not None and 0 <= mem.numa_node < numa.node_count()
        if numa.node_count() == 1:
            assert mem.numa_node == 0
    t = torch.ones(1 << 16, dtype=torch.uint8)
    with pd.register_host_tensor(t, DEV) as mem:
        assert mem.numa_node == numa.node_of(t.data_ptr())


def test_local_places_on_the_device_node_or_is_a_no_op_on_one_node() -> None:
    node = numa.device_node(DEV)
    with pd.alloc_registered(1 << 16, DEV, numa="local") as mem:
        if numa.node_count() == 1:
            assert node == 0 and mem.numa_node == 0
        elif node is not None:
            assert mem.numa_node == node
    with pd.HostKVPool(model_layout("page_first", 4), DEV, numa="local") as host:
        assert host.memory.numa_node is not None


def test_numa_argument_is_checked() -> None:
    with pytest.raises(errors.InvalidRegistrationError):
        pd.alloc_registered(4096, DEV, numa="remote")  # type: ignore[arg-type]


def test_numa_maps_fallback_agrees_with_the_syscall() -> None:
    t = torch.ones(1 << 20, dtype=torch.uint8)
    assert numa._node_from_numa_maps(t.data_ptr()) == numa.node_of(t.data_ptr())
    assert numa._node_from_numa_maps(1) is None  # an address no mapping holds


def test_bind_to_a_node_moves_or_says_why() -> None:
    t = torch.ones(1 << 20, dtype=torch.uint8)
    why = numa.bind_to_node(t.data_ptr(), t.numel(), 0)
    assert why == "" or "mbind failed" in why
    if why == "":
        assert numa.node_of(t.data_ptr()) == 0
    assert "beyond" in numa.bind_to_node(t.data_ptr(), 4096, 10_000)


@pytest.mark.gpu
def test_gpu_node_is_read_from_sysfs() -> None:
    node = numa.device_node(pd.Device("cuda", 0))
    assert node is None or 0 <= node < numa.node_count()
    with pd.alloc_registered(1 << 20, "cuda:0", numa="local") as mem:
        if node is not None and numa.node_count() > 1:
            assert mem.numa_node == node
