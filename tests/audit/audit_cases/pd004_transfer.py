# Cases for PD004 (transfer calls fed ints).
from mooncake.engine import TransferEngine
from nixl._api import nixl_agent


def xfer(t, peer, remote, n, bufs, remotes, lens, wrapped, info, remote_info):
    engine = TransferEngine()
    engine.transfer_sync_read(peer, t.data_ptr(), remote, n)  # expect[PD004]
    engine.batch_transfer_sync_write(peer, bufs, remotes, lens)  # expect[PD004]
    agent = nixl_agent("a")
    descs = agent.get_xfer_descs([(t.data_ptr(), n, 0)], "DRAM")  # expect[PD004]
    agent.register_memory([(t.data_ptr(), n, 0, "")], "DRAM")  # expect[PD004]
    # negatives
    agent.get_xfer_descs(t, "VRAM")
    wrapped.transfer_sync_read(peer, info, remote_info)
    return descs
