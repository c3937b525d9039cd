// Kernel tuning sweep (H200), in one process per phase: `candidates` (every candidate shape
// of the specialised transfer kernel), `shipped` (gpu::transfer's own choice on the other
// host layouts), `all` (both), `tma` (the TMA bulk-copy experiment, not adopted) and
// `staged` (gpu::staged_transfer, the staged copy-engine path).
// A developer tool: it includes the kernel source to reach the templates; the user
// benchmark (python -m benchmarks.transfer) goes through the public API only.
//
// Build and run (scripts/gpu-check sweep does this):
//   nvcc -arch=sm_90 -O3 -std=c++17 -Isrc/kernels benchmarks/kernel_sweep.cu -o /tmp/sweep
//   /tmp/sweep OUT_DIR [all|candidates|shipped|tma|staged] [GiB per point]
//
// Pools: a device pool in layer_first layout with one table entry per (kv, layer)
// buffer (as engines hold them) and a registered host pool (page_first by default,
// one table entry), 32 layers, 16-token pages, about 1 GiB; every slot of both pools
// moved, in random page order. Every timed point is checked first: the destination
// is poisoned, the variant runs once, and a check kernel compares every destination
// item with the source's fill pattern at the offset given by the layouts' shapes
// (an indexing formula written from the layout shapes, independent of item_address).
#include "../src/kernels/transfer_gpu.cu"
#include "../src/kernels/transfer_cpu.cpp"
#include "../src/kernels/staged_gpu.cu"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace pd = pointerdomain;
namespace g = pointerdomain::gpu;

#define CK(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            std::exit(2);                                                                          \
        }                                                                                          \
    } while (0)

enum Kind { LAYER_FIRST = 0, PAGE_FIRST = 1, PAGE_FIRST_DIRECT = 2 };
static const char *kind_name[] = {"layer_first", "page_first", "page_first_direct"};

struct Shape {
    int num_kv, layers, page_size, item;
    std::int64_t pages;
    __host__ __device__ std::int64_t slots() const { return pages * page_size; }
    __host__ __device__ std::int64_t nbytes() const { return (std::int64_t)num_kv * layers * slots() * item; }
};

// Byte offset of (kv, layer, slot) from the layout's one-buffer shape (layouts.py docstring).
__host__ __device__ inline std::int64_t ref_offset(int kind, const Shape &s, std::int64_t kv, std::int64_t layer,
                                                   std::int64_t slot) {
    const std::int64_t L = s.layers, S = s.slots(), P = s.pages, ps = s.page_size, it = s.item;
    if (kind == LAYER_FIRST) return ((kv * L + layer) * S + slot) * it;
    if (kind == PAGE_FIRST) return ((kv * S + slot) * L + layer) * it;
    const std::int64_t page = slot / ps, tok = slot % ps;
    return (((kv * P + page) * L + layer) * ps + tok) * it;
}

// Geometry like KVLayout.geometry: dims outermost first, the first `split` covered by the table.
static pd::Side make_side(int kind, const Shape &s, int split, const std::uint64_t *table) {
    const char *order[3][4] = {{"kv", "layer", "page", "tok"}, {"kv", "page", "tok", "layer"},
                               {"kv", "page", "layer", "tok"}};
    auto count = [&](const std::string &d) -> std::int64_t {
        return d == "kv" ? s.num_kv : d == "layer" ? s.layers : d == "page" ? s.pages : s.page_size;
    };
    std::int64_t stride[4], st = s.item;
    for (int j = 3; j >= 0; --j) {
        stride[j] = st;
        st *= count(order[kind][j]);
    }
    std::int64_t e[3] = {0, 0, 0}, o[4] = {0, 0, 0, 0};  // kv, layer, page (, tok)
    auto id = [](const std::string &d) { return d == "kv" ? 0 : d == "layer" ? 1 : d == "page" ? 2 : 3; };
    std::int64_t es = 1;
    for (int j = split - 1; j >= 0; --j) {
        e[id(order[kind][j])] = es;
        es *= count(order[kind][j]);
    }
    for (int j = split; j < 4; ++j) o[id(order[kind][j])] = stride[j];
    return pd::Side{table, e[0], e[1], e[2], o[0], o[1], o[2], o[3], s.slots()};
}

__device__ __host__ inline std::uint32_t mix(std::uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return static_cast<std::uint32_t>(x);
}

__global__ void fill(std::uint32_t *p, std::int64_t words, std::uint64_t seed) {
    for (std::int64_t i = blockIdx.x * (std::int64_t)blockDim.x + threadIdx.x; i < words;
         i += (std::int64_t)gridDim.x * blockDim.x)
        p[i] = mix(seed * 0x9E3779B97F4A7C15ULL + i);
}

// One thread per 4-byte word of every moved item: dst word == src fill pattern.
__global__ void check(const std::uint32_t *dst, int dst_kind, Shape shape, const std::int64_t *si,
                      const std::int64_t *di, std::int64_t n, int src_kind, std::uint64_t src_seed,
                      unsigned long long *bad) {
    const std::int64_t wpi = shape.item / 4, per_pair = (std::int64_t)shape.num_kv * shape.layers * wpi;
    for (std::int64_t x = blockIdx.x * (std::int64_t)blockDim.x + threadIdx.x; x < n * per_pair;
         x += (std::int64_t)gridDim.x * blockDim.x) {
        const std::int64_t i = x / per_pair, r = x % per_pair;
        const std::int64_t kv = r / (shape.layers * wpi), layer = (r / wpi) % shape.layers, w = r % wpi;
        const std::int64_t so = ref_offset(src_kind, shape, kv, layer, si[i]) / 4 + w;
        const std::int64_t dw = ref_offset(dst_kind, shape, kv, layer, di[i]) / 4 + w;
        if (dst[dw] != mix(src_seed * 0x9E3779B97F4A7C15ULL + so)) atomicAdd(bad, 1ULL);
    }
}

struct Pool {
    Shape shape;
    int kind, split;
    bool host;
    std::uint8_t *va = nullptr;      // host VA (host pools) or device pointer
    std::uint64_t alias = 0;         // device address of byte 0
    std::uint64_t *table = nullptr;  // device table
    int entries = 1;
    pd::Side side() const { return make_side(kind, shape, split, table); }
};

static Pool make_pool(const Shape &s, int kind, bool host, bool per_layer_table) {
    Pool p;
    p.shape = s;
    p.kind = kind;
    p.host = host;
    p.split = per_layer_table ? 2 : 0;  // layer_first: (kv, layer) entries
    p.entries = per_layer_table ? s.num_kv * s.layers : 1;
    const std::size_t nb = static_cast<std::size_t>(s.nbytes());
    if (host) {
        p.va = static_cast<std::uint8_t *>(std::aligned_alloc(1 << 21, (nb + (1 << 21) - 1) & ~std::size_t((1 << 21) - 1)));
        CK(cudaHostRegister(p.va, nb, cudaHostRegisterPortable | cudaHostRegisterMapped));
        void *a = nullptr;
        CK(cudaHostGetDevicePointer(&a, p.va, 0));
        p.alias = reinterpret_cast<std::uint64_t>(a);
    } else {
        CK(cudaMalloc(&p.va, nb));
        p.alias = reinterpret_cast<std::uint64_t>(p.va);
    }
    std::vector<std::uint64_t> t(p.entries);
    for (int e = 0; e < p.entries; ++e) t[e] = p.alias + static_cast<std::uint64_t>(e) * (nb / p.entries);
    CK(cudaMalloc(&p.table, 8 * t.size()));
    CK(cudaMemcpy(p.table, t.data(), 8 * t.size(), cudaMemcpyHostToDevice));
    return p;
}

static void free_pool(Pool &p) {
    if (p.host) {
        cudaHostUnregister(p.va);
        std::free(p.va);
    } else {
        cudaFree(p.va);
    }
    cudaFree(p.table);
}

// Experiment: the copy engine inside the SM (TMA, cp.async.bulk). Each thread is a worker
// that owns NS shared-memory slots of ITEM bytes: a bulk load from the source into a slot
// completes on the slot's mbarrier, a bulk store writes the slot to the destination. Do
// bulk requests read host memory over PCIe more efficiently than 128-byte line loads?
namespace tma {
__device__ __forceinline__ std::uint32_t smem(const void *p) {
    return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}
template <int ITEM, int NS>
__global__ void __launch_bounds__(128) kernel(const __grid_constant__ pd::Transfer t) {
    extern __shared__ __align__(128) unsigned char buf[];
    const int W = blockDim.x;
    unsigned long long *bars = reinterpret_cast<unsigned long long *>(buf + static_cast<std::size_t>(W) * NS * ITEM);
    unsigned char *slot0 = buf + static_cast<std::size_t>(threadIdx.x) * NS * ITEM;
    unsigned long long *bar0 = bars + threadIdx.x * NS;
    for (int k = 0; k < NS; ++k) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem(bar0 + k)));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    std::uint32_t phase[NS];
    for (int k = 0; k < NS; ++k) phase[k] = 0;
    const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * W;
    const int lc = static_cast<int>(t.layer_count), qn = static_cast<int>(t.num_kv) * lc;
    for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * W + threadIdx.x; i < t.n; i += stride) {
        const std::int64_t s = t.src_idx[i], d = t.dst_idx[i];
        if (!pd::slot_ok(s, t.src.num_slots) || !pd::slot_ok(d, t.dst.num_slots)) {
            if (t.oob) *t.oob = 1u;
            continue;
        }
        const pd::SlotBase sb = pd::slot_base(t.src, s, t.page_size), db = pd::slot_base(t.dst, d, t.page_size);
        auto issue_load = [&](int q, int k) {
            const int kv = q >= lc ? 1 : 0;
            const std::uint64_t src = g::item_ptr(t.src, sb, kv, t.layer_begin + (q - kv * lc));
            asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // the slot's last store has read it
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem(bar0 + k)), "r"(ITEM)
                         : "memory");
            asm volatile(
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                    smem(slot0 + k * ITEM)),
                "l"(src), "r"(ITEM), "r"(smem(bar0 + k))
                : "memory");
        };
        for (int q = 0; q < qn && q < NS; ++q) issue_load(q, q);
        for (int q = 0; q < qn; ++q) {
            const int k = q % NS;
            std::uint32_t done = 0;
            while (!done) {
                asm volatile(
                    "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                    : "=r"(done)
                    : "r"(smem(bar0 + k)), "r"(phase[k])
                    : "memory");
            }
            phase[k] ^= 1u;
            const int kv = q >= lc ? 1 : 0;
            const std::uint64_t dst = g::item_ptr(t.dst, db, kv, t.layer_begin + (q - kv * lc));
            asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
                         "r"(smem(slot0 + k * ITEM)), "r"(ITEM)
                         : "memory");
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
            if (q + NS < qn) issue_load(q + NS, k);
        }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
template <int ITEM, int NS, int W> int launch(const pd::Transfer &t, int max_ctas, cudaStream_t s) {
    const int smem_bytes = W * NS * ITEM + W * NS * 8;
    static bool set = [&] {
        return cudaFuncSetAttribute(kernel<ITEM, NS>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes) ==
               cudaSuccess;
    }();
    if (!set) return 1;
    int ctas = max_ctas > 0 ? max_ctas : 132;
    const std::int64_t need = (t.n + W - 1) / W;
    if (need < ctas) ctas = static_cast<int>(need);
    kernel<ITEM, NS><<<ctas, W, smem_bytes, s>>>(t);
    return static_cast<int>(cudaGetLastError());
}
}  // namespace tma

using LaunchFn = std::function<int(const pd::Transfer &, int max_ctas, cudaStream_t)>;
struct Variant {
    std::string name;
    int item;
    LaunchFn fn;
};

template <int ITEM, int LANES, int VEC, int U, int HINT = 1> Variant V() {
    char b[64];
    std::snprintf(b, sizeof b, "L%d.V%d.U%d%s", LANES, VEC, U, HINT ? "" : ".plain");
    return Variant{b, ITEM, [](const pd::Transfer &t, int m, cudaStream_t s) {
                       return g::launch_item<ITEM, LANES, VEC, U, HINT>(t, 0, m, s);
                   }};
}

template <int ITEM, int NS, int W> Variant T() {
    char b[64];
    std::snprintf(b, sizeof b, "TMA.S%d.W%d", NS, W);
    return Variant{b, ITEM, [](const pd::Transfer &t, int m, cudaStream_t s) { return tma::launch<ITEM, NS, W>(t, m, s); }};
}

static std::vector<Variant> tma_candidates() {
    return {T<512, 4, 96>(), T<1024, 2, 96>(), T<1024, 4, 48>(), T<1152, 2, 96>(), T<2048, 2, 48>(), T<4096, 1, 48>()};
}

static std::vector<Variant> candidates() {
    return {
        // 128-byte groups, one item in flight per worker (sglang JIT's shape, written here)
        V<512, 16, 8, 1>(), V<1024, 16, 8, 1>(), V<1152, 16, 8, 1>(), V<2048, 32, 4, 1>(), V<4096, 32, 4, 1>(),
        // round 2 (round 1: U = 1 with 128 B per lane won; see docs/log/2026-12-01.md)
        V<512, 4, 16, 1>(), V<512, 8, 16, 1>(), V<512, 8, 16, 2>(), V<512, 4, 8, 1>(),
        V<1024, 8, 16, 1>(), V<1024, 8, 8, 1>(), V<1024, 8, 16, 1, 0>(),
        V<1152, 8, 16, 1>(), V<1152, 8, 16, 1, 0>(), V<1152, 16, 8, 2>(),
        V<2048, 16, 16, 1>(), V<2048, 16, 8, 1>(), V<4096, 32, 16, 1>(), V<4096, 32, 8, 1>(),
    };
}

struct Ctx {
    cudaStream_t stream;
    cudaEvent_t e0, e1;
    unsigned long long *bad;
    FILE *json;
    double bulk[2] = {0, 0};  // D2H, H2D GB/s
    std::vector<std::string> table;
};

struct Case {
    Shape shape;
    int host_kind;
    bool mla;
    Pool dev, host;
    std::int64_t *d_dev_slots, *d_host_slots;
    std::int64_t n;
    std::vector<std::int64_t> host_slots;  // host copy (the staged path reads it on the host)
};

static Case make_case(int item, bool mla, int host_kind, std::int64_t target_bytes, std::mt19937_64 &rng) {
    Case c;
    c.shape = Shape{mla ? 1 : 2, 32, 16, item, 0};
    c.shape.pages = std::max<std::int64_t>(64, target_bytes / ((std::int64_t)c.shape.num_kv * 32 * 16 * item));
    c.host_kind = host_kind;
    c.mla = mla;
    c.dev = make_pool(c.shape, LAYER_FIRST, false, true);
    c.host = make_pool(c.shape, host_kind, true, false);
    const std::int64_t P = c.shape.pages, ps = c.shape.page_size;
    std::vector<std::int64_t> pd_(P), ph(P);
    std::iota(pd_.begin(), pd_.end(), 0);
    std::iota(ph.begin(), ph.end(), 0);
    std::shuffle(pd_.begin(), pd_.end(), rng);
    std::shuffle(ph.begin(), ph.end(), rng);
    std::vector<std::int64_t> ds(P * ps), hs(P * ps);
    for (std::int64_t p = 0; p < P; ++p)
        for (std::int64_t t = 0; t < ps; ++t) {
            ds[p * ps + t] = pd_[p] * ps + t;
            hs[p * ps + t] = ph[p] * ps + t;
        }
    c.n = P * ps;
    CK(cudaMalloc(&c.d_dev_slots, 8 * c.n));
    CK(cudaMalloc(&c.d_host_slots, 8 * c.n));
    CK(cudaMemcpy(c.d_dev_slots, ds.data(), 8 * c.n, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(c.d_host_slots, hs.data(), 8 * c.n, cudaMemcpyHostToDevice));
    c.host_slots = hs;
    return c;
}

static void free_case(Case &c) {
    free_pool(c.dev);
    free_pool(c.host);
    cudaFree(c.d_dev_slots);
    cudaFree(c.d_host_slots);
}

static double elapsed(Ctx &x, const std::function<void()> &fn, int reps) {
    CK(cudaEventRecord(x.e0, x.stream));
    for (int r = 0; r < reps; ++r) fn();
    CK(cudaEventRecord(x.e1, x.stream));
    CK(cudaEventSynchronize(x.e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, x.e0, x.e1));
    return ms / 1e3;
}

// One point: dir 0 = D2H (device -> host), 1 = H2D. per_layer: one launch per layer.
static void point(Ctx &x, Case &c, int dir, bool per_layer, int budget, const std::string &vname,
                  const LaunchFn &fn, std::uint64_t &seed) {
    Pool &src = dir == 0 ? c.dev : c.host, &dst = dir == 0 ? c.host : c.dev;
    std::int64_t *si = dir == 0 ? c.d_dev_slots : c.d_host_slots, *di = dir == 0 ? c.d_host_slots : c.d_dev_slots;
    pd::Transfer t{src.side(), dst.side(), si, di, c.n, c.shape.page_size, c.shape.num_kv, 0, c.shape.layers,
                   c.shape.item, nullptr};
    int status = 0;
    auto run = [&] {
        if (!per_layer) {
            status |= fn(t, budget, x.stream);
        } else {
            for (int l = 0; l < c.shape.layers; ++l) {
                pd::Transfer tl = t;
                tl.layer_begin = l;
                tl.layer_count = 1;
                status |= fn(tl, budget, x.stream);
            }
        }
    };
    const std::uint64_t src_seed = seed++, poison = seed++;
    fill<<<1024, 256, 0, x.stream>>>(reinterpret_cast<std::uint32_t *>(src.alias), src.shape.nbytes() / 4, src_seed);
    fill<<<1024, 256, 0, x.stream>>>(reinterpret_cast<std::uint32_t *>(dst.alias), dst.shape.nbytes() / 4, poison);
    CK(cudaMemsetAsync(x.bad, 0, 8, x.stream));
    run();
    check<<<2048, 256, 0, x.stream>>>(reinterpret_cast<const std::uint32_t *>(dst.alias), dst.kind, c.shape, si, di,
                                      c.n, src.kind, src_seed, x.bad);
    unsigned long long bad = 0;
    CK(cudaMemcpyAsync(&bad, x.bad, 8, cudaMemcpyDeviceToHost, x.stream));
    CK(cudaStreamSynchronize(x.stream));
    CK(cudaGetLastError());
    double gbps = 0;
    if (status == 0 && bad == 0) {
        const double one = elapsed(x, run, 1);
        const int reps = std::max(2, std::min(20, static_cast<int>(0.08 / std::max(one, 1e-6))));
        double best[3];
        for (double &b : best) b = elapsed(x, run, reps) / reps;
        std::sort(best, best + 3);
        gbps = c.shape.nbytes() / best[1] / 1e9;
    }
    const double ratio = gbps / x.bulk[dir];
    char line[400];
    std::snprintf(line, sizeof line, "%-17s %-5s %s %-3s %-9s %-16s %4s %7.2f %5.3f %s", kind_name[c.host_kind],
                  c.mla ? "MLA" : "MHA", c.shape.item == 1152 ? "1152" : std::to_string(c.shape.item).c_str(),
                  dir == 0 ? "D2H" : "H2D", per_layer ? "per-layer" : "all-layer", vname.c_str(),
                  budget > 0 ? std::to_string(budget).c_str() : "GPU", gbps, ratio,
                  status ? "LAUNCH-ERROR" : bad ? "WRONG-BYTES" : "ok");
    std::printf("%s\n", line);
    std::fflush(stdout);
    x.table.push_back(line);
    std::fprintf(x.json,
                 "{\"host_layout\":\"%s\",\"attention\":\"%s\",\"item\":%d,\"dir\":\"%s\",\"mode\":\"%s\","
                 "\"variant\":\"%s\",\"ctas\":%d,\"gbps\":%.3f,\"x_bulk\":%.4f,\"bad_words\":%llu,\"status\":%d,"
                 "\"bytes\":%lld}\n",
                 kind_name[c.host_kind], c.mla ? "mla" : "mha", c.shape.item, dir == 0 ? "D2H" : "H2D",
                 per_layer ? "per_layer" : "all_layer", vname.c_str(), budget, gbps, ratio, bad, status,
                 (long long)c.shape.nbytes());
    std::fflush(x.json);
}

static void bulk(Ctx &x, std::int64_t nbytes) {
    void *h = std::aligned_alloc(1 << 21, nbytes), *d = nullptr;
    CK(cudaHostRegister(h, nbytes, cudaHostRegisterPortable | cudaHostRegisterMapped));
    CK(cudaMalloc(&d, nbytes));
    for (int dir = 0; dir < 2; ++dir) {
        auto run = [&] {
            if (dir == 0) CK(cudaMemcpyAsync(h, d, nbytes, cudaMemcpyDeviceToHost, x.stream));
            else CK(cudaMemcpyAsync(d, h, nbytes, cudaMemcpyHostToDevice, x.stream));
        };
        elapsed(x, run, 1);
        double b[3];
        for (double &v : b) v = elapsed(x, run, 4) / 4;
        std::sort(b, b + 3);
        x.bulk[dir] = nbytes / b[1] / 1e9;
    }
    std::printf("bulk cudaMemcpyAsync %.2f GiB: D2H %.2f GB/s, H2D %.2f GB/s\n", nbytes / double(1 << 30), x.bulk[0],
                x.bulk[1]);
    std::fprintf(x.json, "{\"bulk_d2h\":%.3f,\"bulk_h2d\":%.3f}\n", x.bulk[0], x.bulk[1]);
    CK(cudaHostUnregister(h));
    std::free(h);
    CK(cudaFree(d));
}

int main(int argc, char **argv) {
    const std::string out = argc > 1 ? argv[1] : ".";
    const std::string phase = argc > 2 ? argv[2] : "all";
    const double gib = argc > 3 ? std::atof(argv[3]) : 1.0;
    const std::int64_t target = static_cast<std::int64_t>(gib * (1 << 30));
    Ctx x;
    CK(cudaStreamCreateWithFlags(&x.stream, cudaStreamNonBlocking));
    CK(cudaEventCreate(&x.e0));
    CK(cudaEventCreate(&x.e1));
    CK(cudaMalloc(&x.bad, 8));
    x.json = std::fopen((out + "/sweep-" + phase + ".jsonl").c_str(), "w");
    cudaDeviceProp prop{};
    CK(cudaGetDeviceProperties(&prop, 0));
    std::printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
    bulk(x, target);
    std::mt19937_64 rng(7);
    std::uint64_t seed = 1;
    const auto t0 = std::chrono::steady_clock::now();
    auto secs = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
    LaunchFn shipped = [](const pd::Transfer &t, int m, cudaStream_t s) {
        return g::transfer(t, 0, reinterpret_cast<std::uint64_t>(s), m, 16);
    };
    struct Item { int item; bool mla; };
    if (phase == "all" || phase == "candidates" || phase == "tma") {
        // Every candidate at 1, 2 and 4 CTAs, all-layer, and 1 and 2 CTAs per-layer; both directions.
        const std::vector<Variant> vs = phase == "tma" ? tma_candidates() : candidates();
        for (Item it : {Item{512, false}, Item{1024, false}, Item{1152, true}, Item{1152, false}, Item{2048, false},
                        Item{4096, false}}) {
            Case c = make_case(it.item, it.mla, PAGE_FIRST, target, rng);
            for (const Variant &v : vs) {
                if (v.item != it.item) continue;
                for (int dir = 0; dir < 2; ++dir) {
                    for (int b : {1, 2, 4}) point(x, c, dir, false, b, v.name, v.fn, seed);
                    for (int b : {1, 2}) point(x, c, dir, true, b, v.name, v.fn, seed);
                }
            }
            free_case(c);
            std::printf("-- %.0f s\n", secs());
        }
    }
    if (phase == "staged") {
        // The staged copy-engine path at 1 and 2 CTAs, all layers, page_first host.
        void *staging = nullptr;
        const std::uint64_t staging_max = 256ull << 20;
        CK(cudaMalloc(&staging, staging_max));
        for (Item it : {Item{1024, false}, Item{1152, true}, Item{2048, false}, Item{4096, false}}) {
            Case c = make_case(it.item, it.mla, PAGE_FIRST, target, rng);
            const std::uint64_t host_entry = c.host.alias;  // the host side's table, in host memory
            const pd::Side host_side = make_side(PAGE_FIRST, c.shape, 0, &host_entry);
            for (std::uint64_t mib : {16ull, 64ull, 256ull})
                for (int ring : {2, 4}) {
                    if (mib == 256 && ring == 2) continue;
                    char name[64];
                    std::snprintf(name, sizeof name, "staged.%lluMiB.r%d", (unsigned long long)mib, ring);
                    for (int dir = 0; dir < 2; ++dir) {
                        LaunchFn fn = [&, dir, mib, ring](const pd::Transfer &t, int m, cudaStream_t s) {
                            return g::staged_transfer(t, dir == 1, host_side, c.host_slots.data(),
                                                      reinterpret_cast<std::uint64_t>(staging), mib << 20, ring, 0,
                                                      reinterpret_cast<std::uint64_t>(s), m, 16);
                        };
                        for (int b : {1, 2}) point(x, c, dir, false, b, name, fn, seed);
                    }
                }
            free_case(c);
            std::printf("-- %.0f s\n", secs());
        }
        CK(cudaFree(staging));
    }
    if (phase == "all" || phase == "shipped") {
        // The shipped dispatch on the other host layouts (page_first at every budget: python -m benchmarks.transfer).
        for (Item it : {Item{512, false}, Item{1024, false}, Item{1152, true}, Item{2048, false}, Item{4096, false},
                        Item{16384, false}}) {
            for (int hk : {PAGE_FIRST_DIRECT, LAYER_FIRST}) {
                Case c = make_case(it.item, it.mla, hk, target, rng);
                for (int dir = 0; dir < 2; ++dir)
                    for (bool pl : {false, true})
                        for (int b : {1, 2, 0}) point(x, c, dir, pl, b, "shipped", shipped, seed);
                free_case(c);
            }
            std::printf("-- %.0f s\n", secs());
        }
    }
    std::fclose(x.json);
    std::printf("\n%-17s %-5s %s %-3s %-9s %-16s %4s %7s %5s\n", "host", "attn", "item", "dir", "mode", "variant",
                "ctas", "GB/s", "xbulk");
    for (const auto &l : x.table)
        if (l.find("shipped") != std::string::npos) std::printf("%s\n", l.c_str());
    return 0;
}
