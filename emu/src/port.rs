//! The in-process `Port`: register access, DMA mapping and progress on one fabric node.

use crate::fabric::Shared;
use ringbell::{Port, PortError};
use std::os::fd::BorrowedFd;

/// A driver's connection to node `node` of a [`crate::Fabric`].
#[derive(Debug, Clone)]
pub struct EmuPort {
    pub(crate) shared: Shared,
    pub(crate) node: usize,
}

impl EmuPort {
    /// The node this port reaches.
    pub fn node(&self) -> usize {
        self.node
    }
}

impl Port for EmuPort {
    fn read32(&self, offset: u64) -> u32 {
        self.shared.borrow_mut().mmio_read(self.node, offset)
    }

    fn write32(&self, offset: u64, value: u32) {
        self.shared
            .borrow_mut()
            .mmio_write(self.node, offset, value)
    }

    fn write_block(&self, offset: u64, data: &[u8]) {
        self.shared
            .borrow_mut()
            .mmio_write_block(self.node, offset, data)
    }

    fn dma_map(&self, fd: BorrowedFd<'_>, len: u64, iova: u64) -> Result<(), PortError> {
        self.shared.borrow_mut().nodes[self.node]
            .iommu
            .map(fd, len, iova)
    }

    fn dma_unmap(&self, iova: u64, len: u64) -> Result<(), PortError> {
        self.shared.borrow_mut().nodes[self.node]
            .iommu
            .unmap(iova, len)
    }

    fn progress(&self) -> bool {
        self.shared.borrow_mut().step()
    }

    fn lockstep(&self) -> bool {
        true
    }

    fn map_process(&self) -> Result<(), PortError> {
        self.shared.borrow_mut().nodes[self.node]
            .iommu
            .map_process(ringbell::HOST_IOVA_OFFSET);
        Ok(())
    }

    fn idle_until(&self, clock_ps: u64) {
        self.shared
            .borrow_mut()
            .idle_until(ringbell_specs::SimTime(clock_ps));
    }
}
