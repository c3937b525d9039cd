// Item addressing shared by the CPU and GPU transfer kernels.
//
// A KV buffer is addressed through a pointer table whose entries cover the
// leading dimensions of the layout; the remaining dimensions are byte offsets:
//   entry = kv*e_kv + layer*e_layer + page*e_page
//   addr  = table[entry] + kv*s_kv + layer*s_layer + page*s_page + tok*s_tok
// Python (pointerdomain.layouts) derives these numbers and checks that every
// address stays inside the entry's buffer; the kernels only move bytes.
//
// The formula is split in two so that a kernel pays for the slot's page/token
// split (a division) once per slot pair and steps through the (kv, layer) items
// with multiply-adds only: slot_base() holds the slot's part of the entry and of
// the offset, item_entry() / item_offset() add the (kv, layer) part. The CPU
// reference and every GPU kernel variant call these same functions.
#pragma once
#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define PD_HD __host__ __device__ __forceinline__
#else
#define PD_HD inline
#endif

namespace pointerdomain {

struct Side {
    const std::uint64_t *table;  // entries: device aliases (or emulated aliases on CPU)
    std::int64_t e_kv, e_layer, e_page;
    std::int64_t s_kv, s_layer, s_page, s_tok;
    std::int64_t num_slots;  // valid slot indices are [0, num_slots)
};

struct Transfer {
    Side src, dst;
    const std::int64_t *src_idx;  // token slots, int64
    const std::int64_t *dst_idx;
    std::int64_t n;           // number of slot pairs
    std::int64_t page_size;   // tokens per page
    std::int64_t num_kv;      // 2 for MHA (K and V), 1 for MLA
    std::int64_t layer_begin, layer_count;
    std::int64_t item_bytes;  // bytes per (kv, layer, token)
    // Nullable. Bit kOutOfRange is set (atomic or) by a kernel that skipped a slot pair for
    // being out of range, bit kDuplicate by the validation pass below; Python reads the word
    // to raise IndexValidationError / OverlapError later.
    std::uint32_t *oob;
    // Nullable: the duplicate-destination check. Scratch of marks_words(dst.num_slots) words
    // that a validation pass, before the copy, zeroes and then marks with one bit per
    // destination slot (slots out of range are not marked); a slot marked twice sets word 0
    // and kDuplicate in *oob, and the copy then writes nothing at all. The scratch must not
    // be used by two launches at once (the GPU launcher is given one per stream).
    std::uint32_t *marks = nullptr;
};

constexpr std::uint32_t kOutOfRange = 1u;  // error word bits (pointerdomain.transfer.launch_errors)
constexpr std::uint32_t kDuplicate = 2u;

// Scratch words for the duplicate check of a destination of `num_slots` slots: the abort
// flag, then a bit per slot.
PD_HD std::int64_t marks_words(std::int64_t num_slots) { return 1 + (num_slots + 31) / 32; }

// The slot's share of an item address: page*e_page of the entry, page*s_page +
// tok*s_tok of the offset. Needs slot >= 0 (slot_ok) and page_size > 0.
struct SlotBase {
    std::int64_t entry, offset;
};

PD_HD SlotBase slot_base(const Side &s, std::int64_t slot, std::int64_t page_size) {
    std::int64_t page, tok;
    if ((static_cast<std::uint64_t>(slot) | static_cast<std::uint64_t>(page_size)) >> 32 == 0) {
        // 32-bit division where the operands fit (always in practice): a 64-bit one is a
        // long instruction sequence on the GPU.
        const auto s32 = static_cast<std::uint32_t>(slot), p32 = static_cast<std::uint32_t>(page_size);
        const std::uint32_t q = s32 / p32;
        page = q;
        tok = s32 - q * p32;
    } else {
        page = slot / page_size;
        tok = slot - page * page_size;
    }
    return SlotBase{page * s.e_page, page * s.s_page + tok * s.s_tok};
}

PD_HD std::int64_t item_entry(const Side &s, const SlotBase &b, std::int64_t kv, std::int64_t layer) {
    return b.entry + kv * s.e_kv + layer * s.e_layer;
}

PD_HD std::uint64_t item_offset(const Side &s, const SlotBase &b, std::int64_t kv, std::int64_t layer) {
    return static_cast<std::uint64_t>(b.offset + kv * s.s_kv + layer * s.s_layer);
}

PD_HD std::uint64_t item_address(const Side &s, const SlotBase &b, std::int64_t kv, std::int64_t layer) {
    return s.table[item_entry(s, b, kv, layer)] + item_offset(s, b, kv, layer);
}

PD_HD std::uint64_t item_address(const Side &s, std::int64_t kv, std::int64_t layer, std::int64_t slot,
                                 std::int64_t page_size) {
    return item_address(s, slot_base(s, slot, page_size), kv, layer);
}

// A slot outside [0, num_slots) is skipped: Python rejects it before launch, and
// this check keeps a graph-replayed launch with bad indices from touching memory.
PD_HD bool slot_ok(std::int64_t slot, std::int64_t num_slots) {
    return slot >= 0 && slot < num_slots;
}

// CPU reference implementation (transfer_cpu.cpp).
void transfer_cpu(const Transfer &t, int num_threads);
// The layer pipeline on the CPU (the emulated device): t's layers in order, and after
// layer l is copied, gen stored (release) to flags[l - t.layer_begin].
void transfer_cpu_layers(const Transfer &t, std::uint32_t *flags, std::uint32_t gen, int num_threads);

}  // namespace pointerdomain
