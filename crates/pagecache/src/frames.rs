//! Page frames: the memory (one registered shared region) and a per-frame state word.
//!
//! Each frame's state is one `AtomicU64`: a version (bumped whenever the frame changes identity or
//! content), a pin count, and flags. A hit reads it optimistically — state, data, state again, and
//! the copy counts only if the version did not move — so readers on different cores never write a
//! shared cache line (seqlock style). Zero-copy guards publish the frame in a per-handle hazard slot
//! (see `hazard`); writeback and guards past a handle's slots pin by a CAS on the word.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// The frame holds the page's bytes (readable).
pub const VALID: u16 = 1 << 0;
/// A read of the page into this frame is in flight.
pub const IO: u16 = 1 << 1;
/// The frame holds writes not yet on the device.
pub const DIRTY: u16 = 1 << 2;
/// CLOCK's referenced bit: hit since the hand last passed.
pub const REFERENCED: u16 = 1 << 3;
/// The frame is in the index (its key finds it).
pub const INDEXED: u16 = 1 << 4;
/// Out of the page's service: lost a lazy-indexing race (another frame holds the page), or
/// superseded in flight by a writer (set while the frame is still indexed; the writer then takes
/// it out of the index). Freed by whoever of its reader, its read's completion and that writer
/// last lets go of it (no pin, no I/O, out of the index).
pub const ABANDONED: u16 = 1 << 5;
/// A writer is changing the bytes: optimistic readers retry.
pub const BUSY: u16 = 1 << 6;
/// The read failed: waiters give up on this frame.
pub const FAILED: u16 = 1 << 7;
/// A write back of this frame was given up on by a handle whose engine kept failing: the
/// write may still land at any time, and its pin goes only when a handle on the same lbio
/// array takes its completion. Writers refuse the page until then.
pub const LOST: u16 = 1 << 8;

/// A copy a `store` put in place of a page with a lost write back still out (see [`LOST`]):
/// the device may yet get that older write, over the stored bytes. The copy stays dirty, is
/// not written back while this is set (the lost write could land after its write), and
/// writers refuse the page; the flag goes when the lost write's completion is taken, and the
/// next `sync` then writes the copy again, after it.
pub const REWRITE: u16 = 1 << 9;

/// A [`LOST`] frame a `store` took out of the index (its page now in a frame of its own): freed
/// by whoever lets go of it last, of the lost write's completion, a write back pass that
/// pinned it too, a guard pinned by count and the `store`. A zero-copy guard may still hold it
/// through a hazard slot then: the frame is retired instead (see `PageCache::retire`).
pub const REPLACED: u16 = 1 << 10;

/// A decoded state word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct State(pub u64);

impl State {
    pub fn new(version: u32, pins: u16, flags: u16) -> State {
        State((version as u64) << 32 | (pins as u64) << 16 | flags as u64)
    }
    pub fn version(self) -> u32 {
        (self.0 >> 32) as u32
    }
    pub fn pins(self) -> u16 {
        (self.0 >> 16) as u16
    }
    pub fn flags(self) -> u16 {
        self.0 as u16
    }
    pub fn has(self, f: u16) -> bool {
        self.flags() & f == f
    }
    pub fn with_flags(self, flags: u16) -> State {
        State::new(self.version(), self.pins(), flags)
    }
    pub fn with_pins(self, pins: u16) -> State {
        State::new(self.version(), pins, self.flags())
    }
    pub fn bumped(self) -> State {
        State::new(self.version().wrapping_add(1), self.pins(), self.flags())
    }
}

/// A page's identity: file id in the top 16 bits, page index below.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Key(pub u64);

/// Pages a file may have (48 bits of page index).
pub const MAX_PAGES_PER_FILE: u64 = 1 << 48;
/// Marks a frame with no page.
pub const NO_KEY: u64 = u64::MAX;

impl Key {
    pub fn new(file: u16, page: u64) -> Key {
        debug_assert!(page < MAX_PAGES_PER_FILE);
        Key((file as u64) << 48 | page)
    }
    pub fn file(self) -> u16 {
        (self.0 >> 48) as u16
    }
    pub fn page(self) -> u64 {
        self.0 & (MAX_PAGES_PER_FILE - 1)
    }
    /// A well-mixed hash (splitmix64 finaliser).
    pub fn hash(self) -> u64 {
        let mut x = self.0;
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^ (x >> 31)
    }
}

/// Per-frame metadata, cache-line aligned so frames do not share lines.
#[repr(align(64))]
pub struct FrameMeta {
    pub state: AtomicU64,
    pub key: AtomicU64,
    /// Write backs of this frame that a live handle left in flight when its wait for them
    /// failed: each holds a pin, which goes only when that handle next drives its engine.
    /// Writers of another handle refuse the page while this is non-zero rather than wait.
    pub parked: AtomicU32,
}

/// All frames' metadata.
pub struct FrameTable {
    metas: Box<[FrameMeta]>,
}

impl FrameTable {
    pub fn new(frames: u32) -> FrameTable {
        FrameTable {
            metas: (0..frames)
                .map(|_| FrameMeta {
                    state: AtomicU64::new(0),
                    key: AtomicU64::new(NO_KEY),
                    parked: AtomicU32::new(0),
                })
                .collect(),
        }
    }

    pub fn len(&self) -> u32 {
        self.metas.len() as u32
    }

    pub fn meta(&self, frame: u32) -> &FrameMeta {
        &self.metas[frame as usize]
    }

    pub fn state(&self, frame: u32) -> State {
        State(self.meta(frame).state.load(Ordering::Acquire))
    }

    /// The state, read after publishing a hazard slot (sequentially consistent, see `hazard`).
    pub fn state_after_protect(&self, frame: u32) -> State {
        State(self.meta(frame).state.load(Ordering::SeqCst))
    }

    pub fn key(&self, frame: u32) -> u64 {
        self.meta(frame).key.load(Ordering::Acquire)
    }

    /// CAS the state word from `old` to `new`.
    pub fn cas(&self, frame: u32, old: State, new: State) -> bool {
        self.meta(frame)
            .state
            .compare_exchange(old.0, new.0, Ordering::SeqCst, Ordering::Acquire)
            .is_ok()
    }

    /// Set the state of a frame this thread owns outright: free (no pins, not valid, out of the
    /// index), so no other thread changes its state (pins, writers and eviction all need VALID).
    pub fn set_owned(&self, frame: u32, new: State) {
        self.meta(frame).state.store(new.0, Ordering::Release);
    }

    /// Apply `f` to the state until the CAS succeeds or `f` declines (returns `None`).
    pub fn update(&self, frame: u32, mut f: impl FnMut(State) -> Option<State>) -> Option<State> {
        let meta = self.meta(frame);
        let mut cur = State(meta.state.load(Ordering::Acquire));
        loop {
            let new = f(cur)?;
            // Sequentially consistent: a change that needs the frame unread is followed by a
            // scan of the hazard slots (see `hazard`), and the two must not be reordered.
            match meta.state.compare_exchange_weak(
                cur.0,
                new.0,
                Ordering::SeqCst,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(new),
                Err(actual) => cur = State(actual),
            }
        }
    }

    /// Pin a valid, indexed frame still holding `key`; `false` if it changed meanwhile. (A
    /// frame a lookup found may since hold the same page abandoned, out of the index: its reader
    /// frees it once its own pin goes, so another pin would keep it from ever being freed.)
    pub fn pin(&self, frame: u32, key: Key) -> bool {
        let pinned = self
            .update(frame, |s| {
                (s.has(VALID | INDEXED) && !s.has(BUSY) && s.pins() < u16::MAX)
                    .then(|| s.with_pins(s.pins() + 1))
            })
            .is_some();
        if pinned && self.key(frame) != key.0 {
            self.unpin(frame);
            return false;
        }
        pinned
    }

    /// Drop one pin; the state the subtraction left (so the caller can tell, from its own
    /// atomic step, whether it let go of the frame last).
    pub fn unpin(&self, frame: u32) -> State {
        // One atomic subtract on the pin field: it is > 0 while pinned, so nothing borrows from
        // the version above it.
        let before = State(self.meta(frame).state.fetch_sub(1 << 16, Ordering::AcqRel));
        debug_assert!(before.pins() > 0, "unpin of an unpinned frame {frame}");
        State(before.0.wrapping_sub(1 << 16))
    }

    /// Set `flag` unless already set (a read first, so hot frames are not written on every hit).
    pub fn mark(&self, frame: u32, flag: u16) {
        let meta = self.meta(frame);
        if State(meta.state.load(Ordering::Relaxed)).flags() & flag == 0 {
            meta.state.fetch_or(flag as u64, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_fields_pack_and_unpack() {
        let s = State::new(7, 3, VALID | DIRTY);
        assert_eq!((s.version(), s.pins(), s.flags()), (7, 3, VALID | DIRTY));
        assert!(s.has(VALID) && !s.has(IO));
        assert_eq!(s.bumped().version(), 8);
        assert_eq!(State::new(u32::MAX, 0, 0).bumped().version(), 0);
    }

    #[test]
    fn keys_hold_file_and_page() {
        let k = Key::new(3, (1 << 40) + 5);
        assert_eq!((k.file(), k.page()), (3, (1 << 40) + 5));
        assert_ne!(Key::new(1, 0).hash(), Key::new(0, 1).hash());
    }

    #[test]
    fn pin_checks_validity_and_key() {
        let t = FrameTable::new(2);
        let k = Key::new(1, 9);
        assert!(!t.pin(0, k), "an empty frame cannot be pinned");
        t.meta(0).key.store(k.0, Ordering::Release);
        t.meta(0)
            .state
            .store(State::new(1, 0, VALID | INDEXED).0, Ordering::Release);
        assert!(t.pin(0, k));
        assert!(!t.pin(0, Key::new(1, 10)), "another key");
        assert_eq!(t.state(0).pins(), 1);
        t.unpin(0);
        assert_eq!(t.state(0).pins(), 0);
    }

    /// A stale lookup's frame reused for the same page by a miss that lost the indexing race
    /// (valid, the key, abandoned, pinned by its reader) is not pinned: the reader's unpin
    /// must find no other pin and free it.
    #[test]
    fn pin_refuses_a_frame_out_of_the_index() {
        let t = FrameTable::new(1);
        let k = Key::new(1, 9);
        t.meta(0).key.store(k.0, Ordering::Release);
        t.meta(0)
            .state
            .store(State::new(1, 1, VALID | ABANDONED).0, Ordering::Release);
        assert!(!t.pin(0, k));
        assert_eq!(t.state(0).pins(), 1);
    }
}
