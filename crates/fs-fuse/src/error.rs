//! Errors, each saying what was found and, where there is one, the way out.

#[derive(Debug, thiserror::Error)]
pub enum FsError {
    #[error("{0}")]
    Config(String),
    #[error("an image of {bytes} bytes is too small: {why}")]
    TooSmall { bytes: u64, why: String },
    /// Not an aiosfs image at all (nothing is changed on it).
    #[error("not an aiosfs image: {0}")]
    Foreign(String),
    /// An aiosfs image of a format or block size this build does not read.
    #[error("unsupported aiosfs image: {0}")]
    Unsupported(String),
    /// An aiosfs image whose structures do not check out.
    #[error("damaged aiosfs image: {0}")]
    Damaged(String),
    /// Another mount or mkfs holds the image's lock ([`crate::ImageLock`]); nothing was
    /// written.
    #[error("{image}: in use: another aiosfs mount or mkfs holds its lock{}", holder_text(*.holder))]
    InUse {
        image: String,
        /// The holding process, when `/proc/locks` shows it.
        holder: Option<u32>,
    },
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Lbio(#[from] lbio::LbioError),
    #[error(transparent)]
    Core(#[from] aios_core::CoreError),
    #[error(transparent)]
    Journal(#[from] journal::JournalError),
    #[error(transparent)]
    Rio(#[from] journal::rio_ordering::RioError),
}

fn holder_text(holder: Option<u32>) -> String {
    holder.map_or(String::new(), |p| format!(" (process {p})"))
}

impl FsError {
    pub(crate) fn io(path: &std::path::Path, source: std::io::Error) -> FsError {
        FsError::Io {
            path: path.display().to_string(),
            source,
        }
    }
}
