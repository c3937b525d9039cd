"""A device that does not exist is named as such (InvalidDeviceError) wherever a launch
takes a device, never reported as a mismatch with the table (DeviceMismatchError)."""

from __future__ import annotations

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.transfer.kernel_args import check_kernel_table, kernel_table_tensor
from tests.reference import DEV


def test_kernel_argument_checks_name_a_missing_device() -> None:
    table = pd.make_kernel_ptr_table([pd.device_empty((64,), torch.uint8, DEV)], DEV)
    for call in (lambda: check_kernel_table(table, "emulated:9"), lambda: kernel_table_tensor(table, "emulated:9")):
        with pytest.raises(errors.InvalidDeviceError, match="does not exist"):
            call()
    assert check_kernel_table(table, DEV) == DEV

