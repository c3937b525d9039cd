#include "transfer.h"

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

namespace pointerdomain {

// ITEM > 0: the item size as a compile-time constant, so memcpy becomes inline vector
// moves instead of a library call per item (1 KiB items are the common case).
template <std::int64_t ITEM>
static void copy_range(const Transfer &t, std::int64_t begin, std::int64_t end) {
    const auto bytes = static_cast<std::size_t>(ITEM > 0 ? ITEM : t.item_bytes);
    for (std::int64_t i = begin; i < end; ++i) {
        const std::int64_t s = t.src_idx[i], d = t.dst_idx[i];
        if (!slot_ok(s, t.src.num_slots) || !slot_ok(d, t.dst.num_slots)) {
            if (t.oob != nullptr) *t.oob = 1u;
            continue;
        }
        // The slot's page/token split once per pair, then one multiply-add per item.
        const SlotBase sb = slot_base(t.src, s, t.page_size), db = slot_base(t.dst, d, t.page_size);
        for (std::int64_t kv = 0; kv < t.num_kv; ++kv) {
            for (std::int64_t l = t.layer_begin; l < t.layer_begin + t.layer_count; ++l) {
                std::memcpy(reinterpret_cast<void *>(item_address(t.dst, db, kv, l)),
                            reinterpret_cast<const void *>(item_address(t.src, sb, kv, l)), bytes);
            }
        }
    }
}

static void copy_any(const Transfer &t, std::int64_t begin, std::int64_t end) {
    switch (t.item_bytes) {
        case 512: return copy_range<512>(t, begin, end);
        case 1024: return copy_range<1024>(t, begin, end);
        case 1152: return copy_range<1152>(t, begin, end);
        case 2048: return copy_range<2048>(t, begin, end);
        case 4096: return copy_range<4096>(t, begin, end);
        default: return copy_range<0>(t, begin, end);
    }
}

void transfer_cpu(const Transfer &t, int num_threads) {
    // Threads only pay off once each has a few hundred KiB to move.
    const std::int64_t bytes = t.n * t.num_kv * t.layer_count * t.item_bytes;
    std::int64_t workers = std::max<std::int64_t>(1, std::min<std::int64_t>(num_threads, bytes >> 19));
    workers = std::min<std::int64_t>(workers, std::max<std::int64_t>(1, t.n));
    if (workers == 1) {
        copy_any(t, 0, t.n);
        return;
    }
    std::vector<std::thread> pool;
    const std::int64_t per = (t.n + workers - 1) / workers;
    for (std::int64_t w = 0; w < workers; ++w) {
        const std::int64_t b = w * per, e = std::min(t.n, b + per);
        if (b < e) pool.emplace_back(copy_any, std::cref(t), b, e);
    }
    for (auto &th : pool) th.join();
}

}  // namespace pointerdomain
