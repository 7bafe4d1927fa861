//! `SimDisk`: an SSD with a volatile write cache, simulated in RAM, for crash testing.
//!
//! Requests are started into a queue and completed later, when the engine needs progress
//! ([`aios_core::SoftDevice`]): each time, a random non-empty set of the queued requests completes,
//! in a random order. A completed write sits in the volatile cache (reads see it) and becomes
//! durable only when a FLUSH submitted after its completion completes, or at once when it was
//! written with FUA, or at once on a device with power-loss protection.
//!
//! [`SimDisk::cut_power`] stops the device where it is; [`SimDisk::crash_image`] then returns an
//! image a power cut could leave: every durable write, plus any subset of the writes that were
//! not durable yet (completed or still queued), each of them possibly torn at sector boundaries;
//! the queued ones land in any order among themselves, and each may land under or over a write
//! that completed after it was sent (the device may have done it first without completing it).
//! Misdirected writes (a write lands at another offset) and bit rot (flipped bits in the image)
//! can be switched on. Everything is drawn from one seeded generator, so a run replays exactly
//! from its seed. A latency model advances a simulated clock ([`SimDisk::sim_time_ns`]).

use std::rc::Rc;
use std::sync::{Arc, Mutex, MutexGuard};

use aios_core::{CoreError, Engine, SinkId, SoftDevice};

use crate::array::LbioArray;
use crate::backend::{Backend, Caps, Op, Outcome, Piece, PieceError, Started};
use crate::device::{Device, Geometry};
use crate::error::LbioError;

/// A small, stable, seeded generator (splitmix64): the same seed gives the same run on every
/// platform and every version of this crate.
#[derive(Clone, Debug)]
pub struct SimRng(u64);

impl SimRng {
    pub fn new(seed: u64) -> SimRng {
        SimRng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        debug_assert!(n > 0);
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
    /// True with probability `num / den`.
    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }
}

/// Simulated device time, in nanoseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimLatency {
    pub read_ns: u64,
    pub write_ns: u64,
    /// Added per 4 KiB transferred.
    pub per_4k_ns: u64,
    /// A FLUSH that writes the volatile cache out.
    pub flush_ns: u64,
    /// A FLUSH on a device with power-loss protection (nothing to write out).
    pub flush_plp_ns: u64,
    /// Requests the device works on at once (its internal parallelism). A FLUSH waits for
    /// everything before it and occupies the whole device.
    pub parallelism: u32,
}

impl Default for SimLatency {
    fn default() -> Self {
        // Roughly an ultra-low-latency NVMe SSD.
        SimLatency {
            read_ns: 8_000,
            write_ns: 10_000,
            per_4k_ns: 1_000,
            flush_ns: 20_000,
            flush_plp_ns: 500,
            parallelism: 8,
        }
    }
}

/// How a [`SimDisk`] behaves.
#[derive(Clone, Copy, Debug)]
pub struct SimConfig {
    pub bytes: u64,
    /// The unit a write is atomic in (a torn write keeps or loses whole sectors).
    pub sector_bytes: u32,
    pub seed: u64,
    /// Power-loss protection: completed writes survive a crash, and FLUSH costs little.
    pub plp: bool,
    /// Start this many requests, then cut the power (a crash at a chosen point; `Some(0)`: the
    /// power is off from the start); `None`: never.
    pub power_cut_after: Option<u64>,
    /// Per million writes, how many land at a wrong offset (never their own).
    pub misdirect_per_million: u32,
    pub latency: SimLatency,
    /// The largest request the device takes (an NVMe controller's MDTS; a larger one is refused
    /// with EINVAL); lbio splits larger ones, and so does an ordered device.
    pub max_transfer_bytes: u32,
}

impl SimConfig {
    /// A device of `bytes` bytes, 512-byte sectors, no power-loss protection, from `seed`.
    pub fn new(bytes: u64, seed: u64) -> SimConfig {
        SimConfig {
            bytes,
            sector_bytes: 512,
            seed,
            plp: false,
            power_cut_after: None,
            misdirect_per_million: 0,
            latency: SimLatency::default(),
            max_transfer_bytes: 1 << 20,
        }
    }
}

/// Counters of a [`SimDisk`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimStats {
    pub reads: u64,
    pub writes: u64,
    pub fua_writes: u64,
    pub flushes: u64,
    /// Requests that completed out of the order they were started in.
    pub reordered: u64,
    pub misdirected: u64,
    /// Requests refused or failed because the power was off.
    pub after_power_cut: u64,
}

/// What a crash image may contain beyond the durable writes.
#[derive(Clone, Copy, Debug)]
pub struct CrashOptions {
    /// Let multi-sector writes that were not durable survive in part.
    pub torn: bool,
    /// Bits to flip at random places in the image (bit rot): distinct ones, at most all.
    pub bit_flips: u32,
}

impl Default for CrashOptions {
    fn default() -> Self {
        CrashOptions {
            torn: true,
            bit_flips: 0,
        }
    }
}

struct Queued {
    sink: SinkId,
    payload: u64,
    op: Op,
    offset: u64,
    len: u32,
    /// The opening that started it (and completes it).
    port: u64,
    /// Where a read's bytes go.
    ptr: ReadPtr,
    /// A write's bytes, copied at start (the caller's buffer is free after completion).
    data: Vec<u8>,
    fua: bool,
    /// Completions counted when it was started: a FLUSH covers those before; a write may land
    /// under any write completed from then on.
    mark: u64,
    started: u64,
    /// The simulated time the host issued it.
    issued_ns: u64,
}

/// A completed write not yet durable.
struct Volatile {
    completed: u64,
    offset: u64,
    data: Vec<u8>,
    /// Per sector: still able to reach the media (a later durable write of the sector kills it).
    live: Vec<bool>,
}

struct Sim {
    cfg: SimConfig,
    rng: SimRng,
    media: Vec<u8>,
    /// What reads see: the media plus completed writes.
    view: Vec<u8>,
    volatile: Vec<Volatile>,
    queue: Vec<Queued>,
    /// (port, payload) of completions that failed (a NOP carries no result of its own).
    failed: Vec<(u64, u64)>,
    /// Writes that were in flight when the power went (mark, offset, bytes): failed to their
    /// caller, but the device may have written any part of them.
    cut_in_flight: Vec<(u64, u64, Vec<u8>)>,
    /// Durable writes an in-flight write may lie under (completion count, offset, length), in
    /// completion order: those completed since the oldest write in flight was sent (their bytes
    /// are in `media`).
    recent_durable: Vec<(u64, u64, u64)>,
    started: u64,
    completed: u64,
    powered: bool,
    /// The host's simulated clock: the latest completion it has seen.
    now_ns: u64,
    /// When each of the device's parallel units is next free.
    units: Vec<u64>,
    stats: SimStats,
}

/// A simulated SSD; clone the handle freely (all clones are the same disk), also across
/// threads: each thread opens it on its own engine ([`SimDisk::open`]), and each opening
/// completes its own requests when its engine waits.
#[derive(Clone)]
pub struct SimDisk(Arc<Shared>);

/// The disk's state, shared by its handles and its ports.
struct Shared {
    sim: Mutex<Sim>,
    next_port: std::sync::atomic::AtomicU64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Sim> {
        self.sim.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One opening of the disk on one engine: the engine holds it weakly as a [`SoftDevice`] and
/// asks it to complete the requests started through it.
struct Port {
    disk: Arc<Shared>,
    id: u64,
    /// Requests the disk completed whose NOPs a failed push left unsent (sink, payload): they
    /// stay pending and go first at the next advance.
    unsent: std::cell::RefCell<Vec<(SinkId, u64)>>,
}

/// A read's destination, used only on the thread whose engine started the read.
struct ReadPtr(*mut u8);
// SAFETY: the pointer is written only in `Port::advance`, on the engine thread that started
// the request (ports complete only their own requests); other threads never touch it.
unsafe impl Send for ReadPtr {}

impl SimDisk {
    /// A zero-filled disk.
    pub fn new(cfg: SimConfig) -> Result<SimDisk, LbioError> {
        Self::from_image(cfg, vec![0; cfg.bytes as usize])
    }

    /// A disk holding `image` (durable), e.g. a crash image to recover from.
    pub fn from_image(cfg: SimConfig, image: Vec<u8>) -> Result<SimDisk, LbioError> {
        if !cfg.sector_bytes.is_power_of_two() || cfg.sector_bytes < 512 {
            return Err(LbioError::Config(format!(
                "SimDisk sector size {} must be a power of two of at least 512",
                cfg.sector_bytes
            )));
        }
        if image.len() as u64 != cfg.bytes || cfg.bytes % cfg.sector_bytes as u64 != 0 {
            return Err(LbioError::Config(format!(
                "SimDisk image of {} bytes: the disk is {} bytes, a multiple of {}-byte sectors",
                image.len(),
                cfg.bytes,
                cfg.sector_bytes
            )));
        }
        Ok(SimDisk(Arc::new(Shared {
            next_port: std::sync::atomic::AtomicU64::new(1),
            sim: Mutex::new(Sim {
                cfg,
                rng: SimRng::new(cfg.seed),
                view: image.clone(),
                media: image,
                volatile: Vec::new(),
                queue: Vec::new(),
                failed: Vec::new(),
                cut_in_flight: Vec::new(),
                recent_durable: Vec::new(),
                started: 0,
                completed: 0,
                powered: cfg.power_cut_after != Some(0),
                now_ns: 0,
                units: vec![0; cfg.latency.parallelism.max(1) as usize],
                stats: SimStats::default(),
            }),
        })))
    }

    /// Open the disk as a device on `lbio` (both request classes), and let `lbio`'s engine drive
    /// its completions.
    pub fn open(&self, lbio: &Rc<LbioArray>) -> Result<Device, LbioError> {
        let cfg = self.0.lock().cfg;
        let port = Rc::new(Port {
            unsent: Default::default(),
            disk: Arc::clone(&self.0),
            id: self
                .0
                .next_port
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        });
        lbio.engine().attach_soft_device(Rc::downgrade(&port) as _);
        let geometry = Geometry {
            capacity_bytes: cfg.bytes,
            logical_block: cfg.sector_bytes,
            mem_align: 512,
            offset_align: cfg.sector_bytes,
            max_transfer_bytes: cfg.max_transfer_bytes,
        };
        Device::from_backends(
            lbio,
            Box::new(SimBackend(Rc::clone(&port))),
            Box::new(SimBackend(port)),
            geometry,
            true,
        )
    }

    /// Stop the device now: queued requests fail, new ones are refused, nothing more changes.
    pub fn cut_power(&self) {
        self.0.lock().powered = false;
    }

    /// Cut the power once `n` more requests have been started (a crash at a chosen point); `0`
    /// cuts it now.
    pub fn cut_power_after(&self, n: u64) {
        let mut s = self.0.lock();
        s.cfg.power_cut_after = Some(s.started + n);
        if n == 0 {
            s.powered = false;
        }
    }

    /// Whether the power is still on.
    pub fn powered(&self) -> bool {
        self.0.lock().powered
    }

    /// An image a power cut now could leave (see the module docs). Each call draws anew.
    pub fn crash_image(&self, opts: CrashOptions) -> Vec<u8> {
        // One lock for the media and the draw: a FLUSH completing on another thread in between
        // would move writes out of the cache after the media was copied, and the image would
        // lose them while keeping later writes that depended on them.
        let mut guard = self.0.lock();
        let mut img = guard.media.clone();
        guard.crash_draw(opts.torn, &mut |at, bytes| {
            img[at as usize..at as usize + bytes.len()].copy_from_slice(bytes)
        });
        // Distinct bits (two flips of one bit would undo each other), at most every bit.
        let bits = img.len() as u64 * 8;
        let mut flipped = std::collections::BTreeSet::new();
        while (flipped.len() as u64) < bits.min(opts.bit_flips as u64) {
            let bit = guard.rng.below(bits);
            if flipped.insert(bit) {
                img[(bit / 8) as usize] ^= 1 << (bit % 8);
            }
        }
        img
    }

    /// A crash draw as the sectors it puts over [`SimDisk::media`], in order (a later one wins
    /// where two overlap): the same draw [`SimDisk::crash_image`] makes, without copying the
    /// whole disk — for checking very many crash states. Bit flips are not drawn here.
    pub fn crash_overlay(&self, opts: CrashOptions) -> Vec<(u64, Vec<u8>)> {
        let mut out = Vec::new();
        self.crash_draw(opts.torn, &mut |at, bytes| out.push((at, bytes.to_vec())));
        out
    }

    /// One crash draw, the cheapest way: `put(offset, bytes)` for every not-yet-durable sector
    /// it keeps, in order (a later one wins where two overlap), over [`SimDisk::media`];
    /// `torn` lets multi-sector writes survive in part.
    pub fn crash_draw(&self, torn: bool, put: &mut dyn FnMut(u64, &[u8])) {
        self.0.lock().crash_draw(torn, put);
    }

    /// The durable bytes only (what survives if no volatile write does).
    pub fn media(&self) -> Vec<u8> {
        self.0.lock().media.clone()
    }

    /// What a read would return now.
    pub fn view(&self) -> Vec<u8> {
        self.0.lock().view.clone()
    }

    /// Requests started so far.
    pub fn started(&self) -> u64 {
        self.0.lock().started
    }

    /// Simulated device time so far.
    pub fn sim_time_ns(&self) -> u64 {
        self.0.lock().now_ns
    }

    pub fn stats(&self) -> SimStats {
        self.0.lock().stats
    }

    pub fn config(&self) -> SimConfig {
        self.0.lock().cfg
    }
}

/// Draw what a crash keeps of a not-yet-durable write: nothing, all of it, or (when `torn`) a
/// random subset of its sectors; `live` marks the sectors that may still reach the media (all
/// if `None`). The kept sectors go to `put`.
fn choose_sectors(
    rng: &mut SimRng,
    put: &mut dyn FnMut(u64, &[u8]),
    offset: u64,
    data: &[u8],
    live: Option<&[bool]>,
    sector: usize,
    torn: bool,
) {
    let choice = rng.below(if torn { 3 } else { 2 });
    for (i, chunk) in data.chunks(sector).enumerate() {
        let keep = match choice {
            0 => false,
            1 => true,
            _ => rng.chance(1, 2),
        };
        if keep && live.is_none_or(|l| l[i]) {
            put(offset + (i * sector) as u64, chunk);
        }
    }
}

/// Draw an in-flight write laid at `slot` (see `Sim::crash_draw`): under the durable writes
/// completed from `slot` on, whose sectors keep their bytes (in the media), and over the rest.
#[allow(clippy::too_many_arguments)]
fn land_in_flight(
    rng: &mut SimRng,
    put: &mut dyn FnMut(u64, &[u8]),
    recent_durable: &[(u64, u64, u64)],
    slot: u64,
    offset: u64,
    data: &[u8],
    sector: usize,
    torn: bool,
) {
    let over = &recent_durable[recent_durable.partition_point(|d| d.0 < slot)..];
    let end = offset + data.len() as u64;
    let hides = |s: u64, len: u64| over.iter().any(|&(_, o, l)| o < s + len && s < o + l);
    let live: Vec<bool>;
    let live = if hides(offset, end - offset) {
        live = (0..data.len() / sector)
            .map(|i| !hides(offset + (i * sector) as u64, 1))
            .collect();
        Some(&live[..])
    } else {
        None
    };
    choose_sectors(rng, put, offset, data, live, sector, torn);
}

impl Sim {
    /// See [`SimDisk::crash_draw`].
    fn crash_draw(&mut self, torn: bool, put: &mut dyn FnMut(u64, &[u8])) {
        let Sim {
            cfg,
            rng,
            volatile,
            queue,
            cut_in_flight,
            recent_durable,
            ..
        } = self;
        let sector = cfg.sector_bytes as usize;
        let volatile: &[Volatile] = if cfg.plp { &[] } else { volatile };
        // Writes the device had not completed (mark, offset, bytes): it may have done them in
        // any order, so they are shuffled (two overlapping untorn writes can show either on
        // top; ties below keep this order).
        let mut in_flight: Vec<(u64, u64, &[u8])> = cut_in_flight
            .iter()
            .map(|(m, o, d)| (*m, *o, &d[..]))
            .chain(
                queue
                    .iter()
                    .filter(|q| q.op == Op::Write)
                    .map(|q| (q.mark, q.offset, &q.data[..])),
            )
            .collect();
        for i in (1..in_flight.len()).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            in_flight.swap(i, j);
        }
        // And each may have been done before any write completed since it was sent (under
        // it), or after: it lands just before one of those writes, drawn at random, or after
        // all of them. Its slot is that write's completion count (`u64::MAX`: after all).
        let mut placed: Vec<(u64, u64, &[u8])> = in_flight
            .into_iter()
            .map(|(mark, offset, data)| {
                let v = volatile.len() - volatile.partition_point(|v| v.completed < mark);
                let d = recent_durable.len() - recent_durable.partition_point(|d| d.0 < mark);
                let slot = if v + d == 0 {
                    u64::MAX
                } else {
                    match rng.below((v + d + 1) as u64) as usize {
                        k if k < v => volatile[volatile.len() - v + k].completed,
                        k if k < v + d => recent_durable[recent_durable.len() - d + k - v].0,
                        _ => u64::MAX,
                    }
                };
                (slot, offset, data)
            })
            .collect();
        placed.sort_by_key(|p| p.0);
        let mut placed = placed.into_iter().peekable();
        // The cached writes in completion order, each in-flight one laid just before its slot.
        for v in volatile {
            while let Some((slot, offset, data)) = placed.next_if(|p| p.0 <= v.completed) {
                land_in_flight(rng, put, recent_durable, slot, offset, data, sector, torn);
            }
            choose_sectors(rng, put, v.offset, &v.data, Some(&v.live), sector, torn);
        }
        for (slot, offset, data) in placed {
            land_in_flight(rng, put, recent_durable, slot, offset, data, sector, torn);
        }
    }

    /// A request of `port`'s that the power cut stopped: it fails, and a write may still have
    /// been done, in any part.
    fn fail_after_cut(&mut self, port: u64, q: Queued) {
        self.stats.after_power_cut += 1;
        self.failed.push((port, q.payload));
        if q.op == Op::Write {
            self.cut_in_flight.push((q.mark, q.offset, q.data));
        }
    }

    /// Forget the durable writes no write in flight can lie under any more (those completed
    /// before the oldest one was sent; a write sent later is after all of them).
    fn forget_old_durable(&mut self) {
        if self.recent_durable.is_empty() {
            return;
        }
        let oldest = self
            .queue
            .iter()
            .filter(|q| q.op == Op::Write)
            .map(|q| q.mark)
            .chain(self.cut_in_flight.iter().map(|c| c.0))
            .min()
            .unwrap_or(u64::MAX);
        let old = self.recent_durable.partition_point(|d| d.0 < oldest);
        self.recent_durable.drain(..old);
    }

    /// Account a request issued at `issued` taking `cost` on the first free unit (a barrier
    /// waits for all units and holds them all); the host sees it done at its end.
    fn run_for(&mut self, issued: u64, cost: u64, barrier: bool) {
        let done = if barrier {
            let start = self.units.iter().copied().max().unwrap_or(0).max(issued);
            let done = start + cost;
            self.units.iter_mut().for_each(|u| *u = done);
            done
        } else {
            let (i, free) = self
                .units
                .iter()
                .copied()
                .enumerate()
                .min_by_key(|&(_, t)| t)
                .expect("at least one unit");
            let done = free.max(issued) + cost;
            self.units[i] = done;
            done
        };
        self.now_ns = self.now_ns.max(done);
    }

    /// Complete one queued request: its effect on the disk, and its result.
    fn complete(&mut self, q: Queued) {
        let lat = self.cfg.latency;
        let sector = self.cfg.sector_bytes as usize;
        let kib4 = (q.len as u64).div_ceil(4096);
        match q.op {
            Op::Read => {
                self.stats.reads += 1;
                self.run_for(q.issued_ns, lat.read_ns + kib4 * lat.per_4k_ns, false);
                let at = q.offset as usize;
                // SAFETY: the backend contract keeps `ptr..ptr+len` ours until this completion is
                // dispatched; `view` is a separate allocation.
                unsafe {
                    std::ptr::copy_nonoverlapping(self.view[at..].as_ptr(), q.ptr.0, q.len as usize)
                };
            }
            Op::Write => {
                self.stats.writes += 1;
                self.run_for(q.issued_ns, lat.write_ns + kib4 * lat.per_4k_ns, false);
                let mut offset = q.offset;
                // Where a write of this length can start; a misdirected one lands at any of
                // them but its own (none where there is no other).
                let places = (self.cfg.bytes - q.len as u64) / sector as u64 + 1;
                if self.cfg.misdirect_per_million > 0
                    && self
                        .rng
                        .chance(self.cfg.misdirect_per_million as u64, 1_000_000)
                    && places > 1
                {
                    let own = q.offset / sector as u64;
                    let other = self.rng.below(places - 1);
                    offset = (other + u64::from(other >= own)) * sector as u64;
                    self.stats.misdirected += 1;
                }
                let at = offset as usize;
                self.view[at..at + q.data.len()].copy_from_slice(&q.data);
                if q.fua || self.cfg.plp {
                    if q.fua {
                        self.stats.fua_writes += 1;
                    }
                    self.media[at..at + q.data.len()].copy_from_slice(&q.data);
                    self.recent_durable
                        .push((self.completed, offset, q.data.len() as u64));
                    // Older cached copies of these sectors can no longer reach the media.
                    let (lo, hi) = (offset, offset + q.data.len() as u64);
                    for v in &mut self.volatile {
                        for (i, live) in v.live.iter_mut().enumerate() {
                            let s = v.offset + (i * sector) as u64;
                            if s >= lo && s < hi {
                                *live = false;
                            }
                        }
                    }
                } else {
                    let n = q.data.len() / sector;
                    self.volatile.push(Volatile {
                        completed: self.completed,
                        offset,
                        data: q.data,
                        live: vec![true; n],
                    });
                }
            }
            Op::Flush => {
                self.stats.flushes += 1;
                let cost = if self.cfg.plp {
                    lat.flush_plp_ns
                } else {
                    lat.flush_ns
                };
                self.run_for(q.issued_ns, cost, true);
                let mark = q.mark;
                let sector = self.cfg.sector_bytes as usize;
                let media = &mut self.media;
                let durable = &mut self.recent_durable;
                let before = durable.len();
                self.volatile.retain(|v| {
                    if v.completed >= mark {
                        return true;
                    }
                    durable.push((v.completed, v.offset, v.data.len() as u64));
                    for (i, chunk) in v.data.chunks(sector).enumerate() {
                        if v.live[i] {
                            let at = v.offset as usize + i * sector;
                            media[at..at + chunk.len()].copy_from_slice(chunk);
                        }
                    }
                    false
                });
                if durable.len() > before {
                    durable.sort_by_key(|d| d.0);
                }
            }
        }
        if q.started != self.completed {
            self.stats.reordered += 1;
        }
        self.completed += 1;
    }
}

impl SoftDevice for Port {
    fn pending(&self) -> u32 {
        let id = self.id;
        let queued = self
            .disk
            .lock()
            .queue
            .iter()
            .filter(|q| q.port == id)
            .count();
        (queued + self.unsent.borrow().len()) as u32
    }

    fn advance(&self, engine: &Engine) -> Result<(), CoreError> {
        // Completions a failed push left unsent go first (they are progress enough).
        let unsent = std::mem::take(&mut *self.unsent.borrow_mut());
        if !unsent.is_empty() {
            return self.send(engine, unsent);
        }
        // Pick and apply under the lock; push completions after it (a push may dispatch
        // completions, whose handlers may start new requests here).
        let done: Vec<(SinkId, u64)> = {
            let mut guard = self.disk.lock();
            let s = &mut *guard;
            // This port's requests leave the queue; a random non-empty subset of them completes,
            // in random order, and the rest go back.
            let mut mine = Vec::new();
            let mut i = 0;
            while i < s.queue.len() {
                if s.queue[i].port == self.id {
                    mine.push(s.queue.swap_remove(i));
                } else {
                    i += 1;
                }
            }
            if mine.is_empty() {
                return Ok(());
            }
            let k = 1 + s.rng.below(mine.len() as u64) as usize;
            let mut out = Vec::with_capacity(k);
            for _ in 0..k {
                let j = s.rng.below(mine.len() as u64) as usize;
                let q = mine.swap_remove(j);
                let (sink, payload) = (q.sink, q.payload);
                if s.powered {
                    s.complete(q);
                } else {
                    s.fail_after_cut(self.id, q);
                }
                out.push((sink, payload));
            }
            s.queue.extend(mine);
            s.forget_old_durable();
            out
        };
        self.send(engine, done)
    }
}

impl Port {
    /// Push the NOPs that hand `done`'s completions to their sinks. A push that fails (the
    /// submission queue full and the kernel refusing the `io_uring_enter` that would make room)
    /// leaves its completion and those after it for the next advance: the disk has applied
    /// them, so dropping them would leave their requests waiting for ever.
    fn send(&self, engine: &Engine, done: Vec<(SinkId, u64)>) -> Result<(), CoreError> {
        for (i, &(sink, payload)) in done.iter().enumerate() {
            if let Err(e) = engine.push_nop(sink, payload) {
                self.unsent.borrow_mut().extend_from_slice(&done[i..]);
                return Err(e);
            }
        }
        Ok(())
    }
}

/// The [`Backend`] face of a [`SimDisk`] opening.
struct SimBackend(Rc<Port>);

impl Backend for SimBackend {
    fn caps(&self) -> Caps {
        Caps {
            name: "simdisk",
            asynchronous: true,
            fua: true,
            flush: true,
            iopoll: false,
            power_loss_protected: self.0.disk.lock().cfg.plp,
            // One segment per piece: each is a write the crash model may keep or lose alone.
            vectored: false,
        }
    }

    fn outcome(&self, res: i32, len: u32) -> Outcome {
        if res < 0 {
            Outcome::Failed(PieceError::Errno(-res))
        } else {
            Outcome::Bytes(len)
        }
    }

    fn outcome_of(&self, payload: u64, res: i32, len: u32) -> Outcome {
        let mut s = self.0.disk.lock();
        let port = self.0.id;
        if let Some(i) = s.failed.iter().position(|&p| p == (port, payload)) {
            s.failed.swap_remove(i);
            return Outcome::Failed(PieceError::Errno(libc::EIO));
        }
        drop(s);
        self.outcome(res, len)
    }

    unsafe fn start(
        &self,
        _engine: &Engine,
        sink: SinkId,
        payload: u64,
        piece: &Piece,
    ) -> Result<Started, CoreError> {
        let mut s = self.0.disk.lock();
        if !s.powered {
            s.stats.after_power_cut += 1;
            return Ok(Started::Done(-libc::EIO));
        }
        let end = piece.offset.checked_add(piece.len as u64);
        if end.is_none_or(|e| e > s.cfg.bytes) {
            return Ok(Started::Done(-libc::EINVAL));
        }
        // A read or write moves whole sectors (the crash model keeps or loses each whole).
        let sector = s.cfg.sector_bytes as u64;
        // And no more than the controller's max transfer (a larger one is refused, not split).
        if piece.op != Op::Flush
            && (piece.len == 0
                || piece.offset % sector != 0
                || piece.len as u64 % sector != 0
                || piece.len > s.cfg.max_transfer_bytes)
        {
            return Ok(Started::Done(-libc::EINVAL));
        }
        let data = if piece.op == Op::Write {
            // SAFETY: the caller guarantees `ptr..ptr+len` is valid for the piece's lifetime.
            unsafe { std::slice::from_raw_parts(piece.ptr, piece.len as usize) }.to_vec()
        } else {
            Vec::new()
        };
        let started = s.started;
        let mark = s.completed;
        let issued_ns = s.now_ns;
        s.queue.push(Queued {
            sink,
            payload,
            port: self.0.id,
            op: piece.op,
            offset: piece.offset,
            len: piece.len,
            ptr: ReadPtr(piece.ptr),
            data,
            fua: piece.fua,
            mark,
            started,
            issued_ns,
        });
        s.started += 1;
        if s.cfg.power_cut_after.is_some_and(|n| s.started >= n) {
            s.powered = false;
        }
        Ok(Started::Queued)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Io, LbioConfig};
    use aios_core::{EngineConfig, FixedBuf};

    fn setup(cfg: SimConfig) -> (Rc<Engine>, Rc<LbioArray>, SimDisk, Device) {
        let engine = Engine::new(EngineConfig {
            ring_entries: 256,
            arena_bytes: 4 << 20,
            huge_pages: false,
            ..EngineConfig::default()
        })
        .unwrap();
        let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
        let disk = SimDisk::new(cfg).unwrap();
        let dev = disk.open(&lbio).unwrap();
        (engine, lbio, disk, dev)
    }

    fn buf(engine: &Engine, len: usize, v: u8) -> FixedBuf {
        let mut b = engine.try_alloc(len).unwrap();
        b.fill(v);
        b
    }

    /// Start `n` 4 KiB writes of value `v + i` at block `i`, detached, and wait for all.
    fn write_blocks(engine: &Engine, lbio: &LbioArray, dev: &Device, n: u64, v: u8) -> Vec<u64> {
        let mut order = Vec::new();
        let mut tags = Vec::new();
        for i in 0..n {
            let io = Io::write(i * 4096, buf(engine, 4096, v + i as u8));
            tags.push(dev.submit(io).map_err(|e| e.0).unwrap());
        }
        while order.len() < n as usize {
            lbio.wait_done(1).unwrap();
            while let Some(c) = lbio.take_done() {
                c.result.unwrap();
                order.push(tags.iter().position(|t| *t == c.tag).unwrap() as u64);
            }
        }
        order
    }

    #[test]
    fn simulated_time_overlaps_requests_in_flight_and_serialises_waits() {
        let mut cfg = SimConfig::new(1 << 20, 5);
        cfg.latency.parallelism = 8;
        let cost = cfg.latency.write_ns + cfg.latency.per_4k_ns;
        // Eight writes in flight together: about one write's time.
        let (engine, lbio, disk, dev) = setup(cfg);
        write_blocks(&engine, &lbio, &dev, 8, 1);
        assert_eq!(disk.sim_time_ns(), cost);
        // Eight writes one after another: eight times that.
        let (engine, _lbio, disk, dev) = setup(cfg);
        for i in 0..8u64 {
            dev.write_at_blocking(i * 4096, buf(&engine, 4096, 1), false)
                .unwrap();
        }
        assert_eq!(disk.sim_time_ns(), 8 * cost);
        // A FLUSH waits for what is on the device and holds all of it.
        dev.flush_blocking().unwrap();
        assert_eq!(disk.sim_time_ns(), 8 * cost + cfg.latency.flush_ns);
    }

    #[test]
    fn writes_complete_out_of_order_and_reads_see_them() {
        let (engine, lbio, disk, dev) = setup(SimConfig::new(1 << 20, 7));
        let order = write_blocks(&engine, &lbio, &dev, 16, 1);
        assert_ne!(
            order,
            (0..16).collect::<Vec<_>>(),
            "completion order {order:?}"
        );
        assert!(disk.stats().reordered > 0);
        let back = dev
            .read_at_blocking(5 * 4096, buf(&engine, 4096, 0))
            .unwrap();
        assert!(back.iter().all(|&b| b == 6));
        assert!(disk.sim_time_ns() > 0);
    }

    #[test]
    fn only_flushed_or_fua_writes_are_certain_to_survive_a_crash() {
        let (engine, lbio, disk, dev) = setup(SimConfig::new(1 << 20, 11));
        write_blocks(&engine, &lbio, &dev, 2, 1); // blocks 0, 1: values 1, 2
        dev.flush_blocking().unwrap();
        dev.write_at_blocking(2 * 4096, buf(&engine, 4096, 9), true)
            .unwrap(); // FUA
        dev.write_at_blocking(3 * 4096, buf(&engine, 4096, 7), false)
            .unwrap(); // volatile
        disk.cut_power();
        let mut kept = 0;
        for _ in 0..64 {
            let img = disk.crash_image(CrashOptions::default());
            assert!(img[..4096].iter().all(|&b| b == 1));
            assert!(img[4096..8192].iter().all(|&b| b == 2));
            assert!(img[2 * 4096..3 * 4096].iter().all(|&b| b == 9));
            let b3 = &img[3 * 4096..4 * 4096];
            if b3.iter().all(|&b| b == 7) {
                kept += 1;
            }
            assert!(b3.iter().all(|&b| b == 7 || b == 0));
        }
        assert!(
            kept > 0 && kept < 64,
            "the volatile write survived {kept} of 64 crashes"
        );
        assert!(disk.media()[3 * 4096..4 * 4096].iter().all(|&b| b == 0));
    }

    #[test]
    fn unflushed_multi_sector_writes_tear_at_sector_boundaries() {
        let (engine, _lbio, disk, dev) = setup(SimConfig::new(1 << 20, 3));
        dev.write_at_blocking(0, buf(&engine, 4096, 5), false)
            .unwrap();
        disk.cut_power();
        let mut torn = 0;
        for _ in 0..64 {
            let img = disk.crash_image(CrashOptions::default());
            let sectors: Vec<bool> = img[..4096].chunks(512).map(|s| s[0] == 5).collect();
            for (s, chunk) in sectors.iter().zip(img[..4096].chunks(512)) {
                assert!(
                    chunk.iter().all(|&b| b == if *s { 5 } else { 0 }),
                    "a sector split"
                );
            }
            if sectors.iter().any(|&s| s) && !sectors.iter().all(|&s| s) {
                torn += 1;
            }
        }
        assert!(torn > 0);
        let whole = disk.crash_image(CrashOptions {
            torn: false,
            bit_flips: 0,
        });
        assert!(whole[..4096].iter().all(|&b| b == 5) || whole[..4096].iter().all(|&b| b == 0));
    }

    #[test]
    fn power_loss_protection_keeps_completed_writes() {
        let mut cfg = SimConfig::new(1 << 20, 5);
        cfg.plp = true;
        let (engine, _lbio, disk, dev) = setup(cfg);
        assert!(dev.critical_route().0.power_loss_protected);
        dev.write_at_blocking(0, buf(&engine, 4096, 4), false)
            .unwrap();
        disk.cut_power();
        for _ in 0..16 {
            assert!(disk.crash_image(CrashOptions::default())[..4096]
                .iter()
                .all(|&b| b == 4));
        }
    }

    #[test]
    fn a_power_cut_fails_queued_and_new_requests() {
        let mut cfg = SimConfig::new(1 << 20, 9);
        cfg.power_cut_after = Some(3);
        let (engine, lbio, disk, dev) = setup(cfg);
        let mut tags = Vec::new();
        for i in 0..3u64 {
            tags.push(
                dev.submit(Io::write(i * 4096, buf(&engine, 4096, 1)))
                    .map_err(|e| e.0)
                    .unwrap(),
            );
        }
        assert!(!disk.powered());
        let mut failed = 0;
        while tags.len() > failed {
            lbio.wait_done(1).unwrap();
            while let Some(c) = lbio.take_done() {
                let e = c.result.unwrap_err();
                assert!(e.to_string().contains("Input/output error"), "{e}");
                failed += 1;
            }
        }
        assert!(dev.flush_blocking().is_err());
        assert_eq!(disk.stats().after_power_cut, 4);
    }

    #[test]
    fn the_same_seed_replays_the_same_run() {
        let run = |seed| {
            let (engine, lbio, disk, dev) = setup(SimConfig::new(1 << 20, seed));
            let order = write_blocks(&engine, &lbio, &dev, 12, 1);
            disk.cut_power();
            (order, disk.crash_image(CrashOptions::default()))
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
    }

    #[test]
    fn bit_rot_flips_the_asked_number_of_bits() {
        let (_engine, _lbio, disk, _dev) = setup(SimConfig::new(64 << 10, 1));
        let img = disk.crash_image(CrashOptions {
            torn: true,
            bit_flips: 1,
        });
        let ones: u32 = img.iter().map(|b| b.count_ones()).sum();
        assert_eq!(ones, 1);
    }

    #[test]
    fn misdirected_writes_land_elsewhere() {
        let mut cfg = SimConfig::new(1 << 20, 2);
        cfg.misdirect_per_million = 1_000_000;
        let (engine, _lbio, disk, dev) = setup(cfg);
        dev.write_at_blocking(0, buf(&engine, 4096, 3), true)
            .unwrap();
        assert_eq!(disk.stats().misdirected, 1);
        let media = disk.media();
        assert!(media.iter().filter(|&&b| b == 3).count() == 4096);
        assert!(!media[..4096].iter().all(|&b| b == 3));
    }

    /// A read or write the disk's sectors cannot hold is refused, as a device with that LBA
    /// size would: it was queued, and a crash draw then indexed past the write's sectors (or
    /// tore a sector). lbio aligns what it sends; this is the device's own check.
    #[test]
    fn a_piece_not_in_whole_sectors_is_refused() {
        let mut cfg = SimConfig::new(64 << 10, 1);
        cfg.sector_bytes = 4096;
        let disk = SimDisk::new(cfg).unwrap();
        for op in [Op::Write, Op::Read] {
            for (offset, len) in [(512, 4096), (0, 512), (0, 4608), (0, 0)] {
                assert_eq!(
                    start_unadvanced(&disk, &[(op, offset, len, 1)]),
                    [Started::Done(-libc::EINVAL)],
                    "{op:?} of {len} at {offset}"
                );
            }
        }
        assert_eq!(
            start_unadvanced(&disk, &[(Op::Write, 4096, 8192, 1), (Op::Flush, 0, 0, 0)]),
            [Started::Queued, Started::Queued]
        );
        assert_eq!(disk.started(), 2);
        disk.cut_power();
        let img = disk.crash_image(CrashOptions::default());
        assert!(img[..4096].iter().all(|&b| b == 0));
    }

    /// Start `pieces` (op, offset, length, fill byte) on `disk` without ever advancing it:
    /// they stay in flight. Returns what each start answered.
    fn start_unadvanced(disk: &SimDisk, pieces: &[(Op, u64, u32, u8)]) -> Vec<Started> {
        let engine = Engine::new(EngineConfig {
            ring_entries: 8,
            arena_bytes: 1 << 20,
            huge_pages: false,
            ..EngineConfig::default()
        })
        .unwrap();
        // A port no opening of the disk gets (theirs count from 1), so that a device opened on
        // the same disk never completes these.
        let backend = SimBackend(Rc::new(Port {
            unsent: Default::default(),
            disk: Arc::clone(&disk.0),
            id: u64::MAX,
        }));
        pieces
            .iter()
            .map(|&(op, offset, len, v)| {
                // Writes are copied at start; reads are never advanced, so never written.
                let mut data = vec![v; len as usize];
                let piece = Piece {
                    op,
                    offset,
                    ptr: data.as_mut_ptr(),
                    len,
                    fua: false,
                    buf_index: None,
                    iov: std::ptr::null(),
                    iov_count: 0,
                };
                // SAFETY: a write's bytes are copied at start; nothing is advanced, so nothing
                // writes through the pointer later.
                unsafe { backend.start(&engine, SinkId(0), 0, &piece) }.unwrap()
            })
            .collect()
    }

    /// Cut the power, then draw 400 untorn crash images: the first byte of each of their first
    /// three 512-byte sectors, as seen.
    fn untorn_images_after_a_cut(disk: &SimDisk) -> std::collections::BTreeSet<[u8; 3]> {
        disk.cut_power();
        (0..400)
            .map(|_| {
                let img = disk.crash_image(CrashOptions {
                    torn: false,
                    bit_flips: 0,
                });
                [img[0], img[512], img[1024]]
            })
            .collect()
    }

    /// Two overlapping writes in flight together can land in either order: the device has
    /// completed neither. With atomic (untorn) writes, `[1 1 _]` then `[_ 2 2]` and the reverse
    /// must both be reachable; the draw always laid them in queue order, so the middle sector
    /// could hold only the second one when both survived.
    #[test]
    fn overlapping_writes_in_flight_together_land_in_either_order() {
        let disk = SimDisk::new(SimConfig::new(4 << 10, 1)).unwrap();
        start_unadvanced(&disk, &[(Op::Write, 0, 1024, 1), (Op::Write, 512, 1024, 2)]);
        let seen = untorn_images_after_a_cut(&disk);
        for want in [[1, 1, 2], [1, 2, 2], [1, 1, 0], [0, 2, 2], [0, 0, 0]] {
            assert!(seen.contains(&want), "{want:?} never drawn: {seen:?}");
        }
        assert_eq!(seen.len(), 5, "{seen:?}");
    }

    /// A write still in flight at the crash may have been done by the device before a later
    /// overlapping write that completed (or even became durable) while it was in flight: it
    /// lands under that write. With atomic (untorn) writes, `[1 2 2]` (the in-flight `[1 1 _]`
    /// under the completed `[_ 2 2]`) must be reachable; the draw laid every in-flight write
    /// over the completed ones, so it never was. A write sent after the other completed can
    /// never land under it, and a durable one always shows.
    #[test]
    fn an_in_flight_write_can_land_under_a_later_completed_one() {
        // How B (`[_ 2 2]`) ends: 0 cached, 1 FUA, 2 flushed.
        for (b_first, durable) in [(false, 0), (false, 1), (false, 2), (true, 0), (true, 2)] {
            let (engine, _lbio, disk, dev) = setup(SimConfig::new(4 << 10, 3));
            let a = || start_unadvanced(&disk, &[(Op::Write, 0, 1024, 1)]);
            if !b_first {
                a();
            }
            dev.write_at_blocking(512, buf(&engine, 1024, 2), durable == 1)
                .unwrap();
            if durable == 2 {
                dev.flush_blocking().unwrap();
            }
            if b_first {
                a();
            }
            let seen = untorn_images_after_a_cut(&disk);
            let mut want = vec![[1, 1, 2], [0, 2, 2]];
            if !b_first {
                want.push([1, 2, 2]);
            }
            if durable == 0 {
                want.extend([[0, 0, 0], [1, 1, 0]]);
            }
            for w in &want {
                assert!(
                    seen.contains(w),
                    "B first {b_first}, durable {durable}: {w:?} never drawn: {seen:?}"
                );
            }
            assert_eq!(
                seen.len(),
                want.len(),
                "B first {b_first}, durable {durable}: {seen:?}"
            );
        }
    }

    /// Untorn crash draws of small random histories are exactly the images a device could
    /// leave, listed by brute force: every order of the writes in which the completed ones go
    /// in completion order (the order reads saw) and each in-flight one anywhere after the
    /// writes completed before it was sent, with every durable write kept and any subset of the
    /// others. (Requests are started and completed here one by one, in a random order, some
    /// failed by the power cut, some left queued.)
    #[test]
    fn untorn_crash_draws_are_exactly_the_images_a_device_could_leave() {
        const SECTORS: usize = 4;
        /// A request as the test knows it.
        struct Req {
            /// A write's (first sector, sectors, FUA); `None`: a FLUSH.
            write: Option<(usize, usize, bool)>,
            /// Completions counted when it was started.
            mark: u64,
            /// Completed as the n-th (from 0); `None`: in flight at the cut.
            done: Option<u64>,
        }
        for seed in 0..150u64 {
            let mut rng = SimRng::new(seed);
            let disk = SimDisk::new(SimConfig::new(SECTORS as u64 * 512, seed)).unwrap();
            let mut reqs: Vec<Req> = Vec::new();
            let mut completions = 0;
            let writes = |reqs: &[Req]| reqs.iter().filter(|r| r.write.is_some()).count();
            for _ in 0..10 {
                let queued = disk.0.lock().queue.len();
                match rng.below(5) {
                    0 | 1 if writes(&reqs) < 4 => {
                        let n = 1 + rng.below(2) as usize;
                        let first = rng.below((SECTORS - n + 1) as u64) as usize;
                        let fua = rng.chance(1, 3);
                        let v = writes(&reqs) as u8 + 1;
                        let len = n as u32 * 512;
                        start_unadvanced(&disk, &[(Op::Write, first as u64 * 512, len, v)]);
                        disk.0.lock().queue.last_mut().unwrap().fua = fua;
                        reqs.push(Req {
                            write: Some((first, n, fua)),
                            mark: completions,
                            done: None,
                        });
                    }
                    2 => {
                        start_unadvanced(&disk, &[(Op::Flush, 0, 0, 0)]);
                        reqs.push(Req {
                            write: None,
                            mark: completions,
                            done: None,
                        });
                    }
                    _ if queued > 0 => {
                        let mut s = disk.0.lock();
                        let q = s.queue.remove(rng.below(queued as u64) as usize);
                        reqs[q.started as usize].done = Some(completions);
                        s.complete(q);
                        s.forget_old_durable();
                        completions += 1;
                    }
                    _ => {}
                }
            }
            disk.cut_power();
            {
                // Some of what is queued fails at the cut (as an advance would fail it).
                let mut s = disk.0.lock();
                for _ in 0..rng.below(s.queue.len() as u64 + 1) {
                    let q = s.queue.remove(0);
                    s.fail_after_cut(u64::MAX, q);
                }
                s.forget_old_durable();
            }
            let durable = |r: &Req| {
                r.done.is_some_and(|c| {
                    r.write.is_some_and(|w| w.2)
                        || reqs
                            .iter()
                            .any(|f| f.write.is_none() && f.done.is_some() && c < f.mark)
                })
            };
            // Every order of the writes a device could have done them in.
            let ids: Vec<usize> = (0..reqs.len())
                .filter(|&i| reqs[i].write.is_some())
                .collect();
            let mut orders: Vec<Vec<usize>> = vec![vec![]];
            for _ in 0..ids.len() {
                let mut longer = Vec::new();
                for o in &orders {
                    for &i in ids.iter().filter(|i| !o.contains(i)) {
                        longer.push([&o[..], &[i]].concat());
                    }
                }
                orders = longer;
            }
            let mut possible = std::collections::BTreeSet::new();
            for order in orders {
                let fits = order.iter().enumerate().all(|(k, &i)| {
                    order[k + 1..]
                        .iter()
                        .all(|&j| match (reqs[i].done, reqs[j].done) {
                            // Completed ones in completion order.
                            (Some(a), Some(b)) => a < b,
                            // Nothing in flight before a write that completed before it was sent.
                            (None, Some(b)) => b >= reqs[i].mark,
                            _ => true,
                        })
                });
                if !fits {
                    continue;
                }
                for kept in 0..1u32 << order.len() {
                    let mut img = [0u8; SECTORS];
                    let mut ok = true;
                    for (k, &i) in order.iter().enumerate() {
                        if kept & 1 << k != 0 {
                            let (first, n, _) = reqs[i].write.unwrap();
                            img[first..first + n]
                                .fill(1 + ids.iter().position(|&j| j == i).unwrap() as u8);
                        } else if durable(&reqs[i]) {
                            ok = false;
                        }
                    }
                    if ok {
                        possible.insert(img);
                    }
                }
            }
            let media = disk.media();
            let mut drawn = std::collections::BTreeMap::new();
            for _ in 0..6000 {
                let mut img = [0u8; SECTORS];
                for (s, b) in img.iter_mut().enumerate() {
                    *b = media[s * 512];
                }
                disk.crash_draw(false, &mut |at, bytes| {
                    img[at as usize / 512] = bytes[0];
                    assert_eq!(bytes.len(), 512);
                });
                *drawn.entry(img).or_insert(0u32) += 1;
            }
            for img in drawn.keys() {
                assert!(
                    possible.contains(img),
                    "seed {seed}: {img:?} drawn, not possible: {possible:?}"
                );
            }
            for img in &possible {
                assert!(
                    drawn.contains_key(img),
                    "seed {seed}: {img:?} never drawn: {drawn:?}"
                );
            }
        }
    }

    /// A piece larger than the device's max transfer (its MDTS) is refused, as the NVMe
    /// controller would: the disk took a piece of any size, hiding a layer that forgot to split.
    #[test]
    fn a_piece_over_the_max_transfer_is_refused() {
        let mut cfg = SimConfig::new(64 << 10, 1);
        cfg.max_transfer_bytes = 4096;
        let disk = SimDisk::new(cfg).unwrap();
        let got = start_unadvanced(
            &disk,
            &[
                (Op::Write, 0, 8192, 1),
                (Op::Read, 0, 8192, 0),
                (Op::Write, 0, 4096, 1),
                (Op::Read, 0, 4096, 0),
            ],
        );
        assert_eq!(
            got,
            [
                Started::Done(-libc::EINVAL),
                Started::Done(-libc::EINVAL),
                Started::Queued,
                Started::Queued,
            ]
        );
    }

    #[test]
    fn bad_configurations_are_refused() {
        let mut cfg = SimConfig::new(1 << 20, 1);
        cfg.sector_bytes = 100;
        assert!(SimDisk::new(cfg).is_err());
        assert!(SimDisk::from_image(SimConfig::new(4096, 1), vec![0; 10]).is_err());
    }
}
