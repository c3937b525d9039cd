"""``pointerdomain audit --fix`` never breaks code: rows of a 2-D tensor, a name the module
already binds, code that runs on other devices, consumers that need a tensor, and the
re-parse + mypy check before anything is written."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pointerdomain.audit import AuditConfig, audit_file
from pointerdomain.audit.autofix import FixStyle, check_fix, fix_source
from pointerdomain.audit.cli import main
from tests import childenv

FIX_CASES = Path(__file__).with_name("audit_cases") / "fix"


def _case(name: str) -> str:
    return (FIX_CASES / name).read_text()


def test_rows_of_a_2d_tensor_become_a_list_of_rows() -> None:
    result = fix_source(_case("pool_rows.py"))
    assert result.fixes == 2 and result.refused == ()
    assert "self.host_ptrs = host_ptr_table([*self.kv_buffer])" in result.code
    assert "self.dev_ptrs = make_kernel_ptr_table([*self.kv_buffer], self.device)" in result.code
    # at run time the host table holds what the comprehension computed: one address per row
    host_only = result.code.replace("self.dev_ptrs = make_kernel_ptr_table([*self.kv_buffer], self.device)", "pass")
    ns: dict[str, object] = {}
    exec(compile(host_only, "pool_rows.py", "exec"), ns)
    pool = ns["RowPool"](4, 64, "cpu")  # type: ignore[operator]
    rows = pool.kv_buffer  # type: ignore[attr-defined]
    got = pool.host_ptrs.as_uint64_tensor()  # type: ignore[attr-defined]
    assert got.dtype == torch.uint64 and got.tolist() == [rows[i].data_ptr() for i in range(4)]
    assert got.tolist() == [rows.data_ptr() + 64 * i for i in range(4)]


def test_a_taken_name_gets_a_qualified_import() -> None:
    result = fix_source(_case("shadowed.py"))
    assert result.fixes == 1
    assert "import pointerdomain as pd\n" in result.code
    assert "from pointerdomain import" not in result.code
    assert "self.plain = pd.make_kernel_ptr_table([*bufs], device)" in result.code
    # the module's own helper and its call are untouched
    assert "from pool_helpers import make_kernel_ptr_table" in result.code
    assert "make_kernel_ptr_table(bufs, device, host_memory_registered=True)" in result.code
    taken_pd = "pd = object()\n" + _case("shadowed.py")
    both = fix_source(taken_pd)
    assert "import pointerdomain\n" in both.code and "pointerdomain.make_kernel_ptr_table(" in both.code


def test_other_devices_are_never_rewritten() -> None:
    result = fix_source(_case("other_devices.py"))
    # line 22: the device is self.device, set to "xpu" in the class's __init__
    assert result.fixes == 1 and [line for line, _ in result.refused] == [8, 22]
    assert all("non-CUDA/HIP" in reason for _, reason in result.refused)
    assert "return make_kernel_ptr_table([*bufs], device)" in result.code
    backend = "import torch_npu\n" + _case("other_devices.py")
    assert fix_source(backend).fixes == 0


def test_consumers_that_need_a_tensor_are_refused() -> None:
    result = fix_source(_case("consumers.py"))
    reasons = dict(result.refused)
    assert sorted(reasons) == [8, 9, 11, 13]
    assert "torch.cat" in reasons[8] and "torch.cat" in reasons[9] and "arithmetic" in reasons[11]
    assert "passed to transfer_kv()" in reasons[13]  # a native op of unknown signature
    assert result.fixes == 0 and result.code == _case("consumers.py")
    # the tensor form cannot prove the buffers contiguous, non-empty memory of the right kind
    tensor_style = fix_source(_case("consumers.py"), "tensor")
    assert tensor_style.fixes == 0 and tensor_style.code == _case("consumers.py")
    assert sorted(dict(tensor_style.refused)) == [8, 9, 11, 13]
    assert all("not a drop-in" in why for _, why in tensor_style.refused)


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("mypy")  # the GPU machine has none
    return Path(os.environ.get("MYPY_CACHE_DIR", tmp_path_factory.mktemp("mypy_cache")))


@pytest.mark.slow  # runs --fix, whose check runs mypy: 25-50 s on a busy 2-core machine
def test_mypy_check_refuses_a_fix_with_new_errors(mypy_cache: Path) -> None:
    before = _case("typed_consumer.py")
    result = fix_source(before)
    assert result.fixes == 1 and result.refused == ()
    check = check_fix(before, result.code, "typed_consumer.py", mypy_cache)
    assert not check.ok and check.reason == "mypy reports new errors"
    assert any("return-value" in e and "PointerTable" in e for e in check.new_errors), check
    # the same rewrite with the annotation updated passes
    updated = result.code.replace(") -> torch.Tensor:", ") -> object:")
    assert check_fix(before.replace(") -> torch.Tensor:", ") -> object:"), updated, "t.py", mypy_cache).ok
    broken = result.code.replace("device: torch.device)", "device: torch.device")
    bad = check_fix(before, broken, "t.py", mypy_cache)
    assert not bad.ok and "does not parse" in bad.reason


@pytest.mark.slow  # runs --fix, whose check runs mypy: 25-50 s on a busy 2-core machine
def test_cli_dry_run_diff_and_write(tmp_path: Path, mypy_cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("pool_rows.py", "typed_consumer.py", "consumers.py"):
        (tmp_path / name).write_text(_case(name))
    before = {p.name: p.read_text() for p in tmp_path.iterdir()}
    os.environ["MYPY_CACHE_DIR"] = str(mypy_cache)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        rc = main(["--progress", "none", "--fix", "--file-timeout", "600", "--diff", "."])  # mypy may be slow
        out, err = capsys.readouterr()
        assert {p.name: p.read_text() for p in tmp_path.iterdir()} == before  # a dry run writes nothing
        assert "+        self.host_ptrs = host_ptr_table([*self.kv_buffer])" in out
        assert "typed_consumer.py: 1 fix(es) refused: mypy reports new errors" in err
        assert "consumers.py:8: not fixed: its value is put in a list or tuple (torch.cat of tables)" in err
        assert "2 site(s) would be rewritten" in err  # pool_rows 2
        rc = main(["--progress", "none", "--fix", "--file-timeout", "600", "."])
        capsys.readouterr()
    finally:
        os.chdir(cwd)
        del os.environ["MYPY_CACHE_DIR"]
    assert rc == 1  # the refused sites are still findings
    assert "host_ptr_table([*self.kv_buffer])" in (tmp_path / "pool_rows.py").read_text()
    assert (tmp_path / "typed_consumer.py").read_text() == before["typed_consumer.py"]


def test_a_table_passed_to_a_native_call_is_refused() -> None:
    result = fix_source(_case("native_calls.py"))
    reasons = dict(result.refused)
    assert sorted(reasons) == [15, 20, 25]
    assert "transfer_kv_all_layer()" in reasons[15] and "copy_rows[(len(srcs),)]()" in reasons[20]
    assert "torch.ops.sgl_kernel.transfer()" in reasons[25]
    # pointerdomain's own API and print take the table: that site alone is rewritten
    assert result.fixes == 1 and 'table = make_kernel_ptr_table([*srcs], "cuda")' in result.code
    tensor_style = fix_source(_case("native_calls.py"), "tensor")
    assert tensor_style.fixes == 0 and len(tensor_style.refused) == 4


def test_a_name_list_bound_in_the_module_is_never_called() -> None:
    result = fix_source(_case("name_clashes.py"))
    assert result.fixes == 2 and result.refused == ()
    assert "return make_kernel_ptr_table([*list], device)" in result.code
    assert "return host_ptr_table([*list])" in result.code
    assert "(list(" not in result.code
    # [*X] holds what the comprehension iterated, even with `list` bound to typing.List
    ns: dict[str, object] = {}
    exec(compile(result.code, "name_clashes.py", "exec"), ns)
    rows = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    got = ns["local_named_list"](rows, "cpu").as_uint64_tensor()  # type: ignore[operator]
    assert got.dtype == torch.uint64 and got.tolist() == [rows[i].data_ptr() for i in range(3)]


def test_a_star_import_gets_the_fully_qualified_form() -> None:
    result = fix_source(_case("star_import.py"))
    assert result.fixes == 1
    assert "import pointerdomain\n" in result.code and "from pointerdomain import" not in result.code
    assert "table = pointerdomain.make_kernel_ptr_table([*bufs], device)" in result.code
    assert "return make_kernel_ptr_table(bufs, device)  # noqa: F405" in result.code  # the star-imported one


_TABLE_SITE = (
    "import torch\n"
    "\n"
    "\n"
    "def table(bufs: list[torch.Tensor], device: torch.device) -> object:\n"
    "    return torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64, device=device)\n"
)
# A stand-in for mypy in the child CLI (the check it runs is tested above with the real one):
# no error, and a stall that SIGALRM cannot cut short on a file carrying the marker.
_FAKE_MYPY_API = '''
import signal, time

def run(args):
    with open(args[-1], encoding="utf-8") as f:
        text = f.read()
    if "stall-the-checker" in text:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(600)
    return "", "", 0
'''


def _fix_cli(tree: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    fake = tree.parent / "fake_mypy"
    (fake / "mypy").mkdir(parents=True, exist_ok=True)
    (fake / "mypy" / "__init__.py").write_text("")
    (fake / "mypy" / "api.py").write_text(_FAKE_MYPY_API)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(fake), childenv.pythonpath())))
    return subprocess.run([sys.executable, "-m", "pointerdomain.audit", "--progress", "none", "--fix", *args, "."],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # runs --fix, whose check runs mypy: 25-50 s on a busy 2-core machine
def test_fix_stops_a_file_past_the_timeout_and_goes_on(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    stall = _TABLE_SITE + "# stall-the-checker\n"
    (tree / "a_stall.py").write_text(stall)
    (tree / "b_good.py").write_text(_TABLE_SITE)
    t0 = time.perf_counter()
    out = _fix_cli(tree, "--file-timeout", "10", timeout=90)
    took = time.perf_counter() - t0
    assert "a_stall.py: not fixed: skipped (the fix did not finish within file_timeout = 10 s; nothing written)" \
        in out.stderr, out.stderr
    assert (tree / "a_stall.py").read_text() == stall  # untouched
    assert "return make_kernel_ptr_table(bufs, device)" in (tree / "b_good.py").read_text()
    assert "1 site(s) rewritten; 1 file(s) skipped" in out.stderr
    assert out.returncode == 1  # a_stall.py's finding is still reported
    assert took < 80
    assert [p.name for p in tree.iterdir() if p.name.endswith(".tmp")] == []


def test_fix_keeps_crlf_and_bom_byte_for_byte(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    # CRLF throughout, a BOM, an LF-only line and a CRLF inside a string literal
    body = _TABLE_SITE + 'NOTE = """two\nlines"""\n'
    crlf = body.replace("\n", "\r\n").replace("import torch\r\n\r\n", "import torch\r\n\n", 1)
    original = b"\xef\xbb\xbf" + crlf.encode("utf-8")
    (tree / "crlf.py").write_bytes(original)
    plain = crlf.encode("utf-8")
    (tree / "plain_crlf.py").write_bytes(plain)
    out = _fix_cli(tree)
    assert "2 site(s) rewritten" in out.stderr, out.stderr
    # expected: the same bytes except the rewritten call and the added import, in CRLF
    old_site = b"torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64, device=device)"
    new_site = b"make_kernel_ptr_table(bufs, device)"
    for name, before in (("crlf.py", original), ("plain_crlf.py", plain)):
        after = (tree / name).read_bytes()
        head = b"\xef\xbb\xbf" if name == "crlf.py" else b""
        added = b"import torch\r\nfrom pointerdomain import make_kernel_ptr_table\r\n"
        assert after.startswith(head + added)
        rest = after[len(head + added):]
        assert rest == before[len(head + b"import torch\r\n"):].replace(old_site, new_site)
        assert rest.startswith(b"\n\r\ndef table(")  # the LF-only line stays LF
        assert after.count(b"\r\n") == before.count(b"\r\n") + 1 and b'"""two\r\nlines"""' in rest


def test_a_device_chosen_at_run_time_gets_one_builder_per_case() -> None:
    result = fix_source(_case("conditional_device.py"))
    assert "return make_kernel_ptr_table(bufs, device) if device else host_ptr_table(bufs)" in result.code
    assert result.code.count("make_kernel_ptr_table(bufs, device) if device else host_ptr_table(bufs)") == 2
    assert 'return make_kernel_ptr_table(bufs, "cuda") if torch.cuda.is_available() else host_ptr_table(bufs)' \
        in result.code
    assert "    return host_ptr_table(bufs)\n" in result.code  # "cpu" in both branches
    # `pick()` would run twice as the condition and the device: left alone
    assert result.fixes == 4 and [line for line, _ in result.refused] == [24]
    assert "chosen at run time" in result.refused[0][1]
    # on the CPU (no device) the rewritten host table holds what the comprehension computed
    ns: dict[str, object] = {}
    exec(compile(result.code, "conditional_device.py", "exec"), ns)
    bufs = [torch.zeros(4), torch.zeros(8, dtype=torch.uint8)]
    for fn in ("maybe_device", "device_or_cpu", "when_available"):
        if fn == "when_available" and torch.cuda.is_available():
            continue
        got = ns[fn](bufs).as_uint64_tensor()  # type: ignore[operator]
        assert got.dtype == torch.uint64 and got.tolist() == [b.data_ptr() for b in bufs]


@pytest.mark.slow  # runs --fix, whose check runs mypy: 25-50 s on a busy 2-core machine
def test_a_dry_run_prints_each_diff_once_across_a_stopped_file(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "a_good.py").write_text(_TABLE_SITE)
    (tree / "b_stall.py").write_text(_TABLE_SITE + "# stall-the-checker\n")
    (tree / "c_good.py").write_text(_TABLE_SITE)
    out = _fix_cli(tree, "--diff", "--file-timeout", "10", timeout=90)
    assert "b_stall.py: not fixed: skipped" in out.stderr, out.stderr
    # each diff once: the fix process that replaced the stopped one prints nothing itself
    assert out.stdout.count("+++ b/a_good.py") == 1 and out.stdout.count("+++ b/c_good.py") == 1
    assert "+++ b/b_stall.py" not in out.stdout
    assert "2 site(s) would be rewritten; 1 file(s) skipped" in out.stderr
    assert (tree / "a_good.py").read_text() == _TABLE_SITE  # a dry run


def test_a_device_held_in_a_name_is_followed_or_the_site_refused() -> None:
    source = _case("named_devices.py")
    result = fix_source(source)
    # bound once to the CPU (a local, a module constant, `self.device` set once in __init__): the host form
    assert "self.ptrs = host_ptr_table(bufs)\n" in result.code
    # bound to the CPU and to something else, or a parameter whose default is the CPU: left alone
    assert [line for line, _ in result.refused] == [16, 23, 44]
    assert all("not known to be a CUDA/HIP device" in why for _, why in result.refused)
    kept_sites = ("device=self.device)\n\n    def move", "device=device)\n\n\ndef local_cpu",
                  "device=dev)\n\n\ndef local_cuda")
    for kept in kept_sites:
        assert kept in source and kept in result.code
    # a device bound once, a literal "cpu" and a parameter without a default: as before
    assert "    dev = \"cuda\"\n    return make_kernel_ptr_table(bufs, dev)\n" in result.code
    assert "def literal_cpu(bufs: list[torch.Tensor]) -> object:\n    return host_ptr_table(bufs)\n" in result.code
    assert "return make_kernel_ptr_table(bufs, device)\n" in result.code
    assert result.fixes == 7
    # on the CPU each rewritten host site returns what the original returned
    ns: dict[str, object] = {}
    exec(compile(result.code, "named_devices.py", "exec"), ns)
    original: dict[str, object] = {}
    exec(compile(source, "named_devices.py", "exec"), original)
    bufs = [torch.zeros(4), torch.zeros(8, dtype=torch.uint8), torch.zeros(2, dtype=torch.float64)]
    want = [b.data_ptr() for b in bufs]
    for fn in ("local_cpu", "module_cpu", "local_torch_device", "literal_cpu", "default_cpu"):
        before = original[fn](bufs)  # type: ignore[operator]
        assert before.device.type == "cpu" and before.tolist() == want
        after = ns[fn](bufs)  # type: ignore[operator]
        got = after if isinstance(after, torch.Tensor) else after.as_uint64_tensor()
        assert got.device.type == "cpu" and got.dtype == torch.uint64 and got.tolist() == want, fn
    pool = ns["HostPool"](bufs).ptrs  # type: ignore[operator]
    assert pool.as_uint64_tensor().tolist() == want


def test_a_copied_table_is_left_alone() -> None:
    source = _case("copies.py")
    result = fix_source(source)
    # `t2 = tbl` then a native op, `self.other = self.tbl` then a native op, a copy then `.sum()`
    assert [line for line, _ in result.refused] == [7, 13, 20]
    assert all("copied to another name" in why for _, why in result.refused)
    assert result.code.count("torch.tensor([x.data_ptr() for x in bufs]") == 3
    # returned as is: still rewritten
    assert result.fixes == 1 and "    tbl = host_ptr_table(bufs)\n    return tbl\n" in result.code
    tensor = fix_source(source, "tensor")
    assert tensor.fixes == 0 and all("not a drop-in" in why for _, why in tensor.refused)


def test_the_finding_names_the_domain_of_a_device_held_in_a_name() -> None:
    path = FIX_CASES / "named_devices.py"
    found = {f.line: f.message for f in audit_file(path, AuditConfig(root=FIX_CASES))[0]}
    # `dev = "cpu"`, `torch.device("cpu")`: a host table, not a device one
    assert found[28].endswith("untyped host pointer table") and found[37].endswith("untyped host pointer table")
    assert found[49].endswith("untyped device pointer table")
    # a parameter defaulting to the CPU, `self.device = "cpu"`: either, named in the fix too
    for line in (10, 23):
        assert "host or device pointer table (the device is chosen at run time)" in found[line]


def test_a_table_that_escapes_to_unseen_consumers_is_left_alone() -> None:
    source = _case("escapes.py")
    result = fix_source(source)
    reasons = dict(result.refused)
    assert sorted(reasons) == [8, 16, 22, 31, 39, 44, 48, 52, 55, 59, 75]
    assert "returned" in reasons[8] and "returned" in reasons[16]  # no return type, Any
    assert "pool.ptrs" in reasons[22]  # read on another object in the module
    assert "getattr" in reasons[31] and "setattr" in reasons[39]
    assert "pool.ptrs" in reasons[44]  # stored on another object
    assert "cannot follow" in reasons[48] and "append()" in reasons[52]
    assert "module" in reasons[55] and "class" in reasons[59]
    # a declared return type, but a caller in the module uses the value as a tensor
    assert "typed_but_summed(bufs)" in reasons[75] and ".sum" in reasons[75]
    # a declared return type is the callers' contract (mypy checks it), and a private read
    assert result.fixes == 2
    assert "    return host_ptr_table(bufs)\n" in result.code
    assert "self.own = host_ptr_table(bufs)\n" in result.code
    tensor = fix_source(source, "tensor")
    assert tensor.fixes == 0 and len(tensor.refused) == 13


_RETURNED = (
    "import torch\n\n\n"
    "def build(bufs):\n"
    "    return torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64)\n\n\n"
    "def checksum(bufs):\n"
    "    return int(build(bufs).sum())\n\n\n"
    "class Pool:\n"
    "    def __init__(self, bufs):\n"
    "        self.ptrs = torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64)\n\n"
    "    def total(self):\n"
    "        return int(getattr(self, 'ptrs').sum())\n\n\n"
    "def total(pool):\n"
    "    return int(pool.ptrs.sum())\n"
)


def _run_both(source: str, style: FixStyle, call: str, bufs: list[torch.Tensor]) -> tuple[object, object]:
    before: dict[str, object] = {"BUFS": bufs}
    exec(compile(source, "before.py", "exec"), before)
    after: dict[str, object] = {"BUFS": bufs}
    exec(compile(fix_source(source, style).code, "after.py", "exec"), after)
    expr = call.replace("bufs", "BUFS")
    return eval(expr, before), eval(expr, after)


@pytest.mark.parametrize("style", ["table", "tensor"])
def test_the_fixed_file_computes_what_the_original_did(style: FixStyle) -> None:
    # the reproducer: a returned table summed by a caller, a table read by getattr and on another object
    bufs = [torch.zeros(4), torch.zeros(8, dtype=torch.uint8)]
    want = sum(b.data_ptr() for b in bufs)
    for call in ("checksum(bufs)", "Pool(bufs).total()", "total(Pool(bufs))"):
        before, after = _run_both(_RETURNED, style, call, bufs)
        assert before == want and after == want, (style, call)
    assert fix_source(_RETURNED).fixes == 0


def test_the_tensor_form_is_refused_where_it_is_not_a_drop_in() -> None:
    source = _case("dtypes.py")
    result = fix_source(source, "tensor")
    reasons = dict(result.refused)
    assert result.fixes == 0 and result.code == source
    assert sorted(reasons) == [7, 15, 19, 23, 27]
    assert "dtype" in reasons[23] and "dtype" in reasons[27]
    # the builders refuse what torch.tensor of data_ptr() values took: no site is proven equivalent
    for line in (7, 15, 19):
        assert "not a drop-in" in reasons[line] and "strided views" in reasons[line]
    from pointerdomain import host_ptr_table
    from pointerdomain.errors import InvalidArgumentError, NonContiguousError
    kv = torch.zeros(2, 4, 8)
    with pytest.raises(NonContiguousError):
        host_ptr_table([kv[:, 0], kv[:, 1]])
    with pytest.raises(InvalidArgumentError):
        host_ptr_table([torch.zeros(0)])


_MOVED = (
    "import torch\n\n\n"
    "def table(bufs: list[torch.Tensor], device: str) -> torch.Tensor:\n"
    "    return torch.tensor([t.data_ptr() for t in bufs], dtype=torch.int64).to(device)\n\n\n"
    "def on_gpu(bufs: list[torch.Tensor]) -> torch.Tensor:\n"
    "    return torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64).cuda()\n"
)


@pytest.mark.parametrize("style", ["table", "tensor"])
def test_a_table_moved_after_it_is_built_is_left_as_it_is(style: FixStyle) -> None:
    result = fix_source(_MOVED, style)
    assert result.fixes == 0 and result.code == _MOVED
    reasons = dict(result.refused)
    assert sorted(reasons) == [5, 9]
    assert "(.to())" in reasons[5] and "(.cuda())" in reasons[9] and "chain" in reasons[5]


_TYPE_READS = (
    "import torch\n\n\n"
    "def checked(bufs: list[torch.Tensor]) -> bool:\n"
    "    tbl = torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64)\n"
    "    return isinstance(tbl, torch.Tensor)\n\n\n"
    "def typed(bufs: list[torch.Tensor]) -> str:\n"
    "    tbl = torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64)\n"
    "    return \"tensor\" if type(tbl) == torch.Tensor else \"other\"\n\n\n"
    "def printed(bufs: list[torch.Tensor]) -> None:\n"
    "    tbl = torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64)\n"
    "    print(id(tbl), repr(tbl))\n"
)


def test_a_table_read_by_isinstance_or_type_is_left_alone() -> None:
    result = fix_source(_TYPE_READS)
    reasons = dict(result.refused)
    assert sorted(reasons) == [5, 10]
    assert "isinstance()" in reasons[5] and "type()" in reasons[10]
    assert result.fixes == 1 and "    tbl = host_ptr_table(bufs)\n    print(id(tbl), repr(tbl))\n" in result.code
    bufs = [torch.zeros(4), torch.zeros(8)]
    before: dict[str, object] = {}
    exec(compile(_TYPE_READS, "before.py", "exec"), before)
    after: dict[str, object] = {}
    exec(compile(result.code, "after.py", "exec"), after)
    for fn, want in (("checked", True), ("typed", "tensor")):
        assert before[fn](bufs) == want and after[fn](bufs) == want  # type: ignore[operator]


_BY_NAME_READS = {
    "nonlocal": (
        "from typing import Any\n\nimport torch\n\n\n"
        "def build(bufs: list[torch.Tensor]) -> int:\n"
        "    tbl: Any = None\n\n"
        "    def init() -> None:\n"
        "        nonlocal tbl\n"
        "        tbl = torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64)\n\n"
        "    init()\n"
        "    return int(tbl.numel())\n"),
    "attrgetter": (
        "import operator\n\nimport torch\n\n\n"
        "class Pool:\n"
        "    def __init__(self, bufs: list[torch.Tensor]) -> None:\n"
        "        self.tbl = torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64)\n\n"
        "    def count(self) -> int:\n"
        "        return int(operator.attrgetter(\"tbl\")(self).numel())\n"),
    "locals()": (
        "import torch\n\n\n"
        "def build(bufs: list[torch.Tensor]) -> int:\n"
        "    tbl = torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64)\n"
        "    return int(locals()[\"tbl\"].numel())\n"),
    "vars()": (
        "import torch\n\n\n"
        "def build(bufs: list[torch.Tensor]) -> int:\n"
        "    tbl = torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64)\n"
        "    return int(vars()[\"tbl\"].numel())\n"),
    "eval()": (
        "import torch\n\n\n"
        "def build(bufs: list[torch.Tensor]) -> int:\n"
        "    tbl = torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64)\n"
        "    return int(eval(\"tbl\").numel())\n"),
}


@pytest.mark.parametrize("kind", sorted(_BY_NAME_READS))
def test_a_table_read_in_another_scope_or_by_name_is_left_alone(kind: str) -> None:
    source = _BY_NAME_READS[kind]
    result = fix_source(source)
    assert result.fixes == 0 and result.code == source
    assert len(result.refused) == 1 and kind in result.refused[0][1], result.refused
    # a function that reads no name by name is still rewritten
    plain = source.replace("locals()[\"tbl\"]", "tbl").replace("vars()[\"tbl\"]", "tbl").replace("eval(\"tbl\")", "tbl")
    if plain != source:
        assert fix_source(plain).refused[0][1].startswith("its value is used as a tensor (.numel)")


_DEVICES = (
    "import argparse\n\nimport torch\n\n\n"
    "def loop(bufs: list[torch.Tensor]) -> None:\n"
    "    for dev in [\"cpu\", \"cuda\"]:\n"
    "        print(torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64, device=dev))\n\n\n"
    "def from_args(bufs: list[torch.Tensor], args: argparse.Namespace) -> None:\n"
    "    print(torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64, device=args.device))\n\n\n"
    "def from_a_call(bufs: list[torch.Tensor]) -> None:\n"
    "    print(torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64, device=bufs[0].device))\n\n\n"
    "def written_out(bufs: list[torch.Tensor], i: int) -> None:\n"
    "    print(torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64, device=f\"cuda:{i}\"))\n"
    "    print(torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64, device=torch.device(\"cuda\", i)))\n"
    "    print(torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64, device=\"cuda:1\"))\n"
)


def test_a_device_that_may_be_the_cpu_is_refused() -> None:
    result = fix_source(_DEVICES)
    reasons = dict(result.refused)
    assert sorted(reasons) == [8, 12, 16]
    assert all("not known to be a CUDA/HIP device" in why for why in reasons.values())
    assert "(dev)" in reasons[8] and "(args.device)" in reasons[12] and "(bufs[0].device)" in reasons[16]
    assert result.fixes == 3
    assert 'print(make_kernel_ptr_table(bufs, f"cuda:{i}"))' in result.code
    assert 'print(make_kernel_ptr_table(bufs, torch.device("cuda", i)))' in result.code
    assert 'print(make_kernel_ptr_table(bufs, "cuda:1"))' in result.code


_PARENTHESIZED = (
    "import torch\n\n\n"
    "def good(ks: list[torch.Tensor]) -> None:\n"
    "    print(torch.tensor([t.data_ptr() for t in ks], dtype=torch.uint64))\n\n\n"
    "def pick(ks: list[torch.Tensor], vs: list[torch.Tensor], both: bool) -> None:\n"
    "    print(torch.tensor([t.data_ptr() for t in (ks if both else vs)], dtype=torch.uint64))\n"
    "    print(torch.tensor([t.data_ptr() for t in (k for k in ks)], dtype=torch.uint64))\n"
    "    print(torch.tensor([t.data_ptr() for t in (ks or vs)], dtype=torch.uint64))\n"
    "    print(torch.tensor([t.data_ptr() for t in (not_a := ks)], dtype=torch.uint64))\n"
)


def test_the_star_rewrite_keeps_the_parentheses_it_needs() -> None:
    result = fix_source(_PARENTHESIZED)
    assert result.refused == () and result.fixes == 5
    compile(result.code, "parenthesized.py", "exec")
    for want in ("host_ptr_table(ks)", "host_ptr_table([*(ks if both else vs)])", "host_ptr_table([*(k for k in ks)])",
                 "host_ptr_table([*(ks or vs)])", "host_ptr_table([*(not_a := ks)])"):
        assert f"    print({want})\n" in result.code
    ns: dict[str, object] = {}
    exec(compile(result.code, "parenthesized.py", "exec"), ns)
    ns["pick"]([torch.zeros(2)], [torch.zeros(3)], True)  # type: ignore[operator]
