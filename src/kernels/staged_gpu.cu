// Staged copy-engine path: the copy engine moves whole contiguous host
// runs between the registered host pool and a device staging ring; a small kernel (the
// ordinary transfer kernel, at most max_ctas CTAs) moves the items between the ring and
// the device pool. Host reads and writes then go at copy-engine speed (large requests)
// instead of the SM ceiling of 128-byte lines, and the kernel's SM time is spent on HBM.
#include "gpu.h"
#include "gpu_compat.h"

#include <algorithm>
#include <array>
#include <mutex>
#include <vector>

namespace pointerdomain::gpu {
namespace {

constexpr int kMaxRing = 8;
constexpr std::uint64_t kHeader = 64 << 10;  // staging bytes reserved for the ring's tables and the identity slots
constexpr std::uint64_t kTableBytes = 4 << 10;

int fail(gpuError_t e) {
    if (e != gpuSuccess) gpuGetLastError();
    return static_cast<int>(e);
}

// Per device: the copy stream and the events that order the ring.
struct Resources {
    gpuStream_t copy = nullptr;
    gpuEvent_t start = nullptr, end = nullptr;
    std::array<gpuEvent_t, kMaxRing> ready{}, free{};
};

int resources(int device, Resources **out) {
    static std::mutex mu;
    static std::array<Resources, 64> all;
    static std::array<bool, 64> made{};
    if (device < 0 || device >= 64) return static_cast<int>(gpuErrorInvalidDevice);
    std::lock_guard<std::mutex> lock(mu);
    Resources &r = all[device];
    if (!made[device]) {
        if (gpuError_t e = gpuStreamCreateWithFlags(&r.copy, gpuStreamNonBlocking)) return fail(e);
        for (gpuEvent_t *ev : {&r.start, &r.end})
            if (gpuError_t e = gpuEventCreateWithFlags(ev, gpuEventDisableTiming)) return fail(e);
        for (int k = 0; k < kMaxRing; ++k) {
            if (gpuError_t e = gpuEventCreateWithFlags(&r.ready[k], gpuEventDisableTiming)) return fail(e);
            if (gpuError_t e = gpuEventCreateWithFlags(&r.free[k], gpuEventDisableTiming)) return fail(e);
        }
        made[device] = true;
    }
    *out = &r;
    return 0;
}

// Writes the ring's one-entry tables and the identity slot list 0..chunk-1 into the
// staging header (kernel arguments by value: nothing on the host has to outlive the call).
struct Bases {
    std::uint64_t v[kMaxRing];
};
__global__ void write_header(std::uint64_t *tables, Bases bases, int ring, std::int64_t *iota, std::int64_t chunk) {
    const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < ring) tables[i] = bases.v[i];
    for (std::int64_t j = i; j < chunk; j += static_cast<std::int64_t>(gridDim.x) * blockDim.x) iota[j] = j;
}

// The chunk schedule: (first slot, slots) per chunk. Full chunks in the middle, and ramps of
// chunk/8, chunk/4, chunk/2 at both ends: the pipeline's fill (D2H: the first kernel before
// any copy) and drain (H2D: the last kernel after the last copy) leave the copy engine
// idle for one chunk's kernel time, so short end chunks shorten that (and back to back,
// the next call's start waits on the previous call's end).
std::vector<std::array<std::int64_t, 2>> chunk_schedule(std::int64_t n, std::int64_t chunk) {
    std::vector<std::array<std::int64_t, 2>> out;
    std::array<std::int64_t, 3> ramp{std::max<std::int64_t>(1, chunk / 8), std::max<std::int64_t>(1, chunk / 4),
                                     std::max<std::int64_t>(1, chunk / 2)};
    const std::int64_t ends = 2 * (ramp[0] + ramp[1] + ramp[2]);
    std::int64_t c0 = 0;
    auto add = [&](std::int64_t m) {
        out.push_back({c0, m});
        c0 += m;
    };
    if (chunk < 8 || n < ends + 2 * chunk) {  // too short to gain: equal full chunks
        while (c0 < n) add(std::min(chunk, n - c0));
        return out;
    }
    for (std::int64_t m : ramp) add(m);
    const std::int64_t middle_end = n - (ends / 2);
    while (c0 < middle_end) add(std::min(chunk, middle_end - c0));
    for (auto it = ramp.rbegin(); it != ramp.rend(); ++it) add(*it);
    return out;
}

}  // namespace

int staged_preload() {
    gpuFuncAttributes attributes{};
    return fail(gpuFuncGetAttributes(&attributes, reinterpret_cast<const void *>(write_header)));
}

int staged_transfer(const Transfer &t, bool host_is_src, const Side &host, const std::int64_t *host_idx,
                    std::uint64_t staging, std::uint64_t staging_bytes, int ring, int device, std::uint64_t stream,
                    int max_ctas, int vec_bytes) {
    if (t.n <= 0 || t.num_kv <= 0 || t.layer_count <= 0 || t.item_bytes <= 0) return 0;
    const std::int64_t block = t.layer_count * t.item_bytes;  // one slot's items of one kv, contiguous on the host
    if (t.layer_count > 1 && host.s_layer != t.item_bytes) return kStagedNotApplicable;
    ring = std::max(2, std::min(ring, kMaxRing));
    const std::uint64_t slot_bytes = staging_bytes > kHeader ? ((staging_bytes - kHeader) / ring) & ~std::uint64_t{4095} : 0;
    std::int64_t chunk = static_cast<std::int64_t>(slot_bytes / static_cast<std::uint64_t>(t.num_kv * block));
    chunk = std::min<std::int64_t>({chunk, t.n, static_cast<std::int64_t>((kHeader - kTableBytes) / 8)});
    if (chunk < 1) return kStagedNotApplicable;
    for (std::int64_t i = 0; i < t.n; ++i)
        if (!slot_ok(host_idx[i], host.num_slots)) return kStagedBadIndex;

    int previous = 0;
    if (gpuError_t e = gpuGetDevice(&previous)) return fail(e);
    if (previous != device)
        if (gpuError_t e = gpuSetDevice(device)) return fail(e);
    struct Restore {
        int dev;
        ~Restore() { gpuSetDevice(dev); }
    } restore{previous};
    Resources *res = nullptr;
    if (const int e = resources(device, &res)) return e;
    const auto s = reinterpret_cast<gpuStream_t>(stream);
    const auto cs = res->copy;

    // Staging: [tables | identity slots | ring slot 0 | ring slot 1 | ...]. A ring slot holds
    // `chunk` slots in the host's order: [kv][j][layer][item]; its table entry points
    // layer_begin items before the slot so the kernel's absolute layer offsets land in it.
    auto *tables = reinterpret_cast<std::uint64_t *>(staging);
    auto *iota = reinterpret_cast<std::int64_t *>(staging + kTableBytes);
    Bases bases{};
    for (int k = 0; k < ring; ++k)
        bases.v[k] = staging + kHeader + static_cast<std::uint64_t>(k) * slot_bytes -
                     static_cast<std::uint64_t>(t.layer_begin * t.item_bytes);
    write_header<<<static_cast<unsigned>(std::min<std::int64_t>(64, (chunk + 255) / 256)), 256, 0, s>>>(
        tables, bases, ring, iota, chunk);
    if (gpuError_t e = gpuGetLastError()) return fail(e);
    if (gpuError_t e = gpuEventRecord(res->start, s)) return fail(e);
    if (gpuError_t e = gpuStreamWaitEvent(cs, res->start, 0)) return fail(e);

    std::vector<std::uint64_t> dsts, srcs, sizes;
    const auto schedule = chunk_schedule(t.n, chunk);
    const std::int64_t chunks = static_cast<std::int64_t>(schedule.size());
    for (std::int64_t k = 0; k < chunks; ++k) {
        const int r = static_cast<int>(k % ring);
        const std::int64_t c0 = schedule[k][0], m = schedule[k][1];
        const std::uint64_t ring_base = staging + kHeader + static_cast<std::uint64_t>(r) * slot_bytes;
        // The chunk's contiguous runs: consecutive host blocks merge.
        dsts.clear();
        srcs.clear();
        sizes.clear();
        // A run never crosses a host table entry: two entries may be two registrations, whose
        // aliases are not one range even where the numbers meet.
        std::int64_t last_entry = -1;
        for (std::int64_t kv = 0; kv < t.num_kv; ++kv) {
            for (std::int64_t j = 0; j < m; ++j) {
                const SlotBase b = slot_base(host, host_idx[c0 + j], t.page_size);
                const std::int64_t entry = item_entry(host, b, kv, t.layer_begin);
                const std::uint64_t h = host.table[entry] + item_offset(host, b, kv, t.layer_begin);
                const std::uint64_t d = ring_base + static_cast<std::uint64_t>((kv * chunk + j) * block);
                const std::uint64_t hs = host_is_src ? h : d, hd = host_is_src ? d : h;
                if (!sizes.empty() && entry == last_entry && srcs.back() + sizes.back() == hs &&
                    dsts.back() + sizes.back() == hd) {
                    sizes.back() += static_cast<std::uint64_t>(block);
                } else {
                    srcs.push_back(hs);
                    dsts.push_back(hd);
                    sizes.push_back(static_cast<std::uint64_t>(block));
                }
                last_entry = entry;
            }
        }
        // The kernel's view of this ring slot: a page_first-like side of `chunk` slots.
        Side ring_side{tables + r, 0, 0, 0, chunk * block, t.item_bytes, t.page_size * block, block, chunk};
        Transfer kt = t;
        kt.n = m;
        if (host_is_src) {
            kt.src = ring_side;
            kt.src_idx = iota;
            kt.dst_idx = t.dst_idx + c0;
            if (k >= ring)
                if (gpuError_t e = gpuStreamWaitEvent(cs, res->free[r], 0)) return fail(e);
            if (const int e = copy_runs(dsts.data(), srcs.data(), sizes.data(), sizes.size(), device,
                                        reinterpret_cast<std::uint64_t>(cs), has_batch_copy()))
                return e;
            if (gpuError_t e = gpuEventRecord(res->ready[r], cs)) return fail(e);
            if (gpuError_t e = gpuStreamWaitEvent(s, res->ready[r], 0)) return fail(e);
            if (const int e = transfer(kt, device, stream, max_ctas, vec_bytes)) return e;
            if (gpuError_t e = gpuEventRecord(res->free[r], s)) return fail(e);
        } else {
            kt.dst = ring_side;
            kt.dst_idx = iota;
            kt.src_idx = t.src_idx + c0;
            if (k >= ring)
                if (gpuError_t e = gpuStreamWaitEvent(s, res->free[r], 0)) return fail(e);
            if (const int e = transfer(kt, device, stream, max_ctas, vec_bytes)) return e;
            if (gpuError_t e = gpuEventRecord(res->ready[r], s)) return fail(e);
            if (gpuError_t e = gpuStreamWaitEvent(cs, res->ready[r], 0)) return fail(e);
            if (const int e = copy_runs(dsts.data(), srcs.data(), sizes.data(), sizes.size(), device,
                                        reinterpret_cast<std::uint64_t>(cs), has_batch_copy()))
                return e;
            if (gpuError_t e = gpuEventRecord(res->free[r], cs)) return fail(e);
        }
    }
    // The caller's stream continues after the last copy (D2H) / the last kernel (H2D).
    if (gpuError_t e = gpuEventRecord(res->end, cs)) return fail(e);
    if (gpuError_t e = gpuStreamWaitEvent(s, res->end, 0)) return fail(e);
    return 0;
}

}  // namespace pointerdomain::gpu
