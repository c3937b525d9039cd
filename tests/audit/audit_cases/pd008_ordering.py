# Cases for PD008: addresses used only to order or identify (bisect, heapq, an LRU, a hash, a sort
# key) or written into a log record are no address use; the same values handed to native code are.
import bisect
import heapq
import logging
from bisect import insort
from collections import OrderedDict
from heapq import heappush as push

from some_ext import ops

logger = logging.getLogger(__name__)


class Registry:
    def __init__(self):
        self.starts = []
        self.heap = []
        self.lru = OrderedDict()

    def lookup(self, t):
        i = bisect.bisect_right(self.starts, t.data_ptr())  # negative: a range look-up
        insort(self.starts, t.data_ptr())  # negative: a sorted index
        heapq.heappush(self.heap, (t.data_ptr(), t.numel()))  # negative: a priority
        push(self.heap, (t.data_ptr(), 0))  # negative: the same, imported under another name
        self.lru.move_to_end(t.data_ptr())  # negative: an LRU order
        return i

    def order(self, ts):
        ts.sort(key=lambda t: t.data_ptr())  # negative: a sort key
        return sorted(ts, key=self._by_address)

    def _by_address(self, t):
        return t.data_ptr()  # negative: used as a sort key

    def _address_of(self, t):
        return t.data_ptr()  # expect[PD008]

    def record(self, t, off):
        logger.info("alloc", extra={"ptr": t.data_ptr(), "n": t.numel()})  # negative: a log record
        logging.getLogger("pool").debug("alloc %x", t.data_ptr() + off, extra={"end": t.data_ptr() + t.nbytes})
        self.log.warning("freed %#x", t.data_ptr())  # negative
        ops.record({"ptr": t.data_ptr()})  # expect[PD002]
        self.catalog.info({"ptr": t.data_ptr()})  # expect[PD002]: a catalog, not a logger

    def native_order(self, t):
        ops.heappush(self.heap, t.data_ptr())  # expect[PD008]


class Key:
    def __init__(self, t):
        self.t = t

    def __hash__(self):
        return self.t.data_ptr()  # negative: identity


def smallest(ts):
    return heapq.nsmallest(2, ts, key=_addr)


def _addr(t):
    return t.data_ptr()  # negative: a key function
