//! The page index: (file, page) → frame, an open-addressing table of atomic slots.
//!
//! Lookups take no lock: they probe slots and compare the frame's key (an atomic load each). Inserts
//! and removals of one key are serialised by a striped mutex chosen by the key's hash, so two
//! inserts of the same page cannot both succeed; slots change by CAS, so writers of different keys
//! never block each other or any reader. Removal leaves a tombstone that later inserts reuse.
//!
//! Tombstones never turn back into empty slots (a reader may be probing past one), so under
//! churn the table ends up with no empty slot at all, and a probe that stopped only at an empty
//! slot would scan the whole table for every absent key. Two things keep probes short instead:
//! - **A probe bound.** An insert takes the first free slot (empty or tombstone) from the key's
//!   home slot, and raises `max_probe` to its distance from home before it publishes the entry.
//!   No entry lies further from home than `max_probe`, so a search stops there. With at least
//!   four slots per frame the live entries fill at most a quarter of the table, and the bound
//!   stays a few slots.
//! - **Tags.** A slot holds the frame and 32 bits of the key's hash, so a probe loads a frame's
//!   key only when the tag matches: the slots it passes cost one load each, from consecutive
//!   memory.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::frames::{FrameTable, Key};

const EMPTY: u64 = 0;
const TOMBSTONE: u64 = u64::MAX;
/// Write-side lock stripes (a power of two).
const STRIPES: usize = 64;

/// A slot's word: the key's tag in the high half, frame + 1 in the low half.
fn entry(tag: u32, frame: u32) -> u64 {
    ((tag as u64) << 32) | (frame as u64 + 1)
}

fn tag_of(hash: u64) -> u32 {
    (hash >> 32) as u32
}

pub struct Index {
    slots: Box<[AtomicU64]>,
    mask: usize,
    /// No entry is further than this many slots from its key's home slot.
    max_probe: AtomicUsize,
    stripes: Box<[Mutex<()>]>,
}

/// What an insert found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Insert {
    /// The frame now stands for the key.
    Inserted,
    /// Another frame already stands for the key.
    Present(u32),
}

impl Index {
    /// A table with at least four slots per frame (so the live entries fill at most a quarter of
    /// it and probes stay short).
    pub fn new(frames: u32) -> Index {
        assert!(frames < u32::MAX - 1, "frame numbers must fit a slot");
        let n = (frames as usize * 4).next_power_of_two().max(16);
        Index {
            slots: (0..n).map(|_| AtomicU64::new(EMPTY)).collect(),
            mask: n - 1,
            max_probe: AtomicUsize::new(0),
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
        }
    }

    fn stripe(&self, key: Key) -> std::sync::MutexGuard<'_, ()> {
        let i = (key.hash() >> 58) as usize % STRIPES;
        // A poisoned stripe only means a panic elsewhere while holding it; the slots are atomics
        // and stay consistent, so go on.
        self.stripes[i]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The slots a search for a key must look at: `max_probe + 1` of them from its home.
    fn probe_limit(&self) -> usize {
        self.max_probe.load(Ordering::Acquire).min(self.mask)
    }

    /// The frame standing for `key`, if any. Lock-free.
    pub fn get(&self, key: Key, frames: &FrameTable) -> Option<u32> {
        self.get_seeing(key, frames, |_| {})
    }

    /// [`Self::get`], calling `candidate` with each frame a slot names before that frame's key is
    /// compared (a hit path uses it to start fetching the frame's bytes while the key loads).
    pub fn get_seeing(
        &self,
        key: Key,
        frames: &FrameTable,
        mut candidate: impl FnMut(u32),
    ) -> Option<u32> {
        let hash = key.hash();
        let tag = tag_of(hash);
        let limit = self.probe_limit();
        let mut i = hash as usize & self.mask;
        for _ in 0..=limit {
            match self.slots[i].load(Ordering::Acquire) {
                EMPTY => return None,
                TOMBSTONE => {}
                v if (v >> 32) as u32 == tag => {
                    let frame = v as u32 - 1;
                    candidate(frame);
                    if frames.key(frame) == key.0 {
                        return Some(frame);
                    }
                }
                _ => {}
            }
            i = (i + 1) & self.mask;
        }
        None
    }

    /// Make `frame` stand for `key` unless another frame already does.
    pub fn insert(&self, key: Key, frame: u32, frames: &FrameTable) -> Insert {
        let _g = self.stripe(key);
        let hash = key.hash();
        let tag = tag_of(hash);
        let home = hash as usize & self.mask;
        // Every entry for `key` lies within the bound (inserts of `key` are serialised by the
        // stripe, so the bound any of them raised is visible here).
        let limit = self.probe_limit();
        let mut free: Option<usize> = None;
        let mut i = home;
        for _ in 0..=limit {
            match self.slots[i].load(Ordering::Acquire) {
                EMPTY => {
                    free.get_or_insert(i);
                    break;
                }
                TOMBSTONE => {
                    free.get_or_insert(i);
                }
                v => {
                    let f = v as u32 - 1;
                    if (v >> 32) as u32 == tag && f != frame && frames.key(f) == key.0 {
                        return Insert::Present(f);
                    }
                }
            }
            i = (i + 1) & self.mask;
        }
        // The first free slot from home, or past the bound when there is none within it; another
        // key's insert may take a slot first: then the next free one.
        let mut at = free.unwrap_or(i);
        let mine = entry(tag, frame);
        for _ in 0..=self.mask {
            let cur = self.slots[at].load(Ordering::Acquire);
            if cur == EMPTY || cur == TOMBSTONE {
                // Raise the bound before the entry can be seen (only when it is lower: the
                // bound never falls, and a read-modify-write is dearer than a load).
                let dist = at.wrapping_sub(home) & self.mask;
                if dist > self.max_probe.load(Ordering::Acquire) {
                    self.max_probe.fetch_max(dist, Ordering::AcqRel);
                }
                if self.slots[at]
                    .compare_exchange(cur, mine, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    return Insert::Inserted;
                }
            }
            at = (at + 1) & self.mask;
        }
        unreachable!("the index has four slots per frame: never full")
    }

    /// Remove `frame` as the entry for `key` (no-op when it is not).
    pub fn remove(&self, key: Key, frame: u32) -> bool {
        let _g = self.stripe(key);
        let hash = key.hash();
        let mine = entry(tag_of(hash), frame);
        let limit = self.probe_limit();
        let mut i = hash as usize & self.mask;
        for _ in 0..=limit {
            match self.slots[i].load(Ordering::Acquire) {
                EMPTY => return false,
                v if v == mine => {
                    return self.slots[i]
                        .compare_exchange(v, TOMBSTONE, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok();
                }
                _ => {}
            }
            i = (i + 1) & self.mask;
        }
        false
    }

    /// How many slots a search for `key` looks at (for tests).
    #[cfg(test)]
    fn probes(&self, key: Key) -> usize {
        let limit = self.probe_limit();
        let mut i = key.hash() as usize & self.mask;
        for n in 0..=limit {
            if self.slots[i].load(Ordering::Acquire) == EMPTY {
                return n + 1;
            }
            i = (i + 1) & self.mask;
        }
        limit + 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keyed(frames: &FrameTable, frame: u32, key: Key) {
        frames
            .meta(frame)
            .key
            .store(key.0, std::sync::atomic::Ordering::Release);
    }

    #[test]
    fn insert_get_remove_and_duplicates() {
        let frames = FrameTable::new(8);
        let idx = Index::new(8);
        let (a, b) = (Key::new(1, 10), Key::new(1, 11));
        keyed(&frames, 0, a);
        keyed(&frames, 1, b);
        keyed(&frames, 2, a);
        assert_eq!(idx.get(a, &frames), None);
        assert_eq!(idx.insert(a, 0, &frames), Insert::Inserted);
        assert_eq!(idx.insert(b, 1, &frames), Insert::Inserted);
        assert_eq!(
            idx.insert(a, 2, &frames),
            Insert::Present(0),
            "one frame per page"
        );
        assert_eq!(idx.get(a, &frames), Some(0));
        assert_eq!(idx.get(b, &frames), Some(1));
        assert!(idx.remove(a, 0));
        assert!(!idx.remove(a, 0));
        assert_eq!(idx.get(a, &frames), None);
        assert_eq!(idx.get(b, &frames), Some(1), "found past the tombstone");
        assert_eq!(idx.insert(a, 2, &frames), Insert::Inserted);
        assert_eq!(idx.get(a, &frames), Some(2));
    }

    #[test]
    fn churn_never_fills_the_table() {
        let frames = FrameTable::new(4);
        let idx = Index::new(4);
        for round in 0..10_000u64 {
            let f = (round % 4) as u32;
            let k = Key::new(0, round);
            keyed(&frames, f, k);
            assert_eq!(idx.insert(k, f, &frames), Insert::Inserted);
            assert_eq!(idx.get(k, &frames), Some(f));
            assert!(idx.remove(k, f));
        }
    }

    /// Tombstones pile up until the table has no empty slot left; searches for absent keys must
    /// still stop after a few slots, not scan the table.
    #[test]
    fn probes_stay_short_under_churn() {
        const FRAMES: u32 = 1024;
        let frames = FrameTable::new(FRAMES);
        let idx = Index::new(FRAMES);
        let mut resident: Vec<Option<Key>> = vec![None; FRAMES as usize];
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for n in 0..200_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let f = (x % FRAMES as u64) as u32;
            if let Some(old) = resident[f as usize].take() {
                assert!(idx.remove(old, f));
            }
            let k = Key::new(1, n);
            keyed(&frames, f, k);
            assert_eq!(idx.insert(k, f, &frames), Insert::Inserted);
            resident[f as usize] = Some(k);
        }
        let empty = idx
            .slots
            .iter()
            .filter(|s| s.load(Ordering::Relaxed) == EMPTY)
            .count();
        assert!(
            empty < idx.slots.len() / 20,
            "the churn should leave few empty slots ({empty} of {})",
            idx.slots.len()
        );
        for (f, k) in resident.iter().enumerate() {
            let k = k.expect("every frame holds a key");
            assert_eq!(idx.get(k, &frames), Some(f as u32));
        }
        let absent = 10_000u64;
        let total: usize = (0..absent)
            .map(|n| {
                let k = Key::new(2, n);
                assert_eq!(idx.get(k, &frames), None);
                idx.probes(k)
            })
            .sum();
        let mean = total as f64 / absent as f64;
        let bound = idx.probe_limit() + 1;
        assert!(
            bound <= 64 && mean <= 32.0,
            "an absent key's search looks at {mean:.1} slots on average (bound {bound}) in a table of {}",
            idx.slots.len()
        );
    }
}
