//! The registered buffer arena: one mapping, allocated and registered with io_uring once at
//! start, carved into fixed-size frames that a per-engine free map hands out.
//!
//! The whole arena is registered as a single fixed buffer (index 0), so any frame can be used by
//! `ReadFixed`/`WriteFixed` without per-I/O page pinning. Frames are tracked in a bitmap (one bit
//! per frame, set = in use) scanned from a rotating cursor: single-frame allocations — the common
//! case — find a free bit in the first non-full word, and runs of frames for larger buffers are
//! found without any heap allocation.

use std::cell::{Cell, RefCell};
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::rc::Rc;

use crate::error::CoreError;

/// How the arena's memory is backed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backing {
    /// Explicit huge pages (`MAP_HUGETLB`, 2 MiB).
    HugeTlb,
    /// Ordinary pages with `MADV_HUGEPAGE`: the kernel may back them with transparent huge pages.
    TransparentHuge,
    /// Ordinary 4 KiB pages (huge pages were not asked for).
    Pages,
}

impl fmt::Display for Backing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backing::HugeTlb => "hugetlb 2 MiB pages",
            Backing::TransparentHuge => {
                "4 KiB pages with MADV_HUGEPAGE (no hugetlb pages reserved)"
            }
            Backing::Pages => "4 KiB pages",
        })
    }
}

const HUGE_PAGE_BYTES: usize = 2 << 20;

struct FreeMap {
    /// One bit per frame; 1 = in use. Bits past `frames` in the last word are kept set.
    words: Box<[u64]>,
    /// Word index where the next search starts.
    cursor: usize,
    free_frames: u32,
}

impl FreeMap {
    fn new(frames: u32) -> Self {
        let n = (frames as usize).div_ceil(64);
        let mut words = vec![0u64; n].into_boxed_slice();
        let tail = frames as usize % 64;
        if tail != 0 {
            words[n - 1] = !0u64 << tail;
        }
        FreeMap {
            words,
            cursor: 0,
            free_frames: frames,
        }
    }

    fn take_one(&mut self) -> Option<u32> {
        let n = self.words.len();
        for i in 0..n {
            let w = (self.cursor + i) % n;
            let word = self.words[w];
            if word != !0 {
                let bit = (!word).trailing_zeros();
                self.words[w] |= 1 << bit;
                self.cursor = w;
                self.free_frames -= 1;
                return Some((w * 64) as u32 + bit);
            }
        }
        None
    }

    fn is_free(&self, frame: usize) -> bool {
        self.words[frame / 64] & (1 << (frame % 64)) == 0
    }

    fn take_run(&mut self, count: u32, frames: u32) -> Option<u32> {
        let count = count as usize;
        let total = frames as usize;
        if count > total {
            return None;
        }
        // Scan from the cursor, wrapping once; runs never wrap around the end of the arena.
        let start_at = (self.cursor * 64).min(total);
        let mut scanned = 0usize;
        let mut first = start_at;
        while scanned < total {
            if first + count > total {
                scanned += total - first;
                first = 0;
                continue;
            }
            match (first..first + count).find(|&f| !self.is_free(f)) {
                None => {
                    for f in first..first + count {
                        self.words[f / 64] |= 1 << (f % 64);
                    }
                    self.cursor = (first + count) / 64 % self.words.len();
                    self.free_frames -= count as u32;
                    return Some(first as u32);
                }
                Some(used) => {
                    scanned += used + 1 - first;
                    first = used + 1;
                }
            }
        }
        None
    }

    fn give_back(&mut self, first: u32, count: u32) {
        for f in first as usize..(first + count) as usize {
            debug_assert!(!self.is_free(f), "frame {f} freed twice");
            self.words[f / 64] &= !(1 << (f % 64));
        }
        self.free_frames += count;
    }
}

/// Map `bytes` of anonymous memory, trying explicit huge pages first when `huge_pages` is set,
/// and touch every page so the hot path never takes a first-touch fault.
fn map_memory(bytes: usize, huge_pages: bool) -> Result<(NonNull<u8>, Backing), CoreError> {
    let mut backing = Backing::Pages;
    let mut ptr = libc::MAP_FAILED;
    if huge_pages {
        let huge_len = bytes.div_ceil(HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES;
        // SAFETY: anonymous private mapping with no address hint; the result is checked.
        ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                huge_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if ptr != libc::MAP_FAILED {
            backing = Backing::HugeTlb;
        }
    }
    if ptr == libc::MAP_FAILED {
        // Transparent huge pages back only the 2 MiB-aligned parts of a mapping: when asked for
        // huge pages, map 2 MiB more and trim it so the start is aligned (a mapping that starts
        // mid-way through a huge page would otherwise be left with 4 KiB pages in each partial
        // 2 MiB at its ends, and where it lands is up to the kernel).
        let pad = if huge_pages && bytes >= HUGE_PAGE_BYTES {
            HUGE_PAGE_BYTES
        } else {
            0
        };
        // SAFETY: anonymous private mapping with no address hint; the result is checked.
        ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes + pad,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(CoreError::ArenaMap {
                bytes,
                source: std::io::Error::last_os_error(),
            });
        }
        if pad > 0 {
            let start = ptr as usize;
            let head = start.next_multiple_of(HUGE_PAGE_BYTES) - start;
            // SAFETY: both ranges lie inside the mapping just made (`head <= pad`, and the tail
            // is what is left of the `bytes + pad` after the aligned `bytes`); unmapping them
            // leaves exactly `bytes` mapped from the aligned start.
            unsafe {
                if head > 0 {
                    libc::munmap(ptr, head);
                }
                if pad - head > 0 {
                    libc::munmap((start + head + bytes) as *mut libc::c_void, pad - head);
                }
            }
            ptr = (start + head) as *mut libc::c_void;
        }
        if huge_pages {
            // SAFETY: advice on the mapping just created, of exactly its length.
            unsafe { libc::madvise(ptr, bytes, libc::MADV_HUGEPAGE) };
            backing = Backing::TransparentHuge;
        }
        // SAFETY: the mapping is `bytes` long and writable.
        unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0, bytes) };
    }
    // SAFETY: mmap succeeded, so `ptr` is non-null.
    Ok((unsafe { NonNull::new_unchecked(ptr.cast()) }, backing))
}

/// Undo [`map_memory`].
///
/// # Safety
/// `base`, `bytes` and `backing` must come from one `map_memory` call, and nothing may use the
/// memory afterwards.
unsafe fn unmap_memory(base: NonNull<u8>, bytes: usize, backing: Backing) {
    let len = if backing == Backing::HugeTlb {
        bytes.div_ceil(HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    } else {
        bytes
    };
    // SAFETY: the caller's contract.
    unsafe { libc::munmap(base.as_ptr().cast(), len) };
}

/// Memory shared by several engines (and threads): mapped once, registered as a fixed buffer
/// with each engine that does I/O into it ([`Engine::register_region`](crate::Engine::register_region)).
/// A page cache keeps its frames here, so any core can read a frame another core's I/O filled.
///
/// The region only owns the mapping; who may touch which bytes when is the owner's protocol.
pub struct SharedRegion {
    base: NonNull<u8>,
    bytes: usize,
    backing: Backing,
}

// SAFETY: the region is plain memory; it hands out only raw pointers, and every access through
// them is the caller's (unsafe) responsibility.
unsafe impl Send for SharedRegion {}
// SAFETY: as above.
unsafe impl Sync for SharedRegion {}

impl SharedRegion {
    /// Map `bytes` (rounded up to a whole 4 KiB page), huge pages first when asked.
    pub fn map(bytes: usize, huge_pages: bool) -> Result<SharedRegion, CoreError> {
        if bytes == 0 || bytes > 1 << 40 {
            return Err(CoreError::Config(format!(
                "shared region of {bytes} bytes: need 1 byte to 1 TiB"
            )));
        }
        let bytes = bytes.div_ceil(4096) * 4096;
        let (base, backing) = map_memory(bytes, huge_pages)?;
        Ok(SharedRegion {
            base,
            bytes,
            backing,
        })
    }
    /// Start of the mapping.
    pub fn as_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }
    /// Length in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    /// How the memory is backed.
    pub fn backing(&self) -> Backing {
        self.backing
    }
    pub(crate) fn iovec(&self) -> libc::iovec {
        libc::iovec {
            iov_base: self.base.as_ptr().cast(),
            iov_len: self.bytes,
        }
    }
}

impl Drop for SharedRegion {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`; engines that registered it hold an `Arc` to it, so
        // the last owner is gone.
        unsafe { unmap_memory(self.base, self.bytes, self.backing) };
    }
}

impl fmt::Debug for SharedRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedRegion")
            .field("bytes", &self.bytes)
            .field("backing", &self.backing)
            .finish()
    }
}

/// Anonymous memory mapped the way an arena or a [`SharedRegion`] is (huge pages first when
/// asked), owned by one value and used as a plain byte slice. For memory that should sit on the
/// same kind of pages as a page cache's frames without being registered: a benchmark's copy
/// baseline, for one, whose figures would otherwise carry TLB misses the frames do not pay.
pub struct MappedBytes {
    region: SharedRegion,
    len: usize,
}

impl MappedBytes {
    /// `len` bytes (1 byte to 1 TiB), every one `fill`: written here, so every page is mapped
    /// before the first timed access. With `huge_pages`, less than a huge page is mapped as a
    /// whole one (aligned), so that it can sit on one as a larger arena's frames do.
    pub fn new(len: usize, fill: u8, huge_pages: bool) -> Result<MappedBytes, CoreError> {
        if len == 0 {
            return Err(CoreError::Config(
                "mapped bytes of length 0: need at least 1".into(),
            ));
        }
        let map_len = if huge_pages {
            len.max(HUGE_PAGE_BYTES)
        } else {
            len
        };
        let region = SharedRegion::map(map_len, huge_pages)?;
        let mut m = MappedBytes { region, len };
        m.fill(fill);
        Ok(m)
    }
    /// How the memory is backed.
    pub fn backing(&self) -> Backing {
        self.region.backing()
    }
}

impl Deref for MappedBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the mapping holds at least `len` readable bytes, and only this value (which
        // owns it) hands out references to them, borrowed from it.
        unsafe { std::slice::from_raw_parts(self.region.as_ptr(), self.len) }
    }
}

impl DerefMut for MappedBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes this reference the only one.
        unsafe { std::slice::from_raw_parts_mut(self.region.as_ptr(), self.len) }
    }
}

impl fmt::Debug for MappedBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MappedBytes")
            .field("len", &self.len)
            .field("backing", &self.region.backing())
            .finish()
    }
}

/// The engine's registered memory, carved into frames.
pub struct Arena {
    base: NonNull<u8>,
    bytes: usize,
    frame_bytes: usize,
    frames: u32,
    backing: Backing,
    free: RefCell<FreeMap>,
    exhausted: Cell<u64>,
}

impl Arena {
    /// Map `bytes` (rounded up to whole frames) of memory. Huge pages are tried first when
    /// `huge_pages` is set. The memory is not registered here: the engine does that.
    pub(crate) fn map(
        bytes: usize,
        frame_bytes: usize,
        huge_pages: bool,
    ) -> Result<Arena, CoreError> {
        if !frame_bytes.is_power_of_two() || frame_bytes < 512 {
            return Err(CoreError::Config(format!(
                "frame_bytes {frame_bytes} must be a power of two of at least 512"
            )));
        }
        let frames = bytes.div_ceil(frame_bytes);
        if frames == 0 || frames > u32::MAX as usize {
            return Err(CoreError::Config(format!(
                "arena_bytes {bytes} gives {frames} frames of {frame_bytes} bytes; need 1..=2^32-1"
            )));
        }
        let bytes = frames * frame_bytes;
        let (base, backing) = map_memory(bytes, huge_pages)?;
        Ok(Arena {
            base,
            bytes,
            frame_bytes,
            frames: frames as u32,
            backing,
            free: RefCell::new(FreeMap::new(frames as u32)),
            exhausted: Cell::new(0),
        })
    }

    /// The iovec to register with io_uring: the whole arena as fixed buffer 0.
    pub(crate) fn iovec(&self) -> libc::iovec {
        libc::iovec {
            iov_base: self.base.as_ptr().cast(),
            iov_len: self.bytes,
        }
    }

    /// Start of the arena's memory, for registering it with another subsystem too (an RDMA
    /// memory region). It stays mapped as long as the arena.
    pub fn base_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Total bytes in the arena.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    /// Bytes per frame.
    pub fn frame_bytes(&self) -> usize {
        self.frame_bytes
    }
    /// Number of frames.
    pub fn frames(&self) -> u32 {
        self.frames
    }
    /// Frames not handed out now.
    pub fn free_frames(&self) -> u32 {
        self.free.borrow().free_frames
    }
    /// How the memory is backed (huge pages or not).
    pub fn backing(&self) -> Backing {
        self.backing
    }
    /// How many allocations found the arena exhausted (back-pressure events).
    pub fn exhausted_count(&self) -> u64 {
        self.exhausted.get()
    }

    /// Allocate a buffer of `len` bytes (whole frames, contiguous). `None` when the arena has no
    /// run of free frames that long: back-pressure, counted in [`Arena::exhausted_count`].
    pub fn try_alloc(self: &Rc<Self>, len: usize) -> Option<FixedBuf> {
        let b = self.try_alloc_run(len);
        if b.is_none() {
            self.exhausted.set(self.exhausted.get() + 1);
        }
        b
    }

    /// [`Arena::try_alloc`] for a caller that falls back to a shorter buffer when this one does
    /// not fit: a miss is not counted as exhaustion.
    pub fn try_alloc_run(self: &Rc<Self>, len: usize) -> Option<FixedBuf> {
        let count = len.max(1).div_ceil(self.frame_bytes);
        if count > self.frames as usize {
            return None;
        }
        let first = {
            let mut free = self.free.borrow_mut();
            if count == 1 {
                free.take_one()
            } else {
                free.take_run(count as u32, self.frames)
            }
        };
        first.map(|first| FixedBuf {
            arena: Rc::clone(self),
            first,
            frames: count as u32,
            start: 0,
            len,
        })
    }

    fn frame_ptr(&self, frame: u32) -> *mut u8 {
        // SAFETY: callers only pass frames below `self.frames`, so the offset stays in the mapping.
        unsafe { self.base.as_ptr().add(frame as usize * self.frame_bytes) }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping created in `map`; no FixedBuf outlives the arena
        // because each holds an `Rc<Arena>`.
        unsafe { unmap_memory(self.base, self.bytes, self.backing) };
    }
}

impl fmt::Debug for Arena {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Arena")
            .field("bytes", &self.bytes)
            .field("frame_bytes", &self.frame_bytes)
            .field("frames", &self.frames)
            .field("free_frames", &self.free_frames())
            .field("backing", &self.backing)
            .finish()
    }
}

/// A buffer of one or more contiguous frames of the registered arena.
///
/// It owns its frames and gives them back when dropped. The I/O range is `start..start + len`
/// within the buffer's capacity; [`FixedBuf::set_range`] moves it (e.g. to hand a sub-range to a
/// device). While a request is in flight the buffer is owned by that request, so nobody else can
/// touch the memory the kernel is using.
pub struct FixedBuf {
    arena: Rc<Arena>,
    first: u32,
    frames: u32,
    start: usize,
    len: usize,
}

impl FixedBuf {
    /// Capacity in bytes (whole frames).
    pub fn capacity(&self) -> usize {
        self.frames as usize * self.arena.frame_bytes
    }
    /// Length of the I/O range.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the I/O range is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Start of the I/O range within the buffer.
    pub fn start(&self) -> usize {
        self.start
    }
    /// Set the I/O range to `start..start + len`; fails when it does not fit the capacity.
    pub fn set_range(&mut self, start: usize, len: usize) -> Result<(), CoreError> {
        match start.checked_add(len) {
            Some(end) if end <= self.capacity() => {
                self.start = start;
                self.len = len;
                Ok(())
            }
            _ => Err(CoreError::BufferRange {
                start,
                len,
                capacity: self.capacity(),
            }),
        }
    }
    /// Set the I/O range to `0..len`; fails when `len` exceeds the capacity.
    pub fn set_len(&mut self, len: usize) -> Result<(), CoreError> {
        self.set_range(0, len)
    }
    /// Index of the registered buffer this memory belongs to (for `ReadFixed`/`WriteFixed`).
    pub fn buf_index(&self) -> u16 {
        0
    }
    /// Pointer to the start of the I/O range.
    pub fn as_ptr(&self) -> *const u8 {
        // SAFETY: `start <= capacity` is kept by `set_range`, so this stays inside our frames.
        unsafe { self.arena.frame_ptr(self.first).add(self.start) }
    }
    /// Mutable pointer to the start of the I/O range.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        // SAFETY: as in `as_ptr`; `&mut self` gives unique access.
        unsafe { self.arena.frame_ptr(self.first).add(self.start) }
    }
    /// The arena this buffer came from.
    pub fn arena(&self) -> &Rc<Arena> {
        &self.arena
    }
}

impl Deref for FixedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the range lies inside frames this buffer owns exclusively; the mapping lives as
        // long as the `Rc<Arena>` we hold.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len) }
    }
}

impl DerefMut for FixedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        // SAFETY: as in `deref`, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.as_mut_ptr(), len) }
    }
}

impl Drop for FixedBuf {
    fn drop(&mut self) {
        self.arena
            .free
            .borrow_mut()
            .give_back(self.first, self.frames);
    }
}

impl fmt::Debug for FixedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FixedBuf")
            .field("first_frame", &self.first)
            .field("frames", &self.frames)
            .field("start", &self.start)
            .field("len", &self.len)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arena(frames: usize) -> Rc<Arena> {
        Rc::new(Arena::map(frames * 4096, 4096, false).unwrap())
    }

    #[test]
    fn a_region_asking_for_huge_pages_starts_on_a_huge_page_and_is_all_usable() {
        for bytes in [HUGE_PAGE_BYTES, 3 * HUGE_PAGE_BYTES + 4096, 6 << 20] {
            let r = SharedRegion::map(bytes, true).unwrap();
            // Explicit huge pages are aligned by the kernel; the THP mapping by the trim.
            assert_eq!(
                r.as_ptr() as usize % HUGE_PAGE_BYTES,
                0,
                "{:?}",
                r.backing()
            );
            // SAFETY: the region is `bytes` long and writable, and nothing else uses it.
            let all = unsafe { std::slice::from_raw_parts_mut(r.as_ptr(), r.bytes()) };
            all.fill(0x5a);
            assert!(all.iter().all(|&b| b == 0x5a));
        }
        // Smaller than a huge page: mapped as asked, nothing to align.
        let r = SharedRegion::map(8192, true).unwrap();
        assert_eq!(r.bytes(), 8192);
    }

    #[test]
    fn mapped_bytes_are_filled_sized_as_asked_and_writable() {
        for (len, huge) in [
            (1, false),
            (5000, false),
            (4096, true),
            (HUGE_PAGE_BYTES + 100, true),
        ] {
            let mut m = MappedBytes::new(len, 0xa5, huge).unwrap();
            assert_eq!(m.len(), len);
            if huge && m.backing() != Backing::Pages {
                // Mapped as a whole huge page or more, starting on one.
                assert_eq!(
                    m.as_ptr() as usize % HUGE_PAGE_BYTES,
                    0,
                    "{:?}",
                    m.backing()
                );
            }
            assert!(m.iter().all(|&b| b == 0xa5));
            m[len - 1] = 1;
            assert_eq!(m[len - 1], 1);
        }
        assert!(MappedBytes::new(0, 0, false).is_err());
    }

    #[test]
    fn single_frames_run_out_and_come_back() {
        let a = arena(70);
        let bufs: Vec<_> = (0..70).map(|_| a.try_alloc(4096).unwrap()).collect();
        assert!(a.try_alloc(1).is_none());
        assert_eq!(a.exhausted_count(), 1);
        let mut firsts: Vec<u32> = bufs.iter().map(|b| b.first).collect();
        firsts.sort();
        firsts.dedup();
        assert_eq!(firsts.len(), 70, "every frame handed out once");
        drop(bufs);
        assert_eq!(a.free_frames(), 70);
    }

    #[test]
    fn runs_are_contiguous_and_do_not_overlap() {
        let a = arena(130);
        let x = a.try_alloc(3 * 4096).unwrap();
        let y = a.try_alloc(64 * 4096).unwrap();
        let z = a.try_alloc(63 * 4096).unwrap();
        assert_eq!(a.free_frames(), 0);
        let ranges = [
            (x.first, x.frames),
            (y.first, y.frames),
            (z.first, z.frames),
        ];
        for (i, a1) in ranges.iter().enumerate() {
            for b1 in &ranges[i + 1..] {
                assert!(
                    a1.0 + a1.1 <= b1.0 || b1.0 + b1.1 <= a1.0,
                    "{a1:?} overlaps {b1:?}"
                );
            }
        }
        drop(y);
        assert!(a.try_alloc(65 * 4096).is_none());
        assert!(a.try_alloc(64 * 4096).is_some());
    }

    #[test]
    fn fragmentation_fails_a_run_but_not_single_frames() {
        let a = arena(8);
        let bufs: Vec<_> = (0..8).map(|_| a.try_alloc(4096).unwrap()).collect();
        let keep: Vec<_> = bufs
            .into_iter()
            .enumerate()
            .filter(|(i, _)| i % 2 == 0)
            .collect();
        assert_eq!(a.free_frames(), 4);
        assert!(a.try_alloc(2 * 4096).is_none());
        assert!(a.try_alloc(4096).is_some());
        drop(keep);
    }

    #[test]
    fn range_is_checked_and_bytes_stick() {
        let a = arena(4);
        let mut b = a.try_alloc(8192).unwrap();
        assert_eq!(b.capacity(), 8192);
        b.fill(7);
        assert!(b.set_range(4096, 4097).is_err());
        b.set_range(4096, 4096).unwrap();
        assert_eq!(b.len(), 4096);
        assert!(b.iter().all(|&x| x == 7));
        assert_eq!(b.as_ptr() as usize % 4096, 0);
    }

    /// A range whose end overflows is a typed error with a message that names it: the message
    /// once added start and length, which panicked (debug) or printed a wrapped end (release).
    #[test]
    fn an_overflowing_range_is_an_error_that_can_be_printed() {
        let a = arena(1);
        let mut b = a.try_alloc(4096).unwrap();
        let e = b.set_range(usize::MAX, 3).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains(&format!("of 3 bytes at {}", usize::MAX)),
            "{msg}"
        );
    }
}
