"""The layer pipeline (``HostKVPool.load_layers`` / ``pd.load_layers``): every layer queued
at once, exact bytes against the torch reference, per-layer completion, and the call's
errors raised before the first layer is queued."""

from __future__ import annotations

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from tests.helpers.checks import assert_round_trip
from tests.reference import DEV, as_bytes, fill_pool, filled_pools, model_layout, pool_bytes

#: Also run in strict alias mode by CI (python -m pytest -m strict_alias --strict-alias).
pytestmark = pytest.mark.strict_alias


@pytest.mark.parametrize("attention", ["mha", "mla"])
@pytest.mark.parametrize("kind", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("backend", ["auto", "kernel", "copy_engine"])
def test_load_layers_moves_the_reference_bytes(kind: str, attention: str, backend: str) -> None:
    dev_layout = model_layout("layer_first", pages=6, attention=attention)
    host_layout = model_layout(kind, pages=10, attention=attention)
    with filled_pools(dev_layout, host_layout, DEV, chunk_blocks=None, seed=3) as (pool, host):
        dev_slots = torch.tensor([0, 5, 23, 7, 12, 13])
        host_slots = torch.tensor([39, 2, 8, 17, 30, 31])
        loads: list[pd.LayerLoad] = []

        def load() -> None:
            loads.append(host.load_layers(pool, host_slots, dev_slots, backend=backend))  # type: ignore[arg-type]

        assert_round_trip(pool, host, dev_slots, host_slots, poison_seed=77, load=load)
        (done,) = loads
        assert done.num_layers == dev_layout.num_layers
        assert all(done.ready(layer) for layer in range(done.num_layers))  # synchronous device: all done
        for layer in range(done.num_layers):
            done.wait(layer)
            done.wait(layer, stream=0)
        done.synchronize()


def test_load_layers_touches_only_the_given_slots_of_every_layer() -> None:
    """A poisoned destination: the bytes outside the moved slots stay the poison."""
    pool = pd.DeviceKVPool(model_layout(), DEV)
    fill_pool(pool, 9)
    before = pool_bytes(pool).clone()
    with pd.HostKVPool(model_layout("page_first"), DEV) as host:
        torch.manual_seed(0)
        as_bytes(host.buffer).copy_(torch.randint(0, 256, as_bytes(host.buffer).shape, dtype=torch.uint8))
        empty = torch.empty(0, dtype=torch.int64)
        host.load_layers(pool, empty, empty)
        assert torch.equal(pool_bytes(pool), before)  # nothing to move: nothing written


def test_layer_load_refuses_a_layer_it_did_not_queue() -> None:
    with filled_pools(model_layout(), model_layout("page_first"), DEV, chunk_blocks=None, seed=1) as (pool, host):
        idx = torch.arange(4)
        done = host.load_layers(pool, idx, idx)
        for bad in (-1, done.num_layers, 2**70):
            with pytest.raises(errors.IndexValidationError, match="layer"):
                done.wait(bad)
            with pytest.raises(errors.IndexValidationError, match="layer"):
                done.ready(bad)
        for wrong in (1.0, "0", True, None):
            with pytest.raises(errors.IndexValidationError, match="expected an int"):
                done.wait(wrong)  # type: ignore[arg-type]
        for stream in (-1, 2**64, "0", 1.5):
            with pytest.raises(errors.InvalidArgumentError, match="stream"):
                done.wait(0, stream=stream)  # type: ignore[arg-type]
        assert "LayerLoad(3 layers" in repr(done)


def test_load_layers_errors_come_before_any_layer_is_queued() -> None:
    pool = pd.DeviceKVPool(model_layout(), DEV)
    fill_pool(pool, 4)
    before = pool_bytes(pool).clone()
    with pd.HostKVPool(model_layout("page_first"), DEV) as host:
        ok = torch.arange(4)
        cases: list[tuple[dict[str, object], type[Exception], str]] = [
            ({"host_indices": torch.tensor([0, 1, 2, 999])}, errors.IndexValidationError, "outside"),
            ({"device_indices": ok[:3]}, errors.IndexValidationError, "has 3"),
            ({"stream": -5}, errors.InvalidArgumentError, "stream"),
            ({"backend": "fast"}, errors.InvalidArgumentError, "backend"),
            ({"max_ctas": -3}, errors.InvalidArgumentError, "max_ctas"),
            ({"backend": "staged"}, errors.InvalidArgumentError, "one copy per layer"),
        ]
        for change, error, match in cases:
            kwargs: dict[str, object] = {"host_indices": ok, "device_indices": ok}
            kwargs.update(change)
            host_idx, dev_idx = kwargs.pop("host_indices"), kwargs.pop("device_indices")
            with pytest.raises(error, match=match):
                host.load_layers(pool, host_idx, dev_idx, **kwargs)  # type: ignore[arg-type]
            assert torch.equal(pool_bytes(pool), before)
        with pytest.raises(errors.InvalidTypeError):
            host.load_layers(host, ok, ok)  # type: ignore[arg-type]
    with pytest.raises(errors.ClosedError):
        host.load_layers(pool, ok, ok)
    assert torch.equal(pool_bytes(pool), before)


def test_module_function_takes_tables_and_layouts() -> None:
    with filled_pools(model_layout(), model_layout("page_first"), DEV, chunk_blocks=None, seed=2) as (pool, host):
        idx = torch.tensor([3, 1, 4, 1 + 8, 5])
        fill_pool(pool, 5)
        done = pd.load_layers(host.kernel_table, pool.table, idx, idx, src_layout=host.layout,
                              dst_layout=pool.layout)
        assert done.num_layers == 3
        with pytest.raises(errors.DomainError):
            pd.load_layers(host.host_table, pool.table, idx, idx, src_layout=host.layout,  # type: ignore[arg-type]
                           dst_layout=pool.layout)
        with pytest.raises(errors.InvalidArgumentError, match="KVLayout"):
            pd.load_layers(host.kernel_table, pool.table, idx, idx, src_layout="x",  # type: ignore[arg-type]
                           dst_layout=pool.layout)
