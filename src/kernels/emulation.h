// Emulated distinct-alias backend for machines without a GPU.
//
// Registered host memory gets a second virtual mapping of the same physical
// pages (memfd + two mmaps), so its "device alias" differs from its host VA
// as it does on MI355X or WSL2, and bytes written through one are read through
// the other. Emulated device memory is anonymous memory tagged with an ordinal.
#pragma once
#include <cstdint>

namespace pointerdomain::emu {

enum Status : int {
    kOk = 0,
    kInvalidValue = 1,            // zero length, null pointer
    kMapFailed = 2,               // out of memory or address space (mmap / memfd failed)
    kSharedPage = 3,              // pages shared with memory registered separately
    kAlreadyRegistered = 712,     // same code as cudaErrorHostMemoryAlreadyRegistered
    kNotRegistered = 713,         // same code as cudaErrorHostMemoryNotRegistered
};

// Page-aligned host memory backed by a memfd so that it can be aliased later.
// Returns nullptr on failure. Freed with host_free.
void *host_alloc(std::uint64_t nbytes);
void host_free(void *ptr);

// Map [va, va+nbytes) a second time; writes the alias to *alias.
int register_range(std::uint64_t va, std::uint64_t nbytes, std::uint64_t *alias);
int unregister_range(std::uint64_t va);
// Put [va, va+nbytes) behind one memfd before it is registered in several chunks, so
// chunks that share a page (a range starting mid-page) map the same file. kOk if done.
int prepare_range(std::uint64_t va, std::uint64_t nbytes);
// Alias of an address inside a registered range (interior pointers keep their offset).
int get_device_pointer(std::uint64_t va, std::uint64_t *alias);
// Alias of `va` as emulated device `ordinal` sees it. Every device has its own
// mapping of a registration's pages (ordinal 0: the one register_range made; the
// others made on first use, dropped by unregister_range), so one registration has
// a different alias on each device and an alias of one device is not mapped for
// another, as a portable registration on several GPUs need not share aliases.
int get_device_pointer_on(std::uint64_t va, int ordinal, std::uint64_t *alias);
// Ordinal of the device whose alias mapping holds [addr, addr+nbytes), or -1.
int alias_lookup(std::uint64_t addr, std::uint64_t nbytes);

// Emulated device memory: anonymous pages tagged with a device ordinal.
void *device_alloc(std::uint64_t nbytes, int ordinal);
void device_free(void *ptr);
// Ordinal of the device allocation holding [addr, addr+nbytes), or -1.
int device_lookup(std::uint64_t addr, std::uint64_t nbytes);
// Device allocations released since the process started (only grows).
std::uint64_t device_frees();

}  // namespace pointerdomain::emu
