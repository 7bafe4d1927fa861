//! Per-handle hazard slots: how a zero-copy guard keeps its page without writing a shared line.
//!
//! Pinning by counting in the frame's state word costs two atomic writes per guard to a line
//! every core reading that page shares, so guards on the same hot pages do not scale across cores
//! (the line migrates on every pin and unpin). Instead each handle owns one cache line of slots.
//! A guard publishes its frame in a slot of its own handle, then re-reads the frame's state; a
//! thread that wants a frame with no readers (eviction, a writer) changes the state first and then
//! scans the slots. Both sides use sequentially consistent operations, so at least one of them sees
//! the other (the Dekker pattern): either the guard sees the change and lets go, or the other side
//! sees the slot and backs off.
//!
//! Handles beyond [`MAX_BLOCKS`] and guards beyond a handle's [`SLOTS`] fall back to the pin count.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};

/// Slots per handle: zero-copy guards a handle can hold at once without touching the frame's word.
pub const SLOTS: usize = 15;
/// Handles that get slots (one 64-byte line each).
pub const MAX_BLOCKS: usize = 128;

const EMPTY: u32 = 0;

#[repr(align(64))]
struct Block {
    owned: AtomicBool,
    /// `frame + 1`, or [`EMPTY`].
    slots: [AtomicU32; SLOTS],
}

/// All handles' slots.
pub struct Hazards {
    blocks: Box<[Block]>,
    /// Blocks ever claimed (the scan stops here).
    used: AtomicUsize,
}

impl Hazards {
    pub fn new() -> Hazards {
        Hazards {
            blocks: (0..MAX_BLOCKS)
                .map(|_| Block {
                    owned: AtomicBool::new(false),
                    slots: std::array::from_fn(|_| AtomicU32::new(EMPTY)),
                })
                .collect(),
            used: AtomicUsize::new(0),
        }
    }

    /// Claim a block for a new handle; `None` when all are taken.
    pub fn claim(&self) -> Option<usize> {
        for (i, b) in self.blocks.iter().enumerate() {
            if b.owned
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                self.used.fetch_max(i + 1, Ordering::SeqCst);
                return Some(i);
            }
        }
        None
    }

    /// Give a block back (its slots must all be empty: every guard is gone).
    pub fn release(&self, block: usize) {
        let b = &self.blocks[block];
        debug_assert!(b.slots.iter().all(|s| s.load(Ordering::Relaxed) == EMPTY));
        b.owned.store(false, Ordering::Release);
    }

    /// Publish `frame` in a slot; the caller must re-read the frame's state afterwards.
    pub fn protect(&self, block: usize, slot: usize, frame: u32) {
        self.blocks[block].slots[slot].store(frame + 1, Ordering::SeqCst);
    }

    /// Empty a slot.
    pub fn clear(&self, block: usize, slot: usize) {
        self.blocks[block].slots[slot].store(EMPTY, Ordering::Release);
    }

    /// Whether any handle's slot holds `frame`. Call after changing the frame's state (with a
    /// sequentially consistent operation).
    pub fn protects(&self, frame: u32) -> bool {
        let used = self.used.load(Ordering::SeqCst);
        self.blocks[..used].iter().any(|b| {
            b.slots
                .iter()
                .any(|s| s.load(Ordering::SeqCst) == frame + 1)
        })
    }

    /// Whether `block`'s own slots hold `frame` (a handle asking about its own guards).
    pub fn protects_in(&self, block: usize, frame: u32) -> bool {
        self.blocks[block]
            .slots
            .iter()
            .any(|s| s.load(Ordering::Relaxed) == frame + 1)
    }

    /// Slots in use, over all handles.
    #[cfg(test)]
    pub fn in_use(&self) -> usize {
        self.blocks
            .iter()
            .map(|b| {
                b.slots
                    .iter()
                    .filter(|s| s.load(Ordering::Acquire) != EMPTY)
                    .count()
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_protect_until_cleared() {
        let h = Hazards::new();
        let a = h.claim().unwrap();
        let b = h.claim().unwrap();
        assert_ne!(a, b);
        assert!(!h.protects(7));
        h.protect(b, 3, 7);
        assert!(h.protects(7) && h.protects_in(b, 7) && !h.protects_in(a, 7));
        assert!(!h.protects(6) && !h.protects(8));
        assert_eq!(h.in_use(), 1);
        h.clear(b, 3);
        assert!(!h.protects(7));
        h.release(a);
        assert_eq!(h.claim(), Some(a), "a released block is claimed again");
    }

    #[test]
    fn blocks_run_out() {
        let h = Hazards::new();
        for _ in 0..MAX_BLOCKS {
            assert!(h.claim().is_some());
        }
        assert_eq!(h.claim(), None);
    }
}
