//! Errors.

use crate::pdu::PduError;

/// What can go wrong on the network side, with the peer and the way out.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("{0}")]
    Config(String),
    /// A socket call failed.
    #[error("{what} {peer}: {source}")]
    Io {
        what: &'static str,
        peer: String,
        #[source]
        source: std::io::Error,
    },
    /// The peer sent something the protocol does not allow.
    #[error("{peer}: {source}")]
    Protocol {
        peer: String,
        #[source]
        source: PduError,
    },
    /// The peer answered a command with an error status.
    #[error("{peer}: {what} failed with status type {sct:#x} code {sc:#04x}")]
    Status {
        peer: String,
        what: String,
        sct: u8,
        sc: u8,
    },
    /// The peer said something unexpected (out of sequence, wrong size...).
    #[error("{peer}: {msg}")]
    Peer { peer: String, msg: String },
    /// A target stayed unreachable.
    #[error("target {peer} unreachable for {secs:.1} s: {why}")]
    Unreachable {
        peer: String,
        secs: f64,
        why: String,
    },
    #[error(transparent)]
    Rio(#[from] rio_ordering::RioError),
    #[error(transparent)]
    Lbio(#[from] lbio::LbioError),
    #[error(transparent)]
    Core(#[from] aios_core::CoreError),
}

impl NetError {
    pub(crate) fn io(what: &'static str, peer: impl ToString, source: std::io::Error) -> NetError {
        NetError::Io {
            what,
            peer: peer.to_string(),
            source,
        }
    }
    pub(crate) fn peer(peer: impl ToString, msg: impl Into<String>) -> NetError {
        NetError::Peer {
            peer: peer.to_string(),
            msg: msg.into(),
        }
    }
}
