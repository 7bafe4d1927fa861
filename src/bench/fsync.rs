//! `aios bench fsync`: a 4 KiB write made durable, through the journal (vanilla, overlapped and
//! one-write commit) and through ext4 (`pwrite` + `fsync`) on the same kind of device.
//!
//! One operation of the journal modes is what a file system's `fsync` of a 4 KiB overwrite
//! costs on the journal: build a file-level transaction with the data block (ordered, written in
//! place) and the file's inode block (journaled metadata), then commit it. Each thread has its
//! own engine, its own journal area (per-core journals) and its own file; the latency of one
//! operation runs from building the transaction to the commit's return. The ext4 anchor does
//! the same on a freshly made ext4: `pwrite` 4 KiB at a random block of a preallocated file of
//! its own, then `fsync`.
//!
//! That anchor does less than a journal op. An overwrite changes no metadata but the mtime, and
//! the kernel updates the mtime at clock-tick granularity unless someone has read it since (its
//! multigrain timestamps), so ext4's fsync commits its journal about once per clock tick and
//! otherwise writes the data and sends a FLUSH. The `ext4-meta` anchor makes every fsync commit
//! the inode, the same work as a journal op: a `stat` after each fsync (outside the op's
//! latency) makes the next write's mtime fine-grained. Both ext4 modes report the jbd2 commits
//! they caused per fsync (`/proc/fs/jbd2`); threads' concurrent fsyncs may share one commit.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use std::rc::Rc;

use aios_core::CompletionMode;
use hdrhistogram::Histogram;
use journal::rio_ordering::{self, BlockPmr, MemPmr, OrderedConfig, Pmr};
use journal::{CommitMode, Journal, JournalSet, Layout, Tx};
use lbio::{LbioArray, LbioConfig};
use serde::Serialize;

use crate::bench::compare::Progress;
use crate::bench::pagecache::{completion_for, device_bytes, thread_stack};
use crate::bench::{
    arena_within_memlock, cdf_us, median, new_histogram, quantile_us, run_threads, xorshift,
    BenchError,
};

/// Journal blocks per area (4 MiB): a checkpoint every ~340 single-block commits per thread.
pub const AREA_BLOCKS: u64 = 1024;
/// Blocks of each thread's file (its home region on the journal device; its file on ext4).
pub const FILE_BLOCKS: u64 = 4096;
/// Blocks of each area's attribute log in the Rio modes (64 KiB: 1,000 entries; a commit
/// takes three, freed as soon as it is durable).
pub const RIO_LOG_BLOCKS: u64 = 16;
const BLOCK: usize = journal::format::BLOCK;

/// What makes the write durable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum FsyncMode {
    /// The journal, vanilla commit.
    Vanilla,
    /// The journal, overlapped commit (AIOS §3.3).
    Overlapped,
    /// The journal, one-write commit: the data journaled too, and the commit block in the same
    /// write as the other log blocks (a torn transaction is told by its checksum); one device
    /// round trip per commit.
    #[value(name = "one-write")]
    #[serde(rename = "one-write")]
    OneWrite,
    /// The journal, Rio-ordered commit (Rio §4.7): data, journal and commit block sent together,
    /// one FLUSH; the attribute log in a **block log** on the journal device (durable, for
    /// hardware without a PMR: it costs a FUA write before the data and one after the FLUSH).
    #[value(name = "rio-blocklog")]
    #[serde(rename = "rio-blocklog")]
    RioBlocklog,
    /// The same with the attribute log in persistent memory **emulated in RAM**: not durable,
    /// a stand-in for an NVMe PMR (a few MMIO writes per commit), to show what one would give.
    #[value(name = "rio-mempmr")]
    #[serde(rename = "rio-mempmr")]
    RioMempmr,
    /// `pwrite` + `fsync` on ext4.
    Ext4,
    /// `pwrite` + `fsync` on ext4 with the inode changed by every write (a `stat` after each
    /// fsync, outside the op's latency, makes the next mtime fine-grained), so that every fsync
    /// commits ext4's journal: the same work as a journal op.
    #[value(name = "ext4-meta")]
    #[serde(rename = "ext4-meta")]
    Ext4Meta,
}

impl FsyncMode {
    pub fn name(self) -> &'static str {
        match self {
            FsyncMode::Vanilla => "vanilla",
            FsyncMode::Overlapped => "overlapped",
            FsyncMode::OneWrite => "one-write",
            FsyncMode::RioBlocklog => "rio-blocklog",
            FsyncMode::RioMempmr => "rio-mempmr",
            FsyncMode::Ext4 => "ext4",
            FsyncMode::Ext4Meta => "ext4-meta",
        }
    }

    /// The ext4 anchors (everything else runs the journal).
    pub fn is_ext4(self) -> bool {
        matches!(self, FsyncMode::Ext4 | FsyncMode::Ext4Meta)
    }
}

/// One measured run, printed as a table row or one JSON line.
#[derive(Clone, Debug, Default, Serialize)]
pub struct FsyncSample {
    pub mode: String,
    pub threads: u32,
    pub iops: f64,
    pub lat_us_mean: f64,
    pub lat_us_p50: f64,
    pub lat_us_p99: f64,
    pub lat_us_p999: f64,
    pub cpu_s: f64,
    pub iops_per_cpu_s: f64,
    pub seconds: f64,
    /// Journal checkpoints during the run (journal modes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoints: Option<u64>,
    /// Journal modes: how data and journal blocks were made durable, and what the journal
    /// measured when it chose.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub durability: Option<DurabilityInfo>,
    /// Journal areas the threads commit into.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub areas: Option<u32>,
    /// Fraction of commits that went out in a group (group commit).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grouped: Option<f64>,
    /// FLUSH commands skipped because the device declares power-loss protection.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub flushes_skipped: Option<u64>,
    /// Journal modes: mean µs per commit spent preparing buffers, until the data and journal
    /// blocks were written, in the FLUSH, and writing the commit block durably.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phases_us: Option<Phases>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub round: Option<u32>,
    pub device: String,
    /// Mean latency ÷ vanilla's, same round and thread count.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lat_vs_vanilla: Option<f64>,
    /// IOPS ÷ ext4's, same round and thread count.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub iops_vs_ext4: Option<f64>,
    /// IOPS ÷ ext4-meta's (every fsync committing ext4's journal), same round and thread count.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub iops_vs_ext4_meta: Option<f64>,
    /// ext4 modes: jbd2 transactions committed on the file system during the run, per fsync
    /// (warm-up and file preparation included; threads' concurrent fsyncs may share one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub jbd2_commits_per_fsync: Option<f64>,
    /// Rio modes: what the ordered devices did (summed over threads).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rio: Option<RioInfo>,
    #[serde(skip)]
    pub cdf: Vec<(f64, f64)>,
}

/// What the Rio modes' ordered devices did during a run.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct RioInfo {
    /// Data writes sent to the device (merged commands count once).
    pub device_cmds: u64,
    pub flushes: u64,
    /// Block log syncs in front of the data (`rio-blocklog`), and their mean time.
    pub log_syncs: u64,
    pub log_sync_us_mean: f64,
}

/// Where a commit's time goes (mean µs per commit).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Phases {
    pub prepare: f64,
    pub writes: f64,
    pub flush: f64,
    pub commit: f64,
}

/// The durability a journal run used (`flush` or `fua`) and the probe's medians (µs).
#[derive(Clone, Debug, Default, Serialize)]
pub struct DurabilityInfo {
    pub chosen: String,
    pub probe_write_us: f64,
    pub probe_fua_write_us: f64,
    pub probe_flush_us: f64,
}

/// An ext4 file system made for the run on a device, mounted on a fresh directory; unmounted
/// (and the directory removed) on drop.
#[derive(Debug)]
pub struct Ext4Mount {
    dir: PathBuf,
    /// Unmounts and removes the mount point (when dropped, or on SIGINT/SIGTERM).
    _undo: crate::bench::cleanup::Undo,
}

impl Ext4Mount {
    /// `mkfs.ext4` on `dev` (destroys its contents) and mount it (default options: ordered
    /// data, barriers on). Needs root and e2fsprogs.
    pub fn make(dev: &Path) -> Result<Ext4Mount, BenchError> {
        let run = |cmd: &mut Command, what: &str| -> Result<(), BenchError> {
            let out = cmd
                .output()
                .map_err(|e| BenchError::Setup(format!("running {what}: {e}")))?;
            if !out.status.success() {
                return Err(BenchError::Setup(format!(
                    "{what} failed: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                )));
            }
            Ok(())
        };
        run(
            // Inode tables and journal initialised now, not by a background thread during the
            // measurements.
            Command::new("mkfs.ext4")
                .args(["-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0"])
                .arg(dev),
            "mkfs.ext4 (e2fsprogs)",
        )?;
        let dir = std::env::temp_dir().join(format!("aios-ext4-{}", std::process::id()));
        std::fs::create_dir_all(&dir)
            .map_err(|e| BenchError::Setup(format!("creating {}: {e}", dir.display())))?;
        if let Err(e) = run(Command::new("mount").arg(dev).arg(&dir), "mount") {
            let _ = std::fs::remove_dir(&dir);
            return Err(e);
        }
        let d = dir.clone();
        let undo = crate::bench::cleanup::register("the ext4 mount", move || {
            // Still busy after an interruption (a fio run of the bench goes on to its end):
            // detach it now, and the kernel unmounts it when fio lets go.
            let plain = Command::new("umount")
                .arg(&d)
                .stderr(std::process::Stdio::null())
                .status();
            if !plain.is_ok_and(|s| s.success()) {
                let _ = Command::new("umount").arg("-l").arg(&d).status();
            }
            let _ = std::fs::remove_dir(&d);
        });
        Ok(Ext4Mount { dir, _undo: undo })
    }

    /// The mount point.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// The benchmark: modes × thread counts, `rounds` rounds in alternating order.
#[derive(Debug)]
pub struct FsyncBench {
    /// The device the journal modes write (its contents are destroyed).
    pub journal_dev: PathBuf,
    /// A directory on ext4 for the ext4 mode.
    pub ext4_dir: Option<PathBuf>,
    pub modes: Vec<FsyncMode>,
    pub threads: Vec<u32>,
    pub seconds: f64,
    pub rounds: u32,
    pub device_name: String,
    /// Journal areas; `None`: one per thread (per-core journals). With fewer areas than threads,
    /// thread t commits into area t mod areas and concurrent commits form groups.
    pub areas: Option<u32>,
    /// Group commit on (the default) or off.
    pub group_commit: bool,
    /// How data and journal blocks are made durable: `None` = what the journal measured at
    /// format time.
    pub durability: Option<journal::Durability>,
    /// How the journal threads wait for their I/O: `None` = busy-poll up to one thread per
    /// CPU, spin then sleep beyond ([`completion_for`]).
    pub completion: Option<CompletionMode>,
}

/// What one thread measured.
struct ThreadResult {
    hist: Histogram<u64>,
    ops: u64,
}

impl FsyncBench {
    /// Every run of one round, in order.
    pub fn cases(&self) -> Vec<(FsyncMode, u32)> {
        let mut v = Vec::new();
        for &t in &self.threads {
            for &m in &self.modes {
                v.push((m, t));
            }
        }
        v
    }

    /// Check the settings before anything is written.
    pub fn validate(&self) -> Result<(), BenchError> {
        self.validate_settings()?;
        if self.modes.iter().any(|m| m.is_ext4()) && self.ext4_dir.is_none() {
            return Err(BenchError::Invalid(
                "the ext4 mode needs an ext4 directory (--ext4-dir, or --device ull)".into(),
            ));
        }
        if self.modes.iter().any(|m| !m.is_ext4()) {
            let max_t = *self.threads.iter().max().expect("non-empty") as u64;
            let need = self.journal_bytes(max_t);
            let have = device_bytes(&self.journal_dev)?;
            if have < need {
                return Err(BenchError::Invalid(format!(
                    "{} holds {have} bytes; {max_t} thread(s) need {need} ({AREA_BLOCKS} journal \
                     blocks and {FILE_BLOCKS} file blocks each)",
                    self.journal_dev.display()
                )));
            }
        }
        Ok(())
    }

    /// The checks of [`FsyncBench::validate`] that need neither the journal's device nor the
    /// ext4 directory: made before either is prepared.
    pub fn validate_settings(&self) -> Result<(), BenchError> {
        crate::bench::check_seconds(self.seconds)?;
        if self.threads.is_empty() || self.threads.contains(&0) {
            return Err(BenchError::Invalid("--threads needs counts >= 1".into()));
        }
        if self.modes.is_empty() {
            return Err(BenchError::Invalid("--modes is empty".into()));
        }
        let max_t = *self.threads.iter().max().expect("non-empty") as u64;
        if self.areas == Some(0) {
            return Err(BenchError::Invalid("--areas must be >= 1".into()));
        }
        let rio = self
            .modes
            .iter()
            .any(|m| matches!(m, FsyncMode::RioBlocklog | FsyncMode::RioMempmr));
        if rio && self.areas.is_some_and(|a| a < max_t as u32) {
            return Err(BenchError::Invalid(
                "the rio modes need one journal area per thread (one Rio stream per area): drop \
                 --areas"
                    .into(),
            ));
        }
        Ok(())
    }

    fn journal_bytes(&self, threads: u64) -> u64 {
        threads * (AREA_BLOCKS + FILE_BLOCKS + 1 + RIO_LOG_BLOCKS) * BLOCK as u64
    }

    /// Run every case for every round; `emit` sees each sample once its round is complete.
    /// Returns all samples and the per-case medians.
    pub fn run(
        &self,
        progress: &Progress,
        emit: &mut dyn FnMut(&FsyncSample),
    ) -> Result<(Vec<FsyncSample>, Vec<FsyncSample>), BenchError> {
        self.validate()?;
        let cases = self.cases();
        let rounds = self.rounds.max(1);
        let mut all = Vec::new();
        for round in 0..rounds {
            let mut order = cases.clone();
            if round % 2 == 1 {
                order.reverse();
            }
            let mut this_round = Vec::new();
            for (i, &(mode, threads)) in order.iter().enumerate() {
                progress.step(&format!(
                    "fsync round {}/{rounds} run {}/{}: {} x{threads} thread(s)",
                    round + 1,
                    i + 1,
                    order.len(),
                    mode.name()
                ));
                let mut s = self.run_case(mode, threads)?;
                s.round = Some(round + 1);
                this_round.push(s);
            }
            progress.done();
            fill_ratios(&mut this_round);
            this_round.sort_by_key(|s| case_index(&cases, s));
            for s in &this_round {
                emit(s);
            }
            all.extend(this_round);
        }
        let meds = medians(&cases, &all, &self.device_name);
        Ok((all, meds))
    }

    fn run_case(&self, mode: FsyncMode, threads: u32) -> Result<FsyncSample, BenchError> {
        match mode {
            FsyncMode::Ext4 | FsyncMode::Ext4Meta => self.run_ext4(mode, threads),
            _ => self.run_journal(mode, threads),
        }
    }

    fn areas_for(&self, threads: u32) -> u32 {
        self.areas.map_or(threads, |a| a.clamp(1, threads))
    }

    fn run_journal(&self, fmode: FsyncMode, threads: u32) -> Result<FsyncSample, BenchError> {
        let mode = match fmode {
            FsyncMode::Vanilla => CommitMode::Vanilla,
            FsyncMode::OneWrite => CommitMode::OneWrite,
            _ => CommitMode::Overlapped,
        };
        let completion = self.completion.unwrap_or_else(|| completion_for(threads));
        let areas = self.areas_for(threads);
        let layout = Layout::per_core(0, AREA_BLOCKS, areas as usize);
        let group = self.group_commit;
        let set = {
            // Formatting needs a few buffers only.
            let (_e, _l, dev) = thread_stack(&self.journal_dev, 1 << 20, completion, true)?;
            JournalSet::format(&dev, layout).map_err(journal_err)?
        };
        if let Some(d) = self.durability {
            set.set_durability(d);
        }
        let files_at = areas as u64 * AREA_BLOCKS;
        let seconds = self.seconds;
        let path = &self.journal_dev;
        let arena = arena_within_memlock(4 << 20, threads);
        let set = &set;
        // The Rio modes' attribute logs: per area, after every thread's file.
        let rio_logs_at = files_at + threads as u64 * (FILE_BLOCKS + 1);
        let rio_stats = std::sync::Mutex::new(Vec::new());
        let rio_stats = &rio_stats;
        let (results, elapsed, cpu) = run_threads(threads, |t, barrier| {
            let ready = (|| {
                let (engine, _lbio, dev) = thread_stack(path, arena, completion, true)?;
                let area = (t % areas) as usize;
                let mut j = match fmode {
                    FsyncMode::RioBlocklog | FsyncMode::RioMempmr => {
                        let own = LbioArray::new(Rc::clone(&engine), LbioConfig::default())?;
                        let target = dev_on(&own, path)?;
                        let bytes = (RIO_LOG_BLOCKS as usize) * BLOCK;
                        let pmr: Box<dyn Pmr> = if fmode == FsyncMode::RioBlocklog {
                            let at = (rio_logs_at + area as u64 * RIO_LOG_BLOCKS) * BLOCK as u64;
                            Box::new(BlockPmr::open(&engine, path, at, bytes).map_err(rio_err)?)
                        } else {
                            Box::new(MemPmr::new(bytes))
                        };
                        // A commit closes two groups: send them together (one block-log sync
                        // in front of the data instead of two).
                        let cfg = OrderedConfig {
                            batch: 2,
                            ..OrderedConfig::default()
                        };
                        Journal::with_rio(set, area, dev, target, pmr, cfg).map_err(journal_err)?
                    }
                    _ => Journal::new(set, area, dev, mode).map_err(journal_err)?,
                };
                j.set_group_commit(group);
                Ok::<_, BenchError>((engine, _lbio, j))
            })();
            barrier.wait();
            let (_engine, _lbio, j) = ready?;
            // Thread t's "file": an inode block and FILE_BLOCKS data blocks.
            let inode = files_at + t as u64 * (FILE_BLOCKS + 1);
            let first = inode + 1;
            let mut data = vec![0u8; BLOCK];
            let mut meta = vec![0u8; BLOCK];
            let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (t as u64 + 1);
            // A file-level transaction when the thread has its area to itself; sharing one, a
            // plain one that may join a group. One `Tx`, cleared for each commit, keeps its
            // memory: the commit path allocates nothing.
            let mut tx = if areas == threads {
                Tx::for_file(t)
            } else {
                Tx::new()
            };
            let mut one = |n: u64| -> Result<u64, BenchError> {
                let block = first + xorshift(&mut x) % FILE_BLOCKS;
                data[..8].copy_from_slice(&n.to_le_bytes());
                meta[..8].copy_from_slice(&n.to_le_bytes());
                meta[8..16].copy_from_slice(&block.to_le_bytes());
                let t0 = Instant::now();
                tx.clear();
                tx.write_data(block, &data)
                    .and_then(|tx| tx.write_meta(inode, &meta))
                    .map_err(journal_err)?;
                j.commit(&tx).map_err(journal_err)?;
                Ok(t0.elapsed().as_nanos() as u64)
            };
            for n in 0..8 {
                one(n)?; // warm-up
            }
            let r = timed_loop(seconds, |n| one(n + 8));
            if let Some(st) = j.rio_stats() {
                rio_stats.lock().unwrap_or_else(|p| p.into_inner()).push(st);
            }
            r
        });
        let mut s = self.sample(fmode, threads, results, elapsed, cpu)?;
        let rio: Vec<rio_ordering::OrderedStats> =
            std::mem::take(&mut *rio_stats.lock().unwrap_or_else(|p| p.into_inner()));
        if !rio.is_empty() {
            let sum =
                |f: &dyn Fn(&rio_ordering::OrderedStats) -> u64| rio.iter().map(f).sum::<u64>();
            let syncs = sum(&|r| r.log_syncs);
            s.rio = Some(RioInfo {
                device_cmds: sum(&|r| r.device_cmds),
                flushes: sum(&|r| r.flushes),
                log_syncs: syncs,
                log_sync_us_mean: if syncs > 0 {
                    sum(&|r| r.log_sync_ns) as f64 / syncs as f64 / 1000.0
                } else {
                    0.0
                },
            });
        }
        let st = &set.stats;
        s.checkpoints = Some(st.checkpoints.load(std::sync::atomic::Ordering::Relaxed));
        s.areas = Some(areas);
        let p = set.durability_probe();
        s.durability = Some(DurabilityInfo {
            chosen: set.durability().name().into(),
            probe_write_us: p.write_us,
            probe_fua_write_us: p.fua_write_us,
            probe_flush_us: p.flush_us,
        });
        let commits = st.commits.load(std::sync::atomic::Ordering::Relaxed);
        if commits > 0 {
            s.grouped = Some(
                st.grouped_commits
                    .load(std::sync::atomic::Ordering::Relaxed) as f64
                    / commits as f64,
            );
        }
        s.flushes_skipped = Some(
            st.flushes_skipped
                .load(std::sync::atomic::Ordering::Relaxed),
        );
        s.phases_us = st.mean_phases_ns().map(|p| Phases {
            prepare: p[0] / 1000.0,
            writes: p[1] / 1000.0,
            flush: p[2] / 1000.0,
            commit: p[3] / 1000.0,
        });
        Ok(s)
    }

    fn run_ext4(&self, mode: FsyncMode, threads: u32) -> Result<FsyncSample, BenchError> {
        let dir = self.ext4_dir.as_ref().expect("validated");
        let seconds = self.seconds;
        let meta = mode == FsyncMode::Ext4Meta;
        let jbd2 = jbd2_info(dir);
        let commits0 = jbd2.as_deref().and_then(jbd2_commits);
        let (results, elapsed, cpu) = run_threads(threads, |t, barrier| {
            let path = dir.join(format!("aios-fsync-{t}"));
            let ready = prepare_ext4_file(&path);
            barrier.wait();
            let f = ready?;
            let mut data = vec![0u8; BLOCK];
            let mut x = 0x2545_f491_4f6c_dd1du64 ^ (t as u64 + 1);
            let err = |e: std::io::Error| BenchError::Setup(format!("{}: {e}", path.display()));
            let mut one = |n: u64| -> Result<u64, BenchError> {
                let block = xorshift(&mut x) % FILE_BLOCKS;
                data[..8].copy_from_slice(&n.to_le_bytes());
                let t0 = Instant::now();
                f.write_all_at(&data, block * BLOCK as u64).map_err(err)?;
                f.sync_all().map_err(err)?;
                let ns = t0.elapsed().as_nanos() as u64;
                if meta {
                    // Reading the mtime makes the next write's update fine-grained: the inode
                    // changes, and the next fsync commits it.
                    f.metadata().map_err(err)?;
                }
                Ok(ns)
            };
            for n in 0..WARMUP_OPS {
                one(n)?;
            }
            let r = timed_loop(seconds, |n| one(n + WARMUP_OPS));
            drop(f);
            let _ = std::fs::remove_file(&path);
            r
        });
        let commits1 = jbd2.as_deref().and_then(jbd2_commits);
        let mut s = self.sample(mode, threads, results, elapsed, cpu)?;
        if meta && commits1.is_none() {
            eprintln!(
                "note: no jbd2 statistics for {}: its file system has no internal journal \
                 (ext4 made without one or with an external one, or not ext4), so \
                 ext4-meta's commits per fsync are not known",
                dir.display()
            );
        }
        if let (Some(a), Some(b)) = (commits0, commits1) {
            // Every fsync the threads made: the timed ones, the warm-up and the preparation's.
            let fsyncs = s.iops * s.seconds + (threads as u64 * (WARMUP_OPS + 1)) as f64;
            let per = b.saturating_sub(a) as f64 / fsyncs.max(1.0);
            s.jbd2_commits_per_fsync = Some(per);
            // With one thread every fsync should commit; threads' concurrent fsyncs share
            // commits, so the check is for one thread only.
            if meta && threads == 1 && per < 0.9 {
                eprintln!(
                    "note: ext4-meta committed ext4's journal on only {:.0}% of its fsyncs (this \
                     kernel may keep coarse timestamps even after a stat): it is not the \
                     like-for-like anchor it is meant to be",
                    per * 100.0
                );
            }
        }
        Ok(s)
    }

    fn sample(
        &self,
        mode: FsyncMode,
        threads: u32,
        results: Vec<Result<ThreadResult, BenchError>>,
        elapsed: f64,
        cpu: f64,
    ) -> Result<FsyncSample, BenchError> {
        let mut hist = new_histogram();
        let mut ops = 0;
        for r in results {
            let r = r?;
            hist.add(&r.hist)
                .map_err(|e| BenchError::Setup(format!("merging histograms: {e}")))?;
            ops += r.ops;
        }
        Ok(FsyncSample {
            mode: mode.name().into(),
            threads,
            iops: ops as f64 / elapsed,
            lat_us_mean: hist.mean() / 1000.0,
            lat_us_p50: quantile_us(&hist, 0.5),
            lat_us_p99: quantile_us(&hist, 0.99),
            lat_us_p999: quantile_us(&hist, 0.999),
            cpu_s: cpu,
            iops_per_cpu_s: if cpu > 0.0 { ops as f64 / cpu } else { 0.0 },
            seconds: elapsed,
            device: self.device_name.clone(),
            cdf: cdf_us(&hist),
            ..FsyncSample::default()
        })
    }
}

/// Untimed operations each thread runs before its timed loop.
const WARMUP_OPS: u64 = 8;

/// The jbd2 statistics file of the ext4 file system holding `dir` (internal journal, inode 8).
fn jbd2_info(dir: &Path) -> Option<PathBuf> {
    use std::os::fd::AsRawFd;
    let st = aios_core::sys::statx(std::fs::File::open(dir).ok()?.as_raw_fd()).ok()?;
    let (major, minor) = (st.dev_major, st.dev_minor);
    let link = std::fs::read_link(format!("/sys/dev/block/{major}:{minor}")).ok()?;
    let name = link.file_name()?.to_str()?.to_owned();
    let p = PathBuf::from(format!("/proc/fs/jbd2/{name}-8/info"));
    p.exists().then_some(p)
}

/// Transactions committed so far, from a jbd2 `info` file ("N transactions (M requested), …").
fn jbd2_commits(info: &Path) -> Option<u64> {
    parse_jbd2_commits(&std::fs::read_to_string(info).ok()?)
}

fn parse_jbd2_commits(text: &str) -> Option<u64> {
    let mut words = text.split_whitespace();
    let n = words.next()?.parse().ok()?;
    (words.next()? == "transactions").then_some(n)
}

/// Run `one` until `seconds` pass; `one(n)` returns the operation's latency in ns.
fn timed_loop(
    seconds: f64,
    mut one: impl FnMut(u64) -> Result<u64, BenchError>,
) -> Result<ThreadResult, BenchError> {
    let mut hist = new_histogram();
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let mut ops = 0u64;
    while Instant::now() < deadline {
        let ns = one(ops)?;
        hist.saturating_record(ns.max(1));
        ops += 1;
    }
    Ok(ThreadResult { hist, ops })
}

/// A file of FILE_BLOCKS written and made durable, so the run overwrites allocated blocks.
fn prepare_ext4_file(path: &Path) -> Result<std::fs::File, BenchError> {
    let err = |e: std::io::Error| BenchError::Setup(format!("{}: {e}", path.display()));
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .map_err(err)?;
    let chunk = vec![0x5au8; 1 << 20];
    let bytes = FILE_BLOCKS * BLOCK as u64;
    let mut at = 0;
    while at < bytes {
        let n = chunk.len().min((bytes - at) as usize);
        f.write_all_at(&chunk[..n], at).map_err(err)?;
        at += n as u64;
    }
    f.sync_all().map_err(err)?;
    Ok(f)
}

fn rio_err(e: rio_ordering::RioError) -> BenchError {
    BenchError::Setup(format!("Rio attribute log: {e}"))
}

/// The journal device opened on `lbio` (the Rio modes' ordered device has an array of its own).
fn dev_on(lbio: &Rc<LbioArray>, path: &Path) -> Result<lbio::Device, BenchError> {
    Ok(lbio::Device::open(
        lbio,
        path,
        lbio::DeviceConfig {
            write: true,
            ..crate::bench::pagecache::device_config()
        },
    )?)
}

fn journal_err(e: journal::JournalError) -> BenchError {
    BenchError::Setup(format!("journal: {e}"))
}

fn case_index(cases: &[(FsyncMode, u32)], s: &FsyncSample) -> usize {
    cases
        .iter()
        .position(|(m, t)| m.name() == s.mode && *t == s.threads)
        .unwrap_or(usize::MAX)
}

/// Ratios within one round: latency ÷ vanilla's, IOPS ÷ ext4's, same thread count.
fn fill_ratios(round: &mut [FsyncSample]) {
    let find = |round: &[FsyncSample], mode: &str, t: u32| {
        round
            .iter()
            .find(|s| s.mode == mode && s.threads == t)
            .map(|s| (s.lat_us_mean, s.iops))
    };
    for i in 0..round.len() {
        let (mode, t) = (round[i].mode.clone(), round[i].threads);
        let vanilla = find(round, "vanilla", t);
        let ext4 = find(round, "ext4", t);
        let ext4_meta = find(round, "ext4-meta", t);
        let s = &mut round[i];
        if mode != "ext4" && mode != "ext4-meta" {
            s.lat_vs_vanilla = vanilla.map(|(lat, _)| s.lat_us_mean / lat);
        }
        s.iops_vs_ext4 = ext4.map(|(_, iops)| s.iops / iops);
        s.iops_vs_ext4_meta = ext4_meta.map(|(_, iops)| s.iops / iops);
    }
}

/// Per case: the median of each figure over the rounds (ratios: the median of the per-round
/// ratios).
fn medians(cases: &[(FsyncMode, u32)], all: &[FsyncSample], device: &str) -> Vec<FsyncSample> {
    let mut out = Vec::new();
    for &(mode, threads) in cases {
        let mine: Vec<&FsyncSample> = all
            .iter()
            .filter(|s| s.mode == mode.name() && s.threads == threads)
            .collect();
        if mine.is_empty() {
            continue;
        }
        let med = |f: &dyn Fn(&FsyncSample) -> f64| {
            median(mine.iter().map(|s| f(s)).collect()).unwrap_or(0.0)
        };
        let med_opt = |f: &dyn Fn(&FsyncSample) -> Option<f64>| {
            median(mine.iter().filter_map(|s| f(s)).collect())
        };
        // The CDF of the round whose mean is the median one.
        let mean = med(&|s| s.lat_us_mean);
        let cdf = mine
            .iter()
            .min_by(|a, b| {
                (a.lat_us_mean - mean)
                    .abs()
                    .total_cmp(&(b.lat_us_mean - mean).abs())
            })
            .map(|s| s.cdf.clone())
            .unwrap_or_default();
        out.push(FsyncSample {
            mode: mode.name().into(),
            threads,
            iops: med(&|s| s.iops),
            lat_us_mean: mean,
            lat_us_p50: med(&|s| s.lat_us_p50),
            lat_us_p99: med(&|s| s.lat_us_p99),
            lat_us_p999: med(&|s| s.lat_us_p999),
            cpu_s: med(&|s| s.cpu_s),
            iops_per_cpu_s: med(&|s| s.iops_per_cpu_s),
            seconds: med(&|s| s.seconds),
            checkpoints: med_opt(&|s| s.checkpoints.map(|c| c as f64)).map(|c| c as u64),
            areas: mine[0].areas,
            durability: mine[0].durability.clone(),
            grouped: med_opt(&|s| s.grouped),
            flushes_skipped: med_opt(&|s| s.flushes_skipped.map(|c| c as f64)).map(|c| c as u64),
            phases_us: mine.iter().all(|s| s.phases_us.is_some()).then(|| {
                let ph = |f: &dyn Fn(&Phases) -> f64| med(&|s| s.phases_us.as_ref().map_or(0.0, f));
                Phases {
                    prepare: ph(&|p| p.prepare),
                    writes: ph(&|p| p.writes),
                    flush: ph(&|p| p.flush),
                    commit: ph(&|p| p.commit),
                }
            }),
            round: None,
            device: device.into(),
            lat_vs_vanilla: med_opt(&|s| s.lat_vs_vanilla),
            iops_vs_ext4: med_opt(&|s| s.iops_vs_ext4),
            iops_vs_ext4_meta: med_opt(&|s| s.iops_vs_ext4_meta),
            jbd2_commits_per_fsync: med_opt(&|s| s.jbd2_commits_per_fsync),
            rio: mine[0].rio,
            cdf,
        });
    }
    out
}

/// The table header.
pub fn print_header(out: &mut impl std::io::Write) -> std::io::Result<()> {
    writeln!(
        out,
        "{:>5} {:<10} {:>3} {:>5} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>6} {:>9} {:>9} {:>9}  \
         durability: prep/writes/flush/commit us (ext4 modes: jbd2 commits per fsync)",
        "round",
        "mode",
        "thr",
        "grp%",
        "IOPS",
        "mean us",
        "p50 us",
        "p99 us",
        "p99.9 us",
        "IOPS/cpu-s",
        "ckpts",
        "lat/van",
        "IOPS/ext4",
        "IOPS/e4m",
    )
}

/// One table row.
pub fn print_row(out: &mut impl std::io::Write, s: &FsyncSample) -> std::io::Result<()> {
    let round = s.round.map_or("med".to_string(), |r| r.to_string());
    let ratio = |r: Option<f64>| r.map(|r| format!("{r:.3}x")).unwrap_or_default();
    writeln!(
        out,
        "{:>5} {:<10} {:>3} {:>5} {:>9.0} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>10.0} {:>6} {:>9} {:>9} {:>9}  {}",
        round,
        s.mode,
        s.threads,
        s.grouped
            .map(|g| format!("{:.0}", g * 100.0))
            .unwrap_or_default(),
        s.iops,
        s.lat_us_mean,
        s.lat_us_p50,
        s.lat_us_p99,
        s.lat_us_p999,
        s.iops_per_cpu_s,
        s.checkpoints.map(|c| c.to_string()).unwrap_or_default(),
        ratio(s.lat_vs_vanilla),
        ratio(s.iops_vs_ext4),
        ratio(s.iops_vs_ext4_meta),
        s.phases_us
            .map(|p| format!(
                "{}: {:.1}/{:.1}/{:.1}/{:.1}",
                s.durability.as_ref().map_or("", |d| d.chosen.as_str()),
                p.prepare,
                p.writes,
                p.flush,
                p.commit
            ))
            .or_else(|| s
                .jbd2_commits_per_fsync
                .map(|c| format!("jbd2 commits per fsync: {c:.3}")))
            .unwrap_or_default()
    )
}

/// What the table's columns mean.
pub fn legend() -> &'static str {
    "one op = a 4 KiB write made durable: journal modes build a file-level transaction (the data \
     block in place + the file's inode block journaled) and commit it; ext4 = pwrite 4 KiB + \
     fsync (an overwrite: ext4 commits its journal about once a clock tick, otherwise the data \
     and a FLUSH); ext4-meta = the same with the inode changed by every write, so that every \
     fsync commits ext4's journal, as every journal op does (at one thread; threads share \
     commits). 'lat/van' = mean latency ÷ \
     vanilla's, 'IOPS/ext4' and 'IOPS/e4m' = IOPS ÷ ext4's and ÷ ext4-meta's (same round and \
     thread count; 'med' rows: medians over rounds); 'grp%' = commits that went out in a \
     group (group commit, when threads share areas: --areas); durability 'fua' = data and \
     journal blocks written with FUA, no FLUSH; 'flush' = plain writes, then a FLUSH (chosen by \
     measuring the device at format time unless --durability says)"
}

/// The latency CDFs of the median rows as `Sample`s, for `report::plot_cdf`.
pub fn cdf_series(meds: &[FsyncSample], threads: u32) -> Vec<crate::bench::Sample> {
    meds.iter()
        .filter(|s| s.threads == threads && !s.cdf.is_empty())
        .map(|s| crate::bench::Sample {
            engine: s.mode.clone(),
            workload: "write+fsync".into(),
            bs: BLOCK as u32,
            qd: 1,
            lat_us_mean: s.lat_us_mean,
            cdf: s.cdf.clone(),
            ..crate::bench::Sample::default()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jbd2_info_is_parsed_and_anything_else_is_refused() {
        let info = "502 transactions (502 requested), each up to 1365 blocks\naverage: \n  0ms \
                    waiting for transaction\n";
        assert_eq!(parse_jbd2_commits(info), Some(502));
        assert_eq!(parse_jbd2_commits(""), None);
        assert_eq!(parse_jbd2_commits("502 requested"), None);
        assert_eq!(parse_jbd2_commits("many transactions"), None);
    }

    #[test]
    fn ratios_are_taken_against_both_ext4_anchors_of_the_same_round() {
        let s = |mode: &str, iops: f64| FsyncSample {
            mode: mode.into(),
            threads: 1,
            iops,
            lat_us_mean: 1e6 / iops,
            ..FsyncSample::default()
        };
        let mut round = vec![
            s("vanilla", 10_000.0),
            s("overlapped", 16_000.0),
            s("ext4", 12_800.0),
            s("ext4-meta", 8_000.0),
        ];
        fill_ratios(&mut round);
        let o = &round[1];
        assert_eq!(o.iops_vs_ext4, Some(1.25));
        assert_eq!(o.iops_vs_ext4_meta, Some(2.0));
        assert!((o.lat_vs_vanilla.unwrap() - 0.625).abs() < 1e-9);
        // The anchors are not compared with vanilla's latency.
        assert_eq!(round[3].lat_vs_vanilla, None);
        assert_eq!(round[2].iops_vs_ext4_meta, Some(1.6));
    }
}
