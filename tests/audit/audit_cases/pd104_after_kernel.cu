// PD104 after a kernel definition in the same file: the host function below reads its table
// on the CPU (host VAs), the kernel reads device aliases.
#include <cstdint>
#include <cstring>

__global__ void gather_rows(const uint64_t* row_addrs, float* out, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    if (i < n) {
      const float* row = reinterpret_cast<const float*>(row_addrs[i]);  // expect[PD104] device code
      out[i] = row[0];
    }
  }
}

void stage_rows(const uint64_t* host_addrs, char* dst, size_t bytes, int n) {
  for (int i = 0; i < n; ++i) {
    std::memcpy(dst + i * bytes, reinterpret_cast<const char*>(host_addrs[i]), bytes);  // expect[PD104] host code
  }
}

template <typename T>
__device__ __forceinline__ T load_first(const uint64_t* elem_addrs) {
  return *reinterpret_cast<const T*>(elem_addrs[0]);  // expect[PD104] device code
}

void launch_rows(const uint64_t* dev_addrs, float* out, int n) {
  gather_rows<<<1, 128>>>(dev_addrs, out, n);
  const float* first = reinterpret_cast<const float*>(dev_addrs[0]);  // expect[PD104] host code
  (void)first;
}
