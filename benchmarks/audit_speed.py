"""Time `pointerdomain audit` on a generated tree (default 3,000 files) or on a real one.

    python benchmarks/audit_speed.py                      # generated: 3,000 .py files
    python benchmarks/audit_speed.py --preset flashinfer  # generated: 10,000 files shaped like flashinfer
    python benchmarks/audit_speed.py --tree /path/to/vllm --limit 3000   # the first 3,000 files of a real tree

The flashinfer preset (10,000 files by default, --files changes it) is a kernel library's
shape: a third Python (4 % CuTe-DSL kernel modules of 2,000-4,000 lines whose smem
``.data_ptr()`` calls are DSL pointers, 5 % host wrappers passing ``data_ptr()`` ints to
ops, the rest plain) and two thirds C++/CUDA (kernels and headers of about 300 lines, and
2 % generated instantiation files of 0.5-3 MB, above the default 1,024 KiB cap from
about 1 MB up).

The generated tree mixes, per 100 files: 8 KV-pool modules (pointer tables, data_ptr()
arithmetic, transfer-engine calls, a Triton kernel; about 300 lines each), 6 nn.Module
files with register_buffer (must stay clean), and 86 ordinary modules of classes and
functions (about 250 lines each). That is vLLM's share of files the audit must parse
(458 of 5,579 .py files contain a trigger word, 8 %). Reports wall time, the CPU time of
the audit process and its workers, files, and findings per rule; the pre-commit budget
is 30 s on 2 cores.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

POOL = '''\
import torch
import triton
import triton.language as tl
from mooncake.engine import TransferEngine


class HostPool{i}:
    def __init__(self, bufs: list[torch.Tensor], device: torch.device) -> None:
        self.bufs = bufs
        self.engine = TransferEngine()
        self.ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64, device=device)
        self.base = bufs[0].data_ptr()
        self.engine.register_memory(self.base, bufs[0].nbytes)

    def page_addr(self, page: int, page_bytes: int) -> int:
        return self.base + page * page_bytes

    def send(self, peer: str, remote: int, n: int) -> None:
        self.engine.transfer_sync_write(peer, self.base, remote, n)
'''
KERNEL = '''

@triton.jit
def gather{i}_{k}(table_ptr, out_ptr, n: tl.constexpr):
    src = tl.load(table_ptr + n).to(tl.pointer_type(tl.int8))
    tl.store(out_ptr, tl.load(src))
'''
MODULE_FN = '''

def helper_{i}_{k}(values: list[int], scale: float = 1.0) -> list[float]:
    """Scale and clip values (generated filler)."""
    out = []
    for v in values:
        if v < 0:
            continue
        w = v * scale + {k}
        out.append(min(w, 1e6))
    return out
'''
MODULE_CLASS = '''

class Worker{i}_{k}:
    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = size
        self.items: dict[str, int] = {{}}

    def add(self, key: str, value: int) -> None:
        if key in self.items:
            raise KeyError(key)
        self.items[key] = value * self.size

    def total(self) -> int:
        return sum(self.items.values()) + len(self.name)
'''
NN = '''\
import torch
from torch import nn


class Rotary{i}(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.inv_freq
'''


def generate(root: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    for i in range(n):
        d = root / f"pkg{i % 30}"
        d.mkdir(parents=True, exist_ok=True)
        r = i % 100
        if r < 8:
            text = POOL.format(i=i) + "".join(KERNEL.format(i=i, k=k) for k in range(2)) \
                + "".join(MODULE_FN.format(i=i, k=k) for k in range(12))
        elif r < 14:
            text = NN.format(i=i) + "".join(MODULE_FN.format(i=i, k=k) for k in range(8))
        else:
            parts = [MODULE_FN.format(i=i, k=k) if rng.random() < 0.5 else MODULE_CLASS.format(i=i, k=k)
                     for k in range(12)]
            text = "import math\nimport os\n" + "".join(parts)
        (d / f"mod{i}.py").write_text(text)


CUTE = '''\
import cutlass
import cutlass.cute as cute


class GemmKernel{i}:
    @cute.kernel
    def kernel(self, storage, mA, mB):
{body}
'''
CUTE_LINE = "        bar_{k} = storage.mbar_{k}.data_ptr()\n        cute.arch.mbarrier_init(bar_{k}, 1)\n"
WRAPPER = '''\
import torch
from flashinfer_like import _kernels


def run_{i}(q: torch.Tensor, k: torch.Tensor, out: torch.Tensor) -> None:
    _kernels.decode_{i}(q.data_ptr(), k.data_ptr(), out.data_ptr(), q.size(0))


def ptrs_{i}(bufs: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64, device=device)
'''
CU_KERNEL = '''
template <typename T, int N>
__global__ void kernel_{i}_{k}(const T* __restrict__ src, T* __restrict__ dst, const int64_t* idx, int64_t n) {{
  int64_t t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= n) return;
  const int64_t row = idx[t];
  #pragma unroll
  for (int j = 0; j < N; ++j) {{
    dst[t * N + j] = src[row * N + j];
  }}
}}
'''
CU_INST = "template __global__ void kernel_{i}_{k}<half, {n}>(const half*, half*, const int64_t*, int64_t);\n"


def generate_flashinfer(root: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    n_py = n // 3
    for i in range(n):
        d = root / ("python" if i < n_py else "csrc") / f"dir{i % 40}"
        d.mkdir(parents=True, exist_ok=True)
        if i < n_py:
            r = i % 100
            if r < 4:
                body = "".join(CUTE_LINE.format(k=k) for k in range(rng.randint(1000, 2000)))
                (d / f"kernel{i}.py").write_text(CUTE.format(i=i, body=body))
            elif r < 9:
                (d / f"wrap{i}.py").write_text(WRAPPER.format(i=i) + "".join(
                    MODULE_FN.format(i=i, k=k) for k in range(8)))
            else:
                parts = [MODULE_FN.format(i=i, k=k) if rng.random() < 0.5 else MODULE_CLASS.format(i=i, k=k)
                         for k in range(10)]
                (d / f"mod{i}.py").write_text("import math\n" + "".join(parts))
        elif i % 50 == 0:
            size = rng.randint(512, 3072) * 1024
            line = CU_INST.format(i=i, k=0, n=8)
            (d / f"generated{i}.cu").write_text("#include <cuda_fp16.h>\n" + line * (size // len(line)))
        else:
            ext = (".cu", ".cuh", ".h")[i % 3]
            (d / f"k{i}{ext}").write_text("#include <cstdint>\n" + "".join(
                CU_KERNEL.format(i=i, k=k) for k in range(20)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=0, help="generated files (default 3,000; flashinfer: 10,000)")
    ap.add_argument("--preset", choices=["mixed", "flashinfer"], default="mixed", help="shape of the generated tree")
    ap.add_argument("--tree", type=Path, help="a real tree instead of a generated one")
    ap.add_argument("--limit", type=int, default=0, help="with --tree: only the first N audited files (sorted)")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pd-audit-bench-"))
    try:
        if args.tree is None:
            target = work / "tree"
            if args.preset == "flashinfer":
                generate_flashinfer(target, args.files or 10_000)
            else:
                generate(target, args.files or 3000)
        elif args.limit:
            target = work / "tree"
            suffixes = (".py", ".cpp", ".cc", ".cu", ".cuh", ".h", ".hpp")
            files = sorted(p for p in args.tree.rglob("*") if p.is_file() and p.suffix in suffixes)[: args.limit]
            for p in files:
                dst = target / p.relative_to(args.tree)
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(p, dst)
        else:
            target = args.tree
        report = work / "report.json"
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "pointerdomain.audit", "--progress", "none", "--jobs",
                               str(args.jobs), "--format", "json", "-o", str(report), str(target)],
                              env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        # 3: no new finding but files skipped (the flashinfer preset's size-capped files)
        if proc.returncode not in (0, 1, 3):
            print(proc.stderr, file=sys.stderr)
            return 2
        data = json.loads(report.read_text())
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        counts = collections.Counter(f["code"] for f in data["findings"])
        slowest = sorted(data["files"], key=lambda f: -f["seconds"])[:5]
        print(json.dumps({"files": data["summary"]["files"], "jobs": args.jobs, "exit": proc.returncode, "wall_s": round(wall, 1),
                          "cpu_s": round(cpu, 1), "skipped": data["summary"]["skipped"],
                          "findings": dict(sorted(counts.items())), "load_avg_1m": os.getloadavg()[0],
                          "slowest": [(f["path"], f["seconds"]) for f in slowest]}))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
