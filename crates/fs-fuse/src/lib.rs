//! aiosfs: the file system of the aios stack, mounted through FUSE.
//!
//! - [`format`](mod@format): the on-disk format (a checksummed, versioned superblock with a backup, inode
//!   and block bitmaps, an inode table whose inodes hold their extent maps or extent leaves,
//!   checksummed directory, leaf and xattr blocks, per-core journal areas in the `journal`
//!   crate's format);
//! - [`mkfs()`] and [`fsck()`];
//! - [`ImageLock`]: the exclusive lock `mount()` and `mkfs()` hold on the image they write, so a
//!   second one is refused ([`FsError::InUse`]);
//! - [`fs::Fs`]: the mounted file system (in-memory metadata committed through the journal,
//!   fsync as one overlapped commit), with no FUSE types, so it also runs on a SimDisk;
//! - [`mount()`]: the FUSE adapter (fuser, one worker per core), and [`ring`]: FUSE over
//!   io_uring (one queue thread per CPU) where the kernel offers it.
//!
//! - [`rio`]: the Rio attribute logs of a version-2 image, for Rio-ordered commits
//!   (`FsOptions::rio`, `aios mount --commit rio`).
//!
//! ```no_run
//! use fs_fuse::{fsck, mkfs, MkfsOptions};
//! # fn main() -> Result<(), fs_fuse::FsError> {
//! let path = std::path::Path::new("/var/tmp/aiosfs.img");
//! std::fs::File::create(path).unwrap().set_len(256 << 20).unwrap();
//! let sb = mkfs(path, &MkfsOptions::default())?;
//! let report = fsck(path)?;
//! assert!(report.clean(), "{:?}", report.problems);
//! println!("{} blocks, {} inodes", sb.blocks, sb.inodes);
//! # Ok(()) }
//! ```

#![forbid(unsafe_code)]

mod error;
pub mod format;
pub mod fs;
pub mod fsck;
pub mod lock;
pub mod mkfs;
pub mod mount;
pub mod ring;
pub mod rio;

pub use error::FsError;
pub use fs::{Fs, FsOptions};
pub use fsck::{fsck, fsck_image, read_superblock, Report};
pub use lock::ImageLock;
pub use mkfs::{mkfs, MkfsOptions};
pub use mount::{mount, MountOptions, Mounted, Transport, REQUEST_SPIN};
