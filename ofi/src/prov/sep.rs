//! Scalable endpoints (`fi_scalable_ep`, fi_scalable_ep(3)): one address, several transmit
//! and receive contexts, each context an endpoint of its own with its own queues.
//!
//! The scalable endpoint holds the address, the AV (`fi_scalable_ep_bind`) and the
//! listener of its service number. A transmit context (`fi_tx_context`) sends: its
//! connections are made as an RDM endpoint's are, the REQ's private data naming the
//! scalable endpoint's address marked [`TX_ONLY`] (the passive side never sends back over
//! such a connection: replies go to a receive context) and the receive context it is for.
//! A receive context (`fi_rx_context`) receives: a connection request for context `i` of
//! the service gets a QP on context `i`'s SRQ.
//!
//! Receive contexts are named by address (`FI_NAMED_RX_CTX`): `fi_rx_addr(addr, i, bits)`
//! puts `i` in the top `bits` bits of an AV index, where `bits` is the AV's `rx_ctx_bits`;
//! the provider carries `i` in byte 3 of the 16-byte address it connects to ([`with_rx`]),
//! so that each (peer, context) pair has a connection of its own. Any endpoint may send
//! to a named receive context; an address without one names context 0.

use super::*;

/// Most transmit or receive contexts of one scalable endpoint (`max_ep_tx_ctx`,
/// `max_ep_rx_ctx`).
pub const MAX_EP_CTX: usize = 16;

/// Byte 3 of an address that a transmit context gives as its own in a connection request:
/// the connection only carries messages to the passive side.
pub const TX_ONLY: u8 = 0xFF;

/// What part of a scalable endpoint an endpoint object is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sep {
    /// The scalable endpoint itself, with its number of transmit and receive contexts: no
    /// data transfers of its own.
    Root { tx: usize, rx: usize },
    /// Transmit context `index` of scalable endpoint `sep`: sends only.
    Tx { sep: usize, index: usize },
    /// Receive context `index` of scalable endpoint `sep`: receives only.
    Rx { sep: usize, index: usize },
}

/// Address `a` naming receive context `rx` of its endpoint.
pub fn with_rx(mut a: Addr, rx: u8) -> Addr {
    a[3] = rx;
    a
}

/// Address `a` without a receive context or transmit mark: the endpoint's own.
pub fn base(a: &Addr) -> Addr {
    with_rx(*a, 0)
}

/// Splits `fi_addr` of an AV with `rx_ctx_bits` bits into (AV index, receive context)
/// (fi_av(3), `fi_rx_addr`). `FI_ADDR_UNSPEC` is no address.
pub fn split_rx(fi_addr: u64, bits: u32) -> (u64, u64) {
    if bits == 0 || bits >= 64 || fi_addr == ADDR_UNSPEC {
        return (fi_addr, 0);
    }
    let shift = 64 - bits;
    (fi_addr & ((1u64 << shift) - 1), fi_addr >> shift)
}

impl State {
    /// Context `index` of scalable endpoint `sep` (`fi_tx_context` when `!rx`, else
    /// `fi_rx_context`): an endpoint of the scalable endpoint's domain and address.
    /// `-FI_EINVAL` for an object that is no scalable endpoint, an index beyond its
    /// contexts, or one already open.
    pub fn new_sep_ctx(&mut self, sep: usize, index: usize, rx: bool) -> Result<Ep, Errno> {
        let (dom, format, addr, service, count, tx_flags, rx_flags) = match self.objs.get(&sep) {
            Some(Obj::Ep(e)) => match e.sep {
                Some(Sep::Root { tx, rx: r }) => (
                    e.domain,
                    e.format,
                    e.addr,
                    e.service,
                    if rx { r } else { tx },
                    e.tx_op_flags,
                    e.rx_op_flags,
                ),
                _ => return Err(EINVAL),
            },
            _ => return Err(EINVAL),
        };
        if index >= count {
            return Err(EINVAL);
        }
        let open = self.objs.values().any(|o| {
            matches!(o, Obj::Ep(e) if match e.sep {
                Some(Sep::Tx { sep: s, index: i }) => !rx && s == sep && i == index,
                Some(Sep::Rx { sep: s, index: i }) => rx && s == sep && i == index,
                _ => false,
            })
        });
        if open {
            return Err(EINVAL);
        }
        // The context's address is its endpoint's; a transmit context's is marked so that
        // peers do not send back over its connections.
        let mut e = self.new_ep(dom, Some(service), false, format)?;
        e.named = false;
        e.addr = if rx { addr } else { with_rx(addr, TX_ONLY) };
        e.tx_op_flags = tx_flags;
        e.rx_op_flags = rx_flags;
        e.sep = Some(if rx {
            Sep::Rx { sep, index }
        } else {
            Sep::Tx { sep, index }
        });
        Ok(e)
    }

    /// The AV endpoint `ep` resolves addresses with: its own, or a context's scalable
    /// endpoint's.
    pub(crate) fn ep_av(&self, ep: usize) -> Option<usize> {
        let e = self.objs_ep(ep).ok()?;
        match e.sep {
            Some(Sep::Tx { sep, .. } | Sep::Rx { sep, .. }) => self.objs_ep(sep).ok()?.av,
            _ => e.av,
        }
    }

    /// Whether endpoint `ep` may transmit (`tx`) or receive: a scalable endpoint does
    /// neither (its contexts do), a transmit context does not receive, a receive context
    /// does not transmit (`-FI_ENOSYS`, as for an operation the object does not have).
    pub(crate) fn sep_allows(&self, ep: usize, tx: bool) -> Result<(), Errno> {
        match self.objs_ep(ep)?.sep {
            Some(Sep::Root { .. }) => Err(abi::FI_ENOSYS),
            Some(Sep::Tx { .. }) if !tx => Err(abi::FI_ENOSYS),
            Some(Sep::Rx { .. }) if tx => Err(abi::FI_ENOSYS),
            _ => Ok(()),
        }
    }

    /// The receive endpoint of NIC `nic` that a connection request for `service` and
    /// receive context `rx` reaches: an enabled RDM endpoint listening on `service` (for
    /// context 0), or receive context `rx` of the scalable endpoint that does, or the
    /// connected endpoint whose tagged channel does.
    pub(crate) fn rx_target(&self, nic: usize, service: u64, rx: u8) -> Option<usize> {
        self.objs.iter().find_map(|(&k, o)| match o {
            // A connected endpoint's tagged channel.
            Obj::Ep(e)
                if e.enabled
                    && e.nic == nic
                    && rx == 0
                    && e.msg.as_ref().and_then(|m| m.tag_service) == Some(service) =>
            {
                Some(k)
            }
            Obj::Ep(e) if e.enabled && e.nic == nic && e.service == service => match e.sep {
                None if rx == 0 => Some(k),
                Some(Sep::Rx { sep, index }) if index == usize::from(rx) => {
                    // Only while its scalable endpoint listens.
                    matches!(self.objs.get(&sep), Some(Obj::Ep(s)) if s.enabled).then_some(k)
                }
                _ => None,
            },
            _ => None,
        })
    }

    /// `fi_enable` of a scalable endpoint: it needs its AV, and listens on its number
    /// (published when it is the application's); its contexts are enabled on their own.
    pub(crate) fn enable_sep(&mut self, ep: usize) -> Result<(), Errno> {
        let (nic, service, named) = {
            let e = self.objs_ep(ep)?;
            if e.av.is_none() {
                return Err(abi::FI_ENOAV);
            }
            (e.nic, e.service, e.named)
        };
        self.listen_on(nic, service)?;
        if named {
            names::publish(service, nic, None);
        }
        self.ep_mut(ep)?.enabled = true;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_rx_address_splits_into_its_index_and_context() {
        // fi_rx_addr(5, 3, 2) = 3 << 62 | 5.
        assert_eq!(split_rx((3 << 62) | 5, 2), (5, 3));
        assert_eq!(split_rx(5, 2), (5, 0));
        // Without rx_ctx_bits the whole value is the index.
        assert_eq!(split_rx((3 << 62) | 5, 0), ((3 << 62) | 5, 0));
        assert_eq!(split_rx(ADDR_UNSPEC, 2), (ADDR_UNSPEC, 0));
    }

    #[test]
    fn a_context_is_named_in_byte_3_and_its_base_is_the_endpoint() {
        let a = make_addr([10, 0, 0, 1], 9228);
        let r = with_rx(a, 2);
        assert_ne!(r, a);
        assert_eq!(parse_addr(&r), parse_addr(&a));
        assert_eq!(base(&r), a);
        assert_eq!(base(&with_rx(a, TX_ONLY)), a);
    }
}
