//! Ordered writes across two target servers over NVMe/TCP (rio-net), with one target killed
//! mid-stream and restarted; then a second initiator recovers the volume and reads it back.
//!
//! ```text
//! cargo run --release --example striped_volume            # scratch files in /var/tmp, removed after
//! cargo run --release --example striped_volume -- DIR     # files in DIR, kept
//! ```
//!
//! The example starts itself twice more as target servers on 127.0.0.1. Each serves a 32 MiB
//! data file through lbio (O_DIRECT) and keeps its attribute log in a file (persistent memory
//! emulated in a file, so the log outlives the process). The initiator opens one volume over
//! both: 4 KiB stripes alternate between the targets. Two streams (think of two logs of a
//! database) write 4 KiB records, each record its own group, so each is ordered after the one
//! before it in its stream. Record `q` of stream `s` goes to its own block, and every 64 records
//! the initiator waits for the stream to become durable.
//!
//! While the streams run, the second target is killed with SIGKILL and started again on the
//! same address and files 300 ms later. The volume notices, keeps trying to reconnect, recovers
//! the target's part of each stream and sends again what it had not made durable; the writer's
//! next write that needs the target waits for that, and writing carries on. At the end every record of both streams is read back and
//! checked, and a new initiator opens the volume, as a restarted application would. It finds
//! each stream's durable prefix ending right after the last record and nothing to discard.

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use aios::rio_net::{Target, TargetConfig, TargetLogKind, Volume, VolumeConfig};

mod common;
use common::Res;

const BS: usize = 4096;
/// Each target's data file.
const TARGET_BYTES: u64 = 32 << 20;
/// Each target's attribute log.
const LOG_BYTES: usize = 1 << 20;
const STREAMS: u16 = 2;
/// Records per stream.
const RECORDS: u64 = 2000;
const ACK_EVERY: u64 = 64;
/// The second target is killed once this many records of stream 0 are durable.
const KILL_AT: u64 = 640;
/// How long the killed target stays down.
const DOWN: Duration = Duration::from_millis(300);

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("target") {
        return match args.as_slice() {
            [_, dir, i, addr] => target(Path::new(dir), i.parse()?, addr.parse()?),
            _ => Err("usage: striped_volume target DIR INDEX ADDR".into()),
        };
    }
    common::in_workdir("striped-volume", run)
}

/// A target server process, killed when dropped.
struct TargetProc {
    child: Child,
    addr: SocketAddr,
}

impl TargetProc {
    /// Start target `i` on `addr` (port 0: any free port) and wait until it listens.
    fn start(dir: &Path, i: usize, addr: SocketAddr) -> Res<TargetProc> {
        let mut child = Command::new(std::env::current_exe()?)
            .arg("target")
            .arg(dir)
            .arg(i.to_string())
            .arg(addr.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let mut line = String::new();
        let out = child.stdout.take().ok_or("the target's stdout")?;
        BufReader::new(out).read_line(&mut line)?;
        let Some(bound) = line.trim().strip_prefix("listening ") else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("target {i} did not start (it said {line:?})").into());
        };
        Ok(TargetProc {
            addr: bound.parse()?,
            child,
        })
    }

    fn kill(mut self) -> Res<()> {
        self.child.kill()?; // SIGKILL
        self.child.wait()?;
        Ok(())
    }
}

impl Drop for TargetProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Record `q` (groups start at 1) of stream `s`: its block and its bytes.
fn block_of(s: u16, q: u64) -> u64 {
    (s as u64 * RECORDS + q - 1) * BS as u64
}

fn pattern(s: u16, q: u64, buf: &mut [u8]) {
    for (i, c) in buf.chunks_mut(8).enumerate() {
        let word = (s as u64) << 56 ^ q.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i as u64;
        c.copy_from_slice(&word.to_le_bytes());
    }
}

fn config(addrs: &[SocketAddr]) -> VolumeConfig {
    let mut c = VolumeConfig::new(addrs.to_vec(), STREAMS);
    c.window = 32;
    c.io_timeout = Duration::from_millis(500);
    c.reconnect_for = Duration::from_secs(20);
    c
}

fn run(dir: &Path) -> Res<()> {
    // Fresh data files and attribute logs on every run.
    for i in 0..2 {
        let _ = std::fs::remove_file(dir.join(format!("target{i}.log")));
        std::fs::File::create(dir.join(format!("target{i}.img")))?.set_len(TARGET_BYTES)?;
    }
    let any: SocketAddr = "127.0.0.1:0".parse()?;
    let mut targets = [
        Some(TargetProc::start(dir, 0, any)?),
        Some(TargetProc::start(dir, 1, any)?),
    ];
    let addrs: Vec<SocketAddr> = targets.iter().flatten().map(|t| t.addr).collect();
    println!("targets: listening on {} and {}", addrs[0], addrs[1]);

    let (mut v, report) = Volume::open(config(&addrs))?;
    let recoveries_at_open = v.stats().recoveries;
    println!(
        "volume: {} MiB striped over both in 4 KiB stripes, {STREAMS} streams starting at groups {:?}",
        v.bytes() >> 20,
        report.prefix_end
    );
    if v.bytes() < block_of(STREAMS - 1, RECORDS) + BS as u64 {
        return Err("the volume is too small for the records".into());
    }

    // Write both streams in turn; kill the second target part-way and bring it back.
    let started = Instant::now();
    let mut acked = vec![0u64; STREAMS as usize];
    let mut restart: Option<std::thread::JoinHandle<Result<TargetProc, String>>> = None;
    let mut back_after = None;
    for q in 1..=RECORDS {
        for s in 0..STREAMS {
            let seq = v.next_seq(s)?;
            if seq != q {
                return Err(format!("stream {s} is at group {seq}, expected {q}").into());
            }
            let mut buf = v.alloc(BS).ok_or("the volume's arena ran out")?;
            pattern(s, q, &mut buf);
            v.submit(s, block_of(s, q), buf, true)?;
            take_acks(&mut v, &mut acked)?;
        }
        if q % ACK_EVERY == 0 || q == RECORDS {
            for s in 0..STREAMS {
                v.wait(s)?;
            }
            take_acks(&mut v, &mut acked)?;
            if acked.iter().any(|&a| a < q) {
                return Err(format!("after wait at record {q}: acknowledged {acked:?}").into());
            }
        }
        if q == KILL_AT {
            let victim = targets[1].take().ok_or("target 1 is not running")?;
            let addr = victim.addr;
            victim.kill()?;
            println!(
                "target 1 ({addr}) killed with SIGKILL after {q} records per stream were durable; \
                 it restarts in {} ms, and meanwhile the volume tries to reach it every 100 ms",
                DOWN.as_millis()
            );
            // The writer goes on: its next write that needs target 1 waits in the volume, which
            // reconnects, recovers and sends again what the target had not made durable.
            let dir = dir.to_path_buf();
            restart = Some(std::thread::spawn(move || {
                std::thread::sleep(DOWN);
                TargetProc::start(&dir, 1, addr).map_err(|e| e.to_string())
            }));
        }
        if restart.as_ref().is_some_and(|h| h.is_finished()) {
            let h = restart.take().expect("checked above");
            targets[1] = Some(h.join().map_err(|_| "the restart thread panicked")??);
            back_after = Some(q);
        }
    }
    if let Some(h) = restart.take() {
        targets[1] = Some(h.join().map_err(|_| "the restart thread panicked")??);
    }
    let took = started.elapsed();
    let st = v.stats();
    println!(
        "wrote {RECORDS} records on each of {STREAMS} streams in {:.2} s: {} ordered commands, {} FLUSHes, {} recovery runs (opening the volume is one; tries while target 1 was down count too), {} writes replayed to the restarted target",
        took.as_secs_f64(),
        st.ordered_cmds,
        st.flushes,
        st.recoveries,
        st.replayed
    );
    if st.recoveries == recoveries_at_open {
        return Err("target 1 was killed but the volume recovered nothing".into());
    }
    match back_after {
        Some(q) => println!("target 1 was back before record {} of each stream", q + 1),
        None => println!("target 1 came back after the last record was written"),
    }

    // Every record of both streams reads back.
    let retried = verify(&mut v)?;
    println!(
        "read back all {} records through the volume: intact ({retried} reads retried)",
        RECORDS * STREAMS as u64
    );
    drop(v);

    // A second initiator: everything was waited for, so each stream's durable prefix ends
    // right after its last record and recovery has nothing to cut.
    let (mut v, report) = Volume::open(config(&addrs))?;
    println!(
        "second initiator: streams resume at groups {:?}, {} writes discarded, recovery took {:.1} ms",
        report.prefix_end,
        report.discarded,
        report.took.as_secs_f64() * 1e3
    );
    if report.prefix_end[..STREAMS as usize] != [RECORDS + 1; STREAMS as usize]
        || report.discarded != 0
    {
        return Err(format!(
            "expected both streams to resume at {} with nothing discarded",
            RECORDS + 1
        )
        .into());
    }
    let retried = verify(&mut v)?;
    println!("second initiator: all records intact ({retried} reads retried)");
    Ok(())
}

/// Take the finished writes: each must have succeeded; `acked` keeps each stream's highest.
fn take_acks(v: &mut Volume, acked: &mut [u64]) -> Res<()> {
    for d in v.poll()? {
        d.result
            .map_err(|e| format!("stream {} group {}: {e}", d.stream, d.seq))?;
        acked[d.stream as usize] = acked[d.stream as usize].max(d.seq);
    }
    Ok(())
}

/// Read every record through the volume and compare it with its pattern; returns how many
/// reads were tried again. A read that a recovery catches (the volume is reconnecting to a
/// target) fails with that reason, and is tried again, up to 5 times.
fn verify(v: &mut Volume) -> Res<u64> {
    let mut want = vec![0u8; BS];
    let mut retried = 0;
    for s in 0..STREAMS {
        for q in 1..=RECORDS {
            let mut tries = 0;
            let d = loop {
                let buf = v.alloc(BS).ok_or("the volume's arena ran out")?;
                v.read(s, block_of(s, q), buf)?;
                let done = v.wait_any()?;
                let d = done.into_iter().next().ok_or("no read completion")?;
                tries += 1;
                match &d.result {
                    Ok(()) => break d,
                    Err(e) if tries == 5 => {
                        return Err(format!("reading stream {s} record {q}: {e}").into())
                    }
                    Err(_) => retried += 1,
                }
            };
            pattern(s, q, &mut want);
            if d.buf[..] != want[..] {
                return Err(format!("stream {s} record {q}: wrong bytes on the volume").into());
            }
        }
    }
    Ok(retried)
}

/// The target process: serve `DIR/target{i}.img` with its log in `DIR/target{i}.log` until
/// killed, or until the example's end closes this process's standard input.
fn target(dir: &Path, i: usize, addr: SocketAddr) -> Res<()> {
    let mut cfg = TargetConfig::new(
        dir.join(format!("target{i}.img")),
        TargetLogKind::File(dir.join(format!("target{i}.log")), LOG_BYTES),
    );
    cfg.streams = STREAMS;
    let t = Target::bind(addr, cfg)?;
    println!("listening {}", t.local_addr());
    let _server = t.spawn();
    // Whatever way the example ends, its end closes our standard input.
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    Ok(())
}
