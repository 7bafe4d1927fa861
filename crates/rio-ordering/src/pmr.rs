//! Backends of the attribute log's persistent region besides [`MemPmr`](crate::MemPmr):
//!
//! - [`aios_core::pmr::NvmePmr`]: the controller's PMR, the hardware Rio keeps its
//!   attributes in; every [`Pmr::persist`] is a persistent MMIO write (the writes, then the reads
//!   the controller names as its write barrier).
//! - [`FilePmr`]: persistent memory **emulated** in a small file: `pwrite` then `fdatasync` per
//!   persist. It survives a process crash (and a power cut, if the file system honours
//!   `fdatasync`), at the cost of a system call pair per attribute.
//! - [`BlockPmr`]: for hardware without a PMR, the log kept in a reserved range of blocks on a
//!   device (normally the data device itself). It is *deferred*: appends and persist words change
//!   an in-memory image, and [`Pmr::sync`] writes the changed blocks with FUA (`RWF_DSYNC`) in
//!   one system call per contiguous run. The ordered device syncs once per batch, before it
//!   submits the batch's data (attribute blocks written ahead of their data), and once at the end
//!   of `wait`; header rewrites are written at once, before anything staged after them. It
//!   writes through a descriptor of its own ([`BlockPmr::open`]) or through an lbio device on
//!   the engine's ring ([`BlockPmr::on_device`], a SimDisk included). On a device opened on the
//!   ordered device's own lbio array, the sync is asynchronous ([`Pmr::sync_start`]): the
//!   batch's data goes out from the log writes' completion instead of the thread waiting.

use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use aios_core::pmr::NvmePmr;
use aios_core::{sys, Engine, FixedBuf};

use crate::error::RioError;
use crate::log::{check_range, Pmr};

impl Pmr for NvmePmr {
    fn len(&self) -> usize {
        NvmePmr::len(self)
    }
    fn persist(&mut self, offset: usize, bytes: &[u8]) -> Result<(), RioError> {
        Ok(NvmePmr::persist(self, offset, bytes)?)
    }
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), RioError> {
        Ok(NvmePmr::read(self, offset, out)?)
    }
}

/// Persistent memory emulated in a file (see the module documentation).
#[derive(Debug)]
pub struct FilePmr {
    file: File,
    path: PathBuf,
    len: usize,
}

impl FilePmr {
    /// Opens `path`, creating it with `len` zero bytes when it does not exist. An existing file
    /// keeps its contents and its size (`len` must then match it).
    pub fn open(path: &Path, len: usize) -> Result<FilePmr, RioError> {
        let io = |e: std::io::Error| RioError::Config(format!("{}: {e}", path.display()));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(io)?;
        let have = file.metadata().map_err(io)?.len() as usize;
        if have == 0 {
            file.set_len(len as u64).map_err(io)?;
            file.sync_all().map_err(io)?;
        } else if have != len {
            return Err(RioError::Config(format!(
                "{} holds {have} bytes, not the {len} asked for: give its size, or another path",
                path.display()
            )));
        }
        Ok(FilePmr {
            file,
            path: path.to_path_buf(),
            len,
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Pmr for FilePmr {
    fn len(&self) -> usize {
        self.len
    }
    fn persist(&mut self, offset: usize, bytes: &[u8]) -> Result<(), RioError> {
        check_range(offset, bytes.len(), self.len)?;
        let io = |e: std::io::Error| RioError::Config(format!("{}: {e}", self.path.display()));
        self.file.write_all_at(bytes, offset as u64).map_err(io)?;
        self.file.sync_data().map_err(io)
    }
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), RioError> {
        check_range(offset, out.len(), self.len)?;
        self.file
            .read_exact_at(out, offset as u64)
            .map_err(|e| RioError::Config(format!("{}: {e}", self.path.display())))
    }
}

/// The most writes an asynchronous [`BlockPmr`] sync sends (request slots it needs): one, over
/// all the dirty blocks, from the buffer set aside for it.
pub const ASYNC_SYNC_WRITES: usize = 1;

/// What a [`BlockPmr`] has written so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockLogStats {
    /// `sync` calls that wrote something.
    pub syncs: u64,
    /// Ordered (header) writes.
    pub ordered_writes: u64,
    /// Blocks written.
    pub blocks_written: u64,
    /// FUA write system calls.
    pub writes: u64,
    /// Time spent in those writes (the latency the block log adds in front of the data).
    pub write_time: Duration,
}

/// The attribute log in device blocks (see the module documentation).
pub struct BlockPmr {
    sink: Sink,
    /// What the log is on, for messages.
    name: String,
    /// Byte offset of the region on the device.
    start: u64,
    image: FixedBuf,
    block: usize,
    dirty: Vec<bool>,
    any_dirty: bool,
    stats: BlockLogStats,
    /// Asynchronous syncs (on an lbio device): writes out, with their block ranges.
    pending: Vec<(lbio::Tag, usize, usize)>,
    /// On an lbio device, the buffer a sync copies its blocks into, set aside when the log
    /// opens (out with the write while one is). Taking it from the arena at each sync could
    /// find the arena full of the very data that waits for the sync, with nothing in flight to
    /// free room.
    spare: Option<FixedBuf>,
}

/// A buffer holding `bytes` (of the image), to write: the `spare` one when it is there (a write
/// whose buffer did not come back leaves the arena to provide one). Over fields, not `&mut
/// self`: the caller holds the device it writes to.
fn copy_out(
    spare: &mut Option<FixedBuf>,
    bytes: &[u8],
    engine: &Engine,
) -> Result<FixedBuf, RioError> {
    let mut buf = match spare.take() {
        Some(buf) => buf,
        None => engine.alloc_blocking(bytes.len())?,
    };
    buf.set_len(bytes.len())?;
    buf.copy_from_slice(bytes);
    Ok(buf)
}

/// Where a [`BlockPmr`] writes: a descriptor of its own (`pwrite` with `RWF_DSYNC`), or an lbio
/// device (a FUA write through the engine's ring; also a SimDisk, whose crash states then hold
/// the log).
enum Sink {
    Fd(OwnedFd),
    Device(Box<lbio::Device>),
}

impl std::fmt::Debug for BlockPmr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockPmr")
            .field("on", &self.name)
            .field("start", &self.start)
            .field("len", &self.image.len())
            .field("block", &self.block)
            .finish()
    }
}

fn check_region(
    name: &str,
    start: u64,
    len: usize,
    block: usize,
    capacity: u64,
) -> Result<(), RioError> {
    if start % block as u64 != 0 || len % block != 0 || len == 0 {
        return Err(RioError::Config(format!(
            "a block log at {start}+{len} on {name}: both must be non-zero multiples of its \
             {block}-byte logical block"
        )));
    }
    if start
        .checked_add(len as u64)
        .is_none_or(|end| end > capacity)
    {
        return Err(RioError::Config(format!(
            "a block log at {start}+{len} does not fit {name}'s {capacity} bytes"
        )));
    }
    Ok(())
}

impl BlockPmr {
    /// The `len` bytes at byte `start` of `path` (a block device or a file, opened for direct
    /// I/O), read into an image allocated from `engine`'s arena. Both must be multiples of the
    /// device's logical block.
    pub fn open(
        engine: &Engine,
        path: &Path,
        start: u64,
        len: usize,
    ) -> Result<BlockPmr, RioError> {
        let name = path.display().to_string();
        let io = |e: std::io::Error| RioError::Config(format!("{name}: {e}"));
        let fd = sys::open_direct(path, true).map_err(io)?;
        let st = sys::statx(fd.as_raw_fd()).map_err(io)?;
        let block = if st.is_block_device() {
            sys::block_device_logical_block(fd.as_raw_fd()).map_err(io)? as usize
        } else {
            st.dio.map_or(4096, |d| d.offset_align as usize)
        }
        .max(512);
        let capacity = if st.is_block_device() {
            sys::block_device_bytes(fd.as_raw_fd()).map_err(io)?
        } else {
            st.size
        };
        check_region(&name, start, len, block, capacity)?;
        let mut image = engine.alloc_blocking(len)?;
        let n = sys::pread_into(fd.as_raw_fd(), &mut image[..], start).map_err(io)?;
        if n != len {
            return Err(RioError::Config(format!(
                "{name}: short read of the block log ({n} of {len} bytes)"
            )));
        }
        Ok(BlockPmr::with(Sink::Fd(fd), name, start, image, block))
    }

    /// The `len` bytes at byte `start` of an lbio device (opened writable): the log is read
    /// through the device and synced with FUA writes on its engine's ring, so it works on
    /// anything lbio opens, SimDisk included. The log needs a `Device` of its own (not one of
    /// the ordered device's targets: open the path again). Opened on the ordered device's own
    /// lbio array, its syncs are asynchronous (the ordered device takes their completions and
    /// sends each batch's data from them); on another array of the same engine they block.
    pub fn on_device(device: lbio::Device, start: u64, len: usize) -> Result<BlockPmr, RioError> {
        let g = device.geometry();
        let name = format!("lbio device of {} bytes", g.capacity_bytes);
        let block = (g.offset_align.max(g.logical_block) as usize).max(512);
        check_region(&name, start, len, block, g.capacity_bytes)?;
        let engine = std::rc::Rc::clone(device.lbio().engine());
        let buf = engine.alloc_blocking(len)?;
        let spare = engine.alloc_blocking(len)?;
        let image = device
            .read_at_blocking(start, buf)
            .map_err(|e| RioError::Config(format!("{name}: reading the block log: {e}")))?;
        let mut pmr = BlockPmr::with(Sink::Device(Box::new(device)), name, start, image, block);
        pmr.spare = Some(spare);
        Ok(pmr)
    }

    fn with(sink: Sink, name: String, start: u64, image: FixedBuf, block: usize) -> BlockPmr {
        BlockPmr {
            sink,
            name,
            start,
            dirty: vec![false; image.len() / block],
            any_dirty: false,
            image,
            block,
            stats: BlockLogStats::default(),
            pending: Vec::new(),
            spare: None,
        }
    }

    /// A write's buffer came back: keep it if it is the spare one.
    fn take_back(&mut self, buf: FixedBuf) {
        if self.spare.is_none() && buf.capacity() >= self.image.len() {
            self.spare = Some(buf);
        }
    }

    /// What was written so far.
    pub fn stats(&self) -> BlockLogStats {
        self.stats
    }

    /// Writes blocks `from..to` of the image with FUA.
    fn write_blocks(&mut self, from: usize, to: usize) -> Result<(), RioError> {
        let (a, b) = (from * self.block, to * self.block);
        let t = Instant::now();
        let fail =
            |name: &str, e: String| RioError::Config(format!("{name}: block log write: {e}"));
        let n = match &self.sink {
            Sink::Fd(fd) => sys::pwrite_from(
                fd.as_raw_fd(),
                &self.image[a..b],
                self.start + a as u64,
                true,
            )
            .map_err(|e| fail(&self.name, e.to_string()))?,
            Sink::Device(dev) => {
                let buf = copy_out(&mut self.spare, &self.image[a..b], dev.lbio().engine())?;
                let buf = dev
                    .write_at_blocking(self.start + a as u64, buf, true)
                    .map_err(|e| fail(&self.name, e.to_string()))?;
                let n = buf.len();
                self.take_back(buf);
                n
            }
        };
        self.stats.write_time += t.elapsed();
        if n != b - a {
            return Err(RioError::Config(format!(
                "{}: short block log write ({n} of {} bytes)",
                self.name,
                b - a
            )));
        }
        self.stats.writes += 1;
        self.stats.blocks_written += (to - from) as u64;
        for d in &mut self.dirty[from..to] {
            *d = false;
        }
        Ok(())
    }
}

impl BlockPmr {
    /// The staged blocks, as runs `from..to`.
    fn dirty_runs(&self) -> Vec<(usize, usize)> {
        let mut runs = Vec::new();
        let mut i = 0;
        while i < self.dirty.len() {
            if !self.dirty[i] {
                i += 1;
                continue;
            }
            let mut j = i + 1;
            while j < self.dirty.len() && self.dirty[j] {
                j += 1;
            }
            runs.push((i, j));
            i = j;
        }
        runs
    }

    /// Blocking writes must not overtake an asynchronous write of the same blocks.
    fn check_no_pending(&self, what: &str) -> Result<(), RioError> {
        if self.pending.is_empty() {
            Ok(())
        } else {
            Err(RioError::Config(format!(
                "{}: a {what} while {} asynchronous block log write(s) are out: wait for them \
                 (Pmr::sync_done) first",
                self.name,
                self.pending.len()
            )))
        }
    }
}

impl Pmr for BlockPmr {
    fn len(&self) -> usize {
        self.image.len()
    }
    fn persist(&mut self, offset: usize, bytes: &[u8]) -> Result<(), RioError> {
        check_range(offset, bytes.len(), self.image.len())?;
        if bytes.is_empty() {
            return Ok(());
        }
        self.image[offset..offset + bytes.len()].copy_from_slice(bytes);
        let (first, last) = (offset / self.block, (offset + bytes.len() - 1) / self.block);
        for d in &mut self.dirty[first..=last] {
            *d = true;
        }
        self.any_dirty = true;
        Ok(())
    }
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), RioError> {
        check_range(offset, out.len(), self.image.len())?;
        out.copy_from_slice(&self.image[offset..offset + out.len()]);
        Ok(())
    }
    fn deferred(&self) -> bool {
        true
    }
    fn block_bytes(&self) -> usize {
        self.block
    }
    fn sync(&mut self) -> Result<(), RioError> {
        if !self.any_dirty {
            return Ok(());
        }
        self.check_no_pending("blocking sync")?;
        self.stats.syncs += 1;
        for (i, j) in self.dirty_runs() {
            self.write_blocks(i, j)?;
        }
        self.any_dirty = false;
        Ok(())
    }
    fn persist_ordered(&mut self, offset: usize, bytes: &[u8]) -> Result<(), RioError> {
        self.persist(offset, bytes)?;
        if bytes.is_empty() {
            return Ok(());
        }
        // Only the blocks of this write; whatever else is staged stays staged.
        let (first, last) = (offset / self.block, (offset + bytes.len() - 1) / self.block);
        if self.pending.iter().any(|&(_, a, b)| a <= last && first < b) {
            self.check_no_pending("header write over blocks being written")?;
        }
        self.stats.ordered_writes += 1;
        self.write_blocks(first, last + 1)?;
        self.any_dirty = self.dirty.iter().any(|&d| d);
        Ok(())
    }
    fn async_array(&self) -> Option<&std::rc::Rc<lbio::LbioArray>> {
        match &self.sink {
            Sink::Device(dev) => Some(dev.lbio()),
            Sink::Fd(_) => None,
        }
    }
    fn sync_start(&mut self) -> Result<usize, RioError> {
        let Sink::Device(dev) = &self.sink else {
            return self.sync().map(|()| 0);
        };
        if !self.any_dirty {
            return Ok(0);
        }
        self.check_no_pending("second asynchronous sync")?;
        self.stats.syncs += 1;
        // One write from the first dirty block to the last (the clean blocks between hold what
        // the device holds: no write of them is out), from the spare buffer: the sync takes one
        // request slot and no memory from the arena.
        let i = self.dirty.iter().position(|&d| d).expect("a dirty block");
        let j = 1 + self.dirty.iter().rposition(|&d| d).expect("a dirty block");
        let (a, b) = (i * self.block, j * self.block);
        // A copy: the image keeps changing while the write is out.
        let buf = copy_out(&mut self.spare, &self.image[a..b], dev.lbio().engine())?;
        let tag = match dev.submit(lbio::Io::write(self.start + a as u64, buf).fua(true)) {
            Ok(tag) => tag,
            Err((e, buf)) => {
                // The blocks stay dirty, for the next sync.
                if let Some(buf) = buf {
                    self.take_back(buf);
                }
                return Err(RioError::Config(format!(
                    "{}: block log write: {e}",
                    self.name
                )));
            }
        };
        for d in &mut self.dirty[i..j] {
            *d = false;
        }
        self.pending.push((tag, i, j));
        self.stats.writes += 1;
        self.stats.blocks_written += (j - i) as u64;
        self.any_dirty = false;
        Ok(self.pending.len())
    }
    fn sync_owns(&self, tag: lbio::Tag) -> bool {
        self.pending.iter().any(|p| p.0 == tag)
    }
    fn sync_writes_out(&self) -> usize {
        self.pending.len()
    }
    fn sync_done(&mut self, c: lbio::Completion) -> Result<(), RioError> {
        let Some(k) = self.pending.iter().position(|p| p.0 == c.tag) else {
            return Err(RioError::Config(format!(
                "{}: a completion that is not a block log write",
                self.name
            )));
        };
        let (_, i, j) = self.pending.swap_remove(k);
        if let Some(buf) = c.buf {
            self.take_back(buf);
        }
        match c.result {
            Ok(_) => Ok(()),
            Err(e) => {
                // Not known to be on the device: write them again at the next sync.
                for d in &mut self.dirty[i..j] {
                    *d = true;
                }
                self.any_dirty = true;
                Err(RioError::Config(format!(
                    "{}: block log write: {e}",
                    self.name
                )))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{scan, Attr, AttrLog};

    /// The entry of a one-write group `seq` of 4 KiB.
    fn entry(seq: u64) -> Attr {
        Attr {
            seq,
            seq_end: seq,
            len: 4096,
            boundary: true,
            num: 1,
            members: 1,
            ..Attr::default()
        }
    }

    #[test]
    fn a_file_log_survives_closing_and_reopening_the_file() {
        let dir = std::env::temp_dir().join(format!("rio-filepmr-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("attrs");
        let _ = std::fs::remove_file(&path);
        {
            let mut log = AttrLog::format(FilePmr::open(&path, 16 << 10).unwrap(), 1).unwrap();
            let a = entry(1);
            let s = log.append(&a).unwrap();
            log.set_persist(s, 1).unwrap();
        }
        let pmr = FilePmr::open(&path, 16 << 10).unwrap();
        let sc = scan(&pmr).unwrap();
        assert_eq!(sc.entries.len(), 1);
        assert!(sc.entries[0].1.persist);
        let e = FilePmr::open(&path, 8 << 10).unwrap_err();
        assert!(e.to_string().contains("16384 bytes"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The block log's contract, whatever it writes through: `open` opens the region afresh
    /// (what recovery would read), `bad` tries a misaligned one.
    fn block_log_contract(open: &dyn Fn() -> BlockPmr, bad: RioError) {
        let mut log = AttrLog::format(open(), 2).unwrap();
        assert!(log.deferred());
        let slots_at = scan(log.pmr()).unwrap().header.slots_at;
        assert_eq!(
            slots_at % log.pmr().block_bytes(),
            0,
            "slots start on a block"
        );
        let a = entry(1);
        let s = log.append(&a).unwrap();
        // Not synced: a fresh open of the device sees the empty log.
        assert!(scan(&open()).unwrap().entries.is_empty());
        log.sync().unwrap();
        log.set_persist(s, 1).unwrap();
        let sc = scan(&open()).unwrap();
        assert_eq!(sc.entries.len(), 1);
        assert!(
            !sc.entries[0].1.persist,
            "the persist word waits for the next sync"
        );
        log.sync().unwrap();
        assert!(scan(&open()).unwrap().entries[0].1.persist);
        let st = log.pmr().stats();
        assert!(st.syncs >= 2 && st.ordered_writes == 2, "{st:?}");
        // Bad geometry is refused with the block size.
        assert!(bad.to_string().contains("logical block"), "{bad}");
    }

    fn test_file(name: &str) -> (PathBuf, std::rc::Rc<aios_core::Engine>) {
        let dir = std::env::temp_dir().join(format!("rio-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("dev");
        std::fs::File::create(&path)
            .unwrap()
            .set_len(1 << 20)
            .unwrap();
        let engine = aios_core::Engine::new(aios_core::EngineConfig {
            arena_bytes: 1 << 20,
            huge_pages: false,
            ..aios_core::EngineConfig::default()
        })
        .unwrap();
        (path, engine)
    }

    #[test]
    fn a_block_log_is_durable_only_after_sync_and_keeps_its_slots_off_the_header_block() {
        let (path, engine) = test_file("blockpmr");
        let start = 64 << 10;
        block_log_contract(
            &|| BlockPmr::open(&engine, &path, start, 64 << 10).unwrap(),
            BlockPmr::open(&engine, &path, 100, 4096).unwrap_err(),
        );
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    fn open_writable(lbio: &std::rc::Rc<lbio::LbioArray>, path: &Path) -> lbio::Device {
        let cfg = lbio::DeviceConfig {
            write: true,
            ..lbio::DeviceConfig::default()
        };
        lbio::Device::open(lbio, path, cfg).unwrap()
    }

    #[test]
    fn a_block_log_on_an_lbio_device_keeps_the_same_contract() {
        let (path, engine) = test_file("devpmr");
        let lbio =
            lbio::LbioArray::new(std::rc::Rc::clone(&engine), lbio::LbioConfig::default()).unwrap();
        let dev = || open_writable(&lbio, &path);
        let start = 64 << 10;
        block_log_contract(
            &|| BlockPmr::on_device(dev(), start, 64 << 10).unwrap(),
            BlockPmr::on_device(dev(), 100, 4096).unwrap_err(),
        );
        // Written through the ring with FUA, not by a descriptor of its own.
        let mut log =
            AttrLog::format(BlockPmr::on_device(dev(), start, 64 << 10).unwrap(), 1).unwrap();
        log.sync().unwrap();
        assert!(log.pmr().stats().writes >= 1);
        assert!(format!("{:?}", log.pmr()).contains("lbio device"));
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[test]
    fn an_asynchronous_sync_is_durable_at_its_completion_and_refuses_a_race() {
        let (path, engine) = test_file("asyncpmr");
        let lbio =
            lbio::LbioArray::new(std::rc::Rc::clone(&engine), lbio::LbioConfig::default()).unwrap();
        let dev = || open_writable(&lbio, &path);
        let start = 64 << 10;
        let mut log =
            AttrLog::format(BlockPmr::on_device(dev(), start, 64 << 10).unwrap(), 1).unwrap();
        assert!(log
            .async_array()
            .is_some_and(|a| std::rc::Rc::ptr_eq(a, &lbio)));
        log.append(&entry(1)).unwrap();
        // Hand every completion to the log until the sync's `left` writes are in.
        let finish = |log: &mut AttrLog<BlockPmr>, mut left: usize| {
            while left > 0 {
                lbio.wait_done(1).unwrap();
                while let Some(c) = lbio.take_done() {
                    assert!(log.sync_owns(c.tag));
                    log.sync_done(c).unwrap();
                    left -= 1;
                }
            }
        };
        let out = log.sync_start().unwrap();
        assert!(out >= 1);
        // While its writes are out: no second sync, no blocking one.
        log.append(&entry(2)).unwrap();
        let e = log.sync_start().unwrap_err();
        assert!(e.to_string().contains("asynchronous"), "{e}");
        let e = log.sync().unwrap_err();
        assert!(e.to_string().contains("asynchronous"), "{e}");
        finish(&mut log, out);
        // The first entry is on the device; the second waits for the next sync.
        let sc = scan(&BlockPmr::on_device(dev(), start, 64 << 10).unwrap()).unwrap();
        assert_eq!(sc.entries.len(), 1);
        assert_eq!(sc.entries[0].1.seq, 1);
        let out = log.sync_start().unwrap();
        assert!(out >= 1);
        finish(&mut log, out);
        let sc = scan(&BlockPmr::on_device(dev(), start, 64 << 10).unwrap()).unwrap();
        assert_eq!(sc.entries.len(), 2);
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }
}
