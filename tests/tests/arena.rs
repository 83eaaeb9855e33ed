//! The driver's DMA arena: queue rings and doorbell records come from a few large memory
//! files, so file descriptors and device mappings stay in proportion to the memory used, not
//! to the number of queues, and empty chunks are given back. (Sizes, alignment and zeroed
//! reuse are unit-tested in `driver/src/device.rs`.)

use ringbell::*;
use ringbell_emu::{Fabric, FabricConfig};

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

#[test]
fn many_queues_cost_a_few_mappings_and_are_given_back() {
    let f = Fabric::new(FabricConfig::new(1, 1));
    let dev = Device::open(Box::new(f.port(0))).unwrap();
    let pd = dev.alloc_pd().unwrap();
    let cq = dev.create_cq(64).unwrap();
    let (maps0, fds0) = (f.dma_mappings(0), open_fds());
    let mut qps = Vec::new();
    for _ in 0..300 {
        let mut init = QpInit::new(&cq, &cq);
        init.max_send_wr = 16;
        init.max_recv_wr = 16;
        qps.push(pd.create_qp(&init).unwrap());
    }
    let (chunks, blocks) = dev.arena_usage();
    assert_eq!(
        blocks,
        300 * 3 + 2,
        "SQ, RQ and doorbell record of each QP, and the CQ's two"
    );
    let maps = f.dma_mappings(0) - maps0;
    let fds = open_fds().saturating_sub(fds0);
    // 300 QPs used to take 900 mappings and 900 descriptors.
    assert!(
        maps <= chunks && chunks <= 8,
        "{maps} mappings, {chunks} chunks"
    );
    assert!(fds <= 8, "{fds} descriptors");
    drop(qps);
    let (chunks_after, blocks_after) = dev.arena_usage();
    assert_eq!(blocks_after, 2, "only the CQ's blocks are in use");
    assert!(
        chunks_after <= 2,
        "empty chunks are released: {chunks_after}"
    );
    assert!(f.dma_mappings(0) - maps0 <= 2);
}
