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
// A further mapping of the pages of [va, va + nbytes) of a shared mapping (page-aligned
// va), placed as reserve_guarded places it: strict alias mode's registered mapping of one
// chunk, so separately registered chunks never have adjacent addresses (nor aliases,
// where the alias is the registered address). nullptr on failure.
void *twin(std::uint64_t va, std::uint64_t nbytes);
// munmap of a mapping from these calls (its length, or its reservation, was recorded);
// others are ignored.
void unmap(void *ptr) noexcept;

// Address space for a mapping of `len` bytes that no other mapping adjoins: a reservation
// of inaccessible pages (PROT_NONE) with a random gap of 1 to 256 pages before and after
// the mapping's place, below the previous reservation where that space is free (so
// successive ones run downwards, as MI355X hands out aliases of adjacent host ranges).
// Returns the mapping's address (map over it with MAP_FIXED / MREMAP_FIXED) and the
// reservation, to munmap whole; 0 on failure.
std::uint64_t reserve_guarded(std::uint64_t len, std::uint64_t *reserve_base, std::uint64_t *reserve_len);

}  // namespace pointerdomain::strict
