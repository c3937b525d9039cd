// pointerdomain C++ types for third-party kernels and extensions (header only).
//
// Registered host memory has two addresses: the CPU virtual address (HostVA) and
// the device alias a kernel must use (DeviceAlias, cudaHostGetDevicePointer). They
// are equal only where cudaDevAttrCanUseHostPointerForRegisteredMem is 1; on
// MI355X, WSL2 and some host kernels they differ, and a kernel given a HostVA
// faults (error 700). These types make the mix-up a compile error:
//
//   * HostVA and DeviceAlias are distinct, 8-byte, trivially copyable types built
//     only explicitly from a std::uint64_t (no implicit conversion either way, no
//     conversion to an integer or a pointer except through value() / as<T>());
//   * an offset keeps the type (a + n, a - n, a.offset(n)); a - b within one domain is
//     a std::ptrdiff_t; there is no a + b and no arithmetic or comparison across domains;
//   * KernelTable is a view of a pointerdomain.PointerTable[DeviceAlias]: its device,
//     its length and its entries (const DeviceAlias*, in memory of that device). It is
//     made only by the nanobind caster in <pointerdomain/nanobind.h>, which checks the
//     Python table first.
//
// Usable from host code and from CUDA/HIP device code (the methods are
// __host__ __device__ under nvcc/hipcc). Python side: pointerdomain.get_include().
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define POINTERDOMAIN_HD __host__ __device__
#else
#define POINTERDOMAIN_HD
#endif

namespace pointerdomain {

//! Device kinds, as pointerdomain.Device.type ("cuda" also covers ROCm builds of torch).
enum class DeviceType : std::int32_t { cuda = 1, emulated = 2 };

//! A device: the type and ordinal of a pointerdomain.Device.
struct Device {
    DeviceType type;
    std::int32_t ordinal;

    POINTERDOMAIN_HD friend constexpr bool operator==(Device a, Device b) {
        return a.type == b.type && a.ordinal == b.ordinal;
    }
    POINTERDOMAIN_HD friend constexpr bool operator!=(Device a, Device b) { return !(a == b); }
};

namespace domain {
struct host_va {};
struct device_alias {};
}  // namespace domain

//! An address of one domain. Use the aliases HostVA and DeviceAlias, never this template.
template <class Domain>
class Address {
public:
    //! Explicit only: `HostVA a = 5;` and `HostVA a = some_alias;` do not compile.
    POINTERDOMAIN_HD constexpr explicit Address(std::uint64_t value) noexcept : value_(value) {}
    //! No construction from other integer types or pointers (no silent narrowing or
    //! pointer-to-address leaks): pass a std::uint64_t.
    template <class T, class = std::enable_if_t<!std::is_same_v<T, std::uint64_t>>>
    explicit Address(T) = delete;

    //! The raw address, for an API that takes integers (a conscious boundary crossing).
    POINTERDOMAIN_HD constexpr std::uint64_t value() const noexcept { return value_; }
    //! The address as a typed pointer (HostVA: for CPU code; DeviceAlias: for kernels).
    template <class T>
    POINTERDOMAIN_HD T *as() const noexcept { return reinterpret_cast<T *>(static_cast<std::uintptr_t>(value_)); }

    //! The address nbytes further on, same domain. Stay inside one registration:
    //! separately registered ranges are not contiguous in alias space.
    POINTERDOMAIN_HD constexpr Address offset(std::ptrdiff_t nbytes) const noexcept {
        return Address(value_ + static_cast<std::uint64_t>(nbytes));
    }
    POINTERDOMAIN_HD friend constexpr Address operator+(Address a, std::ptrdiff_t n) noexcept { return a.offset(n); }
    POINTERDOMAIN_HD friend constexpr Address operator-(Address a, std::ptrdiff_t n) noexcept { return a.offset(-n); }
    //! Distance in bytes inside one domain.
    POINTERDOMAIN_HD friend constexpr std::ptrdiff_t operator-(Address a, Address b) noexcept {
        return static_cast<std::ptrdiff_t>(a.value_ - b.value_);
    }
    POINTERDOMAIN_HD friend constexpr bool operator==(Address a, Address b) noexcept { return a.value_ == b.value_; }
    POINTERDOMAIN_HD friend constexpr bool operator!=(Address a, Address b) noexcept { return a.value_ != b.value_; }
    POINTERDOMAIN_HD friend constexpr bool operator<(Address a, Address b) noexcept { return a.value_ < b.value_; }
    POINTERDOMAIN_HD friend constexpr bool operator<=(Address a, Address b) noexcept { return a.value_ <= b.value_; }
    POINTERDOMAIN_HD friend constexpr bool operator>(Address a, Address b) noexcept { return a.value_ > b.value_; }
    POINTERDOMAIN_HD friend constexpr bool operator>=(Address a, Address b) noexcept { return a.value_ >= b.value_; }

    //! Addresses do not add, and an address is not a byte count.
    Address &operator+=(Address) = delete;
    template <class Other>
    friend void operator+(Address, Address<Other>) = delete;

private:
    std::uint64_t value_;
};

//! A CPU virtual address: memcpy, storage back-ends, transfer engines, cudaHostUnregister.
using HostVA = Address<domain::host_va>;
//! An address a kernel on one device may use (device alias of registered host memory, or
//! device memory). The device is the KernelTable's: an 8-byte entry does not carry it.
using DeviceAlias = Address<domain::device_alias>;

static_assert(sizeof(HostVA) == 8 && sizeof(DeviceAlias) == 8, "table entries are 8-byte addresses");
static_assert(std::is_trivially_copyable_v<DeviceAlias> && std::is_standard_layout_v<DeviceAlias>,
              "a DeviceAlias array is the table's uint64 array");
static_assert(!std::is_convertible_v<HostVA, DeviceAlias> && !std::is_convertible_v<DeviceAlias, HostVA>,
              "the domains do not convert");
static_assert(!std::is_constructible_v<DeviceAlias, HostVA> && !std::is_constructible_v<HostVA, DeviceAlias>,
              "not even explicitly");
static_assert(!std::is_convertible_v<std::uint64_t, HostVA>, "an integer becomes an address only explicitly");
// Addresses keep all 64 bits (Intel XPU USM hands out addresses >= 2^63): unsigned
// storage, comparison and arithmetic, never a signed type on the way.
static_assert(DeviceAlias(std::uint64_t{1} << 63).value() == 0x8000000000000000ull, "bit 63 is kept");
static_assert(DeviceAlias(std::uint64_t{1} << 63) > DeviceAlias(std::uint64_t{0x7FFFFFFFFFFFFFFFull}),
              "addresses compare unsigned");
static_assert(DeviceAlias(std::uint64_t{0xFFFFFFFFFFFFF000ull}) + 0xFFF ==
                  DeviceAlias(std::uint64_t{0xFFFFFFFFFFFFFFFFull}), "offsets reach the top of the space");
static_assert(DeviceAlias(std::uint64_t{1} << 63) - DeviceAlias(std::uint64_t{0x7FFFFFFFFFFFF000ull}) == 0x1000,
              "distances across 2^63");

namespace detail {
struct KernelTableAccess;
}

//! A view of a pointerdomain.PointerTable[DeviceAlias] for one call.
//!
//! * device(): the device whose kernels may read the entries;
//! * size(): number of entries;
//! * entries(): the table's own uint64 array as const DeviceAlias*, in memory of
//!   device() (CUDA device memory: read it in a kernel; on the emulated device it is
//!   CPU-readable);
//! * host_sizes(): bytes of the buffer behind each entry, a host array (never pass it
//!   to a kernel).
//!
//! Valid while the Python table lives: the caster holds a reference for the duration
//! of the call. Work that outlives the call (an asynchronous launch) must be ordered
//! before the caller drops the table (the same rule as for the library's own launches).
class KernelTable {
public:
    POINTERDOMAIN_HD constexpr Device device() const noexcept { return device_; }
    POINTERDOMAIN_HD constexpr std::size_t size() const noexcept { return size_; }
    POINTERDOMAIN_HD const DeviceAlias *entries() const noexcept {
        return reinterpret_cast<const DeviceAlias *>(static_cast<std::uintptr_t>(entries_));
    }
    const std::uint64_t *host_sizes() const noexcept { return sizes_; }

    //! An empty view (no entries). Non-empty views are made only by the caster.
    KernelTable() = default;

private:
    friend struct detail::KernelTableAccess;
    Device device_{DeviceType::emulated, 0};
    std::size_t size_ = 0;
    std::uint64_t entries_ = 0;  // raw on purpose: reachable only as const DeviceAlias*
    const std::uint64_t *sizes_ = nullptr;
};

static_assert(std::is_trivially_copyable_v<KernelTable>, "passed to kernels by value");

}  // namespace pointerdomain
