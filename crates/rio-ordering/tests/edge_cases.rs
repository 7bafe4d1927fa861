//! Edge cases of the attribute log and the ordered device, each of which once let recovery keep
//! a group that was not durable or drop one that `wait` had acknowledged (found by a review on
//! 2026-11-27; each test failed before its fix): a torn append leaving an older entry's persist
//! word behind, a background FLUSH failing after `wait`'s own FLUSH of the same target, the
//! header's version wrapping, a group of more writes than its entries can count, and
//! checksummed entries with values no device writes. Then (a later review; each test failed
//! before its fix too): byte ranges past 2^64 taken as writes or block log regions, and a full
//! request array failing `wait`'s FLUSH and an asynchronous block log's header write instead of
//! being waited out; and start or handed-off group numbers outside the range entries carry.
//! Later still: a write from memory off the target's alignment, taken by `submit` and refused by
//! lbio only when sent (its group failed and held the stream's log until recovery),
//! `flush_queue` returning another stream's failure, and a write from another engine's arena,
//! taken by `submit` and failed by the kernel when sent (the same hold).

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use aios_core::{Engine, EngineConfig};
use lbio::{LbioArray, LbioConfig};
use rio_ordering::{
    recover, scan, Attr, AttrLog, MemPmr, OrderedConfig, OrderedDevice, Pmr, RioError, Write,
};

fn one(seq: u64, offset: u64) -> Attr {
    Attr {
        stream: 0,
        target: 0,
        seq,
        seq_end: seq,
        offset,
        len: 4096,
        boundary: true,
        num: 1,
        members: 1,
        ..Attr::default()
    }
}

/// A PMR append is eight 8-byte stores (aios_core::pmr::write_bytes); power fails after the
/// seventh: bytes 56..64 of the slot keep what the slot held before. For an entry without a
/// split and with one member, bytes 56..60 are the same in the old and the new entry, so the
/// checksum (8..60) holds, and the old persist word (60..64) stays.
fn tear_last_word(pmr: &mut MemPmr, off: usize, old: &[u8; 64]) {
    pmr.bytes_mut()[off + 56..off + 64].copy_from_slice(&old[56..64]);
}

#[test]
fn a_torn_append_after_reopen_does_not_inherit_the_stale_entrys_persist_word() {
    // Epoch 1: group 1 of two requests; the first is durable (PLP target, persist word set),
    // the second is not when the power fails. Recovery: prefix_end 1.
    let mut log = AttrLog::format(MemPmr::new(64 << 10), 1).unwrap();
    let mut a = one(1, 0);
    a.boundary = false;
    a.num = 0;
    let s0 = log.append(&a).unwrap();
    log.set_persist(s0, 1).unwrap();
    let mut b = one(1, 4096);
    b.num = 2;
    log.append(&b).unwrap();
    let r = recover(&scan(log.pmr()).unwrap(), &|_| true);
    assert_eq!(r.streams[0].prefix_end, 1);
    // Reopen at the resume mark; the stream writes group 1 again (one request) into slot 0.
    let pmr = log.into_pmr();
    let mut log = AttrLog::reopen(pmr, &r.resume_marks()).unwrap();
    let slots_at = scan(log.pmr()).unwrap().header.slots_at;
    let mut old = [0u8; 64];
    log.pmr().read(slots_at, &mut old).unwrap();
    let s = log.append(&one(1, 8192)).unwrap();
    assert_eq!(s.0, 0);
    // The power fails during that append (before its data is even submitted).
    let mut crash = log.pmr().clone();
    tear_last_word(&mut crash, slots_at, &old);
    let sc = scan(&crash).unwrap();
    assert!(
        sc.damaged.is_empty(),
        "the torn entry is not even seen as damaged"
    );
    let r = recover(&sc, &|_| true);
    assert_eq!(
        r.streams[0].prefix_end, 1,
        "recovery keeps group 1 of epoch 2, whose data was never submitted: {:?}",
        r.streams[0]
    );
}

#[test]
fn a_torn_append_does_not_inherit_another_streams_persist_word() {
    // Two streams, a two-slot log. Stream 1's group 1 sat in slot 0 (durable, persisted);
    // stream 0's group 1 now goes into slot 0, and the power fails after 7 of its 8 stores.
    let mut log = AttrLog::format(MemPmr::new(64 << 10), 2).unwrap();
    let slots_at = scan(log.pmr()).unwrap().header.slots_at;
    let slots = log.slots();
    let mut b = one(1, 1 << 20);
    b.stream = 1;
    for k in 0..slots as u64 {
        let mut e = b;
        e.seq = 1 + k;
        e.seq_end = 1 + k;
        e.offset = (1 << 20) + k * 4096;
        let s = log.append(&e).unwrap();
        log.set_persist(s, e.seq).unwrap();
    }
    log.durable(1, slots as u64 + 1);
    let mut old = [0u8; 64];
    log.pmr().read(slots_at, &mut old).unwrap();
    let s = log.append(&one(1, 0)).unwrap();
    assert_eq!(s.0, 0);
    let mut crash = log.pmr().clone();
    tear_last_word(&mut crash, slots_at, &old);
    let r = recover(&scan(&crash).unwrap(), &|_| true);
    assert_eq!(
        r.streams[0].prefix_end, 1,
        "stream 0's group 1 was never submitted: {:?}",
        r.streams[0]
    );
}

// ---------------------------------------------------------------------------------------------

const DISK: u64 = 1 << 20;
const EIO: i32 = 5;

/// RAM without power-loss protection. While `fail_late` > 0, a FLUSH is queued (a NOP on the
/// ring) and completes later with EIO; other FLUSHes complete at once, without error. So a
/// background FLUSH that fails can complete after a later FLUSH on the same target (as two
/// FLUSHes in io_uring's worker threads, or on an NVMe queue, may).
struct LateFailFlush {
    mem: lbio::MemBackend,
    fail_late: Rc<Cell<u32>>,
    late: Rc<RefCell<Vec<u64>>>,
}

impl lbio::Backend for LateFailFlush {
    fn caps(&self) -> lbio::Caps {
        lbio::Caps {
            power_loss_protected: false,
            asynchronous: true,
            ..self.mem.caps()
        }
    }
    fn outcome_of(&self, payload: u64, res: i32, len: u32) -> lbio::Outcome {
        let mut late = self.late.borrow_mut();
        if let Some(i) = late.iter().position(|&p| p == payload) {
            late.swap_remove(i);
            return lbio::Outcome::Failed(lbio::PieceError::Errno(EIO));
        }
        drop(late);
        self.mem.outcome_of(payload, res, len)
    }
    unsafe fn start(
        &self,
        engine: &Engine,
        sink: aios_core::SinkId,
        tag: u64,
        piece: &lbio::Piece,
    ) -> Result<lbio::Started, aios_core::CoreError> {
        if piece.op == lbio::Op::Flush && self.fail_late.get() > 0 {
            self.fail_late.set(self.fail_late.get() - 1);
            self.late.borrow_mut().push(tag);
            engine.push_nop(sink, tag)?;
            return Ok(lbio::Started::Queued);
        }
        // SAFETY: the caller's contract on `piece` is passed on unchanged.
        unsafe { self.mem.start(engine, sink, tag, piece) }
    }
}

/// A device of `capacity_bytes` bytes with 512-byte blocks and alignment, and transfers of up to
/// 128 KiB.
fn geometry(capacity_bytes: u64) -> lbio::Geometry {
    lbio::Geometry {
        capacity_bytes,
        logical_block: 512,
        mem_align: 512,
        offset_align: 512,
        max_transfer_bytes: 128 << 10,
    }
}

/// A writable device of `geometry` on `lbio`, its critical and its background path each a
/// `backend()`.
fn device_of<B: lbio::Backend + 'static>(
    lbio: &Rc<LbioArray>,
    backend: impl Fn() -> B,
    geometry: lbio::Geometry,
) -> lbio::Device {
    lbio::Device::from_backends(
        lbio,
        Box::new(backend()),
        Box::new(backend()),
        geometry,
        true,
    )
    .unwrap()
}

fn late_target(lbio: &Rc<LbioArray>) -> (lbio::Device, Rc<Cell<u32>>) {
    late_target_of(lbio, DISK)
}

/// [`late_target`] of `disk` bytes.
fn late_target_of(lbio: &Rc<LbioArray>, disk: u64) -> (lbio::Device, Rc<Cell<u32>>) {
    let fail_late = Rc::new(Cell::new(0));
    let late = Rc::new(RefCell::new(Vec::new()));
    let backend = || LateFailFlush {
        mem: lbio::MemBackend::new(disk as usize),
        fail_late: Rc::clone(&fail_late),
        late: Rc::clone(&late),
    };
    let dev = device_of(lbio, backend, geometry(disk));
    (dev, fail_late)
}

fn write(engine: &Engine, target: u16, offset: u64, fill: u8) -> Write {
    write_of(engine.alloc_blocking(4096).unwrap(), target, offset, fill)
}

/// A write (not an in-place update) of `buf`, filled with `fill`, at `offset` of `target`.
fn write_of(mut buf: aios_core::FixedBuf, target: u16, offset: u64, fill: u8) -> Write {
    buf.fill(fill);
    Write {
        target,
        offset,
        buf,
        ipu: false,
    }
}

/// The write of sector `i` of target 0, filled with `i`'s low byte.
fn sector_write(engine: &Engine, i: u64) -> Write {
    write_of(engine.alloc_blocking(512).unwrap(), 0, i * 512, i as u8)
}

#[test]
fn a_background_flush_failing_after_waits_own_flush_is_not_vouched_for() {
    // As `a_background_flush_failing_during_wait_is_not_vouched_for_by_its_entry`, but the
    // failing background FLUSH on target 1 completes after `wait`'s own FLUSH of target 1.
    let (engine, lbio) = engine_and_array_of(engine_config(8 << 20), LbioConfig::default());
    let (a, _) = late_target(&lbio);
    let (b, fail_b) = late_target(&lbio);
    let log = AttrLog::format(MemPmr::new(16 << 10), 2).unwrap();
    let cfg = OrderedConfig {
        flush_ahead: 2,
        ..OrderedConfig::default()
    };
    let mut od = OrderedDevice::new(lbio, vec![a, b], log, &[1, 1], cfg).unwrap();
    od.submit(0, write(&engine, 0, 0, 1), true).unwrap();
    od.poll().unwrap();
    od.submit(0, write(&engine, 1, 0, 2), true).unwrap();
    od.poll().unwrap();
    od.submit(1, write(&engine, 1, 65536, 3), true).unwrap();
    fail_b.set(1);
    let e = od.wait(0).unwrap_err().to_string();
    assert!(e.contains("FLUSH on target 1"), "{e}");
    let rec = recover(&scan(od.log().pmr()).unwrap(), &|_| false);
    assert!(
        rec.streams[0].prefix_end <= 2,
        "recovery keeps group 2, which a failed FLUSH covered (wait said so): {:?}",
        rec.streams[0]
    );
}

/// A write of another stream that had completed (in the target's volatile cache) before `wait`
/// sent its FLUSH, and was taken only while that FLUSH was out, is failed with it when it fails:
/// the FLUSH may have dropped it. No background FLUSH may start on the target while `wait`'s is
/// out: one did (its write counted towards `flush_ahead`), covered that write, succeeded, and the
/// other stream's next `wait` then returned `Ok` and logged a FLUSH entry vouching for it.
#[test]
fn a_write_taken_while_waits_flush_fails_is_not_made_durable_by_a_background_flush() {
    let (engine, lbio) = engine_and_array_of(engine_config(8 << 20), LbioConfig::default());
    let (a, fail_a) = late_target(&lbio);
    let log = AttrLog::format(MemPmr::new(16 << 10), 2).unwrap();
    let cfg = OrderedConfig {
        flush_ahead: 1,
        ..OrderedConfig::default()
    };
    let mut od = OrderedDevice::new(lbio, vec![a], log, &[1, 1], cfg).unwrap();
    // Stream 0's write is done and taken; the background FLUSH it starts completes too.
    od.submit(0, write(&engine, 0, 0, 1), true).unwrap();
    let mut back = Vec::new();
    while back.is_empty() {
        back = od.wait_any().unwrap();
    }
    od.poll().unwrap();
    assert_eq!(od.stats().flushes_ahead, 1);
    assert_eq!(od.in_flight(), 0);
    // Stream 1's write completes at once on the RAM target, but nothing takes its completion
    // before stream 0's `wait` sends its FLUSH, which fails.
    od.submit(1, write(&engine, 0, 65536, 3), true).unwrap();
    fail_a.set(1);
    od.wait(0).expect_err("stream 0's FLUSH fails");
    let r = od.wait(1);
    let rec = recover(&scan(od.log().pmr()).unwrap(), &|_| false);
    assert!(
        r.is_err() && rec.streams[1].prefix_end == 1,
        "stream 1's write reached the target before the FLUSH that failed, yet wait said {r:?} \
         and recovery keeps it: {:?}",
        rec.streams[1]
    );
}

// ---------------------------------------------------------------------------------------------

/// Bytes of one header copy (room for 64 streams' marks, whole 64-byte slots).
const COPY: usize = (24 + 8 * 64usize).div_ceil(64) * 64;

/// Rewrite header copy `k`'s version (as 2^32 header writes over the region's life would).
fn set_version(pmr: &mut MemPmr, k: usize, version: u32) {
    let b = &mut pmr.bytes_mut()[k * COPY..(k + 1) * COPY];
    b[20..24].copy_from_slice(&version.to_le_bytes());
    let crc = crc32c::crc32c(&b[8..]);
    b[4..8].copy_from_slice(&crc.to_le_bytes());
}

#[test]
fn the_header_version_wrapping_keeps_the_newer_copy() {
    let mut pmr = AttrLog::format(MemPmr::new(1152 + 4 * 64), 1)
        .unwrap()
        .into_pmr();
    // The region has seen 2^32 - 2 header writes: copy 1 holds the newest.
    set_version(&mut pmr, 1, u32::MAX - 1);
    let mut log = AttrLog::reopen(pmr, &[1]).unwrap(); // version u32::MAX
    assert_eq!(log.slots(), 4);
    // Groups 1..=5 on a power-loss-protected target, each durable at its completion.
    for g in 1..=5u64 {
        let s = log.append(&one(g, g * 4096)).unwrap();
        log.set_persist(s, g).unwrap();
        log.durable(0, g + 1);
    }
    // Group 5 reused slot 0 after a header write (version 0, marks [5]).
    assert_eq!(log.header_writes(), 1);
    let r = recover(&scan(log.pmr()).unwrap(), &|_| true);
    assert_eq!(
        r.streams[0].prefix_end, 6,
        "every group was durable: {:?}",
        r.streams[0]
    );
}

// ---------------------------------------------------------------------------------------------

/// A group holds at most 65,535 writes (its boundary entry counts them in 16 bits): the next
/// write is refused, and the group of 65,535 is acknowledged and recovered whole. (A group of
/// 65,536 used to be acknowledged by `wait` and then dropped by recovery: its count read 0.)
#[test]
fn a_group_of_the_most_writes_recovers_and_one_more_is_refused() {
    let n = rio_ordering::MAX_GROUP_WRITES as u64;
    let engine_cfg = EngineConfig {
        frame_bytes: 512,
        ..engine_config((n as usize + 64) * 512)
    };
    let (engine, lbio) = engine_and_array_of(engine_cfg, LbioConfig::default());
    let (dev, _) = late_target_of(&lbio, 64 << 20);
    // A log with room for the group (a bit over 4 MiB).
    let log = AttrLog::format(MemPmr::new(((n as usize) + 1024) * 64 + 4096), 1).unwrap();
    let cfg = OrderedConfig {
        merge: false,
        ..OrderedConfig::default()
    };
    let mut od = OrderedDevice::new(lbio, vec![dev], log, &[1], cfg).unwrap();
    for i in 0..n {
        od.submit(0, sector_write(&engine, i), false).unwrap();
    }
    let e = od
        .submit(0, sector_write(&engine, n), true)
        .unwrap_err()
        .to_string();
    assert!(e.contains("65535 writes"), "{e}");
    // `wait` ends the open group.
    od.wait(0).expect("the group is durable");
    let rec = recover(&scan(od.log().pmr()).unwrap(), &|_| false);
    assert_eq!(
        rec.streams[0].prefix_end, 2,
        "{:?}",
        rec.streams[0].stopped_by
    );
}

// ---------------------------------------------------------------------------------------------

/// Merged groups count their requests in the same 16 bits: a run of 65,536 contiguous
/// one-sector groups that a 64 MiB merge limit would take whole goes out as a merged command of
/// 65,535 and the last group alone, and every group recovers. (The count used to overflow: a panic in a debug build, a count of 0,
/// and so the loss of every group of the run, in a release build.)
#[test]
fn a_merge_stops_at_the_most_requests_an_entry_counts() {
    let n = rio_ordering::MAX_GROUP_WRITES as u64 + 1;
    let engine_cfg = EngineConfig {
        frame_bytes: 512,
        // The writes, and the merged copies of them.
        ..engine_config(2 * (n as usize + 64) * 512)
    };
    let (engine, lbio) = engine_and_array_of(engine_cfg, LbioConfig::default());
    let disk = 64u64 << 20;
    let geometry = lbio::Geometry {
        max_transfer_bytes: 64 << 20,
        ..geometry(disk)
    };
    let dev = device_of(&lbio, || lbio::MemBackend::new(disk as usize), geometry);
    let log = AttrLog::format(MemPmr::new(64 << 10), 1).unwrap();
    let cfg = OrderedConfig {
        batch: n as usize,
        max_merge_bytes: 64 << 20,
        ..OrderedConfig::default()
    };
    let mut od = OrderedDevice::new(lbio, vec![dev], log, &[1], cfg).unwrap();
    for i in 0..n {
        od.submit(0, sector_write(&engine, i), true).unwrap();
    }
    od.wait(0).expect("every group is durable");
    assert_eq!(od.stats().merged_cmds, 1);
    let rec = recover(&scan(od.log().pmr()).unwrap(), &|_| false);
    assert_eq!(
        rec.streams[0].prefix_end,
        n + 1,
        "{:?}",
        rec.streams[0].stopped_by
    );
}

// ---------------------------------------------------------------------------------------------

/// A run of contiguous groups that would go out merged, while the arena has no room for the
/// merge's copy, goes out one command per group, in order: merging only saves commands, and
/// failing the groups for it would fail the stream until recovery. (It did: `wait` answered
/// "the arena has no run of 4 free frames", and every later `wait` the same.)
#[test]
fn merged_groups_go_out_unmerged_when_the_arena_has_no_room_for_the_copy() {
    let engine_cfg = EngineConfig {
        frame_bytes: 512,
        ..engine_config(64 * 512)
    };
    let (engine, lbio) = engine_and_array_of(engine_cfg, LbioConfig::default());
    let dev = device_of(
        &lbio,
        || lbio::MemBackend::new(DISK as usize),
        geometry(DISK),
    );
    let log = AttrLog::format(MemPmr::new(64 << 10), 1).unwrap();
    let cfg = OrderedConfig {
        batch: 4,
        flush_ahead: 0,
        ..OrderedConfig::default()
    };
    let mut od = OrderedDevice::new(Rc::clone(&lbio), vec![dev], log, &[1], cfg).unwrap();
    let writes: Vec<Write> = (0..4).map(|i| sector_write(&engine, i)).collect();
    // Every other free frame of the arena held: no two free frames in a row.
    let mut held = Vec::new();
    while let Some(b) = engine.try_alloc(512) {
        held.push(b);
    }
    let kept: Vec<_> = held.into_iter().step_by(2).collect();
    for w in writes {
        od.submit(0, w, true).unwrap();
    }
    od.wait(0).expect("every group is durable");
    let st = od.stats();
    assert_eq!(
        (st.merged_cmds, st.merges_skipped, st.device_cmds),
        (0, 1, 4),
        "{st:?}"
    );
    let rec = recover(&scan(od.log().pmr()).unwrap(), &|_| false);
    assert_eq!(
        rec.streams[0].prefix_end, 5,
        "{:?}",
        rec.streams[0].stopped_by
    );
    // With room, the same kind of run goes out as one merged command.
    drop(kept);
    for i in 4..8 {
        od.submit(0, sector_write(&engine, i), true).unwrap();
    }
    od.wait(0).expect("every group is durable");
    let st = od.stats();
    assert_eq!((st.merged_cmds, st.merges_skipped), (1, 1), "{st:?}");
    let rec = recover(&scan(od.log().pmr()).unwrap(), &|_| false);
    assert_eq!(
        rec.streams[0].prefix_end, 9,
        "{:?}",
        rec.streams[0].stopped_by
    );
}

/// Entries whose checksum holds but whose values no device writes: a merged range ending at
/// the largest id (recovery's `seq_end + 1` overflowed: a panic in a debug build, a prefix of 0
/// in a release build) and a byte range past 2^64. Both are damage, skipped by recovery.
#[test]
fn checksummed_entries_with_impossible_values_are_damage() {
    for (seq_end, offset) in [
        (u64::MAX, 0),
        (rio_ordering::MAX_SEQ + 1, 0),
        (1, u64::MAX - 100),
    ] {
        let mut log = AttrLog::format(MemPmr::new(64 << 10), 1).unwrap();
        let slots_at = scan(log.pmr()).unwrap().header.slots_at;
        let a = Attr {
            epoch: log.epoch(),
            seq: 1,
            seq_end,
            merged: seq_end > 1,
            members: 2,
            persist: true,
            ..one(1, offset)
        };
        let mut b = [0u8; 64];
        a.encode(&mut b);
        log.pmr_mut().bytes_mut()[slots_at..slots_at + 64].copy_from_slice(&b);
        let sc = scan(log.pmr()).unwrap();
        assert!(
            sc.entries.is_empty(),
            "seq_end {seq_end}, offset {offset}: {sc:?}"
        );
        assert_eq!(sc.damaged.len(), 1, "seq_end {seq_end}, offset {offset}");
        let r = recover(&sc, &|_| true);
        assert_eq!(
            r.streams[0].prefix_end, 1,
            "seq_end {seq_end}: {:?}",
            r.streams[0]
        );
    }
    // A header mark past the largest group is a damaged header.
    let mut pmr = AttrLog::format(MemPmr::new(64 << 10), 1)
        .unwrap()
        .into_pmr();
    for k in 0..2 {
        let b = &mut pmr.bytes_mut()[k * COPY..(k + 1) * COPY];
        b[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
        let crc = crc32c::crc32c(&b[8..]);
        b[4..8].copy_from_slice(&crc.to_le_bytes());
    }
    let e = scan(&pmr).unwrap_err().to_string();
    assert!(e.contains("past the largest group"), "{e}");
}

// ---------------------------------------------------------------------------------------------

/// An engine of 256 ring entries and an arena of `arena_bytes`, without huge pages.
fn engine_config(arena_bytes: usize) -> EngineConfig {
    EngineConfig {
        ring_entries: 256,
        arena_bytes,
        huge_pages: false,
        ..EngineConfig::default()
    }
}

/// An engine of `engine` and an lbio array of `array` on it.
fn engine_and_array_of(engine: EngineConfig, array: LbioConfig) -> (Rc<Engine>, Rc<LbioArray>) {
    let engine = Engine::new(engine).unwrap();
    let lbio = LbioArray::new(Rc::clone(&engine), array).unwrap();
    (engine, lbio)
}

/// An engine and an lbio array of `slots` request slots on it.
fn engine_and_array(slots: u32) -> (Rc<Engine>, Rc<LbioArray>) {
    let array = LbioConfig {
        slots,
        ..LbioConfig::default()
    };
    engine_and_array_of(engine_config(1 << 20), array)
}

/// An ordered device on `lbio` over `targets` with the attribute log `log`: no background FLUSH,
/// every stream starting at group 1.
fn ordered<P: Pmr>(
    lbio: Rc<LbioArray>,
    targets: Vec<lbio::Device>,
    log: AttrLog<P>,
) -> OrderedDevice<P> {
    let cfg = OrderedConfig {
        flush_ahead: 0,
        ..OrderedConfig::default()
    };
    let start = vec![1; log.streams() as usize];
    OrderedDevice::new(lbio, targets, log, &start, cfg).unwrap()
}

/// A RAM target of `DISK` bytes without power-loss protection, one stream per log stream, on an
/// lbio array of `slots` request slots.
fn ram_rig(slots: u32, streams: u16) -> (Rc<Engine>, OrderedDevice<MemPmr>) {
    let (engine, lbio) = engine_and_array(slots);
    let dev = lbio::Device::memory(&lbio, DISK as usize).unwrap();
    let log = AttrLog::format(MemPmr::new(64 << 10), streams).unwrap();
    (engine, ordered(lbio, vec![dev], log))
}

/// A write whose end lies past 2^64 is bad input, refused by `submit` like any other write past
/// the target's end. (`offset + len` wrapped: a debug build panicked, and a release build took
/// the write, logged an entry that recovery reports as damage, and failed the stream for good.)
#[test]
fn a_write_ending_past_the_address_space_is_refused_and_the_stream_goes_on() {
    let (engine, mut od) = ram_rig(64, 1);
    let e = od
        .submit(0, write(&engine, 0, u64::MAX - 4095, 1), true)
        .expect_err("a write past the end of the target is refused");
    assert!(e.to_string().contains("inside its"), "{e}");
    assert_eq!(od.next_seq(0), 1, "the refused write took no group");
    od.submit(0, write(&engine, 0, 0, 2), true).unwrap();
    od.wait(0)
        .expect("the stream is not failed by a write it refused");
    let sc = scan(od.log().pmr()).unwrap();
    assert!(sc.damaged.is_empty(), "{:?}", sc.damaged);
    let rec = recover(&sc, &|_| false);
    assert_eq!(rec.streams[0].prefix_end, 2, "{:?}", rec.streams[0]);
}

/// A write whose buffer starts 256 bytes into an arena buffer: its offset and length are
/// aligned, but its memory is not aligned to the target's 512 bytes (lbio would refuse the
/// command; `submit` refuses the write).
fn write_from_unaligned_memory(engine: &Engine, target: u16, offset: u64, fill: u8) -> Write {
    let mut buf = engine.alloc_blocking(8192).unwrap();
    buf.set_range(256, 4096).unwrap();
    write_of(buf, target, offset, fill)
}

/// A write whose memory is not aligned to the target's direct-I/O memory alignment is bad
/// input, refused by `submit` before it takes a group, like a misaligned offset or length, and
/// the stream goes on. (`submit` checked the offset and the length only: it took the write and
/// logged its entry, lbio refused the command when it was sent, its group failed, and that group,
/// never durable, held the stream's log entries until recovery.)
#[test]
fn a_write_from_misaligned_memory_is_refused_and_the_stream_goes_on() {
    let (engine, mut od) = ram_rig(64, 1);
    let w = write_from_unaligned_memory(&engine, 0, 0, 1);
    let addr = w.buf.as_ptr() as u64;
    let e = od
        .submit(0, w, true)
        .expect_err("a write from misaligned memory is refused")
        .to_string();
    assert!(
        e.contains(&addr.to_string()) && e.contains("512"),
        "the error names the address and the alignment: {e}"
    );
    assert_eq!(od.next_seq(0), 1, "the refused write took no group");
    assert_eq!(od.stats().send_errors, 0);
    let id = od.submit(0, write(&engine, 0, 0, 2), true).unwrap();
    od.wait(0)
        .expect("the stream is not failed by a write it refused");
    let done = od.poll().unwrap();
    assert!(
        done.len() == 1 && done[0].id == id && done[0].result.is_ok(),
        "{done:?}"
    );
    let sc = scan(od.log().pmr()).unwrap();
    assert!(sc.damaged.is_empty(), "{:?}", sc.damaged);
    let rec = recover(&sc, &|_| false);
    assert_eq!(rec.streams[0].prefix_end, 2, "{:?}", rec.streams[0]);
}

/// A writable file of `bytes` bytes under the temp directory, opened `O_DIRECT` as an lbio
/// target on `lbio` (its writes go through the kernel as fixed-buffer writes), with transfers
/// of up to 128 KiB. Returns the device and the file's path.
fn file_target(lbio: &Rc<LbioArray>, name: &str, bytes: u64) -> (lbio::Device, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("rio-edge-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("dev");
    std::fs::File::create(&path)
        .unwrap()
        .set_len(bytes)
        .unwrap();
    let cfg = lbio::DeviceConfig {
        write: true,
        max_transfer_bytes: Some(128 << 10),
        ..lbio::DeviceConfig::default()
    };
    (lbio::Device::open(lbio, &path, cfg).unwrap(), path)
}

/// A write whose buffer comes from a second engine's arena (a second engine in the same
/// thread: a `FixedBuf` cannot leave its thread) is bad input, refused by `submit` before it
/// takes a group, and the stream goes on. Its buffer went to the kernel as this ring's
/// registered buffer 0, whose range does not hold that memory: the write failed with EFAULT
/// when it was sent, after it took its group and logged its entry, so its group failed, every
/// later `wait` of the stream reported it, and its entry held the stream's log until recovery.
/// (On a RAM target, or merged or split into copies, the same write went through: whether it
/// worked depended on the path it took.)
#[test]
fn a_write_from_another_engines_arena_is_refused_and_the_stream_goes_on() {
    let (engine, lbio) = engine_and_array(64);
    let other = Engine::new(engine_config(1 << 20)).unwrap();
    let (dev, path) = file_target(&lbio, "foreign", DISK);
    let log = AttrLog::format(MemPmr::new(64 << 10), 1).unwrap();
    let mut od = ordered(lbio, vec![dev], log);
    let w = write_of(other.alloc_blocking(4096).unwrap(), 0, 0, 0xab);
    let addr = w.buf.as_ptr() as u64;
    let e = od
        .submit(0, w, true)
        .map(|id| (id, od.wait(0)))
        .expect_err("a write from another engine's arena is refused");
    assert!(
        matches!(e, rio_ordering::RioError::Config(_)),
        "a typed refusal of bad input: {e:?}"
    );
    let e = e.to_string();
    assert!(
        e.contains("another engine's arena") && e.contains(&format!("{addr:#x}")),
        "the error names the buffer and why: {e}"
    );
    assert_eq!(od.next_seq(0), 1, "the refused write took no group");
    assert_eq!(od.stats().send_errors, 0);
    assert_eq!(
        other.arena().free_frames(),
        other.arena().frames(),
        "the refused buffer went back to its own arena"
    );
    let id = od.submit(0, write(&engine, 0, 0, 0xcd), true).unwrap();
    od.wait(0)
        .expect("the stream is not failed by a write it refused");
    let done = od.poll().unwrap();
    assert!(
        done.len() == 1 && done[0].id == id && done[0].result.is_ok(),
        "{done:?}"
    );
    let sc = scan(od.log().pmr()).unwrap();
    assert!(sc.damaged.is_empty(), "{:?}", sc.damaged);
    let rec = recover(&sc, &|_| false);
    assert_eq!(rec.streams[0].prefix_end, 2, "{:?}", rec.streams[0]);
    let data = std::fs::read(&path).unwrap();
    assert!(
        data[..4096].iter().all(|&b| b == 0xcd),
        "the device holds the accepted write"
    );
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}

/// `wait` FLUSHes while another stream's writes hold every request slot of the array: it waits
/// for one of them to complete, as a data write does, instead of failing. (It returned "all 4
/// request slots are in flight" although nothing had failed.)
#[test]
fn wait_flushes_while_another_streams_writes_hold_every_request_slot() {
    let (engine, mut od) = ram_rig(4, 2);
    od.submit(0, write(&engine, 0, 0, 1), true).unwrap();
    let mut back = Vec::new();
    while back.is_empty() {
        back = od.wait_any().unwrap();
    }
    assert_eq!(back.len(), 1);
    for i in 0..4 {
        od.submit(1, write(&engine, 0, 65536 + i * 4096, 2), true)
            .unwrap();
    }
    assert_eq!(od.in_flight(), 4, "stream 1 holds every request slot");
    od.wait(0)
        .expect("stream 0's write is durable once a slot frees for its FLUSH");
    let rec = recover(&scan(od.log().pmr()).unwrap(), &|_| false);
    assert_eq!(rec.streams[0].prefix_end, 2, "{:?}", rec.streams[0]);
    od.wait(1).unwrap();
    let rec = recover(&scan(od.log().pmr()).unwrap(), &|_| false);
    assert_eq!(rec.streams[1].prefix_end, 5, "{:?}", rec.streams[1]);
}

/// A block log whose region ends past 2^64 is refused as not fitting the device (`start + len`
/// wrapped: a panic in a debug build).
#[test]
fn a_block_log_ending_past_the_address_space_is_refused() {
    let engine_cfg = EngineConfig {
        arena_bytes: 1 << 20,
        huge_pages: false,
        ..EngineConfig::default()
    };
    let (_engine, lbio) = engine_and_array_of(engine_cfg, LbioConfig::default());
    let dev = lbio::Device::memory(&lbio, DISK as usize).unwrap();
    let e = rio_ordering::BlockPmr::on_device(dev, u64::MAX - 4095, 4096).unwrap_err();
    assert!(e.to_string().contains("does not fit"), "{e}");
}

/// A block log on the ordered device's own lbio array (asynchronous sync) rewrites its header,
/// once per lap, with a blocking request on that array. With every request slot held by the
/// device's own writes it waits for one of them, instead of failing the group whose entry
/// needed the header (which used to fail for good: "all 3 request slots are in flight", and
/// every later `wait` of the stream said so).
#[test]
fn an_async_block_logs_header_write_waits_for_a_request_slot_instead_of_failing_the_group() {
    let (engine, lbio) = engine_and_array(3);
    // Data on a SimDisk (its writes stay out until the engine is polled again); the log in 8
    // slots after a 1,536-byte header, on a RAM device of the same array.
    let disk = lbio::SimDisk::new(lbio::SimConfig::new(DISK, 7)).unwrap();
    let dev = disk.open(&lbio).unwrap();
    let log_dev = lbio::Device::memory(&lbio, 64 << 10).unwrap();
    let log = AttrLog::format(
        rio_ordering::BlockPmr::on_device(log_dev, 0, 2048).unwrap(),
        1,
    )
    .unwrap();
    assert_eq!(log.slots(), 8);
    let cfg = OrderedConfig {
        batch: 3,
        merge: false,
        flush_ahead: 0,
        ..OrderedConfig::default()
    };
    let mut od = OrderedDevice::new(Rc::clone(&lbio), vec![dev], log, &[1], cfg).unwrap();
    // Groups 1..=4 and wait's FLUSH entry take slots 0..=4; all durable, the header still at 1.
    for i in 0..4 {
        od.submit(0, write(&engine, 0, i * 4096, i as u8), true)
            .unwrap();
    }
    od.wait(0).unwrap();
    // Groups 5..=7 take slots 5..=7, and their writes every request slot.
    for i in 4..7 {
        od.submit(0, write(&engine, 0, i * 4096, i as u8), true)
            .unwrap();
    }
    od.poll().unwrap();
    assert_eq!(od.in_flight(), 3);
    assert_eq!(lbio.free_slots(), 0, "the device's writes hold every slot");
    // Group 8 reuses slot 0, whose entry the header's mark does not cover yet.
    assert_eq!(od.log().header_writes(), 0);
    od.submit(0, write(&engine, 0, 7 * 4096, 7), true).unwrap();
    od.flush_queue(0)
        .expect("group 8's entry waits for a slot to write the header");
    assert_eq!(od.log().header_writes(), 1);
    od.wait(0).expect("nothing failed");
    let done = od.poll().unwrap();
    assert!(done.iter().all(|d| d.result.is_ok()), "{done:?}");
    let rec = recover(&scan(od.log().pmr()).unwrap(), &|_| false);
    assert_eq!(rec.streams[0].prefix_end, 9, "{:?}", rec.streams[0]);
}

/// A start group or a handed-off next group outside 1..=`MAX_SEQ` is bad input, refused with a
/// typed error (0 in `start` means "the stream lives elsewhere" and stays allowed). A start of
/// `u64::MAX` was taken, and the stream's second group number overflowed; a handoff's
/// `next_seq` of 0 made the next group 0, which no entry may carry.
#[test]
fn start_groups_and_handoffs_outside_the_group_range_are_refused() {
    let (engine, mut od) = ram_rig(64, 2);
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    let new = |start: &[u64]| {
        let dev = lbio::Device::memory(&lbio, DISK as usize).unwrap();
        let log = AttrLog::format(MemPmr::new(64 << 10), 2).unwrap();
        OrderedDevice::new(
            Rc::clone(&lbio),
            vec![dev],
            log,
            start,
            OrderedConfig::default(),
        )
    };
    for bad in [rio_ordering::MAX_SEQ + 1, u64::MAX] {
        let Err(e) = new(&[1, bad]) else {
            panic!("a start of group {bad} was taken");
        };
        assert!(e.to_string().contains(&bad.to_string()), "{e}");
    }
    let mut other = new(&[1, 0]).unwrap();
    let (mut h, _) = od.detach(1).unwrap();
    h.next_seq = 0;
    let e = other.attach(h).expect_err("a handoff of group 0");
    assert!(e.to_string().contains("group 0"), "{e}");
}

// ---------------------------------------------------------------------------------------------

/// Recovery starts a stream at its log header's mark, so a device must start it there: past the
/// mark, a crash left every acknowledged group beyond the prefix (the groups in between never
/// exist); below it, recovery took groups for durable that were not. Both are refused; the
/// mark itself, and a log reopened at another mark, are taken.
#[test]
fn a_stream_starts_at_its_log_marks_group() {
    let cfg = OrderedConfig::default();
    for start in [5, 0, 1] {
        let (_engine, lbio) = engine_and_array(8);
        let dev = lbio::Device::memory(&lbio, DISK as usize).unwrap();
        let log = AttrLog::format(MemPmr::new(64 << 10), 2).unwrap();
        let r = OrderedDevice::new(lbio, vec![dev], log, &[start, 1], cfg);
        match start {
            5 => {
                let e = r.err().expect("refused").to_string();
                assert!(
                    e.contains("starts at group 5") && e.contains("at group 1"),
                    "{e}"
                );
            }
            _ => assert!(r.is_ok(), "start {start}"),
        }
    }
    // A log reopened at group 7: the device starts there, not below, and what it writes
    // recovers.
    let pmr = AttrLog::format(MemPmr::new(64 << 10), 1)
        .unwrap()
        .into_pmr();
    for start in [3, 7] {
        let (engine, lbio) = engine_and_array(8);
        let dev = lbio::Device::memory(&lbio, DISK as usize).unwrap();
        let log = AttrLog::reopen(pmr.clone(), &[7]).unwrap();
        let r = OrderedDevice::new(lbio, vec![dev], log, &[start], cfg);
        if start == 3 {
            let e = r.err().expect("refused").to_string();
            assert!(
                e.contains("starts at group 3") && e.contains("at group 7"),
                "{e}"
            );
            continue;
        }
        let mut od = r.unwrap();
        od.submit(0, write(&engine, 0, 0, 1), true).unwrap();
        od.wait(0).unwrap();
        let rec = recover(&scan(od.log().pmr()).unwrap(), &|_| false);
        assert_eq!(rec.streams[0].prefix_end, 8, "{:?}", rec.streams[0]);
    }
}

// ---------------------------------------------------------------------------------------------

/// RAM whose next `fail` writes fail with EIO (what an asynchronous block log is kept on).
struct FlakyWrites {
    mem: lbio::MemBackend,
    fail: Rc<Cell<u32>>,
}

impl lbio::Backend for FlakyWrites {
    fn caps(&self) -> lbio::Caps {
        self.mem.caps()
    }
    unsafe fn start(
        &self,
        engine: &Engine,
        sink: aios_core::SinkId,
        tag: u64,
        piece: &lbio::Piece,
    ) -> Result<lbio::Started, aios_core::CoreError> {
        if piece.op == lbio::Op::Write && self.fail.get() > 0 {
            self.fail.set(self.fail.get() - 1);
            return Ok(lbio::Started::Done(-EIO));
        }
        // SAFETY: the caller's contract on `piece` is passed on unchanged.
        unsafe { self.mem.start(engine, sink, tag, piece) }
    }
}

/// An ordered device of `streams` streams over one RAM target (no power-loss protection, no
/// background FLUSH), its attribute log a block log on a [`FlakyWrites`] device of the same lbio
/// array (so its syncs are asynchronous); the counter makes the log's next writes fail.
fn async_log_rig(
    streams: u16,
) -> (
    Rc<Engine>,
    OrderedDevice<rio_ordering::BlockPmr>,
    Rc<Cell<u32>>,
) {
    async_log_rig_of(streams, 16 << 10)
}

/// [`async_log_rig`] with a log region of `log_bytes`.
fn async_log_rig_of(
    streams: u16,
    log_bytes: usize,
) -> (
    Rc<Engine>,
    OrderedDevice<rio_ordering::BlockPmr>,
    Rc<Cell<u32>>,
) {
    let (engine, lbio) = engine_and_array(64);
    let dev = lbio::Device::memory(&lbio, DISK as usize).unwrap();
    let (log, fail) = flaky_block_log(&lbio, streams, log_bytes);
    (engine, ordered(lbio, vec![dev], log), fail)
}

/// An attribute log of `streams` streams, a block log in the first `log_bytes` of a 64 KiB
/// [`FlakyWrites`] device on `array`; the counter makes the log's next writes fail.
fn flaky_block_log(
    array: &Rc<LbioArray>,
    streams: u16,
    log_bytes: usize,
) -> (AttrLog<rio_ordering::BlockPmr>, Rc<Cell<u32>>) {
    let fail = Rc::new(Cell::new(0));
    let backend = || FlakyWrites {
        mem: lbio::MemBackend::new(64 << 10),
        fail: Rc::clone(&fail),
    };
    let log_dev = device_of(array, backend, geometry(64 << 10));
    let log = AttrLog::format(
        rio_ordering::BlockPmr::on_device(log_dev, 0, log_bytes).unwrap(),
        streams,
    )
    .unwrap();
    (log, fail)
}

/// An asynchronous block log's write fails while it holds only stream 1's write. Stream 0's
/// `wait` (its own write staged behind that log write) is not failed by it: the batch is
/// staged again, and the retry carries both. The failure reaches stream 1, whose write it held,
/// once; nothing is lost, and recovery keeps every write. (Before, whichever call took the
/// failed log write's completion returned its error: stream 0's `wait` here.)
#[test]
fn a_failed_async_log_write_reaches_the_streams_it_held_not_another_streams_wait() {
    let (engine, mut od, fail) = async_log_rig(2);
    od.submit(0, write(&engine, 0, 0, 1), true).unwrap();
    od.wait(0).unwrap();
    // Stream 1's write: its entry's log write goes out, and fails.
    fail.set(1);
    let b = od.submit(1, write(&engine, 0, 65536, 2), true).unwrap();
    // Stream 0's next write is staged behind that log write (it shares the next one).
    let c = od.submit(0, write(&engine, 0, 4096, 3), true).unwrap();
    od.wait(0)
        .expect("stream 0 had nothing in the failed log write, and the retry succeeds");
    // wait(0)'s retry carried stream 1's write too: its entry is durable, nothing to report.
    od.wait(1)
        .expect("the retry that carried stream 1's write succeeded");
    // A failed log write the stream's own wait meets is its answer; the next wait retries.
    fail.set(1);
    let d = od.submit(1, write(&engine, 0, 69632, 4), true).unwrap();
    let e = od
        .wait(1)
        .expect_err("the failed log write held stream 1's write")
        .to_string();
    assert!(e.contains("block log write"), "{e}");
    od.wait(1).expect("the retry succeeded");
    let done: Vec<(u16, u64, bool)> = od
        .poll()
        .unwrap()
        .into_iter()
        .map(|d| (d.stream, d.id, d.result.is_ok()))
        .collect();
    assert!(
        done.contains(&(0, c, true))
            && done.contains(&(1, b, true))
            && done.contains(&(1, d, true)),
        "{done:?}"
    );
    let rec = recover(&scan(od.log().pmr()).unwrap(), &|_| false);
    assert_eq!(rec.streams[0].prefix_end, 3, "{:?}", rec.streams[0]);
    assert_eq!(rec.streams[1].prefix_end, 3, "{:?}", rec.streams[1]);
}

/// Stream 0's `wait` finds the log full and FLUSHes every target for room. The FLUSH of target
/// 1, which only stream 1 wrote, fails; target 0's makes the room stream 0 needs. Stream 0's
/// writes are all durable and vouched for: its `wait` succeeds, and the failure is stream 1's
/// (its `wait` reports it). (Before, the first failed FLUSH ended the search for room, and
/// stream 0's `wait` returned target 1's error.)
#[test]
fn a_flush_failing_on_another_streams_target_does_not_fail_a_wait_that_found_room() {
    let (engine, lbio) = engine_and_array(64);
    let a = lbio::Device::memory(&lbio, DISK as usize).unwrap();
    let (b, fail_b) = late_target(&lbio);
    let probe = AttrLog::format(MemPmr::new(64 << 10), 2).unwrap();
    let slots_at = scan(probe.pmr()).unwrap().header.slots_at;
    let log = AttrLog::format(MemPmr::new(slots_at + 4 * 64), 2).unwrap();
    assert_eq!(log.slots(), 4);
    let mut od = ordered(Rc::clone(&lbio), vec![a, b], log);
    // Slot 0: stream 0's group 1 (target 0); slot 1: stream 1's group 1 (target 1); slots 2
    // and 3: stream 0's groups 2 and 3 (target 0). The log is full.
    od.submit(0, write(&engine, 0, 0, 1), true).unwrap();
    od.submit(1, write(&engine, 1, 0, 2), true).unwrap();
    od.submit(0, write(&engine, 0, 4096, 3), true).unwrap();
    od.submit(0, write(&engine, 0, 8192, 4), true).unwrap();
    assert!(!od.log().has_room());
    fail_b.set(1);
    od.wait(0)
        .expect("target 0's FLUSH frees slot 0 for stream 0's FLUSH entry");
    let e = od.wait(1).expect_err("target 1's FLUSH failed").to_string();
    assert!(e.contains("FLUSH on target 1"), "{e}");
    let rec = recover(&scan(od.log().pmr()).unwrap(), &|_| false);
    assert_eq!(rec.streams[0].prefix_end, 4, "{:?}", rec.streams[0]);
    assert_eq!(rec.streams[1].prefix_end, 1, "{:?}", rec.streams[1]);
}

/// A full asynchronous block log: stream 0's group 1 is on the device, the log write of stream
/// 1's entry is out (and fails), and stream 0's groups 2..=7 wait behind it. Stream 0's next
/// group, of two writes, needs room: the FLUSH of target 0 frees group 1's slot, and the retried
/// log write the next one. Stream 1's failed log write is stream 1's failure, not a reason to
/// fail stream 0's group for good. (Before, the full log's wait for the writes out ended with
/// that failure, and the group it was appending for failed.)
#[test]
fn a_full_logs_search_for_room_is_not_ended_by_another_streams_failed_log_write() {
    let (engine, mut od, fail) = async_log_rig_of(2, 2048);
    assert_eq!(od.log().slots(), 8);
    od.submit(0, write(&engine, 0, 0, 1), true).unwrap();
    while od.in_flight() > 0 {
        od.wait_progress().unwrap();
    }
    fail.set(1);
    od.submit(1, write(&engine, 0, 65536, 2), true).unwrap();
    for k in 1..7u64 {
        od.submit(0, write(&engine, 0, k * 4096, 3), true).unwrap();
    }
    assert!(!od.log().has_room());
    od.submit(0, write(&engine, 0, 7 * 4096, 4), false).unwrap();
    od.submit(0, write(&engine, 0, 8 * 4096, 4), true).unwrap();
    od.wait(0)
        .expect("stream 0 had nothing in the failed log write, and room was found");
    // Stream 0's calls retried the log write, which carried stream 1's entry: it is durable.
    od.wait(1)
        .expect("the retry that carried stream 1's write succeeded");
    let done = od.poll().unwrap();
    assert_eq!(done.len(), 9, "every write handed back once: {done:?}");
    assert!(done.iter().all(|d| d.result.is_ok()), "{done:?}");
    let rec = recover(&scan(od.log().pmr()).unwrap(), &|_| false);
    assert_eq!(rec.streams[0].prefix_end, 9, "{:?}", rec.streams[0]);
    assert_eq!(rec.streams[1].prefix_end, 2, "{:?}", rec.streams[1]);
}

/// A RAM target without power-loss protection whose writes are held, like lbio's `SimDisk`, by a
/// software device: the data lands when the write starts, its completion when an engine wait
/// advances the device. While `stall` is on, the first advance after a submission found the lbio
/// array with every request slot held fails instead (and with it the engine's wait): a command
/// that waits for a slot then cannot be sent. The ordered device gives it up (its groups fail),
/// as it gives up any command that lbio refuses at submission. (A backend cannot make lbio
/// refuse a command: lbio refuses at submission only bad input, which `submit` refuses first,
/// and a full array; what fails at a backend's start comes back as a failed completion.)
struct HeldWrites {
    mem: lbio::MemBackend,
    lbio: std::rc::Weak<LbioArray>,
    /// Writes started and not completed: (sink, payload), and each one's result.
    held: RefCell<Vec<(aios_core::SinkId, u64)>>,
    results: RefCell<std::collections::HashMap<u64, i32>>,
    stall: Cell<bool>,
    /// The array's count of submissions that found no free slot, at the last advance.
    exhausted: Cell<u64>,
}

impl HeldWrites {
    fn exhausted_now(&self) -> u64 {
        self.lbio
            .upgrade()
            .map_or(0, |a| a.metrics().slot_exhausted)
    }
    /// Stall (or not) from now on: only a full array met after this counts.
    fn stall(&self, on: bool) {
        self.exhausted.set(self.exhausted_now());
        self.stall.set(on);
    }
}

impl aios_core::SoftDevice for HeldWrites {
    fn pending(&self) -> u32 {
        self.held.borrow().len() as u32
    }
    fn advance(&self, engine: &Engine) -> Result<(), aios_core::CoreError> {
        let now = self.exhausted_now();
        let met_full_array = now > self.exhausted.replace(now);
        if self.stall.get() && met_full_array {
            return Err(aios_core::CoreError::Config(
                "the test device stalls while a command waits for a request slot".into(),
            ));
        }
        for (sink, payload) in std::mem::take(&mut *self.held.borrow_mut()) {
            engine.push_nop(sink, payload)?;
        }
        Ok(())
    }
}

struct HeldBackend(Rc<HeldWrites>);

impl lbio::Backend for HeldBackend {
    fn caps(&self) -> lbio::Caps {
        lbio::Caps {
            power_loss_protected: false,
            asynchronous: true,
            ..self.0.mem.caps()
        }
    }
    fn outcome_of(&self, payload: u64, res: i32, len: u32) -> lbio::Outcome {
        // A held write's completion (a NOP) stands for the result its start had.
        let res = self.0.results.borrow_mut().remove(&payload).unwrap_or(res);
        self.0.mem.outcome_of(payload, res, len)
    }
    unsafe fn start(
        &self,
        engine: &Engine,
        sink: aios_core::SinkId,
        tag: u64,
        piece: &lbio::Piece,
    ) -> Result<lbio::Started, aios_core::CoreError> {
        // SAFETY: the caller's contract on `piece` is passed on unchanged (the RAM device is
        // done with its memory when `start` returns).
        let started = unsafe { self.0.mem.start(engine, sink, tag, piece) }?;
        match (piece.op, started) {
            (lbio::Op::Write, lbio::Started::Done(res)) => {
                self.0.results.borrow_mut().insert(tag, res);
                self.0.held.borrow_mut().push((sink, tag));
                Ok(lbio::Started::Queued)
            }
            (_, started) => Ok(started),
        }
    }
}

/// An ordered device of two streams on an lbio array of one request slot: one [`HeldWrites`]
/// target (no background FLUSH), and an asynchronous block log of 8 slots on a RAM device of the
/// same array.
fn held_writes_rig() -> (
    Rc<Engine>,
    OrderedDevice<rio_ordering::BlockPmr>,
    Rc<HeldWrites>,
) {
    let (engine, lbio) = engine_and_array(1);
    let held = Rc::new(HeldWrites {
        mem: lbio::MemBackend::new(DISK as usize),
        lbio: Rc::downgrade(&lbio),
        held: RefCell::new(Vec::new()),
        results: RefCell::new(std::collections::HashMap::new()),
        stall: Cell::new(false),
        exhausted: Cell::new(0),
    });
    let soft: Rc<dyn aios_core::SoftDevice> = held.clone();
    engine.attach_soft_device(Rc::downgrade(&soft));
    let dev = device_of(&lbio, || HeldBackend(Rc::clone(&held)), geometry(DISK));
    let log_dev = lbio::Device::memory(&lbio, 64 << 10).unwrap();
    let log = AttrLog::format(
        rio_ordering::BlockPmr::on_device(log_dev, 0, 2048).unwrap(),
        2,
    )
    .unwrap();
    (engine, ordered(lbio, vec![dev], log), held)
}

/// A full asynchronous block log: stream 0's groups 1 and 2 are on the device (not yet durable),
/// and stream 1's group 1, six writes, fills the last slots. The array has one request slot,
/// and while a command waits for it the test device stalls ([`HeldWrites`]): only stream 1's
/// commands meet the array full, so each second one of them cannot be sent. The log write of
/// stream 1's entries comes in: the first command goes out, the second is given up, and four
/// stay staged. Stream 0's next write needs room. Its search for room sends the staged commands
/// first: `make_room`'s own send gives up one of them, and the send in its wait for the writes
/// out (`drain_all`) another; that fails stream 1's group (its `Done`s carry the error, and its
/// `wait` reports it), not stream 0's write. The FLUSH of target 0 makes stream 0's groups
/// durable and frees the slot. (Before, the first of those refusals ended the search for room,
/// and stream 0's `submit` failed with stream 1's error.)
#[test]
fn a_full_logs_search_for_room_is_not_ended_by_another_streams_command_that_cannot_be_sent() {
    let (engine, mut od, held) = held_writes_rig();
    assert_eq!(od.log().slots(), 8);
    let mut done = Vec::new();
    for k in 0..2u64 {
        od.submit(0, write(&engine, 0, k * 4096, 1), true).unwrap();
    }
    while od.in_flight() > 0 {
        done.extend(od.wait_progress().unwrap());
    }
    // Stream 1's group: six writes that are not contiguous (no merge), in slots 2..=7.
    for k in 0..6u64 {
        od.submit(1, write(&engine, 0, 65536 + k * 8192, 2), k == 5)
            .unwrap();
    }
    assert!(!od.log().has_room());
    held.stall(true);
    // The log write of their entries comes in: the first command takes the slot, the second
    // cannot be sent, the others wait.
    done.extend(od.wait_progress().unwrap());
    assert_eq!(od.stats().send_errors, 1);
    assert_eq!(
        od.in_flight(),
        5,
        "one of stream 1's commands is out, four are still staged"
    );
    let id = od
        .submit(0, write(&engine, 0, 2 * 4096, 3), true)
        .expect("stream 0's write finds room: stream 1's refused commands are stream 1's");
    assert_eq!(
        od.stats().send_errors,
        3,
        "each refused command counted once"
    );
    held.stall(false);
    od.wait(0)
        .expect("every write of stream 0 went out and is durable");
    let e = od
        .wait(1)
        .expect_err("stream 1's commands were refused")
        .to_string();
    assert!(e.contains("sending it") && e.contains("stalls"), "{e}");
    done.extend(od.poll().unwrap());
    let back: Vec<(u16, bool)> = done.iter().map(|d| (d.stream, d.result.is_ok())).collect();
    assert_eq!(
        back.iter().filter(|&&b| b == (0, true)).count(),
        3,
        "{back:?}"
    );
    assert_eq!(
        back.iter().filter(|&&b| b == (1, false)).count(),
        6,
        "{back:?}"
    );
    assert_eq!(back.len(), 9, "every write handed back once: {back:?}");
    assert!(done.iter().any(|d| d.stream == 0 && d.id == id));
    let rec = recover(&scan(od.log().pmr()).unwrap(), &|_| false);
    assert_eq!(rec.streams[0].prefix_end, 4, "{:?}", rec.streams[0]);
    assert_eq!(rec.streams[1].prefix_end, 1, "{:?}", rec.streams[1]);
}

/// An ordered device of `streams` streams over one RAM target (no power-loss protection, no
/// background FLUSH), its attribute log a block log on a [`FlakyWrites`] device of another lbio
/// array (so its syncs block); the counter makes the log's next writes fail.
fn blocking_log_rig(
    streams: u16,
) -> (
    Rc<Engine>,
    OrderedDevice<rio_ordering::BlockPmr>,
    Rc<Cell<u32>>,
) {
    let (engine, lbio) = engine_and_array(64);
    let dev = lbio::Device::memory(&lbio, DISK as usize).unwrap();
    let log_array = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    let (log, fail) = flaky_block_log(&log_array, streams, 16 << 10);
    (engine, ordered(lbio, vec![dev], log), fail)
}

/// `flush_queue(stream)` answers for its own stream, as `wait` does: a log sync that fails
/// while it holds only another stream's staged commands is that stream's failure. Stream 1's
/// write is staged behind a failed sync; stream 0, with nothing queued or staged, flushes its
/// queue while the log still fails: `Ok`. Stream 1's own `flush_queue` reports the failure
/// while its command is held, and sends it once the log can be written. (Before, stream 0's
/// `flush_queue` returned the failed sync, stream 1's error: it ends by sending every stream's
/// staged commands.)
#[test]
fn flush_queue_answers_for_its_own_stream_not_for_another_streams_failed_sync() {
    let (engine, mut od, fail) = blocking_log_rig(2);
    od.submit(0, write(&engine, 0, 0, 1), true).unwrap();
    od.wait(0).unwrap();
    // Stream 1's write: its entry's sync fails, and it stays staged.
    fail.set(3);
    let b = od.submit(1, write(&engine, 0, 65536, 2), true).unwrap();
    assert_eq!(od.stats().send_errors, 1, "the failed sync is counted");
    assert_eq!(od.in_flight(), 1, "stream 1's command is staged");
    od.flush_queue(0)
        .expect("stream 0 holds nothing behind the failed sync");
    assert_eq!(fail.get(), 1, "stream 0's flush_queue tried the sync");
    let e = od
        .flush_queue(1)
        .expect_err("stream 1's command is held behind the failed sync")
        .to_string();
    assert!(e.contains("block log write"), "{e}");
    od.flush_queue(1).expect("the sync succeeds now");
    od.wait(1).unwrap();
    od.wait(0).unwrap();
    let done: Vec<(u16, u64, bool)> = od
        .poll()
        .unwrap()
        .into_iter()
        .map(|d| (d.stream, d.id, d.result.is_ok()))
        .collect();
    assert!(done.contains(&(1, b, true)), "{done:?}");
    let rec = recover(&scan(od.log().pmr()).unwrap(), &|_| false);
    assert_eq!(rec.streams[0].prefix_end, 2, "{:?}", rec.streams[0]);
    assert_eq!(rec.streams[1].prefix_end, 2, "{:?}", rec.streams[1]);
}

/// ... and a command of its own stream that cannot be sent is `flush_queue`'s answer, even with
/// nothing of the stream left behind it (its group failed; its `Done` and `wait` say so too).
#[test]
fn flush_queue_reports_its_own_command_that_cannot_be_sent() {
    let (engine, mut od, held) = held_writes_rig();
    for k in 0..5u64 {
        od.submit(0, write(&engine, 0, k * 4096, 1), true).unwrap();
    }
    held.stall(true);
    // The log writes come in and their commands go out through the one request slot: one of
    // them cannot be sent, and two stay staged.
    let mut done = Vec::new();
    while od.stats().send_errors == 0 {
        done.extend(od.wait_progress().unwrap());
    }
    assert_eq!(od.in_flight(), 3, "one command out, two staged");
    // The first goes out through the slot the command out frees; the second cannot be sent.
    // The answer names the stream's lowest failed group, group 3 (refused above), not group 5.
    let e = od
        .flush_queue(0)
        .expect_err("the stream's own command could not be sent")
        .to_string();
    assert!(e.contains("stalls"), "{e}");
    assert!(e.contains("group 3: sending it"), "{e}");
    assert_eq!(od.stats().send_errors, 1, "returned, not counted");
    held.stall(false);
    let e = od.wait(0).expect_err("two groups failed").to_string();
    assert!(e.contains("sending it"), "{e}");
    done.extend(od.poll().unwrap());
    let back: Vec<(u64, bool)> = done.iter().map(|d| (d.seq, d.result.is_ok())).collect();
    assert_eq!(
        back,
        vec![(1, true), (2, true), (3, false), (4, true), (5, false)],
        "{done:?}"
    );
}

/// A target whose buffers must be aligned beyond what the engine's arena gives (512-byte frames,
/// a target of 4096-byte memory alignment) is refused when the ordered device is built. The
/// copies merged commands and the pieces of split requests are built in come from that arena,
/// and lbio refuses such a copy when it is sent: the group fails, and holds the stream's log
/// until recovery. (Found by a review on 2026-11-28: such a device was built.)
#[test]
fn a_target_needing_more_alignment_than_the_arenas_frames_give_is_refused() {
    let engine_cfg = EngineConfig {
        ring_entries: 64,
        frame_bytes: 512,
        ..engine_config(1 << 20)
    };
    let (_engine, lbio) = engine_and_array_of(engine_cfg, LbioConfig::default());
    let geometry = lbio::Geometry {
        logical_block: 4096,
        mem_align: 4096,
        offset_align: 4096,
        ..geometry(DISK)
    };
    let dev = device_of(&lbio, || lbio::MemBackend::new(DISK as usize), geometry);
    let log = AttrLog::format(MemPmr::new(64 << 10), 1).unwrap();
    let r = OrderedDevice::new(lbio, vec![dev], log, &[1], OrderedConfig::default());
    let Err(e) = r else {
        panic!("a target needing 4096-byte aligned buffers over 512-byte frames was taken");
    };
    let msg = e.to_string();
    assert!(msg.contains("4096") && msg.contains("512"), "{msg}");
}

// ---------------------------------------------------------------------------------------------

/// RAM without power-loss protection whose writes are held, like lbio's `SimDisk`, by a software
/// device, and complete newest first, one per advance (as writes on different device queues, or
/// in io_uring's worker threads, may). A write at an offset in `fail_at` fails with that errno;
/// while `fail_flushes` > 0, a FLUSH fails at once with EIO.
struct NewestFirst {
    mem: lbio::MemBackend,
    /// Writes started and not completed, oldest first: (sink, payload, offset).
    held: RefCell<Vec<(aios_core::SinkId, u64, u64)>>,
    /// Each held write's result.
    results: RefCell<std::collections::HashMap<u64, i32>>,
    /// By offset: the errno a write there fails with.
    fail_at: RefCell<std::collections::HashMap<u64, i32>>,
    /// The offsets of the writes completed so far, in the order they completed.
    completed: RefCell<Vec<u64>>,
    fail_flushes: Cell<u32>,
}

impl aios_core::SoftDevice for NewestFirst {
    fn pending(&self) -> u32 {
        self.held.borrow().len() as u32
    }
    fn advance(&self, engine: &Engine) -> Result<(), aios_core::CoreError> {
        let (sink, payload, offset) = self.held.borrow_mut().pop().expect("a write is held");
        self.completed.borrow_mut().push(offset);
        engine.push_nop(sink, payload)
    }
}

struct NewestFirstBackend(Rc<NewestFirst>);

impl lbio::Backend for NewestFirstBackend {
    fn caps(&self) -> lbio::Caps {
        lbio::Caps {
            power_loss_protected: false,
            asynchronous: true,
            ..self.0.mem.caps()
        }
    }
    fn outcome_of(&self, payload: u64, res: i32, len: u32) -> lbio::Outcome {
        // A held write's completion (a NOP) stands for the result its start had.
        let res = self.0.results.borrow_mut().remove(&payload).unwrap_or(res);
        self.0.mem.outcome_of(payload, res, len)
    }
    unsafe fn start(
        &self,
        engine: &Engine,
        sink: aios_core::SinkId,
        tag: u64,
        piece: &lbio::Piece,
    ) -> Result<lbio::Started, aios_core::CoreError> {
        if piece.op == lbio::Op::Flush && self.0.fail_flushes.get() > 0 {
            self.0.fail_flushes.set(self.0.fail_flushes.get() - 1);
            return Ok(lbio::Started::Done(-EIO));
        }
        // SAFETY: the caller's contract on `piece` is passed on unchanged (the RAM device is
        // done with its memory when `start` returns).
        let started = unsafe { self.0.mem.start(engine, sink, tag, piece) }?;
        match (piece.op, started) {
            (lbio::Op::Write, lbio::Started::Done(res)) => {
                let res = self
                    .0
                    .fail_at
                    .borrow()
                    .get(&piece.offset)
                    .map_or(res, |e| -e);
                self.0.results.borrow_mut().insert(tag, res);
                self.0.held.borrow_mut().push((sink, tag, piece.offset));
                Ok(lbio::Started::Queued)
            }
            (_, started) => Ok(started),
        }
    }
}

/// An ordered device of one stream over one [`NewestFirst`] target whose writes at the offsets
/// of `fail_at` fail with their errno (no background FLUSH, a 64 KiB log in memory).
fn newest_first_rig(
    fail_at: &[(u64, i32)],
) -> (Rc<Engine>, OrderedDevice<MemPmr>, Rc<NewestFirst>) {
    newest_first_rig_on(fail_at, MemPmr::new(64 << 10))
}

/// [`newest_first_rig`] with its attribute log in `region`.
fn newest_first_rig_on<P: Pmr>(
    fail_at: &[(u64, i32)],
    region: P,
) -> (Rc<Engine>, OrderedDevice<P>, Rc<NewestFirst>) {
    let (engine, lbio) = engine_and_array(64);
    let device = Rc::new(NewestFirst {
        mem: lbio::MemBackend::new(DISK as usize),
        held: RefCell::new(Vec::new()),
        results: RefCell::new(std::collections::HashMap::new()),
        fail_at: RefCell::new(fail_at.iter().copied().collect()),
        completed: RefCell::new(Vec::new()),
        fail_flushes: Cell::new(0),
    });
    let soft: Rc<dyn aios_core::SoftDevice> = device.clone();
    engine.attach_soft_device(Rc::downgrade(&soft));
    let dev = device_of(
        &lbio,
        || NewestFirstBackend(Rc::clone(&device)),
        geometry(DISK),
    );
    let log = AttrLog::format(region, 1).unwrap();
    (engine, ordered(lbio, vec![dev], log), device)
}

/// Two groups of a stream fail on the device with different errors, the higher one's failure
/// first (the device completes newest first). The stream is durable up to the group before the
/// lowest failed one, so that group's failure is `wait`'s answer, every time: group 1's, not
/// whichever failure was recorded first. (Before, `wait` returned the first recorded: group 2's
/// ENOSPC, which says nothing of group 1 and names a group above the stream's durable prefix.)
#[test]
fn wait_reports_the_lowest_failed_group_when_a_higher_one_fails_first() {
    const ENOSPC: i32 = 28;
    let (engine, mut od, device) = newest_first_rig(&[(0, EIO), (65536, ENOSPC)]);
    // Group 1 at offset 0 (fails with EIO), group 2 at 64 KiB (not contiguous: no merge; fails
    // with ENOSPC). Both are on the device before either completes.
    let a = od.submit(0, write(&engine, 0, 0, 1), true).unwrap();
    let b = od.submit(0, write(&engine, 0, 65536, 2), true).unwrap();
    assert_eq!(device.held.borrow().len(), 2, "both writes are out");
    for _ in 0..2 {
        let e = od.wait(0).expect_err("both groups failed").to_string();
        assert!(
            e.contains("offset 0 ") && !e.contains("offset 65536"),
            "wait must report group 1's failure (offset 0, EIO), the lowest: {e}"
        );
        assert!(e.contains("group 1"), "the report names the group: {e}");
    }
    assert_eq!(
        *device.completed.borrow(),
        vec![65536, 0],
        "group 2's write completed (and failed) first"
    );
    let done: Vec<(u64, u64, String)> = od
        .poll()
        .unwrap()
        .into_iter()
        .map(|d| (d.seq, d.id, d.result.expect_err("both writes failed")))
        .collect();
    assert_eq!(done.len(), 2, "{done:?}");
    assert_eq!((done[0].0, done[0].1), (1, a), "{done:?}");
    assert_eq!((done[1].0, done[1].1), (2, b), "{done:?}");
    assert!(done[0].2.contains("offset 0 "), "{done:?}");
    assert!(done[1].2.contains("offset 65536"), "{done:?}");
    // The durable prefix the report bounds: nothing of the stream.
    let rec = recover(&scan(od.log().pmr()).unwrap(), &|_| false);
    assert_eq!(rec.streams[0].prefix_end, 1, "{:?}", rec.streams[0]);
}

/// Group 1 fails on the device; group 2 completes, and `wait`'s FLUSH, which would make it
/// durable, fails (group 2 is never durable either). `wait` returns group 1's failure, the one the
/// stream's durable prefix stops at, as every later `wait` does. (Before, that `wait` returned
/// the FLUSH's error, and only the later ones group 1's.)
#[test]
fn wait_whose_flush_fails_reports_the_lower_group_that_failed_before() {
    let (engine, mut od, device) = newest_first_rig(&[(0, EIO)]);
    od.submit(0, write(&engine, 0, 0, 1), true).unwrap();
    od.submit(0, write(&engine, 0, 65536, 2), true).unwrap();
    device.fail_flushes.set(1);
    for _ in 0..2 {
        let e = od.wait(0).expect_err("group 1 failed").to_string();
        assert!(
            e.contains("group 1: write of 4096 bytes at offset 0 "),
            "wait must report group 1's failure, the lowest: {e}"
        );
    }
    assert_eq!(
        device.fail_flushes.get(),
        0,
        "wait's FLUSH was sent, and failed"
    );
    let done: Vec<(u64, bool)> = od
        .poll()
        .unwrap()
        .into_iter()
        .map(|d| (d.seq, d.result.is_ok()))
        .collect();
    // Group 2's write completed: its `Done` was handed back, in order, before the FLUSH.
    assert_eq!(done, vec![(1, false), (2, true)]);
    let rec = recover(&scan(od.log().pmr()).unwrap(), &|_| false);
    assert_eq!(rec.streams[0].prefix_end, 1, "{:?}", rec.streams[0]);
}

/// An attribute log region whose `sync` fails while `fail` is above 0 (each failure counts it
/// down).
struct SyncFails {
    mem: MemPmr,
    fail: Rc<Cell<u32>>,
}

impl Pmr for SyncFails {
    fn len(&self) -> usize {
        self.mem.len()
    }
    fn persist(&mut self, offset: usize, bytes: &[u8]) -> Result<(), RioError> {
        self.mem.persist(offset, bytes)
    }
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), RioError> {
        self.mem.read(offset, out)
    }
    fn sync(&mut self) -> Result<(), RioError> {
        if self.fail.get() > 0 {
            self.fail.set(self.fail.get() - 1);
            return Err(RioError::Corrupt(
                "injected: the region's sync failed".into(),
            ));
        }
        Ok(())
    }
}

/// A `wait` whose last step, the attribute log's sync, fails after a group of the stream had
/// failed on the device reports that group, as every later `wait` does. (It returned the
/// sync's error; only the next `wait` named group 1: a review of 2026-11-28.)
#[test]
fn wait_whose_log_sync_fails_reports_the_group_that_failed_before() {
    let fail = Rc::new(Cell::new(0));
    let region = SyncFails {
        mem: MemPmr::new(64 << 10),
        fail: Rc::clone(&fail),
    };
    let (engine, mut od, _device) = newest_first_rig_on(&[(0, EIO)], region);
    od.submit(0, write(&engine, 0, 0, 1), true).unwrap();
    od.submit(0, write(&engine, 0, 65536, 2), true).unwrap();
    fail.set(1);
    for _ in 0..2 {
        let e = od.wait(0).expect_err("group 1 failed").to_string();
        assert!(
            e.contains("group 1: write of 4096 bytes at offset 0 "),
            "wait must report group 1's failure: {e}"
        );
    }
    assert_eq!(fail.get(), 0, "the log's sync was tried, and failed");
    let rec = recover(&scan(&od.log().pmr().mem).unwrap(), &|_| false);
    assert_eq!(rec.streams[0].prefix_end, 1, "{:?}", rec.streams[0]);
}
