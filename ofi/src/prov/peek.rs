//! `fi_trecvmsg` with `FI_PEEK`, `FI_CLAIM` and `FI_DISCARD` (fi_tagged(3)), and
//! `fi_cancel` of tagged receives (fi_endpoint(3)), over the tag matcher
//! ([`super::tagged`]): the messages a peek can find are the endpoint's unexpected ones,
//! which the matcher's software half holds (a message the NIC matched into a posted
//! receive is never unexpected, and a posted receive always wins over a later peek).
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
//!   an error entry `FI_ECANCELED` (one in the NIC's list once the NIC confirms its
//!   removal, at the next progress); a claimed message waiting for its `FI_CLAIM` receive
//!   is given back to the unexpected queue. Anything else (a receive that already matched,
//!   an untagged receive, which sits on the NIC's receive queue, or an unknown context) is
//!   left to complete as it will; `fi_cancel` returns 0 either way (fi_endpoint(3)).

use super::{tagged, Entry, Errno, State, TRecvReq, ADDR_UNSPEC};
use crate::abi;
use ringbell::tagmatch::Peeked;

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
        self.sep_allows(ep, false)?;
        let (directed, selective, rxcq) = {
            let e = self.ep_mut(ep)?;
            if e.dgram.is_some() {
                return Err(abi::FI_ENOSYS);
            }
            if !e.enabled {
                return Err(abi::FI_EOPBADSTATE);
            }
            (e.directed, e.rx_selective, e.rxcq)
        };
        // What arrived so far is what a peek may find.
        self.tag_progress(ep);
        let report = req.report || !selective;
        if flags & PEEK == 0 {
            if flags & CLAIM == 0 {
                return Err(abi::FI_EINVAL);
            }
            if flags & DISCARD != 0 {
                let e = self.ep_mut(ep)?;
                let tm = e.tm.as_mut().ok_or(abi::FI_EOPBADSTATE)?;
                let p = tm.discard_claimed(req.ctx).ok_or(abi::FI_EINVAL)?;
                if report {
                    let en = self.found_entry(ep, req.ctx, &p, 0);
                    self.push(rxcq, en);
                }
                return Ok(());
            }
            // The claim stays for a retry when the buffers are refused.
            return self.trecv_claimed(ep, bufs, req, report);
        }
        let src = if directed && req.src != ADDR_UNSPEC {
            let a = self.peer(ep, req.src)?;
            let e = self.ep_mut(ep)?;
            Some(
                e.peer_ids
                    .iter()
                    .position(|p| *p == a)
                    .map_or(u64::MAX, |i| i as u64),
            )
        } else {
            None
        };
        let mask = !req.ignore;
        let e = self.ep_mut(ep)?;
        let tm = e.tm.as_mut().ok_or(abi::FI_EOPBADSTATE)?;
        let found = if flags & DISCARD != 0 {
            // A peek reports the message it found (its length too), then drops it.
            tm.discard(req.tag, mask, src)
        } else if flags & CLAIM != 0 {
            tm.claim(req.ctx, req.tag, mask, src)
        } else {
            tm.probe_from(req.tag, mask, src)
        };
        let en = match found {
            Some(p) => self.found_entry(ep, req.ctx, &p, p.len as u64),
            None => Entry {
                ctx: req.ctx,
                flags: TRECV,
                tag: req.tag,
                src: ADDR_UNSPEC,
                err: abi::FI_ENOMSG as i32,
                ..Default::default()
            },
        };
        self.push(rxcq, en);
        Ok(())
    }

    /// `fi_cancel` (see the module documentation).
    pub fn cancel(&mut self, ep: usize, ctx: u64) -> Result<(), Errno> {
        let e = self.ep_mut(ep)?;
        // The earliest posted receive with this context.
        let id = e
            .trecvs
            .iter()
            .filter(|(_, r)| r.ctx == ctx)
            .map(|(&id, _)| id)
            .min();
        let Some(tm) = e.tm.as_mut() else {
            return Ok(());
        };
        let cancelled = id.is_some_and(|id| tm.cancel(id).unwrap_or(false));
        if !cancelled {
            tm.unclaim(ctx);
        }
        self.drain_tag_events(ep);
        Ok(())
    }

    /// The completion of a peek that found `p` (or of a discard, with `len` 0).
    fn found_entry(&self, ep: usize, ctx: u64, p: &Peeked, len: u64) -> Entry {
        let mut flags = TRECV;
        if p.data.is_some() {
            flags |= abi::FI_REMOTE_CQ_DATA as u64;
        }
        let src = self
            .objs_ep(ep)
            .ok()
            .and_then(|e| tagged::peer_of(e, p.conn))
            .map_or(ADDR_UNSPEC, |a| self.av_index(ep, &a));
        Entry {
            ctx,
            flags,
            len,
            buf: 0,
            data: p.data.map_or(0, u64::from),
            tag: p.tag,
            src,
            ..Default::default()
        }
    }
}
