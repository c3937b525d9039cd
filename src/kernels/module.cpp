// pointerdomain._C: thin bindings. Addresses cross as Python ints that the typed
// layer has already checked; only pointerdomain._platform calls these, and it turns
// the status codes that come back into the typed errors.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "emulation.h"
#include "strict_alloc.h"
#include "transfer.h"
#ifdef POINTERDOMAIN_WITH_GPU
#include "attributes_gpu.h"
#include "gpu.h"
#include "pinned_gpu.h"
#endif

namespace nb = nanobind;
namespace pd = pointerdomain;

namespace {
// index_words_set's offsets: tensor storage, storage offset, dim, size 0, stride 0, numel,
// dtype word (in the tensor object); data pointer, size in bytes (in the storage object);
// the tensor object (in the Python object); and torch.Tensor, the one Python type read
std::size_t index_offsets[10] = {};
PyTypeObject *index_type = nullptr;

std::uint64_t word_at(std::uint64_t base, std::size_t offset) {
    std::uint64_t word;
    std::memcpy(&word, reinterpret_cast<const void *>(base + offset), sizeof word);
    return word;
}

// version_words_set's offsets: the version counter (in the tensor object), its version (in
// the counter object)
std::size_t version_offsets[2] = {};

// What a tensor (exactly the type set) is now, as five words: its storage object, storage
// offset, dtype word, the storage's data pointer and the tensor's version.
bool tensor_words(nb::handle tensor, std::uint64_t *out) {
    const std::size_t *o = index_offsets;
    if (!index_type || !version_offsets[0] || Py_TYPE(tensor.ptr()) != index_type) return false;
    const std::uint64_t impl = word_at(reinterpret_cast<std::uint64_t>(tensor.ptr()), o[9]);
    if (!impl) return false;
    const std::uint64_t storage = word_at(impl, o[0]);
    const std::uint64_t counter = word_at(impl, version_offsets[0]);
    if (!storage || !counter) return false;  // (no counter: an inference tensor)
    out[0] = storage;
    out[1] = word_at(impl, o[1]);
    out[2] = word_at(impl, o[6]);
    out[3] = word_at(storage, o[7]);
    out[4] = word_at(counter, version_offsets[1]) & 0xffffffffu;
    return true;
}

// A 1-D int64 view with stride 1 whose storage holds it: its numel and data pointer.
bool index_view(nb::handle tensor, std::uint64_t meta, std::int64_t &n, std::uint64_t &data) {
    const std::size_t *o = index_offsets;
    if (!index_type || Py_TYPE(tensor.ptr()) != index_type) return false;
    const std::uint64_t impl = word_at(reinterpret_cast<std::uint64_t>(tensor.ptr()), o[9]);
    if (!impl || word_at(impl, o[6]) != meta || word_at(impl, o[2]) != 1 || word_at(impl, o[4]) != 1) return false;
    const auto numel = static_cast<std::int64_t>(word_at(impl, o[5]));
    const auto offset = static_cast<std::int64_t>(word_at(impl, o[1]));
    if (numel < 0 || offset < 0 || static_cast<std::int64_t>(word_at(impl, o[3])) != numel) return false;
    const std::uint64_t storage = word_at(impl, o[0]);
    if (!storage) return false;
    const std::uint64_t nbytes = word_at(storage, o[8]);
    if (static_cast<std::uint64_t>(offset) + static_cast<std::uint64_t>(numel) > nbytes / 8) return false;
    n = numel;
    data = word_at(storage, o[7]) + 8 * static_cast<std::uint64_t>(offset);
    return true;
}
}  // namespace

using Geometry = std::array<std::int64_t, 8>;  // e_kv, e_layer, e_page, s_kv, s_layer, s_page, s_tok, num_slots
using HostBytes = nb::ndarray<nb::pytorch, std::uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// The part of a launch that depends only on the tables and layouts, built once by
// pointerdomain.transfer.plan.TransferPlan and bound as _C.KernelPlan, so a launch crosses
// the binding with one object instead of two geometries and a dozen ints.
struct KernelPlan {
    pd::Side src{}, dst{};
    std::int64_t page_size = 0, num_kv = 0, item_bytes = 0;
    int vec_bytes = 1;
    std::uint64_t oob = 0;  // address of the uint32 error word the kernels set (0: none)

    pd::Transfer transfer(std::uint64_t src_idx, std::uint64_t dst_idx, std::int64_t n, std::int64_t layer_begin,
                          std::int64_t layer_count) const {
        return pd::Transfer{src,       dst,         reinterpret_cast<const std::int64_t *>(src_idx),
                            reinterpret_cast<const std::int64_t *>(dst_idx),
                            n,         page_size,   num_kv,
                            layer_begin, layer_count, item_bytes, reinterpret_cast<std::uint32_t *>(oob)};
    }
};

static pd::Side side(std::uint64_t table, const Geometry &g) {
    return pd::Side{reinterpret_cast<const std::uint64_t *>(table), g[0], g[1], g[2], g[3], g[4], g[5], g[6], g[7]};
}

static Geometry geometry(const pd::Side &s) {
    return {s.e_kv, s.e_layer, s.e_page, s.s_kv, s.s_layer, s.s_page, s.s_tok, s.num_slots};
}

static std::uint64_t table_address(const pd::Side &s) { return reinterpret_cast<std::uint64_t>(s.table); }

static HostBytes wrap(void *ptr, std::uint64_t nbytes, void (*release)(void *) noexcept) {
    nb::capsule owner(ptr, release);
    return HostBytes(ptr, {static_cast<std::size_t>(nbytes)}, owner);
}

NB_MODULE(_C, m) {
    m.doc() = "pointerdomain kernels and runtime calls (private; use the pointerdomain package)";
#ifdef POINTERDOMAIN_WITH_GPU
    m.attr("gpu_built") = true;
#else
    m.attr("gpu_built") = false;
#endif

    nb::class_<KernelPlan>(m, "KernelPlan", "Tables and geometry of one launch plan (see pointerdomain.transfer.plan).")
        .def(
            "__init__",
            [](KernelPlan *p, std::uint64_t src_table, const Geometry &src_geometry, std::uint64_t dst_table,
               const Geometry &dst_geometry, std::int64_t page_size, std::int64_t num_kv, std::int64_t item_bytes,
               int vec_bytes, std::uint64_t oob) {
                new (p) KernelPlan{side(src_table, src_geometry), side(dst_table, dst_geometry), page_size, num_kv,
                                   item_bytes, vec_bytes, oob};
            },
            nb::arg("src_table"), nb::arg("src_geometry"), nb::arg("dst_table"), nb::arg("dst_geometry"),
            nb::arg("page_size"), nb::arg("num_kv"), nb::arg("item_bytes"), nb::arg("vec_bytes"), nb::arg("oob") = 0)
        .def_prop_ro("src_table", [](const KernelPlan &p) { return table_address(p.src); })
        .def_prop_ro("dst_table", [](const KernelPlan &p) { return table_address(p.dst); })
        .def_prop_ro("src_geometry", [](const KernelPlan &p) { return geometry(p.src); })
        .def_prop_ro("dst_geometry", [](const KernelPlan &p) { return geometry(p.dst); })
        .def_ro("page_size", &KernelPlan::page_size)
        .def_ro("num_kv", &KernelPlan::num_kv)
        .def_ro("item_bytes", &KernelPlan::item_bytes)
        .def_ro("vec_bytes", &KernelPlan::vec_bytes)
        .def_ro("oob", &KernelPlan::oob, "Address of the uint32 error word (0: none).")
        .def_prop_ro(
            "dst_marks_words", [](const KernelPlan &p) { return pd::marks_words(p.dst.num_slots); },
            "uint32 words of the duplicate-destination scratch for this plan's destination (marks_words).");

    m.def(
        "cpu_transfer",
        [](const KernelPlan &plan, std::uint64_t src_idx, std::uint64_t dst_idx, std::int64_t n,
           std::int64_t layer_begin, std::int64_t layer_count, int num_threads, std::uint64_t marks) {
            pd::Transfer t = plan.transfer(src_idx, dst_idx, n, layer_begin, layer_count);
            t.marks = reinterpret_cast<std::uint32_t *>(marks);
            pd::transfer_cpu(t, num_threads);
        },
        nb::arg("plan"), nb::arg("src_idx"), nb::arg("dst_idx"), nb::arg("n"), nb::arg("layer_begin"),
        nb::arg("layer_count"), nb::arg("num_threads"), nb::arg("marks") = 0, nb::call_guard<nb::gil_scoped_release>(),
        "Copy KV items between two tables of CPU addresses. marks: 0, or the address of a scratch of "
        "marks_words(dst num_slots) uint32 words for the duplicate-destination check (a slot given twice: "
        "nothing copied, error bit 2 set).");
    m.def("marks_words", &pd::marks_words, nb::arg("num_slots"),
          "uint32 words of the duplicate-destination scratch for a destination of num_slots slots.");

    m.def(
        "cpu_transfer_layers",
        [](const KernelPlan &plan, std::uint64_t src_idx, std::uint64_t dst_idx, std::int64_t n,
           std::int64_t layer_begin, std::int64_t layer_count, std::uint64_t flags, std::uint32_t gen,
           int num_threads) {
            pd::transfer_cpu_layers(plan.transfer(src_idx, dst_idx, n, layer_begin, layer_count),
                                    reinterpret_cast<std::uint32_t *>(flags), gen, num_threads);
        },
        nb::arg("plan"), nb::arg("src_idx"), nb::arg("dst_idx"), nb::arg("n"), nb::arg("layer_begin"),
        nb::arg("layer_count"), nb::arg("flags"), nb::arg("gen"), nb::arg("num_threads"),
        nb::call_guard<nb::gil_scoped_release>(),
        "cpu_transfer one layer at a time, storing gen to the uint32 word flags[l] after layer l.");
    m.def(
        "cpu_copy_runs",
        [](std::uint64_t dsts, std::uint64_t srcs, std::uint64_t sizes, std::size_t count) {
            const auto *d = reinterpret_cast<const std::uint64_t *>(dsts);
            const auto *s = reinterpret_cast<const std::uint64_t *>(srcs);
            const auto *n = reinterpret_cast<const std::uint64_t *>(sizes);
            for (std::size_t i = 0; i < count; ++i)
                std::memcpy(reinterpret_cast<void *>(d[i]), reinterpret_cast<const void *>(s[i]), n[i]);
        },
        nb::arg("dsts"), nb::arg("srcs"), nb::arg("sizes"), nb::arg("count"),
        nb::call_guard<nb::gil_scoped_release>(), "memcpy runs: addresses of uint64 arrays of dst, src, bytes.");
    // The launch path's liveness check (pointerdomain._platform.liveness): one pass over the
    // words a table recorded when it was built (each storage's data pointer and size, each
    // kept tensor's storage and offset), instead of two Python calls per storage.
    m.def(
        "words_differ",
        [](std::uint64_t addresses, std::uint64_t expected, std::size_t count) -> std::int64_t {
            const auto *a = reinterpret_cast<const std::uint64_t *>(addresses);
            const auto *e = reinterpret_cast<const std::uint64_t *>(expected);
            for (std::size_t i = 0; i < count; ++i) {
                std::uint64_t word;
                std::memcpy(&word, reinterpret_cast<const void *>(a[i]), sizeof word);
                if (word != e[i]) return static_cast<std::int64_t>(i);
            }
            return -1;
        },
        nb::arg("addresses"), nb::arg("expected"), nb::arg("count"),
        "Index of the first i with *addresses[i] != expected[i] (uint64 arrays by address), or -1.");
    // The host-side index check of indices in host memory (the emulated device, the copy
    // engine's copies): every slot inside its side's [0, slots), no destination twice; the
    // caller words the error (pointerdomain.transfer.plan) when this says there is one.
    m.def(
        "host_slots_problem",
        [](std::uint64_t src_idx, std::uint64_t dst_idx, std::size_t n, std::int64_t src_slots,
           std::int64_t dst_slots) -> int {
            const auto *s = reinterpret_cast<const std::int64_t *>(src_idx);
            const auto *d = reinterpret_cast<const std::int64_t *>(dst_idx);
            for (std::size_t i = 0; i < n; ++i) {
                if (s[i] < 0 || s[i] >= src_slots) return 1;
                if (d[i] < 0 || d[i] >= dst_slots) return 2;
            }
            if (n < 2) return 0;
            if (n <= 32) {
                for (std::size_t i = 1; i < n; ++i)
                    for (std::size_t j = 0; j < i; ++j)
                        if (d[i] == d[j]) return 3;
                return 0;
            }
            std::vector<bool> seen(static_cast<std::size_t>(dst_slots), false);
            for (std::size_t i = 0; i < n; ++i) {
                if (seen[static_cast<std::size_t>(d[i])]) return 3;
                seen[static_cast<std::size_t>(d[i])] = true;
            }
            return 0;
        },
        nb::arg("src_idx"), nb::arg("dst_idx"), nb::arg("n"), nb::arg("src_slots"), nb::arg("dst_slots"),
        "0, or 1 / 2: a src / dst slot outside [0, slots), 3: a dst slot twice (int64 host arrays by address).");
    // The launch path's test of two index tensors (pointerdomain._platform.liveness.IndexReader):
    // the same facts as torch's queries (1-D, stride 1, int64 on the CPU, a storage holding
    // the view, the data pointer), read from torch's own objects at word offsets found and
    // proven at run time. A tensor it does not accept goes to the Python checks.
    m.def(
        "index_words_set",
        [](std::array<std::size_t, 10> offsets, nb::handle tensor_type) {
            std::memcpy(index_offsets, offsets.data(), sizeof index_offsets);
            index_type = reinterpret_cast<PyTypeObject *>(tensor_type.ptr());
            Py_INCREF(tensor_type.ptr());  // kept for the process
        },
        nb::arg("offsets"), nb::arg("tensor_type"),
        "Word offsets: tensor storage, storage offset, dim, size 0, stride 0, numel, dtype word; storage "
        "data, storage size; tensor object in the Python object. tensor_type: the Python type read.");
    m.def(
        "version_words_set",
        [](std::size_t counter, std::size_t version) {
            version_offsets[0] = counter;
            version_offsets[1] = version;
        },
        nb::arg("counter"), nb::arg("version"),
        "Word offsets: the version counter in the tensor object, the version in the counter object.");
    m.def(
        "tensors_words",
        [](nb::handle tensors, std::uint64_t out, bool compare) -> bool {
            // compare: whether every tensor's words equal those at out; else write them there
            const Py_ssize_t n = PyTuple_Size(tensors.ptr());
            if (n < 0) {
                PyErr_Clear();
                return false;
            }
            auto *words = reinterpret_cast<std::uint64_t *>(out);
            for (Py_ssize_t i = 0; i < n; ++i) {
                std::uint64_t now[5];
                if (!tensor_words(nb::handle(PyTuple_GetItem(tensors.ptr(), i)), now)) return false;
                if (compare ? std::memcmp(now, words + 5 * i, sizeof now) != 0 : false) return false;
                if (!compare) std::memcpy(words + 5 * i, now, sizeof now);
            }
            return true;
        },
        nb::arg("tensors"), nb::arg("out"), nb::arg("compare"),
        "For a tuple of tensors (exactly the type set): five words each (storage object, storage offset, "
        "dtype word, storage data pointer, version), written to out (5 uint64 each) or, with compare, "
        "compared with those there. False where a tensor is not read (or, comparing, differs).");
    m.def(
        "index_pair",
        [](nb::handle src, nb::handle dst, std::uint64_t meta, int ordinal) -> nb::object {
            std::int64_t n = 0, nd = 0;
            std::uint64_t sp = 0, dp = 0;
            if (!index_view(src, meta, n, sp) || !index_view(dst, meta, nd, dp)) return nb::none();
            bool host = true;
            if (ordinal >= 0) {  // host memory, or emulated device memory of this ordinal
                const int s_where = pd::emu::device_lookup(sp, n ? 8 * static_cast<std::uint64_t>(n) : 8);
                const int d_where = pd::emu::device_lookup(dp, nd ? 8 * static_cast<std::uint64_t>(nd) : 8);
                if ((s_where >= 0 && s_where != ordinal) || (d_where >= 0 && d_where != ordinal)) return nb::none();
                host = s_where < 0 || d_where < 0;
            }
            return nb::make_tuple(n, nd, sp, dp, host);
        },
        nb::arg("src").none(), nb::arg("dst").none(), nb::arg("meta"), nb::arg("ordinal"),
        "(numel, numel, data pointer, data pointer, host) of two tensors of exactly the type set that are "
        "1-D, stride 1, with the dtype word meta and a storage holding the view; else None. ordinal >= 0: "
        "each must be host memory or emulated device memory of that ordinal (else None), host: one is "
        "host memory; ordinal < 0: not looked up (host True).");
    m.def(
        "read_words",
        [](std::uint64_t address, std::size_t count) {
            std::vector<std::uint64_t> words(count);
            if (count) std::memcpy(words.data(), reinterpret_cast<const void *>(address), count * sizeof(std::uint64_t));
            return words;
        },
        nb::arg("address"), nb::arg("count"), "count uint64 words from address (of a live object).");
    m.def(
        "emu_host_alloc",
        [](std::uint64_t nbytes) {
            void *p = pd::emu::host_alloc(nbytes);
            if (!p) throw std::bad_alloc();
            return wrap(p, nbytes, [](void *q) noexcept { pd::emu::host_free(q); });
        },
        nb::arg("nbytes"), "Page-aligned, memfd-backed host memory as a uint8 tensor.");
    m.def(
        "emu_device_alloc",
        [](std::uint64_t nbytes, int ordinal) {
            void *p = pd::emu::device_alloc(nbytes, ordinal);
            if (!p) throw std::bad_alloc();
            return wrap(p, nbytes, [](void *q) noexcept { pd::emu::device_free(q); });
        },
        nb::arg("nbytes"), nb::arg("ordinal"), "Emulated device memory of one device ordinal, as a uint8 tensor.");
    m.def("emu_device_lookup", &pd::emu::device_lookup, nb::arg("addr"), nb::arg("nbytes"),
          "Ordinal of the emulated device allocation holding the range, or -1.");
    m.def("emu_device_frees", &pd::emu::device_frees,
          "Emulated device allocations released since the process started (only grows).");
    m.def(
        "emu_register",
        [](std::uint64_t va, std::uint64_t nbytes) {
            std::uint64_t alias = 0;
            const int status = pd::emu::register_range(va, nbytes, &alias);
            return std::make_pair(status, alias);
        },
        nb::arg("va"), nb::arg("nbytes"), "Map a host range a second time: (status, alias).");
    m.def("emu_unregister", &pd::emu::unregister_range, nb::arg("va"), "Drop the alias mapping: status.");
    m.def("emu_prepare", &pd::emu::prepare_range, nb::arg("va"), nb::arg("nbytes"),
          "Back a host range by one memfd before a chunked registration: status.");
    m.def(
        "emu_get_device_pointer",
        [](std::uint64_t va) {
            std::uint64_t alias = 0;
            const int status = pd::emu::get_device_pointer(va, &alias);
            return std::make_pair(status, alias);
        },
        nb::arg("va"), "Alias of a registered host address: (status, alias).");
    m.def(
        "strict_shared_alloc",
        [](std::uint64_t nbytes) {
            void *p = pd::strict::shared_alloc(nbytes);
            if (!p) throw std::bad_alloc();
            return wrap(p, nbytes, [](void *q) noexcept { pd::strict::unmap(q); });
        },
        nb::arg("nbytes"), "Page-aligned memfd-backed MAP_SHARED host memory (strict alias mode), a uint8 tensor.");
    m.def(
        "strict_mirror",
        [](std::uint64_t va, std::uint64_t nbytes) {
            void *p = pd::strict::mirror(va, nbytes);
            if (!p) throw std::bad_alloc();
            return wrap(p, nbytes, [](void *q) noexcept { pd::strict::unmap(q); });
        },
        nb::arg("va"), nb::arg("nbytes"), "A second mapping of the shared pages at va (strict alias mode).");
    m.def(
        "strict_twin",
        [](std::uint64_t va, std::uint64_t nbytes) {
            void *p = pd::strict::twin(va, nbytes);
            if (p == nullptr) throw std::bad_alloc();
            return wrap(p, nbytes, [](void *q) noexcept { pd::strict::unmap(q); });
        },
        nb::arg("va"), nb::arg("nbytes"),
        "A further mapping of the shared pages at va, inside guard pages at a random gap (strict alias mode: one "
        "chunk's registered mapping).");
    m.def(
        "emu_get_device_pointer_on",
        [](std::uint64_t va, int ordinal) {
            std::uint64_t alias = 0;
            const int status = pd::emu::get_device_pointer_on(va, ordinal, &alias);
            return std::make_pair(status, alias);
        },
        nb::arg("va"), nb::arg("ordinal"),
        "Alias of a registered host address on one emulated device (each device its own mapping): (status, alias).");
    m.def("emu_alias_lookup", &pd::emu::alias_lookup, nb::arg("addr"), nb::arg("nbytes"),
          "Ordinal of the emulated device whose alias mapping holds the range, or -1.");

#ifdef POINTERDOMAIN_WITH_GPU
    namespace g = pd::gpu;
    m.attr("gpu_runtime") = g::runtime_name();
    auto out_int = [](auto fn) {
        return [fn](auto... args) {
            int value = 0;
            const int status = fn(args..., &value);
            return std::make_pair(status, value);
        };
    };
    m.def("gpu_runtime_version", [] { int v = 0; const int s = g::runtime_version(&v); return std::make_pair(s, v); });
    m.def("gpu_device_count", [] { int v = 0; const int s = g::device_count(&v); return std::make_pair(s, v); },
          "(status, number of devices)");
    m.def("gpu_host_register", &g::host_register, nb::arg("va"), nb::arg("nbytes"), nb::arg("device"),
          nb::call_guard<nb::gil_scoped_release>(), "cudaHostRegister(portable | mapped): status.");
    m.def("gpu_host_unregister", &g::host_unregister, nb::arg("va"), nb::arg("device"),
          nb::call_guard<nb::gil_scoped_release>(), "cudaHostUnregister: status.");
    m.def(
        "gpu_host_get_device_pointer",
        [](std::uint64_t va, int device) {
            std::uint64_t alias = 0;
            const int status = g::host_get_device_pointer(va, device, &alias);
            return std::make_pair(status, alias);
        },
        nb::arg("va"), nb::arg("device"), "cudaHostGetDevicePointer: (status, alias).");
    m.def("gpu_can_use_host_pointer_for_registered_mem",
          [out_int](int device) { return out_int(&g::can_use_host_pointer_for_registered_mem)(device); },
          nb::arg("device"), "(status, cudaDevAttrCanUseHostPointerForRegisteredMem)");
    m.def("gpu_pointer_is_host", [out_int](std::uint64_t ptr) { return out_int(&g::pointer_is_host)(ptr); },
          nb::arg("ptr"), "(status, 1 if the runtime reports registered/pinned host memory)");
    m.def("gpu_multiprocessor_count", [out_int](int device) { return out_int(&g::multiprocessor_count)(device); },
          nb::arg("device"), "(status, number of SMs)");
    nb::enum_<g::DeviceAttribute>(m, "DeviceAttribute",
                                  "Portable device attribute ids for gpu_device_attribute (mapped to the runtime's).")
        .value("CanUseHostPointerForRegisteredMem", g::DeviceAttribute::CanUseHostPointerForRegisteredMem)
        .value("PageableMemoryAccess", g::DeviceAttribute::PageableMemoryAccess)
        .value("PageableMemoryAccessUsesHostPageTables", g::DeviceAttribute::PageableMemoryAccessUsesHostPageTables)
        .value("HostRegisterSupported", g::DeviceAttribute::HostRegisterSupported)
        .value("HostRegisterReadOnlySupported", g::DeviceAttribute::HostRegisterReadOnlySupported)
        .value("PciDomainId", g::DeviceAttribute::PciDomainId)
        .value("PciBusId", g::DeviceAttribute::PciBusId)
        .value("PciDeviceId", g::DeviceAttribute::PciDeviceId);
    m.def(
        "gpu_device_attribute",
        [](g::DeviceAttribute attribute, int device) {
            int value = 0;
            const int status = g::device_attribute(static_cast<int>(attribute), device, &value);
            return std::make_pair(status, value);
        },
        nb::arg("attribute"), nb::arg("device"), "cudaDeviceGetAttribute / hipDeviceGetAttribute: (status, value).");
    m.def("gpu_error_string", &g::error_string, nb::arg("code"));
    m.def(
        "gpu_pinned_alloc",
        [](std::uint64_t nbytes, int device) {
            void *p = nullptr;
            const int status = g::pinned_alloc(nbytes, device, &p);
            std::optional<HostBytes> out;
            if (status == 0) out = wrap(p, nbytes, &g::pinned_free);
            return std::make_pair(status, out);
        },
        nb::arg("nbytes"), nb::arg("device"),
        "cudaHostAlloc(portable | mapped): (status, uint8 tensor or None), freed with the tensor.");
    m.def("gpu_preload_kernels", &g::preload_kernels, nb::arg("device"), nb::call_guard<nb::gil_scoped_release>(),
          "Load every transfer kernel into the device's context now (lazy loading would load each at its "
          "first launch, which may synchronise the context): status.");
    m.def(
        "gpu_transfer",
        [](const KernelPlan &plan, std::uint64_t src_idx, std::uint64_t dst_idx, std::int64_t n,
           std::int64_t layer_begin, std::int64_t layer_count, int device, std::uint64_t stream, int max_ctas,
           std::uint64_t marks, bool shared_marks) {
            pd::Transfer t = plan.transfer(src_idx, dst_idx, n, layer_begin, layer_count);
            t.marks = reinterpret_cast<std::uint32_t *>(marks);
            return g::transfer(t, device, stream, max_ctas, plan.vec_bytes, shared_marks);
        },
        nb::arg("plan"), nb::arg("src_idx"), nb::arg("dst_idx"), nb::arg("n"), nb::arg("layer_begin"),
        nb::arg("layer_count"), nb::arg("device"), nb::arg("stream"), nb::arg("max_ctas"), nb::arg("marks") = 0,
        nb::arg("shared_marks") = false,
        nb::call_guard<nb::gil_scoped_release>(),
        "Launch the KV transfer kernel on a stream: status (tables and indices in device memory; "
        "max_ctas <= 0: the whole GPU). marks: 0, or a device scratch of marks_words(dst num_slots) uint32 "
        "words only this stream uses: a validation pass first refuses a destination slot given twice "
        "(nothing copied, error bit 2 set). shared_marks: marks is the stream's own scratch, refused while "
        "the stream is captured (gpu_marks_per_capture, nothing launched).");
    m.def(
        "gpu_transfer_recorded",
        [](const KernelPlan &plan, std::uint64_t src_idx, std::uint64_t dst_idx, std::int64_t n,
           std::int64_t layer_begin, std::int64_t layer_count, int device, std::uint64_t stream, int max_ctas,
           std::uint64_t event, std::uint64_t marks, bool shared_marks) {
            pd::Transfer t = plan.transfer(src_idx, dst_idx, n, layer_begin, layer_count);
            t.marks = reinterpret_cast<std::uint32_t *>(marks);
            return g::transfer_recorded(t, device, stream, max_ctas, plan.vec_bytes, event, shared_marks);
        },
        nb::arg("plan"), nb::arg("src_idx"), nb::arg("dst_idx"), nb::arg("n"), nb::arg("layer_begin"),
        nb::arg("layer_count"), nb::arg("device"), nb::arg("stream"), nb::arg("max_ctas"), nb::arg("event"),
        nb::arg("marks") = 0, nb::arg("shared_marks") = false, nb::call_guard<nb::gil_scoped_release>(),
        "gpu_transfer (marks, shared_marks: as there), then record event (from gpu_event_create) on the stream unless it is being captured: "
        "0 (recorded), gpu_not_recorded (capturing, or nothing launched) or a runtime error.");
    m.def(
        "gpu_event_create",
        [](int device) {
            std::uint64_t event = 0;
            const int status = g::event_create(device, &event);
            return std::make_pair(status, event);
        },
        nb::arg("device"), "cudaEventCreateWithFlags(DisableTiming) on a device: (status, event), never destroyed.");
    m.def("gpu_event_record", &g::event_record, nb::arg("event"), nb::arg("device"), nb::arg("stream"),
          "Record the event on the stream unless it is being captured: 0, gpu_not_recorded or a runtime error.");
    m.def("gpu_event_query", &g::event_query, nb::arg("event"), nb::call_guard<nb::gil_scoped_release>(),
          "cudaEventQuery: 0 (done, or never recorded), gpu_not_ready, or a runtime error.");
    m.def(
        "gpu_stream_capturing",
        [out_int](int device, std::uint64_t stream) { return out_int(&g::stream_capturing)(device, stream); },
        nb::arg("device"), nb::arg("stream"), "(status, 1 while the stream of the device is being captured)");
    m.def(
        "gpu_transfer_layers",
        [](const KernelPlan &plan, std::uint64_t src_idx, std::uint64_t dst_idx, std::int64_t n,
           std::int64_t layer_begin, std::int64_t layer_count, int device, std::uint64_t stream, int max_ctas,
           std::uint64_t flags, std::uint64_t counters, std::uint32_t gen, std::uint64_t event, std::uint64_t marks) {
            pd::Transfer t = plan.transfer(src_idx, dst_idx, n, layer_begin, layer_count);
            t.marks = reinterpret_cast<std::uint32_t *>(marks);
            return g::transfer_layers(t, device, stream, max_ctas, plan.vec_bytes, flags, counters, gen, event);
        },
        nb::arg("plan"), nb::arg("src_idx"), nb::arg("dst_idx"), nb::arg("n"), nb::arg("layer_begin"),
        nb::arg("layer_count"), nb::arg("device"), nb::arg("stream"), nb::arg("max_ctas"), nb::arg("flags"),
        nb::arg("counters"), nb::arg("gen"), nb::arg("event"), nb::arg("marks") = 0,
        nb::call_guard<nb::gil_scoped_release>(),
        "One launch for every layer, gen written to flags[l] (uint32, device address) once layer l is done; "
        "counters: as many zeroed uint32 words of device memory; event (nonzero): recorded after the kernel; "
        "marks: 0, or the duplicate-destination scratch (as gpu_transfer: a slot given twice copies nothing). "
        "0, gpu_not_recorded or a runtime error (invalid value while the stream is captured).");
    m.def("gpu_stream_wait_value", &g::stream_wait_value, nb::arg("device"), nb::arg("stream"), nb::arg("addr"),
          nb::arg("value"), "cuStreamWaitValue32 GEQ (cyclic) on a uint32 word: status (a CUresult).");
    m.def("gpu_stream_write_value", &g::stream_write_value, nb::arg("device"), nb::arg("stream"), nb::arg("addr"),
          nb::arg("value"), "cuStreamWriteValue32 of a uint32 word after the stream's earlier work: status.");
    m.def("gpu_event_synchronize", &g::event_synchronize, nb::arg("event"), nb::call_guard<nb::gil_scoped_release>(),
          "cudaEventSynchronize: status.");
    m.attr("gpu_not_recorded") = g::kNotRecorded;
    m.attr("gpu_marks_per_capture") = g::kMarksPerCapture;
    m.attr("gpu_not_ready") = g::not_ready_status();
    m.def(
        "gpu_copy_runs",
        [](std::uint64_t dsts, std::uint64_t srcs, std::uint64_t sizes, std::size_t count, int device,
           std::uint64_t stream, bool use_batch) {
            return g::copy_runs(reinterpret_cast<const std::uint64_t *>(dsts),
                                reinterpret_cast<const std::uint64_t *>(srcs),
                                reinterpret_cast<const std::uint64_t *>(sizes), count, device, stream, use_batch);
        },
        nb::arg("dsts"), nb::arg("srcs"), nb::arg("sizes"), nb::arg("count"), nb::arg("device"), nb::arg("stream"),
        nb::arg("use_batch"), nb::call_guard<nb::gil_scoped_release>(),
        "Copy-engine copies: addresses of host uint64/int64 arrays of dst, src, bytes; status. "
        "use_batch: cudaMemcpyBatchAsync (CUDA >= 12.8), else a cudaMemcpyAsync loop.");
    m.attr("gpu_has_batch_copy") = g::has_batch_copy();
    // Staged copy-engine path (staged_gpu.cu): the host side's table again, in HOST memory
    // (the same alias values), and the host side's slot indices as a host int64 array.
    m.def(
        "gpu_staged_transfer",
        [](const KernelPlan &plan, std::uint64_t src_idx, std::uint64_t dst_idx, std::int64_t n,
           std::int64_t layer_begin, std::int64_t layer_count, bool host_is_src, std::uint64_t host_table,
           std::uint64_t host_idx, std::uint64_t staging, std::uint64_t staging_bytes, int ring, int device,
           std::uint64_t stream, int max_ctas) {
            const pd::Transfer t = plan.transfer(src_idx, dst_idx, n, layer_begin, layer_count);
            pd::Side host = host_is_src ? t.src : t.dst;
            host.table = reinterpret_cast<const std::uint64_t *>(host_table);
            return g::staged_transfer(t, host_is_src, host, reinterpret_cast<const std::int64_t *>(host_idx), staging,
                                      staging_bytes, ring, device, stream, max_ctas, plan.vec_bytes);
        },
        nb::arg("plan"), nb::arg("src_idx"), nb::arg("dst_idx"), nb::arg("n"), nb::arg("layer_begin"),
        nb::arg("layer_count"), nb::arg("host_is_src"), nb::arg("host_table"), nb::arg("host_idx"),
        nb::arg("staging"), nb::arg("staging_bytes"), nb::arg("ring"), nb::arg("device"), nb::arg("stream"),
        nb::arg("max_ctas"), nb::call_guard<nb::gil_scoped_release>(),
        "Staged copy-engine transfer: status (0, a runtime error, gpu_staged_not_applicable or "
        "gpu_staged_bad_index). host_table / host_idx: host uint64 / int64 arrays; staging: device buffer.");
    m.attr("gpu_staged_not_applicable") = g::kStagedNotApplicable;
    m.attr("gpu_staged_bad_index") = g::kStagedBadIndex;
#endif
}
