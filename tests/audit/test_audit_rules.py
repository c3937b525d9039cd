"""The audit's fix texts by memory domain, its opt-in rule and the classes of sites it
must find or leave alone (the per-line expectations are in tests/audit/audit_cases/)."""

from __future__ import annotations

from pathlib import Path

from pointerdomain.audit import AuditConfig, audit_file

CASES = Path(__file__).with_name("audit_cases")


def _findings(tmp_path: Path, name: str, text: str, **config: object) -> list[tuple[int, str, str, str]]:
    f = tmp_path / name
    f.write_text(text)
    found, _ = audit_file(f, AuditConfig.model_validate({"root": tmp_path, **config}))
    return [(x.line, x.code, x.message, x.fix) for x in found]


def test_pd103_is_opt_in(tmp_path: Path) -> None:
    text = "struct D {\n  uintptr_t src;\n  uint64_t dst_addr;\n};\n"
    assert _findings(tmp_path, "d.h", text) == []
    on = _findings(tmp_path, "d.h", text, select=("PD", "PD103"))
    assert [(line, code) for line, code, _, _ in on] == [(2, "PD103"), (3, "PD103")]
    # a prefix does not switch it on; the full code does, alone too
    assert _findings(tmp_path, "d.h", text, select=("PD1",)) == []
    assert len(_findings(tmp_path, "d.h", text, select=("PD103",))) == 2


def test_pd104_fix_by_where_the_table_is_read() -> None:
    host = audit_file(CASES / "pd104_host_table.cpp", AuditConfig(root=CASES))[0]
    assert [f.code for f in host] == ["PD104", "PD104"]
    assert "host code:" in host[0].message and "host VAs" in host[0].fix and "host_ptr_table" in host[0].fix
    # read on the CPU but handed to cudaMemset: device addresses, and the rule's own fix
    assert "GPU runtime" in host[1].message and "device addresses" in host[1].message
    assert "host VAs" not in host[1].fix
    device = [f for f in audit_file(CASES / "pd1xx_kernels.cu", AuditConfig(root=CASES))[0] if f.code == "PD104"]
    # line 22 is in a host function of the .cu file, the other in a __global__ kernel
    assert [("host code:" in f.message, "host VAs" in f.fix) for f in device] == [(True, True), (False, False)]
    assert "device code" in device[1].message and "device aliases" in device[1].fix


def test_registration_fix_by_memory_domain(tmp_path: Path) -> None:
    text = (
        "import torch\n"
        "def reg(engine, n):\n"
        "    dev = torch.empty(n, dtype=torch.uint8, device='cuda')\n"
        "    host = torch.empty(n, dtype=torch.uint8).pin_memory()\n"
        "    engine.register_memory(dev.data_ptr(), n)\n"
        "    engine.register_memory(host.data_ptr(), n)\n"
        "    engine.register_memory(n, n)\n"
    )
    found = _findings(tmp_path, "r.py", text)
    assert [(line, code) for line, code, _, _ in found] == [(5, "PD003"), (6, "PD003")]
    device_fix, host_fix = found[0][3], found[1][3]
    assert "device memory" in device_fix and "device address" in device_fix and "never a HostVA" in device_fix
    assert "HostVA" in host_fix and "device memory" not in host_fix


def test_pd008_fix_by_memory_domain(tmp_path: Path) -> None:
    text = (
        "import torch\nfrom ext import ops\n"
        "def go(n):\n"
        "    dev = torch.zeros(n, device='cuda')\n"
        "    host = torch.zeros(n, pin_memory=True)\n"
        "    ops.copy(dev.data_ptr(), n)\n"
        "    ops.copy(host.data_ptr(), n)\n"
    )
    found = _findings(tmp_path, "k.py", text)
    assert [(line, code) for line, code, _, _ in found] == [(6, "PD008"), (7, "PD008")]
    assert found[0][3].startswith("device memory") and found[1][3].startswith("host memory")


def test_pd104_after_a_kernel_is_host_code() -> None:
    found = audit_file(CASES / "pd104_after_kernel.cu", AuditConfig(root=CASES))[0]
    where = [(f.line, "device code" in f.message, "host code:" in f.message) for f in found if f.code == "PD104"]
    # the sites after each kernel's or device function's closing brace are host code again
    assert where == [(9, True, False), (17, False, True), (23, True, False), (28, False, True)]
    assert "host VAs" in found[1].fix and "host VAs" in found[3].fix
    assert "host VAs" not in found[0].fix and "host VAs" not in found[2].fix


def test_a_device_chosen_at_run_time_names_both_domains(tmp_path: Path) -> None:
    text = (
        "import torch\n"
        "def go(engine, ops, bufs, n, device=None):\n"
        "    table = torch.tensor([t.data_ptr() for t in bufs], device=device if device else 'cpu')\n"
        "    host = torch.tensor([t.data_ptr() for t in bufs], device='cpu' if n else torch.device('cpu'))\n"
        "    buf = torch.empty(n, dtype=torch.uint8, device=device if device else 'cpu')\n"
        "    engine.register_memory(buf.data_ptr(), n)\n"
        "    dev = torch.empty(n, device=device or 'cuda')\n"
        "    ops.copy(dev.data_ptr(), n)\n"
    )
    found = _findings(tmp_path, "c.py", text)
    assert [(line, code) for line, code, _, _ in found] == [(3, "PD001"), (4, "PD001"), (6, "PD003"), (8, "PD008")]
    mixed, host, reg, dev = found
    assert "host or device pointer table (the device is chosen at run time)" in mixed[2]
    assert "make_kernel_ptr_table" in mixed[3] and "host_ptr_table" in mixed[3]
    assert "untyped host pointer table" in host[2] and "make_kernel_ptr_table" not in host[3]
    # either memory: the fix names both domains, not the host one alone
    assert "host memory" in reg[3] and "device memory" in reg[3]
    assert dev[3].startswith("device memory")
