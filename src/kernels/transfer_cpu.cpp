#include "transfer.h"

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace pointerdomain {

// Transfers of at least this many bytes store with non-temporal (streaming) stores:
// scattered 1 KiB memcpy stores each read their destination line first (read for
// ownership), so a large gather/scatter moved 0.4-0.5 x the bytes of one contiguous
// memcpy (which streams); streaming the items gives 0.7-0.9 x (docs/performance.md).
// Below this size the destination may stay in cache and plain copies are faster.
constexpr std::int64_t kStreamBytes = std::int64_t{8} << 20;

// One item: streaming 16-byte stores where the item is whole 64-byte lines of a
// 16-byte aligned destination, else memcpy.
static inline void copy_item(void *dst, const void *src, std::size_t bytes, bool stream) {
#if defined(__SSE2__)
    if (stream && bytes % 64 == 0 && reinterpret_cast<std::uintptr_t>(dst) % 16 == 0) {
        auto *d = static_cast<__m128i *>(dst);
        const auto *s = static_cast<const __m128i *>(src);
        for (std::size_t k = 0; k < bytes / 16; k += 4) {
            const __m128i a = _mm_loadu_si128(s + k), b = _mm_loadu_si128(s + k + 1);
            const __m128i c = _mm_loadu_si128(s + k + 2), e = _mm_loadu_si128(s + k + 3);
            _mm_stream_si128(d + k, a);
            _mm_stream_si128(d + k + 1, b);
            _mm_stream_si128(d + k + 2, c);
            _mm_stream_si128(d + k + 3, e);
        }
        return;
    }
#else
    (void)stream;
#endif
    std::memcpy(dst, src, bytes);
}

// ITEM > 0: the item size as a compile-time constant, so memcpy becomes inline vector
// moves instead of a library call per item (1 KiB items are the common case).
template <std::int64_t ITEM>
static void copy_range(const Transfer &t, std::int64_t begin, std::int64_t end, bool stream) {
    const auto bytes = static_cast<std::size_t>(ITEM > 0 ? ITEM : t.item_bytes);
    for (std::int64_t i = begin; i < end; ++i) {
        const std::int64_t s = t.src_idx[i], d = t.dst_idx[i];
        if (!slot_ok(s, t.src.num_slots) || !slot_ok(d, t.dst.num_slots)) {
            if (t.oob != nullptr) __atomic_fetch_or(t.oob, kOutOfRange, __ATOMIC_RELAXED);
            continue;
        }
        // The slot's page/token split once per pair, then one multiply-add per item.
        const SlotBase sb = slot_base(t.src, s, t.page_size), db = slot_base(t.dst, d, t.page_size);
        for (std::int64_t kv = 0; kv < t.num_kv; ++kv) {
            for (std::int64_t l = t.layer_begin; l < t.layer_begin + t.layer_count; ++l) {
                copy_item(reinterpret_cast<void *>(item_address(t.dst, db, kv, l)),
                          reinterpret_cast<const void *>(item_address(t.src, sb, kv, l)), bytes, stream);
            }
        }
    }
#if defined(__SSE2__)
    if (stream) _mm_sfence();  // streaming stores are weakly ordered: drain them before returning
#endif
}

static void copy_any(const Transfer &t, std::int64_t begin, std::int64_t end, bool stream) {
    switch (t.item_bytes) {
        case 512: return copy_range<512>(t, begin, end, stream);
        case 1024: return copy_range<1024>(t, begin, end, stream);
        case 1152: return copy_range<1152>(t, begin, end, stream);
        case 2048: return copy_range<2048>(t, begin, end, stream);
        case 4096: return copy_range<4096>(t, begin, end, stream);
        default: return copy_range<0>(t, begin, end, stream);
    }
}

// The validation pass of the duplicate check (Transfer::marks), as the GPU runs it: false
// when a destination slot is given twice (the launch then copies nothing).
static bool destinations_distinct(const Transfer &t) {
    std::memset(t.marks, 0, static_cast<std::size_t>(marks_words(t.dst.num_slots)) * sizeof(std::uint32_t));
    std::uint32_t *bits = t.marks + 1;
    for (std::int64_t i = 0; i < t.n; ++i) {
        const std::int64_t d = t.dst_idx[i];
        if (!slot_ok(d, t.dst.num_slots)) continue;  // the copy skips and reports it
        const std::uint32_t bit = 1u << (d & 31);
        if (bits[d >> 5] & bit) {
            t.marks[0] = 1u;
            if (t.oob != nullptr) __atomic_fetch_or(t.oob, kDuplicate, __ATOMIC_RELAXED);
            return false;
        }
        bits[d >> 5] |= bit;
    }
    return true;
}

void transfer_cpu(const Transfer &t, int num_threads) {
    if (t.marks != nullptr && t.n > 1 && !destinations_distinct(t)) return;
    // Threads only pay off once each has a few hundred KiB to move.
    const std::int64_t bytes = t.n * t.num_kv * t.layer_count * t.item_bytes;
    std::int64_t workers = std::max<std::int64_t>(1, std::min<std::int64_t>(num_threads, bytes >> 19));
    workers = std::min<std::int64_t>(workers, std::max<std::int64_t>(1, t.n));
    const bool stream = bytes >= kStreamBytes;
    if (workers == 1) {
        copy_any(t, 0, t.n, stream);
        return;
    }
    std::vector<std::thread> pool;
    const std::int64_t per = (t.n + workers - 1) / workers;
    for (std::int64_t w = 0; w < workers; ++w) {
        const std::int64_t b = w * per, e = std::min(t.n, b + per);
        if (b < e) pool.emplace_back(copy_any, std::cref(t), b, e, stream);
    }
    for (auto &th : pool) th.join();
}

void transfer_cpu_layers(const Transfer &t, std::uint32_t *flags, std::uint32_t gen, int num_threads) {
    Transfer one = t;
    one.layer_count = 1;
    for (std::int64_t l = 0; l < t.layer_count; ++l) {
        one.layer_begin = t.layer_begin + l;
        transfer_cpu(one, num_threads);  // its threads are joined: the layer's bytes are all written
        __atomic_store_n(flags + l, gen, __ATOMIC_RELEASE);
    }
}

}  // namespace pointerdomain
