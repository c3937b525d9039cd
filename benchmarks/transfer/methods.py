"""What is measured: one :class:`Method` per column.

(a) bulk copy of the same bytes (CUDA: one cudaMemcpyAsync through torch
    ``.copy_(non_blocking=True)`` between the registered pool and a CUDA tensor; CPU: a
    contiguous torch copy) - the limit every ratio is taken against;
(b) one runtime copy per item (CUDA: ``cupy.cuda.runtime.memcpyAsync``; CPU:
    ``ctypes.memmove``), addresses from the torch reference's item offsets;
(c) the library's copy-engine path, ``transfer_kv_all_layer(backend="copy_engine")``;
(d) torch indexing copy, all layers per statement;
(e) our kernel, ``transfer_kv_all_layer(backend="kernel", max_ctas=N, validate_indices=False)``
    at N = 1, 2, 4, 8 and the whole GPU; (p) the same one ``transfer_kv_per_layer`` call
    per layer; (f) ``backend="auto"`` at the library's default budget;
(s) the staged copy-engine path, ``transfer_kv_all_layer(backend="staged", max_ctas=2)``
    with CUDA index tensors, (sh) the same with CPU index tensors (no device sync);
(g) a simple warp-per-item 16-byte kernel on the whole GPU and (h) an imitation of a
    common 2-CTA design (8-byte words, each warp a contiguous share of the slots), both
    compiled here with ``cupy.RawKernel`` and fed per-item address lists. (h) is a
    simplified imitation: it understates the real peer kernels (sglang's AOT and JIT
    kernels gave 0.60 x and 0.93 x bulk H2D at 1 KiB on 2 CTAs where (h) gave 0.37 x;
    docs/performance.md has their measured figures).

CTA budget and SM-time per GiB (CTAs x seconds per call / GiB moved, in SM-ms) are
recorded per cell: 0 for copy-engine methods, the SM count for whole-GPU kernels (our
whole-GPU grid is the CTAs resident at once: one 1024-thread CTA per SM), none for
torch indexing (its kernels are torch's).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from benchmarks.transfer.common import BenchView, Case, GiB, Skip, pd

__all__ = ["Method", "build"]

Fn = Callable[[], None]
Prep = Callable[["Case", str, torch.Tensor, torch.Tensor], Fn]


@dataclass
class Method:
    key: str
    col: str
    desc: str
    prep: Prep
    ctas: Union[int, str, None] = None  # CTA budget: an int, "GPU", 0 (copy engine) or None (not ours to say)
    mode: str = "all_layer"             # or "per_layer": one call per layer
    cap_items: Optional[int] = None     # at most this many items (slot x kv x layer) per call
    cap_bytes: Optional[int] = None     # at most this many bytes per call
    check: bool = True
    skip: Optional[str] = None          # reason it does not run here

    def sm_count(self, bench: BenchView) -> Optional[int]:
        if isinstance(self.ctas, int):
            return self.ctas
        if self.ctas == "GPU":
            return bench.sms
        return None


BASELINE_CUDA = r"""
typedef unsigned long long u64;
typedef long long i64;
struct alignas(16) Word16 { u64 lo, hi; };

// (g) one warp per item, 16-byte words; srcs/dsts: device addresses of every item.
extern "C" __global__ void warp_per_item_16(const u64 *srcs, const u64 *dsts, i64 items, i64 item_bytes) {
    const i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (warp >= items) return;
    const Word16 *sp = reinterpret_cast<const Word16 *>(srcs[warp]);
    Word16 *dp = reinterpret_cast<Word16 *>(dsts[warp]);
    for (i64 j = lane; j < (item_bytes >> 4); j += 32) dp[j] = sp[j];
}

// (h) imitation of a common design: 8-byte words (non-coherent loads, cache-global
// stores), each warp a contiguous share of the slots, the items of a slot in turn
// (per_slot = num_kv * layers items per slot, slot-major lists); 2 CTAs x 1024 threads.
extern "C" __global__ void common_2cta_8(const u64 *srcs, const u64 *dsts, i64 n, i64 per_slot, i64 item_bytes,
                                         i64 slots_per_warp) {
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const int lane = (int)(tid & 31);
    const i64 warp = tid >> 5;
    for (i64 k = 0; k < slots_per_warp; ++k) {
        const i64 i = warp * slots_per_warp + k;
        if (i >= n) break;
        for (i64 q = 0; q < per_slot; ++q) {
            const u64 *sp = reinterpret_cast<const u64 *>(srcs[i * per_slot + q]);
            u64 *dp = reinterpret_cast<u64 *>(dsts[i * per_slot + q]);
            for (i64 j = lane; j < (item_bytes >> 3); j += 32) {
                u64 v;
                asm volatile("ld.global.nc.b64 %0, [%1];" : "=l"(v) : "l"(sp + j) : "memory");
                asm volatile("st.global.cg.b64 [%0], %1;" ::"l"(dp + j), "l"(v) : "memory");
            }
        }
    }
}
"""


class Cupy:
    """cupy for (b), (g) and (h): the runtime copy call and NVRTC-compiled kernels."""

    def __init__(self, ordinal: int) -> None:
        import cupy  # lazy: optional dependency

        self.cp, self.ordinal = cupy, ordinal
        with cupy.cuda.Device(ordinal):
            module = cupy.RawModule(code=BASELINE_CUDA)
            self.g = module.get_function("warp_per_item_16")
            self.h = module.get_function("common_2cta_8")
        self.version = str(cupy.__version__)


def _addresses(side: Any, slots: torch.Tensor, base: int) -> torch.Tensor:
    """int64 [n * kv * layers] item addresses (slot-major) from the reference's offsets."""
    if base >= 1 << 62:
        raise ValueError("addresses >= 2**62 do not fit the int64 lists here")
    return (side.item_offsets(slots).reshape(-1) + base).contiguous()


def _alias(side: Any) -> int:
    """Device address of byte 0 of a pool: its one kernel-table entry (host) or its
    device tensor (device pool: the per-layer entries are slices of one tensor)."""
    if side.is_host:
        return int(next(iter(side.table)).value)
    return int(side.flat.data_ptr())


def build(bench: BenchView) -> list[Method]:
    """The methods of this run, filtered by ``--methods`` ((a) always: the ratios need it)."""
    cuda = bench.cuda
    a = bench.args
    ms: list[Method] = []
    cupy_skip: Optional[str] = None
    cp: Optional[Cupy] = None
    if cuda:
        try:
            cp = Cupy(bench.device.ordinal)
        except ImportError as exc:
            cupy_skip = f"cupy not importable ({exc})"
        except Exception as exc:
            cupy_skip = f"cupy kernels unavailable ({type(exc).__name__}: {exc})"
    bench.cupy_version = getattr(cp, "version", None)

    # (a)
    def prep_bulk(case: "Case", direction: str, s: torch.Tensor, d: torch.Tensor) -> Fn:
        nbytes = s.numel() * case.bytes_per_slot
        src, dst = case.ends(direction)
        x, y = src.flat[:nbytes], dst.flat[:nbytes]

        def run() -> None:
            y.copy_(x, non_blocking=True)

        return run

    ms.append(Method("a", "(a) bulk", "bulk cudaMemcpyAsync of the same bytes: torch .copy_(non_blocking=True) between "
                     "the registered host pool and a CUDA tensor (the limit)" if cuda else
                     "contiguous torch copy (.copy_) of the same bytes (the limit)", prep_bulk, ctas=0, check=False))

    # (b)
    def prep_per_item(case: "Case", direction: str, s: torch.Tensor, d: torch.Tensor) -> Fn:
        src, dst = case.ends(direction)
        size = case.dev.layout.item_bytes
        # runtime copy calls translate host VAs themselves: data_ptr() of both pools
        srcs = _addresses(src, s, src.flat.data_ptr()).tolist()
        dsts = _addresses(dst, d, dst.flat.data_ptr()).tolist()
        pairs = list(zip(dsts, srcs))
        if not cuda:
            memmove = ctypes.memmove

            def run_cpu() -> None:
                for dd, ss in pairs:
                    memmove(dd, ss, size)

            return run_cpu
        assert cp is not None
        memcpy, stream = cp.cp.cuda.runtime.memcpyAsync, int(bench.stream.cuda_stream)

        def run() -> None:
            for dd, ss in pairs:
                memcpy(dd, ss, size, 4, stream)  # 4: cudaMemcpyDefault

        return run

    ms.append(Method("b", "(b) memcpy/item", "one runtime copy per item (CUDA: cupy.cuda.runtime.memcpyAsync, "
                     "cudaMemcpyDefault; CPU: ctypes.memmove), capped" , prep_per_item, ctas=0,
                     cap_items=a.memcpy_items, skip=cupy_skip if cuda else None))

    # (c)
    def prep_ours(backend: str, max_ctas: Any, per_layer: bool = False, cpu_indices: bool = False) -> Prep:
        def prep(case: "Case", direction: str, s: torch.Tensor, d: torch.Tensor) -> Fn:
            src, dst = case.ends(direction)
            si, di = (s.cpu(), d.cpu()) if cpu_indices else (s.to(bench.tdev), d.to(bench.tdev))
            st, dt, sl, dl = src.table, dst.table, src.layout, dst.layout
            kw: dict[str, Any] = dict(backend=backend, validate_indices=False)
            if max_ctas != "default":
                kw["max_ctas"] = max_ctas
            if not per_layer:
                return lambda: pd.transfer_kv_all_layer(st, dt, si, di, src_layout=sl, dst_layout=dl, **kw)
            layers = range(sl.num_layers)

            def run() -> None:
                for layer in layers:
                    pd.transfer_kv_per_layer(st, dt, si, di, layer_id=layer, src_layout=sl, dst_layout=dl, **kw)

            return run

        return prep

    ms.append(Method("c", "(c) copy engine", "the library's copy-engine path: transfer_kv_all_layer(backend="
                     "'copy_engine') (cudaMemcpyBatchAsync of contiguous runs; here every run is one item)",
                     prep_ours("copy_engine", "default"), ctas=0, cap_items=a.engine_items))

    # (d)
    def prep_index(case: "Case", direction: str, s: torch.Tensor, d: torch.Tensor) -> Fn:
        src, dst = case.ends(direction)
        if src.layout.kind != "layer_first" and dst.layout.kind != "layer_first":
            raise ValueError("torch indexing method expects one layer_first side")
        if (src if direction == "H2D" else dst).layout.kind != "page_first":
            raise Skip("torch indexing row written for a page_first host pool")
        sv, dv = src.items_view(), dst.items_view()
        si, di = s.to(sv.device), d.to(dv.device)
        if not cuda:
            if direction == "D2H":
                return lambda: dv.__setitem__((slice(None), di), sv[:, :, si].transpose(1, 2))
            return lambda: dv.__setitem__((slice(None), slice(None), di), sv[:, si].transpose(1, 2))
        stream, tdev = bench.stream, bench.tdev
        if direction == "D2H":
            def run() -> None:
                items = sv[:, :, si].transpose(1, 2).contiguous()  # [kv, n, layers, item] on the GPU
                staged = items.to("cpu", non_blocking=True)         # torch stages into pinned memory
                stream.synchronize()                                # the bytes must land before the CPU reads them
                dv[:, di] = staged
            return run

        def run_h2d() -> None:
            dv[:, :, di] = sv[:, si].to(tdev, non_blocking=True).transpose(1, 2)

        return run_h2d

    ms.append(Method("d", "(d) torch idx", "torch indexing copy, all layers per statement: D2H host[:, d] = "
                     "dev[:, :, s] (gather on GPU, staged to pinned memory, scatter on CPU); H2D dev[:, :, d] = "
                     "host[:, s].to(cuda)" if cuda else "torch indexing copy on CPU tensors, all layers per statement",
                     prep_index, ctas=None, cap_bytes=int(a.index_gib * GiB)))

    # (e), (p)
    if cuda:
        for mc in (1, 2, 4, 8, None):
            tag = "all" if mc is None else str(mc)
            budget = "whole GPU" if mc is None else f"max_ctas={mc}"
            ms.append(Method(f"e{tag}", f"(e) kernel@{'GPU' if mc is None else mc}",
                             f"our kernel, all layers: transfer_kv_all_layer(backend='kernel', {budget}, "
                             "validate_indices=False)", prep_ours("kernel", pd.WHOLE_GPU if mc is None else mc),
                             ctas="GPU" if mc is None else mc))
        for mc in (1, 2, 4, 8, None):
            tag = "all" if mc is None else str(mc)
            budget = "whole GPU" if mc is None else f"max_ctas={mc}"
            ms.append(Method(f"p{tag}", f"(p) per-layer@{'GPU' if mc is None else mc}",
                             f"our kernel, one transfer_kv_per_layer(backend='kernel', {budget}, "
                             "validate_indices=False) per layer", prep_ours("kernel", pd.WHOLE_GPU if mc is None else mc, per_layer=True),
                             ctas="GPU" if mc is None else mc, mode="per_layer"))
    else:
        ms.append(Method("e", "(e) kernel", "our CPU kernel, transfer_kv_all_layer(backend='kernel') "
                         f"({torch.get_num_threads()} threads)", prep_ours("kernel", "default"), ctas=None))
        ms.append(Method("p", "(p) per-layer", "our CPU kernel, one transfer_kv_per_layer per layer",
                         prep_ours("kernel", "default", per_layer=True), ctas=None, mode="per_layer"))

    # (f)
    default = pd.DEFAULT_MAX_CTAS
    ms.append(Method("f", "(f) auto", f"our auto path, transfer_kv_all_layer(backend='auto') at the default max_ctas "
                     f"({default})", prep_ours("auto", "default"), ctas=default if cuda else None))

    # (s): the staged copy-engine path through the public API
    if cuda:
        from pointerdomain import staged

        if a.staging:
            mib, ring = (int(v) for v in a.staging.split(":"))
            staged.set_staging(bench.device, nbytes=mib << 20, ring=ring)
        staging = staged.staging_config(bench.device)
        ring_text = f"{staging.nbytes >> 20} MiB device ring of {staging.ring} slots"

        def staged_prep(cpu_indices: bool) -> Prep:
            ours_staged = prep_ours("staged", 2, cpu_indices=cpu_indices)

            def prep_staged(case: "Case", direction: str, s: torch.Tensor, d: torch.Tensor) -> Fn:
                src, dst = case.ends(direction)
                if (src if direction == "H2D" else dst).layout.kind != "page_first":
                    raise Skip("the staged path needs a host pool whose slot holds its layers in one block "
                               "(page_first)")
                return ours_staged(case, direction, s, d)

            return prep_staged

        ms.append(Method("s", "(s) staged@2", "our staged copy-engine path: transfer_kv_all_layer(backend='staged', "
                         f"max_ctas=2) (the copy engine moves whole host runs through a {ring_text}, the kernel at "
                         "2 CTAs scatters/gathers the items) with CUDA index tensors, which "
                         "it reads on the host (a sync per call)", staged_prep(False), ctas=2))
        ms.append(Method("sh", "(sh) staged@2, CPU indices", "the same with CPU index tensors (no sync: the host "
                         "prepares the next call while the GPU copies)", staged_prep(True), ctas=2))

    # (g), (h)
    def prep_cupy(which: str) -> Prep:
        def prep(case: "Case", direction: str, s: torch.Tensor, d: torch.Tensor) -> Fn:
            assert cp is not None
            src, dst = case.ends(direction)
            lo = src.layout
            srcs = _addresses(src, s, _alias(src)).to(bench.tdev)
            dsts = _addresses(dst, d, _alias(dst)).to(bench.tdev)
            n, per_slot = s.numel(), lo.num_kv * lo.num_layers
            ptrs = (cp.cp.uint64(srcs.data_ptr()), cp.cp.uint64(dsts.data_ptr()))
            if which == "g":
                items = n * per_slot
                grid, block, kern = (items + 7) // 8, 256, cp.g
                args = ptrs + (cp.cp.int64(items), cp.cp.int64(lo.item_bytes))
            else:
                warps = 2 * 32
                per_warp = (n + warps - 1) // warps
                grid, block, kern = (n + per_warp * 32 - 1) // (per_warp * 32), 1024, cp.h
                args = ptrs + (cp.cp.int64(n), cp.cp.int64(per_slot), cp.cp.int64(lo.item_bytes),
                               cp.cp.int64(per_warp))
            ext_stream = cp.cp.cuda.ExternalStream(int(bench.stream.cuda_stream))
            device = cp.cp.cuda.Device(cp.ordinal)
            keep = (srcs, dsts)

            def run() -> None:
                _ = keep  # the kernel reads these lists: keep them alive with the closure
                with device, ext_stream:
                    kern((grid,), (block,), args)

            return run

        return prep

    if cuda:
        ms.append(Method("g", "(g) warp16 GPU", "simple kernel: one warp per item, 16-byte words, every item in one "
                         "launch (whole GPU); cupy.RawKernel, per-item address lists", prep_cupy("g"), ctas="GPU",
                         skip=cupy_skip))
        ms.append(Method("h", "(h) 2CTA imitation", "imitation of a common 2-CTA design (8-byte ld.global.nc / "
                         "st.global.cg, each warp a contiguous share of the slots, 2 CTAs x 1024 threads; cupy, "
                         "per-item address lists). Understates the real peers: see docs/performance.md",
                         prep_cupy("h"), ctas=2, skip=cupy_skip))
    wanted = a.methods
    if wanted != "all":
        keys = {k.strip() for k in wanted.split(",")}
        ms = [m for m in ms if m.key in keys or m.key == "a"]
    return ms

