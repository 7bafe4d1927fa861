//! Rio's attribute log on a real NVMe PMR, across guest power cuts (runs in the QEMU lab).
//!
//! One run of this program is one *round*:
//! 1. open the PMR of the controller behind `AIOS_LAB_NVME_CHAR` (`/dev/ng0n1`);
//! 2. unless `--fresh`: scan the attribute log, recover each stream's longest durable prefix,
//!    read back every write of that prefix from the namespace and check it, and check that every
//!    group a `wait` acknowledged before the cut is in the prefix (the acknowledgements were
//!    recorded outside the PMR: `O_DSYNC` writes to a ledger area of the namespace);
//! 3. with `--cut`: write a random ordered stream (2 streams, groups of 1–3 writes of 4–8 KiB,
//!    contiguous so they merge, a `wait` every few groups), and after a random number of writes,
//!    with writes in flight, reset the guest at once (`sysrq b`: no sync, no device shutdown).
//!
//! The lab plan runs `--fresh --cut`, then (next boot) `--cut`, then (next boot) a last round
//! that only recovers and checks. On the host, or without `AIOS_LAB_NVME_CHAR`, it reports itself
//! ignored and exits 0, like the other lab tests.
//!
//! Data layout on the namespace: the ledger at 32 MiB (two 4 KiB copies per stream), stream `s`
//! writes from `64 MiB + s × 64 MiB` upwards. Every 4 KiB block written carries its stream,
//! epoch, group, byte offset and a CRC, so a misplaced, stale or torn block cannot pass.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::rc::Rc;

use aios_core::{sys, Engine, EngineConfig, FixedBuf, ProbeOptions};
use lbio::{Device, DeviceConfig, LbioArray, LbioConfig, RouteChoice, SimRng};
use rio_ordering::{recover, scan, AttrLog, NvmePmr, OrderedConfig, OrderedDevice, Write};

const STREAMS: u16 = 2;
const BLOCK: usize = 4096;
const LEDGER_AT: u64 = 32 << 20;
const STREAM_BASE: u64 = 64 << 20;
const STREAM_SPAN: u64 = 64 << 20;
const BLOCK_MAGIC: u64 = u64::from_le_bytes(*b"RIOLABDT");
const LEDGER_MAGIC: u64 = u64::from_le_bytes(*b"RIOLABAK");

struct Args {
    fresh: bool,
    cut: bool,
    seed: u64,
}

fn parse_args() -> Result<Option<Args>, String> {
    let mut a = Args {
        fresh: false,
        cut: false,
        seed: 1,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--fresh" => a.fresh = true,
            "--cut" => a.cut = true,
            "--seed" => {
                a.seed = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .ok_or("--seed needs a number")?
            }
            // What cargo test passes to every test binary: nothing to do with a round.
            "--list" => {
                println!("pmr_power_cut_round: test");
                return Ok(None);
            }
            // Anything else (libtest's flags and filters) does not change a round.
            _ => {}
        }
    }
    Ok(Some(a))
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(Some(a)) => a,
        Ok(None) => return ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pmr_lab: {e}");
            return ExitCode::from(2);
        }
    };
    let Some(dev) = std::env::var_os("AIOS_LAB_NVME_CHAR").map(PathBuf::from) else {
        println!("running 1 test");
        println!("test pmr_power_cut_round ... ignored, needs an NVMe controller with a PMR: runs in the QEMU lab (cargo xtask lab)");
        println!();
        println!("test result: ok. 0 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out");
        return ExitCode::SUCCESS;
    };
    let block = std::env::var_os("AIOS_LAB_NVME_BLOCK")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/dev/nvme0n1"));
    match round(&dev, &block, &args) {
        Ok(()) => {
            println!("test result: ok. 1 passed; 0 failed");
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("pmr_lab: FAILED: {e}");
            println!("test result: FAILED. 0 passed; 1 failed");
            ExitCode::FAILURE
        }
    }
}

/// The 4 KiB block at `offset`, written by `stream` in `epoch` as part of group `seq`.
fn fill_block(b: &mut [u8], stream: u16, epoch: u32, seq: u64, offset: u64, salt: u64) {
    let mut x = salt ^ offset.rotate_left(17) ^ seq;
    for c in b[40..].chunks_mut(8) {
        x = x.wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(1);
        let n = c.len();
        c.copy_from_slice(&x.to_le_bytes()[..n]);
    }
    b[0..8].copy_from_slice(&BLOCK_MAGIC.to_le_bytes());
    b[8..10].copy_from_slice(&stream.to_le_bytes());
    b[10..12].fill(0);
    b[12..16].copy_from_slice(&epoch.to_le_bytes());
    b[16..24].copy_from_slice(&seq.to_le_bytes());
    b[24..32].copy_from_slice(&offset.to_le_bytes());
    b[32..36].fill(0);
    b[36..40].fill(0);
    let crc = crc32c::crc32c(b);
    b[32..36].copy_from_slice(&crc.to_le_bytes());
}

/// Checks a block read back from `offset`; `seqs` is the group range of its log entry.
fn check_block(
    b: &[u8],
    stream: u16,
    epoch: u32,
    seqs: (u64, u64),
    offset: u64,
) -> Result<(), String> {
    let mut c = b.to_vec();
    c[32..36].fill(0);
    let crc = u32::from_le_bytes(b[32..36].try_into().unwrap());
    let what = |why: &str| {
        format!(
            "block at {offset} (stream {stream}, groups {}..={}): {why}",
            seqs.0, seqs.1
        )
    };
    if u64::from_le_bytes(b[0..8].try_into().unwrap()) != BLOCK_MAGIC {
        return Err(what(
            "not written by this test (bad magic): the data never reached the device",
        ));
    }
    if crc32c::crc32c(&c) != crc {
        return Err(what("CRC mismatch: torn or damaged"));
    }
    let s = u16::from_le_bytes(b[8..10].try_into().unwrap());
    let e = u32::from_le_bytes(b[12..16].try_into().unwrap());
    let q = u64::from_le_bytes(b[16..24].try_into().unwrap());
    let o = u64::from_le_bytes(b[24..32].try_into().unwrap());
    if s != stream || e != epoch || o != offset || q < seqs.0 || q > seqs.1 {
        return Err(what(&format!(
            "holds stream {s}, epoch {e}, group {q}, offset {o} (expected epoch {epoch}): stale data"
        )));
    }
    Ok(())
}

struct Ledger {
    fd: OwnedFd,
    buf: FixedBuf,
    version: u64,
}

impl Ledger {
    /// Records durably that `stream` had every group below `below` acknowledged in `epoch`.
    fn record(&mut self, stream: u16, epoch: u32, below: u64) -> Result<(), String> {
        self.version += 1;
        let b = &mut self.buf[..];
        b.fill(0);
        b[0..8].copy_from_slice(&LEDGER_MAGIC.to_le_bytes());
        b[8..10].copy_from_slice(&stream.to_le_bytes());
        b[12..16].copy_from_slice(&epoch.to_le_bytes());
        b[16..24].copy_from_slice(&below.to_le_bytes());
        b[24..32].copy_from_slice(&self.version.to_le_bytes());
        let crc = crc32c::crc32c(&b[..32]);
        b[32..36].copy_from_slice(&crc.to_le_bytes());
        let at = LEDGER_AT + (2 * stream as u64 + self.version % 2) * BLOCK as u64;
        sys::pwrite_from(self.fd.as_raw_fd(), &self.buf[..], at, true)
            .map_err(|e| format!("ledger write: {e}"))?;
        Ok(())
    }
}

/// The newest valid ledger record of `stream`: (version, epoch, acknowledged below).
fn read_ledger(
    fd: &OwnedFd,
    buf: &mut FixedBuf,
    stream: u16,
) -> Result<Option<(u64, u32, u64)>, String> {
    let mut best: Option<(u64, u32, u64)> = None;
    for copy in 0..2u64 {
        let at = LEDGER_AT + (2 * stream as u64 + copy) * BLOCK as u64;
        sys::pread_into(fd.as_raw_fd(), &mut buf[..], at)
            .map_err(|e| format!("ledger read: {e}"))?;
        let b = &buf[..];
        if u64::from_le_bytes(b[0..8].try_into().unwrap()) != LEDGER_MAGIC
            || crc32c::crc32c(&b[..32]) != u32::from_le_bytes(b[32..36].try_into().unwrap())
            || u16::from_le_bytes(b[8..10].try_into().unwrap()) != stream
        {
            continue;
        }
        let v = u64::from_le_bytes(b[24..32].try_into().unwrap());
        let e = u32::from_le_bytes(b[12..16].try_into().unwrap());
        let below = u64::from_le_bytes(b[16..24].try_into().unwrap());
        if best.is_none_or(|(bv, _, _)| v > bv) {
            best = Some((v, e, below));
        }
    }
    Ok(best)
}

fn round(dev: &Path, block: &Path, args: &Args) -> Result<(), String> {
    let pmr = NvmePmr::open(dev).map_err(|e| e.to_string())?;
    let info = pmr.info().clone();
    println!(
        "PMR: {} KiB in BAR {} of {}, write barrier PMRWBM={:#x}, enabled by this open: {}",
        info.bytes >> 10,
        info.bar,
        info.pci_dir.display(),
        info.write_barrier,
        info.enabled_now
    );
    let engine = Engine::new(EngineConfig {
        arena_bytes: 16 << 20,
        passthrough: true,
        ..EngineConfig::default()
    })
    .map_err(|e| e.to_string())?;
    let lbio =
        LbioArray::new(Rc::clone(&engine), LbioConfig::default()).map_err(|e| e.to_string())?;
    let target = Device::open(
        &lbio,
        dev,
        DeviceConfig {
            write: true,
            route: RouteChoice::Ring,
            probe: ProbeOptions {
                latency_samples: 0,
                try_iopoll: false,
            },
            ..DeviceConfig::default()
        },
    )
    .map_err(|e| format!("open {}: {e}", dev.display()))?;
    let plp = target.critical_route().0.power_loss_protected;
    println!(
        "target {}: route {}, power-loss protected: {plp}",
        dev.display(),
        target.critical_route().1
    );
    let ledger_fd =
        sys::open_direct(block, true).map_err(|e| format!("{}: {e}", block.display()))?;
    let mut scratch = engine.alloc_blocking(BLOCK).map_err(|e| e.to_string())?;

    // Where each stream resumes, and where its next write goes.
    let mut resume = vec![1u64; STREAMS as usize];
    let mut cursor: Vec<u64> = (0..STREAMS as u64)
        .map(|s| STREAM_BASE + s * STREAM_SPAN)
        .collect();
    let mut ledger_version = 0;
    let log = if args.fresh {
        println!("fresh: formatting the attribute log over the whole PMR");
        AttrLog::format(pmr, STREAMS).map_err(|e| e.to_string())?
    } else {
        let sc = scan(&pmr).map_err(|e| format!("scan: {e}"))?;
        let rec = recover(&sc, &|_| plp);
        println!(
            "recovery: epoch {}, {} entries of this epoch, {} stale, {} damaged",
            sc.header.epoch,
            sc.entries.len(),
            sc.stale,
            sc.damaged.len()
        );
        for (slot, why) in &rec.damaged {
            println!("  damaged slot {}: {why} (skipped)", slot.0);
        }
        let mut verified = 0usize;
        for sr in &rec.streams {
            let ack = read_ledger(&ledger_fd, &mut scratch, sr.stream)?;
            ledger_version = ledger_version.max(ack.map_or(0, |a| a.0));
            let ack = ack.map(|(_, e, b)| (e, b));
            println!(
                "  stream {}: prefix groups {}..{} ({} entries kept), {} entries beyond{}; acknowledged: {}",
                sr.stream,
                sr.base,
                sr.prefix_end,
                sr.kept.len(),
                sr.beyond.len(),
                sr.stopped_by.as_ref().map_or(String::new(), |w| format!(" (stopped by {w})")),
                ack.map_or("none".into(), |(e, b)| format!("below {b} in epoch {e}"))
            );
            match ack {
                Some((e, below)) if e == sc.header.epoch => {
                    if sr.prefix_end < below {
                        return Err(format!(
                            "stream {}: groups below {below} were acknowledged durable, but the recovered prefix ends at {}",
                            sr.stream, sr.prefix_end
                        ));
                    }
                    if below <= 1 {
                        return Err(format!("stream {}: the round before acknowledged nothing", sr.stream));
                    }
                }
                Some((e, _)) if e > sc.header.epoch => {
                    return Err(format!(
                        "stream {}: the ledger names epoch {e}, the log is at {}",
                        sr.stream, sc.header.epoch
                    ))
                }
                _ => {
                    return Err(format!(
                        "stream {}: no acknowledgement recorded in epoch {}: the round before did not get far",
                        sr.stream, sc.header.epoch
                    ))
                }
            }
            for a in &sr.kept {
                if a.len == 0 {
                    continue;
                }
                for i in 0..(a.len as usize / BLOCK) {
                    let at = a.offset + (i * BLOCK) as u64;
                    sys::pread_into(ledger_fd.as_raw_fd(), &mut scratch[..], at)
                        .map_err(|e| format!("read back {at}: {e}"))?;
                    check_block(
                        &scratch[..],
                        sr.stream,
                        sc.header.epoch,
                        (a.seq, a.seq_end),
                        at,
                    )?;
                    verified += 1;
                }
                cursor[sr.stream as usize] =
                    cursor[sr.stream as usize].max(a.offset + a.len as u64);
            }
        }
        println!("recovery: {verified} blocks of the recovered prefixes read back and verified");
        resume = rec.resume_marks();
        AttrLog::reopen(pmr, &resume).map_err(|e| e.to_string())?
    };
    if !args.cut {
        return Ok(());
    }

    let epoch = log.epoch();
    let mut ordered = OrderedDevice::new(
        Rc::clone(&lbio),
        vec![target],
        log,
        &resume,
        OrderedConfig {
            batch: 4,
            ..OrderedConfig::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let mut ledger = Ledger {
        fd: ledger_fd,
        buf: scratch,
        version: ledger_version,
    };
    let mut rng = SimRng::new(args.seed.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ epoch as u64);
    let cut_after = 300 + rng.below(900);
    println!("epoch {epoch}: writing; the power goes after {cut_after} writes");
    let mut written = 0u64;
    let mut groups_since_wait = [0u32; STREAMS as usize];
    let mut acks = 0u64;
    loop {
        let s = rng.below(STREAMS as u64) as u16;
        let seq = ordered.next_seq(s);
        let n = 1 + rng.below(3);
        for i in 0..n {
            let blocks = 1 + rng.below(2) as usize;
            let mut buf = engine
                .alloc_blocking(blocks * BLOCK)
                .map_err(|e| e.to_string())?;
            let off = cursor[s as usize];
            for (k, b) in buf.chunks_mut(BLOCK).enumerate() {
                fill_block(b, s, epoch, seq, off + (k * BLOCK) as u64, args.seed);
            }
            cursor[s as usize] += (blocks * BLOCK) as u64;
            ordered
                .submit(
                    s,
                    Write {
                        target: 0,
                        offset: off,
                        buf,
                        ipu: false,
                    },
                    i + 1 == n,
                )
                .map_err(|e| format!("submit: {e}"))?;
            written += 1;
            if written == cut_after {
                let st = ordered.stats();
                println!(
                    "cutting the power: {written} writes submitted, {} device commands ({} merged), {} in flight, {acks} waits acknowledged",
                    st.device_cmds,
                    st.merged_cmds,
                    ordered.in_flight()
                );
                std::fs::write("/proc/sysrq-trigger", b"b")
                    .map_err(|e| format!("/proc/sysrq-trigger: {e}"))?;
                std::thread::sleep(std::time::Duration::from_secs(5));
                return Err("the guest did not reset after sysrq b".into());
            }
        }
        groups_since_wait[s as usize] += 1;
        if groups_since_wait[s as usize] >= 4 + rng.below(8) as u32 {
            groups_since_wait[s as usize] = 0;
            ordered.wait(s).map_err(|e| format!("wait: {e}"))?;
            ledger.record(s, epoch, ordered.next_seq(s))?;
            acks += 1;
        }
        drop(ordered.poll().map_err(|e| format!("poll: {e}"))?);
        while ordered.in_flight() > 32 {
            drop(ordered.wait_progress().map_err(|e| format!("wait: {e}"))?);
        }
    }
}
