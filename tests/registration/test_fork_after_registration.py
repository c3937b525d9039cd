"""Registration leaves the caller's memory as it found it: after ``close()`` the pages are
private anonymous memory again with their bytes, and a forked child's writes never reach
the parent, while the registration is open or after it closed, for a tensor that shares
its page with the malloc heap and for a page-aligned one of several pages.

Each case runs in a forked copy of the test process (so an abort fails the case, not the
run); there it forks again: the child writes and leaves with ``os._exit``, the parent
compares its bytes with the copy it kept."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable

import pytest
import torch

import pointerdomain as pd
from tests.reference import DEV


def _mapping_of(address: int) -> str:
    """The /proc/self/maps line of the mapping that holds ``address``."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return line.strip()
    raise AssertionError(f"{address:#x} is not mapped")


def _child_writes(tensor: torch.Tensor, value: int, also_heap: bool) -> int:
    """Fork; the child fills ``tensor`` with ``value`` (and churns the malloc heap when
    ``also_heap``); returns the child's exit code (0: it saw its own write)."""
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no exceptions past here
        code = 1
        try:
            tensor.fill_(value)
            if also_heap:
                junk = [bytearray(b"x" * (16 + i % 64)) for i in range(20000)]
                del junk
            code = 0 if bool((tensor == value).all()) else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _isolated(case: Callable[[], None]) -> None:
    """Run ``case`` in a forked copy of this process; fails unless it returned normally."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            case()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the case ended with {os.waitstatus_to_exitcode(status)}"


def _small() -> tuple[torch.Tensor, object]:
    """A 24-byte tensor in the malloc heap (its page holds other allocations); the
    second element keeps neighbours alive."""
    neighbours = [torch.full((8,), i, dtype=torch.uint8) for i in range(64)]
    t = torch.empty(24, dtype=torch.uint8)
    return t, neighbours


def _large() -> tuple[torch.Tensor, object]:
    """Four whole pages of their own (an mmap'd allocation)."""
    backing = torch.empty((2 << 20) + 6 * 4096, dtype=torch.uint8)
    start = (-backing.data_ptr()) % 4096
    return backing[start: start + 4 * 4096], backing


@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("closed", [False, True])
def test_a_childs_writes_never_reach_the_parent(size: str, closed: bool) -> None:
    def case() -> None:
        tensor, keep = _small() if size == "small" else _large()
        tensor.copy_(torch.arange(tensor.numel()).to(torch.uint8))
        reg = pd.register_host_tensor(tensor, DEV)
        try:
            if closed:
                reg.close()
            expected = tensor.clone()
            assert _child_writes(tensor, 0xA5, also_heap=size == "small") == 0
            assert torch.equal(tensor, expected)
            # the parent's heap around the tensor still works (the child churned its own heap)
            junk = [bytearray(b"y" * (16 + i % 64)) for i in range(20000)]
            assert all(j[0] == ord("y") for j in junk)
        finally:
            reg.close()
        del keep

    _isolated(case)


@pytest.mark.parametrize("size", ["small", "large"])
def test_close_leaves_private_pages_with_their_bytes(size: str) -> None:
    def case() -> None:
        tensor, keep = _small() if size == "small" else _large()
        tensor.copy_(torch.arange(tensor.numel()).to(torch.uint8) ^ 0x5C)
        before = _mapping_of(tensor.data_ptr())
        with pd.register_host_tensor(tensor, DEV) as reg:
            # written through the registration's own view while it is open: kept after close
            reg.tensor[:8].fill_(0x11)
            expected = tensor.clone()
            assert int(tensor[0]) == 0x11
        after = _mapping_of(tensor.data_ptr())
        assert torch.equal(tensor, expected)
        assert "memfd" not in after and "pointerdomain" not in after, (before, after)
        # private again: this process's writes land, and a child's do not come back
        tensor.fill_(0x22)
        assert _child_writes(tensor, 0x33, also_heap=False) == 0
        assert bool((tensor == 0x22).all())
        del keep

    _isolated(case)


def test_register_again_after_close_keeps_the_bytes() -> None:
    def case() -> None:
        tensor, keep = _large()
        tensor.copy_(torch.arange(tensor.numel()).to(torch.uint8))
        for round_ in range(3):
            with pd.register_host_tensor(tensor, DEV):
                tensor[round_] = 200 + round_
        assert [int(v) for v in tensor[:3]] == [200, 201, 202]
        assert torch.equal(tensor[3:], torch.arange(3, tensor.numel()).to(torch.uint8))
        assert "memfd" not in _mapping_of(tensor.data_ptr())
        del keep

    _isolated(case)


@pytest.mark.parametrize("size", ["small", "large"])
def test_the_parents_later_writes_do_not_reach_a_child(size: str) -> None:
    """While the registration is open, the parent's writes made once the child runs do not
    reach the child (the child's pages are its own from the fork on; writes racing the fork
    itself may), and the child's writes do not reach the parent."""
    def case() -> None:
        tensor, keep = _small() if size == "small" else _large()
        tensor.fill_(0x41)
        with pd.register_host_tensor(tensor, DEV) as reg:
            ready_r, ready_w = os.pipe()
            done_r, done_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    os.write(done_w, b"r")  # running: the parent writes 0x42 now
                    os.read(ready_r, 1)
                    own = bool((tensor == 0x41).all())
                    reg.tensor.fill_(0x43)  # the registration's view: the same bytes
                    coherent = bool((tensor == 0x43).all())
                    code = 0 if own and coherent else 3
                finally:
                    os._exit(code)
            os.read(done_r, 1)
            tensor.fill_(0x42)
            os.write(ready_w, b"x")
            _, status = os.waitpid(pid, 0)
            for fd in (ready_r, ready_w, done_r, done_w):
                os.close(fd)
            assert os.waitstatus_to_exitcode(status) == 0
            assert bool((tensor == 0x42).all())
        del keep

    _isolated(case)


@pytest.mark.parametrize("size", [4096, 3 * 4096])
def test_strict_mode_memory_is_private_in_a_child(size: int) -> None:
    """Strict alias mode maps the library's host memory twice (both shared mappings): a
    child writing either view leaves the parent's bytes as they were."""
    def case() -> None:
        with pd.strict_alias(True):
            mem = pd.alloc_registered(size, DEV)
        with mem:
            mem.tensor.copy_(torch.arange(size).to(torch.uint8))
            expected = mem.tensor.clone()
            assert _child_writes(mem.tensor, 0x77, also_heap=False) == 0
            assert torch.equal(mem.tensor, expected)

    _isolated(case)


def _in_child(body: Callable[[], int]) -> int:
    """Fork; the child runs ``body`` and leaves with its result; returns the child's exit code."""
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no exceptions past here
        code = 99
        try:
            code = body()
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.parametrize("kind", ["alloc_registered", "register_host_tensor"])
def test_a_child_does_no_device_work_over_the_parents_registrations(kind: str) -> None:
    """A fork child's device runtime holds none of the parent's registrations (CUDA does
    not survive fork), and the child's copy of library-owned memory is private per
    mapping: a launch, a new table or an alias over memory registered before the fork is
    refused there (ClosedError) before anything is copied; memory the child registers
    itself works; the parent's registrations are untouched."""
    layout = pd.KVLayout(kind="layer_first", attention="mla", num_layers=1, num_pages=64, page_size=1, num_heads=1,
                         head_dim=256, dtype="uint8")

    def case() -> None:
        n = 64 * 256
        if kind == "alloc_registered":
            mem = pd.alloc_registered(n, DEV)
            host = mem.tensor
        else:
            host = torch.zeros(n, dtype=torch.uint8)
            mem = pd.register_host_tensor(host, DEV)
        device = pd.device_empty((n,), torch.uint8, DEV)
        device.copy_(torch.arange(n).to(torch.uint8))
        host.fill_(1)
        h_table, d_table = pd.make_kernel_ptr_table([host], DEV), pd.make_kernel_ptr_table([device], DEV)
        idx = torch.tensor([3])

        def child() -> int:
            for backend in ("kernel", "copy_engine", "staged"):
                try:
                    pd.transfer_kv_all_layer(d_table, h_table, idx, idx, src_layout=layout, dst_layout=layout,
                                             backend=backend)  # type: ignore[arg-type]
                    return 2
                except pd.errors.ClosedError as exc:
                    if "forked" not in str(exc):
                        return 3
            if not bool((host == 1).all()):
                return 4  # refused before anything was copied
            from pointerdomain.transfer.kernel_args import kernel_table_tensor

            for build in (lambda: pd.make_kernel_ptr_table([host], DEV), lambda: pd.resolve_alias(mem.host_va, DEV),
                          lambda: kernel_table_tensor(h_table, DEV)):  # a custom kernel's boundary too
                try:
                    build()
                    return 5
                except pd.errors.ClosedError:
                    pass
            # memory registered here moves its bytes
            with pd.alloc_registered(n, DEV) as own:
                pd.transfer_kv_all_layer(d_table, pd.make_kernel_ptr_table([own.tensor], DEV), idx, idx,
                                         src_layout=layout, dst_layout=layout)
                if not torch.equal(own.tensor[3 * 256:4 * 256], device[3 * 256:4 * 256]):
                    return 6
            mem.close()  # the child may close what it inherited
            return 0

        assert _in_child(child) == 0
        # the parent's registration still works
        pd.transfer_kv_all_layer(d_table, h_table, idx, idx, src_layout=layout, dst_layout=layout)
        assert torch.equal(host[3 * 256:4 * 256], device[3 * 256:4 * 256])
        mem.close()

    _isolated(case)
