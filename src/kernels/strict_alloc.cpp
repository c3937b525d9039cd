#include "strict_alloc.h"

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

#include <map>
#include <mutex>

namespace pointerdomain::strict {
namespace {
std::mutex mu;
std::map<void *, std::uint64_t> lengths;  // mapping -> length, for unmap from a deleter

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
void after_fork_child() {
    for (auto &kv : lengths) {
        void *copy = mmap(nullptr, kv.second, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (copy == MAP_FAILED) continue;
        std::memcpy(copy, kv.first, kv.second);
        if (mremap(copy, kv.second, kv.second, MREMAP_MAYMOVE | MREMAP_FIXED, kv.first) == MAP_FAILED)
            munmap(copy, kv.second);
    }
    mu.unlock();
}
const int fork_handlers = pthread_atfork(before_fork, after_fork_parent, after_fork_child);

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

void unmap(void *ptr) noexcept {
    std::uint64_t len = 0;
    {
        std::lock_guard<std::mutex> lock(mu);
        auto it = lengths.find(ptr);
        if (it == lengths.end()) return;
        len = it->second;
        lengths.erase(it);
    }
    munmap(ptr, len);
}

}  // namespace pointerdomain::strict
