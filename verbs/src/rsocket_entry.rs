//! The C boundary of rsockets ([`crate::rsocket`]): librdmacm's exported `r*` socket
//! functions. Descriptors, socket addresses, buffers, `iovec`s, `pollfd` arrays and
//! `fd_set`s are checked and copied here; the logic is safe Rust in `rsocket`, under the
//! library's lock. A call that must wait polls with the lock released between passes.

use crate::cma::Cma;
use crate::cma_entry::{call, rc, POLL_GAP};
use crate::events::{OnSignal, SignalWindow};
use crate::rsocket::{LINGER, RDMA_ROUTE, SOL_RDMA};
use crate::state::State;
use crate::{guard, set_errno};
use ringbell::Access;
use std::ffi::{c_int, c_long, c_void};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddrV4};
use std::time::{Duration, Instant};

/// -1 with `errno` (as `ssize_t`).
fn fail(e: i32) -> isize {
    set_errno(e);
    -1
}

/// `n`, or -1 with `errno`.
fn len_or(r: Result<usize, i32>) -> isize {
    match r {
        Ok(n) => n as isize,
        Err(e) => fail(e),
    }
}

/// A fresh descriptor for a socket: an eventfd, so that its number is no other open
/// file's. (It never becomes readable: rsockets are polled with `rpoll`.)
fn new_fd() -> Result<i32, i32> {
    // SAFETY: eventfd takes no pointers.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    match fd {
        f if f >= 0 => Ok(f),
        _ => Err(crate::errno()),
    }
}

fn close_fd(fd: i32) {
    // SAFETY: a descriptor this library made for a socket, closed once.
    unsafe { libc::close(fd) };
}

/// Reads a socket address: IPv4, or IPv6's unspecified, loopback (as IPv4's) and
/// IPv4-mapped addresses (ringbell NICs have IPv4 addresses). `v6_other` is the error for
/// any other IPv6 address.
///
/// # Safety
/// `addr` is null or points to `len` readable bytes.
unsafe fn read_addr(
    addr: *const libc::sockaddr,
    len: libc::socklen_t,
    v6_other: i32,
) -> Result<SocketAddrV4, i32> {
    if addr.is_null() {
        return Err(libc::EFAULT);
    }
    let len = len as usize;
    if len < std::mem::size_of::<libc::sa_family_t>() {
        return Err(libc::EINVAL);
    }
    // SAFETY: at least the family is readable (checked above); unaligned reads.
    let family = unsafe { std::ptr::read_unaligned(addr.cast::<libc::sa_family_t>()) };
    match i32::from(family) {
        libc::AF_INET if len >= std::mem::size_of::<libc::sockaddr_in>() => {
            // SAFETY: a whole sockaddr_in is readable (checked above).
            let a = unsafe { std::ptr::read_unaligned(addr.cast::<libc::sockaddr_in>()) };
            Ok(SocketAddrV4::new(
                Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)),
                u16::from_be(a.sin_port),
            ))
        }
        libc::AF_INET6 if len >= std::mem::size_of::<libc::sockaddr_in6>() => {
            // SAFETY: a whole sockaddr_in6 is readable (checked above).
            let a = unsafe { std::ptr::read_unaligned(addr.cast::<libc::sockaddr_in6>()) };
            let ip = Ipv6Addr::from(a.sin6_addr.s6_addr);
            let port = u16::from_be(a.sin6_port);
            match (ip.is_unspecified(), ip.is_loopback(), ip.to_ipv4_mapped()) {
                (true, _, _) => Ok(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, port)),
                (_, true, _) => Ok(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port)),
                (_, _, Some(v4)) => Ok(SocketAddrV4::new(v4, port)),
                _ => Err(v6_other),
            }
        }
        libc::AF_INET | libc::AF_INET6 => Err(libc::EINVAL),
        _ => Err(libc::EAFNOSUPPORT),
    }
}

/// Writes `a` as an address of `family` (IPv6: `::` or IPv4-mapped) into the caller's
/// `addr` of `*len` bytes (truncated to them), and the full size into `*len`; nothing when
/// `addr` or `len` is null.
///
/// # Safety
/// `addr` and `len` are null or valid; `*len` bytes of `addr` are writable.
unsafe fn write_addr(
    addr: *mut libc::sockaddr,
    len: *mut libc::socklen_t,
    a: SocketAddrV4,
    family: i32,
) {
    if addr.is_null() || len.is_null() {
        return;
    }
    let mut bytes = Vec::new();
    if family == libc::AF_INET6 {
        // SAFETY: an all-zero sockaddr_in6 is valid.
        let mut s: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
        s.sin6_family = libc::AF_INET6 as libc::sa_family_t;
        s.sin6_port = a.port().to_be();
        s.sin6_addr.s6_addr = match a.ip().is_unspecified() {
            true => Ipv6Addr::UNSPECIFIED.octets(),
            false => a.ip().to_ipv6_mapped().octets(),
        };
        // SAFETY: viewing a plain struct as bytes.
        bytes.extend_from_slice(unsafe {
            std::slice::from_raw_parts(
                (&s as *const libc::sockaddr_in6).cast::<u8>(),
                std::mem::size_of_val(&s),
            )
        });
    } else {
        // SAFETY: an all-zero sockaddr_in is valid.
        let mut s: libc::sockaddr_in = unsafe { std::mem::zeroed() };
        s.sin_family = libc::AF_INET as libc::sa_family_t;
        s.sin_port = a.port().to_be();
        s.sin_addr.s_addr = u32::from(*a.ip()).to_be();
        // SAFETY: viewing a plain struct as bytes.
        bytes.extend_from_slice(unsafe {
            std::slice::from_raw_parts(
                (&s as *const libc::sockaddr_in).cast::<u8>(),
                std::mem::size_of_val(&s),
            )
        });
    }
    // SAFETY: the caller's length word and buffer of that many bytes.
    unsafe {
        let n = (*len as usize).min(bytes.len());
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), addr.cast::<u8>(), n);
        *len = bytes.len() as libc::socklen_t;
    }
}

/// The caller's bytes `[buf, buf + len)`.
///
/// # Safety
/// `buf` is null only with `len` 0, and points to `len` readable bytes otherwise.
unsafe fn bytes<'a>(buf: *const c_void, len: usize) -> Result<&'a [u8], i32> {
    match (buf.is_null(), len) {
        (_, 0) => Ok(&[]),
        (true, _) => Err(libc::EFAULT),
        // SAFETY: the caller's buffer, as documented.
        (false, _) => Ok(unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), len) }),
    }
}

/// The caller's writable bytes `[buf, buf + len)`.
///
/// # Safety
/// As [`bytes`], writable.
unsafe fn bytes_mut<'a>(buf: *mut c_void, len: usize) -> Result<&'a mut [u8], i32> {
    match (buf.is_null(), len) {
        (_, 0) => Ok(&mut []),
        (true, _) => Err(libc::EFAULT),
        // SAFETY: the caller's buffer, as documented.
        (false, _) => Ok(unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), len) }),
    }
}

/// The caller's `iovec`s, as buffers.
///
/// # Safety
/// `iov` points to `n` `iovec`s whose buffers are valid for their lengths.
unsafe fn iovecs<'a>(iov: *const libc::iovec, n: c_int) -> Result<Vec<&'a mut [u8]>, i32> {
    if !(0..=libc::UIO_MAXIOV).contains(&n) {
        return Err(libc::EINVAL);
    }
    if n > 0 && iov.is_null() {
        return Err(libc::EFAULT);
    }
    (0..n as usize)
        .map(|i| {
            // SAFETY: entry i of the caller's array.
            let v = unsafe { std::ptr::read(iov.add(i)) };
            // SAFETY: the entry's buffer, as documented.
            unsafe { bytes_mut(v.iov_base, v.iov_len) }
        })
        .collect()
}

/// Whether the socket's calls block (not `O_NONBLOCK`, not `MSG_DONTWAIT`).
fn blocking(fd: i32, flags: c_int) -> Result<bool, i32> {
    let nb = call(Err(libc::EIO), |c, _| c.rs_nonblock(fd))?;
    Ok(!nb && flags & libc::MSG_DONTWAIT == 0)
}

/// Sends all of `data` (what fits now when not blocking), to `dst` if given (a datagram
/// socket's destination; a stream's is EISCONN).
fn send_all(fd: i32, data: &[u8], flags: c_int, dst: Option<SocketAddrV4>) -> Result<usize, i32> {
    if flags & libc::MSG_OOB != 0 {
        return Err(libc::EOPNOTSUPP);
    }
    let block = blocking(fd, flags)?;
    let mut sent = 0;
    let win = SignalWindow::open();
    loop {
        match look(block, Err(libc::EIO), |c, st| match dst {
            Some(d) => c.rs_sendto(st, fd, &data[sent..], Some(d)),
            None => c.rs_send(st, fd, &data[sent..]),
        }) {
            Ok(n) => sent += n,
            Err(e) if sent == 0 => return Err(e),
            Err(_) => return Ok(sent),
        }
        if sent == data.len() {
            // A datagram to a destination being resolved waits in the library: a blocking
            // send returns once it is out (or lost), as nothing sends it otherwise until
            // the socket is used again.
            while block && look(true, Err(libc::EIO), |c, st| c.rs_waiting(st, fd))? {
                // The datagram is the library's now: a signal ends the wait, not the send.
                if rest(&win, &[fd], WAKE_GAP, OnSignal::Restart).is_err() {
                    break;
                }
            }
            return Ok(sent);
        }
        if !block {
            return match sent {
                0 => Err(libc::EAGAIN),
                n => Ok(n),
            };
        }
        // Interrupted after some bytes went: their count, as send(2) gives.
        if let Err(e) = rest(&win, &[fd], WAKE_GAP, OnSignal::Restart) {
            return if sent == 0 { Err(e) } else { Ok(sent) };
        }
    }
}

/// Receives into `out`: at least one byte (all of `out` with `MSG_WAITALL` on a stream), 0
/// at the end of the stream; one datagram on a datagram socket. With the datagram's source.
fn recv_into(fd: i32, out: &mut [u8], flags: c_int) -> Result<(usize, Option<SocketAddrV4>), i32> {
    if flags & libc::MSG_OOB != 0 {
        return Err(libc::EINVAL);
    }
    let block = blocking(fd, flags)?;
    let peek = flags & libc::MSG_PEEK != 0;
    let all = flags & libc::MSG_WAITALL != 0 && !peek;
    let mut got = 0;
    let win = SignalWindow::open();
    loop {
        match look(block, Err(libc::EIO), |c, st| {
            c.rs_recv(st, fd, &mut out[got..], peek)
        }) {
            Ok(Some((n, Some(from)))) => return Ok((n, Some(from))),
            Ok(Some((0, None))) => return Ok((got, None)),
            Ok(Some((n, None))) => {
                got += n;
                if !all || got == out.len() {
                    return Ok((got, None));
                }
            }
            Ok(None) if !block => {
                return match got {
                    0 => Err(libc::EAGAIN),
                    n => Ok((n, None)),
                }
            }
            Ok(None) => {}
            Err(e) if got == 0 => return Err(e),
            Err(_) => return Ok((got, None)),
        }
        if let Err(e) = rest(&win, &[fd], WAKE_GAP, OnSignal::Restart) {
            return if got == 0 { Err(e) } else { Ok((got, None)) };
        }
    }
}

#[no_mangle]
pub extern "C" fn rsocket(domain: c_int, kind: c_int, protocol: c_int) -> c_int {
    guard(-1, || {
        let nonblock = kind & libc::SOCK_NONBLOCK != 0;
        let ty = kind & !(libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC);
        let r = (|| {
            if domain != libc::AF_INET && domain != libc::AF_INET6 {
                return Err(libc::EAFNOSUPPORT);
            }
            let dgram = match (ty, protocol) {
                (libc::SOCK_STREAM, 0 | libc::IPPROTO_TCP) => false,
                (libc::SOCK_DGRAM, 0 | libc::IPPROTO_UDP) => true,
                (libc::SOCK_STREAM | libc::SOCK_DGRAM, _) => return Err(libc::EPROTONOSUPPORT),
                _ => return Err(libc::ESOCKTNOSUPPORT),
            };
            let fd = new_fd()?;
            if let Err(e) = call(Err(libc::EIO), |c, _| {
                c.rs_socket(fd, domain, nonblock, dgram)
            }) {
                close_fd(fd);
                return Err(e);
            }
            Ok(fd)
        })();
        r.unwrap_or_else(|e| {
            set_errno(e);
            -1
        })
    })
}

/// # Safety
/// `addr` points to `len` readable bytes (or is null: EFAULT).
#[no_mangle]
pub unsafe extern "C" fn rbind(
    socket: c_int,
    addr: *const libc::sockaddr,
    len: libc::socklen_t,
) -> c_int {
    guard(-1, || {
        let r = call(Err(libc::EIO), |c, _| c.rs_family(socket)).and_then(|_| {
            // SAFETY: the caller's address of `len` bytes.
            let a = unsafe { read_addr(addr, len, libc::EADDRNOTAVAIL) }?;
            call(Err(libc::EIO), |c, st| c.rs_bind(st, socket, a))
        });
        rc(r)
    })
}

#[no_mangle]
pub extern "C" fn rlisten(socket: c_int, backlog: c_int) -> c_int {
    guard(-1, || {
        rc(call(Err(libc::EIO), |c, st| {
            c.rs_listen(st, socket, backlog)
        }))
    })
}

/// # Safety
/// `addr` and `len` are null or valid, `*len` bytes of `addr` writable.
#[no_mangle]
pub unsafe extern "C" fn raccept(
    socket: c_int,
    addr: *mut libc::sockaddr,
    len: *mut libc::socklen_t,
) -> c_int {
    guard(-1, || {
        let r = (|| {
            let family = call(Err(libc::EIO), |c, _| c.rs_family(socket))?;
            let block = blocking(socket, 0)?;
            let newfd = new_fd()?;
            let win = SignalWindow::open();
            loop {
                match look(block, Err(libc::EIO), |c, st| {
                    c.rs_accept(st, socket, newfd)
                }) {
                    Ok(Some(peer)) => {
                        // SAFETY: the caller's address buffer and length, as documented.
                        unsafe { write_addr(addr, len, peer, family) };
                        return Ok(newfd);
                    }
                    Ok(None) if block => {
                        if let Err(e) = rest(&win, &[socket], WAKE_GAP, OnSignal::Restart) {
                            close_fd(newfd);
                            return Err(e);
                        }
                    }
                    Ok(None) => {
                        close_fd(newfd);
                        return Err(libc::EAGAIN);
                    }
                    Err(e) => {
                        close_fd(newfd);
                        return Err(e);
                    }
                }
            }
        })();
        r.unwrap_or_else(|e| {
            set_errno(e);
            -1
        })
    })
}

/// # Safety
/// `addr` points to `len` readable bytes (or is null: EFAULT).
#[no_mangle]
pub unsafe extern "C" fn rconnect(
    socket: c_int,
    addr: *const libc::sockaddr,
    len: libc::socklen_t,
) -> c_int {
    guard(-1, || {
        let r = (|| {
            call(Err(libc::EIO), |c, _| c.rs_family(socket))?;
            // SAFETY: the caller's address of `len` bytes.
            let dst = unsafe { read_addr(addr, len, libc::ENETUNREACH) }?;
            let block = blocking(socket, 0)?;
            if call(Err(libc::EIO), |c, st| c.rs_connect(st, socket, dst))? {
                return Ok(());
            }
            if !block {
                return Err(libc::EINPROGRESS);
            }
            let win = SignalWindow::open();
            loop {
                if look(true, Err(libc::EIO), |c, st| c.rs_connected(st, socket))? {
                    return Ok(());
                }
                // An interrupted connect goes on without the caller, as connect(2)'s does.
                rest(&win, &[socket], WAKE_GAP, OnSignal::Restart)?;
            }
        })();
        rc(r)
    })
}

#[no_mangle]
pub extern "C" fn rshutdown(socket: c_int, how: c_int) -> c_int {
    guard(-1, || {
        rc(call(Err(libc::EIO), |c, st| c.rs_shutdown(st, socket, how)))
    })
}

#[no_mangle]
pub extern "C" fn rclose(socket: c_int) -> c_int {
    guard(-1, || {
        let r = (|| {
            // SO_LINGER on with no time: close at once, as an abortive close does.
            let (on, secs) = call(Err(libc::EIO), |c, _| c.rs_linger(socket))?;
            if on == 0 || secs > 0 {
                let start = Instant::now();
                while start.elapsed() < LINGER {
                    match call(Err(libc::EIO), |c, st| c.rs_drain(st, socket)) {
                        Ok(false) => std::thread::sleep(POLL_GAP),
                        _ => break,
                    }
                }
            }
            call(Err(libc::EIO), |c, st| c.rs_close(st, socket))?;
            close_fd(socket);
            Ok(())
        })();
        rc(r)
    })
}

/// # Safety
/// `buf` points to `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn rrecv(socket: c_int, buf: *mut c_void, len: usize, flags: c_int) -> isize {
    guard(-1, || {
        // SAFETY: the caller's buffer.
        len_or(
            unsafe { bytes_mut(buf, len) }
                .and_then(|out| recv_into(socket, out, flags).map(|r| r.0)),
        )
    })
}

/// # Safety
/// As `rrecv`; `addr` and `len` are null or valid.
#[no_mangle]
pub unsafe extern "C" fn rrecvfrom(
    socket: c_int,
    buf: *mut c_void,
    len: usize,
    flags: c_int,
    addr: *mut libc::sockaddr,
    addrlen: *mut libc::socklen_t,
) -> isize {
    guard(-1, || {
        // SAFETY: the caller's buffer.
        let r = unsafe { bytes_mut(buf, len) }.and_then(|out| recv_into(socket, out, flags));
        if let Ok((_, from)) = r {
            // A datagram's source, or a stream's peer.
            if let Ok((p, family)) = source(socket, from) {
                // SAFETY: the caller's address buffer and length, as documented.
                unsafe { write_addr(addr, addrlen, p, family) };
            }
        }
        len_or(r.map(|r| r.0))
    })
}

/// Where received bytes came from: a datagram's source, or a stream's peer; with the
/// socket's family.
fn source(socket: c_int, from: Option<SocketAddrV4>) -> Result<(SocketAddrV4, i32), i32> {
    call(Err(libc::EIO), |c, _| {
        let family = c.rs_family(socket)?;
        Ok((from.map_or_else(|| c.rs_peername(socket), Ok)?, family))
    })
}

/// Receives into the caller's `iovec`s.
fn recv_vec(
    socket: c_int,
    mut bufs: Vec<&mut [u8]>,
    flags: c_int,
) -> Result<(usize, Option<SocketAddrV4>), i32> {
    let total: usize = bufs.iter().map(|b| b.len()).sum();
    let mut tmp = vec![0u8; total];
    let (n, from) = recv_into(socket, &mut tmp, flags)?;
    let mut off = 0;
    for b in bufs.iter_mut() {
        let k = b.len().min(n - off);
        b[..k].copy_from_slice(&tmp[off..off + k]);
        off += k;
    }
    Ok((n, from))
}

/// # Safety
/// `msg` points to a valid `msghdr` whose buffers are valid.
#[no_mangle]
pub unsafe extern "C" fn rrecvmsg(socket: c_int, msg: *mut libc::msghdr, flags: c_int) -> isize {
    guard(-1, || {
        if msg.is_null() {
            return fail(libc::EFAULT);
        }
        // SAFETY: the caller's header, checked non-null.
        let m = unsafe { &mut *msg };
        // SAFETY: the header's iovecs.
        let r = unsafe { iovecs(m.msg_iov, m.msg_iovlen as c_int) }
            .and_then(|bufs| recv_vec(socket, bufs, flags));
        if let Ok((_, from)) = r {
            m.msg_flags = 0;
            m.msg_controllen = 0;
            if !m.msg_name.is_null() {
                if let Ok((p, family)) = source(socket, from) {
                    // SAFETY: the header's name buffer and its length.
                    unsafe { write_addr(m.msg_name.cast(), &mut m.msg_namelen, p, family) };
                }
            }
        }
        len_or(r.map(|r| r.0))
    })
}

/// # Safety
/// `buf` points to `count` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn rread(socket: c_int, buf: *mut c_void, count: usize) -> isize {
    // SAFETY: as documented.
    unsafe { rrecv(socket, buf, count, 0) }
}

/// # Safety
/// `iov` points to `iovcnt` valid `iovec`s.
#[no_mangle]
pub unsafe extern "C" fn rreadv(socket: c_int, iov: *const libc::iovec, iovcnt: c_int) -> isize {
    guard(-1, || {
        // SAFETY: the caller's iovecs.
        len_or(unsafe { iovecs(iov, iovcnt) }.and_then(|b| recv_vec(socket, b, 0).map(|r| r.0)))
    })
}

/// # Safety
/// `buf` points to `len` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn rsend(
    socket: c_int,
    buf: *const c_void,
    len: usize,
    flags: c_int,
) -> isize {
    guard(-1, || {
        // SAFETY: the caller's buffer.
        len_or(unsafe { bytes(buf, len) }.and_then(|d| send_all(socket, d, flags, None)))
    })
}

/// # Safety
/// As `rsend`; `addr` is null or points to `addrlen` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn rsendto(
    socket: c_int,
    buf: *const c_void,
    len: usize,
    flags: c_int,
    addr: *const libc::sockaddr,
    addrlen: libc::socklen_t,
) -> isize {
    guard(-1, || {
        let r = (|| {
            let dst = match addr.is_null() {
                true => None,
                // SAFETY: the caller's address of `addrlen` bytes.
                false => Some(unsafe { read_addr(addr, addrlen, libc::ENETUNREACH) }?),
            };
            // SAFETY: the caller's buffer.
            let data = unsafe { bytes(buf, len) }?;
            send_all(socket, data, flags, dst)
        })();
        len_or(r)
    })
}

/// Sends the caller's `iovec`s, in order.
fn send_vec(
    socket: c_int,
    bufs: Vec<&mut [u8]>,
    flags: c_int,
    dst: Option<SocketAddrV4>,
) -> Result<usize, i32> {
    let data: Vec<u8> = bufs.iter().flat_map(|b| b.iter().copied()).collect();
    send_all(socket, &data, flags, dst)
}

/// # Safety
/// `msg` points to a valid `msghdr` whose buffers are valid.
#[no_mangle]
pub unsafe extern "C" fn rsendmsg(socket: c_int, msg: *const libc::msghdr, flags: c_int) -> isize {
    guard(-1, || {
        if msg.is_null() {
            return fail(libc::EFAULT);
        }
        // SAFETY: the caller's header, checked non-null.
        let m = unsafe { &*msg };
        let r = (|| {
            let dst = match m.msg_name.is_null() {
                true => None,
                false => {
                    // SAFETY: the header's name of `msg_namelen` bytes.
                    let a =
                        unsafe { read_addr(m.msg_name.cast(), m.msg_namelen, libc::ENETUNREACH) };
                    Some(a?)
                }
            };
            // SAFETY: the header's iovecs.
            let bufs = unsafe { iovecs(m.msg_iov, m.msg_iovlen as c_int) }?;
            send_vec(socket, bufs, flags, dst)
        })();
        len_or(r)
    })
}

/// # Safety
/// `buf` points to `count` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn rwrite(socket: c_int, buf: *const c_void, count: usize) -> isize {
    // SAFETY: as documented.
    unsafe { rsend(socket, buf, count, 0) }
}

/// # Safety
/// `iov` points to `iovcnt` valid `iovec`s.
#[no_mangle]
pub unsafe extern "C" fn rwritev(socket: c_int, iov: *const libc::iovec, iovcnt: c_int) -> isize {
    guard(-1, || {
        // SAFETY: the caller's iovecs.
        len_or(unsafe { iovecs(iov, iovcnt) }.and_then(|b| send_vec(socket, b, 0, None)))
    })
}

/// The longest a blocking call sleeps on a served NIC's interrupt before it looks again (the
/// CM's timers, and a wake-up another thread of the process took, are seen by then).
const WAKE_GAP: Duration = Duration::from_millis(2);

/// Sleeps until something may have happened to rsockets `fds`, at most `most`: on a served
/// NIC until its interrupt (the sockets' CQs and the NIC's CM armed, see `Cma::rs_arm`),
/// or `WAKE_GAP`; in-process, where nothing moves until a call, a nap of `POLL_GAP`.
/// As [`call`], for a look by a call that, if it finds nothing (and `sleeps`), sleeps on
/// the sockets' NIC's interrupt ([`rest`]) rather than returning (see
/// [`crate::cma::Cma::rs_sleeping`]).
fn look<R>(sleeps: bool, fail: R, f: impl FnOnce(&mut Cma, &mut State) -> R) -> R {
    call(fail, |c, st| c.rs_sleeping(st, sleeps, f))
}

fn rest(win: &SignalWindow, fds: &[i32], most: Duration, k: OnSignal) -> Result<(), i32> {
    match call(None, |c, st| c.rs_arm(st, fds)) {
        Some(irq) => {
            if win.wait_fd(irq, most.min(WAKE_GAP), k)? {
                crate::events::take_interrupt(irq);
            }
            Ok(())
        }
        None => win.nap(most.min(POLL_GAP), k),
    }
}

/// Polls `fds` (rsockets and other descriptors) until one is ready or `timeout` passes
/// (None: for ever). Returns how many are ready.
fn poll_all(fds: &mut [libc::pollfd], timeout: Option<Duration>) -> Result<usize, i32> {
    let start = Instant::now();
    let win = SignalWindow::open();
    let sleeps = timeout != Some(Duration::ZERO);
    loop {
        let mut others: Vec<usize> = Vec::new();
        look(sleeps, Err(libc::EIO), |c, st| {
            for (k, p) in fds.iter_mut().enumerate() {
                p.revents = 0;
                if p.fd < 0 {
                    continue;
                }
                match c.rs_is(p.fd) {
                    true => {
                        p.revents = c.rs_ready(st, p.fd, p.events).unwrap_or(libc::POLLNVAL);
                    }
                    false => others.push(k),
                }
            }
            Ok::<(), i32>(())
        })?;
        if !others.is_empty() {
            let mut sys: Vec<libc::pollfd> = others.iter().map(|&k| fds[k]).collect();
            // SAFETY: a local array of `sys.len()` entries.
            let n = unsafe { libc::poll(sys.as_mut_ptr(), sys.len() as libc::nfds_t, 0) };
            if n < 0 {
                return Err(crate::errno());
            }
            for (p, &k) in sys.iter().zip(&others) {
                fds[k].revents = p.revents;
            }
        }
        let ready = fds.iter().filter(|p| p.revents != 0).count();
        if ready > 0 || timeout.is_some_and(|t| start.elapsed() >= t) {
            return Ok(ready);
        }
        let left = timeout.map_or(WAKE_GAP, |t| t.saturating_sub(start.elapsed()));
        if others.is_empty() {
            // Only rsockets: asleep until their NIC interrupts.
            let socks: Vec<i32> = fds.iter().filter(|p| p.fd >= 0).map(|p| p.fd).collect();
            rest(&win, &socks, left, OnSignal::Fail)?;
        } else {
            win.nap(left.min(POLL_GAP), OnSignal::Fail)?;
        }
    }
}

/// # Safety
/// `fds` points to `nfds` `pollfd`s.
#[no_mangle]
pub unsafe extern "C" fn rpoll(
    fds: *mut libc::pollfd,
    nfds: libc::nfds_t,
    timeout: c_int,
) -> c_int {
    guard(-1, || {
        if nfds > 0 && fds.is_null() {
            set_errno(libc::EFAULT);
            return -1;
        }
        // (poll(2)'s bound is the descriptor limit; a million is beyond any.)
        if nfds > 1 << 20 {
            set_errno(libc::EINVAL);
            return -1;
        }
        let mut v: Vec<libc::pollfd> = (0..nfds as usize)
            // SAFETY: entry k of the caller's array.
            .map(|k| unsafe { std::ptr::read(fds.add(k)) })
            .collect();
        let t = u64::try_from(timeout).ok().map(Duration::from_millis);
        match poll_all(&mut v, t) {
            Ok(n) => {
                for (k, p) in v.iter().enumerate() {
                    // SAFETY: entry k of the caller's array (its revents).
                    unsafe { (*fds.add(k)).revents = p.revents };
                }
                n as c_int
            }
            Err(e) => {
                set_errno(e);
                -1
            }
        }
    })
}

/// # Safety
/// Each set is null or a valid `fd_set`; `timeout` is null or valid.
#[no_mangle]
pub unsafe extern "C" fn rselect(
    nfds: c_int,
    readfds: *mut libc::fd_set,
    writefds: *mut libc::fd_set,
    exceptfds: *mut libc::fd_set,
    timeout: *mut libc::timeval,
) -> c_int {
    guard(-1, || {
        if !(0..=libc::FD_SETSIZE as c_int).contains(&nfds) {
            set_errno(libc::EINVAL);
            return -1;
        }
        let isset = |set: *mut libc::fd_set, fd: c_int| {
            if set.is_null() {
                return false;
            }
            // SAFETY: the caller's set, read for a descriptor below nfds.
            unsafe { libc::FD_ISSET(fd, set) }
        };
        let mut v = Vec::new();
        for fd in 0..nfds {
            let mut events = 0;
            if isset(readfds, fd) {
                events |= libc::POLLIN;
            }
            if isset(writefds, fd) {
                events |= libc::POLLOUT;
            }
            if isset(exceptfds, fd) {
                events |= libc::POLLPRI;
            }
            if events != 0 {
                v.push(libc::pollfd {
                    fd,
                    events,
                    revents: 0,
                });
            }
        }
        let t = match timeout.is_null() {
            true => None,
            false => {
                // SAFETY: the caller's timeout, checked non-null.
                let tv = unsafe { *timeout };
                if tv.tv_sec < 0 || !(0..1_000_000).contains(&tv.tv_usec) {
                    set_errno(libc::EINVAL);
                    return -1;
                }
                Some(
                    Duration::from_secs(tv.tv_sec as u64)
                        + Duration::from_micros(tv.tv_usec as u64),
                )
            }
        };
        if let Err(e) = poll_all(&mut v, t) {
            set_errno(e);
            return -1;
        }
        let mut n = 0;
        for set in [readfds, writefds, exceptfds] {
            if !set.is_null() {
                // SAFETY: the caller's set.
                unsafe { libc::FD_ZERO(set) };
            }
        }
        for p in &v {
            let hit = [
                (readfds, libc::POLLIN | libc::POLLHUP | libc::POLLERR),
                (writefds, libc::POLLOUT | libc::POLLERR),
                (exceptfds, libc::POLLPRI),
            ];
            for (set, bits) in hit {
                if !set.is_null() && p.events & bits != 0 && p.revents & bits != 0 {
                    // SAFETY: the caller's set; fd is below nfds.
                    unsafe { libc::FD_SET(p.fd, set) };
                    n += 1;
                }
            }
        }
        n
    })
}

/// Writes the socket's address `which` gives into the caller's `addr`.
///
/// # Safety
/// `addr` and `len` are null (EFAULT) or valid; `*len` bytes of `addr` writable.
unsafe fn name_of(
    socket: c_int,
    addr: *mut libc::sockaddr,
    len: *mut libc::socklen_t,
    which: fn(&crate::cma::Cma, i32) -> Result<SocketAddrV4, i32>,
) -> c_int {
    if addr.is_null() || len.is_null() {
        return rc(Err(libc::EFAULT));
    }
    let r = call(Err(libc::EIO), |c, _| {
        Ok::<_, i32>((which(c, socket)?, c.rs_family(socket)?))
    });
    rc(r.map(|(a, family)| {
        // SAFETY: the caller's buffer and length, checked non-null.
        unsafe { write_addr(addr, len, a, family) }
    }))
}

/// # Safety
/// `addr` and `len` are valid; `*len` bytes of `addr` writable.
#[no_mangle]
pub unsafe extern "C" fn rgetpeername(
    socket: c_int,
    addr: *mut libc::sockaddr,
    len: *mut libc::socklen_t,
) -> c_int {
    // SAFETY: as documented.
    guard(-1, || unsafe {
        name_of(socket, addr, len, crate::cma::Cma::rs_peername)
    })
}

/// # Safety
/// `addr` and `len` are valid; `*len` bytes of `addr` writable.
#[no_mangle]
pub unsafe extern "C" fn rgetsockname(
    socket: c_int,
    addr: *mut libc::sockaddr,
    len: *mut libc::socklen_t,
) -> c_int {
    // SAFETY: as documented.
    guard(-1, || unsafe {
        name_of(socket, addr, len, crate::cma::Cma::rs_sockname)
    })
}

/// # Safety
/// `optval` points to `optlen` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn rsetsockopt(
    socket: c_int,
    level: c_int,
    optname: c_int,
    optval: *const c_void,
    optlen: libc::socklen_t,
) -> c_int {
    guard(-1, || {
        let r = (|| {
            call(Err(libc::EIO), |c, _| c.rs_family(socket))?;
            // SAFETY: the caller's option bytes.
            let v = unsafe { bytes(optval, optlen as usize) }?;
            match (level, optname) {
                // A path record: the fabric's route is the only one.
                (SOL_RDMA, RDMA_ROUTE) => Ok(()),
                (libc::SOL_SOCKET, libc::SO_LINGER) => {
                    if v.len() < std::mem::size_of::<libc::linger>() {
                        return Err(libc::EINVAL);
                    }
                    let int =
                        |i: usize| i32::from_ne_bytes(v[i..i + 4].try_into().unwrap_or_default());
                    call(Err(libc::EIO), |c, _| {
                        c.rs_set_linger(socket, int(0), int(4))
                    })
                }
                _ => {
                    if !crate::rsocket::int_option(level, optname) {
                        return Err(libc::ENOPROTOOPT);
                    }
                    if v.len() < 4 {
                        return Err(match optval.is_null() {
                            true => libc::EFAULT,
                            false => libc::EINVAL,
                        });
                    }
                    let x = i32::from_ne_bytes([v[0], v[1], v[2], v[3]]);
                    call(Err(libc::EIO), |c, _| {
                        c.rs_setopt(socket, level, optname, x)
                    })
                }
            }
        })();
        rc(r)
    })
}

/// # Safety
/// `optval` points to `*optlen` writable bytes; `optlen` is valid.
#[no_mangle]
pub unsafe extern "C" fn rgetsockopt(
    socket: c_int,
    level: c_int,
    optname: c_int,
    optval: *mut c_void,
    optlen: *mut libc::socklen_t,
) -> c_int {
    guard(-1, || {
        let r = (|| {
            call(Err(libc::EIO), |c, _| c.rs_family(socket))?;
            if optval.is_null() || optlen.is_null() {
                return Err(libc::EFAULT);
            }
            // SAFETY: the caller's length word, checked non-null.
            let room = unsafe { *optlen } as usize;
            let out: Vec<u8> = match (level, optname) {
                (libc::SOL_SOCKET, libc::SO_LINGER) => {
                    let (on, secs) = call(Err(libc::EIO), |c, _| c.rs_linger(socket))?;
                    [on.to_ne_bytes(), secs.to_ne_bytes()].concat()
                }
                _ => {
                    if room < 4 && crate::rsocket::int_option(level, optname) {
                        return Err(libc::EINVAL);
                    }
                    call(Err(libc::EIO), |c, _| c.rs_getopt(socket, level, optname))?
                        .to_ne_bytes()
                        .to_vec()
                }
            };
            let n = room.min(out.len());
            // SAFETY: the caller's buffer of `room` bytes and its length word.
            unsafe {
                std::ptr::copy_nonoverlapping(out.as_ptr(), optval.cast::<u8>(), n);
                *optlen = n as libc::socklen_t;
            }
            Ok(())
        })();
        rc(r)
    })
}

/// `rfcntl(socket, cmd, ...)`: `F_GETFL` and `F_SETFL` (`O_NONBLOCK`). Declared with the
/// one argument these commands take: the x86-64 and AArch64 calling conventions pass a
/// variadic integer argument where a declared one goes.
#[no_mangle]
pub extern "C" fn rfcntl(socket: c_int, cmd: c_int, arg: c_long) -> c_int {
    guard(-1, || {
        let r = match cmd {
            libc::F_GETFL => call(Err(libc::EIO), |c, _| c.rs_nonblock(socket))
                .map(|nb| libc::O_RDWR | if nb { libc::O_NONBLOCK } else { 0 }),
            libc::F_SETFL => call(Err(libc::EIO), |c, _| {
                c.rs_set_nonblock(socket, arg as c_int & libc::O_NONBLOCK != 0)
            })
            .map(|()| 0),
            _ => call(Err(libc::EIO), |c, _| c.rs_family(socket)).and(Err(libc::EINVAL)),
        };
        r.unwrap_or_else(|e| {
            set_errno(e);
            -1
        })
    })
}

/// # Safety
/// `buf` points to `len` bytes the caller keeps mapped until `riounmap`.
#[no_mangle]
pub unsafe extern "C" fn riomap(
    socket: c_int,
    buf: *mut c_void,
    len: usize,
    prot: c_int,
    _flags: c_int,
    offset: libc::off_t,
) -> libc::off_t {
    guard(-1, || {
        let r = (|| {
            call(Err(libc::EIO), |c, _| c.rs_family(socket))?;
            if buf.is_null() || len == 0 {
                return Err(libc::EINVAL);
            }
            match prot {
                // Local only: a source of riowrite, which copies anyway.
                libc::PROT_NONE => return Ok(0),
                libc::PROT_WRITE => {}
                _ => return Err(libc::EINVAL),
            }
            let block = blocking(socket, 0)?;
            let win = SignalWindow::open();
            loop {
                let r = call(Err(libc::EIO), |c, st| {
                    let pd = c.rs_pd(socket)?;
                    let acc = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
                    // SAFETY: the caller's buffer, which riomap's contract keeps mapped
                    // until riounmap (or the socket's close), addressed by its own address.
                    let mr = unsafe { pd.reg_user_mr(buf.cast(), len, buf as u64, acc) }
                        .map_err(|e| crate::errno_of(&e))?;
                    c.rs_iomap(st, socket, offset, mr, len as u64, buf as u64)
                });
                match r {
                    Err(libc::EAGAIN) if block => {
                        rest(&win, &[socket], WAKE_GAP, OnSignal::Restart)?
                    }
                    r => return r,
                }
            }
        })();
        match r {
            Ok(off) => off as libc::off_t,
            Err(e) => {
                set_errno(e);
                -1
            }
        }
    })
}

/// # Safety
/// `buf` is the address a `riomap` of this socket mapped.
#[no_mangle]
pub unsafe extern "C" fn riounmap(socket: c_int, buf: *mut c_void, _len: usize) -> c_int {
    guard(-1, || {
        rc(call(Err(libc::EIO), |c, st| {
            c.rs_iounmap(st, socket, buf as u64)
        }))
    })
}

/// # Safety
/// `buf` points to `count` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn riowrite(
    socket: c_int,
    buf: *const c_void,
    count: usize,
    offset: libc::off_t,
    flags: c_int,
) -> usize {
    guard(usize::MAX, || {
        let r = (|| {
            // SAFETY: the caller's buffer.
            let data = unsafe { bytes(buf, count) }?;
            let offset = u64::try_from(offset).map_err(|_| libc::EINVAL)?;
            let block = blocking(socket, flags)?;
            let mut sent = 0;
            let win = SignalWindow::open();
            loop {
                match look(block, Err(libc::EIO), |c, st| {
                    c.rs_iowrite(st, socket, &data[sent..], offset + sent as u64)
                }) {
                    Ok(n) => sent += n,
                    Err(e) if sent == 0 => return Err(e),
                    Err(_) => return Ok(sent),
                }
                if sent == data.len() {
                    return Ok(sent);
                }
                if !block {
                    return match sent {
                        0 => Err(libc::EAGAIN),
                        n => Ok(n),
                    };
                }
                if let Err(e) = rest(&win, &[socket], WAKE_GAP, OnSignal::Restart) {
                    return if sent == 0 { Err(e) } else { Ok(sent) };
                }
            }
        })();
        r.unwrap_or_else(|e| {
            set_errno(e);
            usize::MAX
        })
    })
}
