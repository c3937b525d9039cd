"""Checked kernel-table arguments for tensor-taking kernels (torch ops, Triton): the checks
are plain Python and run here without Triton or a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.transfer.kernel_args import check_kernel_table, kernel_table_tensor
from pointerdomain.transfer.triton import kernel_table_arg, launch, launch_args

DEV = "emulated:0"


def test_kernel_table_tensor_is_a_checked_copy_of_the_aliases() -> None:
    with pd.alloc_registered(8192, DEV) as mem:
        parts = list(mem.tensor.view(2, 4096).unbind(0))
        table = pd.make_kernel_ptr_table(parts, DEV)
        host = pd.host_ptr_table(parts)
        ptrs = kernel_table_tensor(table, DEV)
        assert ptrs.dtype == torch.uint64 and ptrs.tolist() == [a.value for a in table]
        assert ptrs.tolist() != [h.value for h in host]            # aliases, not host VAs (emulated)
        signed = kernel_table_arg(table, pd.Device("emulated", 0))
        assert signed.dtype == torch.int64 and signed.view(torch.uint64).tolist() == ptrs.tolist()
        ptrs.zero_()                                                 # a copy: the table is unchanged
        assert kernel_table_tensor(table, DEV).tolist() == [a.value for a in table]
        assert check_kernel_table(table, "emulated:0") == pd.Device("emulated", 0)


def test_refusals() -> None:
    with pd.alloc_registered(4096, DEV) as mem:
        table = pd.make_kernel_ptr_table([mem.tensor], DEV)
        bad: list[object] = [pd.host_ptr_table([mem.tensor]), table.as_uint64_tensor(), table[0].value, table[0], None]
        for b in bad:
            with pytest.raises(errors.DomainError):
                kernel_table_tensor(b, DEV)  # type: ignore[arg-type]
            with pytest.raises(errors.DomainError):
                kernel_table_arg(b, DEV)  # type: ignore[arg-type]
        with pytest.raises(errors.DomainError, match=r"PointerTable\[HostVA\]"):
            kernel_table_arg(pd.host_ptr_table([mem.tensor]), DEV)  # type: ignore[arg-type]
        with pytest.raises(errors.DeviceMismatchError, match="emulated:0 was given for a launch on emulated:1"):
            kernel_table_arg(table, "emulated:1")
        # a GPU that is there: another device; none: a device that does not exist
        with pytest.raises(errors.DeviceMismatchError if torch.cuda.is_available() else errors.InvalidDeviceError):
            kernel_table_arg(table, "cuda:0")
        with pytest.raises(errors.InvalidArgumentError):
            kernel_table_tensor(table, DEV, dtype="int32")  # type: ignore[arg-type]
    with pytest.raises(errors.ClosedError):
        kernel_table_arg(table, DEV)


def test_launch_arguments_are_checked_before_triton() -> None:
    with pd.alloc_registered(4096, DEV) as mem:
        table = pd.make_kernel_ptr_table([mem.tensor], DEV)
        args, kwargs = launch_args(DEV, (table, 5, torch.zeros(3, dtype=torch.int64)), {"t": table, "BLOCK": 128})
        assert args[0].dtype == torch.int64 and args[0].tolist() == [table[0].value]  # type: ignore[attr-defined]
        assert args[1] == 5 and kwargs["BLOCK"] == 128
        assert kwargs["t"].tolist() == [table[0].value]  # type: ignore[attr-defined]
        for bad in (pd.host_ptr_table([mem.tensor]), table.as_uint64_tensor(), table[0], pd.host_ptr_table([mem.tensor])[0]):
            with pytest.raises(errors.DomainError):
                launch_args(DEV, (bad,), {})
        other_gpu = errors.DeviceMismatchError if torch.cuda.is_available() else errors.InvalidDeviceError
        with pytest.raises(other_gpu):
            launch_args("cuda:0", (table,), {})

        class NeverLaunched:
            def __getitem__(self, grid: object) -> object:
                raise AssertionError("launched")

        with pytest.raises(errors.InvalidDeviceError, match="need a CUDA device"):
            launch(NeverLaunched(), (1,), table, device=DEV)
        with pytest.raises(other_gpu):          # checked before Triton is imported
            launch(NeverLaunched(), (1,), table, device="cuda:0")


def test_importing_pointerdomain_never_imports_triton() -> None:
    code = (
        "import sys, torch; before = 'triton' in sys.modules; "
        "import pointerdomain, pointerdomain.transfer.triton, pointerdomain.transfer.kernel_args, pointerdomain.adapters.nixl; "
        "assert ('triton' in sys.modules) == before, 'triton imported'; "
        "assert 'nixl' not in sys.modules and 'nixl._api' not in sys.modules, 'nixl imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
