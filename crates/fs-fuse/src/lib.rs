//! aiosfs: the file system of the aios stack, to be mounted through FUSE.
//!
//! **Built so far:** the on-disk format ([`format`]: a checksummed, versioned superblock with a
//! backup, inode and block bitmaps, an inode table whose inodes hold their extent maps,
//! checksummed directory blocks, per-core journal areas in the `journal` crate's format),
//! [`mkfs`] and [`fsck`]. **Not built yet:** the mount (`aios mount`, FUSE), everything that
//! changes a file system after mkfs, and the benchmarks — see the README.
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
pub mod mkfs;
pub mod mount;

pub use error::FsError;
pub use fs::{Fs, FsOptions};
pub use fsck::{fsck, fsck_image, read_superblock, Report};
pub use mkfs::{mkfs, MkfsOptions};
pub use mount::{mount, MountOptions, Mounted};
