# Cases for PD002 (data_ptr() arithmetic and collections).
def arith(host, idx, copy_size, other, f):
    src = host.data_ptr() + 2 * copy_size * idx  # expect[PD002]
    base = host.data_ptr()
    end = base + host.numel()  # expect[PD002]
    table = {}
    table["k"] = host.data_ptr()  # expect[PD002]
    out = []
    out.append(host.data_ptr())  # expect[PD002]
    d = {name: t.data_ptr() for name, t in host.items()}  # expect[PD002]
    descs = [(t.data_ptr(), t.nbytes) for t in host]  # expect[PD002]
    off = base
    off += 4096  # expect[PD002]
    # negatives: ints that are not addresses, a bare address passed on, a comparison
    n = host.numel() + 1
    p = host.data_ptr()
    f(p)
    same = host.data_ptr() == other.data_ptr()
    slack = base % 4096  # negative: an alignment check
    counts = [t.numel() for t in host]
    return src, end, table, out, d, descs, off, n, same, counts  # expect[PD008] addresses returned as ints


class Pool:
    def __init__(self, buf):
        self.base = buf.data_ptr()

    def page_addr(self, page, page_bytes):
        return self.base + page * page_bytes  # expect[PD002]

    def size(self, page_bytes):
        return self.count * page_bytes  # negative
