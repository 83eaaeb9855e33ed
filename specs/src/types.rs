//! Newtypes for the integers of the field: queue pair numbers, packet sequence numbers,
//! memory keys, I/O virtual addresses and simulated time.

use core::fmt;
use core::ops::{Add, Sub};

/// A 24-bit queue pair number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Qpn(u32);

impl Qpn {
    /// Largest representable QPN.
    pub const MAX: u32 = 0x00FF_FFFF;
    /// Builds a QPN, rejecting values wider than 24 bits.
    pub const fn new(v: u32) -> Option<Qpn> {
        if v <= Self::MAX {
            Some(Qpn(v))
        } else {
            None
        }
    }
    /// Builds a QPN from the low 24 bits of `v`.
    pub const fn from_bits(v: u32) -> Qpn {
        Qpn(v & Self::MAX)
    }
    /// The numeric value.
    pub const fn get(self) -> u32 {
        self.0
    }
}

impl fmt::Display for Qpn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#08x}", self.0)
    }
}

/// A 24-bit packet sequence number with wrapping arithmetic.
///
/// There is deliberately no `Ord`: PSNs compare only relative to a window, through
/// [`Psn::diff`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Psn(u32);

impl Psn {
    /// Mask of the 24 PSN bits.
    pub const MASK: u32 = 0x00FF_FFFF;
    /// Builds a PSN from the low 24 bits of `v`.
    pub const fn new(v: u32) -> Psn {
        Psn(v & Self::MASK)
    }
    /// The numeric value.
    pub const fn get(self) -> u32 {
        self.0
    }
    /// `self + n`, wrapping at 2^24.
    pub const fn add(self, n: u32) -> Psn {
        Psn::new(self.0.wrapping_add(n))
    }
    /// Signed distance `self - other` in the range -2^23..2^23.
    pub const fn diff(self, other: Psn) -> i32 {
        let d = self.0.wrapping_sub(other.0) & Self::MASK;
        ((d << 8) as i32) >> 8
    }
}

impl fmt::Display for Psn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A local memory key, named by the device at REG_MR.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Lkey(pub u32);

/// A remote memory key, named by the device at REG_MR.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Rkey(pub u32);

/// An I/O virtual address: what the device puts on the bus, translated by the IOMMU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Iova(pub u64);

/// Simulated time in integer picoseconds since the simulation started.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct SimTime(pub u64);

impl SimTime {
    /// Time zero.
    pub const ZERO: SimTime = SimTime(0);
    /// `ns` nanoseconds.
    pub const fn from_ns(ns: u64) -> SimTime {
        SimTime(ns * 1000)
    }
    /// Picoseconds.
    pub const fn ps(self) -> u64 {
        self.0
    }
    /// Whole nanoseconds (truncated).
    pub const fn as_ns(self) -> u64 {
        self.0 / 1000
    }
    /// Microseconds as a float, for display only.
    pub fn as_us_f64(self) -> f64 {
        self.0 as f64 / 1e6
    }
}

impl Add for SimTime {
    type Output = SimTime;
    fn add(self, rhs: SimTime) -> SimTime {
        SimTime(self.0.saturating_add(rhs.0))
    }
}

impl Sub for SimTime {
    type Output = SimTime;
    fn sub(self, rhs: SimTime) -> SimTime {
        SimTime(self.0.saturating_sub(rhs.0))
    }
}

impl fmt::Display for SimTime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{:03} ns", self.0 / 1000, self.0 % 1000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn psn_diff_inverts_add(a in 0u32..=Psn::MASK, n in 0u32..(1 << 23)) {
            let p = Psn::new(a);
            prop_assert_eq!(p.add(n).diff(p), n as i32);
            prop_assert_eq!(p.diff(p.add(n)), -(n as i32));
        }
    }

    #[test]
    fn qpn_rejects_wide_values() {
        assert!(Qpn::new(1 << 24).is_none());
        assert_eq!(Qpn::from_bits(0x0123_4567).get(), 0x23_4567);
    }
}
