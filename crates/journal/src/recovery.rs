//! Recovery, as pure functions over bytes: parse an area's log, merge areas by transaction id.
//!
//! An area's log is read from its superblock's tail: each transaction must start with a
//! descriptor whose id is above the previous one's, and ends at a commit block whose count and
//! chained checksum match what was read. The scan stops at the first transaction that does not
//! check out. Whether that is the normal torn tail of a crash or damage in the middle of the log
//! is told by what lies beyond: a transaction's commit is only written after every earlier
//! transaction of the area is durable, so a valid commit block with a larger id anywhere in the
//! area (or the broken transaction's own commit, intact, over damaged contents) means the log was
//! damaged after it was written. A one-write commit block goes out with its transaction's other
//! blocks, so it vouches for the transactions before it, not for its own.

use std::collections::HashMap;

use crate::error::JournalError;
use crate::format::{
    self, Header, Kind, Superblock, BLOCK, FLAG_FILE_TX, FLAG_ONE_WRITE, FLAG_RIO,
};

/// A committed transaction found in a log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecoveredTx {
    pub tid: u64,
    pub area: u32,
    /// The file of a file-level transaction.
    pub file: Option<u32>,
    /// (home block, bytes), in log order.
    pub metas: Vec<(u64, Vec<u8>)>,
    pub revokes: Vec<u64>,
    /// Log position of its first block, and how many blocks it takes.
    pub pos: u64,
    pub blocks: u64,
    /// A Rio-ordered commit: the group its commit block had on the area's stream.
    pub rio_group: Option<u64>,
}

/// How an area's log ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LogEnd {
    /// After the last committed transaction there is nothing of a newer one.
    Clean,
    /// A newer transaction was being written when the crash came (normal; it is dropped).
    TornTail { tid: u64, pos: u64 },
    /// The log is damaged before its end: transactions from here on are not replayed.
    Corrupt { pos: u64, why: String },
}

/// What one area's log holds.
#[derive(Clone, Debug)]
pub struct AreaLog {
    pub superblock: Superblock,
    pub txs: Vec<RecoveredTx>,
    pub end: LogEnd,
    /// Log position just after the last committed transaction.
    pub end_pos: u64,
    /// The largest transaction id in any sealed log block of the area (new ids must exceed it).
    pub max_tid_seen: u64,
    /// Parsed without the attribute logs: the id of a Rio-ordered commit block that alone makes
    /// `end` [`LogEnd::Corrupt`]. Only the attribute log can say whether it is evidence of
    /// damage or the torn tail's own commit block, so [`apply_rio_prefix`] without attribute
    /// logs refuses it as it refuses a Rio-ordered transaction.
    pub rio_unvouched: Option<u64>,
}

/// Why a transaction did not check out.
struct Broken {
    /// Its id, when its first descriptor was readable.
    tid: Option<u64>,
    pos: u64,
    /// Its commit block, when it was found intact but the contents do not match it.
    commit: Option<CommitSeen>,
    why: String,
}

/// An intact commit block found past a broken transaction's contents.
#[derive(Clone, Copy)]
struct CommitSeen {
    /// Its Rio group, when it is a Rio-ordered commit.
    rio: Option<u64>,
    /// A one-write commit (written with the contents: it proves nothing about them).
    one_write: bool,
}

impl CommitSeen {
    fn of(h: &Header, b: &[u8]) -> CommitSeen {
        CommitSeen {
            rio: rio_group(h, b),
            one_write: h.flags & FLAG_ONE_WRITE != 0,
        }
    }
}

/// Parse area `index` from its bytes (superblock first, the whole area).
pub fn parse_area(area: &[u8], index: usize) -> Result<AreaLog, JournalError> {
    parse_area_rio(area, index, None)
}

/// The Rio group of a Rio-ordered commit block.
fn rio_group(h: &Header, b: &[u8]) -> Option<u64> {
    (h.kind == Kind::Commit && h.flags & FLAG_RIO != 0)
        .then(|| format::get_u64(b, format::HEADER + 8))
}

/// [`parse_area`] knowing where the area's Rio stream's durable prefix ends (`None`: unknown).
///
/// A Rio-ordered commit block is written together with its transaction's other blocks, so on
/// its own it proves nothing about them: an intact commit block past a broken transaction is
/// evidence of damage only when the attribute log shows its group durable. Without the
/// attribute log's word every commit block counts as evidence, as for the other modes.
pub fn parse_area_rio(
    area: &[u8],
    index: usize,
    prefix_end: Option<u64>,
) -> Result<AreaLog, JournalError> {
    let evidence = |rio: Option<u64>| match (rio, prefix_end) {
        (Some(g), Some(p)) => g < p,
        _ => true,
    };
    if area.len() < 2 * BLOCK || area.len() % BLOCK != 0 {
        return Err(JournalError::BadSuperblock {
            area: index,
            why: format!("an area of {} bytes is not two or more blocks", area.len()),
        });
    }
    let sb = Superblock::decode(&area[..BLOCK])
        .map_err(|why| JournalError::BadSuperblock { area: index, why })?;
    let blocks = (area.len() / BLOCK) as u64;
    if sb.area_blocks != blocks || sb.area_index as usize != index {
        return Err(JournalError::BadSuperblock {
            area: index,
            why: format!(
                "it describes area {} of {} blocks; the layout has area {index} of {blocks}",
                sb.area_index, sb.area_blocks
            ),
        });
    }
    let log_len = blocks - 1;
    let block = |pos: u64| {
        let at = (1 + (pos % log_len)) as usize * BLOCK;
        &area[at..at + BLOCK]
    };
    let mut txs = Vec::new();
    let mut pos = sb.tail_pos;
    let mut consumed = 0u64;
    let mut min_tid = sb.tail_tid;
    let broken = loop {
        match parse_tx(
            &block,
            pos,
            log_len,
            min_tid,
            log_len - consumed,
            index as u32,
        ) {
            Ok(Some(tx)) => {
                consumed += tx.blocks;
                pos = (pos + tx.blocks) % log_len;
                min_tid = tx.tid + 1;
                txs.push(tx);
            }
            Ok(None) => break None,
            Err(b) => break Some(b),
        }
    };
    let last_tid = txs.last().map_or(sb.tail_tid.saturating_sub(1), |t| t.tid);
    // Evidence of a newer transaction anywhere in the area, and the largest id written.
    let mut max_tid_seen = last_tid;
    let mut newer_commit: Option<u64> = None;
    // Whether a newer commit block is evidence on its own (not a Rio-ordered one taken on
    // trust for want of the attribute log), and the newest of those taken on trust.
    let mut newer_vouched = false;
    let mut newer_on_trust: Option<u64> = None;
    // The id of a one-write commit block that landed for the transaction the scan stopped at.
    let mut own_torn: Option<u64> = None;
    for p in 0..log_len {
        let b = block(p);
        if format::get_u32(b, 0) != format::LOG_MAGIC {
            continue;
        }
        let Some(h) = Header::read(b) else { continue };
        if h.area as usize != index {
            continue;
        }
        max_tid_seen = max_tid_seen.max(h.tid);
        let beyond = broken.as_ref().and_then(|b| b.tid).unwrap_or(last_tid);
        // A one-write commit block is written with its transaction's other blocks, so it proves
        // only the transactions before it: the commit of the transaction that should start
        // where the scan stopped (its descriptor lost, the commit landed) is that torn tail's.
        let own_torn_commit = h.flags & FLAG_ONE_WRITE != 0
            && (p + log_len - format::get_u32(b, format::HEADER) as u64 % log_len) % log_len == pos;
        if h.kind == Kind::Commit
            && h.tid > beyond
            && !own_torn_commit
            && evidence(rio_group(&h, b))
        {
            newer_commit = Some(p);
            if rio_group(&h, b).is_some() && prefix_end.is_none() {
                newer_on_trust = Some(newer_on_trust.map_or(h.tid, |t| t.max(h.tid)));
            } else {
                newer_vouched = true;
            }
        }
        if h.kind == Kind::Commit && h.tid > beyond && own_torn_commit {
            own_torn = Some(own_torn.map_or(h.tid, |t: u64| t.max(h.tid)));
        }
    }
    // A Corrupt verdict that rests on Rio-ordered commit blocks alone, without the attribute
    // log: the id of the newest such block.
    let own_on_trust = broken.as_ref().and_then(|b| {
        b.commit
            .filter(|c| !c.one_write && c.rio.is_some() && prefix_end.is_none())
            .and(b.tid)
    });
    // The broken transaction's own intact commit block, when not Rio-ordered, is evidence.
    let own_vouched = broken
        .as_ref()
        .is_some_and(|b| b.commit.is_some_and(|c| !c.one_write && c.rio.is_none()));
    let mut rio_unvouched = None;
    if !newer_vouched && !own_vouched {
        rio_unvouched = match (own_on_trust, newer_on_trust) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
    }
    let end = match broken {
        Some(b) if b.commit.is_some_and(|c| !c.one_write && evidence(c.rio)) => LogEnd::Corrupt {
            pos: b.pos,
            why: format!("{} (its commit block is intact)", b.why),
        },
        Some(b) if newer_commit.is_some() => LogEnd::Corrupt {
            pos: b.pos,
            why: format!(
                "{}, and a later transaction commits at log block {}",
                b.why,
                newer_commit.unwrap_or_default()
            ),
        },
        None if newer_commit.is_some() => LogEnd::Corrupt {
            pos,
            why: format!(
                "no valid descriptor at log block {pos}, but a later transaction commits at log block {}",
                newer_commit.unwrap_or_default()
            ),
        },
        Some(Broken { tid: Some(tid), .. }) => LogEnd::TornTail { tid, pos },
        // Nothing of the transaction's first block, but its one-write commit block landed: the
        // crash came while it was being written.
        _ if own_torn.is_some() => LogEnd::TornTail {
            tid: own_torn.unwrap_or_default(),
            pos,
        },
        _ => LogEnd::Clean,
    };
    if !matches!(end, LogEnd::Corrupt { .. }) {
        rio_unvouched = None;
    }
    Ok(AreaLog {
        superblock: sb,
        txs,
        end,
        end_pos: pos,
        max_tid_seen,
        rio_unvouched,
    })
}

/// Parse the transaction starting at log position `pos` of a log of `log_len` blocks: `Ok(None)`
/// when no newer transaction starts there.
fn parse_tx<'a>(
    block: &impl Fn(u64) -> &'a [u8],
    pos: u64,
    log_len: u64,
    min_tid: u64,
    room: u64,
    area: u32,
) -> Result<Option<RecoveredTx>, Broken> {
    let first = block(pos);
    let Some(h) = Header::read(first) else {
        return Ok(None);
    };
    if h.kind != Kind::Descriptor || h.tid < min_tid || h.area != area {
        return Ok(None);
    }
    let tid = h.tid;
    let file = (h.flags & FLAG_FILE_TX != 0).then_some(h.file);
    // The log position of the transaction's block `n` (it may wrap past the log's end).
    let at = |n: u64| (pos + n) % log_len;
    let broken = |n: u64, commit: Option<CommitSeen>, why: String| Broken {
        tid: Some(tid),
        pos: at(n),
        commit,
        why: format!("transaction {tid}: {why}"),
    };
    let mut chain = 0u32;
    let mut n = 0u64;
    let mut metas = Vec::new();
    let mut revokes = Vec::new();
    let mut seen_revoke = false;
    loop {
        if n >= room {
            return Err(broken(n, None, "runs past the end of the log".into()));
        }
        let b = block(pos + n);
        let h = Header::read(b).filter(|h| h.tid == tid && h.area == area);
        match h.map(|h| h.kind) {
            Some(Kind::Descriptor) if !seen_revoke => {
                let count = h.map_or(0, |h| h.count) as u64;
                chain = format::crc_chain(chain, b);
                n += 1;
                for i in 0..count {
                    if n >= room {
                        return Err(broken(n, None, "runs past the end of the log".into()));
                    }
                    let m = block(pos + n);
                    let (home, crc) = format::tag(b, i as usize);
                    let mut bytes = m.to_vec();
                    if format::tag_flags(b, i as usize) & format::TAG_ESCAPED != 0 {
                        format::unescape(&mut bytes);
                    }
                    if format::crc(&bytes) != crc {
                        let intact = commit_follows(block, pos + n, room - n, tid, area);
                        return Err(broken(
                            n,
                            intact,
                            format!("metadata block for home block {home} fails its checksum"),
                        ));
                    }
                    chain = format::crc_chain(chain, m);
                    metas.push((home, bytes));
                    n += 1;
                }
            }
            Some(Kind::Revoke) => {
                seen_revoke = true;
                let count = h.map_or(0, |h| h.count) as usize;
                for i in 0..count {
                    revokes.push(format::get_u64(b, format::HEADER + 8 * i));
                }
                chain = format::crc_chain(chain, b);
                n += 1;
            }
            Some(Kind::Commit) => {
                let blocks = format::get_u32(b, format::HEADER) as u64;
                let crc = format::get_u32(b, format::HEADER + 4);
                let seen = h.map(|h| CommitSeen::of(&h, b));
                let rio_group = seen.and_then(|c| c.rio);
                if blocks != n || crc != chain {
                    return Err(broken(
                        n,
                        seen,
                        format!(
                            "commit block says {blocks} blocks with checksum {crc:#x}, the log has {n} with {chain:#x}"
                        ),
                    ));
                }
                return Ok(Some(RecoveredTx {
                    tid,
                    area,
                    file,
                    metas,
                    revokes,
                    pos,
                    blocks: n + 1,
                    rio_group,
                }));
            }
            _ => {
                let intact = commit_follows(block, pos + n, room - n, tid, area);
                return Err(broken(
                    n,
                    intact,
                    format!(
                        "log block {} is not the next block of the transaction",
                        at(n)
                    ),
                ));
            }
        }
    }
}

/// Drop the Rio-ordered commits that the attribute logs do not show durable.
///
/// A Rio-ordered transaction's data, journal blocks and commit block go to the device together,
/// with no FLUSH between them, so an intact commit block alone does not prove the rest landed.
/// `prefix_end[area]` is where the area's stream's durable prefix ends (Rio recovery of the
/// area's attribute log): the area keeps its transactions up to the first whose commit group is
/// at or past it, and that one becomes the log's torn tail. Commits are durable one after the
/// other in an area, so nothing after it can be either. `None`: no attribute logs were given,
/// and a Rio-ordered commit is an error rather than replayed on trust. Returns how many
/// transactions were dropped.
///
/// Transactions below [`home_below`] are not looked at: a checkpoint wrote them home and made
/// that durable, so they need no log to vouch for them. (An area whose superblock a crash kept
/// from moving past them still lists them; they used to make `open` demand attribute logs.)
pub fn apply_rio_prefix(
    logs: &mut [AreaLog],
    prefix_end: Option<&[u64]>,
) -> Result<usize, JournalError> {
    check_rio_prefix(logs.len(), prefix_end)?;
    let home = home_below(logs.iter());
    let mut dropped = 0;
    for (i, l) in logs.iter_mut().enumerate() {
        if prefix_end.is_none() {
            // The log's end judged by a Rio-ordered commit block on trust: refused like one
            // of its transactions (with the attribute log it may be the torn tail's).
            if let Some(tid) = l.rio_unvouched.filter(|&t| t >= home) {
                if !l.txs.iter().any(|t| t.tid >= home && t.rio_group.is_some()) {
                    return Err(JournalError::RioLogsNeeded { area: i, tid });
                }
            }
        }
        let Some(cut) = l.txs.iter().position(|t| {
            t.tid >= home
                && t.rio_group
                    .is_some_and(|g| prefix_end.is_none_or(|p| g >= p[i]))
        }) else {
            continue;
        };
        let t = &l.txs[cut];
        if prefix_end.is_none() {
            return Err(JournalError::RioLogsNeeded {
                area: i,
                tid: t.tid,
            });
        }
        if !matches!(l.end, LogEnd::Corrupt { .. }) {
            l.end = LogEnd::TornTail {
                tid: t.tid,
                pos: t.pos,
            };
        }
        l.end_pos = t.pos;
        dropped += l.txs.len() - cut;
        l.txs.truncate(cut);
    }
    Ok(dropped)
}

/// Refuse Rio prefixes that are not one per journal area.
pub(crate) fn check_rio_prefix(
    areas: usize,
    prefix_end: Option<&[u64]>,
) -> Result<(), JournalError> {
    match prefix_end {
        Some(p) if p.len() != areas => Err(JournalError::Layout(format!(
            "{} Rio prefixes for {areas} journal areas",
            p.len()
        ))),
        _ => Ok(()),
    }
}

/// An intact commit block of `tid` within the next `room` log blocks.
fn commit_follows<'a>(
    block: &impl Fn(u64) -> &'a [u8],
    from: u64,
    room: u64,
    tid: u64,
    area: u32,
) -> Option<CommitSeen> {
    (0..room).find_map(|i| {
        let b = block(from + i);
        Header::read(b)
            .filter(|h| h.kind == Kind::Commit && h.tid == tid && h.area == area)
            .map(|h| CommitSeen::of(&h, b))
    })
}

/// Transactions below this id are home already: a checkpoint writes every committed block home
/// and makes it durable before it moves any area's tail, so the largest tail id of any area
/// covers all areas (even when a crash cut the checkpoint short between superblocks).
pub fn home_below<'a>(logs: impl IntoIterator<Item = &'a AreaLog>) -> u64 {
    logs.into_iter()
        .map(|l| l.superblock.tail_tid)
        .max()
        .unwrap_or(0)
}

/// The blocks to write home after merging every area's committed transactions with ids from
/// `from_tid` on: for each block the version of the newest transaction, unless a newer
/// transaction revoked it. Sorted by block number.
pub fn merge(logs: &[AreaLog], from_tid: u64) -> Vec<(u64, &[u8])> {
    let mut txs: Vec<&RecoveredTx> = logs
        .iter()
        .flat_map(|l| l.txs.iter())
        .filter(|t| t.tid >= from_tid)
        .collect();
    txs.sort_by_key(|t| t.tid);
    let mut newest: HashMap<u64, (u64, &[u8])> = HashMap::new();
    let mut revoked: HashMap<u64, u64> = HashMap::new();
    for t in txs {
        for &b in &t.revokes {
            revoked.insert(b, t.tid);
        }
        for (home, data) in &t.metas {
            newest.insert(*home, (t.tid, data));
        }
    }
    let mut out: Vec<(u64, &[u8])> = newest
        .into_iter()
        .filter(|(b, (tid, _))| revoked.get(b).is_none_or(|r| r <= tid))
        .map(|(b, (_, d))| (b, d))
        .collect();
    out.sort_by_key(|(b, _)| *b);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn area(index: u32, tail_tid: u64, txs: &[(u64, Option<u64>)]) -> AreaLog {
        AreaLog {
            superblock: Superblock {
                area_blocks: 64,
                area_index: index,
                area_count: 2,
                tail_pos: 0,
                tail_tid,
                generation: 1,
            },
            txs: txs
                .iter()
                .enumerate()
                .map(|(k, &(tid, rio_group))| RecoveredTx {
                    tid,
                    area: index,
                    file: None,
                    metas: Vec::new(),
                    revokes: Vec::new(),
                    pos: 2 * k as u64,
                    blocks: 2,
                    rio_group,
                })
                .collect(),
            end: LogEnd::Clean,
            end_pos: 2 * txs.len() as u64,
            max_tid_seen: txs.iter().map(|t| t.0).max().unwrap_or(0),
            rio_unvouched: None,
        }
    }

    /// A checkpoint moved area 1's superblock past its Rio-ordered commits (tail id 4), and a
    /// crash kept area 0's from moving: area 0 still lists Rio commits 1 and 3, though they are
    /// home. Opening without attribute logs must not ask for them (it returned
    /// `RioLogsNeeded`), and with them must not cut area 0's log at them.
    #[test]
    fn rio_commits_below_the_checkpoint_need_no_attribute_log() {
        let logs = || {
            vec![
                area(0, 1, &[(1, Some(1)), (3, Some(2)), (5, None)]),
                area(1, 4, &[(4, None)]),
            ]
        };
        let mut l = logs();
        assert_eq!(apply_rio_prefix(&mut l, None).unwrap(), 0);
        assert_eq!(l[0].txs.len(), 3);
        // Fresh attribute logs (nothing durable on them): still nothing to cut.
        let mut l = logs();
        assert_eq!(apply_rio_prefix(&mut l, Some(&[1, 1])).unwrap(), 0);
        assert_eq!(l[0].txs.len(), 3);
        // A Rio commit at or past the checkpoint still needs its log.
        let mut l = vec![
            area(0, 1, &[(1, Some(1)), (5, Some(2))]),
            area(1, 4, &[(4, None)]),
        ];
        assert!(matches!(
            apply_rio_prefix(&mut l, None),
            Err(JournalError::RioLogsNeeded { area: 0, tid: 5 })
        ));
        let mut l = vec![
            area(0, 1, &[(1, Some(1)), (5, Some(2))]),
            area(1, 4, &[(4, None)]),
        ];
        assert_eq!(apply_rio_prefix(&mut l, Some(&[2, 1])).unwrap(), 1);
        assert_eq!(l[0].txs.len(), 1);
    }
}
