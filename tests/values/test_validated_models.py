"""Every public pydantic model validates every derivation.

The models are found by walking the public API (every public module of the package,
every public class that is a ``pydantic.BaseModel``), so a new model is covered as soon
as it exists: it must derive from ``ValidatedModel`` and have a sample below. Each
derivation (class call, ``model_validate`` / ``_json`` / ``_strings``, ``model_copy``
with and without ``update``, ``__replace__``, ``replace``) of each model is tried with
invalid values and must raise; valid derivations must give the values asked for.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pydantic
import pytest

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.audit.config import AuditConfig
from pointerdomain.validated import ValidatedModel

DEV = pd.Device("emulated", 0)
ALIAS = pd.DeviceAlias(0x2000, DEV)


def _public_modules() -> Iterator[str]:
    yield "pointerdomain"
    for info in pkgutil.walk_packages(pd.__path__, "pointerdomain."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            yield info.name


def public_models() -> dict[str, type[pydantic.BaseModel]]:
    """Public pydantic models reachable from the package's public modules, by qualified name."""
    found: dict[str, type[pydantic.BaseModel]] = {}
    for name in _public_modules():
        module = importlib.import_module(name)
        names = set(getattr(module, "__all__", ())) | {a for a in vars(module) if not a.startswith("_")}
        for attr in sorted(names):
            obj = getattr(module, attr, None)
            if (isinstance(obj, type) and issubclass(obj, pydantic.BaseModel) and obj is not ValidatedModel
                    and obj.__module__.startswith("pointerdomain") and not obj.__name__.startswith("_")):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def _layout() -> pd.KVLayout:
    return pd.KVLayout(kind="layer_first", num_layers=2, num_pages=4, page_size=4, num_heads=2, head_dim=8)


#: A valid instance of each public model, the valid changes to try, and invalid changes
#: (field -> bad value) besides the generic ones (an unknown field, an ``object()`` in
#: every field). A model missing here fails test_every_public_model_has_a_sample.
SAMPLES: dict[str, tuple[Callable[[], pydantic.BaseModel], dict[str, Any], list[dict[str, Any]]]] = {
    "pointerdomain.registration.metadata.BufferInfo": (
        lambda: pd.BufferInfo(address=pd.HostVA(0x1000), nbytes=128, item_bytes=64),
        {"nbytes": 64, "address": pd.HostVA(0x4000)},
        [
            {"address": ALIAS},                       # a device alias handed on as a host VA
            {"address": 0x1000},                      # an int has no domain
            {"nbytes": -1},
            {"nbytes": 0},
            {"item_bytes": -64},
            {"nbytes": 96},                           # not whole items
            {"address": pd.HostVA(2**64 - 64)},       # wraps past 2**64
            {"nbytes": True},                         # strict: a bool is not a size
        ],
    ),
    "pointerdomain.layouts.KVLayout": (
        _layout,
        {"num_pages": 8, "kind": "page_first"},
        [
            {"num_pages": 0},
            {"head_dim": -8},
            {"kind": "pagefirst"},
            {"dtype": "float128"},
            {"attention": "mla"},                     # MLA with 2 heads
            {"head_groups": 2},                       # outside page_unified
            {"num_layers": 2.0},
        ],
    ),
    "pointerdomain.audit.config.AuditConfig": (
        lambda: AuditConfig(root=Path("/tmp"), select=("PD0",)),
        {"jobs": 2, "select": ("PD001",)},
        [
            {"jobs": -1},
            {"select": ("XX9",)},                     # no such rule
            {"paths": ["a.py"]},                      # strict: a list is not a tuple
        ],
    ),
}

MODELS = public_models()


def _bad_changes(key: str) -> list[dict[str, Any]]:
    model = MODELS[key]
    generic = [{"no_such_field": 1}, *({field: object()} for field in model.model_fields)]
    return [*SAMPLES[key][2], *generic]


def _ids(changes: dict[str, Any]) -> str:
    # an object's repr holds its address: name its type so every process collects the same ids (pytest-xdist)
    return ",".join(f"{k}=" + (f"<{type(v).__name__}>" if type(v) is object else f"{v!r:.24}") for k, v in changes.items())


def test_models_found() -> None:
    # the walk sees the models the package is known to have (a broken walk would test nothing)
    assert {"pointerdomain.registration.metadata.BufferInfo", "pointerdomain.layouts.KVLayout",
            "pointerdomain.audit.config.AuditConfig"} <= set(MODELS)


def test_every_public_model_has_a_sample() -> None:
    missing = sorted(set(MODELS) - set(SAMPLES))
    assert not missing, f"public pydantic models without a sample in SAMPLES (add one): {missing}"


@pytest.mark.parametrize("key", sorted(MODELS))
def test_model_is_validated_model(key: str) -> None:
    model = MODELS[key]
    assert issubclass(model, ValidatedModel), f"{key} must derive from pointerdomain.validated.ValidatedModel"
    assert model.model_config.get("frozen") is True
    assert model.model_config.get("extra") == "forbid" and model.model_config.get("strict") is True


@pytest.mark.parametrize("key", sorted(SAMPLES))
def test_model_construct_refused(key: str) -> None:
    model = MODELS[key]
    sample = SAMPLES[key][0]()
    with pytest.raises(errors.DomainError, match="model_construct"):
        model.model_construct()
    with pytest.raises(errors.DomainError, match="model_construct"):
        model.model_construct(**{f: getattr(sample, f) for f in model.model_fields})


@pytest.mark.parametrize("key", sorted(SAMPLES))
def test_valid_derivations(key: str) -> None:
    make, good, _ = SAMPLES[key]
    sample = make()
    copied = sample.model_copy()
    assert copied == sample and copied is not sample
    assert sample.model_copy(deep=True) == sample
    derived = sample.model_copy(update=good)
    assert type(derived) is type(sample)
    for field, value in good.items():
        assert getattr(derived, field) == value
    for field in set(type(sample).model_fields) - set(good):
        assert getattr(derived, field) == getattr(sample, field)
    assert sample.__replace__(**good) == derived
    replace = getattr(sample, "replace", None)
    if replace is not None:
        assert replace(**good) == derived
    # derivation leaves the original alone
    assert sample == make()


def _derivations(sample: pydantic.BaseModel, changes: dict[str, Any]) -> Iterator[tuple[str, Callable[[], object]]]:
    model = type(sample)
    fields = {f: getattr(sample, f) for f in model.model_fields}
    yield "model_copy", lambda: sample.model_copy(update=changes)
    yield "model_copy(deep)", lambda: sample.model_copy(update=changes, deep=True)
    yield "__replace__", lambda: sample.__replace__(**changes)
    yield "class call", lambda: model(**{**fields, **changes})
    yield "model_validate", lambda: model.model_validate({**fields, **changes})
    if hasattr(sample, "replace"):
        yield "replace", lambda: getattr(sample, "replace")(**changes)


@pytest.mark.parametrize(
    ("key", "changes"),
    [(key, ch) for key in sorted(SAMPLES) if key in MODELS for ch in _bad_changes(key)],
    ids=lambda v: v.rsplit(".", 1)[-1] if isinstance(v, str) else _ids(v),
)
def test_invalid_derivations_raise(key: str, changes: dict[str, Any]) -> None:
    sample = SAMPLES[key][0]()
    for how, derive in _derivations(sample, changes):
        with pytest.raises(ValueError) as info:  # pydantic.ValidationError and the typed errors are ValueErrors
            derive()
        if key == "pointerdomain.audit.config.AuditConfig":  # the audit's own error tree: ConfigError at load
            assert isinstance(info.value, pydantic.ValidationError), how
        else:
            assert isinstance(info.value, errors.PointerDomainError), f"{how}: {type(info.value).__name__}"


@pytest.mark.parametrize("key", sorted(SAMPLES))
def test_update_that_is_not_a_mapping(key: str) -> None:
    sample = SAMPLES[key][0]()
    with pytest.raises(errors.InvalidTypeError, match="replace"):
        sample.model_copy(update=[("nbytes", 1)])  # type: ignore[arg-type]


@pytest.mark.parametrize("key", sorted(SAMPLES))
def test_frozen(key: str) -> None:
    sample = SAMPLES[key][0]()
    before = sample.model_copy()
    for field in type(sample).model_fields:
        with pytest.raises(ValueError) as info:
            setattr(sample, field, getattr(sample, field))
        with pytest.raises(ValueError) as deleted:
            delattr(sample, field)
        if key != "pointerdomain.audit.config.AuditConfig":
            assert isinstance(info.value, errors.PointerDomainError), type(info.value)
            assert isinstance(deleted.value, errors.PointerDomainError), type(deleted.value)
    assert sample == before


# --------------------------------------------------------------------------- the reported cases


def test_buffer_info_alias_copy_never_reaches_an_engine() -> None:
    """The reported escape: a DeviceAlias through model_copy, then handed to the Mooncake
    wrapper and nixl.dram_desc as a host VA. Now the copy itself raises."""
    from pointerdomain.adapters import nixl

    info = pd.BufferInfo(address=pd.HostVA(0x1000), nbytes=128, item_bytes=64)
    with pytest.raises(errors.MetadataValidationError, match="instance of HostVA"):
        info.model_copy(update={"address": ALIAS})
    with pytest.raises(errors.MetadataValidationError, match="greater than 0"):
        info.model_copy(update={"nbytes": -1})
    assert nixl.dram_desc(info.replace(nbytes=64)).xfer_tuple() == (0x1000, 64, 0)


@pytest.mark.parametrize(("address", "nbytes", "ok"), [
    (2**64 - 64, 128, False),
    (2**64 - 64, 64, True),        # ends exactly at 2**64
    (2**64 - 128, 128, True),
    (2**64 - 64, 128 + 64, False),
])
def test_buffer_info_range_past_2_64(address: int, nbytes: int, ok: bool) -> None:
    if ok:
        info = pd.BufferInfo(address=pd.HostVA(address), nbytes=nbytes, item_bytes=64)
        assert info.address.value + info.nbytes <= 2**64
        return
    with pytest.raises(errors.MetadataValidationError, match=r"runs past 2\*\*64"):
        pd.BufferInfo(address=pd.HostVA(address), nbytes=nbytes, item_bytes=64)
    with pytest.raises(errors.MetadataValidationError, match=r"runs past 2\*\*64"):
        pd.BufferInfo.model_validate_json(f'{{"address": {address}, "nbytes": {nbytes}, "item_bytes": 64}}')


def test_dram_desc_range_past_2_64() -> None:
    from pointerdomain.adapters import nixl

    with pytest.raises(errors.InvalidArgumentError, match=r"runs past 2\*\*64"):
        nixl.dram_desc(pd.HostVA(2**64 - 8), 64)
    assert nixl.dram_desc(pd.HostVA(2**64 - 64), 64).xfer_tuple() == (2**64 - 64, 64, 0)


def test_mooncake_range_past_2_64() -> None:
    from pointerdomain.adapters import mooncake

    class Engine:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def register_memory(self, addr: int, length: int) -> int:
            self.calls.append("register_memory")
            return 0

        def unregister_memory(self, addr: int) -> int:
            return 0

        def transfer_sync_read(self, target: str, buffer: int, peer: int, length: int) -> int:
            self.calls.append("read")
            return 0

        def transfer_sync_write(self, target: str, buffer: int, peer: int, length: int) -> int:
            self.calls.append("write")
            return 0

    engine = Engine()
    wrapper = mooncake.HostTransferEngine(engine, "127.0.0.1")
    with pytest.raises(errors.InvalidArgumentError, match=r"runs past 2\*\*64"):
        wrapper.register_memory(pd.HostVA(2**64 - 8), 64)
    with pytest.raises(errors.InvalidArgumentError, match=r"runs past 2\*\*64"):
        wrapper.transfer_sync_write("peer:1", pd.HostVA(2**64 - 8), pd.HostVA(0x1000), 64)
    assert engine.calls == []
