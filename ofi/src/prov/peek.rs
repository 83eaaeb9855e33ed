//! `fi_trecvmsg` with `FI_PEEK`, `FI_CLAIM` and `FI_DISCARD` (fi_tagged(3)), and
//! `fi_cancel` of tagged receives (fi_endpoint(3)), over the provider's software matching:
//! the messages a peek can find are the endpoint's unexpected ones (announced, not yet
//! matched by a posted receive).
//!
//! - `FI_PEEK`: the earliest unexpected message the receive would take completes the peek
//!   with its length, tag, CQ data and source (no data: `buf` is NULL, which fi_tagged(3)
//!   allows); none is an error entry `FI_ENOMSG`. The message stays unexpected.
//! - `FI_PEEK|FI_CLAIM`: as a peek, and the message found is set aside for the receive
//!   that passes the same context with `FI_CLAIM`; no other receive can take it.
//! - `FI_CLAIM`: receives the message claimed with this context into the buffers (as a
//!   posted receive that matched it). No message claimed with it: `-FI_EINVAL`.
//! - `FI_DISCARD` with `FI_PEEK` (a message found) or with `FI_CLAIM` (the claimed one):
//!   the message is dropped (its sender's send completes); the peek completes as above
//!   (with the message's length), the claim with length 0. `FI_DISCARD` alone is
//!   `-FI_EINVAL`.
//! - `fi_cancel`: a tagged receive still waiting for a message is removed and completes as
//!   an error entry `FI_ECANCELED`; a claimed message waiting for its `FI_CLAIM` receive is
//!   given back to the unexpected queue. Anything else (a receive that already matched, an
//!   untagged receive, which sits on the NIC's receive queue, or an unknown context) is left
//!   to complete as it will; `fi_cancel` returns 0 either way (fi_endpoint(3)).

use super::{Addr, Ctl, Entry, Errno, Rts, State, TRecv, TRecvReq, ADDR_UNSPEC};
use crate::abi;

const PEEK: u64 = abi::FI_PEEK as u64;
const CLAIM: u64 = abi::FI_CLAIM;
const DISCARD: u64 = abi::FI_DISCARD;
const TRECV: u64 = abi::FI_RECV as u64 | abi::FI_TAGGED as u64;

impl State {
    /// `fi_trecvmsg` with any of `FI_PEEK`, `FI_CLAIM`, `FI_DISCARD` in `flags` (see the
    /// module documentation).
    ///
    /// # Safety
    /// As [`State::post_trecv`]: every buffer is memory of this process that stays mapped
    /// until the operation completes.
    pub unsafe fn trecv_special(
        &mut self,
        ep: usize,
        bufs: &[(usize, usize, usize)],
        req: TRecvReq,
        flags: u64,
    ) -> Result<(), Errno> {
        let (directed, selective, rxcq) = {
            let e = self.ep_mut(ep)?;
            if !e.enabled {
                return Err(abi::FI_EOPBADSTATE);
            }
            (e.directed, e.rx_selective, e.rxcq)
        };
        let report = req.report || !selective;
        if flags & PEEK == 0 {
            if flags & CLAIM == 0 {
                return Err(abi::FI_EINVAL);
            }
            let e = self.ep_mut(ep)?;
            let i = e
                .claimed
                .iter()
                .position(|(c, _, _)| *c == req.ctx)
                .ok_or(abi::FI_EINVAL)?;
            let (_, r, payload) = e.claimed.remove(i);
            if flags & DISCARD != 0 {
                self.drop_message(ep, &r);
                if report {
                    let en = self.found_entry(ep, req.ctx, &r, 0);
                    self.push(rxcq, en);
                }
                return Ok(());
            }
            let dom = self.ep_mut(ep)?.domain;
            let bounce = super::bounce::needs_bounce(bufs);
            let got = if bounce {
                super::bounce::user_sges(bufs).map(|s| (s, Vec::new()))
            } else {
                // SAFETY: per the caller.
                unsafe { self.sges(dom, bufs, ringbell::Access::LOCAL_WRITE) }
            };
            let (sges, tmp) = match got {
                Ok(s) => s,
                Err(err) => {
                    // The claim stays for a retry with good buffers.
                    if let Ok(e) = self.ep_mut(ep) {
                        e.claimed.insert(i, (req.ctx, r, payload));
                    }
                    return Err(err);
                }
            };
            let t = TRecv {
                ctx: req.ctx,
                tag: req.tag,
                ignore: req.ignore,
                src: None,
                cap: sges.iter().map(|s| s.len as u64).sum(),
                sges,
                _tmp: tmp,
                buf: bufs.first().map_or(0, |b| b.0 as u64),
                report,
                bounce,
            };
            self.start_read(ep, t, r, &payload);
            return Ok(());
        }
        let src: Option<Addr> = if directed && req.src != ADDR_UNSPEC {
            Some(self.peer(ep, req.src)?)
        } else {
            None
        };
        let probe = TRecv {
            ctx: req.ctx,
            tag: req.tag,
            ignore: req.ignore,
            src,
            sges: Vec::new(),
            _tmp: Vec::new(),
            cap: 0,
            buf: 0,
            report: true,
            bounce: false,
        };
        let e = self.ep_mut(ep)?;
        let Some(i) = e.unexpected.iter().position(|(r, _)| probe.takes(r)) else {
            self.push(
                rxcq,
                Entry {
                    ctx: req.ctx,
                    flags: TRECV,
                    tag: req.tag,
                    src: ADDR_UNSPEC,
                    err: abi::FI_ENOMSG as i32,
                    ..Default::default()
                },
            );
            return Ok(());
        };
        let r = e.unexpected[i].0;
        if flags & DISCARD != 0 {
            // A peek reports the message it found (its length too), then drops it.
            e.unexpected.remove(i);
            self.drop_message(ep, &r);
            let en = self.found_entry(ep, req.ctx, &r, r.len);
            self.push(rxcq, en);
            return Ok(());
        }
        if flags & CLAIM != 0 {
            if let Some((r, payload)) = e.unexpected.remove(i) {
                e.claimed.push((req.ctx, r, payload));
            }
        }
        let en = self.found_entry(ep, req.ctx, &r, r.len);
        self.push(rxcq, en);
        Ok(())
    }

    /// `fi_cancel` (see the module documentation).
    pub fn cancel(&mut self, ep: usize, ctx: u64) -> Result<(), Errno> {
        let e = self.ep_mut(ep)?;
        if let Some(i) = e.tposted.iter().position(|t| t.ctx == ctx) {
            let rxcq = e.rxcq;
            if let Some(t) = e.tposted.remove(i) {
                self.push(
                    rxcq,
                    Entry {
                        ctx,
                        flags: TRECV,
                        buf: t.buf,
                        tag: t.tag,
                        src: ADDR_UNSPEC,
                        err: abi::FI_ECANCELED as i32,
                        ..Default::default()
                    },
                );
            }
        } else if let Some(i) = e.claimed.iter().position(|(c, _, _)| *c == ctx) {
            let (_, r, payload) = e.claimed.remove(i);
            // Back in arrival order among the unexpected messages is not knowable any more;
            // first is the closest to it (it was found before the ones still there).
            e.unexpected.push_front((r, payload));
        }
        Ok(())
    }

    /// The completion of a peek that found `r` (or of a discard, with `len` 0).
    fn found_entry(&self, ep: usize, ctx: u64, r: &Rts, len: u64) -> Entry {
        let mut flags = TRECV;
        if r.data.is_some() {
            flags |= abi::FI_REMOTE_CQ_DATA as u64;
        }
        Entry {
            ctx,
            flags,
            len,
            buf: 0,
            data: r.data.map_or(0, u64::from),
            tag: r.tag,
            src: self.av_index(ep, &r.from),
            ..Default::default()
        }
    }

    /// A discarded message: its sender waits for a FIN unless the message came eagerly.
    fn drop_message(&mut self, ep: usize, r: &Rts) {
        if !r.eager {
            let fin = Ctl::Fin { id: r.id, ok: true }.encode();
            let _ = self.send_ctl(ep, r.from, &fin, None, false);
        }
    }
}
