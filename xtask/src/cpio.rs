//! A writer for the uncompressed `newc` cpio format, the one the kernel unpacks as an initramfs.
//!
//! Each entry is a 110-byte ASCII header (`070701` and thirteen 8-digit hex fields), the NUL-terminated
//! name padded so that header + name is a multiple of 4, then the data padded to a multiple of 4. The
//! archive ends with an entry named `TRAILER!!!`. Entries are written in path order, so every directory
//! comes before what it contains.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Read, Write};
use std::path::PathBuf;

pub const S_IFDIR: u32 = 0o040_000;
pub const S_IFREG: u32 = 0o100_000;
pub const S_IFLNK: u32 = 0o120_000;
pub const S_IFCHR: u32 = 0o020_000;

pub const MAGIC: &str = "070701";
pub const HEADER_LEN: usize = 110;
pub const TRAILER: &str = "TRAILER!!!";

/// Where a regular file's bytes come from.
pub enum Data {
    Bytes(Vec<u8>),
    /// Read when the archive is written.
    Path(PathBuf),
}

enum Node {
    Dir { mode: u32 },
    File { mode: u32, data: Data },
    Symlink { target: String },
    CharDev { mode: u32, major: u32, minor: u32 },
}

/// An archive being assembled in memory (file contents stay on disk until written).
#[derive(Default)]
pub struct Archive {
    nodes: BTreeMap<String, Node>,
}

/// `/a//b/` → `a/b`; refuses empty paths and `.`/`..` components.
fn normalize(path: &str) -> Result<String, String> {
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    if parts.is_empty() || parts.iter().any(|p| *p == "." || *p == "..") {
        return Err(format!("bad archive path {path:?}"));
    }
    Ok(parts.join("/"))
}

impl Archive {
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of entries, directories included (the trailer is not counted).
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    fn ensure_parents(&mut self, path: &str) -> Result<(), String> {
        let mut end = 0;
        while let Some(i) = path[end..].find('/') {
            let dir = &path[..end + i];
            match self.nodes.get(dir) {
                None => {
                    self.nodes
                        .insert(dir.to_string(), Node::Dir { mode: 0o755 });
                }
                Some(Node::Dir { .. }) => {}
                Some(_) => return Err(format!("{dir} is not a directory in the archive")),
            }
            end += i + 1;
        }
        Ok(())
    }

    fn insert(&mut self, path: &str, node: Node) -> Result<(), String> {
        let path = normalize(path)?;
        self.ensure_parents(&path)?;
        if let (Some(Node::Dir { .. }), false) =
            (self.nodes.get(&path), matches!(node, Node::Dir { .. }))
        {
            return Err(format!("{path} is already a directory in the archive"));
        }
        self.nodes.insert(path, node);
        Ok(())
    }

    pub fn dir(&mut self, path: &str, mode: u32) -> Result<(), String> {
        self.insert(path, Node::Dir { mode })
    }

    /// Adds (or replaces) a regular file; missing parent directories are created with mode 0755.
    pub fn file(&mut self, path: &str, mode: u32, data: Data) -> Result<(), String> {
        self.insert(path, Node::File { mode, data })
    }

    pub fn symlink(&mut self, path: &str, target: &str) -> Result<(), String> {
        self.insert(
            path,
            Node::Symlink {
                target: target.to_string(),
            },
        )
    }

    pub fn char_dev(
        &mut self,
        path: &str,
        mode: u32,
        major: u32,
        minor: u32,
    ) -> Result<(), String> {
        self.insert(path, Node::CharDev { mode, major, minor })
    }

    /// Writes the archive; returns the number of bytes written.
    pub fn write_to<W: Write>(&self, out: W) -> io::Result<u64> {
        let mut w = Counting {
            inner: out,
            count: 0,
        };
        for (ino, (name, node)) in self.nodes.iter().enumerate() {
            let ino = ino as u32 + 1;
            match node {
                Node::Dir { mode } => {
                    header(
                        &mut w,
                        &Header {
                            ino,
                            mode: S_IFDIR | mode,
                            nlink: 2,
                            ..Header::new(name)
                        },
                    )?;
                }
                Node::Symlink { target } => {
                    let h = Header {
                        ino,
                        mode: S_IFLNK | 0o777,
                        filesize: target.len() as u32,
                        ..Header::new(name)
                    };
                    header(&mut w, &h)?;
                    w.write_all(target.as_bytes())?;
                    pad(&mut w, target.len())?;
                }
                Node::CharDev { mode, major, minor } => {
                    let h = Header {
                        ino,
                        mode: S_IFCHR | mode,
                        rdevmajor: *major,
                        rdevminor: *minor,
                        ..Header::new(name)
                    };
                    header(&mut w, &h)?;
                }
                Node::File {
                    mode,
                    data: Data::Bytes(bytes),
                } => {
                    header(
                        &mut w,
                        &Header {
                            ino,
                            mode: S_IFREG | mode,
                            filesize: size32(bytes.len() as u64, name)?,
                            ..Header::new(name)
                        },
                    )?;
                    w.write_all(bytes)?;
                    pad(&mut w, bytes.len())?;
                }
                Node::File {
                    mode,
                    data: Data::Path(src),
                } => {
                    let mut f = File::open(src).map_err(|e| annotate(e, src))?;
                    let len = f.metadata().map_err(|e| annotate(e, src))?.len();
                    header(
                        &mut w,
                        &Header {
                            ino,
                            mode: S_IFREG | mode,
                            filesize: size32(len, name)?,
                            ..Header::new(name)
                        },
                    )?;
                    let copied = io::copy(&mut (&mut f).take(len), &mut w)?;
                    if copied != len {
                        return Err(io::Error::other(format!(
                            "{} shrank while being archived",
                            src.display()
                        )));
                    }
                    pad(&mut w, len as usize)?;
                }
            }
        }
        header(
            &mut w,
            &Header {
                nlink: 1,
                ..Header::new(TRAILER)
            },
        )?;
        w.flush()?;
        Ok(w.count)
    }
}

fn annotate(e: io::Error, path: &std::path::Path) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

fn size32(len: u64, name: &str) -> io::Result<u32> {
    u32::try_from(len)
        .map_err(|_| io::Error::other(format!("{name} is too large for a newc archive")))
}

/// The header fields this writer varies; uid, gid, mtime, dev and check are always 0.
struct Header<'a> {
    name: &'a str,
    ino: u32,
    mode: u32,
    nlink: u32,
    filesize: u32,
    rdevmajor: u32,
    rdevminor: u32,
}

impl<'a> Header<'a> {
    fn new(name: &'a str) -> Self {
        Header {
            name,
            ino: 0,
            mode: 0,
            nlink: 1,
            filesize: 0,
            rdevmajor: 0,
            rdevminor: 0,
        }
    }
}

fn header<W: Write>(w: &mut W, h: &Header) -> io::Result<()> {
    let namesize = h.name.len() + 1;
    let fields = [
        h.ino,
        h.mode,
        0,
        0,
        h.nlink,
        0,
        h.filesize,
        0,
        0,
        h.rdevmajor,
        h.rdevminor,
        namesize as u32,
        0,
    ];
    let mut text = String::with_capacity(HEADER_LEN);
    text.push_str(MAGIC);
    for f in fields {
        text.push_str(&format!("{f:08X}"));
    }
    debug_assert_eq!(text.len(), HEADER_LEN);
    w.write_all(text.as_bytes())?;
    w.write_all(h.name.as_bytes())?;
    w.write_all(&[0])?;
    pad(w, HEADER_LEN + namesize)
}

/// Zero bytes that bring `len` up to a multiple of 4.
fn pad<W: Write>(w: &mut W, len: usize) -> io::Result<()> {
    let n = (4 - len % 4) % 4;
    w.write_all(&[0u8; 3][..n])
}

struct Counting<W> {
    inner: W,
    count: u64,
}

impl<W: Write> Write for Counting<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.count += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// One entry read back from an archive (tests only).
#[cfg(test)]
#[derive(Debug)]
pub struct Entry {
    pub name: String,
    pub ino: u32,
    pub mode: u32,
    pub nlink: u32,
    pub rdev: (u32, u32),
    pub data: Vec<u8>,
}

/// Reads a newc archive back, checking the magic, field syntax and padding; stops at the trailer.
#[cfg(test)]
pub fn parse(buf: &[u8]) -> Result<Vec<Entry>, String> {
    let mut pos = 0;
    let mut out = Vec::new();
    loop {
        if pos % 4 != 0 {
            return Err(format!("header at {pos} is not 4-aligned"));
        }
        let head = buf.get(pos..pos + HEADER_LEN).ok_or("truncated header")?;
        let head = std::str::from_utf8(head).map_err(|e| e.to_string())?;
        if &head[..6] != MAGIC {
            return Err(format!("bad magic at {pos}: {:?}", &head[..6]));
        }
        let field = |i: usize| {
            u32::from_str_radix(&head[6 + 8 * i..14 + 8 * i], 16).map_err(|e| e.to_string())
        };
        let (ino, mode, nlink, filesize) = (field(0)?, field(1)?, field(4)?, field(6)? as usize);
        let rdev = (field(9)?, field(10)?);
        let namesize = field(11)? as usize;
        let name_at = pos + HEADER_LEN;
        let name = buf
            .get(name_at..name_at + namesize)
            .ok_or("truncated name")?;
        if name.last() != Some(&0) {
            return Err("name is not NUL-terminated".into());
        }
        let name = String::from_utf8(name[..namesize - 1].to_vec()).map_err(|e| e.to_string())?;
        let data_at = (name_at + namesize).next_multiple_of(4);
        if buf[name_at + namesize..data_at].iter().any(|b| *b != 0) {
            return Err("non-zero name padding".into());
        }
        let data = buf
            .get(data_at..data_at + filesize)
            .ok_or("truncated data")?
            .to_vec();
        pos = (data_at + filesize).next_multiple_of(4);
        if buf
            .get(data_at + filesize..pos)
            .ok_or("truncated padding")?
            .iter()
            .any(|b| *b != 0)
        {
            return Err("non-zero data padding".into());
        }
        if name == TRAILER {
            if pos != buf.len() {
                return Err(format!("{} bytes after the trailer", buf.len() - pos));
            }
            return Ok(out);
        }
        out.push(Entry {
            name,
            ino,
            mode,
            nlink,
            rdev,
            data,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn build(a: &Archive) -> Vec<u8> {
        let mut buf = Vec::new();
        let n = a.write_to(&mut buf).unwrap();
        assert_eq!(n as usize, buf.len());
        buf
    }

    #[test]
    fn round_trip_of_every_kind() {
        let mut a = Archive::new();
        a.file("/bin/busybox", 0o755, Data::Bytes(b"\x7fELF12345".to_vec()))
            .unwrap();
        a.symlink("/bin/sh", "busybox").unwrap();
        a.char_dev("/dev/console", 0o600, 5, 1).unwrap();
        a.dir("/proc", 0o555).unwrap();
        a.file("init", 0o755, Data::Bytes(b"#!/bin/sh\n".to_vec()))
            .unwrap();
        let buf = build(&a);
        assert_eq!(buf.len() % 4, 0);
        let entries = parse(&buf).unwrap();
        let names: Vec<&str> = entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "bin",
                "bin/busybox",
                "bin/sh",
                "dev",
                "dev/console",
                "init",
                "proc"
            ]
        );
        let get = |n: &str| entries.iter().find(|e| e.name == n).unwrap();
        assert_eq!(get("bin").mode, S_IFDIR | 0o755);
        assert_eq!(get("bin").nlink, 2);
        assert_eq!(get("proc").mode, S_IFDIR | 0o555);
        assert_eq!(get("bin/busybox").mode, S_IFREG | 0o755);
        assert_eq!(get("bin/busybox").data, b"\x7fELF12345");
        assert_eq!(get("bin/sh").mode, S_IFLNK | 0o777);
        assert_eq!(get("bin/sh").data, b"busybox");
        assert_eq!(get("dev/console").mode, S_IFCHR | 0o600);
        assert_eq!(get("dev/console").rdev, (5, 1));
        assert!(get("dev/console").data.is_empty());
        let mut inos: Vec<u32> = entries.iter().map(|e| e.ino).collect();
        inos.dedup();
        assert_eq!(inos.len(), entries.len(), "inode numbers are distinct");
    }

    #[test]
    fn header_fields_are_where_the_kernel_reads_them() {
        let mut a = Archive::new();
        a.file("ab", 0o644, Data::Bytes(vec![1, 2, 3, 4, 5]))
            .unwrap();
        let buf = build(&a);
        let head = std::str::from_utf8(&buf[..HEADER_LEN]).unwrap();
        assert_eq!(&head[..6], "070701");
        assert_eq!(&head[6..14], "00000001", "ino");
        assert_eq!(&head[14..22], "000081A4", "mode 0100644");
        assert_eq!(&head[54..62], "00000005", "filesize");
        assert_eq!(&head[94..102], "00000003", "namesize counts the NUL");
        // 110 + 3 = 113 → name padded to 116, data 5 → padded to 124; then the trailer.
        assert_eq!(&buf[110..116], b"ab\0\0\0\0");
        assert_eq!(&buf[116..124], &[1, 2, 3, 4, 5, 0, 0, 0]);
        assert_eq!(&buf[124..130], b"070701");
        // Trailer: name "TRAILER!!!\0" is 11 bytes: 110 + 11 = 121 → 124.
        assert_eq!(buf.len(), 124 + 124);
    }

    #[test]
    fn padding_for_every_name_and_data_length() {
        for name_len in 1..=8 {
            for data_len in 0..=8 {
                let mut a = Archive::new();
                let name = "n".repeat(name_len);
                a.file(&name, 0o600, Data::Bytes(vec![0xAA; data_len]))
                    .unwrap();
                let buf = build(&a);
                let e = parse(&buf).unwrap();
                assert_eq!(e.len(), 1);
                assert_eq!(e[0].name, name);
                assert_eq!(e[0].data.len(), data_len);
            }
        }
    }

    #[test]
    fn files_from_disk_and_parent_directories() {
        let dir = std::env::temp_dir().join(format!("xtask-cpio-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("blob");
        std::fs::write(&src, vec![7u8; 1001]).unwrap();
        let mut a = Archive::new();
        a.file("/lib/x86_64-linux-gnu/libc.so.6", 0o755, Data::Path(src))
            .unwrap();
        let entries = parse(&build(&a)).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let names: Vec<&str> = entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "lib",
                "lib/x86_64-linux-gnu",
                "lib/x86_64-linux-gnu/libc.so.6"
            ]
        );
        assert_eq!(entries[2].data, vec![7u8; 1001]);
    }

    #[test]
    fn refuses_bad_paths_and_kind_clashes() {
        let mut a = Archive::new();
        assert!(a.file("/", 0o644, Data::Bytes(vec![])).is_err());
        assert!(a.file("a/../b", 0o644, Data::Bytes(vec![])).is_err());
        a.file("f", 0o644, Data::Bytes(vec![])).unwrap();
        assert!(
            a.file("f/g", 0o644, Data::Bytes(vec![])).is_err(),
            "parent is a file"
        );
        a.dir("d", 0o755).unwrap();
        assert!(a.symlink("d", "x").is_err(), "would replace a directory");
    }
}
