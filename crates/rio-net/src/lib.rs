//! Rio over the network (EuroSys'23, §4.3–§4.5): ordered writes to several target servers over
//! NVMe/TCP, with Rio's ordering attribute in reserved dwords of the commands.
//!
//! - [`pdu`]: the NVMe/TCP PDUs and the attribute's wire form.
//! - [`Target`]: a target server over any lbio device, with its attribute log.
//! - [`Volume`]: the initiator — a volume striped over targets, one connection per stream and
//!   target, in-order completion, reconnection, and recovery.

// Only the RDMA transport (verbs through FFI) needs `unsafe`; it opts in module-wide.
#![deny(unsafe_code)]

pub mod conn;
mod error;
mod initiator;
pub mod pdu;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod target;

pub use conn::Transport;
pub use error::NetError;
pub use initiator::{
    Done, RecoveryReport, Volume, VolumeConfig, VolumeStats, HELD_PER_WINDOW, MAX_PIECES,
};
pub use target::{Target, TargetConfig, TargetLogKind, TargetStats, TargetStatsHandle};
