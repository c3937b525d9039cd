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
