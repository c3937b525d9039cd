// PD102 on ATen's mutable_data_ptr() / const_data_ptr(), which are data_ptr() by other names.
#include <cstdint>

void casts(at::Tensor t, at::Tensor u) {
  auto a = reinterpret_cast<uintptr_t>(t.mutable_data_ptr());  // expect[PD102]
  auto b = reinterpret_cast<uint64_t>(u.const_data_ptr());  // expect[PD102]
  auto c = (uint64_t)t.mutable_data_ptr();  // expect[PD102]
  auto d = (uint64_t)u->const_data_ptr<float>();  // expect[PD102]
  auto e = reinterpret_cast<void**>(t.mutable_data_ptr());  // expect[PD102]
  auto f = reinterpret_cast<const float*>(u.const_data_ptr());  // negative: a typed pointer
  bool ok = reinterpret_cast<uintptr_t>(t.mutable_data_ptr()) % 16 == 0;  // negative: an alignment check
  use(a, b, c, d, e, f, ok);
}
