//! Backends of the attribute log's persistent region besides [`MemPmr`](crate::MemPmr):
//!
//! - [`NvmePmr`](aios_core::pmr::NvmePmr): the controller's PMR, the hardware Rio keeps its
//!   attributes in; every [`Pmr::persist`] is a persistent MMIO write (the writes, then the reads
//!   the controller names as its write barrier).
//! - [`FilePmr`]: persistent memory **emulated** in a small file: `pwrite` then `fdatasync` per
//!   persist. It survives a process crash (and a power cut, if the file system honours
//!   `fdatasync`), at the cost of a system call pair per attribute.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use aios_core::pmr::NvmePmr;

use crate::error::RioError;
use crate::log::Pmr;

impl Pmr for NvmePmr {
    fn len(&self) -> usize {
        NvmePmr::len(self)
    }
    fn persist(&mut self, offset: usize, bytes: &[u8]) -> Result<(), RioError> {
        Ok(NvmePmr::persist(self, offset, bytes)?)
    }
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), RioError> {
        Ok(NvmePmr::read(self, offset, out)?)
    }
}

/// Persistent memory emulated in a file (see the module documentation).
#[derive(Debug)]
pub struct FilePmr {
    file: File,
    path: PathBuf,
    len: usize,
}

impl FilePmr {
    /// Opens `path`, creating it with `len` zero bytes when it does not exist. An existing file
    /// keeps its contents and its size (`len` must then match it).
    pub fn open(path: &Path, len: usize) -> Result<FilePmr, RioError> {
        let io = |e: std::io::Error| RioError::Config(format!("{}: {e}", path.display()));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(io)?;
        let have = file.metadata().map_err(io)?.len() as usize;
        if have == 0 {
            file.set_len(len as u64).map_err(io)?;
            file.sync_all().map_err(io)?;
        } else if have != len {
            return Err(RioError::Config(format!(
                "{} holds {have} bytes, not the {len} asked for: give its size, or another path",
                path.display()
            )));
        }
        Ok(FilePmr {
            file,
            path: path.to_path_buf(),
            len,
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Pmr for FilePmr {
    fn len(&self) -> usize {
        self.len
    }
    fn persist(&mut self, offset: usize, bytes: &[u8]) -> Result<(), RioError> {
        check(offset, bytes.len(), self.len)?;
        let io = |e: std::io::Error| RioError::Config(format!("{}: {e}", self.path.display()));
        self.file.write_all_at(bytes, offset as u64).map_err(io)?;
        self.file.sync_data().map_err(io)
    }
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), RioError> {
        check(offset, out.len(), self.len)?;
        self.file
            .read_exact_at(out, offset as u64)
            .map_err(|e| RioError::Config(format!("{}: {e}", self.path.display())))
    }
}

fn check(offset: usize, len: usize, size: usize) -> Result<(), RioError> {
    match offset.checked_add(len) {
        Some(e) if e <= size => Ok(()),
        _ => Err(RioError::Config(format!(
            "persistent-memory access at {offset}+{len} past its {size} bytes"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{scan, Attr, AttrLog};

    #[test]
    fn a_file_log_survives_closing_and_reopening_the_file() {
        let dir = std::env::temp_dir().join(format!("rio-filepmr-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("attrs");
        let _ = std::fs::remove_file(&path);
        {
            let mut log = AttrLog::format(FilePmr::open(&path, 16 << 10).unwrap(), 1).unwrap();
            let a = Attr {
                seq: 1,
                seq_end: 1,
                len: 4096,
                boundary: true,
                num: 1,
                members: 1,
                ..Attr::default()
            };
            let s = log.append(&a).unwrap();
            log.set_persist(s, 1).unwrap();
        }
        let pmr = FilePmr::open(&path, 16 << 10).unwrap();
        let sc = scan(&pmr).unwrap();
        assert_eq!(sc.entries.len(), 1);
        assert!(sc.entries[0].1.persist);
        let e = FilePmr::open(&path, 8 << 10).unwrap_err();
        assert!(e.to_string().contains("16384 bytes"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
