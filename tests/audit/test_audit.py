"""`pointerdomain audit`: every rule on snippets written here (tests/audit/audit_cases, lines
marked `expect[CODE]` must give exactly those codes and no other line may give any),
suppressions, the baseline, the report formats, exit codes, the autofix (checked with
mypy and against data_ptr() at run time), the flake8 plugin and the worker pool."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import torch

from pointerdomain.audit import RULES, AuditConfig, audit_file, audit_paths, fix_source, load_config
from pointerdomain.audit.baseline import write_baseline
from pointerdomain.audit.cli import main
from pointerdomain.audit.flake8_plugin import Plugin
from pointerdomain.audit.output import Summary, render
from tests import childenv

ROOT = Path(__file__).resolve().parents[2]
CASES = Path(__file__).with_name("audit_cases")
_EXPECT = re.compile(r"expect\[([A-Z0-9, ]+)\]")
KERNEL_OPS = ("sgl_kernel.transfer_kv_all_layer",)


def expected(path: Path) -> Counter[tuple[int, str]]:
    out: Counter[tuple[int, str]] = Counter()
    for i, line in enumerate(path.read_text().splitlines(), 1):
        m = _EXPECT.search(line)
        if m:
            out.update((i, c.strip()) for c in m.group(1).split(","))
    return out


def found(path: Path, config: AuditConfig | None = None) -> Counter[tuple[int, str]]:
    # every rule, the opt-in PD103 included
    config = config or AuditConfig(root=CASES, kernel_ops=KERNEL_OPS, select=("PD", "PD103"))
    findings, _ = audit_file(path, config)
    return Counter((f.line, f.code) for f in findings)


@pytest.mark.parametrize("case", sorted(p.name for p in CASES.iterdir() if p.suffix in (".py", ".cu", ".cpp")))
def test_rule_cases(case: str) -> None:
    path = CASES / case
    want = expected(path)
    assert want, f"{case} has no expect[] markers"
    assert found(path) == want


def test_every_rule_has_a_positive_case() -> None:
    codes = {code for p in CASES.iterdir() if p.is_file() for _, code in expected(p)}
    assert codes >= {c for c in RULES if c not in ("PD900", "PD901")}


def test_register_buffer_is_resolved_not_grepped(tmp_path: Path) -> None:
    # `register_buffer(` appears, the text pattern would hit; the names say nn.Module.
    f = tmp_path / "m.py"
    f.write_text("import torch\nfrom torch import nn\n\nclass M(nn.Module):\n    def __init__(self):\n"
                 "        super().__init__()\n        self.register_buffer('x', torch.ones(2))\n")
    assert found(f, AuditConfig(root=tmp_path)) == Counter()
    # ...while a Mooncake store's register_buffer of an address is a registration call.
    g = tmp_path / "s.py"
    g.write_text("from mooncake.store import MooncakeDistributedStore\n\ndef f(t):\n"
                 "    store = MooncakeDistributedStore()\n    store.register_buffer(t.data_ptr(), t.nbytes)\n")
    assert found(g, AuditConfig(root=tmp_path)) == Counter({(5, "PD003"): 1})


def test_pd007_needs_config(tmp_path: Path) -> None:
    assert found(CASES / "pd007_kernel_ops.py", AuditConfig(root=CASES)) == Counter()


# -- suppressions -----------------------------------------------------------------------


def test_suppressions(tmp_path: Path) -> None:
    f = tmp_path / "s.py"
    f.write_text(textwrap.dedent("""\
        def f(bufs):
            a = [t.data_ptr() for t in bufs]  # pointerdomain: ignore[PD002] host-only scratch list for logging
            b = [t.data_ptr() for t in bufs]  # pointerdomain: ignore[PD002]
            # pointerdomain: ignore[PD002] the line below is a debug dump, never launched
            c = [t.data_ptr() for t in bufs]
            d = [t.data_ptr() for t in bufs]  # pointerdomain: ignore
            e = [t.data_ptr() for t in bufs]  # pointerdomain: ignore[PD999] no such rule
            s = "# pointerdomain: ignore[PD002] inside a string is no comment"
            g = [t.data_ptr() for t in bufs]  # pointerdomain: ignore[PD001] wrong code
            return a, b, c, d, e, g
        """))
    findings, suppressed = audit_file(f, AuditConfig(root=tmp_path))
    got = Counter((x.line, x.code) for x in findings)
    assert suppressed == 2  # lines 2 and 5
    assert got == Counter({(3, "PD002"): 1, (3, "PD900"): 1, (6, "PD002"): 1, (6, "PD900"): 1,
                           (7, "PD002"): 1, (7, "PD900"): 1, (9, "PD002"): 1})
    messages = {x.line: x.message for x in findings if x.code == "PD900"}
    assert "no reason" in messages[3] and "no rule code" in messages[6] and "PD999" in messages[7]


def test_suppression_covers_a_multiline_statement(tmp_path: Path) -> None:
    # on the first line or the closing line, a suppression covers every line of the statement
    # (a call is reported at its first line, arithmetic in it at its own); on a middle line,
    # that line only
    f = tmp_path / "m.py"
    f.write_text(textwrap.dedent("""\
        from ext import ops


        def f(x, y):
            ops.dispatch(
                x.data_ptr(),
            )  # pointerdomain: ignore[PD008] the op takes a HostVA by contract
            ends = (  # pointerdomain: ignore[PD002] range ends for an overlap check
                x.data_ptr() + 8,
                y.data_ptr() + 8,
            )
            lasts = (
                x.data_ptr() + 8,
                y.data_ptr() + 8,
            )  # pointerdomain: ignore[PD002] range ends for an overlap check
            # pointerdomain: ignore[PD002] range ends for an overlap check
            firsts = (
                x.data_ptr() + 8,
                y.data_ptr() + 8,
            )
            mids = (
                x.data_ptr() + 8,  # pointerdomain: ignore[PD002] only this line
                y.data_ptr() + 8,
            )
            ops.dispatch(  # pointerdomain: ignore[PD001] wrong code: still reported
                x.data_ptr(),
            )
            with ops.session(
                x.data_ptr(),
            ) as s:  # pointerdomain: ignore[PD008] the header of a with statement
                ops.dispatch(s, y.data_ptr())
            return ends, lasts, firsts, mids
        """))
    findings, suppressed = audit_file(f, AuditConfig(root=tmp_path))
    # left: the line after the covered middle line (23), the wrong code (25), the with body (31)
    assert Counter((x.line, x.code) for x in findings) == Counter({(23, "PD002"): 1, (25, "PD008"): 1,
                                                                   (31, "PD008"): 1})
    assert suppressed == 9
    # the same through flake8
    plugin = Plugin(ast.parse(f.read_text()), f.read_text().splitlines(keepends=True), str(f))
    assert sorted(line for line, *_ in plugin.run()) == [23, 25, 31]


def test_cpp_suppression_covers_a_multiline_statement(tmp_path: Path) -> None:
    f = tmp_path / "k.cu"
    f.write_text("void f(at::Tensor t) {\n"
                 "  auto a = reinterpret_cast<uintptr_t>(  // pointerdomain: ignore[PD102] printed only\n"
                 "      t.data_ptr());\n"
                 "  auto b = reinterpret_cast<uintptr_t>(\n"
                 "      t.data_ptr());  // pointerdomain: ignore[PD102] printed only\n"
                 "  auto c =\n"
                 "      reinterpret_cast<uintptr_t>(t.data_ptr());\n"
                 "  use(a, b,  // pointerdomain: ignore[PD102] a middle line\n"
                 "      c);\n"
                 "}\n")
    findings, suppressed = audit_file(f, AuditConfig(root=tmp_path))
    assert suppressed == 2
    assert [(x.line, x.code) for x in findings] == [(7, "PD102")]


def test_cpp_suppression(tmp_path: Path) -> None:
    f = tmp_path / "k.cu"
    f.write_text("struct D {\n  uintptr_t a;  // pointerdomain: ignore[PD103] host VA for the engine, by contract\n"
                 "  uintptr_t b;  // pointerdomain: ignore[PD103]\n};\n")
    findings, suppressed = audit_file(f, AuditConfig(root=tmp_path, select=("PD", "PD103")))
    assert suppressed == 1
    assert Counter((x.line, x.code) for x in findings) == Counter({(3, "PD103"): 1, (3, "PD900"): 1})


# -- config, baseline, formats, exit codes --------------------------------------------


def _project(tmp_path: Path, config: str = "") -> Path:
    (tmp_path / "pyproject.toml").write_text("[tool.pointerdomain.audit]\n" + config)
    pkg = tmp_path / "pkg"
    pkg.mkdir(exist_ok=True)
    (pkg / "pool.py").write_text("import torch\n\ndef table(bufs, dev) -> object:\n"
                                 "    return torch.tensor([b.data_ptr() for b in bufs], device=dev)\n")
    (pkg / "clean.py").write_text("def f(x):\n    return x + 1\n")
    return tmp_path


def _cli(tmp_path: Path, *args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        rc = main(["--progress", "none", *args])
    finally:
        os.chdir(cwd)
    out, err = capsys.readouterr()
    return rc, out, err


def test_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _project(tmp_path)
    assert _cli(tmp_path, "pkg/clean.py", capsys=capsys)[0] == 0
    rc, out, _ = _cli(tmp_path, "pkg", capsys=capsys)
    assert rc == 1 and "pkg/pool.py:4:12: PD001" in out
    assert _cli(tmp_path, "missing_dir", capsys=capsys)[0] == 2
    assert _cli(tmp_path, "--select", "XX9", "pkg", capsys=capsys)[0] == 2
    assert _cli(tmp_path, "--baseline", "nope.json", "pkg", capsys=capsys)[0] == 2
    assert _cli(tmp_path, "--select", "PD1", "pkg", capsys=capsys)[0] == 0  # the C++ rules only
    (tmp_path / "pyproject.toml").write_text("[tool.pointerdomain.audit]\nunknown_key = 1\n")
    rc, _, err = _cli(tmp_path, "pkg", capsys=capsys)
    assert rc == 2 and "unknown_key" in err
    (tmp_path / "pyproject.toml").write_text("[tool.pointerdomain.audit]\njobs = 'two'\n")
    assert _cli(tmp_path, "pkg", capsys=capsys)[0] == 2
    (tmp_path / "pyproject.toml").write_text("[tool.pointerdomain.audit\n")
    assert _cli(tmp_path, "--config", "pyproject.toml", "pkg", capsys=capsys)[0] == 2
    with pytest.raises(SystemExit) as exc:
        _cli(tmp_path, "--format", "xml", capsys=capsys)
    assert exc.value.code == 2


def test_config_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _project(tmp_path, 'paths = ["pkg"]\nexclude = ["pkg/pool.py"]\n')
    assert _cli(tmp_path, capsys=capsys)[0] == 0  # paths from the config; the only finding excluded
    _project(tmp_path, 'paths = ["pkg"]\nper_file_ignores = { "pkg/*.py" = ["PD001"] }\n')
    assert _cli(tmp_path, capsys=capsys)[0] == 0
    _project(tmp_path, 'paths = ["pkg"]\nignore = ["PD00"]\n')
    assert _cli(tmp_path, capsys=capsys)[0] == 0
    _project(tmp_path, 'paths = ["pkg"]\n')
    assert _cli(tmp_path, capsys=capsys)[0] == 1
    cfg = load_config(tmp_path / "pyproject.toml")
    assert cfg.paths == ("pkg",) and cfg.root == tmp_path.resolve()
    assert "PD900" in AuditConfig(ignore=("PD9",)).enabled()  # a reason-less suppression always counts


def test_baseline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _project(tmp_path, 'baseline = "audit-baseline.json"\n')
    rc, _, _ = _cli(tmp_path, "--write-baseline", "audit-baseline.json", "pkg", capsys=capsys)
    assert rc == 0
    data = json.loads((tmp_path / "audit-baseline.json").read_text())
    assert [e["code"] for e in data["findings"]] == ["PD001"]
    rc, out, _ = _cli(tmp_path, "pkg", capsys=capsys)
    assert rc == 0 and "0 new finding(s), 1 baselined" in out
    pool = tmp_path / "pkg" / "pool.py"
    # moving the site keeps its fingerprint
    pool.write_text("# a comment\n\n" + pool.read_text())
    assert _cli(tmp_path, "pkg", capsys=capsys)[0] == 0
    # a new site fails, and only it is reported
    pool.write_text(pool.read_text() + "\ndef more(bufs):\n    return [b.data_ptr() + 8 for b in bufs]\n")
    rc, out, _ = _cli(tmp_path, "pkg", capsys=capsys)
    assert rc == 1 and "PD002" in out and "PD001" not in out.split("pointerdomain audit:")[0]
    # --no-baseline reports everything
    rc, out, _ = _cli(tmp_path, "--no-baseline", "pkg", capsys=capsys)
    assert rc == 1 and "PD001" in out and "PD002" in out
    # fixing the baselined site leaves a stale entry, reported in the summary
    pool.write_text("def more(bufs):\n    return len(bufs)\n")
    rc, out, _ = _cli(tmp_path, "pkg", capsys=capsys)
    assert rc == 0 and "1 baseline entry no longer found" in out


def test_json_and_sarif(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _project(tmp_path)
    rc, out, _ = _cli(tmp_path, "--format", "json", "pkg", capsys=capsys)
    assert rc == 1
    item = json.loads(out)["findings"][0]
    assert (item["path"], item["line"], item["col"], item["code"], item["rule"]) == \
        ("pkg/pool.py", 4, 12, "PD001", "raw-pointer-table")
    assert "make_kernel_ptr_table" in item["fix"] and item["fingerprint"]

    rc, _, _ = _cli(tmp_path, "--format", "sarif", "-o", "out.sarif", "pkg", capsys=capsys)
    assert rc == 1
    log = json.loads((tmp_path / "out.sarif").read_text())
    assert log["version"] == "2.1.0" and log["$schema"].endswith("sarif-2.1.0.json")
    (run,) = log["runs"]
    driver = run["tool"]["driver"]
    assert driver["name"] == "pointerdomain-audit"
    ids = [r["id"] for r in driver["rules"]]
    assert ids == list(RULES) and all(r["shortDescription"]["text"] and r["help"]["text"] for r in driver["rules"])
    assert all(r["defaultConfiguration"]["level"] in ("error", "warning", "note") for r in driver["rules"])
    (res,) = run["results"]
    assert res["ruleId"] == "PD001" and ids[res["ruleIndex"]] == "PD001" and res["level"] == "error"
    loc = res["locations"][0]["physicalLocation"]
    assert loc["artifactLocation"]["uri"] == "pkg/pool.py"
    region = loc["region"]
    assert (region["startLine"], region["startColumn"]) == (4, 12) and region["endLine"] >= 4
    assert "Fix:" in res["message"]["text"] and res["partialFingerprints"]["pointerdomainAudit/v1"]


def test_text_format_has_fix() -> None:
    from pointerdomain.audit.rules import Finding

    f = Finding("a.py", 3, 5, "PD002", "msg", "do this", "x = 1")
    text = render("text", [f], Summary(1, 1, 0, 0, 0, 0.0), "0")
    assert text.startswith("a.py:3:5: PD002 msg\n    fix: do this\n")


def test_parse_error_is_reported(tmp_path: Path) -> None:
    f = tmp_path / "bad.py"
    f.write_text("def f(x):\n    return x.data_ptr(\n")
    (finding,), _ = audit_file(f, AuditConfig(root=tmp_path))
    assert finding.code == "PD901"


@pytest.mark.parametrize("text", ["def f(:\n    pass\n", "x = (1,\n", "def f():\nreturn 1\n", "a = 1\0\n"])
def test_parse_error_without_trigger_words_is_reported(tmp_path: Path, text: str) -> None:
    """No rule can match the file, but a file Python cannot parse is still not audited."""
    f = tmp_path / "bad.py"
    f.write_text(text)
    (finding,), _ = audit_file(f, AuditConfig(root=tmp_path))
    assert finding.code == "PD901" and "cannot parse" in finding.message
    (tmp_path / "good.py").write_text("def f(x):\n    return x\n")
    run = audit_paths([tmp_path], AuditConfig(root=tmp_path), jobs=1, progress="none")
    assert [(r.path, "cannot parse" in (r.skipped or "")) for r in run.skipped] == [("bad.py", True)]


# -- the worker pool, progress, imports ------------------------------------------------


def test_pool_matches_serial(tmp_path: Path) -> None:
    for i in range(60):
        (tmp_path / f"m{i}.py").write_text(
            f"import torch\n\ndef f{i}(bufs):\n" + "    x = 1\n" * i
            + "    return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)\n")
        (tmp_path / f"n{i}.py").write_text("def g(x):\n    return x\n")
    config = AuditConfig(root=tmp_path)
    serial = audit_paths([tmp_path], config, jobs=1, progress="none")
    pooled = audit_paths([tmp_path], config, jobs=2, progress="none")
    assert serial.files == pooled.files == 120
    assert serial.findings == pooled.findings
    assert Counter(f.line for f in pooled.findings) == Counter(range(4, 64))


def test_no_torch_import(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("def f(t):\n    return t.data_ptr() + 1\n")
    code = ("import sys\nfrom pointerdomain.audit.cli import main\nrc = main(['--progress', 'none', 'a.py'])\n"
            "assert 'torch' not in sys.modules and 'pointerdomain._C' not in sys.modules, 'torch imported'\n"
            "sys.exit(rc)\n")
    env = dict(os.environ, PYTHONPATH=childenv.pythonpath())
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert "a.py:2:12: PD002" in proc.stdout


def test_cli_subcommand_registered(tmp_path: Path) -> None:
    from pointerdomain.tools.cli import main as pd_main

    (tmp_path / "a.py").write_text("x = 1\n")
    assert pd_main(["audit", "--progress", "none", str(tmp_path / "a.py")]) == 0
    assert pd_main(["audit", "--progress", "none", str(CASES / "pd002_arith.py")]) == 1


# -- autofix ---------------------------------------------------------------------------

FIX_SNIPPET = '''\
import torch


def build(bufs: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64, device=device)


def build_host(bufs: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
'''

# What the typed (`table`) fix must feed: functions that want the typed tables.
TABLE_CONSUMER = '''\
import torch
from pointerdomain import DeviceAlias, HostVA, PointerTable


def build(bufs: list[torch.Tensor], device: torch.device) -> PointerTable[DeviceAlias]:
    return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64, device=device)


def build_host(bufs: list[torch.Tensor]) -> PointerTable[HostVA]:
    return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
'''


def _mypy(files: list[Path], cache: Path) -> tuple[int, str]:
    from mypy import api

    out, err, rc = api.run(["--strict", "--no-error-summary", "--cache-dir", str(cache),
                            "--python-executable", sys.executable, *map(str, files)])
    return rc, out + err


@pytest.mark.slow
def test_autofix_mypy(tmp_path: Path) -> None:
    pytest.importorskip("mypy")  # the GPU machine has none
    tensor_style = fix_source(FIX_SNIPPET, "tensor")
    table_style = fix_source(TABLE_CONSUMER, "table")
    # the tensor form is not a drop-in (strided, empty, wrong-memory tensors raise): refused
    assert tensor_style.fixes == 0 and tensor_style.code == FIX_SNIPPET and len(tensor_style.refused) == 2
    assert table_style.fixes == 2
    assert "return make_kernel_ptr_table(bufs, device)\n" in table_style.code
    assert "return host_ptr_table(bufs)\n" in table_style.code
    assert "from pointerdomain import host_ptr_table, make_kernel_ptr_table" in table_style.code
    files = {"fixed_table.py": table_style.code, "unfixed_table.py": TABLE_CONSUMER}
    for name, code in files.items():
        (tmp_path / name).write_text(code)
    os.environ.setdefault("MYPYPATH", str(ROOT / "src"))
    cache = Path(os.environ.get("MYPY_CACHE_DIR", Path(__file__).with_name(".mypy_cache")))
    rc, out = _mypy([tmp_path / "fixed_table.py", tmp_path / "unfixed_table.py"], cache)
    errors = [line for line in out.splitlines() if ": error:" in line]
    # the fixed files are clean; the unfixed one fails where a Tensor is returned as a table
    assert not [e for e in errors if "fixed_t" in e and "unfixed" not in e], out
    assert len([e for e in errors if "unfixed_table.py" in e]) == 2, out
    # the fixed code has no PD001 left
    for name in ("fixed_table.py",):
        assert not [f for f in audit_file(tmp_path / name, AuditConfig(root=tmp_path))[0] if f.code == "PD001"]


def test_autofix_values_match_data_ptr(tmp_path: Path) -> None:
    # The host-table rewrite computes what the original computed: same addresses, same dtype.
    bufs = [torch.arange(16, dtype=torch.float32) + i for i in range(3)]
    fixed = fix_source(FIX_SNIPPET, "tensor").code
    ns: dict[str, object] = {}
    exec(compile(fixed, "fixed.py", "exec"), ns)
    got = ns["build_host"](bufs)  # type: ignore[operator]
    assert isinstance(got, torch.Tensor) and got.dtype == torch.uint64
    assert got.tolist() == [b.data_ptr() for b in bufs]
    table = fix_source(TABLE_CONSUMER, "table").code
    ns = {}
    exec(compile(table, "fixed.py", "exec"), ns)
    t = ns["build_host"](bufs)  # type: ignore[operator]
    assert [a.value for a in t] == [b.data_ptr() for b in bufs]


def test_autofix_leaves_unsafe_forms(tmp_path: Path) -> None:
    src = ("import torch\n\ndef f(bufs, d):\n"
           "    a = torch.tensor([b.data_ptr() for b in bufs if b.numel()], device=d)\n"
           "    c = torch.tensor([b.data_ptr() + 8 for b in bufs], device=d)\n"
           "    e = torch.tensor([b.data_ptr() for b in bufs], device=d, pin_memory=True)\n"
           "    return a, c, e\n")
    assert fix_source(src).fixes == 0


@pytest.mark.slow  # runs --fix, whose check runs mypy: 25-50 s on a busy 2-core machine
def test_cli_fix_writes_and_diff(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("mypy")  # --fix checks each rewrite with mypy and refuses all without it
    _project(tmp_path)
    pool = tmp_path / "pkg" / "pool.py"
    before = pool.read_text()
    rc, out, err = _cli(tmp_path, "--fix", "--file-timeout", "600", "--diff", "pkg", capsys=capsys)  # mypy may be slow
    assert rc == 1 and "+    return make_kernel_ptr_table([*bufs], dev)" in out and pool.read_text() == before
    rc, out, err = _cli(tmp_path, "--fix", "--file-timeout", "600", "pkg", capsys=capsys)
    assert rc == 0 and "1 site(s) rewritten" in err
    assert "make_kernel_ptr_table([*bufs], dev)" in pool.read_text()


# -- flake8 ------------------------------------------------------------------------------


def test_flake8_plugin_class() -> None:
    path = CASES / "pd002_arith.py"
    lines = path.read_text().splitlines(keepends=True)
    results = list(Plugin(None, lines, str(path)).run())  # type: ignore[arg-type]
    assert Counter((line, msg.split()[0]) for line, _col, msg, _t in results) == expected(path)
    assert all(msg.startswith("PD") and "(fix:" in msg for _, _, msg, _ in results)


def test_flake8_entry_point_and_run(tmp_path: Path) -> None:
    import tomllib

    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["flake8.extension"]
    assert eps == {"PD": "pointerdomain.audit.flake8_plugin:Plugin"}
    pytest.importorskip("flake8")
    (tmp_path / "a.py").write_text("def f(t):\n    return t.data_ptr() + 1\n")
    (tmp_path / ".flake8").write_text("[flake8]\nselect = PD\n[flake8:local-plugins]\n"
                                      "extension =\n    PD = pointerdomain.audit.flake8_plugin:Plugin\n")
    env = dict(os.environ, PYTHONPATH=childenv.pythonpath())
    proc = subprocess.run([sys.executable, "-m", "flake8", "a.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.startswith("./a.py:2:12: PD002 ") or proc.stdout.startswith("a.py:2:12: PD002 "), proc.stdout


def test_main_cli_without_libcst(capsys: pytest.CaptureFixture[str]) -> None:
    # doctor/demo must not need the `audit` extra; `audit` then says what to install.
    code = ("import sys\nsys.modules['libcst'] = None\nfrom pointerdomain.tools.cli import main\n"
            "sys.exit(main(['audit', 'x']))\n")
    env = dict(os.environ, PYTHONPATH=childenv.pythonpath())
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "pointerdomain[audit]" in proc.stderr, proc.stderr


def test_files_that_cannot_be_written_or_read_are_usage_errors(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    # a one-line error on stderr and status 2 (not 1, "new findings"), never a traceback
    _project(tmp_path)
    missing = tmp_path / "no-such-dir"

    def usage_error(*args: str) -> str:
        rc, _, err = _cli(tmp_path, *args, capsys=capsys)
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, (args, err)
        return lines[0]

    assert str(missing / "b.json") in usage_error("--write-baseline", str(missing / "b.json"), "pkg")
    assert str(missing / "out.json") in usage_error("--format", "json", "-o", str(missing / "out.json"), "pkg")
    assert "-o" in usage_error("-o", str(tmp_path / "pkg"), "pkg")  # a directory
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00{")
    assert "binary.json" in usage_error("--baseline", "binary.json", "pkg")
    (tmp_path / "deep.json").write_text("[" * 100_000)
    assert "deep.json" in usage_error("--baseline", "deep.json", "pkg")
    (tmp_path / "pyproject.toml").write_bytes(b"[tool.pointerdomain.audit]\nignore = [\"\xff\"]\n")
    assert "pyproject.toml" in usage_error("--config", "pyproject.toml", "pkg")
    # found on the way up, not named: like invalid TOML, it is not a file with the table
    rc, _, err = _cli(tmp_path, "pkg", capsys=capsys)
    assert rc == 1 and "Traceback" not in err
    assert not missing.exists()


def test_a_file_the_fix_cannot_write_is_reported_and_the_run_goes_on(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from pointerdomain.audit import cli
    _project(tmp_path)
    (tmp_path / "pkg" / "pool.py").write_text(
        "import torch\n\n\ndef table(bufs: list[torch.Tensor]) -> object:\n"
        "    return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)\n")
    before = (tmp_path / "pkg" / "pool.py").read_text()
    # a stand-in mypy for the fix process (no error): the check itself is tested with the real one
    fake = tmp_path / "fake_mypy"
    (fake / "mypy").mkdir(parents=True)
    (fake / "mypy" / "__init__.py").write_text("")
    (fake / "mypy" / "api.py").write_text("def run(args):\n    return '', '', 0\n")
    monkeypatch.syspath_prepend(str(fake))

    def refuse(path: Path, data: bytes) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(cli, "_write_atomically", refuse)
    rc, _, err = _cli(tmp_path, "--fix", "pkg", capsys=capsys)
    assert "pkg/pool.py: not fixed: cannot write the file: Permission denied" in err, err
    assert "Traceback" not in err and "0 site(s) rewritten" in err
    assert rc == 1 and (tmp_path / "pkg" / "pool.py").read_text() == before  # the finding stays
