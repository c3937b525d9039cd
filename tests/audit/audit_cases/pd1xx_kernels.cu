// Cases for PD101-PD104. A comment with data_ptr<uintptr_t>() is not code.
#include <torch/extension.h>

struct Desc {
  uintptr_t src;  // expect[PD103]
  uint64_t dst_addr;  // expect[PD103]
  uint64_t num_bytes;
  size_t ptrs_needed;
  int64_t num_ptrs;
  uintptr_t stream;
};

void f(torch::Tensor ptrs_t, torch::Tensor x) {
  auto* tbl = ptrs_t.data_ptr<uintptr_t>();  // expect[PD101]
  int64_t* key_ptrs = ptrs_t.data_ptr<int64_t>();  // expect[PD101]
  int64_t* slots = x.data_ptr<int64_t>();
  int64_t* slot_ptr = x.data_ptr<int64_t>();
  auto** p = reinterpret_cast<float**>(ptrs_t.data_ptr());  // expect[PD102]
  auto a = reinterpret_cast<uintptr_t>(x.data_ptr());  // expect[PD102]
  const uint8_t* b = reinterpret_cast<const uint8_t*>(x.data_ptr());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0);
  float* k = reinterpret_cast<float*>(key_ptrs[3]);  // expect[PD104]
  const char* s = "reinterpret_cast<float**>(t.data_ptr())";
  uint64_t v = (uint64_t)x.data_ptr();  // expect[PD102]
  /* uintptr_t hidden; */
}

// Handles held as integers in an engine's request and backend records: not addresses.
struct XferReq {
  uintptr_t reqh;
  uintptr_t backend;
  uint64_t mvh;
  uintptr_t local_side;
  uintptr_t remote_side;
};

__device__ void step(void** gbl_ptrs, int i, size_t n) {
  gbl_ptrs[i] = reinterpret_cast<uint8_t*>(gbl_ptrs[i]) + n;  // negative: a void** parameter
}

__global__ void gather(const uint64_t* src_addrs, float* out) {
  const float* s = reinterpret_cast<const float*>(src_addrs[threadIdx.x]);  // expect[PD104] device code
  out[threadIdx.x] = s[0];
}

bool checks(torch::Tensor q, torch::Tensor k, torch::Tensor view) {
  const auto bits = reinterpret_cast<uintptr_t>(q.data_ptr()) |
                    reinterpret_cast<uintptr_t>(k.data_ptr());  // negative: an alignment check (bits % 16)
  const uintptr_t begin = reinterpret_cast<uintptr_t>(view.data_ptr());  // expect[PD103] (opt-in) but no PD102: a range end
  return (bits % 16 == 0) && begin != 0;
}
