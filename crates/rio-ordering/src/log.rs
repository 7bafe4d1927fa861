//! The persistent attribute log (Rio §4.3.2): a circular array of 64-byte attribute entries on
//! byte-addressable persistent memory, after a header.
//!
//! - An entry is written (persist word 0) before its data is submitted; its persist word is set
//!   when the data is durable.
//! - Head and tail live in memory. A slot is free again once every group of its entry's stream
//!   up to that entry is durable (not merely completed: a completed write in a volatile cache can
//!   still be lost, and recovery must then see the entry to stop the prefix before it).
//! - Recovery cannot tell a freed entry from a live one by looking at it, so the header holds,
//!   per stream, the group below which everything is durable (`durable_below`). Before a slot is
//!   reused whose entry is not yet below the header's mark, the header is rewritten with the
//!   current marks: one header write per lap of the log at most. Entries below the mark are
//!   ignored by recovery.
//! - A full log refuses the append ([`RioError::LogFull`]): back-pressure, never overwrite.
//! - Each open starts a new epoch; entries of older epochs are stale.

use crate::attr::{Attr, ATTR_BYTES};
use crate::error::RioError;

/// Byte-addressable persistent memory: what an NVMe PMR (or other persistent memory) offers.
pub trait Pmr {
    /// Bytes of the region.
    fn len(&self) -> usize;
    /// Whether the region is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Write `bytes` at `offset`, durable when this returns (on a PMR: the writes, then a read
    /// back that makes them persistent).
    fn persist(&mut self, offset: usize, bytes: &[u8]) -> Result<(), RioError>;
    /// Read `out.len()` bytes at `offset`.
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), RioError>;
    /// A hint: the next write goes to `offset`. A region in ordinary memory brings that line
    /// into the cache ahead of it (the log calls this after each append, for the next slot);
    /// the default does nothing.
    fn prefetch(&self, _offset: usize) {}
    /// Whether [`Pmr::persist`] only stages the bytes, which become durable at the next
    /// [`Pmr::sync`] (a log kept in device blocks). Byte-addressable persistent memory: `false`.
    fn deferred(&self) -> bool {
        false
    }
    /// The unit the region is written in; the log starts its slots on such a boundary so that
    /// header and slots never share one. 1 for byte-addressable memory.
    fn block_bytes(&self) -> usize {
        1
    }
    /// Make every staged [`Pmr::persist`] durable (nothing to do where persist is immediate).
    fn sync(&mut self) -> Result<(), RioError> {
        Ok(())
    }
    /// Like [`Pmr::persist`], but durable on return even on a deferred region, before anything
    /// staged after it (the log header, whose marks must be durable before a slot is reused).
    fn persist_ordered(&mut self, offset: usize, bytes: &[u8]) -> Result<(), RioError> {
        self.persist(offset, bytes)
    }
    /// A deferred region that can also sync without blocking: the lbio array its writes go to
    /// as detached requests. An ordered device on the same array then sends each batch's data
    /// from the completion of the batch's log writes instead of waiting for them.
    fn async_array(&self) -> Option<&std::rc::Rc<lbio::LbioArray>> {
        None
    }
    /// Start writing everything staged (detached FUA writes on [`Pmr::async_array`], at most
    /// [`crate::pmr::ASYNC_SYNC_WRITES`] of them: the caller makes that many request slots free)
    /// and say how many writes went out; the staged bytes are durable once each has been handed to
    /// [`Pmr::sync_done`] without error. Nothing else may write the region until then. The
    /// default writes them at once ([`Pmr::sync`]) and reports none.
    fn sync_start(&mut self) -> Result<usize, RioError> {
        self.sync().map(|()| 0)
    }
    /// Whether `tag` is one of the writes [`Pmr::sync_start`] sent.
    fn sync_owns(&self, _tag: lbio::Tag) -> bool {
        false
    }
    /// How many of those writes are out (after a [`Pmr::sync_start`] that failed part way,
    /// those that went out before the failure).
    fn sync_writes_out(&self) -> usize {
        0
    }
    /// One of those writes completed (its buffer is released here). A failed write's blocks are
    /// staged again, and the error returned.
    fn sync_done(&mut self, _c: lbio::Completion) -> Result<(), RioError> {
        Ok(())
    }
}

/// A boxed region (a target choosing its log kind at run time) is a region.
impl<P: Pmr + ?Sized> Pmr for Box<P> {
    fn len(&self) -> usize {
        (**self).len()
    }
    fn persist(&mut self, offset: usize, bytes: &[u8]) -> Result<(), RioError> {
        (**self).persist(offset, bytes)
    }
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), RioError> {
        (**self).read(offset, out)
    }
    fn prefetch(&self, offset: usize) {
        (**self).prefetch(offset)
    }
    fn deferred(&self) -> bool {
        (**self).deferred()
    }
    fn block_bytes(&self) -> usize {
        (**self).block_bytes()
    }
    fn sync(&mut self) -> Result<(), RioError> {
        (**self).sync()
    }
    fn persist_ordered(&mut self, offset: usize, bytes: &[u8]) -> Result<(), RioError> {
        (**self).persist_ordered(offset, bytes)
    }
    fn async_array(&self) -> Option<&std::rc::Rc<lbio::LbioArray>> {
        (**self).async_array()
    }
    fn sync_start(&mut self) -> Result<usize, RioError> {
        (**self).sync_start()
    }
    fn sync_owns(&self, tag: lbio::Tag) -> bool {
        (**self).sync_owns(tag)
    }
    fn sync_writes_out(&self) -> usize {
        (**self).sync_writes_out()
    }
    fn sync_done(&mut self, c: lbio::Completion) -> Result<(), RioError> {
        (**self).sync_done(c)
    }
}

/// Persistent memory **emulated in RAM**: what it holds survives exactly as long as the value
/// does. For simulation and tests, where the "crash" is simulated and the test keeps the value.
#[derive(Clone, Debug)]
pub struct MemPmr {
    bytes: Vec<u8>,
}

impl MemPmr {
    /// A zeroed region of `len` bytes.
    pub fn new(len: usize) -> MemPmr {
        MemPmr {
            bytes: vec![0; len],
        }
    }
    /// The raw contents (to damage them in tests, or to inspect).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.bytes
    }
}

impl Pmr for MemPmr {
    fn len(&self) -> usize {
        self.bytes.len()
    }
    fn persist(&mut self, offset: usize, bytes: &[u8]) -> Result<(), RioError> {
        let end = check_range(offset, bytes.len(), self.bytes.len())?;
        let to = &mut self.bytes[offset..end];
        match (
            <&mut [u8; ATTR_BYTES]>::try_from(&mut *to),
            <&[u8; ATTR_BYTES]>::try_from(bytes),
        ) {
            // An entry, one per ordered write: a fixed-size copy, no call.
            (Ok(to), Ok(entry)) => *to = *entry,
            _ => to.copy_from_slice(bytes),
        }
        Ok(())
    }
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), RioError> {
        let end = check_range(offset, out.len(), self.bytes.len())?;
        out.copy_from_slice(&self.bytes[offset..end]);
        Ok(())
    }
    #[inline]
    fn prefetch(&self, offset: usize) {
        if let Some(b) = self.bytes.get(offset) {
            aios_core::hint::prefetch(b);
        }
    }
}

pub(crate) fn check_range(offset: usize, len: usize, size: usize) -> Result<usize, RioError> {
    offset
        .checked_add(len)
        .filter(|&e| e <= size)
        .ok_or_else(|| {
            RioError::Config(format!(
                "persistent-memory access at {offset}+{len} past its {size} bytes"
            ))
        })
}

const LOG_MAGIC: u32 = u32::from_le_bytes(*b"RIO2");
/// The magic of the first format, whose persist words depended on the group number alone
/// (until 2026-11-27): such a log is refused, not misread.
const LOG_MAGIC_1: u32 = u32::from_le_bytes(*b"RIOL");
/// Header: magic, crc, epoch, slots, streams, where the slots start (in 64-byte units; 0 means
/// right after both copies), version, then `durable_below` per stream; padded to whole 64-byte
/// slots. Two copies, written in turn, so a torn header write leaves the other.
const HEADER_FIXED: usize = 24;

/// Streams one log serves at most.
pub const MAX_STREAMS: u16 = 64;

/// Bytes of one header copy (room for MAX_STREAMS marks), a whole number of slots.
const fn header_copy_bytes(_streams: usize) -> usize {
    (HEADER_FIXED + 8 * MAX_STREAMS as usize).div_ceil(ATTR_BYTES) * ATTR_BYTES
}

/// Bytes before the first slot: both header copies.
const fn header_bytes(streams: usize) -> usize {
    2 * header_copy_bytes(streams)
}

/// What a log header says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub epoch: u32,
    pub slots: u32,
    /// Bumped on every header write; the newer valid copy wins.
    pub version: u32,
    /// Per stream: every group below this is durable (recovery starts here).
    pub durable_below: Vec<u64>,
    /// Byte offset of slot 0 (after both header copies, rounded up to the region's block).
    pub slots_at: usize,
}

impl Header {
    fn encode(&self) -> Vec<u8> {
        let mut b = Vec::new();
        self.encode_into(&mut b);
        b
    }

    /// [`Self::encode`] into `b` (its allocation reused: the log rewrites its header while
    /// appending).
    fn encode_into(&self, b: &mut Vec<u8>) {
        b.clear();
        b.resize(header_copy_bytes(self.durable_below.len()), 0);
        b[0..4].copy_from_slice(&LOG_MAGIC.to_le_bytes());
        b[8..12].copy_from_slice(&self.epoch.to_le_bytes());
        b[12..16].copy_from_slice(&self.slots.to_le_bytes());
        b[16..18].copy_from_slice(&(self.durable_below.len() as u16).to_le_bytes());
        b[18..20].copy_from_slice(&((self.slots_at / ATTR_BYTES) as u16).to_le_bytes());
        b[20..24].copy_from_slice(&self.version.to_le_bytes());
        for (i, d) in self.durable_below.iter().enumerate() {
            b[HEADER_FIXED + 8 * i..HEADER_FIXED + 8 * i + 8].copy_from_slice(&d.to_le_bytes());
        }
        let crc = crc32c::crc32c(&b[8..]);
        b[4..8].copy_from_slice(&crc.to_le_bytes());
    }

    /// Read one header copy at `at`.
    fn read_copy(pmr: &dyn Pmr, at: usize) -> Result<Header, RioError> {
        let mut fixed = [0u8; HEADER_FIXED];
        if pmr.len() < at + HEADER_FIXED {
            return Err(RioError::Corrupt(format!(
                "a persistent region of {} bytes holds no log header",
                pmr.len()
            )));
        }
        pmr.read(at, &mut fixed)?;
        match u32::from_le_bytes(fixed[0..4].try_into().expect("4")) {
            LOG_MAGIC => {}
            LOG_MAGIC_1 => {
                return Err(RioError::Corrupt(
                    "an attribute log of the first format (persist words that name only the \
                     group; aios before 2026-11-27): recover with that build, or format it"
                        .into(),
                ))
            }
            _ => {
                return Err(RioError::Corrupt(
                    "no attribute log here (bad magic): format it first".into(),
                ))
            }
        }
        let streams = u16::from_le_bytes([fixed[16], fixed[17]]) as usize;
        if streams == 0 || streams > MAX_STREAMS as usize {
            return Err(RioError::Corrupt(format!(
                "log header claims {streams} streams"
            )));
        }
        let len = header_copy_bytes(streams);
        if header_bytes(streams) > pmr.len() {
            return Err(RioError::Corrupt(format!(
                "log header claims {streams} streams, more than the region holds"
            )));
        }
        let mut b = vec![0u8; len];
        pmr.read(at, &mut b)?;
        if crc32c::crc32c(&b[8..]) != u32::from_le_bytes(b[4..8].try_into().expect("4")) {
            return Err(RioError::Corrupt("log header checksum mismatch".into()));
        }
        let slots = u32::from_le_bytes(b[12..16].try_into().expect("4"));
        let slots_at = match u16::from_le_bytes([b[18], b[19]]) as usize * ATTR_BYTES {
            0 => header_bytes(streams),
            at if at < header_bytes(streams) => {
                return Err(RioError::Corrupt(format!(
                    "log header puts its slots at byte {at}, inside the header"
                )))
            }
            at => at,
        };
        if slots < 2 {
            return Err(RioError::Corrupt(format!(
                "log header claims {slots} slots; a log has at least 2"
            )));
        }
        if slots_at + slots as usize * ATTR_BYTES > pmr.len() {
            return Err(RioError::Corrupt(format!(
                "log header claims {slots} slots, more than the region holds"
            )));
        }
        let durable_below: Vec<u64> = (0..streams)
            .map(|i| {
                u64::from_le_bytes(
                    b[HEADER_FIXED + 8 * i..HEADER_FIXED + 8 * i + 8]
                        .try_into()
                        .expect("8"),
                )
            })
            .collect();
        if let Some((i, d)) = durable_below
            .iter()
            .enumerate()
            .find(|&(_, &d)| d > crate::attr::MAX_SEQ + 1)
        {
            return Err(RioError::Corrupt(format!(
                "log header marks stream {i} durable below group {d}, past the largest group"
            )));
        }
        Ok(Header {
            epoch: u32::from_le_bytes(b[8..12].try_into().expect("4")),
            slots,
            version: u32::from_le_bytes(b[20..24].try_into().expect("4")),
            durable_below,
            slots_at,
        })
    }

    /// Read the header of `pmr`: the newer of its two copies that checks out.
    pub fn read(pmr: &dyn Pmr) -> Result<Header, RioError> {
        let first = Self::read_copy(pmr, 0);
        let second = Self::read_copy(pmr, header_copy_bytes(0));
        match (first, second) {
            // Versions count header writes and wrap: the newer is the one less than half the
            // range ahead (the two copies are written in turn, one version apart).
            (Ok(a), Ok(b)) => Ok(if (b.version.wrapping_sub(a.version) as i32) > 0 {
                b
            } else {
                a
            }),
            (Ok(a), Err(_)) => Ok(a),
            (Err(_), Ok(b)) => Ok(b),
            (Err(e), Err(_)) => Err(e),
        }
    }

    /// Where the copy for `version` goes.
    fn copy_offset(&self) -> usize {
        (self.version % 2) as usize * header_copy_bytes(self.durable_below.len())
    }
}

/// A slot of the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot(pub u32);

/// Who holds a slot, packed in one word: `(seq_end + 1) << 6 | stream`, 0 for a free slot.
/// Every append reads its slot's word, round the whole log: at 8 bytes a slot instead of 24,
/// the table a 2 MiB log needs is 256 KiB, and the caches hold more of it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Used(u64);

const STREAM_BITS: u32 = 6;
const _: () = assert!(MAX_STREAMS as u64 <= 1 << STREAM_BITS);

impl Used {
    /// `None` past 2^58 − 2 groups (at ten million writes a second, about 900 years).
    fn new(stream: u16, seq_end: u64) -> Option<Used> {
        let s = seq_end.checked_add(1)?;
        (s < 1 << (64 - STREAM_BITS)).then_some(Used(s << STREAM_BITS | stream as u64))
    }

    fn get(self) -> Option<(u16, u64)> {
        (self.0 != 0).then(|| {
            (
                (self.0 & ((1 << STREAM_BITS) - 1)) as u16,
                (self.0 >> STREAM_BITS) - 1,
            )
        })
    }
}

/// The attribute log on a persistent region.
pub struct AttrLog<P: Pmr> {
    pmr: P,
    header: Header,
    /// Per slot: the (stream, last group) of the entry written there, while it may still matter
    /// to recovery (until the header's mark passes it).
    used: Vec<Used>,
    tail: u32,
    /// Per stream, in memory: every group below is durable.
    durable_below: Vec<u64>,
    header_writes: u64,
    /// The next header and its encoding, built in place when an append moves the header's
    /// marks (allocated once, so the write path allocates nothing).
    next_header: Header,
    encoded: Vec<u8>,
}

impl<P: Pmr> AttrLog<P> {
    /// Write an empty log for `streams` streams over the whole region.
    pub fn format(mut pmr: P, streams: u16) -> Result<AttrLog<P>, RioError> {
        if streams == 0 || streams > MAX_STREAMS {
            return Err(RioError::Config(format!(
                "a log serves 1..={MAX_STREAMS} streams, not {streams}"
            )));
        }
        let block = pmr.block_bytes().max(1);
        if block > u16::MAX as usize * ATTR_BYTES / 2 {
            return Err(RioError::Config(format!(
                "a region written in {block}-byte blocks: blocks above 1 MiB are not supported"
            )));
        }
        let hb = header_bytes(streams as usize).div_ceil(block) * block;
        let slots = pmr.len().saturating_sub(hb) / ATTR_BYTES;
        if slots < 2 {
            return Err(RioError::Config(format!(
                "a persistent region of {} bytes holds {slots} attribute slots for {streams} \
                 streams; it needs at least 2 (make it at least {} bytes)",
                pmr.len(),
                hb + 2 * ATTR_BYTES
            )));
        }
        // Zero the slots, then write the header.
        let zero = vec![0u8; slots * ATTR_BYTES];
        pmr.persist(hb, &zero)?;
        pmr.sync()?;
        let mut header = Header {
            epoch: 1,
            slots: slots as u32,
            version: 0,
            durable_below: vec![1; streams as usize],
            slots_at: hb,
        };
        pmr.persist_ordered(header.copy_offset(), &header.encode())?;
        header.version = 1;
        pmr.persist_ordered(header.copy_offset(), &header.encode())?;
        Ok(Self::with_header(pmr, header))
    }

    fn with_header(pmr: P, header: Header) -> AttrLog<P> {
        let durable_below = header.durable_below.clone();
        let mut encoded = Vec::new();
        header.encode_into(&mut encoded);
        AttrLog {
            next_header: header.clone(),
            encoded,
            used: vec![Used::default(); header.slots as usize],
            pmr,
            tail: 0,
            header_writes: 0,
            durable_below,
            header,
        }
    }

    /// Reopen after recovery: `durable_below` per stream is where each stream resumes (the end
    /// of its recovered prefix). Starts a new epoch, so every entry now in the log is stale.
    pub fn reopen(mut pmr: P, durable_below: &[u64]) -> Result<AttrLog<P>, RioError> {
        let old = Header::read(&pmr)?;
        if durable_below.len() != old.durable_below.len() {
            return Err(RioError::Config(format!(
                "the log has {} streams, {} marks given",
                old.durable_below.len(),
                durable_below.len()
            )));
        }
        let header = Header {
            epoch: old.epoch.wrapping_add(1).max(1),
            slots: old.slots,
            version: old.version.wrapping_add(1),
            durable_below: durable_below.to_vec(),
            slots_at: old.slots_at,
        };
        pmr.persist_ordered(header.copy_offset(), &header.encode())?;
        Ok(Self::with_header(pmr, header))
    }

    /// Streams the log serves.
    pub fn streams(&self) -> u16 {
        self.header.durable_below.len() as u16
    }
    /// Per stream, the group below which the log's header (as last written) vouches that
    /// everything is durable: where recovery starts each stream.
    pub fn header_marks(&self) -> &[u64] {
        &self.header.durable_below
    }
    /// Attribute slots.
    pub fn slots(&self) -> u32 {
        self.header.slots
    }
    /// The current epoch (stamped on new entries).
    pub fn epoch(&self) -> u32 {
        self.header.epoch
    }
    /// Entries not yet released: slots whose groups are not all durable yet (a walk over the
    /// slot table; for inspection, not for the write path).
    pub fn live(&self) -> u32 {
        self.used
            .iter()
            .filter_map(|u| u.get())
            .filter(|&(stream, seq)| seq >= self.durable_below[stream as usize])
            .count() as u32
    }
    /// Header rewrites so far (one per lap at most).
    pub fn header_writes(&self) -> u64 {
        self.header_writes
    }
    /// The region.
    pub fn pmr(&self) -> &P {
        &self.pmr
    }
    /// Give the region back (to reopen it after recovery).
    pub fn into_pmr(self) -> P {
        self.pmr
    }
    /// The region, mutably (tests damage it).
    pub fn pmr_mut(&mut self) -> &mut P {
        &mut self.pmr
    }

    fn slot_offset(&self, s: u32) -> usize {
        self.header.slots_at + s as usize * ATTR_BYTES
    }

    /// Whether appends and persist words wait for [`AttrLog::sync`] to become durable (a
    /// block-backed region): the caller syncs before submitting the data of appended entries.
    pub fn deferred(&self) -> bool {
        self.pmr.deferred()
    }

    /// Make every append and persist word so far durable (a no-op on persistent memory).
    pub fn sync(&mut self) -> Result<(), RioError> {
        self.pmr.sync()
    }

    /// The region's lbio array when it can sync without blocking ([`Pmr::async_array`]).
    pub fn async_array(&self) -> Option<&std::rc::Rc<lbio::LbioArray>> {
        self.pmr.async_array()
    }

    /// [`Pmr::sync_start`].
    pub fn sync_start(&mut self) -> Result<usize, RioError> {
        self.pmr.sync_start()
    }

    /// [`Pmr::sync_owns`].
    pub fn sync_owns(&self, tag: lbio::Tag) -> bool {
        self.pmr.sync_owns(tag)
    }

    /// [`Pmr::sync_writes_out`].
    pub fn sync_writes_out(&self) -> usize {
        self.pmr.sync_writes_out()
    }

    /// [`Pmr::sync_done`].
    pub fn sync_done(&mut self, c: lbio::Completion) -> Result<(), RioError> {
        self.pmr.sync_done(c)
    }

    /// Persist `attr` (stamped with this epoch, persist word clear) in the next slot. A full log
    /// refuses with [`RioError::LogFull`]: the caller waits for durability to free slots.
    pub fn append(&mut self, attr: &Attr) -> Result<Slot, RioError> {
        if attr.stream >= self.streams() {
            return Err(RioError::Config(format!(
                "stream {} on a log of {} streams",
                attr.stream,
                self.streams()
            )));
        }
        let used = Used::new(attr.stream, attr.seq_end).ok_or_else(|| {
            RioError::Config(format!(
                "group {} of stream {}: past the log's 2^58 groups",
                attr.seq_end, attr.stream
            ))
        })?;
        let s = self.tail;
        let reused = self.used[s as usize].get();
        if let Some((stream, seq)) = reused {
            if seq >= self.durable_below[stream as usize] {
                return Err(RioError::LogFull {
                    slots: self.header.slots,
                });
            }
            if seq >= self.header.durable_below[stream as usize] {
                // Recovery would still read this entry as live: move the marks first. The
                // header in memory is what the media holds, so it changes only once the new
                // copy is written: after a failed write the slot stays untouched, and the next
                // append tries the header again.
                let next = &mut self.next_header;
                next.epoch = self.header.epoch;
                next.slots = self.header.slots;
                next.slots_at = self.header.slots_at;
                next.version = self.header.version.wrapping_add(1);
                next.durable_below.clone_from(&self.durable_below);
                next.encode_into(&mut self.encoded);
                self.pmr
                    .persist_ordered(next.copy_offset(), &self.encoded)?;
                std::mem::swap(&mut self.header, &mut self.next_header);
                self.header_writes += 1;
            }
        }
        let off = self.slot_offset(s);
        self.pmr
            .persist(off, &attr.entry_bytes(self.header.epoch, false))?;
        Ok(self.took(s, used))
    }

    /// [`AttrLog::append`] when nothing stands in the way: the slot is free or holds a durable
    /// group the header already counts as such. `Ok(None)`, with nothing changed, otherwise
    /// (the caller then calls `append`, which moves the header's marks first or says why it
    /// cannot). The entry's write failing is `append`'s error, as `append` reports it. The
    /// ordered device tries this first on every write: the result is small enough to come back
    /// in registers.
    #[inline]
    pub(crate) fn append_quick(&mut self, attr: &Attr) -> Result<Option<Slot>, Box<RioError>> {
        if attr.stream >= self.streams() {
            return Ok(None);
        }
        let Some(used) = Used::new(attr.stream, attr.seq_end) else {
            return Ok(None);
        };
        let s = self.tail;
        let reused = self.used[s as usize].get();
        if let Some((stream, seq)) = reused {
            if seq >= self.header.durable_below[stream as usize] {
                return Ok(None);
            }
        }
        let off = self.slot_offset(s);
        self.pmr
            .persist(off, &attr.entry_bytes(self.header.epoch, false))
            .map_err(Box::new)?;
        Ok(Some(self.took(s, used)))
    }

    /// Slot `s` now holds an entry of `used`: the tail moves on.
    #[inline]
    fn took(&mut self, s: u32, used: Used) -> Slot {
        self.used[s as usize] = used;
        // (A compare, not a division: one append per ordered write.)
        let next = if s + 1 == self.header.slots { 0 } else { s + 1 };
        self.tail = next;
        // The next append reads that slot's use and writes its entry: long after this one (a
        // device submission and a completion in between, which push both lines out of the
        // nearer caches) and one line further each time, so they are fetched now.
        aios_core::hint::prefetch(&self.used[next as usize]);
        self.pmr.prefetch(self.slot_offset(next));
        Slot(s)
    }

    /// The data of the entry in `slot` (group `seq`, appended in this epoch) is durable: set its
    /// persist word.
    pub fn set_persist(&mut self, slot: Slot, seq: u64) -> Result<(), RioError> {
        let held = self
            .used
            .get(slot.0 as usize)
            .and_then(|u| u.get())
            .filter(|&(_, seq_end)| seq <= seq_end);
        let Some((stream, _)) = held else {
            return Err(RioError::Config(format!(
                "slot {} holds no entry of group {seq}",
                slot.0
            )));
        };
        let off = self.slot_offset(slot.0) + 60;
        let word = Attr::persisted_word(stream, self.header.epoch, seq);
        self.pmr.persist(off, &word.to_le_bytes())
    }

    /// Every group of `stream` below `below` is durable: their slots may be reused.
    pub fn durable(&mut self, stream: u16, below: u64) {
        let d = &mut self.durable_below[stream as usize];
        *d = (*d).max(below);
    }

    #[doc(hidden)]
    pub fn debug_tail(&self) -> (u32, Option<(u16, u64)>, Vec<u64>) {
        (
            self.tail,
            self.used[self.tail as usize].get(),
            self.durable_below.clone(),
        )
    }

    /// Whether the next append would find a free slot.
    pub fn has_room(&self) -> bool {
        match self.used[self.tail as usize].get() {
            Some((stream, seq)) => seq < self.durable_below[stream as usize],
            None => true,
        }
    }
}

/// Everything in a log region: its header, the entries of its epoch, and damaged slots.
#[derive(Clone, Debug)]
pub struct LogScan {
    pub header: Header,
    pub entries: Vec<(Slot, Attr)>,
    /// Slots holding a damaged entry (skipped; reported).
    pub damaged: Vec<(Slot, String)>,
    /// Entries of earlier epochs (stale; ignored).
    pub stale: usize,
}

impl LogScan {
    /// Several logs read as one: a stream that moved between ordered devices (threads, each
    /// with its own log; see [`crate::OrderedDevice::detach`]) has entries in each. Entries of
    /// every log's current epoch are kept; per stream, the highest durability mark wins (a
    /// device marks a stream durable only up to what it knows to be durable). The merged
    /// header's epoch, version and slot position are the first log's; its slots the sum.
    pub fn merge(scans: &[LogScan]) -> Result<LogScan, RioError> {
        let first = scans
            .first()
            .ok_or_else(|| RioError::Config("no logs to merge".into()))?;
        let streams = first.header.durable_below.len();
        let mut out = first.clone();
        for sc in &scans[1..] {
            if sc.header.durable_below.len() != streams {
                return Err(RioError::Config(format!(
                    "logs of {streams} and {} streams cannot be merged",
                    sc.header.durable_below.len()
                )));
            }
            for (m, &d) in out
                .header
                .durable_below
                .iter_mut()
                .zip(&sc.header.durable_below)
            {
                *m = (*m).max(d);
            }
            out.header.slots += sc.header.slots;
            out.entries.extend(sc.entries.iter().cloned());
            out.damaged.extend(sc.damaged.iter().cloned());
            out.stale += sc.stale;
        }
        Ok(out)
    }
}

/// Read every slot of the log on `pmr`.
pub fn scan(pmr: &dyn Pmr) -> Result<LogScan, RioError> {
    let header = Header::read(pmr)?;
    let hb = header.slots_at;
    let mut entries = Vec::new();
    let mut damaged = Vec::new();
    let mut stale = 0;
    let mut b = [0u8; ATTR_BYTES];
    for s in 0..header.slots {
        pmr.read(hb + s as usize * ATTR_BYTES, &mut b)?;
        match Attr::decode(&b) {
            Ok(None) => {}
            Ok(Some(a)) if a.epoch != header.epoch => stale += 1,
            Ok(Some(a)) if a.stream as usize >= header.durable_below.len() => {
                damaged.push((Slot(s), format!("stream {} out of range", a.stream)))
            }
            Ok(Some(a)) => entries.push((Slot(s), a)),
            Err(e) => damaged.push((Slot(s), e.to_string())),
        }
    }
    Ok(LogScan {
        header,
        entries,
        damaged,
        stale,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recover;

    /// A header that checks out but claims fewer than two slots (a log needs two) is refused
    /// as corrupt. With zero, `reopen` took it and the next `append` indexed an empty slot
    /// table: a panic.
    #[test]
    fn a_header_claiming_too_few_slots_is_corrupt() {
        for slots in [0u32, 1] {
            let log = AttrLog::format(MemPmr::new(64 << 10), 1).unwrap();
            let mut pmr = log.into_pmr();
            for copy in 0..2 {
                let at = copy * header_copy_bytes(1);
                let b = &mut pmr.bytes_mut()[at..at + header_copy_bytes(1)];
                b[12..16].copy_from_slice(&slots.to_le_bytes());
                let crc = crc32c::crc32c(&b[8..]);
                b[4..8].copy_from_slice(&crc.to_le_bytes());
            }
            let e = AttrLog::reopen(pmr, &[1])
                .err()
                .unwrap_or_else(|| panic!("a header of {slots} slots was taken"));
            assert!(matches!(e, RioError::Corrupt(_)), "{e}");
        }
    }

    #[test]
    fn a_slot_word_gives_back_what_was_packed_and_refuses_what_does_not_fit() {
        assert_eq!(Used::default().get(), None);
        for (stream, seq) in [
            (0, 0),
            (0, 1),
            (63, 1),
            (5, 123_456_789),
            (63, (1 << 58) - 2),
        ] {
            assert_eq!(
                Used::new(stream, seq).and_then(Used::get),
                Some((stream, seq))
            );
        }
        assert_eq!(Used::new(0, (1 << 58) - 1), None);
        assert_eq!(Used::new(3, u64::MAX), None);
    }

    fn attr(stream: u16, seq: u64) -> Attr {
        Attr {
            stream,
            seq,
            seq_end: seq,
            offset: seq * 4096,
            len: 4096,
            boundary: true,
            num: 1,
            members: 1,
            ..Attr::default()
        }
    }

    #[test]
    fn a_region_too_small_is_refused_with_the_size_needed() {
        let e = AttrLog::format(MemPmr::new(1200), 1).err().unwrap();
        assert!(e.to_string().contains("at least"), "{e}");
        assert!(AttrLog::format(MemPmr::new(64 << 10), 0).is_err());
        assert!(AttrLog::format(MemPmr::new(64 << 10), MAX_STREAMS + 1).is_err());
    }

    #[test]
    fn a_full_log_pushes_back_instead_of_overwriting() {
        let region = header_bytes(1) + 4 * ATTR_BYTES;
        let mut log = AttrLog::format(MemPmr::new(region), 1).unwrap();
        for seq in 1..=4 {
            log.append(&attr(0, seq)).unwrap();
        }
        assert!(!log.has_room());
        assert!(matches!(
            log.append(&attr(0, 5)),
            Err(RioError::LogFull { slots: 4 })
        ));
        // Nothing was overwritten: all four entries are still there.
        assert_eq!(scan(log.pmr()).unwrap().entries.len(), 4);
        // Groups 1 and 2 durable: two slots free, and the header mark moves before reuse.
        log.durable(0, 3);
        log.append(&attr(0, 5)).unwrap();
        log.append(&attr(0, 6)).unwrap();
        assert!(log.append(&attr(0, 7)).is_err());
        assert_eq!(log.header_writes(), 1);
        assert_eq!(Header::read(log.pmr()).unwrap().durable_below, vec![3]);
    }

    #[test]
    fn live_counts_the_entries_not_yet_released() {
        let region = header_bytes(1) + 4 * ATTR_BYTES;
        let mut log = AttrLog::format(MemPmr::new(region), 1).unwrap();
        for seq in 1..=3 {
            log.append(&attr(0, seq)).unwrap();
        }
        assert_eq!(log.live(), 3);
        // Groups 1 and 2 durable: their slots are released (it used to stay at 3, and at the
        // slot count for good once the log had come round).
        log.durable(0, 3);
        assert_eq!(log.live(), 1);
        log.durable(0, 4);
        assert_eq!(log.live(), 0);
        for seq in 4..=6 {
            log.append(&attr(0, seq)).unwrap();
        }
        assert_eq!(log.live(), 3);
    }

    #[test]
    fn a_damaged_entry_is_skipped_and_reported_and_recovery_stops_before_it() {
        let mut log = AttrLog::format(MemPmr::new(64 << 10), 1).unwrap();
        for seq in 1..=4 {
            let s = log.append(&attr(0, seq)).unwrap();
            log.set_persist(s, seq).unwrap();
        }
        // Damage group 3's entry (slot 2).
        let off = header_bytes(1) + 2 * ATTR_BYTES + 20;
        log.pmr_mut().bytes_mut()[off] ^= 0xff;
        let sc = scan(log.pmr()).unwrap();
        assert_eq!(sc.damaged.len(), 1);
        assert_eq!(sc.damaged[0].0, Slot(2));
        let r = recover(&sc, &|_| true);
        assert_eq!(r.damaged.len(), 1);
        let s = &r.streams[0];
        assert_eq!(s.prefix_end, 3, "groups 1 and 2 survive");
        assert_eq!(s.beyond.iter().map(|a| a.seq).collect::<Vec<_>>(), vec![4]);
        assert!(s.stopped_by.as_deref().unwrap().contains("group 3"));
    }

    #[test]
    fn a_torn_header_leaves_the_other_copy() {
        let mut log = AttrLog::format(MemPmr::new(64 << 10), 2).unwrap();
        let v = Header::read(log.pmr()).unwrap().version;
        // Damage the newer copy: the older one is read.
        let at = (v % 2) as usize * header_copy_bytes(2) + 30;
        log.pmr_mut().bytes_mut()[at] ^= 1;
        let h = Header::read(log.pmr()).unwrap();
        assert_eq!(h.version, v - 1);
        assert_eq!(h.durable_below, vec![1, 1]);
        // Both damaged: a typed error.
        let other = ((v - 1) % 2) as usize * header_copy_bytes(2) + 30;
        log.pmr_mut().bytes_mut()[other] ^= 1;
        assert!(matches!(Header::read(log.pmr()), Err(RioError::Corrupt(_))));
    }

    #[test]
    fn reopening_starts_a_new_epoch() {
        let mut log = AttrLog::format(MemPmr::new(64 << 10), 1).unwrap();
        log.append(&attr(0, 1)).unwrap();
        let pmr = log.pmr().clone();
        let log = AttrLog::reopen(pmr, &[1]).unwrap();
        let sc = scan(log.pmr()).unwrap();
        assert!(sc.entries.is_empty());
        assert_eq!(sc.stale, 1);
        assert_eq!(log.epoch(), 2);
    }
}
