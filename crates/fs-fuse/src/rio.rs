//! The Rio attribute logs of an aiosfs image (format version 2): one per journal area, in the
//! blocks between the journal and the data (`Superblock::rio_logs`).
//!
//! - `mkfs` formats every log empty;
//! - a worker of a `--commit rio` mount formats its area's log when it takes the area (the log a
//!   recovery read is spent once the journal is replayed) and commits through it
//!   ([`journal::Journal::with_rio`]);
//! - recovery (mount and fsck) reads every log, runs Rio recovery over it and keeps a Rio-ordered
//!   commit only where its area's log shows it durable ([`journal::rio_prefix`]).
//!
//! The logs are block logs ([`BlockPmr::on_device`]): this stack's devices have no persistent
//! memory region, so a log record is made durable with a FUA write of its block through the
//! worker's own ring (a SimDisk keeps it in its crash states like any other write).

use journal::rio_ordering::{self, AttrLog, BlockPmr, LogScan, MemPmr, OrderedConfig, Pmr};
use lbio::Device;

use crate::error::FsError;
use crate::format::Superblock;

/// A Rio handle's attribute log, whatever region backs it.
pub type RioLog = AttrLog<Box<dyn Pmr>>;

/// The ordered device's settings for a commit: its two groups (data and journal blocks, then
/// the commit block) go out as one batch, so the block log is written once in front of them.
pub fn ordered_config() -> OrderedConfig {
    OrderedConfig {
        batch: 2,
        ..OrderedConfig::default()
    }
}

/// Area `area`'s attribute log region, on `dev` (opened writable; the region keeps it), as it
/// is: [`journal::Journal::with_rio`] formats it once the area is the handle's.
pub fn log_region(sb: &Superblock, area: u32, dev: Device) -> Result<Box<dyn Pmr>, FsError> {
    let (at, len) = sb.rio_log(area).ok_or_else(no_logs)?;
    Ok(Box::new(BlockPmr::on_device(dev, at, len)?))
}

/// Format area `area`'s attribute log empty, on `dev` (opened writable; the log keeps it).
pub fn format_log(sb: &Superblock, area: u32, dev: Device) -> Result<RioLog, FsError> {
    let log = AttrLog::format(log_region(sb, area, dev)?, sb.journal_areas as u16)?;
    Ok(log)
}

/// Read every area's attribute log (`read(byte offset, bytes)`) and scan it. A log that does
/// not scan is named with its area.
pub fn scan_logs(
    sb: &Superblock,
    read: &mut dyn FnMut(u64, usize) -> Result<Vec<u8>, FsError>,
) -> Result<Vec<LogScan>, FsError> {
    (0..sb.journal_areas)
        .map(|a| {
            let (at, len) = sb.rio_log(a).ok_or_else(no_logs)?;
            let bytes = read(at, len)?;
            let mut pmr = MemPmr::new(len);
            pmr.bytes_mut().copy_from_slice(&bytes);
            rio_ordering::scan(&pmr).map_err(|e| {
                FsError::Damaged(format!("the attribute log of journal area {a}: {e}"))
            })
        })
        .collect()
}

/// Where each area's durable Rio prefix ends, from the areas' attribute logs (`plp`: the
/// device has power-loss protection). `None` for a version-1 image, which has no logs (and so
/// no Rio-ordered commits).
pub fn prefixes(
    sb: &Superblock,
    plp: bool,
    read: &mut dyn FnMut(u64, usize) -> Result<Vec<u8>, FsError>,
) -> Result<Option<Vec<u64>>, FsError> {
    if sb.rio_logs.count == 0 {
        return Ok(None);
    }
    let scans = scan_logs(sb, read)?;
    Ok(Some(journal::rio_prefix(&scans, plp)?))
}

pub(crate) fn no_logs() -> FsError {
    FsError::Config(
        "this image has no Rio attribute logs (aiosfs version 1, made by an older mkfs, or \
         more journal areas than a log has streams): Rio-ordered commits need an image made by \
         this mkfs with at most 64 journal areas; mount it with --commit overlapped, or make a \
         new one"
            .into(),
    )
}
