# Negative cases: what looks like an address site and is not one (PD002, PD004).
import ctypes

from nixl._api import nixl_agent


def identity(tensors, a, b, stride):
    seen = set()
    for t in tensors:
        seen.add(t.data_ptr())  # negative: an identity set, never dereferenced
    unique = {t.data_ptr() for t in tensors}  # negative: an identity set
    assert b.data_ptr() - a.data_ptr() == stride  # negative: a test's stride check
    ordered = [t.data_ptr() for t in tensors]  # expect[PD002] a list, in table order
    return seen, unique, ordered


class Check:
    def test_views(self, a, b, n):
        self.assertEqual(b.data_ptr(), a.data_ptr() + n)  # negative: a test assertion


def files(fd, size, keys):
    agent = nixl_agent("a")
    file_list = [(0, size, fd, "b.bin")]
    agent.register_memory(file_list, "FILE")  # negative: (offset, len, fd) descriptors
    agent.get_xfer_descs([(0, size, fd)], "FILE")  # negative
    kind = "OBJ"
    agent.get_xfer_descs([(0, size, k) for k in keys], mem_type=kind)  # negative


def malformed_lists(agent):
    bad_list = [(1, 2, 3)]
    return agent.get_reg_descs(bad_list, "DRAM")  # negative: literal ints, an API test of bad input


def offsets_and_ranges(q, k, parts, lo, hi, es):
    k_off = (k.data_ptr() - q.data_ptr()) // es  # negative: an offset between two views
    inside = all(lo <= p.data_ptr() and p.data_ptr() + p.nbytes <= hi for p in parts)  # negative: a range check
    sources = tuple((w, w.data_ptr(), w._version) for w in parts)  # negative: identity keys
    return k_off, inside, sources


import cutlass.cute as cute  # noqa: E402


@cute.jit
def dsl_device(storage, idx):
    ptr = storage.buf.data_ptr()
    (ptr + idx).store(0)  # negative: a typed DSL pointer


def lengths(engine, src_list, dst_list, len_list, block_ids, block_len, state, start_addr):
    for src, dst, n in zip(src_list, dst_list, len_list):
        length = len(block_ids) * n  # negative: n is a length, not an address
    byte_offset = start_addr - state.data_ptr()  # negative: an offset
    return length, byte_offset


def identity_snapshots(graph_entry, args, layer):
    # addresses kept only to check that the inputs did not move: never dereferenced
    input_addresses = [x.data_ptr() for x in args]
    graph_entry.input_addresses = input_addresses
    new_input_addresses = [x.data_ptr() for x in args]
    assert new_input_addresses == graph_entry.input_addresses
    original = {name: getattr(layer, name).data_ptr() for name in ("weight", "bias")}
    if layer.weight.data_ptr() != original["weight"]:
        raise RuntimeError("moved")
    table = [x.data_ptr() for x in args]  # expect[PD002] read outside a comparison
    if table == input_addresses:
        return table
    return None


def offsets_and_keys(tensor, arena, weights, seen, page):
    storage = tensor.untyped_storage()
    ptr = storage.data_ptr()
    start = ptr & ~(page - 1)
    length = (ptr + storage.nbytes()) - start  # negative: a length from the page-aligned start
    offset = tensor.data_ptr() - arena.base  # negative: an offset from a base of another module
    key = tuple(w.data_ptr() for w in weights)  # negative: a cache key
    seen.append((tensor.shape[1], storage.data_ptr()))  # negative: a tensor's identity
    moved = ptr + page  # expect[PD002]
    mapped = arena.mc_base + (ptr - arena.base)  # expect[PD002] the address moved into another mapping
    return length, offset, key, moved, mapped  # expect[PD008] the address leaves in a tuple


def tensor_binding_signature(bindings):
    return tuple(tensor.data_ptr() for tensor in bindings)  # negative: a key of captured graphs


class DslTensor:
    def __c_pointers__(self):
        self._desc = ctypes.c_void_p(int(self._pointer))
        return [ctypes.addressof(self._desc)]  # negative: the CuTe DSL argument protocol
