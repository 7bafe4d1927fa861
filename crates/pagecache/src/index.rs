//! The page index: (file, page) → frame, an open-addressing table of atomic slots.
//!
//! Lookups take no lock: they probe slots and compare the frame's key (an atomic load each). Inserts
//! and removals of one key are serialised by a striped mutex chosen by the key's hash, so two
//! inserts of the same page cannot both succeed; slots change by CAS, so writers of different keys
//! never block each other or any reader. Removal leaves a tombstone that later inserts reuse.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

use crate::frames::{FrameTable, Key};

const EMPTY: u32 = 0;
const TOMBSTONE: u32 = u32::MAX;
/// Write-side lock stripes (a power of two).
const STRIPES: usize = 64;

pub struct Index {
    slots: Box<[AtomicU32]>,
    mask: usize,
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
    /// A table with at least four slots per frame (so probes stay short with tombstones).
    pub fn new(frames: u32) -> Index {
        let n = (frames as usize * 4).next_power_of_two().max(16);
        Index {
            slots: (0..n).map(|_| AtomicU32::new(EMPTY)).collect(),
            mask: n - 1,
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

    /// The frame standing for `key`, if any. Lock-free.
    pub fn get(&self, key: Key, frames: &FrameTable) -> Option<u32> {
        let mut i = key.hash() as usize & self.mask;
        for _ in 0..=self.mask {
            match self.slots[i].load(Ordering::Acquire) {
                EMPTY => return None,
                TOMBSTONE => {}
                f => {
                    let frame = f - 1;
                    if frames.key(frame) == key.0 {
                        return Some(frame);
                    }
                }
            }
            i = (i + 1) & self.mask;
        }
        None
    }

    /// Make `frame` stand for `key` unless another frame already does.
    pub fn insert(&self, key: Key, frame: u32, frames: &FrameTable) -> Insert {
        let _g = self.stripe(key);
        let mut i = key.hash() as usize & self.mask;
        let mut free: Option<usize> = None;
        for _ in 0..=self.mask {
            match self.slots[i].load(Ordering::Acquire) {
                EMPTY => {
                    free.get_or_insert(i);
                    break;
                }
                TOMBSTONE => {
                    free.get_or_insert(i);
                }
                f => {
                    if f - 1 != frame && frames.key(f - 1) == key.0 {
                        return Insert::Present(f - 1);
                    }
                }
            }
            i = (i + 1) & self.mask;
        }
        // Another key's insert may take the slot first: then look for the next free one.
        let mut at = free.expect("the index has four slots per frame: never full");
        loop {
            let cur = self.slots[at].load(Ordering::Acquire);
            if (cur == EMPTY || cur == TOMBSTONE)
                && self.slots[at]
                    .compare_exchange(cur, frame + 1, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            {
                return Insert::Inserted;
            }
            at = (at + 1) & self.mask;
        }
    }

    /// Remove `frame` as the entry for `key` (no-op when it is not).
    pub fn remove(&self, key: Key, frame: u32) -> bool {
        let _g = self.stripe(key);
        let mut i = key.hash() as usize & self.mask;
        for _ in 0..=self.mask {
            match self.slots[i].load(Ordering::Acquire) {
                EMPTY => return false,
                f if f == frame + 1 => {
                    return self.slots[i]
                        .compare_exchange(f, TOMBSTONE, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok();
                }
                _ => {}
            }
            i = (i + 1) & self.mask;
        }
        false
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
}
