//! "Allocate at start, never on the hot path" (DESIGN.md): a counting global allocator proves that
//! steady-state 4 KiB reads and writes through lbio allocate nothing, through the blocking, detached
//! and async interfaces, on RAM and on a real O_DIRECT file driven by io_uring. So do page-cache
//! reads (hits, misses with eviction, zero-copy guards) and writes with their `sync`; Rio's
//! ordered writes (single, batched and merged, multi-write groups, with background FLUSHes and
//! `wait`); journal commits (every commit mode, Rio-ordered included, through
//! checkpoints); and aiosfs READs (cached and `O_DIRECT`, at any offset). A rio-net volume and its targets are counted in `tests/no_alloc_net.rs`, on
//! every thread of the process.
//!
//! Only allocations made by the measuring thread while it counts are counted, so tests running in
//! parallel on other threads do not disturb each other. Every read is checked against what was
//! last written to its block, so the loops really move the bytes they claim to.

use std::rc::Rc;

use aios_core::{Engine, EngineConfig, FixedBuf, ProbeOptions};
use lbio::{Device, DeviceConfig, Io, LbioArray, LbioConfig, RouteChoice, Tag};

mod counting;
use counting::allocations_during;

#[global_allocator]
static GLOBAL: counting::CountingAlloc = counting::CountingAlloc;

/// Steady-state operations measured per case (reads and writes, half each).
const OPS: u32 = 100_000;
/// Operations run before measuring, so one-time set-up is not counted.
const WARMUP_OPS: u32 = 2_000;
const BLOCK: usize = 4096;
const DEVICE_BYTES: usize = 4 << 20;
const BLOCKS: usize = DEVICE_BYTES / BLOCK;

#[test]
fn the_counter_sees_allocations() {
    let (v, n) = allocations_during(|| vec![1u8; 100]);
    assert_eq!(v.len(), 100);
    assert!(n >= 1, "a Vec allocation must be counted");
    let (_, n) = allocations_during(|| 1 + 1);
    assert_eq!(n, 0);
}

fn engine() -> Rc<Engine> {
    Engine::new(EngineConfig {
        ring_entries: 64,
        arena_bytes: 1 << 20,
        huge_pages: false,
        ..EngineConfig::default()
    })
    .expect("engine")
}

/// A file under /var/tmp (ext4, O_DIRECT) the size of the test device, fully written so no write
/// allocates blocks; removed when dropped.
fn temp_file(tag: &str) -> counting::TempFile {
    counting::TempFile::new(tag, DEVICE_BYTES)
}

fn open_file(lbio: &Rc<LbioArray>, file: &counting::TempFile) -> Device {
    let cfg = DeviceConfig {
        write: true,
        route: RouteChoice::Ring,
        probe: ProbeOptions {
            latency_samples: 0,
            try_iopoll: false,
        },
        ..DeviceConfig::default()
    };
    let dev = Device::open(lbio, &file.0, cfg).expect("open the test file");
    assert_eq!(dev.critical_route().0.name, "io_uring");
    dev
}

/// What each block last had written to it (a stamp in every byte), and a cheap random walk.
struct Workload {
    stamps: Vec<u8>,
    x: u64,
    checked: u64,
}

impl Workload {
    fn new() -> Self {
        Workload {
            stamps: vec![0; BLOCKS],
            x: 0x2545_f491_4f6c_dd1d,
            checked: 0,
        }
    }
    fn next_block(&mut self, lanes: usize, lane: usize) -> usize {
        self.x ^= self.x << 13;
        self.x ^= self.x >> 7;
        self.x ^= self.x << 17;
        // Lane `lane` owns blocks congruent to it, so requests in flight together never overlap.
        (self.x as usize % (BLOCKS / lanes)) * lanes + lane
    }
    fn stamp_for(&mut self, block: usize, buf: &mut FixedBuf) {
        let s = self.stamps[block].wrapping_add(1).max(1);
        self.stamps[block] = s;
        buf.fill(s);
    }
    fn check(&mut self, block: usize, buf: &FixedBuf) {
        let want = self.stamps[block];
        assert!(
            buf[0] == want && buf[BLOCK - 1] == want,
            "block {block}: read {} / {}, last wrote {want}",
            buf[0],
            buf[BLOCK - 1]
        );
        self.checked += 1;
    }
}

fn blocking_ops(dev: &Device, w: &mut Workload, buf: &mut Option<FixedBuf>, ops: u32) {
    let mut b = buf.take().expect("buffer");
    for _ in 0..ops / 2 {
        let block = w.next_block(1, 0);
        let off = (block * BLOCK) as u64;
        w.stamp_for(block, &mut b);
        b = dev.write_at_blocking(off, b, false).expect("write");
        b.fill(0);
        b = dev.read_at_blocking(off, b).expect("read");
        w.check(block, &b);
    }
    *buf = Some(b);
}

#[test]
fn blocking_io_on_memory_allocates_nothing() {
    let engine = engine();
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    let dev = Device::memory(&lbio, DEVICE_BYTES).unwrap();
    let mut w = Workload::new();
    let mut buf = Some(engine.try_alloc(BLOCK).unwrap());
    blocking_ops(&dev, &mut w, &mut buf, WARMUP_OPS);
    let ((), n) = allocations_during(|| blocking_ops(&dev, &mut w, &mut buf, OPS));
    println!("blocking API, memory device: {n} allocations in {OPS} reads and writes");
    assert_eq!(w.checked, (WARMUP_OPS + OPS) as u64 / 2);
    assert_eq!(n, 0);
}

/// Lanes of detached requests kept in flight at once.
const LANES: usize = 8;

/// One lane's request in flight: its tag, its block, and whether it is the write or the read.
#[derive(Clone, Copy)]
struct InFlight {
    tag: Tag,
    block: usize,
    write: bool,
}

fn detached_ops(
    engine: &Engine,
    lbio: &LbioArray,
    dev: &Device,
    w: &mut Workload,
    bufs: &mut [Option<FixedBuf>; LANES],
    ops: u32,
) {
    let submit = |io: Io| {
        engine
            .hold_submissions(|| dev.submit(io))
            .unwrap_or_else(|(e, _)| panic!("submit: {e}"))
    };
    let mut lanes: [Option<InFlight>; LANES] = [None; LANES];
    let mut issued = 0u32;
    for (lane, slot) in lanes.iter_mut().enumerate() {
        let block = w.next_block(LANES, lane);
        let mut b = bufs[lane].take().expect("buffer");
        w.stamp_for(block, &mut b);
        let tag = submit(Io::write((block * BLOCK) as u64, b));
        *slot = Some(InFlight {
            tag,
            block,
            write: true,
        });
        issued += 1;
    }
    let mut completed = 0u32;
    while completed < issued {
        lbio.wait_done(1).expect("wait");
        while let Some(c) = lbio.take_done() {
            completed += 1;
            assert_eq!(c.result.expect("request") as usize, BLOCK);
            let lane = lanes
                .iter()
                .position(|l| l.is_some_and(|l| l.tag == c.tag))
                .expect("a lane's request");
            let done = lanes[lane].take().expect("in flight");
            let mut b = c.buf.expect("buffer back");
            if !done.write {
                w.check(done.block, &b);
            }
            if issued >= ops {
                bufs[lane] = Some(b);
                continue;
            }
            // Each lane writes a block, reads it back, then moves to another block.
            let next = if done.write {
                b.fill(0);
                InFlight {
                    tag: submit(Io::read((done.block * BLOCK) as u64, b)),
                    block: done.block,
                    write: false,
                }
            } else {
                let block = w.next_block(LANES, lane);
                w.stamp_for(block, &mut b);
                InFlight {
                    tag: submit(Io::write((block * BLOCK) as u64, b)),
                    block,
                    write: true,
                }
            };
            lanes[lane] = Some(next);
            issued += 1;
        }
    }
    assert!(!engine.has_work());
}

#[test]
fn detached_io_on_a_file_allocates_nothing() {
    let file = temp_file("detached");
    let engine = engine();
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    let dev = open_file(&lbio, &file);
    let mut w = Workload::new();
    let mut bufs: [Option<FixedBuf>; LANES] =
        std::array::from_fn(|_| Some(engine.try_alloc(BLOCK).unwrap()));
    detached_ops(&engine, &lbio, &dev, &mut w, &mut bufs, WARMUP_OPS);
    let checked = w.checked;
    let sqes = engine.metrics().sqes;
    let ((), n) = allocations_during(|| detached_ops(&engine, &lbio, &dev, &mut w, &mut bufs, OPS));
    println!(
        "detached API, O_DIRECT file on io_uring ({LANES} in flight): {n} allocations in {OPS} \
         reads and writes"
    );
    assert_eq!(
        engine.metrics().sqes - sqes,
        OPS as u64,
        "every request went through the ring"
    );
    // Each lane alternates write and read; a lane may stop after its write.
    let reads = w.checked - checked;
    assert!(
        reads >= (OPS as u64 / 2) - LANES as u64,
        "{reads} reads checked"
    );
    assert_eq!(n, 0);
}

async fn async_ops(dev: &Device, w: &mut Workload, mut b: FixedBuf, ops: u32) -> FixedBuf {
    for _ in 0..ops / 2 {
        let block = w.next_block(1, 0);
        let off = (block * BLOCK) as u64;
        w.stamp_for(block, &mut b);
        b = dev
            .write_at(off, b, false)
            .await
            .expect("write")
            .expect("buffer");
        b.fill(0);
        b = dev.read_at(off, b).await.expect("read").expect("buffer");
        w.check(block, &b);
    }
    b
}

fn async_case(engine: &Rc<Engine>, dev: &Device, what: &str) {
    let mut w = Workload::new();
    let b = engine.try_alloc(BLOCK).unwrap();
    let b = engine
        .block_on(async_ops(dev, &mut w, b, WARMUP_OPS))
        .unwrap();
    let (b, n) = allocations_during(|| engine.block_on(async_ops(dev, &mut w, b, OPS)).unwrap());
    drop(b);
    println!("async API, {what}: {n} allocations in {OPS} reads and writes");
    assert_eq!(w.checked, (WARMUP_OPS + OPS) as u64 / 2);
    assert_eq!(n, 0);
}

#[test]
fn async_io_on_memory_allocates_nothing() {
    let engine = engine();
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    let dev = Device::memory(&lbio, DEVICE_BYTES).unwrap();
    async_case(&engine, &dev, "memory device");
}

#[test]
fn async_io_on_a_file_allocates_nothing() {
    let file = temp_file("async");
    let engine = engine();
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    let dev = open_file(&lbio, &file);
    let sqes = engine.metrics().sqes;
    async_case(&engine, &dev, "O_DIRECT file on io_uring");
    assert_eq!(
        engine.metrics().sqes - sqes,
        (WARMUP_OPS + OPS) as u64,
        "every request went through the ring"
    );
}

/// A page cache of 256 frames (a quarter of the file fits) over a fresh `O_DIRECT` test file,
/// in AIOS mode, with this thread's handle attached.
struct CacheOnFile {
    h: pagecache::CacheHandle,
    cache: std::sync::Arc<pagecache::PageCache>,
    lbio: Rc<LbioArray>,
    id: pagecache::FileId,
    file: counting::TempFile,
}

impl CacheOnFile {
    fn new(tag: &str) -> CacheOnFile {
        use pagecache::{CacheConfig, CacheHandle, Mode, PageCache};
        let file = temp_file(tag);
        let engine = engine();
        let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
        let dev = open_file(&lbio, &file);
        let cache = PageCache::new(CacheConfig {
            capacity_bytes: 256 * BLOCK,
            pool_batch: 16,
            readahead_pages: 0,
            huge_pages: false,
            vectored_reads: true,
            ..CacheConfig::default()
        })
        .unwrap();
        let id = cache.add_file(DEVICE_BYTES as u64).unwrap();
        let h = CacheHandle::new(&cache, &engine, &lbio, Mode::AIOS).unwrap();
        h.attach(id, dev).unwrap();
        CacheOnFile {
            h,
            cache,
            lbio,
            id,
            file,
        }
    }
}

#[test]
fn page_cache_hits_misses_and_evictions_allocate_nothing() {
    let CacheOnFile {
        h,
        cache,
        lbio,
        id,
        file: _file,
    } = CacheOnFile::new("pagecache");
    let mut buf = [0u8; BLOCK];
    let mut wide = [0u8; 6 * BLOCK];
    let mut x: u64 = 0x9e37_79b9;
    // A quarter of the file fits: about three reads in four miss and evict. Every fourth read
    // spans six pages (runs of misses read with one scattered request).
    let mut run = |n: u32| {
        for i in 0..n {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let page = x % BLOCKS as u64;
            if i % 4 == 0 {
                let g = h.get(id, page).expect("guard");
                assert!(g.iter().all(|&b| b == 0));
            } else if i % 4 == 1 {
                let page = page.min(BLOCKS as u64 - 7);
                h.read(id, page * BLOCK as u64 + 100, &mut wide)
                    .expect("read");
                assert!(wide.iter().all(|&b| b == 0));
            } else {
                h.read(id, page * BLOCK as u64, &mut buf).expect("read");
                assert!(buf.iter().all(|&b| b == 0));
            }
        }
    };
    run(WARMUP_OPS);
    let before = cache.metrics();
    let ((), n) = allocations_during(|| run(OPS / 4));
    let after = cache.metrics();
    assert!(after.misses - before.misses > 1000, "{after:?}");
    assert!(after.hits - before.hits > 1000, "{after:?}");
    assert!(after.evictions - before.evictions > 1000, "{after:?}");
    assert!(lbio.metrics().vectored_pieces > 100, "{:?}", lbio.metrics());
    assert_eq!(n, 0, "{n} allocations in {} page-cache reads", OPS / 4);
}

/// Rio's ordered writes (attribute log on an emulated PMR, completions handed back in order, a
/// background FLUSH every few thousand writes, `wait` for durability) allocate nothing in steady
/// state: each write its own group sent at once, groups held in the ORDER queue and merged,
/// and groups of several writes.
#[test]
fn rio_ordered_writes_allocate_nothing() {
    use rio_ordering::{AttrLog, Done, MemPmr, OrderedConfig, OrderedDevice, Write};
    const QD: usize = 32;
    // (ORDER queue batch, writes per group, sequential offsets)
    for (batch, per_group, sequential) in [(1, 1, false), (8, 1, true), (1, 3, true)] {
        let engine = engine();
        let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
        let dev = Device::memory(&lbio, DEVICE_BYTES).unwrap();
        let log = AttrLog::format(MemPmr::new(2 << 20), 1).unwrap();
        let cfg = OrderedConfig {
            batch,
            ..OrderedConfig::default()
        };
        let mut od = OrderedDevice::new(lbio, vec![dev], log, &[1], cfg).unwrap();
        let mut free: Vec<FixedBuf> = (0..QD).map(|_| engine.try_alloc(BLOCK).unwrap()).collect();
        let mut got: Vec<Done> = Vec::with_capacity(QD);
        let mut w = Workload::new();
        let mut seq_seen = 0u64;
        let mut written = 0usize;
        let mut run = |n: u32, od: &mut OrderedDevice<MemPmr>| {
            for _ in 0..n {
                while free.is_empty() {
                    od.wait_progress_into(&mut got).expect("wait");
                    for d in got.drain(..) {
                        d.result.expect("write");
                        assert!(d.seq >= seq_seen, "in order");
                        seq_seen = d.seq;
                        free.push(d.buf);
                    }
                }
                let mut buf = free.pop().unwrap();
                let block = if sequential {
                    written % BLOCKS
                } else {
                    w.next_block(1, 0)
                };
                written += 1;
                w.stamp_for(block, &mut buf);
                let wr = Write {
                    target: 0,
                    offset: (block * BLOCK) as u64,
                    buf,
                    ipu: false,
                };
                od.submit(0, wr, written % per_group == 0).expect("submit");
            }
            od.wait(0).expect("durable");
        };
        // Until the lists reach their high-water marks: a background FLUSH goes out after
        // 4,096 completed commands, up to 32 KiB of groups in each at batch 8, and what they
        // track lives until its FLUSH is in. A few such rounds reach every mark.
        run(4 * 4096 * batch.max(per_group) as u32, &mut od);
        let before = od.stats();
        let ((), n) = allocations_during(|| run(OPS, &mut od));
        let after = od.stats();
        assert_eq!(after.requests - before.requests, OPS as u64);
        assert!(after.flushes > before.flushes, "{after:?}");
        if batch > 1 || per_group > 1 {
            assert!(after.merged_cmds > before.merged_cmds, "{after:?}");
        }
        assert_eq!(
            n, 0,
            "{n} allocations in {OPS} ordered writes (batch {batch}, {per_group} per group)"
        );
    }
}

/// Journal commits, in each commit mode, on a real `O_DIRECT` file through io_uring (so every
/// write is waited for): once a thread reuses its `Tx`, commits and the checkpoints that empty
/// the log allocate nothing.
#[test]
fn journal_commits_and_checkpoints_allocate_nothing() {
    use journal::{CommitMode, Journal, JournalSet, Layout, Tx};
    const AREA_BLOCKS: u64 = 64;
    const COMMITS: u32 = 3_000;
    // The three commit modes, and Rio-ordered commits (attribute log in emulated PMR).
    for (mode, rio) in [
        (CommitMode::Vanilla, false),
        (CommitMode::Overlapped, false),
        (CommitMode::OneWrite, false),
        (CommitMode::Overlapped, true),
    ] {
        let name = if rio { "rio" } else { mode.name() };
        let file = temp_file(&format!("journal-{name}"));
        let engine = engine();
        let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
        let set = JournalSet::format(
            &open_file(&lbio, &file),
            Layout::per_core(0, AREA_BLOCKS, 1),
        )
        .unwrap();
        let j = if rio {
            let own = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
            let pmr: Box<dyn rio_ordering::Pmr> = Box::new(rio_ordering::MemPmr::new(256 << 10));
            Journal::with_rio(
                &set,
                0,
                open_file(&lbio, &file),
                open_file(&own, &file),
                pmr,
                rio_ordering::OrderedConfig::default(),
            )
            .unwrap()
        } else {
            Journal::new(&set, 0, open_file(&lbio, &file), mode).unwrap()
        };
        assert_eq!(j.rio_ordered(), rio);
        let mut tx = Tx::new();
        let mut block = [0u8; BLOCK];
        let mut i = 0u64;
        // Each commit: a data block written in place, one or two metadata blocks journaled,
        // and now and then a metadata block revoked.
        let mut run = |n: u32| {
            for _ in 0..n {
                i += 1;
                tx.clear();
                block.fill(i as u8);
                tx.write_data(AREA_BLOCKS + 32 + i % 64, &block).unwrap();
                tx.write_meta(AREA_BLOCKS + 8 + i % 16, &block).unwrap();
                if i % 3 == 0 {
                    tx.write_meta(AREA_BLOCKS + 8 + (i + 5) % 16, &block)
                        .unwrap();
                }
                if i % 50 == 0 {
                    tx.revoke(AREA_BLOCKS + 8 + (i + 9) % 16);
                }
                j.commit(&tx).unwrap();
            }
        };
        run(500);
        let commits = set.stats.commits.load(std::sync::atomic::Ordering::Relaxed);
        let checkpoints = set
            .stats
            .checkpoints
            .load(std::sync::atomic::Ordering::Relaxed);
        let ((), n) = allocations_during(|| run(COMMITS));
        let st = &set.stats;
        assert_eq!(
            st.commits.load(std::sync::atomic::Ordering::Relaxed) - commits,
            COMMITS as u64
        );
        let cps = st.checkpoints.load(std::sync::atomic::Ordering::Relaxed) - checkpoints;
        assert!(cps > 50, "{cps} checkpoints");
        assert_eq!(
            n, 0,
            "{n} allocations in {COMMITS} {name} commits and {cps} checkpoints"
        );
    }
}

/// Page-cache writes (whole pages, into resident pages and into pages that miss and evict) and
/// `sync` every 64 writes allocate nothing, and what `sync` wrote back is on the file.
#[test]
fn page_cache_writes_and_sync_allocate_nothing() {
    let CacheOnFile {
        h, cache, id, file, ..
    } = CacheOnFile::new("pagecache-w");
    let mut buf = [0u8; BLOCK];
    // What each page last had written to it (0: never written; the file starts zeroed).
    let mut last = vec![0u8; BLOCKS];
    let mut x: u64 = 0x9e37_79b9;
    let mut stamp = 0u8;
    let mut run = |n: u32| {
        for i in 0..n {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let page = (x % BLOCKS as u64) as usize;
            stamp = stamp.wrapping_add(1).max(1);
            buf.fill(stamp);
            h.write(id, (page * BLOCK) as u64, &buf).expect("write");
            last[page] = stamp;
            if i % 64 == 63 {
                h.sync(id).expect("sync");
            }
        }
        h.sync(id).expect("sync");
    };
    run(WARMUP_OPS);
    let before = cache.metrics();
    let ((), n) = allocations_during(|| run(20_000));
    let after = cache.metrics();
    assert!(after.writebacks - before.writebacks > 10_000, "{after:?}");
    assert!(after.evictions - before.evictions > 1_000, "{after:?}");
    assert_eq!(
        n, 0,
        "{n} allocations in 20,000 page-cache writes and their syncs"
    );
    let on_file = std::fs::read(&file.0).unwrap();
    for (page, &want) in last.iter().enumerate() {
        let got = &on_file[page * BLOCK..(page + 1) * BLOCK];
        assert!(got.iter().all(|&b| b == want), "page {page}: want {want}");
    }
}

/// Group commit: two threads commit into one journal area, each through its own handle, engine
/// and lbio array over the same `O_DIRECT` file, so one often waits behind the other and joins
/// its group. Once each thread reuses its `Tx`, neither thread allocates, whether it leads a
/// group, joins one or commits alone.
#[test]
fn journal_group_commits_allocate_nothing() {
    use journal::{CommitMode, Journal, JournalSet, Layout, Tx};
    use std::sync::atomic::Ordering;
    use std::sync::{Arc, Barrier};
    const AREA_BLOCKS: u64 = 256;
    const COMMITS: u32 = 3_000;
    let file = Arc::new(temp_file("journal-group"));
    let set = {
        let engine = engine();
        let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
        JournalSet::format(
            &open_file(&lbio, &file),
            Layout::per_core(0, AREA_BLOCKS, 1),
        )
        .unwrap()
    };
    let barrier = Arc::new(Barrier::new(2));
    let threads: Vec<_> = (0..2u64)
        .map(|t| {
            let (set, file, barrier) = (Arc::clone(&set), Arc::clone(&file), Arc::clone(&barrier));
            std::thread::spawn(move || {
                let engine = engine();
                let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
                let j =
                    Journal::new(&set, 0, open_file(&lbio, &file), CommitMode::Overlapped).unwrap();
                let mut tx = Tx::new();
                let mut block = [0u8; BLOCK];
                let mut i = 0u64;
                // Each thread its own data and metadata blocks.
                let base = AREA_BLOCKS + 200 * t;
                let mut run = |n: u32| {
                    for _ in 0..n {
                        i += 1;
                        tx.clear();
                        block.fill(i as u8);
                        tx.write_data(base + 100 + i % 64, &block).unwrap();
                        tx.write_meta(base + i % 16, &block).unwrap();
                        j.commit(&tx).unwrap();
                    }
                };
                run(500);
                barrier.wait();
                let ((), n) = allocations_during(|| run(COMMITS));
                n
            })
        })
        .collect();
    let counts: Vec<u64> = threads.into_iter().map(|h| h.join().unwrap()).collect();
    let st = &set.stats;
    let grouped = st.grouped_commits.load(Ordering::Relaxed);
    assert!(
        grouped > 100,
        "{grouped} commits went out in groups: the test needs them"
    );
    assert!(st.checkpoints.load(Ordering::Relaxed) > 10);
    assert_eq!(
        counts,
        vec![0, 0],
        "allocations per thread in {COMMITS} commits each ({grouped} grouped)"
    );
}

/// aiosfs READs (`Fs::read_into`, what both FUSE transports answer a READ with) allocate
/// nothing: cached and `O_DIRECT`, at any offset and length, over a file of two extents with a
/// hole and a dirty (not yet committed) block, through a page cache small enough to evict.
/// Every read is checked against a model of the file's bytes.
#[test]
fn file_system_reads_allocate_nothing() {
    use fs_fuse::format::{ROOT_INO, S_IFREG};
    use fs_fuse::fs::{Caller, Fs, FsOptions};
    const FILE_BLOCKS: usize = 96;
    let image = counting::TempFile::new("aiosfs-read", 32 << 20);
    fs_fuse::mkfs(
        &image.0,
        &fs_fuse::MkfsOptions {
            journals: 1,
            journal_blocks: 256,
            ..fs_fuse::MkfsOptions::default()
        },
    )
    .expect("mkfs");
    let (fs, _) = Fs::open(
        fs_fuse::mount::image_factory(&image.0),
        FsOptions {
            arena_bytes: 4 << 20,
            cache_bytes: 256 << 10,
            ..FsOptions::default()
        },
    )
    .expect("open the file system");
    let root = Caller { uid: 0, gid: 0 };
    let mk = |name: &[u8]| {
        fs.mknod(ROOT_INO, name, S_IFREG | 0o644, 0, root, None)
            .expect("create")
            .ino
    };
    let (ino, other) = (mk(b"read-me"), mk(b"other"));
    // The file: its first half, then a block of another file (so the second half is a second
    // extent), then the second half with a hole of four blocks in it, all committed; then one
    // block rewritten and left dirty in memory.
    let mut model = vec![0u8; FILE_BLOCKS * BLOCK];
    for (i, b) in model.iter_mut().enumerate() {
        *b = (i / 7 % 251) as u8 + 1;
    }
    let hole = 60..64;
    model[hole.start * BLOCK..hole.end * BLOCK].fill(0);
    let half = FILE_BLOCKS / 2 * BLOCK;
    fs.write(ino, 0, &model[..half]).expect("write");
    fs.fsync(ino).expect("fsync");
    fs.write(other, 0, &[9u8; BLOCK]).expect("write");
    fs.fsync(other).expect("fsync");
    fs.write(ino, half as u64, &model[half..hole.start * BLOCK])
        .expect("write");
    fs.write(ino, (hole.end * BLOCK) as u64, &model[hole.end * BLOCK..])
        .expect("write");
    fs.fsync(ino).expect("fsync");
    model[30 * BLOCK + 100..31 * BLOCK - 100].fill(0xd1);
    fs.write(
        ino,
        (30 * BLOCK + 100) as u64,
        &model[30 * BLOCK + 100..31 * BLOCK - 100],
    )
    .expect("write");

    let mut buf = vec![0u8; 64 << 10];
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut run = |n: u32| {
        for _ in 0..n {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Offsets up to a little past the end; lengths 1 byte to 64 KiB.
            let offset = (x >> 8) % (model.len() as u64 + 2 * BLOCK as u64);
            let len = 1 + (x >> 40) as usize % buf.len();
            let direct = x & 3 == 0;
            let got = fs
                .read_into(ino, offset, &mut buf[..len], direct)
                .expect("read");
            let from = (offset as usize).min(model.len());
            let want = &model[from..(from + len).min(model.len())];
            assert_eq!(got, want.len(), "read of {len} at {offset}");
            assert!(
                buf[..got] == *want,
                "read of {len} at {offset} (direct {direct}): wrong bytes"
            );
        }
    };
    run(500);
    let ((), n) = allocations_during(|| run(5_000));
    assert_eq!(n, 0, "{n} allocations in 5,000 aiosfs reads");
}
