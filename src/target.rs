//! The device a command runs on: the `ull` loop device, a file the command creates, or a path
//! the user named. Whatever the command created is removed when the target is dropped.

use std::path::{Path, PathBuf};

use crate::bench::cleanup::{self, Undo};
use crate::bench::ull::{fill_file, UllDevice, ULL_BYTES};
use crate::bench::BenchError;

/// A device prepared for a run.
#[derive(Debug)]
pub enum Target {
    /// The loop-over-/dev/shm device (detached on drop).
    Ull(UllDevice),
    /// A file this run created and filled (removed on drop, or on SIGINT/SIGTERM).
    Created(PathBuf, Undo),
    /// A path the user named; never removed.
    Existing(PathBuf),
}

/// Create `path` with `bytes` of data, removed when the returned [`Target`] is dropped, when
/// the filling fails, or when the process is interrupted (also while it is being filled).
fn created(path: PathBuf, bytes: u64) -> Result<Target, BenchError> {
    let undo = cleanup::remove_file("a file the bench created", &path);
    fill_file(&path, bytes)?;
    Ok(Target::Created(path, undo))
}

impl Target {
    /// `ull` → create the loop device; an existing path → use it; a missing path whose parent
    /// exists → create a file of `create_bytes` filled with data.
    pub fn prepare(spec: &str, create_bytes: u64) -> Result<Target, BenchError> {
        if spec == "ull" {
            return Ok(Target::Ull(UllDevice::create(ULL_BYTES)?));
        }
        let path = PathBuf::from(spec);
        // Not `exists()`, which follows a symbolic link: a dangling one would count as new, the
        // file it names would be created through it, and the removal on drop would take the
        // link only, leaving that file behind. A link, dangling or not, is the user's path.
        if path.symlink_metadata().is_ok() {
            return Ok(Target::Existing(path));
        }
        let parent = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        if !parent.is_dir() {
            return Err(BenchError::Setup(format!(
                "{spec}: no such device or file, and {} is not a directory to create it in",
                parent.display()
            )));
        }
        created(path, create_bytes)
    }

    /// A scratch file of `bytes` in `dir`, created and filled now.
    pub fn scratch(dir: &Path, name: &str, bytes: u64) -> Result<Target, BenchError> {
        created(
            dir.join(format!("{name}-{}.img", std::process::id())),
            bytes,
        )
    }

    /// The path to open.
    pub fn path(&self) -> &Path {
        match self {
            Target::Ull(u) => u.path(),
            Target::Created(p, _) | Target::Existing(p) => p,
        }
    }

    /// Whether this run created the device (so writing to it destroys nobody's data).
    pub fn created_here(&self) -> bool {
        !matches!(self, Target::Existing(_))
    }

    /// A short description for reports.
    pub fn describe(&self) -> String {
        match self {
            Target::Ull(u) => format!(
                "ull: {} (loop, direct-io, over a 1 GiB image in /dev/shm)",
                u.path().display()
            ),
            Target::Created(p, _) => format!("{} (scratch file created for this run)", p.display()),
            Target::Existing(p) => p.display().to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `--device` that is a dangling symbolic link is the user's path, used as it is (opening
    /// it then fails): the bench neither creates the file it names through it nor leaves such a
    /// file behind. Before, the link counted as a new path: the bench filled the named file
    /// through the link and, on drop, removed the link and left the file.
    #[test]
    fn a_dangling_symlink_is_not_a_new_path() {
        let dir = std::env::temp_dir().join(format!("aios-target-link-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let named = dir.join("named.img");
        let link = dir.join("link");
        std::os::unix::fs::symlink(&named, &link).unwrap();
        let t = Target::prepare(link.to_str().unwrap(), 4096).unwrap();
        let existing = !t.created_here();
        drop(t);
        let left = named.exists();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(existing, "a dangling link was taken for a path to create");
        assert!(!left, "the file the link names was created and left behind");
    }
}
