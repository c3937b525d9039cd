"""Transfer-engine metadata (pointerdomain.registration.metadata): HostVA only, JSON."""

from __future__ import annotations

import json

import pytest

import pointerdomain as pd
from pointerdomain import errors
from tests.reference import DEV, model_layout


def test_metadata_is_host_va_only_and_json() -> None:
    with pd.HostKVPool(model_layout("page_first"), DEV) as host:
        infos = host.get_contiguous_buf_infos()
        assert len(infos) == 1 and infos[0].address == host.memory.host_va
        assert infos[0].nbytes == host.layout.nbytes
        assert json.loads(infos[0].model_dump_json())["address"] == host.memory.host_va.value
        assert pd.BufferInfo.model_validate_json(infos[0].model_dump_json()) == infos[0]
        blocks = host.get_page_buffer_meta([2])
        assert [b.nbytes for b in blocks] == [host.layout.page_block_bytes()] * 2
        assert blocks[0].address == host.memory.host_va + 2 * host.layout.page_block_bytes()
        with pytest.raises(errors.DomainError):
            pd.buffer_infos(host.kernel_table, 64)  # type: ignore[arg-type]
        with pytest.raises(Exception):
            pd.BufferInfo(address=host.kernel_table[0], nbytes=1, item_bytes=1)  # type: ignore[arg-type]
