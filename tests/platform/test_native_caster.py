"""A third-party nanobind extension built against pointerdomain's installed headers.

The extension (tests/platform/native/toy_cache: a toy cache's own CPU "kernels") is built once per
session with CMake and nanobind's ``nanobind_add_module``, its include path from
``pointerdomain.get_include()``, exactly as docs/embedding.md tells a new user. Then:

* good kernel tables: its functions read the entries (device aliases of the emulated
  device, a second mapping of the same pages) and sum / copy bytes through them; the
  results are checked against plain torch on the host-VA side;
* bad arguments: a host-VA table, a raw tensor, an int, a table of another device, a
  closed table, an unknown device: the library's typed errors (pointerdomain.errors),
  raised before the function body runs (the destination stays untouched);
* its stub (nanobind.stubgen) type-checks under mypy: a pass case, and a fail case where
  a host table, a tensor and an int are rejected;
* the C++ strong types: a pass snippet compiles and each misuse snippet does not.

Skipped, with the reason, only when CMake or a C++ compiler is missing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors

pytestmark = pytest.mark.slow  # builds a third-party extension with CMake, then type-checks its stub

DEV = "emulated:0"
SOURCE = Path(__file__).resolve().parent / "native" / "toy_cache"
CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _tool_env() -> dict[str, str]:
    """Environment in which a child python imports this same pointerdomain."""
    env = dict(os.environ)
    root = str(Path(pd.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


@pytest.fixture(scope="session")
def toy_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("cmake") is None:
        pytest.skip("cmake not found: cannot build the third-party test extension")
    if CXX is None:
        pytest.skip("no C++ compiler (c++, g++, clang++) found: cannot build the third-party test extension")
    pytest.importorskip("nanobind")
    build = tmp_path_factory.mktemp("toy_cache_build")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    env = _tool_env()
    configure = subprocess.run(
        ["cmake", "-S", str(SOURCE), "-B", str(build), *generator, "-DCMAKE_BUILD_TYPE=Release",
         f"-DPython_EXECUTABLE={sys.executable}", f"-DCMAKE_CXX_COMPILER={CXX}"],
        env=env, capture_output=True, text=True,
    )
    assert configure.returncode == 0, configure.stdout + configure.stderr
    compiled = subprocess.run(["cmake", "--build", str(build)], env=env, capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr
    stub = subprocess.run([sys.executable, "-m", "nanobind.stubgen", "-q", "-m", "toy_cache", "-o",
                           str(build / "toy_cache.pyi")], cwd=build, env={**env, "PYTHONPATH": f"{build}{os.pathsep}{env['PYTHONPATH']}"},
                          capture_output=True, text=True)
    assert stub.returncode == 0, stub.stdout + stub.stderr
    return build


@pytest.fixture(scope="session")
def toy(toy_build: Path) -> ModuleType:
    sys.path.insert(0, str(toy_build))
    try:
        import toy_cache
    finally:
        sys.path.remove(str(toy_build))
    return toy_cache


def _filled(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def test_get_include_has_the_headers() -> None:
    inc = Path(pd.get_include())
    assert (inc / "pointerdomain" / "pointerdomain.h").is_file()
    assert (inc / "pointerdomain" / "nanobind.h").is_file()
    assert "get_include" in pd.__all__


def test_good_tables_read_and_copy_through_aliases(toy: ModuleType) -> None:
    with pd.alloc_registered(3 * 4096, DEV) as mem:
        host = mem.tensor
        host.copy_(_filled(host.numel(), 1))
        parts = list(host.view(3, 4096).unbind(0))
        table = pd.make_kernel_ptr_table(parts, DEV)
        assert table[0].value != pd.host_ptr_table(parts)[0].value   # the aliases differ from the VAs here
        sums = toy.checksum(table, DEV, 1000)
        assert sums == [int(p[:1000].to(torch.int64).sum()) for p in parts]
        assert toy.checksum(table, pd.Device("emulated", 0), 4096) == [int(p.to(torch.int64).sum()) for p in parts]

        dst = [pd.device_empty((4096,), torch.uint8, DEV) for _ in range(3)]
        for d in dst:
            d.fill_(0xA5)                                    # poison
        dst_table = pd.make_kernel_ptr_table(dst, DEV)
        toy.copy_items(table, dst_table, DEV, 256, [3, 0, 15], [1, 7, 2])
        for p, d in zip(parts, dst):
            expect = torch.full((4096,), 0xA5, dtype=torch.uint8)
            for s, t in zip([3, 0, 15], [1, 7, 2]):
                expect[t * 256:(t + 1) * 256] = p[s * 256:(s + 1) * 256]
            assert torch.equal(d, expect)
        assert toy.entries_on(table, DEV) == 3


def test_addresses_at_and_above_2_63_cross_the_caster(toy: ModuleType) -> None:
    from pointerdomain.registration.tables import resolved_kernel_table

    high = [1 << 63, (1 << 63) + 0x1000, (1 << 64) - 2, 0x7FFFFFFFF000]
    table = resolved_kernel_table(high, [1] * len(high), pd.as_device(DEV), [])
    assert toy.alias_values(table, DEV) == [v for h in high for v in (h, h + 1)]


def test_bad_arguments_raise_typed_errors_before_the_body(toy: ModuleType) -> None:
    with pd.alloc_registered(4096, DEV) as mem:
        host = mem.tensor
        host.copy_(_filled(4096, 2))
        table = pd.make_kernel_ptr_table([host], DEV)
        dst = pd.device_empty((4096,), torch.uint8, DEV)
        dst.fill_(0x5A)
        dst_table = pd.make_kernel_ptr_table([dst], DEV)
        untouched = dst.clone()

        with pytest.raises(errors.DomainError, match=r"PointerTable\[HostVA\].*device aliases only"):
            toy.copy_items(pd.host_ptr_table([host]), dst_table, DEV, 64, [0], [0])
        with pytest.raises(errors.DomainError, match="raw tensor has no address domain"):
            toy.copy_items(table.as_uint64_tensor(), dst_table, DEV, 64, [0], [0])
        with pytest.raises(errors.DomainError, match="raw tensor"):
            toy.checksum(host, DEV, 16)
        with pytest.raises(errors.DomainError, match="plain int has no address domain"):
            toy.copy_items(table, table[0].value, DEV, 64, [0], [0])
        with pytest.raises(errors.DomainError, match="got str"):
            toy.checksum("0x7f00", DEV, 16)
        # another device: refused by the same_device wrapper before the body, and by a
        # body that checks it itself
        other = pd.device_empty((4096,), torch.uint8, "emulated:1")
        with pytest.raises(errors.DeviceMismatchError, match="emulated:1 was given for a call on emulated:0"):
            toy.copy_items(table, pd.make_kernel_ptr_table([other], "emulated:1"), DEV, 64, [0], [0])
        with pytest.raises(errors.DeviceMismatchError, match="emulated:0 was given for a call on emulated:1"):
            toy.checksum(table, "emulated:1", 16)
        with pytest.raises(errors.DeviceMismatchError):
            toy.entries_on(table, "emulated:1")
        with pytest.raises(errors.InvalidDeviceError):
            toy.checksum(table, "gpu:0", 16)
        with pytest.raises(errors.InvalidDeviceError, match="does not exist"):
            toy.checksum(table, "emulated:9", 16)  # no such device: not a mismatch with the table
        # the body's own typed bounds check (it runs without the GIL: raise_error takes it)
        with pytest.raises(errors.IndexValidationError, match="outside entry 0"):
            toy.copy_items(table, dst_table, DEV, 64, [0], [64])
        # None: nanobind's own refusal (no .none() annotation), still a TypeError
        with pytest.raises(TypeError):
            toy.checksum(None, DEV, 16)
        assert torch.equal(dst, untouched)
    with pytest.raises(errors.ClosedError, match="was closed"):
        toy.copy_items(table, dst_table, DEV, 64, [0], [0])
    assert torch.equal(dst, untouched)


def test_unpinned_memory_is_refused_by_the_caster(toy: ModuleType) -> None:
    """Memory on the registration ladder's unpinned rung: its table holds host VAs, which
    the caster refuses (UnpinnedMemoryError) before the body reads them."""
    import warnings

    from pointerdomain.testing import NOT_SUPPORTED, DriverFaults, backend_for, install_backend

    policy = pd.RegistrationPolicy(on_failure="degrade", allow_unpinned=True, allow_pinned_copy=False)
    dst = pd.device_empty((4096,), torch.uint8, DEV)
    dst.fill_(0x5A)
    untouched = dst.clone()
    dst_table = pd.make_kernel_ptr_table([dst], DEV)
    faults = DriverFaults(backend_for(pd.validate_device(DEV)), refuse_all=NOT_SUPPORTED)  # type: ignore[arg-type]
    with install_backend(faults, "emulated"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the ladder's degraded-registration warning
            mem = pd.alloc_registered(4096, DEV, policy=policy)
        with mem:
            table = pd.make_kernel_ptr_table([mem.tensor], DEV)
            with pytest.raises(errors.UnpinnedMemoryError, match="not pinned"):
                toy.copy_items(table, dst_table, DEV, 64, [0], [0])
            with pytest.raises(errors.UnpinnedMemoryError):
                toy.checksum(table, DEV, 16)
    assert torch.equal(dst, untouched)


def test_table_reference_is_held_for_the_call_only(toy: ModuleType) -> None:
    """The table (holding its buffers) is the only owner left; the call reads the right
    bytes through it, and the caster's reference is dropped when the call returns."""
    import weakref

    buf = pd.device_empty((1 << 16,), torch.uint8, DEV)
    buf.copy_(_filled(1 << 16, 3))
    expect = int(buf.to(torch.int64).sum())
    table = pd.make_kernel_ptr_table([buf], DEV)
    del buf
    alive = weakref.ref(table)
    assert toy.checksum(table, DEV, 1 << 16) == [expect]
    del table
    assert alive() is None


_PASS_CASE = """\
from typing_extensions import assert_type

import pointerdomain as pd
import toy_cache


def use(table: pd.PointerTable[pd.DeviceAlias], device: pd.Device) -> int:
    sums = toy_cache.checksum(table, device, 16)
    assert_type(sums, list[int])
    toy_cache.copy_items(table, table, "emulated:0", 64, [0], [1])
    return toy_cache.entries_on(table, device)
"""

_FAIL_CASE = """\
import torch

import pointerdomain as pd
import toy_cache


def misuse(host: pd.PointerTable[pd.HostVA], raw: torch.Tensor, kernel: pd.PointerTable[pd.DeviceAlias]) -> None:
    toy_cache.checksum(host, "emulated:0", 16)
    toy_cache.checksum(raw, "emulated:0", 16)
    toy_cache.checksum(0x7F00, "emulated:0", 16)
    toy_cache.copy_items(kernel, host, "emulated:0", 64, [0], [1])
"""


def test_stub_type_checks(toy_build: Path, tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    (tmp_path / "pass_toy.py").write_text(_PASS_CASE)
    (tmp_path / "fail_toy.py").write_text(_FAIL_CASE)
    env = _tool_env()
    root = Path(pd.__file__).resolve().parents[1]
    paths = [str(toy_build)] + ([] if "site-packages" in root.parts else [str(root)])
    env["MYPYPATH"] = os.pathsep.join(paths)
    # Its own cache: the typing suite's mypy may be writing typing_tests/.mypy_cache concurrently.
    env_cache = os.environ.get("MYPY_CACHE_DIR")
    cache = Path(env_cache) / "native" if env_cache else Path(__file__).resolve().parent / ".mypy_cache"
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary", "--cache-dir", str(cache),
         "pass_toy.py", "fail_toy.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True,
    )
    lines = [ln for ln in result.stdout.splitlines() if ": error:" in ln]
    assert not [ln for ln in lines if ln.startswith("pass_toy.py")], result.stdout + result.stderr
    failed = sorted({int(m.group(1)) for ln in lines if (m := re.match(r"fail_toy\.py:(\d+): error: .*\[arg-type\]", ln))})
    assert failed == [8, 9, 10, 11], result.stdout + result.stderr
    assert len(lines) == 4, result.stdout + result.stderr
    assert 'PointerTable[HostVA]"; expected "PointerTable[DeviceAlias]"' in result.stdout


_CPP_OK = """\
#include <pointerdomain/pointerdomain.h>
#include <type_traits>
namespace pd = pointerdomain;
constexpr pd::HostVA h{std::uint64_t{4096}};
constexpr pd::DeviceAlias a{std::uint64_t{8192}};
static_assert(std::is_same_v<decltype(h + 64), pd::HostVA>);
static_assert(std::is_same_v<decltype(a.offset(64)), pd::DeviceAlias>);
static_assert(std::is_same_v<decltype(a - 64), pd::DeviceAlias>);
static_assert(std::is_same_v<decltype((a + 64) - a), std::ptrdiff_t>);
static_assert((a + 64) - a == 64 && (h + 8).value() == 4104 && h < h + 1);
int main() { return 0; }
"""

#: Each must fail to compile: domains never mix, nor become integers or each other implicitly.
_CPP_MISUSE = {
    "alias_from_host": "pd::DeviceAlias x = h;",
    "host_from_alias_explicit": "pd::HostVA x(a);",
    "implicit_from_int": "pd::HostVA x = std::uint64_t{5};",
    "from_signed_int": "pd::HostVA x(5);",
    "from_pointer": "int i = 0; pd::HostVA x(&i);",
    "add_across_domains": "auto x = h + a; (void) x;",
    "add_addresses": "auto x = h + h; (void) x;",
    "subtract_across_domains": "auto x = a - h; (void) x;",
    "compare_across_domains": "bool x = a == h; (void) x;",
    "to_integer": "std::uint64_t x = a; (void) x;",
    "table_entries_as_host": "pd::KernelTable t; const pd::HostVA *e = t.entries(); (void) e;",
    "table_raw_field": "pd::KernelTable t; auto x = t.entries_; (void) x;",
}


@pytest.mark.skipif(CXX is None, reason="no C++ compiler (c++, g++, clang++) found")
def test_cpp_strong_types(tmp_path: Path) -> None:
    inc = pd.get_include()
    ok = tmp_path / "ok.cpp"
    ok.write_text(_CPP_OK)
    res = subprocess.run([str(CXX), "-std=c++17", "-fsyntax-only", f"-I{inc}", str(ok)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    for name, body in {"control": "", **_CPP_MISUSE}.items():
        src = tmp_path / f"{name}.cpp"
        src.write_text(textwrap.dedent(f"""\
            #include <pointerdomain/pointerdomain.h>
            namespace pd = pointerdomain;
            void f(pd::HostVA h, pd::DeviceAlias a) {{ (void) h; (void) a; {body} }}
            """))
        res = subprocess.run([str(CXX), "-std=c++17", "-fsyntax-only", f"-I{inc}", str(src)], capture_output=True, text=True)
        if name == "control":   # the frame itself compiles: each failure below is its body's
            assert res.returncode == 0, res.stderr
            continue
        assert res.returncode != 0, f"{name} compiled: {body}"
        assert "error" in res.stderr, res.stderr


_CUDA_KERNEL = """\
#include <pointerdomain/pointerdomain.h>
namespace pd = pointerdomain;
// A gather kernel taking the table view by value: entries are DeviceAlias in device memory.
__global__ void gather(pd::KernelTable src, pd::DeviceAlias dst, std::uint64_t item, const long *slots, int n) {
    int t = blockIdx.x;
    if (t >= n) return;
    const pd::DeviceAlias base = src.entries()[blockIdx.y];
    const unsigned char *s = (base + static_cast<std::ptrdiff_t>(slots[t] * item)).as<const unsigned char>();
    unsigned char *d = dst.offset(static_cast<std::ptrdiff_t>((blockIdx.y * n + t) * item)).as<unsigned char>();
    for (std::uint64_t i = threadIdx.x; i < item; i += blockDim.x) d[i] = s[i];
}
void launch(pd::KernelTable t, pd::DeviceAlias dst, const long *slots, int n) {
    gather<<<dim3(n, (unsigned) t.size()), 128>>>(t, dst, 256, slots, n);
}
"""


def test_header_compiles_in_a_cuda_kernel(tmp_path: Path) -> None:
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if nvcc is None:
        pytest.skip("nvcc not found: the header's __host__ __device__ path is not compiled here")
    src = tmp_path / "gather.cu"
    src.write_text(_CUDA_KERNEL)
    res = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", f"-I{pd.get_include()}", "-c", str(src), "-o",
                          str(tmp_path / "gather.o")], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
