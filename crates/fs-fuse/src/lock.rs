//! The image lock. Whoever writes an image as a file system holds an exclusive advisory lock
//! on it for as long as it does: [`mount()`](crate::mount()) until its [`Mounted`] is dropped
//! (after `run` has unmounted), [`mkfs()`](crate::mkfs()) while it writes. The lock is
//! `flock(LOCK_EX | LOCK_NB)` on a descriptor of the image's own (a file, or a block device
//! node such as `/dev/loop0`), so taking it and refusing are one step in the kernel: of two
//! openers started at the same instant, one gets it and the other [`FsError::InUse`]. The
//! kernel lets go of it when the holder closes it or dies, SIGKILL included.
//!
//! `fsck()` takes no lock: it only reads, and it still runs under a live mount (whose
//! uncommitted changes it cannot see; `aios fsck` warns). [`Fs::open`](crate::Fs::open) takes
//! a device factory, not a path, and locks nothing: a caller that opens an image path itself
//! holds an [`ImageLock`] beside it.
//!
//! The lock is on the node named: a block device reached through two different device nodes
//! (not symlinks to one node, which are the same node) is two locks.
//!
//! [`Mounted`]: crate::Mounted

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::error::FsError;

/// An exclusive lock on an image, held until dropped (closing the descriptor lets go of it: no
/// unlock call that could fail in a drop).
#[derive(Debug)]
pub struct ImageLock {
    _file: File,
    path: PathBuf,
}

impl ImageLock {
    /// Lock `path` exclusively, without waiting: [`FsError::InUse`] when another holder has
    /// it (naming the image, and the holder's process when `/proc/locks` shows it).
    pub fn exclusive(path: &Path) -> Result<ImageLock, FsError> {
        let file = File::open(path).map_err(|e| FsError::io(path, e))?;
        // nix's `flock` function, not its `Flock` guard, which nix prefers: the guard's drop
        // unlocks and panics when that fails (an NFS server error, say), where closing the
        // descriptor lets go of the lock in any case. (`File::try_lock` is newer than this
        // workspace's minimum Rust.)
        #[allow(deprecated)]
        let locked = nix::fcntl::flock(
            file.as_raw_fd(),
            nix::fcntl::FlockArg::LockExclusiveNonblock,
        );
        match locked {
            Ok(()) => Ok(ImageLock {
                _file: file,
                path: path.to_path_buf(),
            }),
            Err(nix::errno::Errno::EWOULDBLOCK) => Err(FsError::InUse {
                image: path.display().to_string(),
                holder: holder_of(&file),
            }),
            Err(e) => Err(FsError::io(path, std::io::Error::from(e))),
        }
    }

    /// The image locked.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The process holding the exclusive `flock` on the file open as `file`, from `/proc/locks`
/// (lines such as `1: FLOCK  ADVISORY  WRITE 4242 08:01:1234 0 EOF`: kind, access, process,
/// device major:minor in hex and inode of the locked node). `None` where it is not there or
/// the process is not visible from here (another pid namespace).
fn holder_of(file: &File) -> Option<u32> {
    let m = file.metadata().ok()?;
    let dev = m.dev();
    // glibc's gnu_dev_major / gnu_dev_minor.
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    let want = format!("{major:02x}:{minor:02x}:{}", m.ino());
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    locks.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        // Waiters are listed as "N: -> FLOCK ...".
        match f.as_slice() {
            [_, "FLOCK", _, "WRITE", pid, at, ..] if *at == want => {
                pid.parse::<u32>().ok().filter(|&p| p > 0)
            }
            _ => None,
        }
    })
}
