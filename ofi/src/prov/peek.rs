//! `FI_PEEK`, `FI_CLAIM` and `FI_DISCARD` (fi_tagged(3)) over the provider's unexpected
//! messages: a peek looks for a message that arrived and no receive took, reports its tag,
//! length, CQ data and source (no data: the entry's `buf` is NULL) or an `FI_ENOMSG` error
//! entry, and with `FI_CLAIM` sets the message aside for a later receive with `FI_CLAIM` and
//! the same context, or with `FI_DISCARD` drops it. A rendezvous message that is dropped
//! completes its send all the same (a FIN goes back): the receiver did not want the data.

use super::*;

/// What a tagged receive is, as to `FI_PEEK` and friends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Peek {
    /// An ordinary receive.
    #[default]
    None,
    /// `FI_PEEK`, with `FI_CLAIM` and/or `FI_DISCARD`.
    Peek { claim: bool, discard: bool },
    /// `FI_CLAIM` without `FI_PEEK`: receive (or, with `FI_DISCARD`, drop) the message
    /// claimed with this context.
    Claim { discard: bool },
}

impl Peek {
    /// From a receive's flags; `FI_DISCARD` alone is `-FI_EINVAL`.
    pub fn from_flags(flags: u64) -> Result<Peek, Errno> {
        let f = |b: u64| flags & b != 0;
        let (peek, claim, discard) = (f(abi::FI_PEEK as u64), f(abi::FI_CLAIM), f(abi::FI_DISCARD));
        Ok(match (peek, claim, discard) {
            (false, false, false) => Peek::None,
            (true, claim, discard) => Peek::Peek { claim, discard },
            (false, true, discard) => Peek::Claim { discard },
            (false, false, true) => return Err(EINVAL),
        })
    }
}

impl State {
    /// A peek, or a claimed message dropped: done here (`Some`). A claimed message to be
    /// received goes on as a receive (`None`).
    pub(super) fn peek_trecv(
        &mut self,
        ep: usize,
        req: &TRecvReq,
        src: Option<Addr>,
    ) -> Result<Option<()>, Errno> {
        let e = self.ep_mut(ep)?;
        let rxcq = e.rxcq;
        let found = match req.peek {
            Peek::None | Peek::Claim { discard: false } => return Ok(None),
            Peek::Claim { discard: true } => {
                let (r, _) = e.claimed.remove(&req.ctx).ok_or(EINVAL)?;
                self.drop_message(ep, &r);
                self.count(ep, abi::FI_RECV as u64, true);
                self.push(
                    rxcq,
                    Entry {
                        ctx: req.ctx,
                        flags: abi::FI_RECV as u64 | abi::FI_TAGGED as u64,
                        tag: r.tag,
                        src: ADDR_UNSPEC,
                        ..Default::default()
                    },
                );
                return Ok(Some(()));
            }
            Peek::Peek { .. } => e.unexpected.iter().position(|(r, _)| {
                tag_matches(r.tag, req.tag, req.ignore) && src.is_none_or(|s| s == r.from)
            }),
        };
        let Peek::Peek { claim, discard } = req.peek else {
            return Ok(None);
        };
        let Some(i) = found else {
            self.push(
                rxcq,
                Entry {
                    ctx: req.ctx,
                    flags: abi::FI_RECV as u64 | abi::FI_TAGGED as u64,
                    tag: req.tag,
                    src: ADDR_UNSPEC,
                    err: abi::FI_ENOMSG as i32,
                    ..Default::default()
                },
            );
            return Ok(Some(()));
        };
        let r = e.unexpected[i].0;
        if claim || discard {
            if let Some(m) = e.unexpected.remove(i) {
                if discard {
                    self.drop_message(ep, &m.0);
                } else {
                    self.ep_mut(ep)?.claimed.insert(req.ctx, m);
                }
            }
        }
        let mut flags = abi::FI_RECV as u64 | abi::FI_TAGGED as u64;
        if r.data.is_some() {
            flags |= abi::FI_REMOTE_CQ_DATA as u64;
        }
        let src = self.av_index(ep, &r.from);
        self.push(
            rxcq,
            Entry {
                ctx: req.ctx,
                flags,
                len: r.len,
                data: r.data.map_or(0, u64::from),
                tag: r.tag,
                src,
                ..Default::default()
            },
        );
        Ok(Some(()))
    }

    /// A message nobody will receive: a rendezvous sender gets its FIN (its send is over).
    fn drop_message(&mut self, ep: usize, r: &Rts) {
        if !r.eager {
            let fin = Ctl::Fin { id: r.id, ok: true }.encode();
            let _ = self.send_ctl(ep, r.from, &fin, None, false);
        }
    }
}
