//! Recovery's edges that earlier fixes guarded by reading alone, each with a test that fails on
//! the code before its fix: a completion from before a reset that would vouch for a new entry
//! in its old slot, a recovery with more zeroing to do than a connection has command ids, a
//! recovery retried after its reset step, a `flush_all` whose connection dies under it, and a
//! recovery whose zeroing takes longer than `io_timeout` in all.
//!
//! The last three run the volume through a small TCP proxy that refuses connections, cuts one
//! at a given command (a link lost at a known point, without network namespaces), or passes
//! the target's answers on slowly.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rio_net::pdu::{self, op, Cqe, Sqe, WireAttr};
use rio_net::target::{
    TEST_FAIL_ORDERED_FLUSHES, TEST_FAIL_ORDERED_WRITES, TEST_HOLD_ORDERED_FLUSH,
};
use rio_net::{Target, TargetConfig, TargetLogKind, TargetStatsHandle, Volume, VolumeConfig};
use rio_ordering::{Attr, AttrLog, MemPmr, Pmr};

mod common;
use common::{put, queues, read_block, Raw};

const BLOCK: u64 = 4096;
/// Device bytes of each target.
const TARGET_BYTES: u64 = 16 << 20;
/// How long a test waits for something that comes at once unless the code is broken.
const HANG: Duration = Duration::from_secs(20);

/// The tests arm process-wide hooks of the target: one at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

/// Disarms the target's test hooks and removes the test's files, however the test ends.
struct Cleanup(Vec<PathBuf>);
impl Drop for Cleanup {
    fn drop(&mut self) {
        for hook in [
            &TEST_FAIL_ORDERED_WRITES,
            &TEST_FAIL_ORDERED_FLUSHES,
            &TEST_HOLD_ORDERED_FLUSH,
        ] {
            hook.store(0, Relaxed);
        }
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

fn scratch(name: &str) -> PathBuf {
    PathBuf::from(format!(
        "/dev/shm/rio-recovery-edges-{}-{name}",
        std::process::id()
    ))
}

/// A target of two log streams over a fresh file (its path is added to `cleanup`).
fn target(
    name: &str,
    log: TargetLogKind,
    cleanup: &mut Cleanup,
) -> (SocketAddr, TargetStatsHandle) {
    let dev = scratch(name);
    cleanup.0.push(dev.clone());
    std::fs::File::create(&dev)
        .and_then(|f| f.set_len(TARGET_BYTES))
        .unwrap();
    let mut cfg = TargetConfig::new(dev, log);
    cfg.streams = 2;
    let t = Target::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap();
    let addr = t.local_addr();
    let stats = t.stats_handle();
    t.spawn();
    (addr, stats)
}

/// An ordered write of one block at `block`: group `seq` of `stream`, after group `seq - 1`.
fn ordered_write(cid: u16, stream: u16, seq: u64, block: u64) -> Sqe {
    let mut w = Sqe::default();
    w.set_opcode(op::WRITE);
    w.set_cid(cid);
    w.set_cdw(1, 1);
    w.set_cdw(10, block as u32);
    w.set_cdw(11, (block >> 32) as u32);
    w.set_sgl(BLOCK as u32, true);
    WireAttr {
        stream,
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

/// `stream`'s ordered FLUSH for its groups up to `seq`.
fn ordered_flush(cid: u16, stream: u16, seq: u64) -> Sqe {
    let mut f = Sqe::default();
    f.set_opcode(op::FLUSH);
    f.set_cid(cid);
    f.set_cdw(1, 1);
    f.set_sgl(0, false);
    WireAttr {
        stream,
        seq,
        seq_end: seq,
        flush: true,
        ..WireAttr::default()
    }
    .put(&mut f);
    f
}

/// Write to `path` the image of a two-stream attribute log of `log_bytes` holding, as an
/// initiator crash could leave it, one unflushed entry per `(stream, seq, block)`: a group of
/// one 4 KiB write at `block`, after group `seq - 1`. Returns the log's slots.
fn unflushed_log(
    path: &std::path::Path,
    log_bytes: usize,
    writes: impl Iterator<Item = (u16, u64, u64)>,
) -> u32 {
    let mut log = AttrLog::format(MemPmr::new(log_bytes), 2).unwrap();
    for (stream, seq, block) in writes {
        log.append(&Attr {
            stream,
            seq,
            seq_end: seq,
            prev: seq - 1,
            offset: block * BLOCK,
            len: BLOCK as u32,
            boundary: true,
            num: 1,
            members: 1,
            ..Attr::default()
        })
        .unwrap();
    }
    let mut image = vec![0u8; log_bytes];
    log.pmr().read(0, &mut image).unwrap();
    std::fs::write(path, &image).unwrap();
    log.slots()
}

/// Where recovery over the target's log ends each stream's durable prefix (no power-loss
/// protection: only a FLUSH entry with its persist word set vouches for a write).
fn prefixes(admin: &mut Raw) -> Vec<u64> {
    let mut image = Vec::new();
    let mut total = usize::MAX;
    while image.len() < total {
        let mut get = Sqe::default();
        get.set_opcode(op::RIO_GET_LOG);
        get.set_cid(40);
        get.set_cdw(10, image.len() as u32);
        get.set_sgl(128 << 10, false);
        let (cqe, data) = admin.command(&get, &[]);
        assert!(cqe.ok(), "RIO_GET_LOG");
        total = cqe.dw0 as usize | (cqe.dw1 as usize) << 32;
        image.extend_from_slice(&data);
    }
    image.truncate(total);
    let mut pmr = MemPmr::new(total);
    pmr.bytes_mut().copy_from_slice(&image);
    let scan = rio_ordering::scan(&pmr).unwrap();
    rio_ordering::recover(&scan, &|_| false).resume_marks()
}

/// A FLUSH of a connection from before a reset that completes after it must not set the
/// persist word of the slot it had: the reset log may hold another entry there by then. Here
/// the old connection's FLUSH (stream 1) is held at its completion while the log is reset and
/// stream 0 writes group 1 and FLUSHes it into the same two slots, that FLUSH failing on the
/// device. Released, the old FLUSH's persist word would be exactly stream 0's failed FLUSH
/// entry's (same slot, same group number, the new epoch), and recovery would count stream 0's
/// group 1 durable. (The persist-word half of the generation check: the target checks the
/// connection's generation before setting it.)
#[test]
fn a_flush_completing_after_a_reset_sets_no_persist_word_in_the_new_log() {
    let _serial = one_at_a_time();
    let mut cleanup = Cleanup(Vec::new());
    let (addr, _) = target("hold", TargetLogKind::Mem(1 << 20), &mut cleanup);
    let (mut admin, mut old) = queues(addr);
    // The old generation: stream 1's group 1 in slot 0, its FLUSH in slot 1, held at completion.
    let (cqe, _) = old.command(&ordered_write(10, 1, 1, 100), &[0x11; BLOCK as usize]);
    assert!(cqe.ok(), "the old connection's write");
    TEST_HOLD_ORDERED_FLUSH.store(1, Relaxed);
    old.send_cmd(&ordered_flush(11, 1, 1), &[]);
    let deadline = Instant::now() + HANG;
    while TEST_HOLD_ORDERED_FLUSH.load(Relaxed) != 2 {
        assert!(Instant::now() < deadline, "the old FLUSH never completed");
        std::thread::sleep(Duration::from_millis(1));
    }
    // Recovery resets the log: a new generation, slots from 0 again.
    let mut reset = Sqe::default();
    reset.set_opcode(op::RIO_RESET);
    reset.set_cid(20);
    let marks: Vec<u8> = [1u64, 1].iter().flat_map(|m| m.to_le_bytes()).collect();
    reset.set_sgl(marks.len() as u32, true);
    let (cqe, _) = admin.command(&reset, &marks);
    assert!(cqe.ok(), "RIO_RESET");
    // The new generation: stream 0's group 1 in slot 0, its FLUSH in slot 1 failing.
    let (_admin2, mut new) = queues(addr);
    let (cqe, _) = new.command(&ordered_write(10, 0, 1, 0), &[0x22; BLOCK as usize]);
    assert!(cqe.ok(), "the new connection's write");
    TEST_FAIL_ORDERED_FLUSHES.store(1, Relaxed);
    let (cqe, _) = new.command(&ordered_flush(11, 0, 1), &[]);
    TEST_FAIL_ORDERED_FLUSHES.store(0, Relaxed);
    assert!(!cqe.ok(), "the new FLUSH failed on the device");
    assert_eq!(
        prefixes(&mut admin),
        [1, 1],
        "before the old FLUSH completes"
    );
    // The old FLUSH completes now.
    TEST_HOLD_ORDERED_FLUSH.store(0, Relaxed);
    let (cqe, _) = old.answer();
    assert_eq!(
        prefixes(&mut admin),
        [1, 1],
        "stream 0's group 1, whose only FLUSH failed, counted durable after the old generation's FLUSH completed"
    );
    assert!(
        !cqe.ok(),
        "the old generation's FLUSH is answered as durable: {:?}",
        cqe.sct_sc()
    );
}

/// Recovery zeroes the writes beyond the durable prefixes over one connection per target, a
/// command each: with more of them than a connection has command ids (65,536), it waits for
/// those out every `ZEROES_OUT` (4,096). Here a target's log holds 66,000 unflushed writes of
/// two streams (33,000 each, within what one stream may have out), as an initiator crash could
/// leave it; a new initiator's recovery zeroes every one (it ran out of command ids and
/// panicked), and what no entry names is left alone.
#[test]
fn recovery_zeroes_more_writes_than_a_connection_has_command_ids() {
    const WRITES: u64 = 66_000;
    /// The writes go round this many blocks (later ones overwrite earlier ones).
    const SPAN: u64 = 256;
    let _serial = one_at_a_time();
    let mut cleanup = Cleanup(Vec::new());
    // The log as the crash left it, written where the target will find it.
    let log_path = scratch("zero-log");
    cleanup.0.push(log_path.clone());
    let log_bytes = 5 << 20;
    let slots = unflushed_log(
        &log_path,
        log_bytes,
        (0..WRITES).map(|i| ((i % 2) as u16, i / 2 + 1, i % SPAN)),
    );
    assert!(slots as u64 > WRITES);
    let (addr, stats) = target(
        "zero",
        TargetLogKind::File(log_path, log_bytes),
        &mut cleanup,
    );
    // The written blocks hold data, and so does the block after them.
    {
        let dev = std::fs::OpenOptions::new()
            .write(true)
            .open(scratch("zero"))
            .unwrap();
        let fill = vec![0xab; ((SPAN + 1) * BLOCK) as usize];
        std::os::unix::fs::FileExt::write_all_at(&dev, &fill, 0).unwrap();
    }
    let (mut v, rep) = Volume::open(VolumeConfig::new(vec![addr], 2)).unwrap();
    assert_eq!(rep.prefix_end, [1, 1]);
    assert_eq!(rep.discarded as u64, WRITES, "writes zeroed");
    assert!(
        stats.stats().orderless > WRITES,
        "the target took a command per write, and a FLUSH: {:?}",
        stats.stats()
    );
    for chunk in 0..SPAN * BLOCK / (128 << 10) {
        let b = v.alloc(128 << 10).unwrap();
        v.read(0, chunk * (128 << 10), b).unwrap();
        let d = v.wait_any().unwrap();
        assert!(d[0].result.is_ok(), "{:?}", d[0].result);
        assert!(
            d[0].buf.iter().all(|&x| x == 0),
            "bytes {} to {} were not zeroed",
            chunk * (128 << 10),
            (chunk + 1) * (128 << 10)
        );
    }
    let b = v.alloc(BLOCK as usize).unwrap();
    v.read(0, SPAN * BLOCK, b).unwrap();
    let d = v.wait_any().unwrap();
    assert!(
        d[0].buf.iter().all(|&x| x == 0xab),
        "a block no entry names was zeroed"
    );
}

/// What [`Proxy`] does.
const FORWARD: u8 = 0;
/// Forward the target's answers up to the first failed one, then cut that connection and
/// go on as [`REFUSE_AFTER_RESET`].
const CUT_AFTER_ERROR: u8 = 1;
/// Forward, and refuse the first connection made once a RIO_RESET has gone through.
const REFUSE_AFTER_RESET: u8 = 2;
/// Refuse the next connection, then forward.
const REFUSE_ONE: u8 = 3;
/// Forward, but cut the connection that carries the next plain FLUSH (the FLUSH is not sent
/// on), then forward again.
const CUT_AT_FLUSH: u8 = 4;
/// Forward, holding each of the target's answers for [`SLOW_ANSWER`] first.
const SLOW_ANSWERS: u8 = 5;
const SLOW_ANSWER: Duration = Duration::from_millis(10);
/// An admin opcode no target knows (vendor specific, unused): what [`Proxy::hide_rio`] turns
/// RIO_INFO into.
const UNKNOWN_ADMIN_OPCODE: u8 = 0xcf;

/// A TCP proxy in front of a target that loses links where a test says.
struct Proxy {
    addr: SocketAddr,
    mode: Arc<AtomicU8>,
    /// Connections refused, and connections cut.
    refused: Arc<AtomicU32>,
    cut: Arc<AtomicU32>,
    /// Pass RIO_INFO on as an opcode the target does not know: it then answers as a standard
    /// NVMe/TCP target (Invalid Opcode).
    hide_rio: Arc<AtomicBool>,
}

/// What a proxy does with one PDU.
#[derive(PartialEq)]
enum Pass {
    On,
    OnThenCut,
    Cut,
}

impl Proxy {
    fn start(target: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let p = Proxy {
            addr: listener.local_addr().unwrap(),
            mode: Arc::new(AtomicU8::new(FORWARD)),
            refused: Arc::new(AtomicU32::new(0)),
            cut: Arc::new(AtomicU32::new(0)),
            hide_rio: Arc::new(AtomicBool::new(false)),
        };
        let (mode, refused, cut) = (p.mode.clone(), p.refused.clone(), p.cut.clone());
        let hide_rio = p.hide_rio.clone();
        std::thread::spawn(move || {
            for host in listener.incoming() {
                let Ok(host) = host else { continue };
                if mode
                    .compare_exchange(REFUSE_ONE, FORWARD, Relaxed, Relaxed)
                    .is_ok()
                {
                    refused.fetch_add(1, Relaxed);
                    continue; // dropped: closed
                }
                let Ok(up) = TcpStream::connect(target) else {
                    continue;
                };
                let (host2, up2) = (host.try_clone().unwrap(), up.try_clone().unwrap());
                let (mode2, cut2) = (mode.clone(), cut.clone());
                let (mode, cut) = (mode.clone(), cut.clone());
                let hide_rio = hide_rio.clone();
                std::thread::spawn(move || {
                    pump(host, up, |p| {
                        if p[0] != pdu::CMD || p.len() < pdu::CMD_HLEN {
                            return Pass::On;
                        }
                        let mut sqe = Sqe::default();
                        sqe.0.copy_from_slice(&p[pdu::CH_BYTES..pdu::CMD_HLEN]);
                        if sqe.opcode() == op::RIO_INFO && hide_rio.load(Relaxed) {
                            // No header digests here: the opcode byte is all that changes.
                            p[pdu::CH_BYTES] = UNKNOWN_ADMIN_OPCODE;
                        }
                        if sqe.opcode() == op::RIO_RESET {
                            let _ = mode.compare_exchange(
                                REFUSE_AFTER_RESET,
                                REFUSE_ONE,
                                Relaxed,
                                Relaxed,
                            );
                        }
                        let plain_flush = sqe.opcode() == op::FLUSH && sqe.rio_op() == 0;
                        if plain_flush
                            && mode
                                .compare_exchange(CUT_AT_FLUSH, FORWARD, Relaxed, Relaxed)
                                .is_ok()
                        {
                            cut.fetch_add(1, Relaxed);
                            return Pass::Cut;
                        }
                        Pass::On
                    })
                });
                std::thread::spawn(move || {
                    pump(up2, host2, |p| {
                        if p[0] == pdu::RSP && mode2.load(Relaxed) == SLOW_ANSWERS {
                            std::thread::sleep(SLOW_ANSWER);
                        }
                        let failed = p[0] == pdu::RSP
                            && p.len() >= pdu::RSP_HLEN
                            && !Cqe::decode(&p[pdu::CH_BYTES..pdu::RSP_HLEN]).ok();
                        if failed
                            && mode2
                                .compare_exchange(
                                    CUT_AFTER_ERROR,
                                    REFUSE_AFTER_RESET,
                                    Relaxed,
                                    Relaxed,
                                )
                                .is_ok()
                        {
                            cut2.fetch_add(1, Relaxed);
                            return Pass::OnThenCut;
                        }
                        Pass::On
                    })
                });
            }
        });
        p
    }
}

/// Pass whole PDUs from `from` to `to` as `watch` says; a cut closes both.
fn pump(mut from: TcpStream, mut to: TcpStream, watch: impl Fn(&mut [u8]) -> Pass) {
    let mut pending = Vec::new();
    let mut buf = vec![0u8; 256 << 10];
    'conn: loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        pending.extend_from_slice(&buf[..n]);
        while pending.len() >= pdu::CH_BYTES {
            let plen = u32::from_le_bytes(pending[4..8].try_into().unwrap()) as usize;
            if pending.len() < plen {
                break;
            }
            let pass = watch(&mut pending[..plen]);
            if pass == Pass::Cut || to.write_all(&pending[..plen]).is_err() {
                break 'conn;
            }
            if pass == Pass::OnThenCut {
                break 'conn;
            }
            pending.drain(..plen);
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

/// Submit one block of `byte` at `block` on stream 0, as its own group.
/// A recovery retried after its reset step must not take the reset log's prefix for durable.
/// Group 2's write fails on the device and group 3 goes out after it; the link drops right
/// after group 2's failure comes back, so group 3 is still held when the volume recovers. That
/// recovery zeroes groups 2 and 3 and resets the log to the stream's next group (4), then fails
/// to reconnect; its retry finds a prefix ending at 4. Group 3 must come back failed (its
/// write was zeroed), and a new initiator finds what was acknowledged. (The retry handed group
/// 3 back `Ok`: a failed stream's held groups were handed back only after the reset. And the
/// recovery after a failed group was not retried: `wait` returned the reconnection's error.)
#[test]
fn a_recovery_retried_after_its_reset_does_not_take_the_reset_prefix_for_durable() {
    let _serial = one_at_a_time();
    let mut cleanup = Cleanup(Vec::new());
    let (addr, _) = target("retry", TargetLogKind::Mem(1 << 20), &mut cleanup);
    let proxy = Proxy::start(addr);
    let mut cfg = VolumeConfig::new(vec![proxy.addr], 1);
    cfg.reconnect_for = Duration::from_secs(10);
    let (mut v, _) = Volume::open(cfg.clone()).unwrap();
    put(&mut v, 0, 0x11);
    v.wait(0).unwrap();
    assert!(v.poll().unwrap().iter().all(|d| d.result.is_ok()));
    let recoveries = v.stats().recoveries;
    proxy.mode.store(CUT_AFTER_ERROR, Relaxed);
    TEST_FAIL_ORDERED_WRITES.store(1, Relaxed);
    put(&mut v, 1, 0x22);
    put(&mut v, 2, 0x33);
    // The recovery fails after its reset; the volume retries it within the call, for up to
    // `reconnect_for`, whether it started for the failed connection or for the failed group
    // (the cut not seen yet). The second used to try once and hand the error to the caller.
    let first = v.wait(0);
    TEST_FAIL_ORDERED_WRITES.store(0, Relaxed);
    assert!(
        first.is_ok(),
        "a recovery that failed once is retried within reconnect_for: {first:?}"
    );
    let mut done = v.poll().unwrap();
    assert_eq!(
        (proxy.cut.load(Relaxed), proxy.refused.load(Relaxed)),
        (1, 1),
        "the link was cut after group 2's failure, and the recovery's reconnection after its reset refused ({first:?})"
    );
    assert_eq!(
        v.stats().recoveries,
        recoveries + 2,
        "a recovery that failed after its reset, and its retry ({first:?})"
    );
    done.sort_by_key(|d| d.seq);
    let results: Vec<(u64, bool)> = done.iter().map(|d| (d.seq, d.result.is_ok())).collect();
    assert_eq!(
        results,
        [(2, false), (3, false)],
        "groups 2 and 3 come back failed (true: Ok)"
    );
    put(&mut v, 3, 0x44);
    v.wait(0).unwrap();
    assert!(v.poll().unwrap().iter().all(|d| d.result.is_ok()));
    drop(v);
    let (mut v, rep) = Volume::open(cfg).unwrap();
    let blocks: Vec<u8> = (0..4).map(|b| read_block(&mut v, b)).collect();
    assert_eq!(
        blocks,
        [0x11, 0, 0, 0x44],
        "what a new initiator reads (recovery: {rep:?})"
    );
}

/// `flush_all` whose connection fails while its FLUSH is out: the volume recovers (a new
/// connection), and the FLUSH goes unanswered, so the call reports an error; the orderless write
/// before it may not be durable. (It returned `Ok`: recovery cleared the outstanding count the
/// call waited on.)
#[test]
fn flush_all_reports_a_connection_lost_under_its_flush() {
    let _serial = one_at_a_time();
    let mut cleanup = Cleanup(Vec::new());
    let (addr, _) = target("flushcut", TargetLogKind::Mem(1 << 20), &mut cleanup);
    let proxy = Proxy::start(addr);
    let mut cfg = VolumeConfig::new(vec![proxy.addr], 1);
    cfg.reconnect_for = Duration::from_secs(5);
    let (mut v, _) = Volume::open(cfg).unwrap();
    let mut b = v.alloc(BLOCK as usize).unwrap();
    b.fill(0x55);
    v.write_orderless(0, 0, b).unwrap();
    let d = v.wait_any().unwrap();
    assert!(d.len() == 1 && d[0].result.is_ok(), "the orderless write");
    let recoveries = v.stats().recoveries;
    proxy.mode.store(CUT_AT_FLUSH, Relaxed);
    let r = v.flush_all(0);
    assert_eq!(proxy.cut.load(Relaxed), 1, "the FLUSH's connection was cut");
    assert_eq!(v.stats().recoveries, recoveries + 1, "the volume recovered");
    let e = r.expect_err("flush_all with its FLUSH lost reports an error");
    assert!(e.to_string().contains("connection failed"), "{e}");
    v.flush_all(0).expect("the next flush_all");
    assert_eq!(read_block(&mut v, 0), 0x55);
}

/// A volume over a standard NVMe/TCP target (one that refuses RIO_INFO: orderless I/O only)
/// reconnects when a connection is lost, and goes on. Its recovery failed ("recovery needs Rio
/// targets") and stayed due, so after one lost connection every later call retried it for
/// `reconnect_for` and failed.
#[test]
fn a_volume_over_a_standard_target_reconnects_after_a_lost_connection() {
    let _serial = one_at_a_time();
    let mut cleanup = Cleanup(Vec::new());
    let (addr, _) = target("standard", TargetLogKind::Mem(1 << 20), &mut cleanup);
    let proxy = Proxy::start(addr);
    proxy.hide_rio.store(true, Relaxed);
    let mut cfg = VolumeConfig::new(vec![proxy.addr], 1);
    cfg.reconnect_for = Duration::from_secs(1);
    let mut v = Volume::connect(cfg).unwrap();
    let b = v.alloc(BLOCK as usize).unwrap();
    assert!(
        v.submit(0, 0, b, true).is_err(),
        "ordered writes are refused: the target looks standard"
    );
    let mut b = v.alloc(BLOCK as usize).unwrap();
    b.fill(0x55);
    v.write_orderless(0, 0, b).unwrap();
    let d = v.wait_any().unwrap();
    assert!(d.len() == 1 && d[0].result.is_ok(), "the orderless write");
    v.flush_all(0).unwrap();
    proxy.mode.store(CUT_AT_FLUSH, Relaxed);
    let lost = v.flush_all(0);
    assert_eq!(proxy.cut.load(Relaxed), 1, "the FLUSH's connection was cut");
    let e = lost.expect_err("a FLUSH lost with its connection is an error");
    assert!(e.to_string().contains("connection failed"), "{e}");
    v.flush_all(0)
        .expect("the FLUSH on the connection made again");
    assert_eq!(read_block(&mut v, 0), 0x55);
    let mut b = v.alloc(BLOCK as usize).unwrap();
    b.fill(0x66);
    v.write_orderless(0, BLOCK, b).unwrap();
    let d = v.wait_any().unwrap();
    assert!(
        d.len() == 1 && d[0].result.is_ok(),
        "an orderless write after it"
    );
    assert_eq!(read_block(&mut v, 1), 0x66);
}

/// Recovery waits for its zeroing as long as answers keep coming: its time-out runs from the
/// last answer, not from the first command. Here a crash left 200 unflushed writes in the
/// target's log, and the network passes each answer on 10 ms after the one before: the
/// zeroing takes about 2 s in all, twice `io_timeout`. (With the time-out counted from the
/// start, the recovery gave up after `io_timeout` and the open failed: "targets did not answer
/// in time".)
#[test]
fn recovery_zeroing_longer_than_io_timeout_in_all_waits_while_answers_come() {
    const WRITES: u64 = 200;
    let _serial = one_at_a_time();
    let mut cleanup = Cleanup(Vec::new());
    let log_path = scratch("slow-log");
    cleanup.0.push(log_path.clone());
    let log_bytes = 1 << 20;
    unflushed_log(&log_path, log_bytes, (1..=WRITES).map(|seq| (0, seq, seq)));
    let (addr, _) = target(
        "slow",
        TargetLogKind::File(log_path, log_bytes),
        &mut cleanup,
    );
    let proxy = Proxy::start(addr);
    proxy.mode.store(SLOW_ANSWERS, Relaxed);
    let mut cfg = VolumeConfig::new(vec![proxy.addr], 1);
    cfg.io_timeout = Duration::from_secs(1);
    let t0 = Instant::now();
    let opened = Volume::open(cfg);
    let took = t0.elapsed();
    let (_v, rep) = opened.unwrap_or_else(|e| panic!("open after {took:?}: {e}"));
    assert_eq!(rep.discarded as u64, WRITES, "writes zeroed");
    // Not a timing threshold: the proxy's sleeps alone make it at least 2 s. It shows the
    // recovery did outlast its time-out, so the test still tests what it names.
    assert!(
        took > Duration::from_secs(1),
        "the zeroing outlasted io_timeout ({took:?})"
    );
}
