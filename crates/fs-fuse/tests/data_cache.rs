//! File data through the page cache (`FsOptions::cache_bytes`): random writes, truncates,
//! hole punches, fallocates, fsyncs, commits, re-creations (so freed blocks go to other
//! files) and reads, cached and `O_DIRECT`, against a model of every file's bytes. The cache
//! is tiny (16 frames), so pages are evicted all the time, and it is keyed by physical block:
//! a block that changes hands or contents must never be read back with old bytes.

mod common;

use std::sync::Arc;

use common::{factory, fresh_image, opts};
use fs_fuse::format::{ROOT_INO, S_IFREG};
use fs_fuse::fs::{Caller, Fs, FsOptions, SetAttr};
use lbio::{SimConfig, SimDisk};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

const ROOT: Caller = Caller { uid: 0, gid: 0 };
const FILES: usize = 3;
/// Files stay below this (in bytes), so a few dozen blocks each.
const SPAN: u64 = 160 << 10;

#[derive(Clone, Debug)]
enum Op {
    Write {
        f: usize,
        off: u64,
        len: usize,
        seed: u8,
    },
    Read {
        f: usize,
        off: u64,
        len: u32,
        direct: bool,
    },
    Truncate {
        f: usize,
        size: u64,
    },
    Punch {
        f: usize,
        off: u64,
        len: u64,
    },
    Allocate {
        f: usize,
        off: u64,
        len: u64,
    },
    Fsync {
        f: usize,
        datasync: bool,
    },
    SyncAll,
    /// Unlink the file, forget it, and create a new one in its place (its blocks are freed
    /// for others).
    Recreate {
        f: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let f = 0..FILES;
    prop_oneof![
        5 => (f.clone(), 0..SPAN, 1..20_000usize, any::<u8>())
            .prop_map(|(f, off, len, seed)| Op::Write { f, off, len, seed }),
        5 => (f.clone(), 0..SPAN, 1..40_000u32, any::<bool>())
            .prop_map(|(f, off, len, direct)| Op::Read { f, off, len, direct }),
        1 => (f.clone(), 0..SPAN).prop_map(|(f, size)| Op::Truncate { f, size }),
        1 => (f.clone(), 0..SPAN, 1..30_000u64).prop_map(|(f, off, len)| Op::Punch { f, off, len }),
        1 => (f.clone(), 0..SPAN, 1..30_000u64)
            .prop_map(|(f, off, len)| Op::Allocate { f, off, len }),
        2 => (f.clone(), any::<bool>()).prop_map(|(f, datasync)| Op::Fsync { f, datasync }),
        1 => Just(Op::SyncAll),
        1 => f.prop_map(|f| Op::Recreate { f }),
    ]
}

fn cached_opts() -> FsOptions {
    FsOptions {
        cache_bytes: 16 * 4096,
        ..opts()
    }
}

struct Model {
    fs: Arc<Fs>,
    inos: Vec<u64>,
    names: Vec<Vec<u8>>,
    data: Vec<Vec<u8>>,
    generation: u32,
}

impl Model {
    fn create(&mut self, f: usize) -> Result<(), i32> {
        self.generation += 1;
        let name = format!("f{f}-{}", self.generation).into_bytes();
        let a = self
            .fs
            .mknod(ROOT_INO, &name, S_IFREG | 0o644, 0, ROOT, None)?;
        self.inos[f] = a.ino;
        self.names[f] = name;
        self.data[f].clear();
        Ok(())
    }

    fn check(&self, f: usize, off: u64, len: u32, direct: bool) -> Result<(), TestCaseError> {
        let got = self
            .fs
            .read_with(self.inos[f], off, len, direct)
            .map_err(|e| TestCaseError::fail(format!("read errno {e}")))?;
        let d = &self.data[f];
        let from = (off as usize).min(d.len());
        let to = (off as usize + len as usize).min(d.len());
        prop_assert!(
            got[..] == d[from..to],
            "file {} read {}+{} (direct {}): {} bytes back, {} expected, first difference at {:?}",
            f,
            off,
            len,
            direct,
            got.len(),
            to - from,
            got.iter().zip(&d[from..to]).position(|(a, b)| a != b)
        );
        Ok(())
    }

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        let fail = |e: i32| TestCaseError::fail(format!("{op:?}: errno {e}"));
        match *op {
            Op::Write { f, off, len, seed } => {
                let bytes: Vec<u8> = (0..len).map(|i| seed ^ (i % 251) as u8).collect();
                let n = self.fs.write(self.inos[f], off, &bytes).map_err(fail)?;
                prop_assert_eq!(n, len);
                let d = &mut self.data[f];
                let end = off as usize + len;
                if d.len() < end {
                    d.resize(end, 0);
                }
                d[off as usize..end].copy_from_slice(&bytes);
            }
            Op::Read {
                f,
                off,
                len,
                direct,
            } => self.check(f, off, len, direct)?,
            Op::Truncate { f, size } => {
                let set = SetAttr {
                    size: Some(size),
                    ..SetAttr::default()
                };
                self.fs.setattr(self.inos[f], &set).map_err(fail)?;
                self.data[f].resize(size as usize, 0);
            }
            Op::Punch { f, off, len } => {
                let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
                self.fs
                    .fallocate(self.inos[f], off, len, mode)
                    .map_err(fail)?;
                let d = &mut self.data[f];
                let end = ((off + len) as usize).min(d.len());
                if (off as usize) < end {
                    d[off as usize..end].fill(0);
                }
            }
            Op::Allocate { f, off, len } => {
                self.fs.fallocate(self.inos[f], off, len, 0).map_err(fail)?;
                let d = &mut self.data[f];
                if d.len() < (off + len) as usize {
                    d.resize((off + len) as usize, 0);
                }
            }
            Op::Fsync { f, datasync } => self.fs.fsync_as(self.inos[f], datasync).map_err(fail)?,
            Op::SyncAll => self.fs.sync_all().map_err(fail)?,
            Op::Recreate { f } => {
                self.fs
                    .remove(ROOT_INO, &self.names[f].clone(), false)
                    .map_err(fail)?;
                self.fs.forget(self.inos[f], 1);
                self.create(f).map_err(fail)?;
            }
        }
        Ok(())
    }
}

fn run(image: &[u8], ops: &[Op]) -> Result<(u64, u64), TestCaseError> {
    let disk = SimDisk::from_image(SimConfig::new(image.len() as u64, 1), image.to_vec()).unwrap();
    let (fs, _) = Fs::open(factory(&disk), cached_opts()).unwrap();
    let mut m = Model {
        fs,
        inos: vec![0; FILES],
        names: vec![Vec::new(); FILES],
        data: vec![Vec::new(); FILES],
        generation: 0,
    };
    for f in 0..FILES {
        m.create(f).unwrap();
    }
    for op in ops {
        m.apply(op)?;
    }
    // Everything once more, both ways, after a commit (no dirty data left: all from the
    // device or the cache).
    m.fs.sync_all().unwrap();
    for f in 0..FILES {
        let len = m.data[f].len() as u32 + 1;
        m.check(f, 0, len, false)?;
        m.check(f, 0, len, true)?;
    }
    let c = m.fs.cache_metrics().expect("a cache");
    Ok((c.hits, c.evictions))
}

#[test]
fn file_data_through_a_tiny_page_cache_matches_a_model() {
    let image = fresh_image(8 << 20);
    let mut runner = TestRunner::new(Config {
        cases: 64,
        failure_persistence: None,
        ..Config::default()
    });
    let totals = std::cell::Cell::new((0u64, 0u64));
    runner
        .run(&prop::collection::vec(op(), 1..60), |ops| {
            let (h, e) = run(&image, &ops)?;
            let (th, te) = totals.get();
            totals.set((th + h, te + e));
            Ok(())
        })
        .unwrap();
    let (hits, evictions) = totals.get();
    println!("page cache over 64 cases: {hits} hits, {evictions} evictions");
    assert!(hits > 0 && evictions > 0, "the cache was not exercised");
}

/// An empty regular file `name` in the root directory.
fn create(fs: &Fs, name: &[u8]) -> u64 {
    fs.mknod(ROOT_INO, name, S_IFREG | 0o644, 0, ROOT, None)
        .unwrap()
        .ino
}

/// Unlink and forget `name` (inode `ino`), and commit, so its blocks can be allocated again.
fn free(fs: &Fs, name: &[u8], ino: u64) {
    fs.remove(ROOT_INO, name, false).unwrap();
    fs.forget(ino, 1);
    fs.sync_all().unwrap();
}

/// A file taking every free block (so the next allocation gets whatever is freed next).
fn fill_up(fs: &Fs) {
    let filler = create(fs, b"filler");
    fs.sync_all().unwrap();
    let free = fs.statfs().bfree;
    fs.fallocate(filler, 0, free * 4096, 0).unwrap();
    fs.sync_all().unwrap();
    assert_eq!(fs.statfs().bfree, 0);
}

/// Create `name` with one block of `byte`, committed, and read it once (so it is cached).
fn cached_file(fs: &Fs, name: &[u8], byte: u8) -> u64 {
    let ino = create(fs, name);
    fs.write(ino, 0, &[byte; 4096]).unwrap();
    fs.fsync(ino).unwrap();
    assert!(fs.read(ino, 0, 4096).unwrap() == vec![byte; 4096]);
    ino
}

fn open_cached() -> Arc<Fs> {
    let image = fresh_image(8 << 20);
    let disk = SimDisk::from_image(SimConfig::new(image.len() as u64, 2), image).unwrap();
    Fs::open(factory(&disk), cached_opts()).unwrap().0
}

#[test]
fn data_written_by_a_commit_is_a_hit_and_a_reused_block_never_shows_its_old_owner() {
    let fs = open_cached();
    let a = create(&fs, b"a");
    fs.write(a, 0, &[0xaa; 4096]).unwrap();
    fs.fsync(a).unwrap();
    let before = fs.cache_metrics().unwrap();
    assert!(fs.read(a, 0, 4096).unwrap() == vec![0xaa; 4096]);
    let after = fs.cache_metrics().unwrap();
    assert_eq!(
        (after.hits - before.hits, after.misses - before.misses),
        (1, 0),
        "the block the commit wrote is a hit"
    );
    fill_up(&fs);
    // a's block is the only one free once its removal is committed: b's write takes it.
    free(&fs, b"a", a);
    let b = create(&fs, b"b");
    fs.write(b, 0, &[0xbb; 100]).unwrap();
    fs.sync_all().unwrap();
    assert_eq!(fs.statfs().bfree, 0, "b took a's block");
    let want = vec![0xbb; 100];
    assert!(
        fs.read(b, 0, 4096).unwrap() == want,
        "b's bytes through the cache"
    );
    assert!(
        fs.read_with(b, 0, 4096, true).unwrap() == want,
        "b's bytes from the device"
    );
}

#[test]
fn an_fdatasync_in_place_updates_the_cache() {
    let fs = open_cached();
    let a = cached_file(&fs, b"a", 0x11);
    let in_place = fs
        .stats
        .fsync_in_place
        .load(std::sync::atomic::Ordering::Relaxed);
    fs.write(a, 0, &[0x22; 4096]).unwrap();
    fs.fsync_as(a, true).unwrap();
    assert_eq!(
        fs.stats
            .fsync_in_place
            .load(std::sync::atomic::Ordering::Relaxed),
        in_place + 1,
        "an overwrite then fdatasync is written in place"
    );
    assert!(
        fs.read(a, 0, 4096).unwrap() == vec![0x22; 4096],
        "the new bytes"
    );
}

#[test]
fn a_fallocate_over_a_reused_block_reads_zeros() {
    let fs = open_cached();
    let a = cached_file(&fs, b"a", 0x33);
    fill_up(&fs);
    free(&fs, b"a", a);
    let c = create(&fs, b"c");
    fs.fallocate(c, 0, 4096, 0).unwrap();
    assert_eq!(fs.statfs().bfree, 0, "c took a's block");
    assert!(
        fs.read(c, 0, 4096).unwrap() == vec![0; 4096],
        "zeros, not a's bytes"
    );
}
