// A table of addresses read on the CPU (a binding that copies with memcpy): PD104 with the
// host-VA fix text.
#include <cstring>
#include <vector>

void copy_all(const std::vector<uint64_t>& buffer_addrs, const std::vector<size_t>& sizes, char* dst) {
  for (size_t i = 0; i < sizes.size(); ++i) {
    std::memcpy(dst, reinterpret_cast<const char*>(buffer_addrs[i]), sizes[i]);  // expect[PD104] host code
    dst += sizes[i];
  }
}

void set_peers(const int64_t* ipc_ptrs, int rank, size_t n, void* const* buffer_ptrs) {
  cudaMemset(reinterpret_cast<void*>(ipc_ptrs[rank]), 0, n);  // expect[PD104] handed to the runtime
  auto* sig = reinterpret_cast<int*>(buffer_ptrs[rank]);  // negative: an array of pointers
  std::array<int8_t*, 4> pointers{};
  auto* shapes = reinterpret_cast<float*>(pointers[0]);  // negative: std::array of pointers
}
