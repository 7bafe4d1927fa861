//! A small key-value table: updates committed through the journal (overlapped commit), reads
//! through the page cache; the writer process is killed mid-stream, the journal recovered, and
//! the table checked against a model of every update.
//!
//! An update is a transaction: all of it survives a crash or none of it does.
//!
//! ```text
//! cargo run --release --example kv_journal            # scratch files in /var/tmp, removed after
//! cargo run --release --example kv_journal -- DIR     # files in DIR, kept
//! ```
//!
//! `kv.img` holds a journal area (blocks 0..256) and 64 home blocks for the table (blocks
//! 256..320). Each home block is a bucket of 64 slots of 64 bytes, one per key: 4,096 keys,
//! each slot holding its key, the number of the update that last wrote it, and 48 bytes of value
//! derived from both. An update changes 1 to 8 pseudo-random keys (the same sequence on every
//! run): it reads their buckets through the page cache, changes the slots, and commits the
//! changed buckets as one transaction. Once the commit returns, the new buckets go into the
//! page cache too (`CacheHandle::store`), so the next read of them is a hit, and the writer
//! prints `acked N`.
//!
//! The example starts itself again as the writer and kills it with SIGKILL 50–450 ms after its
//! first acknowledgement. It then recovers the journal (`JournalSet::open`: committed
//! transactions replayed, the torn tail dropped) and reads the table. The table must be
//! exactly what the first `c` updates make of it, for one `c` no smaller than the last
//! acknowledged update: all of a transaction or none of it, and nothing acknowledged lost.
//! Last, it applies 500 more updates on the recovered table and checks the result the same way.

use std::path::Path;
use std::rc::Rc;

use aios::core::Engine;
use aios::journal::{CommitMode, Journal, JournalSet, Layout, Tx};
use aios::lbio::{Device, DeviceConfig, LbioArray};
use aios::pagecache::{CacheConfig, CacheHandle, FileId, Mode, PageCache};

mod common;
use common::Res;

const BLOCK: usize = 4096;
const JOURNAL_BLOCKS: u64 = 256;
const BUCKETS: u64 = 64;
const SLOT: usize = 64;
const SLOTS: u64 = (BLOCK / SLOT) as u64;
const KEYS: u64 = BUCKETS * SLOTS;
const IMAGE_BYTES: u64 = (JOURNAL_BLOCKS + BUCKETS) * BLOCK as u64;
/// Updates the writer applies at most.
const UPDATES: u64 = 1 << 20;
/// Updates applied after recovery.
const MORE: u64 = 500;

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("writer") {
        let dir = args.get(1).ok_or("writer: no directory given")?;
        return writer(Path::new(dir));
    }
    common::in_workdir("kv-journal", run)
}

/// The keys update `n` (counting from 1) changes: 1 to 8 of them, distinct, the same on every
/// run.
fn keys_of(n: u64) -> Vec<u64> {
    let mut x = n.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let count = 1 + next() % 8;
    let mut keys: Vec<u64> = Vec::with_capacity(count as usize);
    while keys.len() < count as usize {
        let k = next() % KEYS;
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    keys
}

/// Where key `k` lives: (home block, byte offset in it).
fn slot_of(k: u64) -> (u64, usize) {
    (JOURNAL_BLOCKS + k / SLOTS, (k % SLOTS) as usize * SLOT)
}

/// The slot of key `k` as update `n` writes it (`n` 0: never written, all zero).
fn slot_bytes(k: u64, n: u64, out: &mut [u8]) {
    if n == 0 {
        out.fill(0);
        return;
    }
    out[..8].copy_from_slice(&k.to_le_bytes());
    out[8..16].copy_from_slice(&n.to_le_bytes());
    for (i, c) in out[16..].chunks_mut(8).enumerate() {
        let w = k.rotate_left(17) ^ n.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ i as u64;
        c.copy_from_slice(&w.to_le_bytes());
    }
}

/// What the first `n` updates make of the table: per key, the last update that wrote it.
fn model(n: u64) -> Vec<u64> {
    let mut last = vec![0u64; KEYS as usize];
    for u in 1..=n {
        for k in keys_of(u) {
            last[k as usize] = u;
        }
    }
    last
}

/// The table stack: an engine, the journal handle and the page cache over `kv.img`.
struct Table {
    engine: Rc<Engine>,
    journal: Journal,
    cache: CacheHandle,
    file: FileId,
}

impl Table {
    fn open(dir: &Path, set: &std::sync::Arc<JournalSet>) -> Res<Table> {
        let (engine, lbio, jdev) = open_image(dir)?;
        let journal = Journal::new(set, 0, jdev, CommitMode::Overlapped)?;
        let cache = PageCache::new(CacheConfig {
            capacity_bytes: 1 << 20,
            huge_pages: false,
            readahead_pages: 0,
            ..CacheConfig::default()
        })?;
        let file = cache.add_file(IMAGE_BYTES)?;
        let handle = CacheHandle::new(&cache, &engine, &lbio, Mode::AIOS)?;
        let cdev = Device::open(&lbio, &dir.join("kv.img"), DeviceConfig::default())?;
        handle.attach(file, cdev)?;
        Ok(Table {
            engine,
            journal,
            cache: handle,
            file,
        })
    }

    /// Apply update `n`: read the buckets it touches, change its keys' slots, commit them as
    /// one transaction, then put the new buckets in the page cache.
    fn update(&self, n: u64) -> Res<()> {
        let mut buckets: Vec<(u64, Vec<u8>)> = Vec::new();
        for k in keys_of(n) {
            let (block, at) = slot_of(k);
            let i = match buckets.iter().position(|(b, _)| *b == block) {
                Some(i) => i,
                None => {
                    let mut bytes = vec![0u8; BLOCK];
                    self.cache
                        .read(self.file, block * BLOCK as u64, &mut bytes)?;
                    buckets.push((block, bytes));
                    buckets.len() - 1
                }
            };
            slot_bytes(k, n, &mut buckets[i].1[at..at + SLOT]);
        }
        let mut tx = Tx::new();
        for (block, bytes) in &buckets {
            tx.write_meta(*block, bytes)?;
        }
        self.journal.commit(&tx)?;
        for (block, bytes) in &buckets {
            self.cache.store(self.file, block * BLOCK as u64, bytes)?;
        }
        Ok(())
    }

    /// Read the whole table through the page cache: per key, the update its slot names (after
    /// checking the slot is exactly what that update wrote).
    fn read_all(&self) -> Res<Vec<u64>> {
        let mut last = vec![0u64; KEYS as usize];
        let mut bytes = vec![0u8; BLOCK];
        let mut want = [0u8; SLOT];
        for b in 0..BUCKETS {
            let block = JOURNAL_BLOCKS + b;
            self.cache
                .read(self.file, block * BLOCK as u64, &mut bytes)?;
            for s in 0..SLOTS {
                let k = b * SLOTS + s;
                let slot = &bytes[s as usize * SLOT..(s as usize + 1) * SLOT];
                let n = u64::from_le_bytes(slot[8..16].try_into()?);
                slot_bytes(k, n, &mut want);
                if slot != want {
                    return Err(format!("key {k}: its slot is not what any update wrote").into());
                }
                last[k as usize] = n;
            }
        }
        Ok(last)
    }
}

/// An engine, its lbio array, and `DIR/kv.img` open for writing on it.
fn open_image(dir: &Path) -> Res<(Rc<Engine>, Rc<LbioArray>, Device)> {
    common::open_writable(&dir.join("kv.img"))
}

fn layout() -> Layout {
    Layout::per_core(0, JOURNAL_BLOCKS, 1)
}

/// The writer process: format the journal, then apply updates until killed.
fn writer(dir: &Path) -> Res<()> {
    let set = {
        let (_engine, _lbio, dev) = open_image(dir)?;
        JournalSet::format(&dev, layout())?
    };
    let table = Table::open(dir, &set)?;
    for n in 1..=UPDATES {
        table.update(n)?;
        println!("acked {n}");
    }
    Ok(())
}

fn run(dir: &Path) -> Res<()> {
    // A fresh image on every run: zeros are the empty table.
    let image = dir.join("kv.img");
    let _ = std::fs::remove_file(&image);
    std::fs::File::create(&image)?.set_len(IMAGE_BYTES)?;

    let writer = common::run_writer_and_kill(dir)?;
    let acked = writer.acked;
    println!("writer: {writer} with {acked} updates acknowledged");

    // Recovery: replay what was committed, drop the torn tail.
    let (set, report) = {
        let (_engine, _lbio, dev) = open_image(dir)?;
        JournalSet::open(&dev, layout())?
    };
    println!(
        "recovery: {} transactions replayed, {} home blocks written, log end: {:?}",
        report.replayed.iter().map(Vec::len).sum::<usize>(),
        report.blocks_written,
        report.areas.iter().map(|(_, end)| end).collect::<Vec<_>>()
    );
    if !report.corrupt.is_empty() {
        return Err(format!("recovery found damage in areas {:?}", report.corrupt).into());
    }
    let table = Table::open(dir, &set)?;
    let got = table.read_all()?;
    // The writer commits one update at a time and prints its line as soon as the commit
    // returns: at most one update can be committed without its line (killed in between).
    let c = (acked..=acked + 1)
        .find(|&c| model(c) == got)
        .ok_or_else(|| {
            format!(
                "the table after recovery is what no prefix of the updates makes of it: neither 1..={acked} nor 1..={}",
                acked + 1
            )
        })?;
    println!(
        "recovery: the table is exactly updates 1..={c} ({} acknowledged, {} committed before the kill without its acknowledgement)",
        acked,
        c - acked
    );

    // Resume: the next updates on the recovered table.
    for n in c + 1..=c + MORE {
        table.update(n)?;
    }
    let got = table.read_all()?;
    if got != model(c + MORE) {
        return Err("after resuming, the table differs from the model".into());
    }
    let m = table.cache.cache().metrics();
    println!(
        "resumed: {MORE} more updates committed; the table is exactly updates 1..={} (page cache: {} hits, {} misses; engine: {} SQEs)",
        c + MORE,
        m.hits,
        m.misses,
        table.engine.metrics().sqes
    );
    drop(table);

    // Once more from the device alone: recover again (nothing to replay beyond the checkpoint
    // and the log) and read the table through a fresh cache.
    let (set, _) = {
        let (_engine, _lbio, dev) = open_image(dir)?;
        JournalSet::open(&dev, layout())?
    };
    let table = Table::open(dir, &set)?;
    if table.read_all()? != model(c + MORE) {
        return Err("reopened, the table differs from the model".into());
    }
    println!("reopened: the device holds the same table");
    Ok(())
}
