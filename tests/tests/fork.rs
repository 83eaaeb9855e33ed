//! A child of `fork` gets a copy of the memory the driver shares with its devices (adopted
//! program memory, DMA buffers and rings), not the parent's pages: each process writes its
//! own, and a child that drives its copy of the in-process fabric changes nothing of the
//! parent's.

use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{fork, ForkResult};
use ringbell::*;
use ringbell_tests::*;
use std::sync::Mutex;

/// The tests fork: one at a time, so that no other test's thread is mid-step at a fork.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn write_and_wait(p: &mut Pair, data: &[u8]) -> WcStatus {
    p.a.buf.write(0, data).unwrap();
    let sge = [p.a.mr.sge(0, data.len() as u32)];
    let remote = RemoteAddr {
        addr: p.b.mr.addr(),
        rkey: p.b.mr.rkey(),
    };
    p.a.qp
        .post_send(&[SendWr::new(1, WrOp::Write(remote), &sge).flags(SendFlags::SIGNALED)])
        .unwrap();
    wait(&p.fabric, &mut p.a.cq, 1)[0].status
}

fn read_b(p: &Pair, n: usize) -> Vec<u8> {
    let mut got = vec![0u8; n];
    p.b.buf.read(0, &mut got).unwrap();
    got
}

#[test]
fn a_child_of_fork_writes_its_own_copy_of_device_and_registered_memory() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut p = pair();
    // Program memory adopted by a registration (a heap buffer, as ibv_reg_mr takes it).
    let mut heap = vec![0u8; 3 * 4096];
    heap[..4].copy_from_slice(b"orig");
    // SAFETY: `heap` lives, untouched by other threads, until after the region is dropped.
    let user = unsafe {
        p.a.pd.reg_user_mr(
            heap.as_mut_ptr(),
            heap.len(),
            heap.as_ptr() as u64,
            Access::LOCAL_WRITE,
        )
    }
    .unwrap();
    assert_eq!(write_and_wait(&mut p, b"parent"), WcStatus::Success);
    // SAFETY: the child only runs the code below and leaves with _exit, never returning to
    // the test harness (whose other threads it does not have).
    match unsafe { fork() }.unwrap() {
        ForkResult::Child => {
            let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                heap[..4].copy_from_slice(b"kid!");
                // The child's copy of the fabric carries a WRITE of its own.
                write_and_wait(&mut p, b"child!") == WcStatus::Success
                    && read_b(&p, 6) == b"child!"
                    && &heap[..4] == b"kid!"
            }))
            .unwrap_or(false);
            // SAFETY: ends the child at once, without running the harness's exit path.
            unsafe { nix::libc::_exit(if ok { 0 } else { 1 }) };
        }
        ForkResult::Parent { child } => {
            assert_eq!(waitpid(child, None).unwrap(), WaitStatus::Exited(child, 0));
        }
    }
    // Nothing the child wrote reached the parent: its heap, its send buffer, the peer's
    // buffer, which the child's WRITE filled in the child's copy only.
    assert_eq!(&heap[..4], b"orig");
    let mut a = [0u8; 6];
    p.a.buf.read(0, &mut a).unwrap();
    assert_eq!(&a, b"parent");
    assert_eq!(read_b(&p, 6), b"parent");
    // The parent's device goes on working, with the registration made before the fork.
    assert_eq!(write_and_wait(&mut p, b"again!"), WcStatus::Success);
    assert_eq!(read_b(&p, 6), b"again!");
    drop(user);
    heap[4] = 1;
}

/// The start and end of the mapping of this process that holds `addr`.
fn mapping_of(addr: usize) -> (usize, usize) {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .filter_map(|l| {
            let (a, b) = l.split_whitespace().next()?.split_once('-')?;
            Some((
                usize::from_str_radix(a, 16).ok()?,
                usize::from_str_radix(b, 16).ok()?,
            ))
        })
        .find(|&(a, b)| (a..b).contains(&addr))
        .expect("the address is mapped")
}

/// When the heap itself is registered (the thread's malloc arena, as a program registering
/// a large heap range has it), the child reads nothing on it before its copy is in place:
/// the parent frees the fork's bookkeeping there and goes on allocating at once.
#[test]
fn a_child_of_fork_gets_its_own_copy_of_a_registered_heap() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let p = pair();
    let mut marker = Box::new([0u8; 64]);
    let (start, end) = mapping_of(marker.as_ptr() as usize);
    // SAFETY: this thread's heap, adopted in place with its bytes; it outlives the region,
    // which is dropped before the test returns.
    let heap = unsafe {
        p.a.pd.reg_user_mr(
            start as *mut u8,
            end - start,
            start as u64,
            Access::LOCAL_WRITE,
        )
    }
    .unwrap();
    for round in 0..20 {
        // SAFETY: the child only runs the code below and leaves with _exit, never
        // returning to the test harness (whose other threads it does not have).
        match unsafe { fork() }.unwrap() {
            ForkResult::Child => {
                // Sleeping allocates nothing; by its end the parent has written the marker.
                std::thread::sleep(std::time::Duration::from_millis(20));
                let own = marker[0] == 0;
                // SAFETY: ends the child at once, without running the harness's exit path.
                unsafe { nix::libc::_exit(if own { 0 } else { 1 }) };
            }
            ForkResult::Parent { child } => {
                for i in 0..2000 {
                    std::hint::black_box(vec![i as u8; 24 + i % 512]);
                }
                marker[0] = 1;
                assert_eq!(
                    waitpid(child, None).unwrap(),
                    WaitStatus::Exited(child, 0),
                    "fork {round}"
                );
                marker[0] = 0;
            }
        }
    }
    drop(heap);
}
