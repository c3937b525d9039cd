#include "strict_alloc.h"

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <atomic>
#include <map>
#include <mutex>
#include <random>

namespace pointerdomain::strict {
namespace {
std::mutex mu;
std::map<void *, std::uint64_t> lengths;  // mapping -> length, for unmap from a deleter
struct Twin {
    std::uint64_t len;           // the twin mapping
    std::uint64_t reserve_base;  // its reservation (guard pages around it), unmapped whole
    std::uint64_t reserve_len;
};
std::map<void *, Twin> twins;
// Lowest reservation so far: a placement hint only, so no lock (reserve_guarded runs under
// the emulated backend's lock too, and a second lock there would order two fork handlers).
std::atomic<std::uint64_t> last_reserve{0};
constexpr std::uint64_t kMaxGapPages = 256;

void *keep(void *m, std::uint64_t len) {
    if (m == MAP_FAILED) return nullptr;
    std::lock_guard<std::mutex> lock(mu);
    lengths[m] = len;
    return m;
}

// fork(): both mappings of a strict allocation are MAP_SHARED, so a child writing the
// host mapping (a forked worker filling a pool) would write the parent's pages. In the
// child (single-threaded here) each mapping becomes a private anonymous copy of its bytes
// at the same address, as pinned malloc'd memory is copied into a child at fork (Linux >=
// 5.9). The two mappings no longer share bytes in the child: a child must not use them
// for device work (CUDA does not survive fork either).
void before_fork() { mu.lock(); }
void after_fork_parent() { mu.unlock(); }
void make_private(void *at, std::uint64_t len) {
    void *copy = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (copy == MAP_FAILED) return;
    std::memcpy(copy, at, len);
    if (mremap(copy, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, at) == MAP_FAILED) munmap(copy, len);
}
void after_fork_child() {
    for (auto &kv : lengths) make_private(kv.first, kv.second);
    for (auto &kv : twins) make_private(kv.first, kv.second.len);  // each chunk's registered mapping too
    mu.unlock();
}
const int fork_handlers = pthread_atfork(before_fork, after_fork_parent, after_fork_child);

// The highest start of a free range of `total` bytes lying inside [floor, top), or 0 if none:
// the process's mappings are read from /proc/self/maps (sorted by address). The slot right
// below the last reservation is often taken (the kernel fills holes top-down with torch's and
// the allocator's mappings), and the kernel's own choice would then go up into a hole: this
// keeps the aliases descending while the host VAs ascend, as on MI355X, wherever room is left.
std::uint64_t highest_gap_below(std::uint64_t top, std::uint64_t total, std::uint64_t floor) {
    FILE *maps = std::fopen("/proc/self/maps", "re");
    if (maps == nullptr) return 0;
    char *line = nullptr;
    size_t cap = 0;
    std::uint64_t best = 0, prev_hi = floor;
    auto consider = [&](std::uint64_t gap_lo, std::uint64_t gap_hi) {
        if (gap_hi > top) gap_hi = top;
        if (gap_hi > gap_lo && gap_hi - gap_lo >= total) best = gap_hi - total;
    };
    while (getline(&line, &cap, maps) > 0) {
        unsigned long long lo = 0, hi = 0;
        if (std::sscanf(line, "%llx-%llx", &lo, &hi) != 2) continue;
        if (lo >= top) break;  // every later gap starts above top
        if (lo > prev_hi) consider(prev_hi, lo);
        if (hi > prev_hi) prev_hi = hi;
    }
    if (prev_hi < top) consider(prev_hi, top);
    std::free(line);
    std::fclose(maps);
    return best;
}

std::uint64_t round_up(std::uint64_t n) {
    const auto p = static_cast<std::uint64_t>(sysconf(_SC_PAGESIZE));
    return (n + p - 1) & ~(p - 1);
}
}  // namespace

void *shared_alloc(std::uint64_t nbytes) {
    if (nbytes == 0) return nullptr;
    const std::uint64_t len = round_up(nbytes);
    const int fd = memfd_create("pointerdomain-strict", MFD_CLOEXEC);
    if (fd < 0) return nullptr;
    if (ftruncate(fd, static_cast<off_t>(len)) != 0) {
        close(fd);
        return nullptr;
    }
    // Populated now: cudaHostRegister faults the pages in when it pins them anyway.
    void *m = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    close(fd);
    return keep(m, len);
}

void *mirror(std::uint64_t va, std::uint64_t nbytes) {
    const auto p = static_cast<std::uint64_t>(sysconf(_SC_PAGESIZE));
    if (va == 0 || nbytes == 0 || (va & (p - 1)) != 0) return nullptr;
    // old_size 0 on a shared mapping: a new mapping of the same pages (mremap(2)).
    void *m = mremap(reinterpret_cast<void *>(va), 0, round_up(nbytes), MREMAP_MAYMOVE);
    return keep(m, round_up(nbytes));
}

std::uint64_t reserve_guarded(std::uint64_t len, std::uint64_t *reserve_base, std::uint64_t *reserve_len) {
    const std::uint64_t p = static_cast<std::uint64_t>(sysconf(_SC_PAGESIZE));
    thread_local std::mt19937_64 rng{std::random_device{}()};
    const std::uint64_t before = (1 + rng() % kMaxGapPages) * p, after = (1 + rng() % kMaxGapPages) * p;
    const std::uint64_t total = before + round_up(len) + after;
    const std::uint64_t last = last_reserve.load(std::memory_order_relaxed);
    constexpr std::uint64_t kFloor = std::uint64_t{1} << 32;  // never near the low heap and the program
    auto place_at = [&](std::uint64_t at) -> void * {
        void *m = mmap(reinterpret_cast<void *>(at), total, PROT_NONE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
        if (m != MAP_FAILED && reinterpret_cast<std::uint64_t>(m) != at) {
            munmap(m, total);  // a kernel without MAP_FIXED_NOREPLACE took the address as a hint only
            m = MAP_FAILED;
        }
        return m;
    };
    void *r = MAP_FAILED;
    if (last > total + kFloor) {
        r = place_at(last - total);
        if (r == MAP_FAILED) {
            const std::uint64_t gap = highest_gap_below(last, total, kFloor);
            if (gap != 0) r = place_at(gap);  // another thread may take it first: then the kernel chooses
        }
    }
    if (r == MAP_FAILED) r = mmap(nullptr, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (r == MAP_FAILED) return 0;
    const std::uint64_t base = reinterpret_cast<std::uint64_t>(r);
    last_reserve.store(base, std::memory_order_relaxed);
    *reserve_base = base;
    *reserve_len = total;
    return base + before;
}

void *twin(std::uint64_t va, std::uint64_t nbytes) {
    const auto p = static_cast<std::uint64_t>(sysconf(_SC_PAGESIZE));
    if (va == 0 || nbytes == 0 || (va & (p - 1)) != 0) return nullptr;
    std::uint64_t base = 0, len = 0;
    const std::uint64_t at = reserve_guarded(nbytes, &base, &len);
    if (at == 0) return nullptr;
    // old_size 0 on a shared mapping: a new mapping of the same pages, here into the reservation.
    void *m = mremap(reinterpret_cast<void *>(va), 0, round_up(nbytes), MREMAP_MAYMOVE | MREMAP_FIXED,
                     reinterpret_cast<void *>(at));
    if (m == MAP_FAILED) {
        munmap(reinterpret_cast<void *>(base), len);
        return nullptr;
    }
    std::lock_guard<std::mutex> lock(mu);
    twins[m] = Twin{round_up(nbytes), base, len};
    return m;
}

void unmap(void *ptr) noexcept {
    std::uint64_t start = reinterpret_cast<std::uint64_t>(ptr), len = 0;
    {
        std::lock_guard<std::mutex> lock(mu);
        auto it = lengths.find(ptr);
        if (it != lengths.end()) {
            len = it->second;
            lengths.erase(it);
        } else {
            auto t = twins.find(ptr);
            if (t == twins.end()) return;
            start = t->second.reserve_base;
            len = t->second.reserve_len;
            twins.erase(t);
        }
    }
    munmap(reinterpret_cast<void *>(start), len);
}

}  // namespace pointerdomain::strict
