// nanobind type casters for pointerdomain's C++ types (header only; needs nanobind >= 2).
//
//   #include <pointerdomain/nanobind.h>
//   namespace pd = pointerdomain;
//   std::uint64_t checksum(pd::KernelTable table, pd::Device device, std::uint64_t nbytes);
//   NB_MODULE(toy, m) { m.def("checksum", pd::nanobind::same_device(&checksum), ...); }
//
// * A pd::KernelTable parameter accepts only a pointerdomain.PointerTable whose
//   domain is DeviceAlias and whose registrations are open. Anything else raises the
//   library's typed error before the function body runs (not nanobind's generic
//   "incompatible function arguments" TypeError): a PointerTable[HostVA], a tensor,
//   an int or any other object -> pointerdomain.errors.DomainError; a closed
//   registration -> ClosedError. The caster holds a reference to the table for the
//   whole call, so the entries stay valid while the body runs.
// * A pd::Device parameter accepts what pointerdomain.validate_device accepts
//   (pointerdomain.Device, "cuda:0", "emulated:1", a torch.device); an unknown device,
//   or one that does not exist, raises InvalidDeviceError.
// * pd::nanobind::same_device(&fn) wraps a function with exactly one pd::Device
//   parameter and at least one pd::KernelTable parameter: before fn runs, every table's
//   device must equal that Device (else DeviceMismatchError). That is how "a table of
//   the right device" is enforced before the body; pd::nanobind::require_device(table,
//   device) does the same check inside a body that knows its device otherwise.
//
// In a stub (nanobind.stubgen) the parameters read
// `pointerdomain.PointerTable[pointerdomain.DeviceAlias]` and `pointerdomain.Device | str`,
// so mypy rejects a PointerTable[HostVA] at the call site too.
//
// None: nanobind refuses None itself (its generic TypeError, before any caster) unless the
// parameter is annotated `nb::arg("table").none()`; then the caster refuses it with DomainError.
//
// The typed errors are raised only in nanobind's converting pass. A function overloaded on
// a KernelTable parameter therefore still gets its other overloads tried first; do not
// overload on it (the first converting overload with a KernelTable raises).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "pointerdomain.h"

namespace pointerdomain {
namespace detail {

//! Raise pointerdomain.errors.<name>(message) as a Python exception: nanobind restores it
//! when the call unwinds. Takes the GIL itself, so it may be called under
//! nb::call_guard<nb::gil_scoped_release>.
[[noreturn]] inline void raise_error(const char *name, const std::string &message) {
    ::nanobind::gil_scoped_acquire gil;
    ::nanobind::object errors = ::nanobind::module_::import_("pointerdomain.errors");
    ::nanobind::object cls = errors.attr(name);
    PyErr_SetString(cls.ptr(), message.c_str());
    throw ::nanobind::python_error();
}

inline std::string type_name_of(::nanobind::handle h) {
    return ::nanobind::cast<std::string>(::nanobind::handle((PyObject *) Py_TYPE(h.ptr())).attr("__name__"));
}

inline std::string repr_of(::nanobind::handle h) { return ::nanobind::cast<std::string>(::nanobind::repr(h)); }

inline bool is_instance(::nanobind::handle obj, ::nanobind::handle cls) {
    int r = PyObject_IsInstance(obj.ptr(), cls.ptr());
    if (r < 0)
        throw ::nanobind::python_error();
    return r == 1;
}

//! pointerdomain.Device -> Device (the Python object is already validated by the library).
inline Device device_from_python(::nanobind::handle dev) {
    std::string type = ::nanobind::cast<std::string>(dev.attr("type"));
    long ordinal = ::nanobind::cast<long>(dev.attr("ordinal"));
    if (type != "cuda" && type != "emulated")
        raise_error("InvalidDeviceError", "unknown device type " + type + " (this header knows cuda and emulated)");
    if (ordinal < 0 || ordinal > INT32_MAX)
        raise_error("InvalidDeviceError", "device ordinal out of range: " + std::to_string(ordinal));
    return Device{type == "cuda" ? DeviceType::cuda : DeviceType::emulated, static_cast<std::int32_t>(ordinal)};
}

inline std::string to_string(Device d) {
    return std::string(d.type == DeviceType::cuda ? "cuda:" : "emulated:") + std::to_string(d.ordinal);
}

struct KernelTableAccess {
    //! Check `src` and read the view. Raises the library's typed errors.
    static KernelTable from_python(::nanobind::handle src, std::vector<std::uint64_t> &sizes) {
        namespace nb = ::nanobind;
        nb::module_ pd = nb::module_::import_("pointerdomain");
        nb::object table_cls = pd.attr("PointerTable");
        if (!is_instance(src, table_cls)) {
            nb::object tensor_cls = nb::module_::import_("torch").attr("Tensor");
            std::string what = type_name_of(src);
            if (is_instance(src, tensor_cls))
                raise_error("DomainError",
                            "a raw tensor has no address domain: a kernel table parameter takes a "
                            "pointerdomain.PointerTable[DeviceAlias] (build it with make_kernel_ptr_table), "
                            "not a tensor of addresses");
            if (PyLong_Check(src.ptr()))
                raise_error("DomainError",
                            "a plain int has no address domain: a kernel table parameter takes a "
                            "pointerdomain.PointerTable[DeviceAlias] (build it with make_kernel_ptr_table)");
            raise_error("DomainError", "a kernel table parameter takes a pointerdomain.PointerTable[DeviceAlias], got " +
                                           what);
        }
        nb::object domain = src.attr("domain");
        if (!domain.is(pd.attr("DeviceAlias")))
            raise_error("DomainError",
                        repr_of(src) + " reached a kernel table parameter: kernels read device aliases only "
                                    "(PointerTable[DeviceAlias] from make_kernel_ptr_table); host VAs are for CPU code "
                                    "and transfer engines");
        src.attr("check_live")();             // ClosedError propagates as is
        src.attr("check_kernel_readable")();  // UnpinnedMemoryError: host VAs of unpinned memory
        KernelTable view;
        view.device_ = device_from_python(src.attr("device"));
        view.size_ = nb::len(src);
        view.entries_ = nb::cast<std::uint64_t>(src.attr("kernel_table_address")());
        nb::object py_sizes = src.attr("sizes");
        sizes.clear();
        sizes.reserve(view.size_);
        for (nb::handle s : py_sizes)
            sizes.push_back(nb::cast<std::uint64_t>(s));
        if (sizes.size() != view.size_)
            raise_error("LayoutError", "table sizes do not match its length");
        view.sizes_ = sizes.data();
        return view;
    }
};

template <class T>
inline constexpr bool is_table_v = std::is_same_v<std::remove_cv_t<std::remove_reference_t<T>>, KernelTable>;
template <class T>
inline constexpr bool is_device_v = std::is_same_v<std::remove_cv_t<std::remove_reference_t<T>>, Device>;

}  // namespace detail

namespace nanobind {

//! Raise pointerdomain.errors.<name>(message) from C++ (e.g. "IndexValidationError");
//! the GIL need not be held.
[[noreturn]] inline void raise_error(const char *name, const std::string &message) {
    detail::raise_error(name, message);
}

//! Raises DeviceMismatchError unless the table belongs to `device`.
inline void require_device(const KernelTable &table, Device device) {
    if (table.device() != device)
        detail::raise_error("DeviceMismatchError", "a kernel table of " + detail::to_string(table.device()) +
                                                       " was given for a call on " + detail::to_string(device));
}

//! Wrap `fn` so that, before it runs, every KernelTable argument is checked against its one
//! Device argument (DeviceMismatchError otherwise). Bind the result with m.def.
template <typename R, typename... Args>
auto same_device(R (*fn)(Args...)) {
    constexpr std::size_t n_devices = (std::size_t(0) + ... + std::size_t(detail::is_device_v<Args>));
    constexpr std::size_t n_tables = (std::size_t(0) + ... + std::size_t(detail::is_table_v<Args>));
    static_assert(n_devices == 1, "same_device: the function needs exactly one pointerdomain::Device parameter");
    static_assert(n_tables >= 1, "same_device: the function has no pointerdomain::KernelTable parameter");
    return [fn](Args... args) -> R {
        const Device *device = nullptr;
        auto find = [&](const auto &a) {
            if constexpr (detail::is_device_v<decltype(a)>)
                device = &a;
        };
        (find(args), ...);
        auto check = [&](const auto &a) {
            if constexpr (detail::is_table_v<decltype(a)>)
                require_device(a, *device);
        };
        (check(args), ...);
        return fn(std::forward<Args>(args)...);
    };
}

}  // namespace nanobind
}  // namespace pointerdomain

namespace nanobind::detail {

template <>
struct type_caster<pointerdomain::KernelTable> {
    NB_TYPE_CASTER(pointerdomain::KernelTable, const_name("pointerdomain.PointerTable[pointerdomain.DeviceAlias]"))

    object owner;                        // keeps the table (and its buffers) alive for the call
    std::vector<std::uint64_t> sizes;    // backs value.host_sizes()

    bool from_python(handle src, uint8_t flags, cleanup_list *) {
        // No-convert pass (overloaded functions only): decline quietly so other overloads are tried.
        if (!(flags & (uint8_t) cast_flags::convert)) {
            object cls = module_::import_("pointerdomain").attr("PointerTable");
            if (!pointerdomain::detail::is_instance(src, cls))
                return false;
        }
        value = pointerdomain::detail::KernelTableAccess::from_python(src, sizes);
        owner = borrow(src);
        return true;
    }
};

template <>
struct type_caster<pointerdomain::Device> {
    NB_TYPE_CASTER(pointerdomain::Device, io_name("pointerdomain.Device | str", "pointerdomain.Device"))

    bool from_python(handle src, uint8_t flags, cleanup_list *) {
        object pd = module_::import_("pointerdomain");
        if (!(flags & (uint8_t) cast_flags::convert) && !pointerdomain::detail::is_instance(src, pd.attr("Device")))
            return false;
        // validate_device, not as_device: a device that does not exist is InvalidDeviceError
        // here, never a DeviceMismatchError against the table later
        value = pointerdomain::detail::device_from_python(pd.attr("validate_device")(src));
        return true;
    }

    static handle from_cpp(pointerdomain::Device d, rv_policy, cleanup_list *) noexcept {
        try {
            object pd = module_::import_("pointerdomain");
            return pd.attr("Device")(d.type == pointerdomain::DeviceType::cuda ? "cuda" : "emulated", d.ordinal)
                .release();
        } catch (python_error &e) {
            e.restore();
            return handle();
        }
    }
};

}  // namespace nanobind::detail
