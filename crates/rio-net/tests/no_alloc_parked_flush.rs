//! A target's connection that parks an ordered FLUSH behind a write still awaiting its data (by
//! R2T) allocates nothing for it: the list of parked FLUSHes has its room from the start, like
//! the connection's other lists (from a review on 2026-11-28).
//!
//! One test in this file, with an allocator that counts every thread but the one speaking to
//! the target (its raw host allocates as it reads).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};

use rio_net::pdu::{self, op, Digests, Sqe, WireAttr};
use rio_net::{Target, TargetConfig, TargetLogKind};

mod common;
use common::{lba_sqe, queues, Raw};

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static COUNTED: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// Set on the thread whose allocations are not counted.
    static HOST: Cell<bool> = const { Cell::new(false) };
}

fn count() {
    if COUNTING.load(SeqCst) && !HOST.try_with(|h| h.get()).unwrap_or(false) {
        COUNTED.fetch_add(1, SeqCst);
    }
}

// SAFETY: every call goes to the system allocator unchanged; counting touches only atomics
// and a thread-local flag without a destructor.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        count();
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        count();
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        count();
        unsafe { System.realloc(p, l, n) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const LBA: u32 = 4096;

struct Remove(PathBuf);
impl Drop for Remove {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Stream 0's group `seq`: one 4 KiB write at block `seq`, its data by R2T (command `cid`).
fn write(cid: u16, seq: u64) -> Sqe {
    let mut w = lba_sqe(op::WRITE, cid, seq, 1);
    w.set_sgl(LBA, false);
    WireAttr {
        stream: 0,
        seq,
        seq_end: seq,
        prev: seq - 1,
        num: 1,
        members: 1,
        boundary: true,
        ..WireAttr::default()
    }
    .put(&mut w);
    w
}

/// Stream 0's ordered FLUSH for groups up to `seq`.
fn flush(cid: u16, seq: u64) -> Sqe {
    let mut f = Sqe::default();
    f.set_opcode(op::FLUSH);
    f.set_cid(cid);
    f.set_cdw(1, 1);
    f.set_sgl(0, false);
    WireAttr {
        stream: 0,
        seq,
        seq_end: seq,
        flush: true,
        ..WireAttr::default()
    }
    .put(&mut f);
    f
}

/// Group `seq`'s write, and (when `parked`) its FLUSH sent before the write's data, so the
/// target parks the FLUSH until the data is in; else the FLUSH after the write's answer.
fn group(q: &mut Raw, seq: u64, parked: bool) {
    let (wcid, fcid) = (seq as u16 * 2, seq as u16 * 2 + 1);
    q.send_cmd(&write(wcid, seq), &[]);
    let (ty, _, cid, _) = q.next();
    assert_eq!((ty, cid), (pdu::R2T, wcid));
    if parked {
        q.send_cmd(&flush(fcid, seq), &[]);
    }
    let mut h = Vec::new();
    pdu::put_h2c_data(
        &mut h,
        wcid,
        wcid,
        0,
        &[seq as u8; 4096],
        true,
        Digests::default(),
    );
    q.s.write_all(&h).unwrap();
    let (_, cqe, cid, _) = q.next();
    assert_eq!(cid, wcid);
    assert!(cqe.expect("the write's answer").ok());
    if !parked {
        q.send_cmd(&flush(fcid, seq), &[]);
    }
    let (_, cqe, cid, _) = q.next();
    assert_eq!(cid, fcid);
    assert!(cqe.expect("the FLUSH's answer").ok());
}

/// Warmed up by writes by R2T and FLUSHes after them, a connection parks a FLUSH behind a
/// write awaiting its data, then takes the data and answers both, and none of its threads
/// allocate meanwhile. (The list of parked FLUSHes used to start empty: the first FLUSH parked
/// on a connection allocated it.)
#[test]
fn a_flush_parked_behind_a_write_awaiting_its_data_allocates_nothing() {
    HOST.with(|h| h.set(true));
    let p = PathBuf::from(format!("/dev/shm/rio-parked-{}", std::process::id()));
    let _rm = Remove(p.clone());
    std::fs::File::create(&p).unwrap().set_len(4 << 20).unwrap();
    let mut cfg = TargetConfig::new(p.clone(), TargetLogKind::Mem(1 << 20));
    cfg.streams = 1;
    // Every write's data comes by R2T.
    cfg.in_capsule = 0;
    let t = Target::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap();
    let addr = t.local_addr();
    t.spawn();
    let (_admin, mut q) = queues(addr);
    for seq in 1..=64 {
        group(&mut q, seq, false);
    }
    COUNTING.store(true, SeqCst);
    group(&mut q, 65, true);
    COUNTING.store(false, SeqCst);
    let n = COUNTED.load(SeqCst);
    assert_eq!(
        n, 0,
        "{n} allocations on the target's threads for a FLUSH parked behind a write"
    );
}
