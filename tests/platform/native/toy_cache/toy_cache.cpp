// A toy cache's own CPU "kernels" that take pointerdomain kernel tables through the
// nanobind caster (the emulated device's aliases are CPU-readable, a second mapping of
// the same pages). On CUDA the same signatures would launch a kernel with
// table.entries() (device memory) instead of reading it here.
#include <nanobind/stl/vector.h>
#include <pointerdomain/nanobind.h>

#include <cstring>
#include <string>
#include <vector>

namespace nb = nanobind;
namespace pd = pointerdomain;
using namespace nb::literals;

namespace {

void require_cpu_readable(const pd::KernelTable &t) {
    if (t.device().type != pd::DeviceType::emulated)
        pd::nanobind::raise_error("InvalidDeviceError", "toy_cache runs on emulated devices only (its kernels are CPU loops)");
}

void check_range(const pd::KernelTable &t, std::size_t entry, std::uint64_t offset, std::uint64_t nbytes,
                 const char *what) {
    if (offset + nbytes > t.host_sizes()[entry] || offset + nbytes < offset)
        pd::nanobind::raise_error("IndexValidationError",
                                  std::string(what) + ": bytes [" + std::to_string(offset) + ", +" +
                                      std::to_string(nbytes) + ") outside entry " + std::to_string(entry) + " (" +
                                      std::to_string(t.host_sizes()[entry]) + " bytes)");
}

// Sum of the first nbytes bytes behind each entry, read through the device aliases.
std::vector<std::uint64_t> checksum(pd::KernelTable table, pd::Device device, std::uint64_t nbytes) {
    require_cpu_readable(table);
    std::vector<std::uint64_t> out;
    for (std::size_t e = 0; e < table.size(); ++e) {
        check_range(table, e, 0, nbytes, "checksum");
        const pd::DeviceAlias base = table.entries()[e];
        const unsigned char *p = base.as<const unsigned char>();
        std::uint64_t sum = 0;
        for (std::uint64_t i = 0; i < nbytes; ++i)
            sum += p[i];
        out.push_back(sum);
    }
    return out;
}

// For every entry e: copy item src_items[k] of src[e] to item dst_items[k] of dst[e].
void copy_items(pd::KernelTable src, pd::KernelTable dst, pd::Device device, std::uint64_t item_bytes,
                std::vector<std::uint64_t> src_items, std::vector<std::uint64_t> dst_items) {
    require_cpu_readable(src);
    if (src.size() != dst.size() || src_items.size() != dst_items.size())
        pd::nanobind::raise_error("LayoutError", "copy_items: tables or item lists differ in length");
    for (std::size_t e = 0; e < src.size(); ++e)
        for (std::size_t k = 0; k < src_items.size(); ++k) {
            check_range(src, e, src_items[k] * item_bytes, item_bytes, "copy_items src");
            check_range(dst, e, dst_items[k] * item_bytes, item_bytes, "copy_items dst");
        }
    // Runs without the GIL (call_guard below): the casters and checks above needed none,
    // and raise_error takes it back itself.
    for (std::size_t e = 0; e < src.size(); ++e) {
        const pd::DeviceAlias s = src.entries()[e];
        const pd::DeviceAlias d = dst.entries()[e];
        for (std::size_t k = 0; k < src_items.size(); ++k) {
            const pd::DeviceAlias from = s + static_cast<std::ptrdiff_t>(src_items[k] * item_bytes);
            const pd::DeviceAlias to = d.offset(static_cast<std::ptrdiff_t>(dst_items[k] * item_bytes));
            std::memcpy(to.as<void>(), from.as<const void>(), item_bytes);
        }
    }
}

// A function whose body checks the device itself (no same_device wrapper).
std::size_t entries_on(pd::KernelTable table, pd::Device device) {
    pd::nanobind::require_device(table, device);
    return table.size();
}

// The entries as integers, each with the entry one byte on (DeviceAlias arithmetic):
// [e0, e0 + 1, e1, e1 + 1, ...]; no memory is read.
std::vector<std::uint64_t> alias_values(pd::KernelTable table, pd::Device device) {
    require_cpu_readable(table);
    std::vector<std::uint64_t> out;
    for (std::size_t e = 0; e < table.size(); ++e) {
        out.push_back(table.entries()[e].value());
        out.push_back((table.entries()[e] + 1).value());
    }
    return out;
}

}  // namespace

NB_MODULE(toy_cache, m) {
    m.doc() = "A toy cache's own kernels taking pointerdomain kernel tables (test extension).";
    m.def("checksum", pd::nanobind::same_device(&checksum), "table"_a, "device"_a, "nbytes"_a,
          "Byte sum of the first nbytes bytes of each entry, read through the device aliases.");
    m.def("copy_items", pd::nanobind::same_device(&copy_items), "src"_a, "dst"_a, "device"_a, "item_bytes"_a,
          "src_items"_a, "dst_items"_a, nb::call_guard<nb::gil_scoped_release>(),
          "Copy items between two kernel tables of one device, entry by entry.");
    m.def("alias_values", pd::nanobind::same_device(&alias_values), "table"_a, "device"_a,
          "The entries and the entries one byte on, as integers (nothing is read through them).");
    m.def("entries_on", &entries_on, "table"_a, "device"_a, "Number of entries; the body checks the device.");
}
