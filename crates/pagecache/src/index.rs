//! The page index: (file, page) → frame, an open-addressing table of atomic slots in cache lines.
//!
//! Lookups take no lock: they scan slots and compare the frame's key (an atomic load each).
//! Inserts and removals of one key are serialised by a striped mutex chosen by the key's hash, so
//! two inserts of the same page cannot both succeed; slots change by CAS, so writers of different
//! keys never block each other or any reader.
//!
//! **Lines.** The table is an array of 64-byte lines of eight slots. A key's home is a line, and
//! it takes the first empty slot there, starting from a slot its page number picks (a search
//! starts there too, so a hit usually loads one slot). When the line is full it goes on to the
//! next line, and the next, raising each full line's **overflow count** on its way before it
//! publishes the entry. A search scans its home line and moves on only while the line's overflow
//! count says some entry went past it, so a search for an absent key usually reads one line,
//! however much churn the table has seen. A removal empties its slot and lowers the counts its
//! insert raised: nothing is left behind (no tombstones), and there is no table-wide probe bound
//! that only ever grows.
//!
//! **Neighbouring pages share a line.** A key's home line is its group's: the four pages
//! `4k..4k + 3` of a file hash to the same line. The pages of a hot region then find their
//! slots in a quarter of the lines a per-page hash would scatter them over, so the index lines
//! that hits need stay in the CPU's caches beside the frames' bytes instead of costing a memory
//! access of their own before the frame is known (the kernel's per-file radix tree keeps
//! neighbours together the same way). Two dense groups fill a line; with four slots per frame
//! a line seldom gets more.
//!
//! **Tags.** A slot holds the frame and a 32-bit tag of the key (its group's hash, with the
//! page's place in the group mixed in), so a search loads a frame's key only when the tag
//! matches.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;

use crate::frames::{FrameTable, Key};

const EMPTY: u64 = 0;
/// Write-side lock stripes (a power of two).
const STRIPES: usize = 64;
/// Slots in a line (64 bytes).
const LINE_SLOTS: usize = 8;
/// Pages of a file whose keys share a home line (a power of two).
const GROUP_PAGES: u64 = 4;

/// Eight slots, one cache line.
#[repr(align(64))]
struct Line([AtomicU64; LINE_SLOTS]);

/// A slot's word: the key's tag in the high half, frame + 1 in the low half.
fn entry(tag: u32, frame: u32) -> u64 {
    ((tag as u64) << 32) | (frame as u64 + 1)
}

fn tag_of(hash: u64) -> u32 {
    (hash >> 32) as u32
}

pub struct Index {
    lines: Box<[Line]>,
    /// Per line: how many entries have their home at or before it and lie past it (their
    /// inserts found it full). Kept apart from the lines so a line is all slots.
    overflow: Box<[AtomicU32]>,
    /// Lines - 1 (the line count is a power of two).
    mask: usize,
    stripes: Box<[Mutex<()>]>,
    /// Per line: removals of entries whose home it is (raised under the key's stripe). A read
    /// indexed late compares it with its value from before the device read: a copy of the page
    /// that left the index meanwhile may be newer than the bytes that read returns.
    removals: Box<[AtomicU32]>,
}

/// What an insert found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Insert {
    /// The frame now stands for the key.
    Inserted,
    /// Another frame already stands for the key.
    Present(u32),
    /// An entry for the key's line left the index since the caller's [`Index::removals`]:
    /// nothing inserted (the caller's bytes may be older than the page that left).
    Stale,
}

impl Index {
    /// A table with at least four slots per frame (so the live entries fill at most a quarter of
    /// it and lines seldom overflow).
    pub fn new(frames: u32) -> Index {
        assert!(frames < u32::MAX - 1, "frame numbers must fit a slot");
        let lines = (frames as usize * 4)
            .div_ceil(LINE_SLOTS)
            .next_power_of_two()
            .max(2);
        Index {
            lines: (0..lines)
                .map(|_| Line(std::array::from_fn(|_| AtomicU64::new(EMPTY))))
                .collect(),
            overflow: (0..lines).map(|_| AtomicU32::new(0)).collect(),
            mask: lines - 1,
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
            removals: (0..lines).map(|_| AtomicU32::new(0)).collect(),
        }
    }

    /// The line a search for `key` starts at, and the key's tag, from one hash: the hash of its
    /// group (the key with the page's low bits cleared) names the line, and its high half, with
    /// the page's place in the group mixed in, is the tag (so the pages of a group differ).
    fn home_and_tag(&self, key: Key) -> (usize, u32) {
        let group = Key(key.0 & !(GROUP_PAGES - 1)).hash();
        (
            group as usize & self.mask,
            tag_of(group) ^ (key.0 & (GROUP_PAGES - 1)) as u32,
        )
    }

    /// The line a search for `key` starts at (for tests).
    #[cfg(test)]
    fn home(&self, key: Key) -> usize {
        self.home_and_tag(key).0
    }

    /// The slot of its line a key tries first (and a search looks at first): the page's place in
    /// its group, spread over the line, so the pages of one group do not contend for one slot
    /// and a hit usually needs one slot's load.
    fn first_slot(key: Key) -> usize {
        (key.0 & (GROUP_PAGES - 1)) as usize * (LINE_SLOTS / GROUP_PAGES as usize)
    }

    /// Whether some entry whose search passes line `l` lies past it.
    fn overflows(&self, l: usize) -> bool {
        self.overflow[l].load(Ordering::Acquire) != 0
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
        let (mut l, tag) = self.home_and_tag(key);
        let first = Self::first_slot(key);
        for _ in 0..=self.mask {
            let line = &self.lines[l].0;
            for j in 0..LINE_SLOTS {
                let v = line[(first + j) % LINE_SLOTS].load(Ordering::Acquire);
                if v != EMPTY && (v >> 32) as u32 == tag {
                    let frame = v as u32 - 1;
                    candidate(frame);
                    if frames.key(frame) == key.0 {
                        return Some(frame);
                    }
                }
            }
            if !self.overflows(l) {
                return None;
            }
            l = (l + 1) & self.mask;
        }
        None
    }

    /// The removal count of `key`'s line, for [`Self::insert_unless_removed`]: read it before
    /// the device read whose bytes are to be indexed.
    pub fn removals(&self, key: Key) -> u32 {
        self.removals[self.home_and_tag(key).0].load(Ordering::Acquire)
    }

    /// Make `frame` stand for `key` unless another frame already does.
    pub fn insert(&self, key: Key, frame: u32, frames: &FrameTable) -> Insert {
        self.insert_checked(key, frame, frames, None)
    }

    /// [`Self::insert`] for bytes read from the device after `removals` was read: `Stale` if an
    /// entry of the key's line has left the index since (it may have held the page, newer than
    /// those bytes: written, written back and evicted, or stored and evicted, while the read
    /// was in flight). Another key of the line makes it `Stale` too, seldom: the read is then
    /// not cached.
    pub fn insert_unless_removed(
        &self,
        key: Key,
        frame: u32,
        frames: &FrameTable,
        removals: u32,
    ) -> Insert {
        self.insert_checked(key, frame, frames, Some(removals))
    }

    fn insert_checked(
        &self,
        key: Key,
        frame: u32,
        frames: &FrameTable,
        removals: Option<u32>,
    ) -> Insert {
        let _g = self.stripe(key);
        // Removals of `key` take this stripe too, so one before this point is seen here.
        if removals
            .is_some_and(|r| self.removals[self.home_and_tag(key).0].load(Ordering::Acquire) != r)
        {
            return Insert::Stale;
        }
        // Another frame for `key`? Inserts and removals of `key` are serialised by the stripe,
        // so every entry for it, and the counts that lead to it, are visible to this search.
        match self.get(key, frames) {
            // The same frame already standing for the key is not indexed twice (a second entry
            // would outlive the frame's one removal).
            Some(f) if f == frame => return Insert::Inserted,
            Some(f) => return Insert::Present(f),
            None => {}
        }
        let (home, tag) = self.home_and_tag(key);
        // The first empty slot from home. Each full line passed gets its overflow count raised
        // before the entry can be seen past it; another key's insert may take a slot first: then
        // the next empty one.
        let mine = entry(tag, frame);
        let first = Self::first_slot(key);
        let mut l = home;
        for _ in 0..=self.mask {
            let line = &self.lines[l].0;
            for j in 0..LINE_SLOTS {
                let slot = &line[(first + j) % LINE_SLOTS];
                if slot.load(Ordering::Acquire) == EMPTY
                    && slot
                        .compare_exchange(EMPTY, mine, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                {
                    return Insert::Inserted;
                }
            }
            self.overflow[l].fetch_add(1, Ordering::AcqRel);
            l = (l + 1) & self.mask;
        }
        unreachable!("the index has four slots per frame: never full")
    }

    /// Remove `frame` as the entry for `key` (no-op when it is not).
    pub fn remove(&self, key: Key, frame: u32) -> bool {
        let _g = self.stripe(key);
        let (home, tag) = self.home_and_tag(key);
        let mine = entry(tag, frame);
        let mut l = home;
        for passed in 0..=self.mask {
            for slot in &self.lines[l].0 {
                if slot.load(Ordering::Acquire) == mine
                    && slot
                        .compare_exchange(mine, EMPTY, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                {
                    self.removals[home].fetch_add(1, Ordering::AcqRel);
                    // The counts this entry's insert raised on the lines before it.
                    let mut k = home;
                    for _ in 0..passed {
                        self.overflow[k].fetch_sub(1, Ordering::AcqRel);
                        k = (k + 1) & self.mask;
                    }
                    return true;
                }
            }
            if !self.overflows(l) {
                return false;
            }
            l = (l + 1) & self.mask;
        }
        false
    }

    /// Slots holding an entry (for tests).
    #[cfg(test)]
    pub fn occupied(&self) -> usize {
        self.lines
            .iter()
            .map(|l| {
                l.0.iter()
                    .filter(|s| s.load(Ordering::Relaxed) != EMPTY)
                    .count()
            })
            .sum()
    }

    /// How many lines a search for `key` reads (for tests).
    #[cfg(test)]
    fn lines_read(&self, key: Key) -> usize {
        let mut l = self.home(key);
        for n in 1..=self.mask + 1 {
            if !self.overflows(l) {
                return n;
            }
            l = (l + 1) & self.mask;
        }
        self.mask + 1
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
        assert_eq!(
            idx.get(b, &frames),
            Some(1),
            "found beside the emptied slot"
        );
        assert_eq!(idx.insert(a, 2, &frames), Insert::Inserted);
        assert_eq!(idx.get(a, &frames), Some(2));
        // Inserting the frame that already stands for the key adds no second entry: one
        // removal takes the key out.
        assert_eq!(idx.insert(a, 2, &frames), Insert::Inserted);
        assert!(idx.remove(a, 2));
        assert_eq!(idx.get(a, &frames), None);
    }

    /// A late insert whose key's line lost an entry since its count was read is refused: that
    /// entry may have been a newer copy of the page.
    #[test]
    fn a_late_insert_after_a_removal_on_its_line_is_stale() {
        let frames = FrameTable::new(8);
        let idx = Index::new(8);
        let a = Key::new(1, 10);
        keyed(&frames, 0, a);
        keyed(&frames, 1, a);
        let before = idx.removals(a);
        assert_eq!(idx.insert(a, 0, &frames), Insert::Inserted);
        assert!(!idx.remove(a, 1), "not its entry: nothing removed");
        assert_eq!(idx.removals(a), before);
        assert!(idx.remove(a, 0));
        assert_eq!(
            idx.insert_unless_removed(a, 1, &frames, before),
            Insert::Stale
        );
        assert_eq!(idx.get(a, &frames), None);
        let now = idx.removals(a);
        assert_eq!(
            idx.insert_unless_removed(a, 1, &frames, now),
            Insert::Inserted
        );
        assert_eq!(idx.get(a, &frames), Some(1));
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

    /// Under churn (every removal followed by an insert elsewhere) a search for an absent key
    /// must still read about one line: removals leave nothing behind and lower the overflow
    /// counts their inserts raised.
    #[test]
    fn absent_keys_read_one_line_after_churn() {
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
                assert!(!idx.remove(old, f), "removed twice");
            }
            // Pages of several files, in runs (neighbours share a home line) and scattered.
            let k = if n % 3 == 0 {
                Key::new(2, x % (1 << 30))
            } else {
                Key::new(1, n)
            };
            keyed(&frames, f, k);
            assert_eq!(idx.insert(k, f, &frames), Insert::Inserted);
            resident[f as usize] = Some(k);
        }
        for (f, k) in resident.iter().enumerate() {
            let k = k.expect("every frame holds a key");
            assert_eq!(idx.get(k, &frames), Some(f as u32));
        }
        let absent = 10_000u64;
        let reads: Vec<usize> = (0..absent)
            .map(|n| {
                let k = Key::new(3, n * 7);
                assert_eq!(idx.get(k, &frames), None);
                idx.lines_read(k)
            })
            .collect();
        let mean = reads.iter().sum::<usize>() as f64 / absent as f64;
        let most = reads.iter().max().copied().unwrap_or(0);
        assert!(
            mean <= 1.2 && most <= 8,
            "an absent key's search reads {mean:.2} lines on average, at most {most}"
        );
        // Empty the table: every overflow count returns to zero.
        for (f, k) in resident.iter().enumerate() {
            assert!(idx.remove(k.expect("resident"), f as u32));
        }
        assert!((0..=idx.mask).all(|l| !idx.overflows(l)));
        assert!((0..=idx.mask).all(|l| idx.lines[l]
            .0
            .iter()
            .all(|s| s.load(Ordering::Relaxed) == EMPTY)));
    }

    /// The pages of a contiguous region sit in about a quarter as many lines as pages.
    #[test]
    fn neighbouring_pages_share_lines() {
        const FRAMES: u32 = 8192;
        let frames = FrameTable::new(FRAMES);
        let idx = Index::new(FRAMES);
        for p in 0..FRAMES {
            let k = Key::new(5, 1_000 + p as u64);
            keyed(&frames, p, k);
            assert_eq!(idx.insert(k, p, &frames), Insert::Inserted);
        }
        let used = (0..=idx.mask)
            .filter(|&l| {
                idx.lines[l]
                    .0
                    .iter()
                    .any(|s| s.load(Ordering::Relaxed) != EMPTY)
            })
            .count();
        assert!(
            used <= (FRAMES as usize / GROUP_PAGES as usize) * 11 / 10,
            "{FRAMES} neighbouring pages use {used} lines"
        );
        for p in 0..FRAMES {
            assert_eq!(idx.get(Key::new(5, 1_000 + p as u64), &frames), Some(p));
        }
    }

    /// Threads inserting and removing keys that share one home line, against a reader of keys
    /// that overflowed from it: the reader finds every one of them throughout (it must follow
    /// the line's overflow count), and the counts end at zero.
    #[test]
    fn concurrent_inserts_and_removals_keep_entries_findable() {
        const FRAMES: u32 = 256;
        const WRITERS: u32 = 3;
        const PER_WRITER: u32 = 16;
        let frames = FrameTable::new(FRAMES);
        let idx = Index::new(FRAMES);
        // Keys of distinct groups whose home is one line.
        let line = idx.home(Key::new(8, 0));
        let mut same_line: Vec<Key> = (0..1_000_000u64)
            .map(|p| Key::new(8, p * GROUP_PAGES))
            .filter(|&k| idx.home(k) == line)
            .take(12 + (WRITERS * PER_WRITER) as usize)
            .collect();
        assert_eq!(same_line.len(), 12 + (WRITERS * PER_WRITER) as usize);
        // Twelve resident keys: eight fill the line, four overflow into the next.
        let stable: Vec<Key> = same_line.drain(..12).collect();
        for (f, &k) in stable.iter().enumerate() {
            keyed(&frames, f as u32, k);
            assert_eq!(idx.insert(k, f as u32, &frames), Insert::Inserted);
        }
        assert!(idx.overflows(line), "the stable keys overflow their line");
        let done = std::sync::atomic::AtomicU32::new(0);
        std::thread::scope(|s| {
            for t in 0..WRITERS {
                let (idx, frames, done) = (&idx, &frames, &done);
                let mine: Vec<Key> =
                    same_line[(t * PER_WRITER) as usize..((t + 1) * PER_WRITER) as usize].to_vec();
                s.spawn(move || {
                    let frame = |i: usize| 64 + t * PER_WRITER + i as u32;
                    for _ in 0..2_000 {
                        for (i, &k) in mine.iter().enumerate() {
                            keyed(frames, frame(i), k);
                            assert_eq!(idx.insert(k, frame(i), frames), Insert::Inserted);
                        }
                        for (i, &k) in mine.iter().enumerate() {
                            assert_eq!(idx.get(k, frames), Some(frame(i)));
                            assert!(idx.remove(k, frame(i)));
                        }
                    }
                    done.fetch_add(1, Ordering::AcqRel);
                });
            }
            let (idx, frames, stable, done) = (&idx, &frames, &stable, &done);
            s.spawn(move || {
                let mut passes = 0u64;
                while done.load(Ordering::Acquire) < WRITERS || passes == 0 {
                    for (f, &k) in stable.iter().enumerate() {
                        assert_eq!(idx.get(k, frames), Some(f as u32));
                    }
                    passes += 1;
                }
            });
        });
        for (f, &k) in stable.iter().enumerate() {
            assert!(idx.remove(k, f as u32));
        }
        assert!((0..=idx.mask).all(|l| !idx.overflows(l)));
    }
}
