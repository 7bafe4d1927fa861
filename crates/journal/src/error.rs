//! Typed journal errors, each naming the wrong value and what would be right.

use lbio::LbioError;

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// A journal area cannot hold even the smallest transaction next to its superblock.
    #[error("journal area {area} has {blocks} blocks; it needs at least {needed} (a superblock and a log that holds one transaction)")]
    RegionTooSmall {
        area: usize,
        blocks: u64,
        needed: u64,
    },
    /// The layout itself is unusable (overlapping or misaligned areas, none at all).
    #[error("invalid journal layout: {0}")]
    Layout(String),
    /// A transaction needs more log blocks than its area's log has.
    #[error("transaction needs {needed} log blocks but the journal area's log has {log_blocks}: split it or give the area more blocks")]
    TxTooLarge { needed: u64, log_blocks: u64 },
    /// A transaction with nothing in it.
    #[error("empty transaction: add data, metadata or a revoke before committing")]
    EmptyTx,
    /// A block buffer that is not exactly one journal block.
    #[error("block {block}: {len} bytes given, a journal block is 4096")]
    BlockLen { block: u64, len: usize },
    /// A home block inside a journal area or past the device's end.
    #[error("block {block} is not a home block: {why}")]
    NotHomeBlock { block: u64, why: String },
    /// An in-place data write to a block whose journaled metadata is not checkpointed yet (its
    /// replay would overwrite the data): revoke it in the same transaction first.
    #[error("block {block} holds journaled metadata not yet checkpointed: revoke it in this transaction before writing data to it")]
    DataOverJournaledBlock { block: u64 },
    /// An area's superblock is unreadable.
    #[error("journal area {area}: bad superblock: {why}")]
    BadSuperblock { area: usize, why: String },
    /// An earlier commit or checkpoint failed part-way; reopen the journal (recovery) to go on.
    #[error("the journal was aborted by an earlier failed commit or checkpoint: reopen it with JournalSet::open to recover")]
    Aborted,
    /// This commit went out in a group commit led by another thread's commit, and the group
    /// failed with the leader's error, whose text is `cause` (the error itself is the
    /// leader's). `aborted`: the failure aborted the journal set, as with
    /// [`JournalError::Aborted`] (reopen it to recover); otherwise nothing of the group was
    /// written, no id was taken, and the commit may be made again.
    #[error("the group commit that carried this transaction failed{}: {cause}", group_outcome(*aborted))]
    GroupFailed { cause: String, aborted: bool },
    /// Area `area` holds a Rio-ordered commit, which only the attribute logs can vouch for.
    #[error("journal area {area}: transaction {tid} was committed with Rio ordering; recover it with its attribute logs (JournalSet::open_rio, recover_image_rio)")]
    RioLogsNeeded { area: usize, tid: u64 },
    /// The Rio ordered device failed (attribute log, ordered writes, FLUSH).
    #[error("Rio ordering: {0}")]
    Rio(#[from] rio_ordering::RioError),
    /// The device failed a request.
    #[error(transparent)]
    Io(#[from] LbioError),
    #[error(transparent)]
    Core(#[from] aios_core::CoreError),
}

fn group_outcome(aborted: bool) -> &'static str {
    if aborted {
        " and aborted the journal (reopen it with JournalSet::open to recover)"
    } else {
        " before writing anything (commit again)"
    }
}
