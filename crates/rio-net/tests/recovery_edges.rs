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
use rio_net::{
    NetError, Target, TargetConfig, TargetLogKind, TargetStatsHandle, Volume, VolumeConfig,
};
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
    log_of(
        path,
        log_bytes,
        writes.map(|(stream, seq, block)| (stream, seq, block * BLOCK, BLOCK as u32)),
    )
}

/// [`unflushed_log`] of entries `(stream, seq, byte offset, length)`, whatever they say.
fn log_of(
    path: &std::path::Path,
    log_bytes: usize,
    writes: impl Iterator<Item = (u16, u64, u64, u32)>,
) -> u32 {
    let mut log = AttrLog::format(MemPmr::new(log_bytes), 2).unwrap();
    for (stream, seq, offset, len) in writes {
        log.append(&Attr {
            stream,
            seq,
            seq_end: seq,
            prev: seq - 1,
            offset,
            len,
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
/// Forward, holding each of the target's answers for [`Proxy::slow_ms`] first (10 ms unless
/// the test says).
const SLOW_ANSWERS: u8 = 5;
/// Forward, and send the target's data for a RIO_GET_LOG twice (a target sending more data
/// than the command asked for).
const DOUBLE_LOG_DATA: u8 = 6;
/// Forward, and once: put 4 KiB of C2HData for the next orderless write (a command that reads
/// nothing) in front of its answer.
const DATA_FOR_A_WRITE: u8 = 7;
/// Forward, but pass RIO_RESET on as an opcode the target does not know (the target refuses
/// it: a recovery fails at its reset step). Ordered writes forwarded while a reset has been
/// refused and none gone through since are counted in [`Proxy::before_reset`].
const REFUSE_RESET: u8 = 8;
/// Forward, but drop the next READ command (never answered), then forward.
const DROP_READ: u8 = 9;
/// Forward, but cut the connection that carries the next READ command, then forward.
const CUT_AT_READ: u8 = 10;
const SLOW_ANSWER_MS: u32 = 10;
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
    /// [`SLOW_ANSWERS`]' delay, in milliseconds.
    slow_ms: Arc<AtomicU32>,
    /// [`REFUSE_RESET`]: a RIO_RESET was refused and none has gone through since; ordered
    /// writes forwarded meanwhile.
    reset_refused: Arc<AtomicBool>,
    before_reset: Arc<AtomicU32>,
    /// The most commands out at once on one I/O queue (sent by the host, not yet answered), and
    /// the most by which that passed the queue's entries (its Connect's SQSIZE + 1).
    peak_out: Arc<AtomicU32>,
    over_queue: Arc<AtomicU32>,
    /// The most entries an I/O queue Connect asked for.
    queue_entries: Arc<AtomicU32>,
}

/// What a proxy does with one PDU.
#[derive(PartialEq)]
enum Pass {
    On,
    OnThenCut,
    Cut,
    /// Not passed on (the connection goes on).
    Drop,
    /// These bytes first, then the PDU.
    After(Vec<u8>),
}

/// Flags of a C2HData PDU that ends a read which succeeded (no CapsuleResp follows).
const READ_DONE: u8 = pdu::F_DATA_LAST | pdu::F_DATA_SUCCESS;

impl Proxy {
    fn start(target: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let p = Proxy {
            addr: listener.local_addr().unwrap(),
            mode: Arc::new(AtomicU8::new(FORWARD)),
            refused: Arc::new(AtomicU32::new(0)),
            cut: Arc::new(AtomicU32::new(0)),
            hide_rio: Arc::new(AtomicBool::new(false)),
            slow_ms: Arc::new(AtomicU32::new(SLOW_ANSWER_MS)),
            reset_refused: Arc::new(AtomicBool::new(false)),
            before_reset: Arc::new(AtomicU32::new(0)),
            peak_out: Arc::new(AtomicU32::new(0)),
            over_queue: Arc::new(AtomicU32::new(0)),
            queue_entries: Arc::new(AtomicU32::new(0)),
        };
        let (mode, refused, cut) = (p.mode.clone(), p.refused.clone(), p.cut.clone());
        let hide_rio = p.hide_rio.clone();
        let slow_ms = p.slow_ms.clone();
        let (reset_refused, before_reset) = (p.reset_refused.clone(), p.before_reset.clone());
        let (peak_out, over_queue) = (p.peak_out.clone(), p.over_queue.clone());
        let queue_entries = p.queue_entries.clone();
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
                let slow_ms = slow_ms.clone();
                let (reset_refused, before_reset) = (reset_refused.clone(), before_reset.clone());
                let (peak_out, over_queue) = (peak_out.clone(), over_queue.clone());
                let queue_entries = queue_entries.clone();
                // This connection: its queue's entries once its I/O queue Connect is answered
                // (0: admin, or not yet), the commands out on it, an answer to RIO_GET_LOG
                // awaited, the cid of the orderless write to put data in front of (0: none; cid
                // + 1).
                let entries = Arc::new(AtomicU32::new(0));
                let connect_entries = Arc::new(AtomicU32::new(0));
                let out = Arc::new(AtomicU32::new(0));
                let get_log = Arc::new(AtomicBool::new(false));
                let write_cid = Arc::new(AtomicU32::new(0));
                let (entries2, connect_entries2, out2) =
                    (entries.clone(), connect_entries.clone(), out.clone());
                let (get_log2, write_cid2) = (get_log.clone(), write_cid.clone());
                std::thread::spawn(move || {
                    pump(host, up, |p| {
                        if p[0] != pdu::CMD || p.len() < pdu::CMD_HLEN {
                            return Pass::On;
                        }
                        let mut sqe = Sqe::default();
                        sqe.0.copy_from_slice(&p[pdu::CH_BYTES..pdu::CMD_HLEN]);
                        if sqe.opcode() == op::FABRICS && sqe.fctype() == op::FC_CONNECT {
                            let qid = u16::from_le_bytes([sqe.0[42], sqe.0[43]]);
                            let sqsize = u16::from_le_bytes([sqe.0[44], sqe.0[45]]);
                            if qid != 0 {
                                connect_entries.store(sqsize as u32 + 1, Relaxed);
                                queue_entries.fetch_max(sqsize as u32 + 1, Relaxed);
                            }
                        } else if entries.load(Relaxed) != 0 {
                            // Counted before it goes on: its answer cannot pass it.
                            let n = out.fetch_add(1, Relaxed) + 1;
                            peak_out.fetch_max(n, Relaxed);
                            over_queue.fetch_max(n.saturating_sub(entries.load(Relaxed)), Relaxed);
                        }
                        let io = entries.load(Relaxed) != 0;
                        if sqe.opcode() == op::RIO_INFO && hide_rio.load(Relaxed) {
                            // No header digests here: the opcode byte is all that changes.
                            p[pdu::CH_BYTES] = UNKNOWN_ADMIN_OPCODE;
                        }
                        if !io && sqe.opcode() == op::RIO_GET_LOG {
                            get_log.store(true, Relaxed);
                        }
                        if io
                            && sqe.opcode() == op::WRITE
                            && sqe.rio_op() == 0
                            && mode
                                .compare_exchange(DATA_FOR_A_WRITE, FORWARD, Relaxed, Relaxed)
                                .is_ok()
                        {
                            write_cid.store(sqe.cid() as u32 + 1, Relaxed);
                        }
                        if io
                            && sqe.opcode() == op::WRITE
                            && sqe.rio_op() != 0
                            && reset_refused.load(Relaxed)
                        {
                            before_reset.fetch_add(1, Relaxed);
                        }
                        if !io && sqe.opcode() == op::RIO_RESET {
                            if mode.load(Relaxed) == REFUSE_RESET {
                                reset_refused.store(true, Relaxed);
                                p[pdu::CH_BYTES] = UNKNOWN_ADMIN_OPCODE;
                            } else {
                                reset_refused.store(false, Relaxed);
                            }
                        }
                        if io && sqe.opcode() == op::READ {
                            if mode
                                .compare_exchange(DROP_READ, FORWARD, Relaxed, Relaxed)
                                .is_ok()
                            {
                                return Pass::Drop;
                            }
                            if mode
                                .compare_exchange(CUT_AT_READ, FORWARD, Relaxed, Relaxed)
                                .is_ok()
                            {
                                cut.fetch_add(1, Relaxed);
                                return Pass::Cut;
                            }
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
                            std::thread::sleep(Duration::from_millis(slow_ms.load(Relaxed) as u64));
                        }
                        let read_done = p[0] == pdu::C2H_DATA && p[1] & READ_DONE == READ_DONE;
                        if p[0] == pdu::RSP || read_done {
                            if entries2.load(Relaxed) != 0 {
                                let _ = out2.fetch_update(Relaxed, Relaxed, |n| n.checked_sub(1));
                            } else {
                                // The I/O queue's Connect answered: its commands count from now.
                                entries2.store(connect_entries2.load(Relaxed), Relaxed);
                            }
                        }
                        if p[0] == pdu::C2H_DATA
                            && get_log2.load(Relaxed)
                            && mode2.load(Relaxed) == DOUBLE_LOG_DATA
                        {
                            return Pass::After(p.to_vec());
                        }
                        if p[0] == pdu::RSP {
                            get_log2.store(false, Relaxed);
                        }
                        let w = write_cid2.load(Relaxed);
                        if p[0] == pdu::RSP && p.len() >= pdu::RSP_HLEN && w != 0 {
                            let cqe = Cqe::decode(&p[pdu::CH_BYTES..pdu::RSP_HLEN]);
                            if cqe.cid as u32 + 1 == w {
                                write_cid2.store(0, Relaxed);
                                let mut data = Vec::new();
                                pdu::put_c2h_data(
                                    &mut data,
                                    cqe.cid,
                                    0,
                                    &[0xee; BLOCK as usize],
                                    false,
                                    pdu::Digests::default(),
                                );
                                return Pass::After(data);
                            }
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
            let sent = match &pass {
                Pass::Cut => false,
                Pass::Drop => true,
                Pass::After(first) => {
                    to.write_all(first).is_ok() && to.write_all(&pending[..plen]).is_ok()
                }
                Pass::On | Pass::OnThenCut => to.write_all(&pending[..plen]).is_ok(),
            };
            if !sent || pass == Pass::OnThenCut {
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

/// The initiator takes nothing a target sends on trust. A log entry that names a range that
/// is not whole blocks of the namespace is the target's protocol error: an entry shorter than
/// a block made recovery's zeroing compute its block count as 0 - 1 (a panic in a debug
/// build, a huge range in release), and one at an offset inside a block was zeroed from the
/// start of that block (here block 0, which no entry names, lost its data).
#[test]
fn a_log_entry_that_is_not_whole_blocks_is_the_targets_protocol_error() {
    let _serial = one_at_a_time();
    for (name, offset, len) in [("short", 0, 512u32), ("inside", 100, BLOCK as u32)] {
        let mut cleanup = Cleanup(Vec::new());
        let log_path = scratch(&format!("{name}-log"));
        cleanup.0.push(log_path.clone());
        let log_bytes = 1 << 20;
        log_of(&log_path, log_bytes, [(0, 1, offset, len)].into_iter());
        let (addr, _) = target(name, TargetLogKind::File(log_path, log_bytes), &mut cleanup);
        {
            let dev = std::fs::OpenOptions::new()
                .write(true)
                .open(scratch(name))
                .unwrap();
            std::os::unix::fs::FileExt::write_all_at(&dev, &[0xab; BLOCK as usize], 0).unwrap();
        }
        let e = Volume::open(VolumeConfig::new(vec![addr], 1))
            .err()
            .unwrap_or_else(|| panic!("{name}: a log entry of {len} bytes at {offset} was taken"));
        assert!(
            matches!(e, NetError::Peer { .. }) && e.to_string().contains("attribute log names"),
            "{name}: {e}"
        );
        let mut block = [0u8; BLOCK as usize];
        let dev = std::fs::File::open(scratch(name)).unwrap();
        std::os::unix::fs::FileExt::read_exact_at(&dev, &mut block, 0).unwrap();
        assert!(
            block.iter().all(|&b| b == 0xab),
            "{name}: block 0 was zeroed"
        );
    }
}

/// A target that sends more data than a command asked for is a protocol error: the initiator
/// allocated whatever came (here each piece of the attribute log came twice, and the open
/// went on over an image that was not the target's log).
#[test]
fn a_target_sending_more_data_than_asked_for_is_a_protocol_error() {
    let _serial = one_at_a_time();
    let mut cleanup = Cleanup(Vec::new());
    let (addr, _) = target("double", TargetLogKind::Mem(1 << 20), &mut cleanup);
    let proxy = Proxy::start(addr);
    proxy.mode.store(DOUBLE_LOG_DATA, Relaxed);
    let cfg = VolumeConfig::new(vec![proxy.addr], 1);
    let e = Volume::open(cfg.clone())
        .err()
        .expect("the log's data came twice, and the open went on");
    assert!(
        matches!(e, NetError::Peer { .. }) && e.to_string().contains("more data"),
        "{e}"
    );
    proxy.mode.store(FORWARD, Relaxed);
    Volume::open(cfg).expect("the open through a proxy that passes what it gets");
}

/// C2HData from a target for an orderless write (a command that reads nothing) is a protocol
/// error of that target: the connection is given up and recovery runs. It was copied into the
/// write's buffer, the caller's data (to go out after an R2T, or handed back changed).
#[test]
fn data_from_a_target_for_an_orderless_write_is_a_protocol_error() {
    let _serial = one_at_a_time();
    let mut cleanup = Cleanup(Vec::new());
    let (addr, _) = target("c2hwrite", TargetLogKind::Mem(1 << 20), &mut cleanup);
    let proxy = Proxy::start(addr);
    let mut cfg = VolumeConfig::new(vec![proxy.addr], 1);
    cfg.reconnect_for = Duration::from_secs(5);
    let (mut v, _) = Volume::open(cfg).unwrap();
    let recoveries = v.stats().recoveries;
    proxy.mode.store(DATA_FOR_A_WRITE, Relaxed);
    let mut b = v.alloc(BLOCK as usize).unwrap();
    b.fill(0x55);
    v.write_orderless(0, 0, b).unwrap();
    let d = v.wait_any().unwrap();
    assert_eq!(d.len(), 1);
    assert!(
        d[0].buf.iter().all(|&x| x == 0x55),
        "the target's data landed in the write's buffer"
    );
    assert!(d[0].result.is_err(), "the write's connection was given up");
    assert_eq!(v.stats().recoveries, recoveries + 1, "the volume recovered");
    assert_eq!(read_block(&mut v, 0), 0x55, "the write went out as it was");
}

/// `submit` and `wait` run a recovery that is due (one that failed part way) before they send:
/// `submit` sent its group, and `wait` the open group, on the connections the failed recovery
/// left (opened before the reset it did not finish, with the stream's state not yet brought to
/// the logs). The proxy refuses the reset, so `recover()` fails; it counts the ordered writes
/// that go out before a reset has gone through again.
#[test]
fn submit_and_wait_run_a_due_recovery_before_they_send() {
    let _serial = one_at_a_time();
    let mut cleanup = Cleanup(Vec::new());
    let (addr, _) = target("due", TargetLogKind::Mem(1 << 20), &mut cleanup);
    let proxy = Proxy::start(addr);
    let cfg = VolumeConfig::new(vec![proxy.addr], 1);
    let (mut v, _) = Volume::open(cfg.clone()).unwrap();
    put(&mut v, 0, 0x11);
    v.wait(0).unwrap();
    // `submit` after a failed recovery.
    proxy.mode.store(REFUSE_RESET, Relaxed);
    assert!(v.recover().is_err(), "the reset was refused");
    proxy.mode.store(FORWARD, Relaxed);
    put(&mut v, 1, 0x22);
    v.wait(0).unwrap();
    assert_eq!(
        proxy.before_reset.load(Relaxed),
        0,
        "submit sent its group before the recovery was done"
    );
    // `wait` after a failed recovery, with the group still open.
    let mut b = v.alloc(BLOCK as usize).unwrap();
    b.fill(0x33);
    v.submit(0, 2 * BLOCK, b, false).unwrap();
    proxy.mode.store(REFUSE_RESET, Relaxed);
    assert!(v.recover().is_err(), "the reset was refused");
    proxy.mode.store(FORWARD, Relaxed);
    v.wait(0).unwrap();
    assert_eq!(
        proxy.before_reset.load(Relaxed),
        0,
        "wait sent the open group before the recovery was done"
    );
    let done = v.poll().unwrap();
    assert!(done.iter().all(|d| d.result.is_ok()), "{done:?}");
    drop(v);
    let (mut v, _) = Volume::open(cfg).unwrap();
    let blocks: Vec<u8> = (0..3).map(|b| read_block(&mut v, b)).collect();
    assert_eq!(blocks, [0x11, 0x22, 0x33]);
}

/// Most turns of the connections a wait below may take: each turn waits for the network (up to
/// 100 ms) when it got nothing, so about 10 a second of waiting, plus one per answer. A loop
/// that does not wait makes hundreds of thousands a second.
const FEW_TURNS: u64 = 1000;

/// Recovery's first step waits for the connections still up to answer (bounded by
/// `io_timeout`) while another target's are already gone: it waits on the network. It spun:
/// a turn reported the gone target's connections at once ("not connected") and the step
/// turned again, for as long as the other target took. Here target B's connection is cut and
/// target A never answers a read, so the step lasts `io_timeout` (1 s).
#[test]
fn recovery_waits_for_the_targets_still_up_without_spinning() {
    let _serial = one_at_a_time();
    let mut cleanup = Cleanup(Vec::new());
    let (a, _) = target("spin-a", TargetLogKind::Mem(1 << 20), &mut cleanup);
    let (b, _) = target("spin-b", TargetLogKind::Mem(1 << 20), &mut cleanup);
    let (pa, pb) = (Proxy::start(a), Proxy::start(b));
    let mut cfg = VolumeConfig::new(vec![pa.addr, pb.addr], 1);
    cfg.io_timeout = Duration::from_secs(1);
    let (mut v, _) = Volume::open(cfg).unwrap();
    pa.mode.store(DROP_READ, Relaxed);
    pb.mode.store(CUT_AT_READ, Relaxed);
    let buf = v.alloc(BLOCK as usize).unwrap();
    v.read(0, 0, buf).unwrap(); // stripe unit 0: target A
    let buf = v.alloc(BLOCK as usize).unwrap();
    v.read(0, BLOCK, buf).unwrap(); // stripe unit 1: target B
    let (turns, recoveries) = (v.stats().turns, v.stats().recoveries);
    let mut done = Vec::new();
    while done.len() < 2 {
        done.extend(v.wait_any().unwrap());
    }
    assert_eq!(pb.cut.load(Relaxed), 1, "B's connection was cut");
    assert!(
        done.iter().all(|d| d.result.is_err()),
        "both reads failed with their connections"
    );
    assert_eq!(v.stats().recoveries, recoveries + 1);
    let turns = v.stats().turns - turns;
    assert!(turns < FEW_TURNS, "{turns} turns of the connections");
    assert_eq!(read_block(&mut v, 1), 0, "the volume goes on");
}

/// A wait (`flush_all` here; `wait` and recovery alike) waits on the network whether or not
/// the caller has taken the requests handed back before it: with one not taken, each turn
/// returned at once and the call spun until its answer came. Here the write's answer comes
/// 300 ms before the FLUSH's.
#[test]
fn a_wait_with_requests_not_taken_yet_waits_on_the_network() {
    let _serial = one_at_a_time();
    let mut cleanup = Cleanup(Vec::new());
    let (addr, _) = target("notaken", TargetLogKind::Mem(1 << 20), &mut cleanup);
    let proxy = Proxy::start(addr);
    let (mut v, _) = Volume::open(VolumeConfig::new(vec![proxy.addr], 1)).unwrap();
    proxy.slow_ms.store(300, Relaxed);
    proxy.mode.store(SLOW_ANSWERS, Relaxed);
    let mut b = v.alloc(BLOCK as usize).unwrap();
    b.fill(0x66);
    v.write_orderless(0, 0, b).unwrap();
    let turns = v.stats().turns;
    v.flush_all(0).unwrap();
    let turns = v.stats().turns - turns;
    proxy.mode.store(FORWARD, Relaxed);
    let done = v.poll().unwrap();
    assert!(done.len() == 1 && done[0].result.is_ok(), "{done:?}");
    assert!(turns < FEW_TURNS, "{turns} turns of the connections");
}

/// An I/O queue never has more commands out than its Connect's SQSIZE (0's based) gives it
/// entries, and asks for as many as the window needs (within the target's CAP.MQES + 1 and
/// MAXCMD: 1,024 here). The queues connected with SQSIZE 127 whatever the window, and kept
/// every command out at once: 512 single-block groups with a window of 512, then one write of
/// 1,024 stripe units on one target (a command each). The proxy holds each answer 1 ms, so the
/// commands pile up on the queue as the volume sends them.
#[test]
fn commands_out_on_an_io_queue_stay_within_its_size() {
    let _serial = one_at_a_time();
    let mut cleanup = Cleanup(Vec::new());
    let (addr, _) = target("queue", TargetLogKind::Mem(1 << 20), &mut cleanup);
    let proxy = Proxy::start(addr);
    let mut cfg = VolumeConfig::new(vec![proxy.addr], 1);
    cfg.window = 512;
    let (mut v, _) = Volume::open(cfg.clone()).unwrap();
    assert!(
        proxy.queue_entries.load(Relaxed) >= cfg.window,
        "I/O queues of {} entries for a window of {}",
        proxy.queue_entries.load(Relaxed),
        cfg.window
    );
    proxy.slow_ms.store(1, Relaxed);
    proxy.mode.store(SLOW_ANSWERS, Relaxed);
    for g in 0..512 {
        put(&mut v, g, (g % 251) as u8 + 1);
    }
    v.wait(0).unwrap();
    let big = 1024 * BLOCK as usize;
    let mut b = v.alloc(big).unwrap();
    for (i, c) in b.chunks_mut(BLOCK as usize).enumerate() {
        c.fill((i % 251) as u8 + 1);
    }
    v.submit(0, 1024 * BLOCK, b, true).unwrap();
    v.wait(0).unwrap();
    proxy.mode.store(FORWARD, Relaxed);
    let done = v.poll().unwrap();
    assert_eq!(done.len(), 513);
    assert!(done.iter().all(|d| d.result.is_ok()));
    assert_eq!(
        proxy.over_queue.load(Relaxed),
        0,
        "commands out on an I/O queue passed its entries by that much (peak {})",
        proxy.peak_out.load(Relaxed)
    );
    let b = v.alloc(big).unwrap();
    v.read(0, 1024 * BLOCK, b).unwrap();
    let d = v.wait_any().unwrap();
    assert!(d[0].result.is_ok(), "{:?}", d[0].result);
    for (i, c) in d[0].buf.chunks(BLOCK as usize).enumerate() {
        assert!(c.iter().all(|&x| x == (i % 251) as u8 + 1), "block {i}");
    }
    assert_eq!(read_block(&mut v, 7), 8);
}
