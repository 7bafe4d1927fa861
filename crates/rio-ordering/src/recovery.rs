//! Recovery (Rio §4.4): from the attribute log, the longest prefix of each stream's order whose
//! every request is durable; what lies beyond it is for the caller to discard (out-of-place
//! updates) or replay, and in-place updates among it are flagged for the upper layer.
//!
//! An entry's data is durable when
//! - its target has power-loss protection and the entry's persist word is set (set at the
//!   request's completion), or
//! - a FLUSH-bearing entry of the same stream on the same target, at the same or a later group,
//!   has its persist word set: that FLUSH went out after every earlier request of the stream on
//!   the target had completed, so it covers them.
//!
//! A group is complete when its requests are all there and durable: a multi-group merged entry
//! (always whole groups) by itself; otherwise the group's final entry gives the request count
//! (`num`), entries count their `members`, and a split request counts once, when every piece
//! from index 0 to count−1 is there with contiguous bytes.

use std::collections::{BTreeMap, BTreeSet};

use crate::attr::Attr;
use crate::log::{LogScan, Slot};

/// One stream's recovered state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamRecovery {
    pub stream: u16,
    /// Groups below this were durable before the crash (the log header's mark).
    pub base: u64,
    /// Groups `base..prefix_end` are complete and durable: the valid prefix. The stream resumes
    /// at `prefix_end`.
    pub prefix_end: u64,
    /// Entries of the prefix, in group order.
    pub kept: Vec<Attr>,
    /// Entries of later groups: their data may or may not have reached the device. Out-of-place
    /// updates there are to be discarded; in-place ones (`ipu`) go to the upper layer.
    pub beyond: Vec<Attr>,
    /// Why the prefix ends where it does (`None`: the log holds nothing beyond it).
    pub stopped_by: Option<String>,
}

/// The whole log's recovery.
#[derive(Clone, Debug)]
pub struct Recovery {
    pub streams: Vec<StreamRecovery>,
    /// Damaged entries, skipped (a torn append at the crash lands here too).
    pub damaged: Vec<(Slot, String)>,
    /// Entries of earlier epochs, ignored.
    pub stale: usize,
}

impl Recovery {
    /// Where each stream resumes (for [`crate::AttrLog::reopen`]).
    pub fn resume_marks(&self) -> Vec<u64> {
        self.streams.iter().map(|s| s.prefix_end).collect()
    }
    /// In-place updates beyond the prefixes, for the upper layer.
    pub fn in_place_beyond(&self) -> impl Iterator<Item = &Attr> {
        self.streams
            .iter()
            .flat_map(|s| s.beyond.iter().filter(|a| a.ipu))
    }
}

fn is_marker(a: &Attr) -> bool {
    a.flush && a.len == 0 && a.members == 0
}

/// Recover every stream of `scan`; `plp(target)` says whether a target has power-loss
/// protection (no volatile write cache).
pub fn recover(scan: &LogScan, plp: &dyn Fn(u16) -> bool) -> Recovery {
    let streams = (0..scan.header.durable_below.len() as u16)
        .map(|s| recover_stream(scan, s, plp))
        .collect();
    Recovery {
        streams,
        damaged: scan.damaged.clone(),
        stale: scan.stale,
    }
}

fn recover_stream(scan: &LogScan, stream: u16, plp: &dyn Fn(u16) -> bool) -> StreamRecovery {
    let base = scan.header.durable_below[stream as usize].max(1);
    let mine: Vec<Attr> = scan
        .entries
        .iter()
        .map(|(_, a)| *a)
        .filter(|a| a.stream == stream && a.seq_end >= base)
        .collect();
    // Per target, the latest group whose FLUSH is known durable.
    let mut flushed: BTreeMap<u16, u64> = BTreeMap::new();
    for a in mine.iter().filter(|a| a.flush && a.persist) {
        let f = flushed.entry(a.target).or_insert(0);
        *f = (*f).max(a.seq);
    }
    let durable = |a: &Attr| {
        if plp(a.target) {
            a.persist
        } else {
            flushed.get(&a.target).is_some_and(|&f| f >= a.seq_end)
        }
    };
    let last = mine.iter().map(|a| a.seq_end).max().unwrap_or(0);
    let mut groups = GroupIndex::new(&mine);
    let mut g = base;
    let mut stopped_by = None;
    while g <= last {
        match group_complete(groups.merged_covering(g), groups.members(g), g, &durable) {
            Ok(next) => g = next,
            Err(why) => {
                stopped_by = Some(format!("group {g}: {why}"));
                break;
            }
        }
    }
    let prefix_end = g;
    let (kept, beyond): (Vec<Attr>, Vec<Attr>) = mine
        .into_iter()
        .filter(|a| !is_marker(a))
        .partition(|a| a.seq_end < prefix_end);
    let mut kept = kept;
    kept.sort_by_key(|a| (a.seq, a.target, a.offset));
    let mut beyond = beyond;
    beyond.sort_by_key(|a| (a.seq, a.target, a.offset));
    StreamRecovery {
        stream,
        base,
        prefix_end,
        kept,
        beyond,
        stopped_by,
    }
}

/// One stream's entries arranged for the walk over its groups, so that each group's lookup
/// costs a search rather than a pass over the whole stream (which made recovery quadratic: a
/// full 2 MiB log of one stream took over a second).
struct GroupIndex<'a> {
    /// Entries of one group each (markers left out), by group; in log order within a group.
    single: Vec<&'a Attr>,
    /// Entries of whole merged groups, by first group, each with its place in the log.
    merged: Vec<(usize, &'a Attr)>,
    /// Merged entries already reached by the walk, by place in the log and by last group.
    next_merged: usize,
    open: BTreeMap<usize, &'a Attr>,
    open_by_end: BTreeSet<(u64, usize)>,
}

impl<'a> GroupIndex<'a> {
    fn new(entries: &'a [Attr]) -> GroupIndex<'a> {
        let mut single: Vec<&Attr> = entries
            .iter()
            .filter(|a| a.seq == a.seq_end && !is_marker(a))
            .collect();
        // Stable: log order is kept within a group.
        single.sort_by_key(|a| a.seq);
        let mut merged: Vec<(usize, &Attr)> = entries
            .iter()
            .enumerate()
            .filter(|(_, a)| a.merged && a.seq_end > a.seq)
            .collect();
        merged.sort_by_key(|(_, a)| a.seq);
        GroupIndex {
            single,
            merged,
            next_merged: 0,
            open: BTreeMap::new(),
            open_by_end: BTreeSet::new(),
        }
    }

    /// The entries of group `g` alone, in log order.
    fn members(&self, g: u64) -> &[&'a Attr] {
        let from = self.single.partition_point(|a| a.seq < g);
        let to = self.single.partition_point(|a| a.seq <= g);
        &self.single[from..to]
    }

    /// The first merged entry in log order that carries group `g`. The walk asks with `g`
    /// never going down.
    fn merged_covering(&mut self, g: u64) -> Option<&'a Attr> {
        while let Some(&(at, a)) = self.merged.get(self.next_merged) {
            if a.seq > g {
                break;
            }
            self.open.insert(at, a);
            self.open_by_end.insert((a.seq_end, at));
            self.next_merged += 1;
        }
        while let Some(&(end, at)) = self.open_by_end.first() {
            if end >= g {
                break;
            }
            self.open_by_end.pop_first();
            self.open.remove(&at);
        }
        self.open.first_key_value().map(|(_, a)| *a)
    }
}

/// Whether group `g` is complete and durable; on success, the next group to check. `merged`:
/// an entry of whole groups that carries `g`; `members`: the entries of `g` alone, in log
/// order.
fn group_complete(
    merged: Option<&Attr>,
    members: &[&Attr],
    g: u64,
    durable: &dyn Fn(&Attr) -> bool,
) -> Result<u64, String> {
    // Whole groups merged into one entry: all of them or none.
    if let Some(m) = merged {
        return if durable(m) {
            Ok(m.seq_end + 1)
        } else {
            Err(format!(
                "merged groups {}..={} not durable",
                m.seq, m.seq_end
            ))
        };
    }
    let Some(num) = members.iter().find(|a| a.boundary).map(|a| a.num) else {
        return Err(if members.is_empty() {
            "no entry".to_string()
        } else {
            "its final request's entry is missing".to_string()
        });
    };
    if let Some(a) = members.iter().find(|a| !durable(a)) {
        return Err(format!(
            "request at byte {} on target {} not durable",
            a.offset, a.target
        ));
    }
    let mut count: u32 = members
        .iter()
        .filter(|a| a.split.is_none())
        .map(|a| a.members as u32)
        .sum();
    // Split pieces: per target, in byte order, runs 0..n of contiguous pieces.
    let mut pieces: Vec<&&Attr> = members.iter().filter(|a| a.split.is_some()).collect();
    pieces.sort_by_key(|a| (a.target, a.offset));
    let mut i = 0;
    while i < pieces.len() {
        let first = pieces[i];
        let (idx, n) = first.split.expect("split pieces");
        if idx != 0 {
            return Err(format!(
                "a split request on target {} lacks its first piece",
                first.target
            ));
        }
        let mut end = first.offset + first.len as u64;
        for k in 1..n {
            let p = pieces.get(i + k as usize).ok_or_else(|| {
                format!(
                    "a split request at byte {} on target {} lacks piece {k} of {n}",
                    first.offset, first.target
                )
            })?;
            if p.split != Some((k, n)) || p.target != first.target || p.offset != end {
                return Err(format!(
                    "a split request at byte {} on target {} lacks piece {k} of {n}",
                    first.offset, first.target
                ));
            }
            end += p.len as u64;
        }
        count += first.members as u32;
        i += n as usize;
    }
    if count != num as u32 {
        return Err(format!("{count} of its {num} requests in the log"));
    }
    Ok(g + 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::log::Header;
    use proptest::prelude::*;

    /// The walk with each group's entries found by a pass over the whole stream, as recovery
    /// did before [`GroupIndex`]: where the prefix ends, and why.
    fn walk_by_passes(
        mine: &[Attr],
        base: u64,
        durable: &dyn Fn(&Attr) -> bool,
    ) -> (u64, Option<String>) {
        let last = mine.iter().map(|a| a.seq_end).max().unwrap_or(0);
        let mut g = base;
        while g <= last {
            let merged = mine
                .iter()
                .find(|a| a.merged && a.seq <= g && g <= a.seq_end && a.seq_end > a.seq);
            let members: Vec<&Attr> = mine
                .iter()
                .filter(|a| a.seq == g && a.seq_end == g && !is_marker(a))
                .collect();
            match group_complete(merged, &members, g, durable) {
                Ok(next) => g = next,
                Err(why) => return (g, Some(format!("group {g}: {why}"))),
            }
        }
        (g, None)
    }

    /// An entry of stream 0 from random parts: a group of 1..=10, perhaps merged over up to
    /// three groups, split, a boundary, a FLUSH or a marker, persisted or not, on one of two
    /// targets.
    fn entry() -> impl Strategy<Value = Attr> {
        (
            (1u64..=10, 0u64..3, any::<bool>(), 0u8..4, 0u8..3),
            (
                0u16..4,
                1u16..3,
                any::<bool>(),
                any::<bool>(),
                0u16..2,
                0u64..6,
            ),
        )
            .prop_map(
                |(
                    (seq, span, merged, split, count),
                    (num, members, persist, flush, target, at),
                )| {
                    let merged = merged && span > 0;
                    let marker = flush && split == 3;
                    Attr {
                        stream: 0,
                        target,
                        seq,
                        seq_end: if merged { seq + span } else { seq },
                        offset: at * 4096,
                        len: if marker { 0 } else { 4096 },
                        boundary: num > 0,
                        flush,
                        merged,
                        num,
                        members: if marker { 0 } else { members },
                        split: (split < count).then_some((split, count)),
                        persist,
                        ..Attr::default()
                    }
                },
            )
    }

    proptest! {
        /// The indexed walk ends each stream where a pass per group ends it, for the same
        /// reason, on random logs (merged, split and missing entries, markers, entries not
        /// durable), with and without power-loss protection.
        #[test]
        fn the_indexed_walk_stops_where_a_pass_per_group_stops(
            entries in proptest::collection::vec(entry(), 0..40),
            base in 1u64..4,
            plp in any::<bool>(),
        ) {
            let scan = LogScan {
                header: Header {
                    epoch: 1,
                    slots: 64,
                    version: 1,
                    durable_below: vec![base],
                    slots_at: 0,
                },
                entries: entries.iter().enumerate().map(|(i, a)| (Slot(i as u32), *a)).collect(),
                damaged: Vec::new(),
                stale: 0,
            };
            let r = recover_stream(&scan, 0, &|_| plp);
            let mine: Vec<Attr> = entries.iter().copied().filter(|a| a.seq_end >= base).collect();
            let mut flushed: BTreeMap<u16, u64> = BTreeMap::new();
            for a in mine.iter().filter(|a| a.flush && a.persist) {
                let f = flushed.entry(a.target).or_insert(0);
                *f = (*f).max(a.seq);
            }
            let durable = |a: &Attr| {
                if plp {
                    a.persist
                } else {
                    flushed.get(&a.target).is_some_and(|&f| f >= a.seq_end)
                }
            };
            let (end, why) = walk_by_passes(&mine, base, &durable);
            prop_assert_eq!(r.prefix_end, end);
            prop_assert_eq!(r.stopped_by, why);
        }
    }
}
