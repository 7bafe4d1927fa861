//! The ordered device on SimDisk targets: completions in order under a device that completes
//! out of order, merging, refusal of overlapping writes in a group, and crashes through the
//! whole device path (power cut with writes in flight, crash images, recovery, data checked).
//!
//! `AIOS_RIO_DEV_SEEDS` sets the crash workloads (default 500, 200 crash draws each: 100,000 crash
//! states); `AIOS_RIO_DEV_SEED=N` replays one.

use std::collections::HashMap;
use std::rc::Rc;

use aios_core::{Engine, EngineConfig};
use lbio::{LbioArray, LbioConfig, SimConfig, SimDisk, SimRng};
use rio_ordering::{
    recover, scan, AttrLog, MemPmr, OrderedConfig, OrderedDevice, Pmr, RioError, Write,
};

const DISK: u64 = 1 << 20;
/// SimDisk's default sector.
const SECTOR: usize = 512;

fn engine() -> Rc<Engine> {
    engine_with_arena(8 << 20)
}

fn engine_with_arena(arena_bytes: usize) -> Rc<Engine> {
    Engine::new(EngineConfig {
        ring_entries: 256,
        arena_bytes,
        huge_pages: false,
        ..EngineConfig::default()
    })
    .unwrap()
}

fn pattern(id: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    for (i, c) in v.chunks_mut(8).enumerate() {
        c.copy_from_slice(&(id.wrapping_mul(0x9e37_79b9) ^ i as u64).to_le_bytes());
    }
    v
}

/// A log region that is either persistent memory or a block log (deferred: appends and persist
/// words are staged and become durable at `sync`, as with `BlockPmr`), kept in memory so that a
/// crash can take exactly what was synced.
enum LogRegion {
    Mem(MemPmr),
    Blocks {
        durable: Vec<u8>,
        image: Vec<u8>,
        dirty: std::collections::BTreeSet<usize>,
        /// Asynchronous syncs: the staged blocks go out as one detached write to this SimDisk
        /// (on the ordered device's own array), and reach `durable` when it completes. A cut
        /// keeps any subset of the blocks of a write still out.
        sink: Option<Box<AsyncSink>>,
    },
}

/// An asynchronous log write out: its tag, and each block with its bytes when it went out.
type LogWriteOut = (lbio::Tag, Vec<(usize, Vec<u8>)>);

struct AsyncSink {
    lbio: Rc<LbioArray>,
    dev: lbio::Device,
    /// The write out: its tag, and each block with its bytes when the write went out.
    out: Option<LogWriteOut>,
}

const LOG_BLOCK: usize = 512;

impl LogRegion {
    fn blocks(len: usize, sink: Option<Box<AsyncSink>>) -> LogRegion {
        LogRegion::Blocks {
            durable: vec![0; len],
            image: vec![0; len],
            dirty: Default::default(),
            sink,
        }
    }
    fn write_back(durable: &mut [u8], image: &[u8], b: usize) {
        let r = b * LOG_BLOCK..((b + 1) * LOG_BLOCK).min(image.len());
        durable[r.clone()].copy_from_slice(&image[r]);
    }
    /// Block `b` from a copy of that block alone.
    fn put_block(durable: &mut [u8], b: usize, bytes: &[u8]) {
        let r = b * LOG_BLOCK..((b + 1) * LOG_BLOCK).min(durable.len());
        let n = r.len();
        durable[r].copy_from_slice(&bytes[..n]);
    }
    /// The region after a power cut: what was synced, plus any subset of the staged blocks (a
    /// sync the cut interrupted).
    fn crash_image(&self, rng: &mut SimRng) -> MemPmr {
        match self {
            LogRegion::Mem(m) => m.clone(),
            LogRegion::Blocks {
                durable,
                image,
                dirty,
                sink,
            } => {
                let mut d = durable.clone();
                for (b, bytes) in sink.iter().flat_map(|s| &s.out).flat_map(|o| &o.1) {
                    if rng.chance(1, 2) {
                        Self::put_block(&mut d, *b, bytes);
                    }
                }
                for &b in dirty {
                    if rng.chance(1, 2) {
                        Self::write_back(&mut d, image, b);
                    }
                }
                let mut m = MemPmr::new(d.len());
                m.bytes_mut().copy_from_slice(&d);
                m
            }
        }
    }
}

impl Pmr for LogRegion {
    fn len(&self) -> usize {
        match self {
            LogRegion::Mem(m) => m.len(),
            LogRegion::Blocks { image, .. } => image.len(),
        }
    }
    fn persist(&mut self, offset: usize, bytes: &[u8]) -> Result<(), RioError> {
        match self {
            LogRegion::Mem(m) => m.persist(offset, bytes),
            LogRegion::Blocks { image, dirty, .. } => {
                image[offset..offset + bytes.len()].copy_from_slice(bytes);
                for b in offset / LOG_BLOCK..(offset + bytes.len()).div_ceil(LOG_BLOCK) {
                    dirty.insert(b);
                }
                Ok(())
            }
        }
    }
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), RioError> {
        match self {
            LogRegion::Mem(m) => m.read(offset, out),
            LogRegion::Blocks { image, .. } => {
                out.copy_from_slice(&image[offset..offset + out.len()]);
                Ok(())
            }
        }
    }
    fn deferred(&self) -> bool {
        matches!(self, LogRegion::Blocks { .. })
    }
    fn block_bytes(&self) -> usize {
        if self.deferred() {
            LOG_BLOCK
        } else {
            1
        }
    }
    fn sync(&mut self) -> Result<(), RioError> {
        if let LogRegion::Blocks {
            durable,
            image,
            dirty,
            sink,
        } = self
        {
            assert!(
                sink.as_ref().is_none_or(|s| s.out.is_none()),
                "a blocking sync while asynchronous log writes are out"
            );
            for b in std::mem::take(dirty) {
                Self::write_back(durable, image, b);
            }
        }
        Ok(())
    }
    fn async_array(&self) -> Option<&Rc<LbioArray>> {
        match self {
            LogRegion::Blocks { sink: Some(s), .. } => Some(&s.lbio),
            _ => None,
        }
    }
    fn sync_start(&mut self) -> Result<usize, RioError> {
        let LogRegion::Blocks {
            image,
            dirty,
            sink: Some(s),
            ..
        } = self
        else {
            return self.sync().map(|()| 0);
        };
        assert!(
            s.out.is_none(),
            "a second asynchronous sync while one is out"
        );
        if dirty.is_empty() {
            return Ok(0);
        }
        let blocks: Vec<(usize, Vec<u8>)> = std::mem::take(dirty)
            .into_iter()
            .map(|b| {
                let r = b * LOG_BLOCK..((b + 1) * LOG_BLOCK).min(image.len());
                let mut bytes = vec![0; LOG_BLOCK];
                bytes[..r.len()].copy_from_slice(&image[r]);
                (b, bytes)
            })
            .collect();
        let buf = s.lbio.engine().alloc_blocking(4096).unwrap();
        let tag = s
            .dev
            .submit(lbio::Io::write(0, buf).fua(true))
            .map_err(|(e, _)| RioError::Config(format!("log write: {e}")))?;
        s.out = Some((tag, blocks));
        Ok(1)
    }
    fn sync_owns(&self, tag: lbio::Tag) -> bool {
        matches!(self, LogRegion::Blocks { sink: Some(s), .. } if s.out.as_ref().is_some_and(|o| o.0 == tag))
    }
    fn sync_done(&mut self, c: lbio::Completion) -> Result<(), RioError> {
        let LogRegion::Blocks {
            durable,
            sink: Some(s),
            ..
        } = self
        else {
            panic!("a log write completion without an asynchronous sink");
        };
        let (tag, blocks) = s.out.take().expect("our write");
        assert_eq!(tag, c.tag);
        c.result
            .map_err(|e| RioError::Config(format!("log write: {e}")))?;
        for (b, bytes) in blocks {
            Self::put_block(durable, b, &bytes);
        }
        Ok(())
    }
    fn persist_ordered(&mut self, offset: usize, bytes: &[u8]) -> Result<(), RioError> {
        self.persist(offset, bytes)?;
        if let LogRegion::Blocks {
            durable,
            image,
            dirty,
            ..
        } = self
        {
            for b in offset / LOG_BLOCK..(offset + bytes.len()).div_ceil(LOG_BLOCK) {
                Self::write_back(durable, image, b);
                dirty.remove(&b);
            }
        }
        Ok(())
    }
}

struct Rig {
    engine: Rc<Engine>,
    disks: Vec<SimDisk>,
    dev: OrderedDevice<LogRegion>,
    /// The disk an asynchronous block log writes to (its contents are not looked at).
    log_disk: Option<SimDisk>,
}

fn rig(
    seed: u64,
    targets: usize,
    plp: &[bool],
    streams: u16,
    slots: usize,
    cfg: OrderedConfig,
) -> Rig {
    rig_with(seed, targets, plp, streams, slots, cfg, RigOpts::default())
}

/// Less common rig settings.
#[derive(Clone, Copy)]
struct RigOpts {
    /// Keep the log in device blocks (deferred) instead of memory.
    block_log: bool,
    /// ...synced with detached writes on the ordered device's array (asynchronous).
    async_log: bool,
    /// Request slots of the lbio array.
    slots: u32,
    /// The largest request a target takes.
    max_transfer: u32,
}

impl Default for RigOpts {
    fn default() -> Self {
        RigOpts {
            block_log: false,
            async_log: false,
            slots: LbioConfig::default().slots,
            max_transfer: 1 << 20,
        }
    }
}

fn rig_with(
    seed: u64,
    targets: usize,
    plp: &[bool],
    streams: u16,
    slots: usize,
    cfg: OrderedConfig,
    opts: RigOpts,
) -> Rig {
    let RigOpts {
        block_log,
        async_log,
        slots: lbio_slots,
        max_transfer,
    } = opts;
    let engine = engine();
    let lbio = LbioArray::new(
        Rc::clone(&engine),
        LbioConfig {
            slots: lbio_slots,
            ..LbioConfig::default()
        },
    )
    .unwrap();
    let disks: Vec<SimDisk> = (0..targets)
        .map(|t| {
            let mut c = SimConfig::new(DISK, seed.wrapping_mul(31).wrapping_add(t as u64));
            c.plp = plp[t];
            c.max_transfer_bytes = max_transfer;
            SimDisk::new(c).unwrap()
        })
        .collect();
    let devs = disks.iter().map(|d| d.open(&lbio).unwrap()).collect();
    let bytes = 2 * 576 + slots * 64;
    let mut log_disk = None;
    let region = if block_log {
        let sink = async_log.then(|| {
            let disk = SimDisk::new(SimConfig::new(DISK, seed ^ 0x106)).unwrap();
            let dev = disk.open(&lbio).unwrap();
            log_disk = Some(disk);
            Box::new(AsyncSink {
                lbio: Rc::clone(&lbio),
                dev,
                out: None,
            })
        });
        // Room for the header block and the same number of slots.
        LogRegion::blocks(bytes.div_ceil(LOG_BLOCK) * LOG_BLOCK + LOG_BLOCK, sink)
    } else {
        LogRegion::Mem(MemPmr::new(bytes))
    };
    let log = AttrLog::format(region, streams).unwrap();
    let start = vec![1; streams as usize];
    let dev = OrderedDevice::new(lbio, devs, log, &start, cfg).unwrap();
    Rig {
        engine,
        disks,
        dev,
        log_disk,
    }
}

fn write(engine: &Engine, target: u16, offset: u64, id: u64, len: usize) -> Write {
    let mut buf = engine.alloc_blocking(len).unwrap();
    buf.copy_from_slice(&pattern(id, len));
    Write {
        target,
        offset,
        buf,
        ipu: false,
    }
}

#[test]
fn completions_come_back_in_order_from_a_device_that_completes_out_of_order() {
    for seed in 1..=20u64 {
        let mut r = rig(seed, 2, &[true, false], 2, 256, OrderedConfig::default());
        let mut rng = SimRng::new(seed);
        let mut submitted: HashMap<u16, Vec<(u64, u64)>> = HashMap::new(); // id, seq
        let mut got: Vec<rio_ordering::Done> = Vec::new();
        let mut next_off = [0u64; 2];
        for _ in 0..200 {
            let s = rng.below(2) as u16;
            let t = rng.below(2) as u16;
            let seq = r.dev.next_seq(s);
            let off = next_off[t as usize];
            next_off[t as usize] = (off + 4096) % DISK;
            let id = r
                .dev
                .submit(s, write(&r.engine, t, off, seq, 4096), rng.chance(1, 2))
                .unwrap();
            submitted.entry(s).or_default().push((id, seq));
            if rng.chance(1, 4) {
                got.extend(r.dev.poll().unwrap());
            }
        }
        for s in 0..2 {
            r.dev.wait(s).unwrap();
        }
        got.extend(r.dev.poll().unwrap());
        for s in 0..2u16 {
            let ids: Vec<u64> = got.iter().filter(|d| d.stream == s).map(|d| d.id).collect();
            let want: Vec<u64> = submitted[&s].iter().map(|x| x.0).collect();
            assert_eq!(
                ids, want,
                "seed {seed} stream {s}: completions in submission order"
            );
            assert!(got
                .iter()
                .filter(|d| d.stream == s)
                .all(|d| d.result.is_ok() && d.buf.len() == 4096));
        }
    }
}

#[test]
fn thirty_two_sequential_writes_become_at_most_two_commands() {
    let cfg = OrderedConfig {
        batch: 32,
        ..OrderedConfig::default()
    };
    let mut r = rig(7, 1, &[true], 1, 256, cfg);
    for i in 0..32u64 {
        r.dev
            .submit(0, write(&r.engine, 0, i * 4096, i, 4096), true)
            .unwrap();
    }
    r.dev.wait(0).unwrap();
    let st = r.dev.stats();
    assert!(st.device_cmds <= 2, "{st:?}");
    assert_eq!(st.requests, 32);
    let done = r.dev.poll().unwrap();
    assert_eq!(done.len(), 32);
    assert!(done.windows(2).all(|w| w[0].seq < w[1].seq));
    // Merged and written: the data is where it belongs.
    let img = r.disks[0].view();
    for i in 0..32u64 {
        let at = (i * 4096) as usize;
        assert_eq!(
            &img[at..at + 4096],
            pattern(i, 4096).as_slice(),
            "block {i}"
        );
    }
    // Without merging: one command per write.
    let cfg = OrderedConfig {
        batch: 32,
        merge: false,
        ..OrderedConfig::default()
    };
    let mut r = rig(7, 1, &[true], 1, 256, cfg);
    for i in 0..32u64 {
        r.dev
            .submit(0, write(&r.engine, 0, i * 4096, i, 4096), true)
            .unwrap();
    }
    r.dev.wait(0).unwrap();
    assert_eq!(r.dev.stats().device_cmds, 32);
}

#[test]
fn overlapping_writes_in_one_group_are_refused() {
    let mut r = rig(3, 1, &[true], 1, 64, OrderedConfig::default());
    r.dev
        .submit(0, write(&r.engine, 0, 0, 1, 8192), false)
        .unwrap();
    let e = r
        .dev
        .submit(0, write(&r.engine, 0, 4096, 2, 4096), true)
        .unwrap_err();
    assert!(
        matches!(
            e,
            RioError::OverlapInGroup {
                offset: 4096,
                end: 8192,
                ..
            }
        ),
        "{e}"
    );
    // In the next group the same bytes are fine: groups are ordered.
    r.dev
        .submit(0, write(&r.engine, 0, 12288, 3, 4096), true)
        .unwrap();
    r.dev
        .submit(0, write(&r.engine, 0, 4096, 4, 4096), true)
        .unwrap();
    r.dev.wait(0).unwrap();
}

/// A write: (stream, seq, target, offset, len, pattern id).
type WriteRec = (u16, u64, u16, u64, usize, u64);

/// Recovers `sc` and checks it against the writes: every acknowledged group is in its stream's
/// prefix, and in each of `images` crash states drawn from the (cut) disks every write of a
/// prefix is intact. Returns the writes checked.
fn check_crash(
    what: &str,
    sc: &rio_ordering::LogScan,
    plp: &[bool],
    acked_below: &[u64],
    writes: &[WriteRec],
    disks: &[SimDisk],
    images: usize,
) -> Result<u64, String> {
    let rec = recover(sc, &|t| plp[t as usize]);
    if !rec.damaged.is_empty() {
        return Err(format!("{what}: damaged entries {:?}", rec.damaged));
    }
    for sr in &rec.streams {
        let acked = acked_below[sr.stream as usize];
        if sr.prefix_end < acked {
            return Err(format!(
                "{what}: stream {}: acknowledged below {acked}, prefix ends at {} ({:?})",
                sr.stream, sr.prefix_end, sr.stopped_by
            ));
        }
    }
    // The writes to check: those in a recovered prefix.
    let in_prefix: Vec<&WriteRec> = writes
        .iter()
        .filter(|w| {
            let sr = &rec.streams[w.0 as usize];
            w.1 >= sr.base && w.1 < sr.prefix_end
        })
        .collect();
    let media: Vec<Vec<u8>> = disks.iter().map(|d| d.media()).collect();
    // Every write goes to fresh bytes, so a recovered write is intact in a crash state iff each
    // of its sectors is either durable already or put back by that state's draw (checked byte
    // for byte). Writes already durable hold in every state; the others are checked per draw.
    let mut at_risk: HashMap<u64, (usize, usize)> = HashMap::new(); // sector -> (write, chunk)
    for (w, &&(_, _, t, off, len, id)) in in_prefix.iter().enumerate() {
        let want = pattern(id, len);
        let m = &media[t as usize];
        for (i, chunk) in want.chunks(SECTOR).enumerate() {
            let at = off as usize + i * SECTOR;
            if &m[at..at + SECTOR] != chunk {
                at_risk.insert(((t as u64) << 48) | at as u64, (w, i));
            }
        }
    }
    let mut checked = 0u64;
    for k in 0..images {
        let mut back: std::collections::HashSet<u64> = std::collections::HashSet::new();
        for (t, d) in disks.iter().enumerate() {
            d.crash_draw(true, &mut |at, bytes| {
                let key = ((t as u64) << 48) | at;
                if let Some(&(w, i)) = at_risk.get(&key) {
                    let &(_, _, _, _, len, id) = in_prefix[w];
                    let want = pattern(id, len);
                    if bytes == &want[i * SECTOR..(i + 1) * SECTOR] {
                        back.insert(key);
                    }
                }
            });
        }
        if let Some((key, &(w, _))) = at_risk.iter().find(|(key, _)| !back.contains(key)) {
            let &(s, seq, t, off, _, _) = in_prefix[w];
            let sr = &rec.streams[s as usize];
            return Err(format!(
                "{what} state {k}: stream {s} group {seq} (in the recovered prefix {}..{}) \
                 lost its write at {off} on target {t}, sector {} (power-loss protected: {})",
                sr.base,
                sr.prefix_end,
                key & ((1 << 48) - 1),
                plp[t as usize]
            ));
        }
        checked += in_prefix.len() as u64;
    }
    Ok(checked)
}

/// One crash workload: random streams, groups, sizes (some above the transfer limit: split),
/// targets with and without power-loss protection, waits; a power cut; images; recovery.
fn crash_run(seed: u64, images: usize) -> Result<(usize, u64, u64, u64, u64), String> {
    let mut rng = SimRng::new(seed);
    let targets = 1 + rng.below(3) as usize;
    let plp: Vec<bool> = (0..targets).map(|_| rng.chance(1, 2)).collect();
    let streams = 1 + rng.below(3) as u16;
    let cfg = OrderedConfig {
        batch: 1 + rng.below(4) as usize,
        merge: rng.chance(2, 3),
        // Background FLUSHes: after every completed write, after a few, or only at `wait` and
        // on a full log.
        flush_ahead: [1, 4, 16, 0, 1024][rng.below(5) as usize],
        ..OrderedConfig::default()
    };
    let block_log = rng.chance(1, 2);
    let async_log = block_log && rng.chance(1, 2);
    // Half the runs on devices taking at most 8 KiB a request: larger writes go out in pieces.
    let max_transfer = if rng.chance(1, 2) { 8192 } else { 1 << 20 };
    let mut r = rig_with(
        seed,
        targets,
        &plp,
        streams,
        64 + rng.below(64) as usize,
        cfg,
        RigOpts {
            block_log,
            async_log,
            max_transfer,
            ..RigOpts::default()
        },
    );
    // Every write goes to fresh bytes (out-of-place), so the image shows which landed.
    let mut next_off = vec![0u64; targets];
    // (stream, seq, target, offset, len, id)
    let mut writes: Vec<WriteRec> = Vec::new();
    let mut acked_below = vec![1u64; streams as usize];
    let steps = 20 + rng.below(150);
    for _ in 0..steps {
        let s = rng.below(streams as u64) as u16;
        match rng.below(10) {
            0..=6 => {
                let t = rng.below(targets as u64) as u16;
                let len = 4096 * (1 + rng.below(4) as usize);
                let off = next_off[t as usize];
                if off + len as u64 > DISK {
                    break;
                }
                next_off[t as usize] = off + len as u64;
                let seq = r.dev.next_seq(s);
                let id = r
                    .dev
                    .submit(
                        s,
                        write(&r.engine, t, off, seq * 1000 + off, len),
                        rng.chance(1, 2),
                    )
                    .map_err(|e| format!("seed {seed}: submit: {e}"))?;
                writes.push((s, seq, t, off, len, seq * 1000 + off));
                let _ = id;
            }
            7 | 8 => {
                r.dev
                    .poll()
                    .map_err(|e| format!("seed {seed}: poll: {e}"))?;
            }
            _ => {
                let next = r.dev.next_seq(s);
                r.dev
                    .wait(s)
                    .map_err(|e| format!("seed {seed}: wait: {e}"))?;
                // Everything submitted before the wait, including an open group it closed.
                acked_below[s as usize] = r.dev.next_seq(s).max(next);
            }
        }
    }
    // Power cut on every target at once, with whatever is in flight.
    for d in r.disks.iter().chain(&r.log_disk) {
        d.cut_power();
    }
    let log_image = r.dev.log().pmr().crash_image(&mut rng);
    let sc = scan(&log_image).map_err(|e| format!("seed {seed}: scan: {e}"))?;
    let checked = check_crash(
        &format!("seed {seed} (block log: {block_log}, asynchronous: {async_log})"),
        &sc,
        &plp,
        &acked_below,
        &writes,
        &r.disks,
        images,
    )?;
    let st = r.dev.stats();
    let async_syncs = if async_log { st.log_syncs } else { 0 };
    Ok((
        images,
        checked,
        st.split_cmds,
        st.flushes_ahead,
        async_syncs,
    ))
}

#[test]
fn crashes_through_the_device_path_keep_a_durable_prefix_with_every_acknowledged_write() {
    let seeds: Vec<u64> = match std::env::var("AIOS_RIO_DEV_SEED") {
        Ok(s) => vec![s.parse().unwrap()],
        Err(_) => (1..=std::env::var("AIOS_RIO_DEV_SEEDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(500))
            .collect(),
    };
    let (mut states, mut writes, mut ahead, mut split) = (0usize, 0u64, 0u64, 0u64);
    let mut async_syncs = 0u64;
    let t0 = std::time::Instant::now();
    for &seed in &seeds {
        match crash_run(seed, 200) {
            Ok((s, w, p, a, y)) => {
                async_syncs += y;
                states += s;
                writes += w;
                split += p;
                ahead += a;
            }
            Err(e) => panic!(
                "{e}\nreplay with: AIOS_RIO_DEV_SEED={seed} cargo test -p rio-ordering --test device_sim"
            ),
        }
    }
    if seeds.len() > 1 {
        assert!(
            split > 0 && ahead > 0 && async_syncs > 0,
            "the workloads split requests ({split}), FLUSH in the background ({ahead}) and sync \
             block logs asynchronously ({async_syncs})"
        );
    }
    println!(
        "rio device crashes: {} workloads ({split} split pieces, {ahead} background FLUSHes, \
         {async_syncs} asynchronous block log syncs), \
         {states} crash states, \
         {writes} recovered writes checked against them in {:.1} s, 0 violations",
        seeds.len(),
        t0.elapsed().as_secs_f64()
    );
}

/// What the stealing test's main thread asks a worker (one ordered device on its own thread).
enum Op {
    Write {
        stream: u16,
        target: u16,
        offset: u64,
        len: usize,
        id: u64,
        end: bool,
    },
    Poll,
    Wait(u16),
    Detach(u16),
    Attach(rio_ordering::StreamHandoff),
    Finish,
}

enum Reply {
    Seq(u64),
    Acked(u64),
    Handoff(rio_ordering::StreamHandoff),
    Done,
    Log(MemPmr),
    Failed(String),
}

fn worker(
    disks: Vec<SimDisk>,
    start: Vec<u64>,
    rx: std::sync::mpsc::Receiver<Op>,
    tx: std::sync::mpsc::Sender<Reply>,
    flush_ahead: usize,
) {
    let engine = engine();
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    let devs = disks.iter().map(|d| d.open(&lbio).unwrap()).collect();
    let log = AttrLog::format(MemPmr::new(2 * 576 + 256 * 64), start.len() as u16).unwrap();
    let cfg = OrderedConfig {
        flush_ahead,
        ..OrderedConfig::default()
    };
    let mut dev = OrderedDevice::new(lbio, devs, log, &start, cfg).unwrap();
    for op in rx {
        let reply = match op {
            Op::Write {
                stream,
                target,
                offset,
                len,
                id,
                end,
            } => {
                let seq = dev.next_seq(stream);
                match dev.submit(stream, write(&engine, target, offset, id, len), end) {
                    Ok(_) => Reply::Seq(seq),
                    Err(e) => Reply::Failed(format!("submit: {e}")),
                }
            }
            Op::Poll => match dev.poll() {
                Ok(_) => Reply::Done,
                Err(e) => Reply::Failed(format!("poll: {e}")),
            },
            Op::Wait(s) => match dev.wait(s) {
                Ok(()) => Reply::Acked(dev.next_seq(s)),
                Err(e) => Reply::Failed(format!("wait: {e}")),
            },
            Op::Detach(s) => match dev.detach(s) {
                Ok((h, _done)) => Reply::Handoff(h),
                Err(e) => Reply::Failed(format!("detach: {e}")),
            },
            Op::Attach(h) => match dev.attach(h) {
                Ok(()) => Reply::Done,
                Err(e) => Reply::Failed(format!("attach: {e}")),
            },
            Op::Finish => {
                let _ = tx.send(Reply::Log(dev.log().pmr().clone()));
                return;
            }
        };
        if tx.send(reply).is_err() {
            return;
        }
    }
}

/// Stream stealing: two streams move back and forth between two threads, each with its own
/// ordered device, engine and attribute log, over the same targets; then a power cut. The two
/// logs read as one recover, per stream, a prefix holding every acknowledged write, intact.
#[test]
fn streams_moving_between_threads_keep_their_order_through_a_crash() {
    let mut states = 0usize;
    for seed in 1..=40u64 {
        let mut rng = SimRng::new(seed ^ 0x57ea1);
        let targets = 1 + rng.below(2) as usize;
        let plp: Vec<bool> = (0..targets).map(|_| rng.chance(1, 2)).collect();
        let disks: Vec<SimDisk> = (0..targets)
            .map(|t| {
                let mut c = SimConfig::new(DISK, seed * 7 + t as u64);
                c.plp = plp[t];
                SimDisk::new(c).unwrap()
            })
            .collect();
        std::thread::scope(|scope| {
            // Inside the scope, so that a failing check drops the channels and the workers end
            // (the scope joins them before the panic goes on).
            let mut chans = Vec::new();
            // Worker 0 starts with stream 0, worker 1 with stream 1.
            for w in 0..2usize {
                let (otx, orx) = std::sync::mpsc::channel::<Op>();
                let (rtx, rrx) = std::sync::mpsc::channel::<Reply>();
                let d = disks.clone();
                let start = if w == 0 { vec![1, 0] } else { vec![0, 1] };
                // Odd seeds FLUSH in the background every 2 writes: streams leave with one out.
                let ahead = if seed % 2 == 1 { 2 } else { 1024 };
                scope.spawn(move || worker(d, start, orx, rtx, ahead));
                chans.push((otx, rrx));
            }
            let ask = |w: usize, op: Op| -> Reply {
                chans[w].0.send(op).unwrap();
                match chans[w].1.recv().unwrap() {
                    Reply::Failed(e) => panic!("seed {seed}: worker {w}: {e}"),
                    r => r,
                }
            };
            let mut home = [0usize, 1usize];
            let mut next_off = vec![0u64; targets];
            let mut writes: Vec<WriteRec> = Vec::new();
            let mut acked_below = vec![1u64; 2];
            let mut moves = 0;
            for _ in 0..150 {
                let s = rng.below(2) as u16;
                let w = home[s as usize];
                match rng.below(12) {
                    0..=7 => {
                        let t = rng.below(targets as u64) as u16;
                        let len = 4096 * (1 + rng.below(2) as usize);
                        let off = next_off[t as usize];
                        if off + len as u64 > DISK {
                            break;
                        }
                        next_off[t as usize] += len as u64;
                        let id = writes.len() as u64 + 1;
                        let end = rng.chance(1, 2);
                        let Reply::Seq(seq) = ask(
                            w,
                            Op::Write {
                                stream: s,
                                target: t,
                                offset: off,
                                len,
                                id,
                                end,
                            },
                        ) else {
                            unreachable!()
                        };
                        writes.push((s, seq, t, off, len, id));
                    }
                    8 => {
                        ask(w, Op::Poll);
                    }
                    9 => {
                        let Reply::Acked(below) = ask(w, Op::Wait(s)) else {
                            unreachable!()
                        };
                        acked_below[s as usize] = below;
                    }
                    _ => {
                        // Steal: the stream moves to the other thread.
                        let Reply::Handoff(h) = ask(w, Op::Detach(s)) else {
                            unreachable!()
                        };
                        // Detaching made everything before durable.
                        acked_below[s as usize] = h.next_seq;
                        let other = 1 - w;
                        ask(other, Op::Attach(h));
                        home[s as usize] = other;
                        moves += 1;
                    }
                }
            }
            for d in &disks {
                d.cut_power();
            }
            let mut scans = Vec::new();
            for (w, (otx, rrx)) in chans.iter().enumerate() {
                otx.send(Op::Finish).unwrap();
                let Reply::Log(pmr) = rrx.recv().unwrap() else {
                    panic!("seed {seed}: worker {w} sent no log")
                };
                scans.push(scan(&pmr).unwrap());
            }
            let merged = rio_ordering::LogScan::merge(&scans).unwrap();
            let what = format!("seed {seed} ({moves} moves)");
            check_crash(&what, &merged, &plp, &acked_below, &writes, &disks, 100)
                .unwrap_or_else(|e| panic!("{e}"));
            states += 100;
        });
    }
    println!("stream stealing: 40 workloads, {states} crash states, 0 violations");
}

#[test]
fn background_flushes_keep_the_log_from_filling() {
    // 1,000 single-write groups, 8 in flight, on a target without power-loss protection and a
    // 64-slot log, never waiting until the end: entries are freed only when a FLUSH makes their
    // writes durable.
    let run = |flush_ahead: usize| {
        let cfg = OrderedConfig {
            flush_ahead,
            ..OrderedConfig::default()
        };
        let mut r = rig(9, 1, &[false], 1, 64, cfg);
        let mut got = Vec::new();
        let mut handed_back = 0;
        for i in 0..1000u64 {
            while r.dev.in_flight() >= 8 {
                r.dev.wait_progress_into(&mut got).unwrap();
                handed_back += got.drain(..).count();
            }
            let w = write(&r.engine, 0, (i % 256) * 4096, i, 4096);
            r.dev.submit(0, w, true).unwrap();
        }
        r.dev.wait(0).unwrap();
        handed_back += r.dev.poll().unwrap().len();
        assert_eq!(handed_back, 1000, "every write handed back");
        r.dev.stats()
    };
    let ahead = run(8);
    let without = run(0);
    assert_eq!(without.flushes_ahead, 0);
    assert!(
        without.log_full_waits > 0,
        "without background FLUSHes the log fills: {without:?}"
    );
    assert!(
        ahead.flushes_ahead > 0 && ahead.log_full_waits * 10 < without.log_full_waits,
        "background FLUSHes free the log: {ahead:?} against {without:?}"
    );
}

#[test]
fn every_write_gets_its_own_buffer_back() {
    // Writes of 4-20 KiB on a device taking 8 KiB a request (split into pieces), groups of
    // several writes, an ORDER queue of 4 groups merging contiguous ones, and a device that
    // completes out of order: each completion carries the caller's own buffer, whole.
    let (mut split, mut merged) = (0, 0);
    for seed in 1..=10u64 {
        let cfg = OrderedConfig {
            batch: 4,
            ..OrderedConfig::default()
        };
        let opts = RigOpts {
            max_transfer: 8192,
            ..RigOpts::default()
        };
        let mut r = rig_with(seed, 1, &[false], 1, 256, cfg, opts);
        let mut rng = SimRng::new(seed);
        let mut sent: HashMap<u64, (u64, usize)> = HashMap::new(); // id -> (offset, len)
        let mut got = Vec::new();
        let mut off = 0u64;
        for _ in 0..50 {
            let len = 4096 * (1 + rng.below(5) as usize);
            let id = r
                .dev
                .submit(0, write(&r.engine, 0, off, off, len), rng.chance(2, 3))
                .unwrap();
            sent.insert(id, (off, len));
            off += len as u64;
            if rng.chance(1, 4) {
                got.extend(r.dev.poll().unwrap());
            }
        }
        r.dev.wait(0).unwrap();
        got.extend(r.dev.poll().unwrap());
        assert_eq!(
            got.len(),
            sent.len(),
            "seed {seed}: every write handed back"
        );
        for d in &got {
            let (off, len) = sent[&d.id];
            assert!(d.result.is_ok(), "seed {seed}: write {} failed", d.id);
            assert!(
                d.buf.len() == len && d.buf[..] == pattern(off, len)[..],
                "seed {seed}: write {} ({len} bytes) got a buffer of {} bytes, or other bytes",
                d.id,
                d.buf.len()
            );
        }
        split += r.dev.stats().split_cmds;
        merged += r.dev.stats().merged_cmds;
    }
    assert!(split > 0 && merged > 0, "split {split}, merged {merged}");
}

#[test]
fn more_writes_than_request_slots_wait_for_slots_with_either_log() {
    // 100 writes submitted without a wait on an array of 8 request slots: with a PMR the
    // sends, with an asynchronous block log the batch sent from the log write's completion,
    // wait for completions to free slots instead of failing.
    for (block_log, async_log) in [(false, false), (true, true)] {
        let opts = RigOpts {
            block_log,
            async_log,
            slots: 8,
            ..RigOpts::default()
        };
        let mut r = rig_with(7, 1, &[false], 1, 256, OrderedConfig::default(), opts);
        let mut want = Vec::new();
        for k in 0..100u64 {
            let id = r
                .dev
                .submit(0, write(&r.engine, 0, k * 4096, k, 4096), true)
                .unwrap_or_else(|e| panic!("block log {block_log}: write {k}: {e}"));
            want.push((id, k));
        }
        r.dev.wait(0).unwrap();
        let got = r.dev.poll().unwrap();
        assert_eq!(
            got.len(),
            100,
            "block log {block_log}: every write handed back"
        );
        for (d, &(id, k)) in got.iter().zip(&want) {
            assert_eq!(d.id, id, "in order");
            assert!(d.result.is_ok() && d.buf[..] == pattern(k, 4096)[..]);
        }
        let st = r.dev.stats();
        assert_eq!(st.device_cmds, 100);
        assert_eq!(st.log_syncs > 0, block_log, "{st:?}");
    }
}

#[test]
fn a_stream_leaves_while_a_background_flush_is_out() {
    // `detach` needs every group of the stream durable; a background FLUSH still out when it is
    // called covers some of them, and `wait` must account for it first.
    for seed in 1..=20u64 {
        let cfg = OrderedConfig {
            flush_ahead: 2,
            ..OrderedConfig::default()
        };
        let mut r = rig(seed, 1, &[false], 1, 64, cfg);
        let mut got = Vec::new();
        for i in 0..12u64 {
            let w = write(&r.engine, 0, i * 4096, i, 4096);
            r.dev.submit(0, w, true).unwrap();
            if i % 3 == 2 {
                r.dev.wait_progress_into(&mut got).unwrap();
            }
        }
        let (h, rest) = r
            .dev
            .detach(0)
            .unwrap_or_else(|e| panic!("seed {seed}: detach: {e}"));
        assert_eq!(
            got.len() + rest.len(),
            12,
            "seed {seed}: every write handed back"
        );
        assert_eq!(h.next_seq, 13);
        assert!(
            r.dev.stats().flushes_ahead > 0,
            "seed {seed}: no background FLUSH"
        );
    }
}

/// Persistent memory whose writes fail while `fail` is set (a PMR gone bad for a moment).
struct Flaky {
    mem: MemPmr,
    fail: Rc<std::cell::Cell<bool>>,
}

impl Pmr for Flaky {
    fn len(&self) -> usize {
        self.mem.len()
    }
    fn persist(&mut self, offset: usize, bytes: &[u8]) -> Result<(), RioError> {
        if self.fail.get() {
            return Err(RioError::Corrupt(
                "injected: the region refused a write".into(),
            ));
        }
        self.mem.persist(offset, bytes)
    }
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), RioError> {
        self.mem.read(offset, out)
    }
}

#[test]
fn a_write_whose_log_entry_fails_leaves_no_hole_in_the_order() {
    let engine = engine();
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    let disk = SimDisk::new(SimConfig::new(DISK, 7)).unwrap();
    let fail = Rc::new(std::cell::Cell::new(false));
    let region = Flaky {
        mem: MemPmr::new(64 << 10),
        fail: Rc::clone(&fail),
    };
    let log = AttrLog::format(region, 1).unwrap();
    let devs = vec![disk.open(&lbio).unwrap()];
    let mut dev = OrderedDevice::new(lbio, devs, log, &[1], OrderedConfig::default()).unwrap();
    let first = dev.submit(0, write(&engine, 0, 0, 1, 4096), true).unwrap();
    fail.set(true);
    let refused = dev.submit(0, write(&engine, 0, 4096, 2, 4096), true);
    assert!(
        matches!(refused, Err(RioError::Corrupt(_))),
        "the log's error comes back: {refused:?}"
    );
    fail.set(false);
    let ids: Vec<u64> = (3..6)
        .map(|k| {
            dev.submit(0, write(&engine, 0, k * 4096, k, 4096), true)
                .unwrap()
        })
        .collect();
    dev.wait(0).unwrap();
    let done = dev.poll().unwrap();
    // The refused write took no group and no id: the next write has the ones it would have had.
    assert_eq!(ids, vec![first + 1, first + 2, first + 3]);
    assert_eq!(
        done.iter().map(|d| (d.seq, d.id)).collect::<Vec<_>>(),
        vec![(1, first), (2, first + 1), (3, first + 2), (4, first + 3)]
    );
    assert!(done.iter().all(|d| d.result.is_ok()));
    // The log holds exactly those four groups' entries (besides `wait`'s FLUSH marker).
    let sc = scan(dev.log().pmr()).unwrap();
    let mut seqs: Vec<u64> = sc
        .entries
        .iter()
        .filter(|(_, a)| !a.flush)
        .map(|(_, a)| a.seq)
        .collect();
    seqs.sort_unstable();
    assert_eq!(seqs, vec![1, 2, 3, 4]);
}

/// A write refused because its log entry could not be written was not taken (no group, no
/// id, nothing sent): the device's counters do not count it. (`requests` counted it, so it
/// said five writes were taken where four were, and their `Done`s were four.)
#[test]
fn a_write_whose_log_entry_fails_is_not_counted_as_a_request() {
    let engine = engine();
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    let disk = SimDisk::new(SimConfig::new(DISK, 7)).unwrap();
    let fail = Rc::new(std::cell::Cell::new(false));
    let region = Flaky {
        mem: MemPmr::new(64 << 10),
        fail: Rc::clone(&fail),
    };
    let log = AttrLog::format(region, 1).unwrap();
    let devs = vec![disk.open(&lbio).unwrap()];
    let mut dev = OrderedDevice::new(lbio, devs, log, &[1], OrderedConfig::default()).unwrap();
    dev.submit(0, write(&engine, 0, 0, 1, 4096), true).unwrap();
    fail.set(true);
    dev.submit(0, write(&engine, 0, 4096, 2, 4096), true)
        .expect_err("the log refuses the entry");
    assert_eq!(
        dev.stats().requests,
        1,
        "the refused write is not counted: {:?}",
        dev.stats()
    );
    fail.set(false);
    for k in 2..5 {
        dev.submit(0, write(&engine, 0, k * 4096, k, 4096), true)
            .unwrap();
    }
    dev.wait(0).unwrap();
    let done = dev.poll().unwrap();
    let st = dev.stats();
    assert_eq!(done.len(), 4);
    assert_eq!(
        (st.requests, st.device_cmds, st.send_errors),
        (4, 4, 0),
        "{st:?}"
    );
}

/// EIO (the crate does not depend on libc).
const EIO: i32 = 5;

/// RAM without power-loss protection whose next `fail_flushes` FLUSHes fail with EIO.
struct FlakyFlush {
    mem: lbio::MemBackend,
    fail_flushes: Rc<std::cell::Cell<u32>>,
}

impl lbio::Backend for FlakyFlush {
    fn caps(&self) -> lbio::Caps {
        lbio::Caps {
            power_loss_protected: false,
            ..self.mem.caps()
        }
    }
    unsafe fn start(
        &self,
        engine: &Engine,
        sink: aios_core::SinkId,
        tag: u64,
        piece: &lbio::Piece,
    ) -> Result<lbio::Started, aios_core::CoreError> {
        if piece.op == lbio::Op::Flush && self.fail_flushes.get() > 0 {
            self.fail_flushes.set(self.fail_flushes.get() - 1);
            return Ok(lbio::Started::Done(-EIO));
        }
        // SAFETY: the caller's contract on `piece` is passed on unchanged.
        unsafe { self.mem.start(engine, sink, tag, piece) }
    }
}

/// The geometry of the RAM targets below: `DISK` bytes, 512-byte blocks.
fn ram_geometry(max_transfer: u32) -> lbio::Geometry {
    lbio::Geometry {
        capacity_bytes: DISK,
        logical_block: 512,
        mem_align: 512,
        offset_align: 512,
        max_transfer_bytes: max_transfer,
    }
}

/// A RAM target on `lbio` (`lbio::MemBackend`, `DISK` bytes).
fn ram_target(lbio: &Rc<LbioArray>, max_transfer: u32, writable: bool) -> lbio::Device {
    let backend = || Box::new(lbio::MemBackend::new(DISK as usize));
    let geometry = ram_geometry(max_transfer);
    lbio::Device::from_backends(lbio, backend(), backend(), geometry, writable).unwrap()
}

/// A [`FlakyFlush`] target on `lbio` (writable), and the counter that makes its next FLUSHes
/// fail.
fn flaky_flush_target(
    lbio: &Rc<LbioArray>,
    max_transfer: u32,
) -> (lbio::Device, Rc<std::cell::Cell<u32>>) {
    let fail_flushes = Rc::new(std::cell::Cell::new(0));
    let backend = || {
        Box::new(FlakyFlush {
            mem: lbio::MemBackend::new(DISK as usize),
            fail_flushes: Rc::clone(&fail_flushes),
        })
    };
    let geometry = ram_geometry(max_transfer);
    let dev = lbio::Device::from_backends(lbio, backend(), backend(), geometry, true).unwrap();
    (dev, fail_flushes)
}

/// An ordered device over one [`FlakyFlush`] target, with a 16 KiB log for `streams` streams
/// and no background FLUSH; the counter makes the next FLUSHes fail.
fn flaky_flush_rig(streams: u16) -> (Rc<Engine>, OrderedDevice<MemPmr>, Rc<std::cell::Cell<u32>>) {
    let engine = engine();
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    let (dev, fail_flushes) = flaky_flush_target(&lbio, 128 << 10);
    let log = AttrLog::format(MemPmr::new(16 << 10), streams).unwrap();
    let cfg = OrderedConfig {
        flush_ahead: 0,
        ..OrderedConfig::default()
    };
    let start = vec![1; streams as usize];
    let od = OrderedDevice::new(lbio, vec![dev], log, &start, cfg).unwrap();
    (engine, od, fail_flushes)
}

#[test]
fn a_failed_flush_fails_its_groups_for_good_and_a_full_log_says_why() {
    let (engine, mut od, fail_flushes) = flaky_flush_rig(1);
    let slots = od.log().slots() as u64;
    let mut got = Vec::new();
    for i in 0..4u64 {
        od.submit(0, write(&engine, 0, i * 4096, i, 4096), true)
            .unwrap();
    }
    od.wait(0).unwrap();

    // `wait`'s FLUSH fails: this wait and every later one report it (a later FLUSH that
    // succeeds does not vouch for the writes the failed one covered).
    for i in 4..8u64 {
        od.submit(0, write(&engine, 0, i * 4096, i, 4096), true)
            .unwrap();
    }
    fail_flushes.set(1);
    let e = od.wait(0).unwrap_err().to_string();
    assert!(e.contains("Input/output error") || e.contains("EIO"), "{e}");
    for _ in 0..2 {
        let e = od.wait(0).unwrap_err().to_string();
        assert!(e.contains("FLUSH on target 0"), "{e}");
    }
    got.extend(od.poll().unwrap());
    assert_eq!(got.len(), 8, "completed writes are still handed back");

    // The failed groups stay live in the log: writing on fills it, and the error says why
    // instead of asking for a bigger log.
    let mut refused = None;
    for i in 8..8 + 2 * slots {
        match od.submit(0, write(&engine, 0, (i % 200) * 4096, i, 4096), true) {
            Ok(_) => got.extend(od.poll().unwrap()),
            Err(e) => {
                refused = Some((i, e.to_string()));
                break;
            }
        }
    }
    let (i, e) = refused.expect("the log fills");
    assert!(i <= 8 + slots, "refused at write {i} of a {slots}-slot log");
    assert!(
        e.contains("can never become durable") && e.contains("group 5 of stream 0"),
        "{e}"
    );
}

#[test]
fn wait_on_a_log_full_of_its_own_volatile_entries_flushes_its_target_for_room() {
    // No background FLUSH, and exactly a log's worth of writes on one target without power-loss
    // protection: `wait`'s FLUSH entry finds the log full of that target's own entries, which
    // only a FLUSH of that very target frees.
    let (engine, mut od, _) = flaky_flush_rig(1);
    let slots = od.log().slots() as u64;
    let mut got = Vec::new();
    for i in 0..slots {
        od.submit(0, write(&engine, 0, (i % 200) * 4096, i, 4096), true)
            .unwrap();
        got.extend(od.poll().unwrap());
    }
    od.wait(0)
        .unwrap_or_else(|e| panic!("wait on a full log ({slots} slots): {e}"));
    got.extend(od.poll().unwrap());
    assert_eq!(got.len() as u64, slots);
    assert!(od.stats().flushes >= 2, "{:?}", od.stats());
    // And the log turns over: as many writes again, then a wait.
    for i in slots..2 * slots {
        od.submit(0, write(&engine, 0, (i % 200) * 4096, i, 4096), true)
            .unwrap();
        got.extend(od.poll().unwrap());
    }
    od.wait(0).unwrap();
}

#[test]
fn a_group_that_cannot_be_sent_fails_and_wait_says_so() {
    // Stream 1 fills the log; stream 0's two-request group then needs room, and the FLUSH that
    // would make it fails: the group fails with it instead of vanishing from the queue.
    let (engine, mut od, fail_flushes) = flaky_flush_rig(2);
    let slots = od.log().slots() as u64;
    let mut got = Vec::new();
    let mut i = 0u64;
    while od.log().has_room() {
        od.submit(
            1,
            write(&engine, 0, 128 * 4096 + (i % 64) * 4096, i, 4096),
            true,
        )
        .unwrap();
        got.extend(od.poll().unwrap());
        i += 1;
    }
    assert!(i <= slots);
    fail_flushes.set(1);
    let a = od
        .submit(0, write(&engine, 0, 0, 1000, 4096), false)
        .unwrap();
    // Taken (it has an id); its failure comes back with its buffer and from `wait`.
    let b = od
        .submit(0, write(&engine, 0, 4096, 1001, 4096), true)
        .unwrap();
    assert_eq!(od.stats().send_errors, 1);
    for _ in 0..2 {
        let e = od.wait(0).unwrap_err().to_string();
        assert!(e.contains("sending it: flush"), "{e}");
    }
    let failed: Vec<(u64, bool)> = od
        .poll()
        .unwrap()
        .into_iter()
        .filter(|d| d.stream == 0)
        .map(|d| (d.id, d.result.is_ok()))
        .collect();
    assert_eq!(failed, vec![(a, false), (b, false)]);
}

#[test]
fn a_write_taken_while_a_flush_fails_is_not_vouched_for_by_a_later_one() {
    // Stream 1's write completes on the device before stream 0's `wait` sends its FLUSH, but
    // is taken only while that FLUSH is out; the FLUSH fails. A later FLUSH cannot vouch for
    // a write the failed one may have dropped: stream 1's `wait` reports the failure too.
    let (engine, mut od, fail_flushes) = flaky_flush_rig(2);
    od.submit(0, write(&engine, 0, 0, 1, 4096), true).unwrap();
    let got = od.poll().unwrap();
    assert_eq!(got.len(), 1);
    od.submit(1, write(&engine, 0, 8192, 2, 4096), true)
        .unwrap();
    fail_flushes.set(1);
    assert!(od.wait(0).is_err());
    let e = od.wait(1).unwrap_err().to_string();
    assert!(e.contains("FLUSH on target 0"), "{e}");
    // Nor does the log: a later write and `wait`, whose FLUSH succeeds, leave recovery
    // stopping at the groups the failed FLUSH covered.
    for s in 0..2u16 {
        od.submit(s, write(&engine, 0, 16384 + s as u64 * 4096, 3, 4096), true)
            .unwrap();
        assert!(od.wait(s).is_err());
    }
    let rec = recover(&scan(od.log().pmr()).unwrap(), &|_| false);
    assert_eq!(
        (rec.streams[0].prefix_end, rec.streams[1].prefix_end),
        (1, 1),
        "{:?}",
        rec.streams
    );
}

/// Persistent memory that takes `left` more writes and then refuses them (`None`: takes all).
struct Countdown {
    mem: MemPmr,
    left: Rc<std::cell::Cell<Option<u32>>>,
}

impl Pmr for Countdown {
    fn len(&self) -> usize {
        self.mem.len()
    }
    fn persist(&mut self, offset: usize, bytes: &[u8]) -> Result<(), RioError> {
        match self.left.get() {
            Some(0) => {
                return Err(RioError::Corrupt(
                    "injected: the region refused a write".into(),
                ))
            }
            Some(n) => self.left.set(Some(n - 1)),
            None => {}
        }
        self.mem.persist(offset, bytes)
    }
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), RioError> {
        self.mem.read(offset, out)
    }
}

/// An ordered device over one RAM target (`max_transfer` bytes per command) on an array of
/// `slots` request slots, with a [`Countdown`] log; also the target's lbio array (to open a
/// second device on).
#[allow(clippy::type_complexity)]
fn countdown_rig(
    slots: u32,
    max_transfer: u32,
    writable: bool,
) -> Result<
    (
        Rc<Engine>,
        Rc<LbioArray>,
        OrderedDevice<Countdown>,
        Rc<std::cell::Cell<Option<u32>>>,
    ),
    RioError,
> {
    let engine = engine();
    let lbio = LbioArray::new(
        Rc::clone(&engine),
        LbioConfig {
            slots,
            ..LbioConfig::default()
        },
    )
    .unwrap();
    let dev = ram_target(&lbio, max_transfer, writable);
    let left = Rc::new(std::cell::Cell::new(None));
    let region = Countdown {
        mem: MemPmr::new(64 << 10),
        left: Rc::clone(&left),
    };
    let log = AttrLog::format(region, 1).unwrap();
    let od = OrderedDevice::new(
        Rc::clone(&lbio),
        vec![dev],
        log,
        &[1],
        OrderedConfig::default(),
    )?;
    Ok((engine, lbio, od, left))
}

/// Every completion of stream 0 so far, as (group, id, ok), each checked to carry the buffer
/// of its own write (`ids` maps a write's id to the pattern it was filled with).
fn handed_back(
    od: &mut OrderedDevice<Countdown>,
    ids: &HashMap<u64, (u64, usize)>,
) -> Vec<(u64, u64, bool)> {
    od.poll()
        .unwrap()
        .into_iter()
        .map(|d| {
            let (pat, len) = ids[&d.id];
            assert!(
                d.buf[..] == pattern(pat, len)[..],
                "write {} came back with another buffer",
                d.id
            );
            if let Err(e) = &d.result {
                assert!(e.contains("sending it"), "{e}");
            }
            (d.seq, d.id, d.result.is_ok())
        })
        .collect()
}

#[test]
fn a_group_cut_short_while_being_sent_still_hands_back_every_buffer_in_order() {
    let (engine, _lbio, mut od, left) = countdown_rig(64, 64 << 10, true).unwrap();
    let mut ids = HashMap::new();
    let a = od.submit(0, write(&engine, 0, 0, 1, 4096), true).unwrap();
    ids.insert(a, (1, 4096));
    // Group 2 of two requests: the first one's entry is logged and it goes to the device, the
    // second one's entry fails.
    let b = od
        .submit(0, write(&engine, 0, 8192, 2, 4096), false)
        .unwrap();
    ids.insert(b, (2, 4096));
    left.set(Some(1));
    // Taken: the failure comes back with the group's buffers.
    let b2 = od
        .submit(0, write(&engine, 0, 16384, 3, 4096), true)
        .unwrap();
    assert_eq!((b2, od.stats().send_errors), (b + 1, 1));
    ids.insert(b2, (3, 4096));
    left.set(None);
    let c = od
        .submit(0, write(&engine, 0, 32768, 4, 4096), true)
        .unwrap();
    ids.insert(c, (4, 4096));
    for _ in 0..2 {
        let e = od.wait(0).unwrap_err().to_string();
        assert!(e.contains("sending it"), "{e}");
    }
    // The failed group comes back whole, with the failure, in its turn; the group after it
    // comes back too (it reached the device; the durability mark stays before the failed one).
    assert_eq!(
        handed_back(&mut od, &ids),
        vec![(1, a, true), (2, b, false), (2, b2, false), (3, c, true)]
    );
    assert_eq!(od.in_flight(), 0);
    // In the log, `wait`'s FLUSH entries vouch for nothing from the failed group on: recovery
    // keeps group 1 only.
    let rec = recover(&scan(od.log().pmr()).unwrap(), &|_| false);
    assert_eq!(rec.streams[0].prefix_end, 2, "{:?}", rec.streams[0]);
}

#[test]
fn a_split_write_cut_short_while_being_sent_hands_its_buffer_back() {
    let (engine, _lbio, mut od, left) = countdown_rig(64, 64 << 10, true).unwrap();
    let mut ids = HashMap::new();
    // 256 KiB in 64 KiB pieces: two are logged and sent, the third one's entry fails.
    left.set(Some(2));
    let a = od
        .submit(0, write(&engine, 0, 0, 1, 256 << 10), true)
        .unwrap();
    ids.insert(a, (1, 256 << 10));
    left.set(None);
    let c = od
        .submit(0, write(&engine, 0, 512 << 10, 2, 4096), true)
        .unwrap();
    ids.insert(c, (2, 4096));
    assert!(od.wait(0).is_err());
    assert_eq!(
        handed_back(&mut od, &ids),
        vec![(1, a, false), (2, c, true)]
    );
    let rec = recover(&scan(od.log().pmr()).unwrap(), &|_| false);
    assert_eq!(rec.streams[0].prefix_end, 1, "{:?}", rec.streams[0]);
}

#[test]
fn a_write_of_more_than_255_pieces_is_refused_before_it_takes_a_group() {
    let (engine, _lbio, mut od, _) = countdown_rig(64, 4096, true).unwrap();
    let e = od
        .submit(0, write(&engine, 0, 0, 1, 256 * 4096), true)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("splits into 256 pieces") && e.contains("at most 255"),
        "{e}"
    );
    assert_eq!(od.next_seq(0), 1);
    let id = od
        .submit(0, write(&engine, 0, 0, 2, 255 * 4096), true)
        .unwrap();
    od.wait(0).unwrap();
    let done = od.poll().unwrap();
    assert_eq!((done.len(), done[0].id, done[0].seq), (1, id, 1));
    assert!(done[0].result.is_ok() && done[0].buf[..] == pattern(2, 255 * 4096)[..]);
}

#[test]
fn a_write_with_no_request_slot_to_be_had_comes_back_failed_and_the_stream_goes_on() {
    use std::future::Future;
    // Another user of the array holds both of its slots (reads out on a SimDisk, owned by
    // their futures): nothing of the ordered device's is out to free one.
    let (engine, lbio, mut od, _) = countdown_rig(2, 64 << 10, true).unwrap();
    let disk = SimDisk::new(SimConfig::new(DISK, 11)).unwrap();
    let other = disk.open(&lbio).unwrap();
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let mut held: Vec<_> = (0..2)
        .map(|_| Box::pin(other.read_at(0, engine.alloc_blocking(4096).unwrap())))
        .collect();
    for f in &mut held {
        assert!(f.as_mut().poll(&mut cx).is_pending());
    }
    assert_eq!(lbio.free_slots(), 0);
    let mut ids = HashMap::new();
    let a = od.submit(0, write(&engine, 0, 0, 1, 4096), true).unwrap();
    assert_eq!(od.stats().send_errors, 1);
    ids.insert(a, (1, 4096));
    // The reads finish; their slots come back.
    let mut finished = [false; 2];
    while finished.contains(&false) {
        engine.poll_completions().unwrap();
        for (f, done) in held.iter_mut().zip(&mut finished) {
            *done = *done || f.as_mut().poll(&mut cx).is_ready();
        }
    }
    held.clear();
    let c = od
        .submit(0, write(&engine, 0, 8192, 2, 4096), true)
        .unwrap();
    ids.insert(c, (2, 4096));
    let e = od.wait(0).unwrap_err().to_string();
    assert!(
        e.contains("sending it") && e.contains("submitting to target 0"),
        "{e}"
    );
    assert_eq!(
        handed_back(&mut od, &ids),
        vec![(1, a, false), (2, c, true)]
    );
    // Group 1's entry is in the log, its data never reached the device: nothing vouches for it.
    let rec = recover(&scan(od.log().pmr()).unwrap(), &|_| false);
    assert_eq!(rec.streams[0].prefix_end, 1, "{:?}", rec.streams[0]);
}

#[test]
fn detached_completions_of_another_device_on_the_array_free_their_slots_for_writes() {
    // Another device's detached writes finished and hold both slots until taken: they are the
    // ordered device's to take (it owns the array's detached completions), so writes go on.
    let (engine, lbio, mut od, _) = countdown_rig(2, 64 << 10, true).unwrap();
    let other = lbio::Device::memory(&lbio, 1 << 20).unwrap();
    for k in 0..2u64 {
        other
            .submit(lbio::Io::write(
                k * 4096,
                engine.alloc_blocking(4096).unwrap(),
            ))
            .map_err(|(e, _)| e)
            .unwrap();
    }
    assert_eq!(lbio.free_slots(), 0);
    let mut ids = HashMap::new();
    for k in 1..=4u64 {
        let id = od
            .submit(0, write(&engine, 0, k * 8192, k, 4096), true)
            .unwrap();
        ids.insert(id, (k, 4096));
    }
    od.wait(0).unwrap();
    assert_eq!(
        handed_back(&mut od, &ids),
        vec![(1, 1, true), (2, 2, true), (3, 3, true), (4, 4, true)]
    );
}

#[test]
fn a_read_only_target_is_refused_up_front() {
    let e = countdown_rig(64, 64 << 10, false)
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("target 0 is open read-only"), "{e}");
}

#[test]
fn a_split_write_in_a_full_arena_takes_finished_pieces_for_room() {
    // A 1 MiB arena: a 384 KiB write and its six 64 KiB copies, then a 256 KiB write, fill it.
    // The first write's pieces are finished but not yet taken: taking them frees the room the
    // second write's copies need.
    let engine = engine_with_arena(1 << 20);
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    let dev = ram_target(&lbio, 64 << 10, true);
    let log = AttrLog::format(MemPmr::new(64 << 10), 1).unwrap();
    let mut od = OrderedDevice::new(lbio, vec![dev], log, &[1], OrderedConfig::default()).unwrap();
    let a = od
        .submit(0, write(&engine, 0, 0, 1, 384 << 10), true)
        .unwrap();
    let b = od
        .submit(0, write(&engine, 0, 512 << 10, 2, 256 << 10), true)
        .unwrap();
    od.wait(0).unwrap();
    let done: Vec<(u64, bool)> = od
        .poll()
        .unwrap()
        .into_iter()
        .map(|d| (d.id, d.result.is_ok()))
        .collect();
    assert_eq!(done, vec![(a, true), (b, true)]);
    assert_eq!(od.stats().send_errors, 0);
}

/// A log region whose writes fail at random (`per_mille` of them), immediate (persistent
/// memory) or `deferred` (staged until `sync`, like a block log).
struct Unreliable {
    mem: MemPmr,
    deferred: bool,
    staged: Vec<(usize, Vec<u8>)>,
    rng: SimRng,
    per_mille: Rc<std::cell::Cell<u64>>,
    /// While set, `sync` fails (what is staged stays staged).
    fail_sync: Rc<std::cell::Cell<bool>>,
}

impl Pmr for Unreliable {
    fn len(&self) -> usize {
        self.mem.len()
    }
    fn persist(&mut self, offset: usize, bytes: &[u8]) -> Result<(), RioError> {
        if self.rng.below(1000) < self.per_mille.get() {
            return Err(RioError::Corrupt(
                "injected: the region refused a write".into(),
            ));
        }
        if self.deferred {
            self.staged.push((offset, bytes.to_vec()));
            Ok(())
        } else {
            self.mem.persist(offset, bytes)
        }
    }
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), RioError> {
        self.mem.read(offset, out)?;
        // What is staged reads back too (it is the region's current content).
        for (at, b) in &self.staged {
            for (i, o) in out.iter_mut().enumerate() {
                let x = offset + i;
                if x >= *at && x < at + b.len() {
                    *o = b[x - at];
                }
            }
        }
        Ok(())
    }
    fn deferred(&self) -> bool {
        self.deferred
    }
    fn block_bytes(&self) -> usize {
        if self.deferred {
            512
        } else {
            1
        }
    }
    fn sync(&mut self) -> Result<(), RioError> {
        if self.fail_sync.get() {
            return Err(RioError::Corrupt("injected: the log sync failed".into()));
        }
        for (at, b) in std::mem::take(&mut self.staged) {
            self.mem.persist(at, &b)?;
        }
        Ok(())
    }
    fn persist_ordered(&mut self, offset: usize, bytes: &[u8]) -> Result<(), RioError> {
        self.sync()?;
        self.mem.persist(offset, bytes)
    }
}

/// What one faulty run saw.
#[derive(Default)]
struct FaultTally {
    taken: u64,
    refused: u64,
    failed_dones: u64,
}

/// One workload under injected faults: log writes that fail, FLUSHes that fail, another user
/// of the array holding every request slot for a while, an arena of `arena` bytes. Every write
/// `submit` took must come back exactly once, with its own buffer, ids in order; nothing stays
/// in flight; and recovery never keeps a group whose write came back failed, nor one after it.
fn faulty_run(
    seed: u64,
    deferred: bool,
    batch: usize,
    merge: bool,
    arena: usize,
) -> Result<FaultTally, String> {
    use std::future::Future;
    let engine = engine_with_arena(arena);
    let lbio = LbioArray::new(
        Rc::clone(&engine),
        LbioConfig {
            slots: 8,
            ..LbioConfig::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let (dev, fail_flushes) = flaky_flush_target(&lbio, 16 << 10);
    let holder_disk =
        SimDisk::new(SimConfig::new(DISK, seed ^ 0x401d)).map_err(|e| e.to_string())?;
    let holder = holder_disk.open(&lbio).map_err(|e| e.to_string())?;
    let per_mille = Rc::new(std::cell::Cell::new(0));
    let region = Unreliable {
        mem: MemPmr::new(32 << 10),
        deferred,
        staged: Vec::new(),
        rng: SimRng::new(seed ^ 0xbad),
        per_mille: Rc::clone(&per_mille),
        fail_sync: Rc::new(std::cell::Cell::new(false)),
    };
    let log = AttrLog::format(region, 1).map_err(|e| e.to_string())?;
    per_mille.set([5, 30, 150][(seed % 3) as usize]);
    let cfg = OrderedConfig {
        batch,
        merge,
        flush_ahead: if seed % 2 == 0 { 0 } else { 4 },
        max_merge_bytes: 64 << 10,
    };
    let mut od = OrderedDevice::new(Rc::clone(&lbio), vec![dev], log, &[1], cfg)
        .map_err(|e| e.to_string())?;

    let mut rng = SimRng::new(seed);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let mut held: Vec<std::pin::Pin<Box<lbio::IoFuture<'_>>>> = Vec::new();
    let mut hold_for = 0;
    let mut tally = FaultTally::default();
    // Pattern key of each write taken -> its id; ids handed back; lowest failed group.
    let mut taken: HashMap<u64, u64> = HashMap::new();
    let mut back: HashMap<u64, u64> = HashMap::new();
    let mut last_id = 0u64;
    let mut lowest_failed = u64::MAX;
    let mut take = |got: Vec<rio_ordering::Done>,
                    back: &mut HashMap<u64, u64>,
                    tally: &mut FaultTally|
     -> Result<(), String> {
        for d in got {
            if d.id <= last_id {
                return Err(format!("id {} handed back after id {last_id}", d.id));
            }
            last_id = d.id;
            let key = u64::from_le_bytes(d.buf[..8].try_into().unwrap()) / 0x9e37_79b9;
            if d.buf[..] != pattern(key, d.buf.len())[..] {
                return Err(format!("id {} came back with a buffer of no write", d.id));
            }
            if back.insert(key, d.id).is_some() {
                return Err(format!("write {key} came back twice"));
            }
            if d.result.is_err() {
                tally.failed_dones += 1;
                lowest_failed = lowest_failed.min(d.seq);
            }
        }
        Ok(())
    };
    let release = |held: &mut Vec<std::pin::Pin<Box<lbio::IoFuture<'_>>>>,
                   cx: &mut std::task::Context<'_>| {
        while !held.is_empty() {
            engine.poll_completions().unwrap();
            held.retain_mut(|f| f.as_mut().poll(cx).is_pending());
        }
    };
    let mut key = 1u64;
    let mut at = 0u64;
    for _ in 0..300 {
        if held.is_empty() && rng.below(12) == 0 {
            while lbio.free_slots() > 0 {
                let Some(b) = engine.try_alloc(4096) else {
                    break;
                };
                let mut f = Box::pin(holder.read_at(0, b));
                if f.as_mut().poll(&mut cx).is_ready() {
                    break;
                }
                held.push(f);
            }
            hold_for = 1 + rng.below(4);
        } else if !held.is_empty() {
            hold_for -= 1;
            if hold_for == 0 {
                release(&mut held, &mut cx);
            }
        }
        if rng.below(40) == 0 {
            fail_flushes.set(1);
        }
        let n = 1 + rng.below(3) as usize;
        for j in 0..n {
            let len = [4096usize, 8192, 16384, 20480, 49152][rng.below(5) as usize];
            if at + len as u64 > DISK {
                at = 0;
            }
            let Some(mut buf) = engine.try_alloc(len) else {
                if let Ok(got) = od.poll() {
                    take(got, &mut back, &mut tally)?;
                }
                continue;
            };
            buf.copy_from_slice(&pattern(key, len));
            let w = Write {
                target: 0,
                offset: at,
                buf,
                ipu: false,
            };
            at += len as u64 + if rng.below(2) == 0 { 0 } else { 4096 };
            match od.submit(0, w, j + 1 == n) {
                Ok(id) => {
                    taken.insert(key, id);
                    tally.taken += 1;
                }
                Err(_) => tally.refused += 1,
            }
            key += 1;
        }
        match rng.below(8) {
            0 | 1 => {
                if let Ok(got) = od.poll() {
                    take(got, &mut back, &mut tally)?;
                }
            }
            2 => {
                let _ = od.wait(0);
            }
            3 => {
                if let Ok(got) = od.wait_progress() {
                    take(got, &mut back, &mut tally)?;
                }
            }
            _ => {}
        }
    }
    // Faults off: everything comes back.
    release(&mut held, &mut cx);
    per_mille.set(0);
    fail_flushes.set(0);
    for _ in 0..3 {
        let _ = od.wait(0);
    }
    for _ in 0..50 {
        take(
            od.poll().map_err(|e| format!("poll: {e}"))?,
            &mut back,
            &mut tally,
        )?;
        if od.in_flight() == 0 {
            break;
        }
        let _ = od.wait_any();
    }
    take(
        od.poll().map_err(|e| format!("poll: {e}"))?,
        &mut back,
        &mut tally,
    )?;
    if od.in_flight() != 0 {
        return Err(format!("{} commands still in flight", od.in_flight()));
    }
    let lost: Vec<u64> = taken
        .iter()
        .filter(|(k, _)| !back.contains_key(k))
        .map(|(_, id)| *id)
        .collect();
    if !lost.is_empty() {
        return Err(format!(
            "{} taken writes never came back, ids {:?}…",
            lost.len(),
            &lost[..lost.len().min(8)]
        ));
    }
    let rec = recover(&scan(od.log().pmr()).map_err(|e| e.to_string())?, &|_| {
        false
    });
    if rec.streams[0].prefix_end > lowest_failed {
        return Err(format!(
            "recovery keeps groups up to {} though group {lowest_failed} failed",
            rec.streams[0].prefix_end - 1
        ));
    }
    Ok(tally)
}

#[test]
fn under_injected_faults_every_taken_write_comes_back_once_and_recovery_keeps_no_failed_group() {
    let seeds: u64 = std::env::var("AIOS_RIO_FAULT_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    let mut bad = Vec::new();
    let mut total = FaultTally::default();
    for seed in 1..=seeds {
        for deferred in [false, true] {
            for (batch, merge) in [(1, true), (3, true), (3, false)] {
                for arena in [8 << 20, 256 << 10] {
                    let what = format!(
                        "seed {seed}, deferred log {deferred}, batch {batch}, merge {merge}, \
                         arena {arena}"
                    );
                    match std::panic::catch_unwind(|| {
                        faulty_run(seed, deferred, batch, merge, arena)
                    }) {
                        Ok(Ok(t)) => {
                            total.taken += t.taken;
                            total.refused += t.refused;
                            total.failed_dones += t.failed_dones;
                        }
                        Ok(Err(e)) => bad.push(format!("{what}: {e}")),
                        Err(p) => bad.push(format!(
                            "{what}: panicked: {:?}",
                            p.downcast_ref::<String>()
                                .cloned()
                                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        )),
                    }
                }
            }
        }
    }
    eprintln!(
        "faults: {} writes taken ({} came back failed), {} refused",
        total.taken, total.failed_dones, total.refused
    );
    assert!(
        bad.is_empty(),
        "{} runs failed:\n{}",
        bad.len(),
        bad.join("\n")
    );
    assert!(
        total.failed_dones > 0 && total.refused > 0,
        "the faults were met"
    );
}

#[test]
fn a_log_sync_that_keeps_failing_does_not_hold_back_finished_writes() {
    // A deferred (block-like) log: write 1 goes out; write 2's log sync fails and keeps
    // failing. `poll` still hands write 1 back; the failure is the answer once nothing is.
    let (engine, lbio, _, _) = countdown_rig(64, 64 << 10, true).unwrap();
    let dev = lbio::Device::memory(&lbio, DISK as usize).unwrap();
    let fail_sync = Rc::new(std::cell::Cell::new(false));
    let region = Unreliable {
        mem: MemPmr::new(32 << 10),
        deferred: true,
        staged: Vec::new(),
        rng: SimRng::new(1),
        per_mille: Rc::new(std::cell::Cell::new(0)),
        fail_sync: Rc::clone(&fail_sync),
    };
    let log = AttrLog::format(region, 1).unwrap();
    let mut od = OrderedDevice::new(lbio, vec![dev], log, &[1], OrderedConfig::default()).unwrap();
    let a = od.submit(0, write(&engine, 0, 0, 1, 4096), true).unwrap();
    fail_sync.set(true);
    let b = od
        .submit(0, write(&engine, 0, 8192, 2, 4096), true)
        .unwrap();
    assert_eq!(od.stats().send_errors, 1);
    let got: Vec<u64> = od.poll().unwrap().into_iter().map(|d| d.id).collect();
    assert_eq!(got, vec![a]);
    for _ in 0..2 {
        let e = od.poll().unwrap_err().to_string();
        assert!(e.contains("log sync failed"), "{e}");
        assert!(od.wait_any().is_err());
        assert!(od.wait_progress().is_err());
    }
    fail_sync.set(false);
    od.wait(0).unwrap();
    let got: Vec<(u64, bool)> = od
        .poll()
        .unwrap()
        .into_iter()
        .map(|d| (d.id, d.result.is_ok()))
        .collect();
    assert_eq!(got, vec![(b, true)]);
}

/// Persistent memory whose next header write fails while `fail_header` is set (once).
struct HeaderFlaky {
    mem: MemPmr,
    fail_header: Rc<std::cell::Cell<bool>>,
}

impl Pmr for HeaderFlaky {
    fn len(&self) -> usize {
        self.mem.len()
    }
    fn persist(&mut self, offset: usize, bytes: &[u8]) -> Result<(), RioError> {
        self.mem.persist(offset, bytes)
    }
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), RioError> {
        self.mem.read(offset, out)
    }
    fn persist_ordered(&mut self, offset: usize, bytes: &[u8]) -> Result<(), RioError> {
        if self.fail_header.replace(false) {
            return Err(RioError::Corrupt(
                "injected: the header write failed".into(),
            ));
        }
        self.mem.persist(offset, bytes)
    }
}

#[test]
fn a_failed_header_write_leaves_the_slot_alone_and_acknowledged_groups_survive() {
    // An 8-slot log on a target with power-loss protection. The 9th write reuses slot 0, so the
    // header's durability marks must be written first: that write fails. The slot must not be
    // reused under the old header (recovery would then lose every acknowledged group).
    let engine = engine();
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    let mut c = SimConfig::new(DISK, 3);
    c.plp = true;
    let disk = SimDisk::new(c).unwrap();
    let fail_header = Rc::new(std::cell::Cell::new(false));
    let probe = AttrLog::format(MemPmr::new(64 << 10), 1).unwrap();
    let slots_at = scan(probe.pmr()).unwrap().header.slots_at;
    let region = HeaderFlaky {
        mem: MemPmr::new(slots_at + 8 * 64),
        fail_header: Rc::clone(&fail_header),
    };
    let log = AttrLog::format(region, 1).unwrap();
    assert_eq!(log.slots(), 8);
    let devs = vec![disk.open(&lbio).unwrap()];
    let mut od = OrderedDevice::new(lbio, devs, log, &[1], OrderedConfig::default()).unwrap();
    let mut k = 0u64;
    for _ in 0..8 {
        od.submit(0, write(&engine, 0, k * 4096, k, 4096), true)
            .unwrap();
        k += 1;
    }
    od.wait(0).unwrap();
    od.poll().unwrap();
    fail_header.set(true);
    let e = od
        .submit(0, write(&engine, 0, k * 4096, k, 4096), true)
        .unwrap_err()
        .to_string();
    assert!(e.contains("header write failed"), "{e}");
    for _ in 0..8 {
        od.submit(0, write(&engine, 0, k * 4096, k, 4096), true)
            .unwrap();
        k += 1;
        od.wait(0).unwrap();
        od.poll().unwrap();
    }
    let rec = recover(&scan(od.log().pmr()).unwrap(), &|_| true);
    assert_eq!(
        rec.streams[0].prefix_end, 17,
        "every acknowledged group survives: {:?}",
        rec.streams[0].stopped_by
    );
}

#[test]
fn a_background_flush_failing_during_wait_is_not_vouched_for_by_its_entry() {
    // Stream 0 wrote group 1 on target 0 and group 2 on target 1. While `wait(0)` FLUSHes
    // target 0, a completion of stream 1 starts a background FLUSH on target 1 that covers
    // group 2, and fails. `wait` reports it, and nothing in the log vouches for group 2.
    let engine = engine();
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    let (a, _) = flaky_flush_target(&lbio, 128 << 10);
    let (b, fail_b) = flaky_flush_target(&lbio, 128 << 10);
    let log = AttrLog::format(MemPmr::new(16 << 10), 2).unwrap();
    let cfg = OrderedConfig {
        flush_ahead: 2,
        ..OrderedConfig::default()
    };
    let mut od = OrderedDevice::new(lbio, vec![a, b], log, &[1, 1], cfg).unwrap();
    od.submit(0, write(&engine, 0, 0, 1, 4096), true).unwrap();
    od.poll().unwrap();
    od.submit(0, write(&engine, 1, 0, 2, 4096), true).unwrap();
    od.poll().unwrap();
    od.submit(1, write(&engine, 1, 65536, 3, 4096), true)
        .unwrap();
    fail_b.set(1);
    let e = od.wait(0).unwrap_err().to_string();
    assert!(e.contains("FLUSH on target 1"), "{e}");
    let rec = recover(&scan(od.log().pmr()).unwrap(), &|_| false);
    assert!(
        rec.streams[0].prefix_end <= 2,
        "recovery keeps group 2: {:?}",
        rec.streams[0]
    );
}

#[test]
fn an_async_block_log_syncs_with_the_arena_full_of_the_writes_it_holds() {
    // A 128 KiB arena. The block log (on a RAM device of the ordered device's own array, so its
    // syncs are asynchronous) takes its image and its sync buffer when it opens; the caller
    // then takes every frame left for its writes. Each sync needs room for the staged blocks'
    // copy while the arena holds nothing but the data waiting for that sync.
    let engine = engine_with_arena(128 << 10);
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    let target = ram_target(&lbio, 64 << 10, true);
    let log_dev = lbio::Device::memory(&lbio, 64 << 10).unwrap();
    let region = rio_ordering::BlockPmr::on_device(log_dev, 0, 8 << 10).unwrap();
    let log = AttrLog::format(region, 1).unwrap();
    let mut od = OrderedDevice::new(
        Rc::clone(&lbio),
        vec![target],
        log,
        &[1],
        OrderedConfig::default(),
    )
    .unwrap();
    let mut bufs = Vec::new();
    while let Some(b) = engine.try_alloc(4096) {
        bufs.push(b);
    }
    assert!(bufs.len() >= 8, "{} frames left", bufs.len());
    let mut ids = Vec::new();
    for (k, mut buf) in bufs.into_iter().enumerate() {
        buf.copy_from_slice(&pattern(k as u64, 4096));
        let w = Write {
            target: 0,
            offset: k as u64 * 4096,
            buf,
            ipu: false,
        };
        ids.push(od.submit(0, w, true).unwrap());
    }
    od.wait(0).unwrap();
    let done = od.poll().unwrap();
    assert_eq!(done.iter().map(|d| d.id).collect::<Vec<_>>(), ids);
    assert!(done.iter().all(|d| d.result.is_ok()));
    assert_eq!(od.stats().send_errors, 0);
}

/// A later group over bytes an earlier one writes ends up on the disk: two writes on the device
/// at once land in either order (SimDisk completes them in a random order, as an SSD may), so
/// the later command waits for the earlier to complete. Three groups of one stream, sent
/// without waiting between them: 8 KiB at 0, then 4 KiB at 4 KiB, then 4 KiB at 0; in every
/// log kind, with and without power-loss protection, at batch 1 and 4, 20 seeds each. After
/// `wait`, the disk must hold the third group's bytes at 0 and the second's at 4 KiB, and
/// recovery must keep all three groups. Before the fix, 140 of the 240 runs left an earlier
/// group's bytes on the disk.
#[test]
fn a_later_group_over_an_earlier_groups_bytes_lands_last() {
    let mut bad = Vec::new();
    let (mut runs, mut waits) = (0, 0);
    for (block_log, async_log) in [(false, false), (true, false), (true, true)] {
        for plp in [false, true] {
            for batch in [1, 4] {
                for seed in 1..=20u64 {
                    runs += 1;
                    let opts = RigOpts {
                        block_log,
                        async_log,
                        ..RigOpts::default()
                    };
                    let cfg = OrderedConfig {
                        batch,
                        ..OrderedConfig::default()
                    };
                    let mut r = rig_with(seed, 1, &[plp], 1, 64, cfg, opts);
                    for (id, offset, len) in [(1, 0, 8192), (2, 4096, 4096), (3, 0, 4096)] {
                        let w = write(&r.engine, 0, offset, id, len);
                        r.dev.submit(0, w, true).unwrap();
                    }
                    r.dev.wait(0).unwrap();
                    let done = r.dev.poll().unwrap();
                    assert_eq!(done.len(), 3);
                    assert!(done.iter().all(|d| d.result.is_ok()));
                    waits += r.dev.stats().overlap_waits;
                    let rec = recover(&scan(r.dev.log().pmr()).unwrap(), &|_| plp);
                    assert_eq!(rec.streams[0].prefix_end, 4, "seed {seed}");
                    let media = r.disks[0].media();
                    let head = media[..4096] == pattern(3, 4096)[..];
                    let tail = media[4096..8192] == pattern(2, 4096)[..];
                    if !(head && tail) {
                        bad.push(format!(
                            "seed {seed}, plp {plp}, batch {batch}, block log {block_log}, \
                             async {async_log}: third group's bytes at 0: {head}, second's at 4 KiB: {tail}"
                        ));
                    }
                }
            }
        }
    }
    assert!(
        bad.is_empty(),
        "{} of {runs} runs left an earlier group's bytes on the disk:\n{}",
        bad.len(),
        bad.join("\n")
    );
    // The second group waited for the first in every run but those with an asynchronous block
    // log at batch 1 (there the first group's command completes before the others go out).
    assert_eq!(waits, 200, "commands held back for an overlap");
}
