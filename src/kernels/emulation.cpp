#include "emulation.h"

#include "strict_alloc.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <atomic>
#include <iterator>
#include <map>
#include <mutex>

namespace pointerdomain::emu {
namespace {

struct Region {       // memory that a memfd backs, so it can be mapped again
    std::uint64_t len;
    int fd;
    bool owned;       // from host_alloc (unmapped by host_free)
};
struct Guarded {                // an alias mapping inside a reservation of inaccessible pages
    std::uint64_t base;         // the mapping (map_len bytes)
    std::uint64_t reserve_base; // the reservation around it, PROT_NONE outside the mapping
    std::uint64_t reserve_len;
};
struct Registration {
    std::uint64_t len;
    std::uint64_t alias;      // alias of va
    std::uint64_t map_base;   // start of the alias mapping (page aligned)
    std::uint64_t map_len;
    std::uint64_t region;     // key of the Region it came from
    Guarded own;              // device 0's mapping (own.base == map_base)
    std::map<int, Guarded> other_devices;  // ordinal > 0 -> its mapping (map_len bytes)
};
struct DeviceAlloc {
    std::uint64_t len;
    int ordinal;
};

std::mutex mu;
std::map<std::uint64_t, Region> regions;
std::map<std::uint64_t, Registration> registrations;
std::map<std::uint64_t, DeviceAlloc> device_allocs;
// Device allocations released so far: a cache of resolved addresses re-checks them only when
// this moved (an address can name other memory only after a free).
std::atomic<std::uint64_t> device_free_count{0};

std::uint64_t page() { return static_cast<std::uint64_t>(sysconf(_SC_PAGESIZE)); }

// [addr, addr + len) inside [base, base + size), without forming addr + len (which wraps
// near 2^64 and would put an address at the top of the space inside every range).
bool inside(std::uint64_t addr, std::uint64_t len, std::uint64_t base, std::uint64_t size) {
    return addr >= base && addr - base <= size && len <= size - (addr - base);
}

template <class M>
typename M::iterator containing(M &m, std::uint64_t addr, std::uint64_t len) {
    auto it = m.upper_bound(addr);
    if (it == m.begin()) return m.end();
    --it;
    if (inside(addr, len, it->first, it->second.len)) return it;
    return m.end();
}

bool overlaps_registration(std::uint64_t va, std::uint64_t len) {
    auto it = registrations.lower_bound(va);  // it->first >= va
    if (it != registrations.end() && it->first - va < len) return true;
    if (it != registrations.begin()) {
        --it;
        if (it->first + it->second.len > va) return true;
    }
    return false;
}

// Whether [base, base + len) is still the region's own mapping of its memfd (offset 0 at
// base). A caller's tensor can release its storage while registered (resize_, set_):
// glibc then unmaps those pages and may hand the range to another mapping. Reading,
// remapping or copying "our" pages then faults or overwrites someone else's memory, so
// every path that touches a region made in place asks /proc/self/maps first. Plain
// syscalls and a stack buffer only: the child of a fork calls it too.
bool still_mapped(std::uint64_t base, std::uint64_t len, int fd) {
    struct stat st{};
    if (fstat(fd, &st) != 0) return false;
    const int maps = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
    if (maps < 0) return false;
    std::uint64_t covered = base;  // [base, covered) proven so far
    bool bad = false;
    char buf[8192];
    std::size_t have = 0;
    for (;;) {
        const ssize_t n = read(maps, buf + have, sizeof(buf) - 1 - have);
        if (n < 0) { bad = true; break; }
        have += static_cast<std::size_t>(n);
        buf[have] = '\0';
        char *line = buf;
        for (char *nl; (nl = std::strchr(line, '\n')) != nullptr; line = nl + 1) {
            *nl = '\0';
            unsigned long long lo = 0, hi = 0, off = 0, ino = 0;
            unsigned dmaj = 0, dmin = 0;
            char perms[8] = {0};
            if (std::sscanf(line, "%llx-%llx %7s %llx %x:%x %llu", &lo, &hi, perms, &off, &dmaj, &dmin,
                            &ino) != 7)
                continue;
            if (hi <= covered || lo >= base + len) continue;  // outside what is left to prove
            if (lo > covered || ino != static_cast<unsigned long long>(st.st_ino) ||
                off != lo - base) {
                bad = true;
                break;
            }
            covered = hi;
        }
        if (bad || n == 0 || covered >= base + len) break;
        have = std::strlen(line);  // an unfinished line moves to the front
        std::memmove(buf, line, have);
        if (have >= sizeof(buf) - 1) { bad = true; break; }  // a line longer than the buffer
    }
    close(maps);
    return !bad && covered >= base + len;
}

int make_fd(std::uint64_t len) {
    int fd = memfd_create("pointerdomain-emulated", MFD_CLOEXEC);
    if (fd < 0) return -1;
    if (ftruncate(fd, static_cast<off_t>(len)) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

// Put existing anonymous pages behind a memfd, in place, keeping their bytes.
// On failure *why is kSharedPage (pages another region backs) or kMapFailed.
std::map<std::uint64_t, Region>::iterator make_shareable(std::uint64_t va, std::uint64_t len, int *why) {
    const std::uint64_t p = page(), lo = va & ~(p - 1), hi = (va + len + p - 1) & ~(p - 1);
    // Remapping pages that another region already backs would split the alias
    // of its registrations from their host VA.
    *why = kSharedPage;
    auto next = regions.lower_bound(lo);
    if (next != regions.end() && next->first < hi) return regions.end();
    if (next != regions.begin() && std::prev(next)->first + std::prev(next)->second.len > lo)
        return regions.end();
    *why = kMapFailed;
    const int fd = make_fd(hi - lo);
    if (fd < 0) return regions.end();
    if (pwrite(fd, reinterpret_cast<void *>(lo), hi - lo, 0) != static_cast<ssize_t>(hi - lo)) {
        close(fd);
        return regions.end();
    }
    void *m = mmap(reinterpret_cast<void *>(lo), hi - lo, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_FIXED, fd, 0);
    if (m == MAP_FAILED) {
        close(fd);
        return regions.end();
    }
    return regions.emplace(lo, Region{hi - lo, fd, false}).first;
}

// Aliases of separately registered ranges are not one range (MI355X gives adjacent host
// ranges aliases far apart, in the other order): each alias mapping sits at a random page
// gap inside a reservation of inaccessible pages, below the previous one
// (strict::reserve_guarded), so alias arithmetic that walks from one registration's alias
// into the next one's host range touches a guard page (SIGSEGV) or an unrelated alias,
// never the next registration.
bool map_guarded(int fd, std::uint64_t off, std::uint64_t len, Guarded *out) {
    std::uint64_t reserve = 0, total = 0;
    const std::uint64_t at = strict::reserve_guarded(len, &reserve, &total);
    if (at == 0) return false;
    void *m = mmap(reinterpret_cast<void *>(at), len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd,
                   static_cast<off_t>(off));
    if (m == MAP_FAILED) {
        munmap(reinterpret_cast<void *>(reserve), total);
        return false;
    }
    *out = Guarded{at, reserve, total};
    return true;
}

void unmap_guarded(const Guarded &g) { munmap(reinterpret_cast<void *>(g.reserve_base), g.reserve_len); }

}  // namespace

void *host_alloc(std::uint64_t nbytes) {
    if (nbytes == 0) return nullptr;
    const std::uint64_t p = page(), len = (nbytes + p - 1) & ~(p - 1);
    const int fd = make_fd(len);
    if (fd < 0) return nullptr;
    // Populate now, as cudaHostRegister faults pages in when it pins them.
    void *m = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (m == MAP_FAILED) {
        close(fd);
        return nullptr;
    }
    std::lock_guard<std::mutex> lock(mu);
    regions.emplace(reinterpret_cast<std::uint64_t>(m), Region{len, fd, true});
    return m;
}

void host_free(void *ptr) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = regions.find(reinterpret_cast<std::uint64_t>(ptr));
    if (it == regions.end()) return;
    munmap(ptr, it->second.len);
    close(it->second.fd);
    regions.erase(it);
}

int register_range(std::uint64_t va, std::uint64_t nbytes, std::uint64_t *alias) {
    if (va == 0 || nbytes == 0 || va > UINT64_MAX - page() || nbytes > UINT64_MAX - page() - va)
        return kInvalidValue;  // the range's pages must fit below 2^64
    std::lock_guard<std::mutex> lock(mu);
    if (overlaps_registration(va, nbytes)) return kAlreadyRegistered;
    auto reg = containing(regions, va, nbytes);
    // The caller's pages of that region were released and the range reused: an alias of
    // the old file would not see the new memory's bytes.
    if (reg != regions.end() && !reg->second.owned && !still_mapped(reg->first, reg->second.len, reg->second.fd))
        return kSharedPage;
    int why = kMapFailed;
    if (reg == regions.end()) reg = make_shareable(va, nbytes, &why);
    if (reg == regions.end()) return why;
    const std::uint64_t p = page(), lo = va & ~(p - 1), hi = (va + nbytes + p - 1) & ~(p - 1);
    Guarded g{};
    if (!map_guarded(reg->second.fd, lo - reg->first, hi - lo, &g)) return kMapFailed;
    *alias = g.base + (va - lo);
    registrations.emplace(va, Registration{nbytes, *alias, g.base, hi - lo, reg->first, g, {}});
    return kOk;
}

int prepare_range(std::uint64_t va, std::uint64_t nbytes) {
    if (va == 0 || nbytes == 0) return kInvalidValue;
    std::lock_guard<std::mutex> lock(mu);
    auto found = containing(regions, va, nbytes);
    if (found != regions.end())
        return found->second.owned || still_mapped(found->first, found->second.len, found->second.fd) ? kOk
                                                                                                    : kSharedPage;
    int why = kMapFailed;
    return make_shareable(va, nbytes, &why) == regions.end() ? why : kOk;
}

namespace {
// Back a region made in place (the caller's pages, which may share a page with its malloc
// heap) by a new memfd holding a copy of its bytes, mapped at the same addresses: the
// caller's mapping and every alias of the region's registrations. The child of a fork
// calls it (single-threaded then), so its pages are its own at once and stay coherent
// with their aliases: neither process's later writes reach the other.
bool copy_into_own_file(std::uint64_t base, Region &r) {
    const int fd = make_fd(r.len);
    if (fd < 0) return false;
    if (pwrite(fd, reinterpret_cast<void *>(base), r.len, 0) != static_cast<ssize_t>(r.len)) {
        close(fd);
        return false;
    }
    mmap(reinterpret_cast<void *>(base), r.len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
    for (auto &kv : registrations) {
        if (kv.second.region != base) continue;
        const off_t off = static_cast<off_t>((kv.first & ~(page() - 1)) - base);
        mmap(reinterpret_cast<void *>(kv.second.map_base), kv.second.map_len, PROT_READ | PROT_WRITE,
             MAP_SHARED | MAP_FIXED, fd, off);
        for (auto &dev : kv.second.other_devices)
            mmap(reinterpret_cast<void *>(dev.second.base), kv.second.map_len, PROT_READ | PROT_WRITE,
                 MAP_SHARED | MAP_FIXED, fd, off);
    }
    close(r.fd);
    r.fd = fd;
    return true;
}

// fork(): CUDA pinned memory of a malloc'd range is private to each process after
// fork (Linux >= 5.9 copies pinned pages into the child early), so a child's writes
// never reach the parent. Our memfd mappings are MAP_SHARED. In the child: the caller's
// pages (regions made in place) are copied into a file of the child's own at once, as
// CUDA copies pinned pages; memory this library allocated (owned regions, whole pages of
// their own) maps the same file pages MAP_PRIVATE at the same addresses (copy on write,
// no copy now).
void before_fork() { mu.lock(); }
void after_fork_parent() { mu.unlock(); }
void after_fork_child() {
    for (auto &kv : regions) {
        // A caller's range released under its registration belongs to other memory now:
        // mapping the file there would overwrite it (the aliases stay the parent's pages).
        if (!kv.second.owned && !still_mapped(kv.first, kv.second.len, kv.second.fd)) continue;
        if (!kv.second.owned && copy_into_own_file(kv.first, kv.second)) continue;
        mmap(reinterpret_cast<void *>(kv.first), kv.second.len, PROT_READ | PROT_WRITE,
             MAP_PRIVATE | MAP_FIXED, kv.second.fd, 0);
        for (auto &reg : registrations) {
            if (reg.second.region != kv.first) continue;
            const off_t off = static_cast<off_t>((reg.first & ~(page() - 1)) - kv.first);
            mmap(reinterpret_cast<void *>(reg.second.map_base), reg.second.map_len, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_FIXED, kv.second.fd, off);
            for (auto &dev : reg.second.other_devices)  // other emulated devices' aliases
                mmap(reinterpret_cast<void *>(dev.second.base), reg.second.map_len, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_FIXED, kv.second.fd, off);
        }
    }
    mu.unlock();
}
const int fork_handlers = pthread_atfork(before_fork, after_fork_parent, after_fork_child);

// The caller's pages of a region made in place, once no registration uses it: private
// anonymous memory again, with their bytes (a copy moved over them in one mremap), so
// a later fork gives the child its own copy (a shared file mapping would carry the
// child's writes, malloc heap included, into the parent). Writes to these pages by
// another thread while this runs may be lost: close() must not race with them (the
// Python binding holds the GIL). If the copy cannot be made the pages stay a shared
// mapping of the file (bytes kept).
void restore_private(std::uint64_t base, const Region &r) {
    if (!still_mapped(base, r.len, r.fd)) return;  // released under its registration: not ours now
    void *copy = mmap(nullptr, r.len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (copy == MAP_FAILED) return;
    std::memcpy(copy, reinterpret_cast<const void *>(base), r.len);
    if (mremap(copy, r.len, r.len, MREMAP_MAYMOVE | MREMAP_FIXED, reinterpret_cast<void *>(base)) == MAP_FAILED)
        munmap(copy, r.len);
}
}  // namespace

int unregister_range(std::uint64_t va) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = registrations.find(va);
    if (it == registrations.end()) return kNotRegistered;
    unmap_guarded(it->second.own);
    for (auto &kv : it->second.other_devices) unmap_guarded(kv.second);
    const std::uint64_t region = it->second.region;
    registrations.erase(it);
    // A region made in place for an existing tensor lives while registrations use it;
    // its pages stay mapped (the tensor still owns them), private again, and the fd goes.
    auto r = regions.find(region);
    if (r != regions.end() && !r->second.owned) {
        bool used = false;
        for (auto &kv : registrations) used = used || kv.second.region == region;
        if (!used) {
            restore_private(r->first, r->second);
            close(r->second.fd);
            regions.erase(r);
        }
    }
    return kOk;
}

int get_device_pointer(std::uint64_t va, std::uint64_t *alias) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = containing(registrations, va, 1);
    if (it == registrations.end()) return kNotRegistered;
    *alias = it->second.alias + (va - it->first);
    return kOk;
}

int get_device_pointer_on(std::uint64_t va, int ordinal, std::uint64_t *alias) {
    if (ordinal < 0) return kInvalidValue;
    std::lock_guard<std::mutex> lock(mu);
    auto it = containing(registrations, va, 1);
    if (it == registrations.end()) return kNotRegistered;
    Registration &r = it->second;
    std::uint64_t base = r.map_base;
    if (ordinal > 0) {
        auto dev = r.other_devices.find(ordinal);
        if (dev == r.other_devices.end()) {
            auto reg = regions.find(r.region);
            if (reg == regions.end()) return kNotRegistered;
            const std::uint64_t lo = it->first & ~(page() - 1);
            Guarded g{};
            if (!map_guarded(reg->second.fd, lo - reg->first, r.map_len, &g)) return kMapFailed;
            dev = r.other_devices.emplace(ordinal, g).first;
        }
        base = dev->second.base;
    }
    *alias = base + (r.alias - r.map_base) + (va - it->first);
    return kOk;
}

int alias_lookup(std::uint64_t addr, std::uint64_t nbytes) {
    std::lock_guard<std::mutex> lock(mu);
    for (auto &kv : registrations) {
        const Registration &r = kv.second;
        if (inside(addr, nbytes, r.map_base, r.map_len)) return 0;
        for (auto &dev : r.other_devices)
            if (inside(addr, nbytes, dev.second.base, r.map_len)) return dev.first;
    }
    return -1;
}

void *device_alloc(std::uint64_t nbytes, int ordinal) {
    if (nbytes == 0) return nullptr;
    void *m = mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return nullptr;
    std::lock_guard<std::mutex> lock(mu);
    device_allocs.emplace(reinterpret_cast<std::uint64_t>(m), DeviceAlloc{nbytes, ordinal});
    return m;
}

void device_free(void *ptr) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = device_allocs.find(reinterpret_cast<std::uint64_t>(ptr));
    if (it == device_allocs.end()) return;
    munmap(ptr, it->second.len);
    device_allocs.erase(it);
    device_free_count.fetch_add(1, std::memory_order_relaxed);
}

std::uint64_t device_frees() { return device_free_count.load(std::memory_order_relaxed); }

int device_lookup(std::uint64_t addr, std::uint64_t nbytes) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = containing(device_allocs, addr, nbytes);
    return it == device_allocs.end() ? -1 : it->second.ordinal;
}

}  // namespace pointerdomain::emu
