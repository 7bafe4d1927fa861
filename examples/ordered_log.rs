//! An append-only log of 4 KiB records on Rio's ordered writes: a writer process is killed
//! mid-stream, then the log is recovered, checked and appended to again.
//!
//! ```text
//! cargo run --release --example ordered_log            # scratch files in /var/tmp, removed after
//! cargo run --release --example ordered_log -- DIR     # files in DIR, kept
//! ```
//!
//! The example starts itself again as the writer. The writer appends records, each its own group
//! (so each is ordered after the one before), to `data.img` through lbio (O_DIRECT), 32 in
//! flight, with the attribute log in `attr.log` (persistent memory emulated in a file). Every
//! 64 records it calls `wait`, which makes the stream durable, and then prints `acked N`.
//! Some time after the first acknowledgement this process kills the writer with SIGKILL. It
//! then scans the attribute log, recovers the stream's longest valid prefix and checks:
//! every acknowledged record lies inside the prefix, and every record of the prefix reads back
//! intact. Last, it reopens the log where the prefix ends and appends more records after it, as
//! a program restarting after a crash would.
//!
//! A process crash leaves the kernel running, so writes that reached the file survive even
//! without a FLUSH. Recovery still keeps only what the log proves durable (on a device with a
//! volatile write cache: up to the last logged FLUSH), which is what a power cut would leave.

use std::path::Path;
use std::rc::Rc;

use aios::core::{Engine, FixedBuf};
use aios::lbio::{Device, DeviceConfig, LbioArray, LbioConfig};
use aios::rio::{recover, scan, AttrLog, FilePmr, OrderedConfig, OrderedDevice, Write};

mod common;
use common::Res;

const BS: usize = 4096;
/// Records the writer appends at most (the data file's size in blocks).
const RECORDS: u64 = 1 << 14;
const QD: usize = 32;
const ACK_EVERY: u64 = 64;
const LOG_BYTES: usize = 256 << 10;
/// Records appended after recovery.
const MORE: u64 = 256;
const MAGIC: &[u8; 8] = b"aiosrec1";

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("writer") {
        let dir = args.get(1).ok_or("writer: no directory given")?;
        return writer(Path::new(dir));
    }
    common::in_workdir("ordered-log", run)
}

fn run(dir: &Path) -> Res<()> {
    // A fresh data file and attribute log on every run.
    let data = dir.join("data.img");
    let _ = std::fs::remove_file(dir.join("attr.log"));
    std::fs::File::create(&data)?.set_len(RECORDS * BS as u64)?;

    let writer = common::run_writer_and_kill(dir)?;
    let acked = writer.acked;
    println!("writer: {writer} with {acked} records acknowledged");

    // Recovery: what the attribute log proves durable.
    let (engine, lbio, dev) = open_data(dir)?;
    let plp = dev.critical_route().0.power_loss_protected;
    let pmr = FilePmr::open(&dir.join("attr.log"), LOG_BYTES)?;
    let r = recover(&scan(&pmr)?, &|_target| plp);
    let s = &r.streams[0];
    // Group g holds record g - 1 (groups start at 1, one record each).
    let kept = s.prefix_end - 1;
    println!(
        "recovery: {kept} records in the valid prefix, {} logged beyond it (to discard), {} damaged log entries{}",
        s.beyond.len(),
        r.damaged.len(),
        s.stopped_by
            .as_ref()
            .map_or(String::new(), |w| format!("; the prefix stops at {w}"))
    );
    if acked > kept {
        return Err(format!("{acked} records were acknowledged, but only {kept} recovered").into());
    }
    verify(&engine, &dev, 0..kept)?;
    println!("recovery: all {kept} records of the prefix read back intact, every acknowledged one among them");

    // Resume: the stream goes on at the first group past the prefix, overwriting what lay
    // beyond it.
    let log = AttrLog::reopen(pmr, &r.resume_marks())?;
    let mut od = OrderedDevice::new(
        lbio,
        vec![dev],
        log,
        &r.resume_marks(),
        OrderedConfig::default(),
    )?;
    let end = (kept + MORE).min(RECORDS);
    append(&engine, &mut od, kept..end, |_| {})?;
    let st = od.stats();
    drop(od);
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default())?;
    let dev = Device::open(&lbio, &data, DeviceConfig::default())?;
    verify(&engine, &dev, 0..end)?;
    println!(
        "resumed: {} more records appended ({} device commands, {} FLUSHes), all {end} read back intact",
        end - kept,
        st.device_cmds,
        st.flushes
    );
    Ok(())
}

/// An engine, its lbio array, and `DIR/data.img` open for writing on it.
fn open_data(dir: &Path) -> Res<(Rc<Engine>, Rc<LbioArray>, Device)> {
    common::open_writable(&dir.join("data.img"))
}

/// The writer process: append records until killed (or until the file is full).
fn writer(dir: &Path) -> Res<()> {
    let (engine, lbio, dev) = open_data(dir)?;
    let log = AttrLog::format(FilePmr::open(&dir.join("attr.log"), LOG_BYTES)?, 1)?;
    let mut od = OrderedDevice::new(lbio, vec![dev], log, &[1], OrderedConfig::default())?;
    append(&engine, &mut od, 0..RECORDS, |n| println!("acked {n}"))?;
    Ok(())
}

/// Append records `range` (record i at block i), `QD` in flight; every `ACK_EVERY` records and
/// at the end, `wait` for durability and call `ack` with the count so far.
fn append(
    engine: &Engine,
    od: &mut OrderedDevice<FilePmr>,
    range: std::ops::Range<u64>,
    mut ack: impl FnMut(u64),
) -> Res<()> {
    let mut free: Vec<FixedBuf> = (0..QD)
        .map(|_| engine.alloc_blocking(BS))
        .collect::<Result<_, _>>()?;
    let mut done = Vec::with_capacity(QD);
    for i in range.clone() {
        while free.is_empty() {
            od.wait_progress_into(&mut done)?;
            for d in done.drain(..) {
                d.result
                    .map_err(|e| format!("record write {} failed: {e}", d.id))?;
                free.push(d.buf);
            }
        }
        let mut buf = free.pop().ok_or("no free buffer")?;
        fill(&mut buf, i);
        let w = Write {
            target: 0,
            offset: i * BS as u64,
            buf,
            ipu: false,
        };
        od.submit(0, w, true)?;
        if (i + 1) % ACK_EVERY == 0 || i + 1 == range.end {
            od.wait(0)?;
            ack(i + 1);
        }
    }
    Ok(())
}

/// Record `i`: the magic, its index, then bytes from a generator seeded with the index.
fn fill(buf: &mut [u8], i: u64) {
    buf[..8].copy_from_slice(MAGIC);
    buf[8..16].copy_from_slice(&i.to_le_bytes());
    let mut x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for b in &mut buf[16..] {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
}

/// Read records `range` back and compare each with what the writer wrote.
fn verify(engine: &Engine, dev: &Device, range: std::ops::Range<u64>) -> Res<()> {
    let mut want = vec![0u8; BS];
    let mut buf = engine.alloc_blocking(BS)?;
    for i in range {
        buf = dev.read_at_blocking(i * BS as u64, buf)?;
        fill(&mut want, i);
        if buf[..] != want[..] {
            return Err(format!("record {i} does not read back as written").into());
        }
    }
    Ok(())
}
