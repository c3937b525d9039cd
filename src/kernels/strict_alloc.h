// Strict alias mode: host memory mapped twice, so that the address CPU code
// uses (one mapping, never registered) and the address the device uses (the alias of
// the other, registered mapping) differ on every platform, and a host VA that reaches
// a kernel faults instead of working by accident (CanUseHostPointerForRegisteredMem = 1).
#pragma once
#include <cstdint>

namespace pointerdomain::strict {

// nbytes (rounded up to whole pages) of memfd-backed MAP_SHARED memory, populated;
// nullptr on failure (errno kept). The memfd is closed: the mapping keeps the pages.
void *shared_alloc(std::uint64_t nbytes);
// A second mapping of the same pages as the shared mapping at page-aligned `va`
// (mremap with old_size 0); nullptr on failure (not page aligned, not a shared mapping).
void *mirror(std::uint64_t va, std::uint64_t nbytes);
// munmap of a mapping from either call (its length was recorded); others are ignored.
void unmap(void *ptr) noexcept;

}  // namespace pointerdomain::strict
