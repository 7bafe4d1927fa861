//! A target facing writes whose data comes later (by R2T), a host that keeps sending while
//! its commands wait for request slots, and a new initiator recovering over an overwrite (from
//! a review on 2026-11-27; each test failed before its fix).

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use rio_net::pdu::{self, op, Digests, Sqe, WireAttr};
use rio_net::{Target, TargetConfig, TargetLogKind, Volume, VolumeConfig};

mod common;
use common::{lba_sqe, put, queues, read_block, Raw};

const LBA: u32 = 4096;

/// The tests run one at a time: one measures the process's memory, and the others' targets
/// would grow it (and compete for its CPU time) meanwhile.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

struct Remove(PathBuf);
impl Drop for Remove {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn target(name: &str, in_capsule: u32) -> (SocketAddr, Remove) {
    let p = PathBuf::from(format!("/dev/shm/rio-edges-{}-{name}", std::process::id()));
    let f = std::fs::File::create(&p).unwrap();
    f.set_len(16 << 20).unwrap();
    let mut cfg = TargetConfig::new(p.clone(), TargetLogKind::Mem(1 << 20));
    cfg.streams = 2;
    cfg.in_capsule = in_capsule;
    let t = Target::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap();
    let a = t.local_addr();
    t.spawn();
    (a, Remove(p))
}

fn write_cmd(cid: u16, slba: u64, in_capsule: bool) -> Sqe {
    let mut sqe = lba_sqe(op::WRITE, cid, slba, 1);
    sqe.set_sgl(LBA, in_capsule);
    sqe
}

/// The attribute of stream 0's group `seq` of one write, after group `seq - 1`, carrying `mark`.
fn one_write_group(seq: u64, mark: u64) -> WireAttr {
    WireAttr {
        stream: 0,
        seq,
        seq_end: seq,
        prev: seq - 1,
        num: 1,
        members: 1,
        boundary: true,
        mark,
        ..WireAttr::default()
    }
}

/// A plain FLUSH of namespace 1.
fn plain_flush(cid: u16) -> Sqe {
    let mut f = Sqe::default();
    f.set_opcode(op::FLUSH);
    f.set_cid(cid);
    f.set_cdw(1, 1);
    f.set_sgl(0, false);
    f
}

/// Stream 0's ordered FLUSH for groups up to `seq`, carrying `mark`.
fn ordered_flush(cid: u16, seq: u64, mark: u64) -> Sqe {
    let mut f = plain_flush(cid);
    WireAttr {
        stream: 0,
        seq,
        seq_end: seq,
        flush: true,
        mark,
        ..WireAttr::default()
    }
    .put(&mut f);
    f
}

/// The next `n` answers on `q`: command id → whether it succeeded.
fn answers(q: &mut Raw, n: usize) -> std::collections::HashMap<u16, bool> {
    (0..n)
        .map(|_| {
            let (_, cqe, cid, _) = q.next();
            (cid, cqe.expect("an answer").ok())
        })
        .collect()
}

/// Recovery over the target's log ends stream 0's durable prefix at `want`.
fn assert_prefix(admin: &mut Raw, want: u64) {
    let sc = fetch_log(admin);
    let r = rio_ordering::recover(&sc, &|_| false);
    assert_eq!(
        r.streams[0].prefix_end, want,
        "{:?} / {:?}",
        r.streams[0], sc.entries
    );
}

fn fetch_log(a: &mut Raw) -> rio_ordering::LogScan {
    let mut image = Vec::new();
    let mut total = usize::MAX;
    let mut cid = 100;
    while image.len() < total {
        let mut sqe = Sqe::default();
        sqe.set_opcode(op::RIO_GET_LOG);
        sqe.set_cid(cid);
        cid += 1;
        sqe.set_cdw(10, image.len() as u32);
        sqe.set_sgl(128 << 10, false);
        let (cqe, data) = a.command(&sqe, &[]);
        assert!(cqe.ok());
        total = cqe.dw0 as usize | (cqe.dw1 as usize) << 32;
        image.extend_from_slice(&data);
    }
    image.truncate(total);
    let mut pmr = rio_ordering::MemPmr::new(total);
    pmr.bytes_mut().copy_from_slice(&image);
    rio_ordering::scan(&pmr).unwrap()
}

/// An ordered FLUSH that arrives after an ordered write whose data still comes by R2T waits
/// for that write: its log entry certifies the write's group, so the write must be on the
/// device first. (It used to be answered at once, and recovery then counted the group durable
/// though its data reached the device after the only FLUSH.)
#[test]
fn an_ordered_flush_waits_for_an_earlier_write_still_awaiting_its_data() {
    let _serial = one_at_a_time();
    let (addr, _rm) = target("flush", 0);
    let (mut admin, mut q) = queues(addr);
    // Group 1: one write of 4 KiB at block 0, data by R2T.
    let mut w = write_cmd(10, 0, false);
    one_write_group(1, 0).put(&mut w);
    q.send_cmd(&w, &[]);
    let (ty, _, cid, _) = q.next();
    assert_eq!((ty, cid), (pdu::R2T, 10));
    // The initiator's ordered FLUSH covering group 1.
    q.send_cmd(&ordered_flush(11, 1, 0), &[]);
    assert!(
        q.next_pdu(Duration::from_millis(300)).is_none(),
        "the FLUSH was answered before the write's data came"
    );
    // The data: now the write, then the FLUSH.
    let mut h = Vec::new();
    pdu::put_h2c_data(&mut h, 10, 10, 0, &[0x5a; 4096], true, Digests::default());
    q.s.write_all(&h).unwrap();
    let mut answered = Vec::new();
    for _ in 0..2 {
        let (ty, cqe, cid, _) = q.next();
        assert_eq!(ty, pdu::RSP);
        assert!(cqe.unwrap().ok());
        answered.push(cid);
    }
    answered.sort_unstable();
    assert_eq!(answered, [10, 11]);
    // The write's entry precedes the FLUSH's in the log, and the FLUSH certifies it.
    let sc = fetch_log(&mut admin);
    let order: Vec<bool> = sc.entries.iter().map(|(_, a)| a.flush).collect();
    assert_eq!(order, [false, true], "{:?}", sc.entries);
    let r = rio_ordering::recover(&sc, &|_| false);
    assert_eq!(r.streams[0].prefix_end, 2, "{:?}", r.streams[0]);
}

fn rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap()
}

/// A host whose commands wait for request slots and that keeps sending is held back by the
/// socket: the target stops reading once a few PDUs' worth is pending. (Its receive buffer used
/// to grow with everything the host sent: 256 MiB for 192 MiB sent here.)
#[test]
fn a_starved_connection_stops_reading() {
    let _serial = one_at_a_time();
    let (addr, _rm) = target("starve", 0);
    let (_admin, mut q) = queues(addr);
    // 256 writes whose data never comes: every request slot is reserved.
    for cid in 0..256u16 {
        q.send_cmd(&write_cmd(cid + 10, cid as u64, false), &[]);
    }
    for _ in 0..256 {
        let (ty, _, _, _) = q.next();
        assert_eq!(ty, pdu::R2T);
    }
    let before = rss_kib();
    // The next command waits for a slot; what follows it must not all be buffered.
    let mut b = Vec::new();
    pdu::put_cmd(
        &mut b,
        &write_cmd(400, 300, true),
        &[0u8; 4096],
        Digests::default(),
    );
    let chunk = vec![0u8; 1 << 20];
    q.s.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
    q.s.write_all(&b).unwrap();
    let mut sent = 0u64;
    for _ in 0..192 {
        if q.s.write_all(&chunk).is_err() {
            break;
        }
        sent += 1;
    }
    std::thread::sleep(Duration::from_millis(500));
    let after = rss_kib();
    assert!(sent < 192, "the target took all {sent} MiB");
    assert!(
        after < before + 64 * 1024,
        "the target buffered {} MiB for one starved connection ({sent} MiB sent)",
        (after - before) / 1024
    );
}

/// A block acknowledged durable and then overwritten in place by a group that is still beyond
/// the durable prefix when the initiator dies: a new initiator's recovery leaves the overwrite
/// as it lies (the block reads the old or the new bytes). Written with `submit`, the overwrite
/// was zeroed, and the acknowledged contents with it; `submit_in_place` marks it.
#[test]
fn recovery_keeps_an_acknowledged_block_under_an_unflushed_overwrite_in_place() {
    let _serial = one_at_a_time();
    let (addr, _rm) = target("ipu", 128 << 10);
    let (mut v, _) = Volume::open(VolumeConfig::new(vec![addr], 1)).unwrap();
    let mut b = v.alloc(4096).unwrap();
    b.fill(0x11);
    v.submit(0, 0, b, true).unwrap();
    v.wait(0).unwrap();
    let d = v.poll().unwrap();
    assert!(
        d.len() == 1 && d[0].result.is_ok(),
        "group 1 acknowledged durable"
    );
    // Group 2 overwrites block 0; the initiator "crashes" right after sending it.
    let mut b = v.alloc(4096).unwrap();
    b.fill(0x22);
    v.submit_in_place(0, 0, b, true).unwrap();
    let _ = v.poll().unwrap();
    drop(v);
    std::thread::sleep(Duration::from_millis(300));
    let (mut v, rep) = Volume::open(VolumeConfig::new(vec![addr], 1)).unwrap();
    let b = v.alloc(4096).unwrap();
    v.read(0, 0, b).unwrap();
    let d = v.wait_any().unwrap();
    let x = d[0].buf[0];
    assert!(
        x == 0x11 || x == 0x22,
        "acknowledged group 1's block reads {x:#x} (recovery: {rep:?})"
    );
}

/// What a connection or a group counts in 16 bits is bounded before anything is sent: a merged
/// command no larger than a target takes, and no more commands out per stream than
/// `max_commands` (one per stripe a request touches). A request that alone (or with its open
/// group) would pass it is refused with the figures; one that only has to wait for earlier
/// requests waits, and everything still lands (from a review: these used to wrap silently).
#[test]
fn limits_on_commands_are_refused_up_front_or_waited_for() {
    let _serial = one_at_a_time();
    let (addr, _rm) = target("limits", 128 << 10);
    let mut cfg = VolumeConfig::new(vec![addr], 1);
    cfg.batch = 4;
    cfg.max_merge_bytes = 256 << 10;
    let e = Volume::open(cfg)
        .err()
        .expect("a merge past MAX_DATA is refused");
    assert!(e.to_string().contains("max_merge_bytes 262144"), "{e}");
    let mut cfg = VolumeConfig::new(vec![addr], 1);
    cfg.max_commands = rio_net::MAX_PIECES + 1;
    assert!(Volume::open(cfg).is_err());

    let mut cfg = VolumeConfig::new(vec![addr], 1);
    cfg.max_commands = 8;
    let (mut v, _) = Volume::open(cfg).unwrap();
    // 16 stripes at once: never fits.
    let b = v.alloc(64 << 10).unwrap();
    let e = v.submit(0, 0, b, true).unwrap_err().to_string();
    assert!(e.contains("16 commands") && e.contains("at most 8"), "{e}");
    let b = v.alloc(64 << 10).unwrap();
    let e = v.read(0, 0, b).unwrap_err().to_string();
    assert!(e.contains("16 commands"), "{e}");
    // An open group of 6 stripes, and 4 more in the same group: refused, the group stays.
    let mut b = v.alloc(6 * 4096).unwrap();
    b.fill(0x5a);
    v.submit(0, 1 << 20, b, false).unwrap();
    let b = v.alloc(4 * 4096).unwrap();
    let e = v.submit(0, 2 << 20, b, false).unwrap_err().to_string();
    assert!(e.contains("write less per group"), "{e}");
    v.wait(0).unwrap();
    assert!(v.poll().unwrap().iter().all(|d| d.result.is_ok()));
    // 40 groups of 3 stripes each, one after another: each waits for room, and all land.
    for i in 0..40u64 {
        let mut b = v.alloc(3 * 4096).unwrap();
        b.fill(i as u8 + 1);
        v.submit(0, i * 3 * 4096, b, true).unwrap();
    }
    v.wait(0).unwrap();
    let done = v.poll().unwrap();
    assert!(done.iter().all(|d| d.result.is_ok()));
    let peak = v.stats().peak_commands;
    assert!((3..=8).contains(&peak), "peak commands {peak}");
    for i in 0..40u64 {
        let b = v.alloc(3 * 4096).unwrap();
        v.read(0, i * 3 * 4096, b).unwrap();
        let d = v.wait_any().unwrap();
        assert!(
            d[0].buf.iter().all(|&x| x == i as u8 + 1),
            "group {i} reads back"
        );
    }
}

/// Submit one 4 KiB group of `byte` at block `block`, as its own group.
/// Groups 2 and 3 after an acknowledged group 1, with the target's device failing what
/// `fail` says. Both come back failed (group 3 was sent after group 2, and must not become
/// durable without it); the volume then recovers by itself (their writes zeroed, the logs
/// reset), and group 4 written after that is durable. A recovery asked for by the caller works
/// too. Then the initiator goes away, and a new one's recovery finds exactly what was
/// acknowledged.
fn fail_then_recover(fail: &std::sync::atomic::AtomicU32, name: &str) {
    let (addr, _rm) = target(name, 128 << 10);
    let (mut v, _) = Volume::open(VolumeConfig::new(vec![addr], 1)).unwrap();
    put(&mut v, 0, 0x11);
    v.wait(0).unwrap();
    assert!(v.poll().unwrap().iter().all(|d| d.result.is_ok()));
    fail.store(1, std::sync::atomic::Ordering::Relaxed);
    put(&mut v, 1, 0x22);
    put(&mut v, 2, 0x33);
    let _ = v.wait(0);
    let mut done = v.poll().unwrap();
    fail.store(0, std::sync::atomic::Ordering::Relaxed);
    done.sort_by_key(|d| d.seq);
    assert_eq!(done.len(), 2);
    assert!(done[0].result.is_err(), "group 2 comes back failed");
    assert!(
        done.iter().all(|d| d.result.is_err()),
        "groups 2 and 3 come back failed"
    );
    assert!(v.stats().recoveries >= 1, "the volume recovered by itself");
    put(&mut v, 3, 0x44);
    v.wait(0).unwrap();
    let done = v.poll().unwrap();
    assert!(
        done.iter().all(|d| d.result.is_ok()),
        "a group after the recovery is durable: {:?}",
        done.iter().map(|d| &d.result).collect::<Vec<_>>()
    );
    v.recover()
        .expect("a recovery the caller asks for after a failure");
    drop(v);
    std::thread::sleep(Duration::from_millis(300));
    let (mut v, rep) = Volume::open(VolumeConfig::new(vec![addr], 1)).unwrap();
    assert_eq!(read_block(&mut v, 0), 0x11, "acknowledged group 1 survives");
    assert_eq!(
        read_block(&mut v, 1),
        0,
        "the failed group's write is not kept ({rep:?})"
    );
    assert_eq!(read_block(&mut v, 2), 0, "group 3 is not kept either");
    assert_eq!(read_block(&mut v, 3), 0x44, "group 4 survives");
}

/// A write the target's device failed is not durable, whatever FLUSH comes after it. (It kept
/// its log entry, the next FLUSH entry vouched for it and the initiator's mark moved past it,
/// so recovery counted group 2 durable.)
#[test]
fn a_write_the_device_failed_is_never_counted_durable() {
    let _serial = one_at_a_time();
    fail_then_recover(&rio_net::target::TEST_FAIL_ORDERED_WRITES, "failw");
}

/// A FLUSH the target's device failed may have dropped the writes before it: a FLUSH that
/// succeeds later does not vouch for them. (The initiator sent another FLUSH, and its success
/// made group 2 `Ok` and counted durable by recovery.)
#[test]
fn a_failed_flush_is_final_for_what_it_covered() {
    let _serial = one_at_a_time();
    fail_then_recover(&rio_net::target::TEST_FAIL_ORDERED_FLUSHES, "failf");
}

/// The target side of a failed write: a FLUSH that an initiator sent before it heard of the
/// failure (here in the same burst as the write) logs an entry that does not vouch for the
/// failed group, and a mark past it frees nothing of it. Recovery's prefix then ends before it.
/// (The FLUSH entry used to name group 2, and recovery counted it durable.)
#[test]
fn a_flush_sent_behind_a_failing_write_does_not_vouch_for_it() {
    let _serial = one_at_a_time();
    let (addr, _rm) = target("failraw", 128 << 10);
    let (mut admin, mut q) = queues(addr);
    let flush = ordered_flush;
    // Group 1, flushed.
    let mut w = write_cmd(10, 0, true);
    one_write_group(1, 0).put(&mut w);
    q.send_cmd(&w, &[0x11; 4096]);
    q.send_cmd(&flush(11, 1, 0), &[]);
    for _ in 0..2 {
        let (_, cqe, _, _) = q.next();
        assert!(cqe.unwrap().ok());
    }
    // Group 2 fails on the device; a FLUSH for it and group 3 (sent at once, with a mark
    // claiming group 2 durable) follows.
    rio_net::target::TEST_FAIL_ORDERED_WRITES.store(1, std::sync::atomic::Ordering::Relaxed);
    let mut w = write_cmd(12, 1, true);
    one_write_group(2, 2).put(&mut w);
    q.send_cmd(&w, &[0x22; 4096]);
    let mut w = write_cmd(13, 2, true);
    one_write_group(3, 0).put(&mut w);
    q.send_cmd(&w, &[0x33; 4096]);
    q.send_cmd(&flush(14, 3, 3), &[]);
    let status = answers(&mut q, 3);
    rio_net::target::TEST_FAIL_ORDERED_WRITES.store(0, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(status.get(&12), Some(&false), "group 2's write failed");
    assert_prefix(&mut admin, 2);
}

/// A connection from before a recovery's reset speaks of a log that is gone: its marks are
/// refused. (A late mark from the old generation used to be taken: here it named the new
/// generation's unflushed group 1 durable, so its slot could be reused, and the header
/// rewritten to cover it, once the log came round.)
#[test]
fn a_mark_from_before_the_last_reset_is_refused() {
    let _serial = one_at_a_time();
    let (addr, _rm) = target("gen", 128 << 10);
    let (mut admin, mut old) = queues(addr);
    let mut reset = Sqe::default();
    reset.set_opcode(op::RIO_RESET);
    reset.set_cid(20);
    let marks: Vec<u8> = [1u64, 1].iter().flat_map(|m| m.to_le_bytes()).collect();
    reset.set_sgl(marks.len() as u32, true);
    let (cqe, _) = admin.command(&reset, &marks);
    assert!(cqe.ok());
    // The new generation: group 1 written, not flushed.
    let (_admin2, mut q) = queues(addr);
    let mut w = write_cmd(10, 0, true);
    one_write_group(1, 0).put(&mut w);
    let (cqe, _) = q.command(&w, &[0x11; 4096]);
    assert!(cqe.ok());
    // The old connection's mark says group 1 is durable.
    let mut m = Sqe::default();
    m.set_opcode(op::RIO_MARK);
    m.set_cid(30);
    m.ensure_sgl();
    m.set_cdw(10, 0);
    m.set_cdw(11, 2);
    m.set_cdw(12, 0);
    let (cqe, _) = old.command(&m, &[]);
    assert!(!cqe.ok(), "a mark from the old generation is refused");
    assert_prefix(&mut admin, 1);
}

/// An ordered FLUSH of group 1 that goes into the log before another FLUSH out with it fails:
/// its success no longer vouches for group 1 (its entry went in uncapped, before the failure
/// was known). Only a host with two ordered FLUSHes out at once gets here; the crate's
/// initiator keeps one. (From a second review; the target used to set its persist word.)
#[test]
fn a_flush_out_with_a_failing_one_does_not_vouch_for_what_it_may_have_dropped() {
    let _serial = one_at_a_time();
    let (addr, _rm) = target("cflush", 0);
    let (mut admin, mut q) = queues(addr);
    let flush = |cid: u16| ordered_flush(cid, 1, 0);
    let mut w = write_cmd(10, 0, false);
    one_write_group(1, 0).put(&mut w);
    q.send_cmd(&w, &[]);
    let (ty, _, cid, _) = q.next();
    assert_eq!((ty, cid), (pdu::R2T, 10));
    // Both FLUSHes wait for the write's data, then go out together.
    q.send_cmd(&flush(11), &[]);
    q.send_cmd(&flush(12), &[]);
    std::thread::sleep(Duration::from_millis(100));
    rio_net::target::TEST_FAIL_ORDERED_FLUSHES.store(1, std::sync::atomic::Ordering::Relaxed);
    let mut h = Vec::new();
    pdu::put_h2c_data(&mut h, 10, 10, 0, &[0x5a; 4096], true, Digests::default());
    q.s.write_all(&h).unwrap();
    let ok = answers(&mut q, 3);
    rio_net::target::TEST_FAIL_ORDERED_FLUSHES.store(0, std::sync::atomic::Ordering::Relaxed);
    // One failed on the device; the other is answered RIO_NOT_DURABLE.
    assert_eq!(ok.get(&10), Some(&true), "the write: {ok:?}");
    assert_eq!(
        ok.values().filter(|&&x| !x).count(),
        2,
        "both FLUSHes fail: {ok:?}"
    );
    assert_prefix(&mut admin, 1);
}

/// A request that waits for the command bound while the stream's open group holds more
/// requests than the window's low mark returns once the bound has room: the open group's
/// requests are not out, so there is nothing to wait for them. (The wait asked for the window's
/// low mark too, which those never-sent requests kept it above: `submit` never returned.)
#[test]
fn a_wait_for_commands_does_not_wait_on_the_open_group() {
    let _serial = one_at_a_time();
    let (addr, _rm) = target("hang", 128 << 10);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut cfg = VolumeConfig::new(vec![addr], 1);
        cfg.window = 9;
        cfg.max_commands = 12;
        let (mut v, _) = Volume::open(cfg).unwrap();
        let b = v.alloc(5 * 4096).unwrap();
        v.submit(0, 0, b, true).unwrap();
        for i in 0..7u64 {
            let b = v.alloc(4096).unwrap();
            v.submit(0, (16 + i) * 4096, b, false).unwrap();
        }
        // 12 commands taken (5 sent, 7 open): this one waits for the sent group.
        let b = v.alloc(4096).unwrap();
        let r = v.submit(0, 30 * 4096, b, true);
        let _ = tx.send(r.is_ok());
        v.wait(0).unwrap();
        let all_ok = v.poll().unwrap().iter().all(|d| d.result.is_ok());
        let _ = tx.send(all_ok);
    });
    let r = rx.recv_timeout(Duration::from_secs(20));
    assert_eq!(r, Ok(true), "the 9th submit returned");
    assert_eq!(rx.recv_timeout(Duration::from_secs(20)), Ok(true));
}

/// One failed write on stream 0 leaves its log entries in place until a recovery; the volume
/// recovers by itself, so stream 1 goes on writing through a small log that comes round many
/// times. (Without that, stream 0's entries from the failed group on were never freed, the
/// ring filled, and stream 1's writes stalled until the connection timed out.)
#[test]
fn one_failed_write_does_not_stall_the_other_streams() {
    let _serial = one_at_a_time();
    let p = PathBuf::from(format!("/dev/shm/rio-edges-{}-ring", std::process::id()));
    let f = std::fs::File::create(&p).unwrap();
    f.set_len(16 << 20).unwrap();
    let _rm = Remove(p.clone());
    let mut tc = TargetConfig::new(p.clone(), TargetLogKind::Mem(64 << 10));
    tc.streams = 2;
    let t = Target::bind("127.0.0.1:0".parse().unwrap(), tc).unwrap();
    let addr = t.local_addr();
    t.spawn();
    let mut cfg = VolumeConfig::new(vec![addr], 2);
    cfg.window = 8;
    cfg.io_timeout = Duration::from_secs(2);
    cfg.reconnect_for = Duration::from_secs(1);
    let (mut v, _) = Volume::open(cfg).unwrap();
    rio_net::target::TEST_FAIL_ORDERED_WRITES.store(1, std::sync::atomic::Ordering::Relaxed);
    let b = v.alloc(4096).unwrap();
    v.submit(0, 0, b, true).unwrap();
    let _ = v.wait(0);
    rio_net::target::TEST_FAIL_ORDERED_WRITES.store(0, std::sync::atomic::Ordering::Relaxed);
    for i in 1..4u64 {
        let b = v.alloc(4096).unwrap();
        v.submit(0, i * 4096, b, true).unwrap();
    }
    let _ = v.wait(0);
    let _ = v.poll();
    let mut failed = 0;
    for i in 0..3000u64 {
        let b = v.alloc(4096).unwrap();
        v.submit(1, (1000 + i % 2000) * 4096, b, true)
            .unwrap_or_else(|e| panic!("stream 1, write {i}: {e}"));
        failed += v
            .poll()
            .unwrap()
            .iter()
            .filter(|d| d.result.is_err())
            .count();
    }
    v.wait(1).unwrap();
    failed += v
        .poll()
        .unwrap()
        .iter()
        .filter(|d| d.result.is_err())
        .count();
    assert_eq!(failed, 0, "stream 1's writes failed");
}

/// A plain FLUSH that fails on a target (from any host) may have dropped any stream's writes
/// there: the target's next ordered FLUSH of a stream, though the device completes it, is
/// answered `RIO_NOT_DURABLE`, so the group it was for comes back failed instead of `Ok`, and
/// the volume recovers. (It was answered with success: the group came back `Ok`, the volume's
/// recovery then refused to run, and a new initiator zeroed the acknowledged group. From a
/// third review.)
#[test]
fn after_a_failed_plain_flush_no_group_is_acknowledged_that_the_log_does_not_vouch_for() {
    let _serial = one_at_a_time();
    let (addr, _rm) = target("plainf", 128 << 10);
    let cfg = VolumeConfig::new(vec![addr], 1);
    let (mut v, _) = Volume::open(cfg.clone()).unwrap();
    // Another host's plain FLUSH fails on the device.
    let (_admin, mut q) = queues(addr);
    let f = plain_flush(7);
    rio_net::target::TEST_FAIL_PLAIN_FLUSHES.store(1, std::sync::atomic::Ordering::Relaxed);
    let (cqe, _) = q.command(&f, &[]);
    rio_net::target::TEST_FAIL_PLAIN_FLUSHES.store(0, std::sync::atomic::Ordering::Relaxed);
    assert!(!cqe.ok(), "the plain FLUSH failed");
    put(&mut v, 0, 0x11);
    let _ = v.wait(0);
    let done = v.poll().unwrap();
    assert_eq!(done.len(), 1);
    assert!(done[0].result.is_err(), "group 1 is not acknowledged");
    // After the recovery that followed, the stream works again.
    put(&mut v, 1, 0x22);
    v.wait(0).unwrap();
    assert!(v.poll().unwrap().iter().all(|d| d.result.is_ok()));
    v.recover().expect("recovery");
    drop(v);
    std::thread::sleep(Duration::from_millis(300));
    let (mut v, _) = Volume::open(cfg).unwrap();
    assert_eq!(
        read_block(&mut v, 1),
        0x22,
        "the acknowledged group 2 survives"
    );
}

/// `flush_all` reports a FLUSH the device failed. (It returned `Ok`: the failed completion
/// started a recovery, and the wait then found nothing outstanding.)
#[test]
fn flush_all_reports_a_failed_flush() {
    let _serial = one_at_a_time();
    let (addr, _rm) = target("plainf3", 128 << 10);
    let (mut v, _) = Volume::open(VolumeConfig::new(vec![addr], 1)).unwrap();
    rio_net::target::TEST_FAIL_PLAIN_FLUSHES.store(1, std::sync::atomic::Ordering::Relaxed);
    let r = v.flush_all(0);
    rio_net::target::TEST_FAIL_PLAIN_FLUSHES.store(0, std::sync::atomic::Ordering::Relaxed);
    assert!(r.is_err(), "flush_all after its FLUSH failed: {r:?}");
    assert!(v.flush_all(0).is_ok(), "and the next one succeeds");
}

/// A FLUSH that fails on one of two targets, where that target has vouched for fewer of the
/// stream's groups than the other: its group comes back failed, and the volume recovers. (The
/// pieces waited on that connection for a FLUSH that would succeed, and every later one was
/// refused: 1,916 refused FLUSHes in 10 s and no hand-back. From a fourth review.)
#[test]
fn a_failed_flush_on_one_of_two_targets_hands_its_group_back() {
    let _serial = one_at_a_time();
    let (a, _ra) = target("two-a", 128 << 10);
    let (b, _rb) = target("two-b", 128 << 10);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let (mut v, _) = Volume::open(VolumeConfig::new(vec![a, b], 1)).unwrap();
        put(&mut v, 0, 0x11); // group 1, on a
        v.wait(0).unwrap();
        put(&mut v, 1, 0x22); // group 2, on b
        v.wait(0).unwrap();
        assert!(v.poll().unwrap().iter().all(|d| d.result.is_ok()));
        rio_net::target::TEST_FAIL_ORDERED_FLUSHES.store(1, std::sync::atomic::Ordering::Relaxed);
        let flushes = v.stats().flushes;
        put(&mut v, 2, 0x33); // group 3, on a: its FLUSH fails
        let _ = v.wait(0);
        let done = v.poll().unwrap();
        rio_net::target::TEST_FAIL_ORDERED_FLUSHES.store(0, std::sync::atomic::Ordering::Relaxed);
        // Handed back at the failure, not after a storm of refused FLUSHes ended by the
        // connection's time-out.
        let sent = v.stats().flushes - flushes;
        let failed = done.len() == 1 && done[0].result.is_err() && sent < 100;
        put(&mut v, 3, 0x44);
        v.wait(0).unwrap();
        let after = v.poll().unwrap().iter().all(|d| d.result.is_ok());
        let _ = tx.send((failed, after, v.stats().recoveries));
    });
    let (failed, after, recoveries) = rx.recv_timeout(Duration::from_secs(30)).unwrap();
    assert!(failed, "group 3 comes back failed, after a few FLUSHes");
    assert!(after && recoveries >= 1, "the volume recovered and goes on");
}

/// `RIO_FENCE` (sent by every recovery before it reads the logs): a connection opened before it
/// can no longer write — its orderless writes and zeroing are refused with Reservation
/// Conflict and never reach the device, an ordered write closes it without entering the log —
/// while it can still read, and connections opened after the fence write as before.
#[test]
fn a_fence_shuts_older_connections_out_of_the_device() {
    let _serial = one_at_a_time();
    let (addr, _rm) = target("fence", 128 << 10);
    let (mut admin, mut old) = queues(addr);
    let (cqe, _) = old.command(&write_cmd(1, 3, true), &[0x11; 4096]);
    assert!(cqe.ok());
    let mut fence = Sqe::default();
    fence.set_opcode(op::RIO_FENCE);
    fence.set_cid(2);
    fence.ensure_sgl();
    let (cqe, _) = admin.command(&fence, &[]);
    assert!(
        cqe.ok(),
        "the fence is answered once older connections are idle"
    );

    // Reservation Conflict.
    let refused = |cqe: pdu::Cqe| cqe.sct_sc() == (0, 0x83);
    let (cqe, _) = old.command(&write_cmd(3, 3, true), &[0x22; 4096]);
    assert!(
        refused(cqe),
        "an older connection's write: {:?}",
        cqe.sct_sc()
    );
    let mut z = write_cmd(4, 3, false);
    z.set_opcode(op::WRITE_ZEROES);
    z.set_sgl(0, false);
    let (cqe, _) = old.command(&z, &[]);
    assert!(
        refused(cqe),
        "an older connection's zeroing: {:?}",
        cqe.sct_sc()
    );
    let read_block_3 = |q: &mut Raw, cid: u16| {
        let mut r = write_cmd(cid, 3, false);
        r.set_opcode(op::READ);
        let (cqe, data) = q.command(&r, &[]);
        assert!(cqe.ok());
        data[0]
    };
    assert_eq!(
        read_block_3(&mut old, 5),
        0x11,
        "neither reached the device"
    );

    let mut w = write_cmd(6, 4, true);
    one_write_group(1, 0).put(&mut w);
    old.send_cmd(&w, &[0x33; 4096]);
    assert!(
        old.next_pdu(Duration::from_secs(5)).is_none(),
        "an older connection's ordered write closes it"
    );
    assert!(
        fetch_log(&mut admin).entries.is_empty(),
        "and leaves nothing in the log"
    );

    let (_admin2, mut new) = queues(addr);
    let (cqe, _) = new.command(&write_cmd(7, 3, true), &[0x44; 4096]);
    assert!(cqe.ok(), "a connection opened after the fence writes");
    assert_eq!(read_block_3(&mut new, 8), 0x44);
}

/// A fence is answered only once the writes older connections already sent have completed
/// on the device: the log the recovery reads next holds them, and its zeroing cannot race
/// them to the same blocks.
#[test]
fn a_fence_waits_for_older_connections_writes_on_the_device() {
    use rio_net::target::TEST_HOLD_WRITE_COMPLETION as HOLD;
    use std::sync::atomic::Ordering::Relaxed;
    let _serial = one_at_a_time();
    let (addr, _rm) = target("fence-wait", 128 << 10);
    let (mut admin, mut old) = queues(addr);
    HOLD.store(1, Relaxed);
    old.send_cmd(&write_cmd(1, 5, true), &[0x55; 4096]);
    let t0 = std::time::Instant::now();
    while HOLD.load(Relaxed) != 2 {
        assert!(t0.elapsed() < Duration::from_secs(5), "the write completes");
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut fence = Sqe::default();
    fence.set_opcode(op::RIO_FENCE);
    fence.set_cid(2);
    fence.ensure_sgl();
    admin.send_cmd(&fence, &[]);
    let early = admin.next_pdu(Duration::from_millis(300));
    HOLD.store(0, Relaxed);
    assert!(
        early.is_none(),
        "the fence was answered with an older connection's write on the device"
    );
    assert!(admin.answer().0.ok());
    assert!(old.answer().0.ok(), "the write sent before the fence");
}

/// An I/O queue takes its controller's generation, not the target's: one opened after a fence
/// under an older controller (an old initiator's Connect that the network held until then)
/// cannot write, while the fencing controller's new queues can. (It took the target's
/// generation at its Connect: the held Connect came through as current, and its writes could
/// land after the recovery's zeroing.)
#[test]
fn an_io_queue_of_a_controller_from_before_a_fence_cannot_write() {
    use common::{admin_queue, io_queue};
    let _serial = one_at_a_time();
    let (addr, _rm) = target("fence-ctrl", 128 << 10);
    let (_old_admin, old_cntlid) = admin_queue(addr);
    let (mut admin, cntlid) = admin_queue(addr);
    let mut fence = Sqe::default();
    fence.set_opcode(op::RIO_FENCE);
    fence.set_cid(2);
    fence.ensure_sgl();
    assert!(admin.command(&fence, &[]).0.ok());

    let mut late = io_queue(addr, old_cntlid);
    let (cqe, _) = late.command(&write_cmd(3, 6, true), &[0x66; 4096]);
    assert_eq!(
        cqe.sct_sc(),
        (0, 0x83),
        "a queue of the older controller, opened after the fence, is refused writes"
    );
    let mut q = io_queue(addr, cntlid);
    let (cqe, _) = q.command(&write_cmd(4, 6, true), &[0x77; 4096]);
    assert!(cqe.ok(), "the fencing controller's queue writes");
}

/// A read or Write Zeroes of `blocks` 4 KiB blocks at block `slba`.
fn lba_cmd(opcode: u8, cid: u16, slba: u64, blocks: u32) -> Sqe {
    let mut sqe = lba_sqe(opcode, cid, slba, blocks);
    let len = if opcode == op::READ { blocks * LBA } else { 0 };
    sqe.set_sgl(len, false);
    sqe
}

/// A burst of reads and Write Zeroes whose buffers together pass the connection's arena
/// waits for buffers, as writes do: every command succeeds. (From a review on 2026-11-28: the
/// commands past the arena failed with Internal Error, 0x06; a recovery zeroing more than an
/// arena's worth of 128 KiB entries on one target failed every time it was tried.)
#[test]
fn reads_and_zeroing_past_the_arena_wait_for_buffers() {
    let _serial = one_at_a_time();
    let (addr, _rm) = target("arena", 128 << 10);
    let (_admin, mut q) = queues(addr);
    // 96 reads of 128 KiB (12 MiB, the arena is 8 MiB), then 96 zeroings of 128 KiB, all sent
    // before any answer is read.
    let mut b = Vec::new();
    for i in 0..96u16 {
        let sqe = lba_cmd(op::READ, 10 + i, (i as u64 % 4) * 32, 32);
        pdu::put_cmd(&mut b, &sqe, &[], Digests::default());
    }
    for i in 0..96u16 {
        let sqe = lba_cmd(op::WRITE_ZEROES, 200 + i, 1024 + (i as u64 % 4) * 32, 32);
        pdu::put_cmd(&mut b, &sqe, &[], Digests::default());
    }
    assert!(q.send(&b));
    let mut failed = Vec::new();
    let mut data = std::collections::HashMap::<u16, usize>::new();
    let mut answered = 0;
    while answered < 192 {
        match q.next() {
            (pdu::C2H_DATA, _, cid, d) => *data.entry(cid).or_default() += d.len(),
            (_, Some(cqe), cid, _) => {
                answered += 1;
                if !cqe.ok() {
                    failed.push((cid, cqe.sct_sc()));
                }
            }
            other => panic!("unexpected PDU type {:#x}", other.0),
        }
    }
    assert!(
        failed.is_empty(),
        "{} of 192 commands failed (command id, status): {failed:?}",
        failed.len()
    );
    assert!(
        (10..106u16).all(|cid| data.get(&cid) == Some(&(128 << 10))),
        "every read got its 128 KiB"
    );
}

/// A host that sends commands whose answers carry data and never reads them is held back by
/// the socket: the target stops taking commands once a few PDUs' worth of answers wait to go
/// out. (From a review on 2026-11-28: its send buffer grew with every answer, so 72-byte Get
/// Log Page commands asking for 128 KiB each grew the target by 128 KiB apiece.)
#[test]
fn a_host_that_does_not_read_its_answers_is_held_back() {
    use common::admin_queue;
    let _serial = one_at_a_time();
    let (addr, _rm) = target("no-read", 128 << 10);
    let (mut a, _) = admin_queue(addr);
    let before = rss_kib();
    // 1,000 Get Log Page commands of 128 KiB each (125 MiB of answers), none read.
    let mut b = Vec::new();
    for i in 0..1000u16 {
        let mut sqe = Sqe::default();
        sqe.set_opcode(op::GET_LOG_PAGE);
        sqe.set_cid(10 + i);
        // NUMDL: 32 Ki dwords, minus one.
        sqe.set_cdw(10, 0x7fff << 16 | 0x02);
        sqe.set_sgl(128 << 10, false);
        pdu::put_cmd(&mut b, &sqe, &[], Digests::default());
    }
    a.s.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
    let _ = a.s.write_all(&b);
    std::thread::sleep(Duration::from_millis(1000));
    let after = rss_kib();
    assert!(
        after < before + 32 * 1024,
        "the target holds {} MiB of answers for one host that does not read them",
        (after.saturating_sub(before)) / 1024
    );
    // Reading them now, every answer comes.
    a.s.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    for _ in 0..1000 {
        let (cqe, data) = a.answer();
        assert!(cqe.ok());
        assert_eq!(data.len(), 128 << 10);
    }
}

/// `RIO_GET_LOG` answers at most one transfer's worth (`MAX_DATA`), whatever length the host's
/// descriptor says: a log of 1 GiB came back as one PDU of 1 GiB, allocated twice on the
/// target for one 72-byte command (from a review on 2026-11-28; here a 1 MiB log came back
/// as one 1 MiB C2HData, eight times the largest PDU a host takes).
#[test]
fn a_log_read_is_at_most_one_transfer() {
    use common::admin_queue;
    let _serial = one_at_a_time();
    let (addr, _rm) = target("log-read", 128 << 10);
    let (mut a, _) = admin_queue(addr);
    let mut sqe = Sqe::default();
    sqe.set_opcode(op::RIO_GET_LOG);
    sqe.set_cid(7);
    sqe.set_sgl(u32::MAX, false);
    a.send_cmd(&sqe, &[]);
    let mut pdus = Vec::new();
    loop {
        let p = a.next_pdu(Duration::from_secs(5)).expect("an answer");
        pdus.push((p[0], p.len()));
        if p[0] == pdu::RSP {
            break;
        }
    }
    let data: usize = pdus
        .iter()
        .filter(|p| p.0 == pdu::C2H_DATA)
        .map(|p| p.1 - 24)
        .sum();
    assert!(
        pdus.iter()
            .all(|p| p.1 <= rio_net::target::MAX_PDU as usize),
        "PDUs (type, bytes): {pdus:?}"
    );
    assert_eq!(data, rio_net::target::MAX_DATA as usize, "{pdus:?}");
}

/// Commands on a queue without request slots (before Connect, or the admin queue) that wait
/// for their data by R2T are bounded: a host that asks for room and never sends the data
/// cannot make the target allocate a buffer per command. Before Connect only fabrics commands
/// are taken; an admin queue holds at most a few commands awaiting data. (From a review on
/// 2026-11-28: 20,000 72-byte commands asking for 128 KiB each, before Connect, got 20,000
/// R2Ts and grew the target by 173 MiB.)
#[test]
fn commands_awaiting_data_on_queues_without_slots_are_bounded() {
    use common::admin_queue;
    let _serial = one_at_a_time();
    let (addr, _rm) = target("no-slots", 128 << 10);
    for connected in [false, true] {
        let mut q = if connected {
            admin_queue(addr).0
        } else {
            common::Raw::open(addr)
        };
        let before = rss_kib();
        let mut b = Vec::new();
        for cid in 0..20_000u16 {
            let mut sqe = Sqe::default();
            sqe.set_opcode(op::SET_FEATURES); // takes data
            sqe.set_cid(cid + 10);
            sqe.set_sgl(128 << 10, false);
            pdu::put_cmd(&mut b, &sqe, &[], Digests::default());
        }
        q.s.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
        let _ = q.s.write_all(&b);
        std::thread::sleep(Duration::from_millis(1000));
        let after = rss_kib();
        let (closed, types) = q.closed_within(Duration::from_secs(2));
        let r2ts = types.iter().filter(|&&t| t == pdu::R2T).count();
        assert!(
            closed && after < before + 16 * 1024 && r2ts <= 8,
            "connected {connected}: the target sent {r2ts} R2Ts, grew by {} MiB, closed: {closed}",
            after.saturating_sub(before) / 1024
        );
    }
}

/// A namespace size larger than the device, smaller than one block or not a whole number of
/// blocks is refused when the target is made, naming it: a larger one was cut to the device's
/// size without a word (a host then saw a smaller volume than it was told to expect), a part
/// block was dropped, and one under a block blamed the device.
/// (Found by a review of the CLI on 2026-11-28.)
#[test]
fn a_namespace_size_the_device_cannot_hold_is_refused() {
    let _one = one_at_a_time();
    let p = PathBuf::from(format!("/dev/shm/rio-edges-{}-nsbytes", std::process::id()));
    let _rm = Remove(p.clone());
    std::fs::File::create(&p)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    for ns in [
        (16 << 20) + LBA as u64,
        1 << 30,
        1,
        LBA as u64 - 1,
        (16 << 20) - 100,
    ] {
        let mut cfg = TargetConfig::new(p.clone(), TargetLogKind::Mem(1 << 20));
        cfg.ns_bytes = Some(ns);
        let Err(e) = Target::bind("127.0.0.1:0".parse().unwrap(), cfg) else {
            panic!("a namespace of {ns} bytes on a 16 MiB device was taken");
        };
        let e = e.to_string();
        assert!(e.contains("ns_bytes") && e.contains(&ns.to_string()), "{e}");
    }
    // The device's whole size, and a whole block less, are served as asked.
    for ns in [16 << 20, (16 << 20) - LBA as u64] {
        let mut cfg = TargetConfig::new(p.clone(), TargetLogKind::Mem(1 << 20));
        cfg.ns_bytes = Some(ns);
        let t = Target::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap();
        assert_eq!(t.ns_bytes(), ns);
    }
}

/// Asynchronous Event Requests beyond the limit the controller advertises (AERL 3: four
/// outstanding) are answered at once with "Asynchronous Event Request Limit Exceeded" (status
/// type 1, code 0x05); the four within it stay outstanding. Every one was kept, without limit.
/// (Found by a review on 2026-11-28.)
#[test]
fn asynchronous_event_requests_past_the_limit_are_refused() {
    let _one = one_at_a_time();
    let (addr, _rm) = target("aer", 8192);
    let (mut admin, _io) = queues(addr);
    for cid in 10..16u16 {
        let mut sqe = Sqe::default();
        sqe.set_opcode(op::ASYNC_EVENT);
        sqe.set_cid(cid);
        admin.send_cmd(&sqe, &[]);
    }
    for cid in 14..16u16 {
        let (_, cqe, got, _) = admin.next();
        let cqe = cqe.expect("an answer");
        assert_eq!(
            got, cid,
            "the requests past the limit are answered, in order"
        );
        assert_eq!(cqe.status & 0x7ff, 1 << 8 | 0x05, "{cqe:?}");
    }
    assert!(
        admin.next_pdu(Duration::from_millis(300)).is_none(),
        "the four within the limit stay outstanding"
    );
}

/// A target serves at most `TargetConfig::max_connections` connections at once: one more is
/// closed as soon as it is accepted (no ICResp), and counted; once a served connection ends,
/// its place is free and a new connection is served again. (Every connection was accepted,
/// each with a thread and an I/O queue's arena, without bound.)
#[test]
fn connections_past_the_limit_are_refused_until_one_ends() {
    let _one = one_at_a_time();
    let p = PathBuf::from(format!("/dev/shm/rio-edges-{}-maxconn", std::process::id()));
    let _rm = Remove(p.clone());
    std::fs::File::create(&p)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    let mut cfg = TargetConfig::new(p.clone(), TargetLogKind::Mem(1 << 20));
    cfg.max_connections = 3;
    let t = Target::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap();
    let (addr, stats) = (t.local_addr(), t.stats_handle());
    t.spawn();
    // Each of these has its ICResp: accepted, counted and served, in the order they came.
    let mut served: Vec<Raw> = (0..3).map(|_| Raw::open(addr)).collect();
    let mut icreq = Vec::new();
    pdu::put_icreq(&mut icreq, Digests::default(), 0);
    let mut extra = Raw::connect(addr);
    let _ = extra.send(&icreq); // the target may have closed it already
    let (closed, types) = extra.closed_within(Duration::from_secs(10));
    assert!(
        closed && types.is_empty(),
        "a 4th connection with 3 allowed: closed {closed}, PDUs {types:?} (an ICResp is 0x{:02x})",
        pdu::ICRESP
    );
    assert_eq!(stats.stats().refused_connections, 1);
    // One host leaves: once the target has ended its connection, a new one is served.
    drop(served.pop());
    let t0 = std::time::Instant::now();
    while stats.stats().open_connections > 2 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the target still counts {} connections 20 s after one left",
            stats.stats().open_connections
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    served.push(Raw::open(addr));
    let s = stats.stats();
    assert_eq!(
        (s.connections, s.open_connections, s.refused_connections),
        (4, 3, 1),
        "{s:?}"
    );
    // A limit of none is refused when the target is made.
    let mut cfg = TargetConfig::new(p.clone(), TargetLogKind::Mem(1 << 20));
    cfg.max_connections = 0;
    let Err(e) = Target::bind("127.0.0.1:0".parse().unwrap(), cfg) else {
        panic!("a target allowing no connection was made");
    };
    assert!(e.to_string().contains("max_connections"), "{e}");
}

/// Storage order is submission order for one stream's overlapping writes: group 1 writes 8 KiB
/// at 0, group 2 4 KiB at 4 KiB, group 3 4 KiB at 0, sent back to back without a wait. The
/// target served a simulated disk that completes the requests it holds in random order; it
/// had all three on the device at once, so group 1 could land after group 3 (or group 2), and
/// after `wait` returned `Ok` the disk held the older group's bytes.
#[test]
fn a_later_group_over_an_earlier_groups_bytes_lands_last() {
    let _one = one_at_a_time();
    let sim = lbio::SimDisk::new(lbio::SimConfig::new(16 << 20, 0x5eed_0e1a)).unwrap();
    let mut cfg = TargetConfig::new("sim", TargetLogKind::Mem(1 << 20));
    cfg.streams = 1;
    cfg.sim = Some(rio_net::target::SimDevice(sim.clone()));
    let t = Target::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap();
    let a = t.local_addr();
    let stats = t.stats_handle();
    t.spawn();
    let (mut v, _) = Volume::open(VolumeConfig::new(vec![a], 1)).unwrap();
    let rounds = 200u64;
    let mut wrong = Vec::new();
    for r in 0..rounds {
        let base = r * 16384;
        let fill = |v: &Volume, len: usize, byte: u8| {
            let mut b = v.alloc(len).unwrap();
            b.fill(byte);
            b
        };
        let g1 = (3 * r % 255) as u8 + 1;
        let (g2, g3) = (g1.wrapping_add(1), g1.wrapping_add(2));
        let b = fill(&v, 8192, g1);
        v.submit(0, base, b, true).unwrap();
        let b = fill(&v, 4096, g2);
        v.submit(0, base + 4096, b, true).unwrap();
        let b = fill(&v, 4096, g3);
        v.submit(0, base, b, true).unwrap();
        v.wait(0).unwrap();
        for d in v.poll().unwrap() {
            d.result.unwrap();
        }
        let view = sim.view();
        let at = base as usize;
        let (first, second) = (view[at], view[at + 4096]);
        let whole = view[at..at + 4096].iter().all(|&x| x == first)
            && view[at + 4096..at + 8192].iter().all(|&x| x == second);
        if !whole || first != g3 || second != g2 {
            wrong.push((r, first, second));
        }
    }
    let reordered = sim.stats().reordered;
    eprintln!(
        "{rounds} rounds: {} with an older group's bytes on the disk (round, first 4 KiB, \
         second 4 KiB; want groups 3 and 2): {:?}; the disk reordered {reordered} requests; \
         target: {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(8)],
        stats.stats()
    );
    assert!(
        reordered > 0,
        "the simulated disk never reordered: the test shows nothing"
    );
    assert!(
        wrong.is_empty(),
        "{} of {rounds} rounds left an older group's bytes after wait returned Ok",
        wrong.len()
    );
    assert!(
        stats.stats().overlap_waits > 0,
        "no write waited for an earlier one over its bytes"
    );
}

/// Recovery zeroes the writes beyond the durable prefix and then resets the logs, so that a
/// later recovery no longer names them: the zeroing must be durable before the reset. Here a
/// group's write is on the media (a plain FLUSH made its bytes durable, but no ordered FLUSH
/// vouches for it, so it lies beyond the prefix), a new initiator's recovery discards it, and
/// then the target loses power (its durable media kept, its file log kept). The next recovery
/// finds nothing to zero, and the discarded group's bytes read back.
#[test]
fn recovery_zeroing_is_durable_before_the_logs_are_reset() {
    let _one = one_at_a_time();
    let log = PathBuf::from(format!("/dev/shm/rio-edges-{}-zlog", std::process::id()));
    let _rm = Remove(log.clone());
    let _ = std::fs::remove_file(&log);
    let simcfg = lbio::SimConfig::new(16 << 20, 0x2e40_0001);
    let sim = lbio::SimDisk::new(simcfg).unwrap();
    let mut cfg = TargetConfig::new("sim", TargetLogKind::File(log.clone(), 1 << 20));
    cfg.streams = 1;
    cfg.sim = Some(rio_net::target::SimDevice(sim.clone()));
    let t = Target::bind("127.0.0.1:0".parse().unwrap(), cfg.clone()).unwrap();
    let a = t.local_addr();
    t.spawn();
    // A first initiator brings the log to a known epoch, and leaves.
    drop(Volume::open(VolumeConfig::new(vec![a], 1)).unwrap());
    // Group 1: 8 blocks of 0xab at block 0, sent raw; a plain FLUSH makes its bytes durable,
    // but no ordered FLUSH vouches for the group.
    {
        let (_admin, mut q) = queues(a);
        let mut w = lba_sqe(op::WRITE, 10, 0, 8);
        w.set_sgl(8 * LBA, true);
        one_write_group(1, 0).put(&mut w);
        q.send_cmd(&w, &vec![0xab; 8 * LBA as usize]);
        let (cqe, _) = q.answer();
        assert!(cqe.ok(), "group 1's write");
        let (cqe, _) = q.command(&plain_flush(11), &[]);
        assert!(cqe.ok(), "plain FLUSH");
    }
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(sim.media()[0], 0xab, "group 1's bytes are durable");
    // A new initiator recovers: group 1 lies beyond the prefix and is zeroed.
    let (v, rep) = Volume::open(VolumeConfig::new(vec![a], 1)).unwrap();
    assert_eq!(rep.discarded, 1, "{rep:?}");
    drop(v);
    std::thread::sleep(Duration::from_millis(200));
    let media = sim.media();
    let left = media[..8 * LBA as usize]
        .iter()
        .filter(|&&b| b == 0xab)
        .count();
    // Power cut: the target comes back with what was durable, and its log.
    let sim2 = lbio::SimDisk::from_image(simcfg, media).unwrap();
    cfg.sim = Some(rio_net::target::SimDevice(sim2));
    let t2 = Target::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap();
    let a2 = t2.local_addr();
    t2.spawn();
    let (mut v, rep2) = Volume::open(VolumeConfig::new(vec![a2], 1)).unwrap();
    let x = read_block(&mut v, 0);
    assert!(
        left == 0 && x == 0,
        "recovery discarded group 1 ({rep:?}) but after a power cut {left} of its bytes were \
         still durable and block 0 reads {x:#x} (second recovery: prefix {:?}, {} discarded)",
        rep2.prefix_end,
        rep2.discarded
    );
}

/// One ordered write over more stripe units of a target than its log has slots (a 4 MiB
/// write at 4 KiB stripes is 1,024 commands, each with its entry; the log has 494 slots, which
/// `Volume::open` accepts for a window of 64). The entries of the writes that went fill the
/// log, the next write waits for a slot, and the FLUSH that would make the others durable
/// (and let the initiator's mark free their slots) arrives behind it.
#[test]
fn a_write_over_more_stripe_units_than_the_log_has_slots_does_not_stall() {
    let _serial = one_at_a_time();
    let p = PathBuf::from(format!("/dev/shm/rio-edges-{}-bigw", std::process::id()));
    let f = std::fs::File::create(&p).unwrap();
    f.set_len(16 << 20).unwrap();
    let _rm = Remove(p.clone());
    let mut tc = TargetConfig::new(p.clone(), TargetLogKind::Mem(32 << 10));
    tc.streams = 1;
    let t = Target::bind("127.0.0.1:0".parse().unwrap(), tc).unwrap();
    let addr = t.local_addr();
    let stats = t.stats_handle();
    t.spawn();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut cfg = VolumeConfig::new(vec![addr], 1);
        cfg.io_timeout = Duration::from_secs(2);
        cfg.reconnect_for = Duration::from_secs(2);
        let (mut v, _) = Volume::open(cfg).unwrap();
        let mut b = v.alloc(4 << 20).unwrap();
        b.fill(0x5a);
        let r = v.submit(0, 0, b, true).and_then(|_| v.wait(0));
        let d = v
            .poll()
            .map(|d| d.into_iter().map(|d| d.result.is_ok()).collect::<Vec<_>>());
        let _ = tx.send((format!("{r:?}, {d:?}"), r, d, v.stats()));
    });
    match rx.recv_timeout(Duration::from_secs(30)) {
        Ok((what, r, d, vs)) => {
            // Handed back durable, or refused before anything went out; never a recovery.
            let refused = matches!(r, Err(rio_net::NetError::Config(_)));
            let handed_back = r.is_ok() && d.as_deref().is_ok_and(|d| d == [true]);
            assert!(
                (handed_back || refused) && vs.recoveries == 1,
                "{what}; volume {vs:?}; target {:?}",
                stats.stats()
            );
        }
        Err(_) => panic!(
            "a 4 MiB ordered write was not handed back in 30 s; target {:?}",
            stats.stats()
        ),
    }
}
