#include "strict_alloc.h"

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <sys/mman.h>
#include <unistd.h>

#include <map>
#include <mutex>
#include <random>
#include <utility>

namespace pointerdomain::strict {
namespace {
std::mutex mu;
std::map<void *, std::uint64_t> lengths;  // mapping -> length, for unmap from a deleter
std::map<void *, std::pair<std::uint64_t, std::uint64_t>> reserved;  // twin -> its reservation
std::uint64_t last_reserve = 0;  // lowest reservation so far (under mu)
constexpr std::uint64_t kMaxGapPages = 256;

void *keep(void *m, std::uint64_t len) {
    if (m == MAP_FAILED) return nullptr;
    std::lock_guard<std::mutex> lock(mu);
    lengths[m] = len;
    return m;
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
    std::lock_guard<std::mutex> lock(mu);
    static std::mt19937_64 rng{std::random_device{}()};
    const std::uint64_t before = (1 + rng() % kMaxGapPages) * p, after = (1 + rng() % kMaxGapPages) * p;
    const std::uint64_t total = before + round_up(len) + after;
    void *r = MAP_FAILED;
    const std::uint64_t want = last_reserve - total;
    if (last_reserve > total + (std::uint64_t{1} << 32)) {
        r = mmap(reinterpret_cast<void *>(want), total, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
        if (r != MAP_FAILED && reinterpret_cast<std::uint64_t>(r) != want) {
            munmap(r, total);  // a kernel without MAP_FIXED_NOREPLACE took the address as a hint only
            r = MAP_FAILED;
        }
    }
    if (r == MAP_FAILED) r = mmap(nullptr, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (r == MAP_FAILED) return 0;
    last_reserve = reinterpret_cast<std::uint64_t>(r);
    *reserve_base = last_reserve;
    *reserve_len = total;
    return last_reserve + before;
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
    reserved[m] = {base, len};
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
            auto r = reserved.find(ptr);
            if (r == reserved.end()) return;
            start = r->second.first;
            len = r->second.second;
            reserved.erase(r);
        }
    }
    munmap(reinterpret_cast<void *>(start), len);
}

}  // namespace pointerdomain::strict
