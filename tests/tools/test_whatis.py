"""pointerdomain.explain / `pointerdomain whatis`, and the explanation typed errors carry."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from tests.reference import fill_pool, model_layout, table_storage

#: Also run in strict alias mode by CI (python -m pytest -m strict_alias --strict-alias).
pytestmark = pytest.mark.strict_alias

PAGE = 4096
EMU = "emulated:0"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pointerdomain", *args], capture_output=True, text=True, timeout=300)


def test_explain_host_va_alias_and_closed() -> None:
    mem = pd.alloc_registered(3 * PAGE, EMU, max_chunk_bytes=PAGE)
    va = mem.host_va + (PAGE + 904)
    alias = pd.resolve_alias(va, EMU)
    got = pd.explain(va)
    assert (got.domain, got.kind, got.state, got.device) == ("host_va", "registration", "open", "emulated:0")
    assert (got.base, got.nbytes, got.offset, got.chunk) == (mem.host_va.value, 3 * PAGE, PAGE + 904, (2, 3))
    assert got.other_domain_address == alias.value != va.value
    assert got.rung == mem.rung.value  # the ladder's record
    assert got.maps_line is not None and got.maps_line.startswith(f"{mem.host_va.value:x}-")
    assert got.pid == os.getpid()
    back = pd.explain(alias)  # the alias side names the same byte in the host domain
    assert (back.domain, back.other_domain_address, back.offset, back.chunk) == ("device_alias", va.value, 904, (2, 3))
    assert back.base == pd.resolve_alias(mem.host_va + PAGE, EMU).value
    assert "DeviceAlias" in back.text() and f"host VA: {va.value:#x}" in back.text()
    mem.close()
    closed = pd.explain(va)
    assert (closed.domain, closed.state, closed.other_domain_address) == ("host_va", "closed", None)
    assert pd.explain(alias).domain != "device_alias"  # its alias mapping is gone


def test_explain_alias_on_a_second_device() -> None:
    # one portable registration, aliases on two devices (kernel_table_for / resolve_alias)
    layout = model_layout("page_first", pages=4)
    with pd.HostKVPool(layout, EMU) as host:
        va = host.memory.host_va
        alias0 = host.kernel_table[0]
        alias1 = host.kernel_table_for("emulated:1")[0]
        assert alias1.value != alias0.value
        got = pd.explain(alias1.value + 40)
        assert (got.domain, got.device, got.state) == ("device_alias", "emulated:1", "open")
        assert (got.base, got.offset, got.other_domain_address) == (alias1.value, 40, va.value + 40)
        assert any("made for emulated:0" in note for note in got.notes)
        assert pd.explain(alias0).device == "emulated:0"  # the own device's alias as before
        side = pd.explain(va)  # the host VA names the own device's alias, and lists the other
        assert (side.domain, side.device, side.other_domain_address) == ("host_va", "emulated:0", alias0.value)
        assert any(f"emulated:1: {alias1.value:#x}" in note for note in side.notes)
    plain = pd.alloc_registered(PAGE, EMU)  # resolved on emulated:1 only through resolve_alias
    try:
        alias = pd.resolve_alias(plain.host_va + 8, "emulated:1")
        got = pd.explain(alias)
        assert (got.domain, got.device, got.other_domain_address) == ("device_alias", "emulated:1", plain.host_va.value + 8)
    finally:
        plain.close()


def test_explain_driver_view_of_an_open_registration_is_registered() -> None:
    mem = pd.alloc_registered(PAGE, EMU)
    if pd.strict_alias_enabled():  # the host VA is never registered: its twin mapping is
        registered = mem.registered_address_of(mem.host_va)
        assert registered != mem.host_va.value
        host_side = pd.explain(mem.host_va).pointer_attributes["emulated"]
        assert host_side["registered_host"] is False and host_side["alias_status"] != 0
    else:
        registered = mem.host_va.value
    open_ = pd.explain(registered).pointer_attributes["emulated"]
    assert open_["registered_host"] is True and open_["alias_status"] == 0
    alias = pd.resolve_alias(mem.host_va, EMU)
    assert pd.explain(alias).pointer_attributes["emulated"]["registered_host"] is False  # an alias, not host memory
    mem.close()
    assert pd.explain(registered).pointer_attributes["emulated"]["registered_host"] is False  # closed: unregistered
    plain = torch.empty(PAGE, dtype=torch.uint8)
    assert pd.explain(plain.data_ptr()).pointer_attributes["emulated"]["registered_host"] is False


def test_explain_device_memory_and_unknown() -> None:
    dev = pd.device_empty((PAGE,), torch.uint8, "emulated:1")
    got = pd.explain(dev.data_ptr() + 17)
    assert (got.domain, got.device) == ("device_memory", "emulated:1")
    plain = torch.empty(PAGE, dtype=torch.uint8)
    unknown = pd.explain(plain.data_ptr())
    assert unknown.domain == "unknown" and unknown.owner is None and unknown.maps_line is not None
    assert pd.explain(8).maps_line is None
    with pytest.raises(errors.InvalidArgumentError):
        pd.explain(-1)
    with pytest.raises(errors.InvalidArgumentError):
        pd.explain(2**64)
    json.dumps(got.to_json())  # JSON-ready


def test_errors_with_an_address_explain_it() -> None:
    with pd.alloc_registered(2 * PAGE, EMU, max_chunk_bytes=PAGE) as mem:
        with pytest.raises(errors.RegistrationSpanError) as span:
            mem.chunk_of(mem.host_va + (PAGE - 8), 16)
        assert span.value.address == mem.host_va.value + PAGE - 8
        info = span.value.explain()
        assert info is not None and info.domain == "host_va" and info.chunk == (1, 2)
        assert any("pointerdomain.explain(" in note for note in span.value.__notes__)
    plain = torch.empty(PAGE, dtype=torch.uint8)
    with pytest.raises(errors.NotRegisteredError) as missing:
        pd.resolve_alias(pd.HostVA(plain.data_ptr()), EMU)
    assert missing.value.address == plain.data_ptr()
    explained = missing.value.explain()
    assert explained is not None and explained.domain == "unknown"
    assert errors.InvalidArgumentError("no address").explain() is None


def test_checked_mode_domain_error_explains_the_host_va() -> None:
    layout = model_layout("page_first", pages=4)
    dev = pd.DeviceKVPool(model_layout("layer_first", pages=4), EMU)
    fill_pool(dev, 1)
    with pd.HostKVPool(layout, EMU) as host:
        raw = table_storage(host.kernel_table)
        raw[0] = host.memory.host_va.value  # the core fault: a host VA reaching a kernel
        slots = torch.arange(layout.page_size)
        with pytest.raises(errors.DomainError) as info:
            host.load(dev, slots, slots)
        raw[0] = host.kernel_table[0].value
        assert info.value.address == host.memory.host_va.value
        explained = info.value.explain()
        assert explained is not None and explained.domain == "host_va" and explained.offset == 0
        assert explained.other_domain_address == host.kernel_table[0].value


@pytest.mark.slow
def test_whatis_cli_demo_pid_and_bad_address() -> None:
    demo = _cli("whatis", "--demo", "--json")
    assert demo.returncode == 0, demo.stderr
    shown = json.loads(demo.stdout)
    # where the alias is the host VA itself (CUDA with CanUseHostPointerForRegisteredMem = 1,
    # outside strict mode) the alias number explains as that host VA, and says so
    same = shown[2]["address"] == shown[1]["address"]
    assert [e["domain"] for e in shown] == ["host_va", "host_va", "host_va" if same else "device_alias"]
    assert shown[1]["other_domain_address"] == shown[2]["address"] and shown[2]["other_domain_address"] == shown[1]["address"]
    assert not same or any("equals the host VA" in note for note in shown[2]["notes"])
    text = _cli("whatis", "--demo")
    assert text.returncode == 0 and "/maps:" in text.stdout
    assert ("equals the host VA" if same else "a DeviceAlias") in text.stdout
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with open(f"/proc/{child.pid}/maps") as f:
            first = f.readline().split()
        start = int(first[0].split("-")[0], 16)
        other = _cli("whatis", hex(start + 1), "--pid", str(child.pid), "--json")
        assert other.returncode == 0, other.stderr
        (got,) = json.loads(other.stdout)
        assert got["pid"] == child.pid and got["maps_line"].split()[0] == first[0] and got["domain"] == "unknown"
        decimal = _cli("whatis", str(start + 1), "--pid", str(child.pid))
        assert decimal.returncode == 0 and f"{start + 1:#x}:" in decimal.stdout
    finally:
        child.kill()
        child.wait()
    for bad in (("whatis", "zz"), ("whatis",), ("whatis", str(2**64)), ("whatis", "--demo", "--pid", "1"),
                ("whatis", "0x10", "--device", "nonsense"), ("whatis", "0x10", "--device", "emulated:9")):
        out = _cli(*bad)
        assert out.returncode == 2, (bad, out.stdout, out.stderr)
        assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_whatis_into_a_closed_pipe_exits_quietly() -> None:
    """`pointerdomain whatis ... --json | head -0`: the reader is gone before the output; no
    BrokenPipeError traceback, exit 1 (the output did not reach anyone)."""
    proc = subprocess.Popen([sys.executable, "-m", "pointerdomain", "whatis", "--demo", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the child has imported anything: its first write meets EPIPE
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 1, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_explain_refuses_what_is_not_a_pid() -> None:
    for bad in (0, -1, True, "1", 1.0):
        with pytest.raises(errors.InvalidArgumentError, match="pid must be a process id") as info:
            pd.explain(0x1000, pid=bad)  # type: ignore[arg-type]
        assert isinstance(info.value, ValueError)


@pytest.mark.slow
def test_whatis_pid_of_no_process_is_a_usage_error() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process (reuse within this test is vanishingly unlikely)
    for pid in (str(gone.pid), "0", "-1"):
        out = _cli("whatis", "--pid", pid, "0x1000")
        assert out.returncode == 2, (pid, out.stdout, out.stderr)
        assert "--pid" in out.stderr and "Traceback" not in out.stderr and out.stdout == ""


def test_whatis_names_the_kind_under_the_vmm_host_profile() -> None:
    env = {**os.environ, "POINTERDOMAIN_EMULATED_PROFILE": "vmm-host"}
    out = subprocess.run([sys.executable, "-m", "pointerdomain", "whatis", "--demo", "--json"], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    host, interior, alias = json.loads(out.stdout)
    assert host["memory_kind"] == interior["memory_kind"] == "vmm_host"
    assert host["memory_owner"].startswith("VMM handle 0x")
    assert alias["address"] == interior["address"]  # the device reads VMM memory at its VA


def test_explain_names_the_kind_of_a_registration() -> None:
    with pd.alloc_registered(2 * PAGE, EMU) as mem:
        got = pd.explain(mem.host_va + 5)
    assert got.memory_kind == "registered" and got.memory_owner is None and "kind: registered" in got.text()
