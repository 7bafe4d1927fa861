//! Errors.

/// What can go wrong, with the value and the way out.
#[derive(Debug, thiserror::Error)]
pub enum RioError {
    /// Bad settings (names the value and the limit).
    #[error("{0}")]
    Config(String),
    /// The attribute log has no free slot: its entries still matter to recovery until their
    /// groups are durable. Wait for completions (and, without power-loss protection, a FLUSH).
    #[error(
        "the attribute log is full ({slots} slots in use by groups not yet durable): wait for \
         durability, or give the log more room"
    )]
    LogFull { slots: u32 },
    /// The engine or a device refused.
    #[error(transparent)]
    Lbio(#[from] lbio::LbioError),
    #[error(transparent)]
    Core(#[from] aios_core::CoreError),
    /// A damaged log or entry.
    #[error("attribute log damaged: {0}")]
    Corrupt(String),
    /// A group whose requests overlap one another (their order inside a group is free, so
    /// overlapping writes would have no defined result).
    #[error(
        "stream {stream}, group {seq}: bytes {offset}..{end} on target {target} overlap another \
         write of the same group; put them in different groups"
    )]
    OverlapInGroup {
        stream: u16,
        seq: u64,
        target: u16,
        offset: u64,
        end: u64,
    },
}
