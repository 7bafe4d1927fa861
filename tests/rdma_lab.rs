//! rio-net over RDMA (Soft-RoCE), in the lab guest (`harness = false`, feature `rdma`).
//!
//! `rdma_lab --integrity`: the same data-integrity test runs twice, first over TCP on
//! 127.0.0.1, then over RDMA on `AIOS_LAB_RDMA_ADDR` (an address of the interface the lab
//! put a Soft-RoCE device on). Each run starts two aios targets in this process, one per
//! device of `AIOS_LAB_RDMA_DEVICES` (default `/dev/nullb0,/dev/nullb1`), and a volume striped
//! over them (4 KiB round robin, two streams):
//!
//! 1. ordered writes of 4 to 128 KiB (groups spanning both targets), handed back in order per
//!    stream, and orderless writes; everything read back through the volume;
//! 2. every range compared on the backing devices at the offset the stripe puts it;
//! 3. an initiator that vanishes with writes in flight: a new one recovers, every write the
//!    first was told was durable reads back, and every group below the recovered prefix is
//!    whole on both targets;
//! 4. a volume that merges (batch 8, 64 KiB stripes): sequential 4 KiB groups go out as merged
//!    commands and read back.
//!
//! Over RDMA the targets must have pulled write data with RDMA READ (and sent no R2T).
//!
//! `rdma_lab --integrity --remote A:P,B:P [--transport tcp|rdma]` runs the test against targets
//! started elsewhere (in another network namespace: lab steps `rdma-netns` and `tcp-netem`).
//! Not run on the host (no RDMA device there).

mod common;
use common::{fill_pattern, same};

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::rc::Rc;
use std::time::{Duration, Instant};

use aios_core::{Engine, EngineConfig, FixedBuf};
use lbio::{Device, DeviceConfig, LbioArray, LbioConfig};
use rio_net::{
    Done, Target, TargetConfig, TargetLogKind, TargetStatsHandle, Transport, Volume, VolumeConfig,
};

const STRIPE: u64 = 4096;
const STREAMS: u16 = 2;
/// Bytes of each device the targets serve.
const NS_BYTES: u64 = 64 << 20;
/// Each stream writes in its own quarter of the volume.
const AREA: u64 = 2 * NS_BYTES / 4;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--list") {
        return ExitCode::SUCCESS;
    }
    let remote = args
        .iter()
        .position(|a| a == "--remote")
        .and_then(|i| args.get(i + 1))
        .map(|l| {
            l.split(',')
                .map(|a| {
                    a.parse::<SocketAddr>()
                        .expect("--remote ADDR:PORT,ADDR:PORT")
                })
                .collect::<Vec<_>>()
        });
    if !args.iter().any(|a| a == "--integrity") {
        println!("rdma_lab: runs in the lab guest only (cargo xtask lab): pass --integrity");
        return ExitCode::SUCCESS;
    }
    let addr: IpAddr = std::env::var("AIOS_LAB_RDMA_ADDR")
        .unwrap_or_else(|_| "10.9.0.1".into())
        .parse()
        .expect("AIOS_LAB_RDMA_ADDR is an IP address");
    let devices: Vec<PathBuf> = std::env::var("AIOS_LAB_RDMA_DEVICES")
        .unwrap_or_else(|_| "/dev/nullb0,/dev/nullb1".into())
        .split(',')
        .map(PathBuf::from)
        .collect();
    let remote_transport: Transport = args
        .iter()
        .position(|a| a == "--transport")
        .and_then(|i| args.get(i + 1))
        .map_or(Transport::Rdma, |t| {
            t.parse().expect("--transport tcp|rdma")
        });
    let mut failed = false;
    if let Some(targets) = remote {
        // Targets started elsewhere (another network namespace).
        let tr = remote_transport;
        println!("=== {tr:?} to {targets:?}");
        let t0 = Instant::now();
        match integrity(tr, Err(targets), &devices, 0x5e5e) {
            Ok(()) => println!("{tr:?}: ok in {:.1} s", t0.elapsed().as_secs_f64()),
            Err(e) => {
                eprintln!("rdma_lab: {tr:?}: FAILED: {e}");
                failed = true;
            }
        }
    }
    let local = if args.iter().any(|a| a == "--remote") {
        Vec::new()
    } else {
        vec![
            (Transport::Tcp, "127.0.0.1".parse().unwrap(), 0x7c9),
            (Transport::Rdma, addr, 0x4d4a),
        ]
    };
    for (transport, ip, seed) in local {
        println!("=== {transport:?} on {ip}");
        let t0 = Instant::now();
        match integrity(transport, Ok(ip), &devices, seed) {
            Ok(()) => println!("{transport:?}: ok in {:.1} s", t0.elapsed().as_secs_f64()),
            Err(e) => {
                eprintln!("rdma_lab: {transport:?}: FAILED: {e}");
                failed = true;
            }
        }
    }
    if failed {
        if let Ok(out) = Command::new("dmesg").output() {
            let text = String::from_utf8_lossy(&out.stdout);
            let lines: Vec<&str> = text.lines().collect();
            eprintln!("--- dmesg (last 30 lines)");
            for l in &lines[lines.len().saturating_sub(30)..] {
                eprintln!("{l}");
            }
        }
        return ExitCode::FAILURE;
    }
    println!("rdma_lab: ok");
    ExitCode::SUCCESS
}

fn start_targets(
    transport: Transport,
    ip: IpAddr,
    devices: &[PathBuf],
    port0: u16,
) -> Result<(Vec<SocketAddr>, Vec<TargetStatsHandle>), String> {
    let mut addrs = Vec::new();
    let mut stats = Vec::new();
    for (i, dev) in devices.iter().enumerate() {
        let mut cfg = TargetConfig::new(dev, TargetLogKind::Mem(2 << 20));
        cfg.streams = 4;
        cfg.format = true;
        cfg.ns_bytes = Some(NS_BYTES);
        cfg.transport = transport;
        let at = SocketAddr::new(ip, port0 + i as u16);
        let t = Target::bind(at, cfg).map_err(|e| format!("target on {at}: {e}"))?;
        addrs.push(t.local_addr());
        stats.push(t.stats_handle());
        t.spawn();
    }
    Ok((addrs, stats))
}

fn volume_cfg(transport: Transport, targets: &[SocketAddr]) -> VolumeConfig {
    let mut c = VolumeConfig::new(targets.to_vec(), STREAMS);
    c.transport = transport;
    c.stripe = STRIPE as u32;
    // Room for every write a full window holds (64 per stream, up to 128 KiB each).
    c.arena_bytes = 64 << 20;
    c.io_timeout = Duration::from_secs(20);
    c
}

/// Where volume byte `off` lives: (target, byte offset on its device).
fn locate(off: u64, targets: u64) -> (usize, u64) {
    let unit = off / STRIPE;
    (
        (unit % targets) as usize,
        unit / targets * STRIPE + off % STRIPE,
    )
}

/// A buffer from the volume's arena; while it is full, drive the volume (finished requests
/// give their buffers back) and keep what finishes in `done`.
fn alloc(v: &mut Volume, len: usize, done: &mut Vec<Done>) -> Result<FixedBuf, String> {
    let t0 = Instant::now();
    loop {
        if let Some(b) = v.alloc(len) {
            return Ok(b);
        }
        if t0.elapsed() > Duration::from_secs(20) {
            return Err(format!(
                "no {len}-byte buffer in the volume's arena for 20 s"
            ));
        }
        let got = v.poll().map_err(|e| format!("poll: {e}"))?;
        if got.is_empty() {
            std::thread::sleep(Duration::from_micros(200));
        }
        done.extend(got);
    }
}

fn check_done(d: &Done) -> Result<(), String> {
    d.result
        .clone()
        .map_err(|e| format!("stream {} write {} failed: {e}", d.stream, d.id))
}

/// `at`: the address to start targets on here, or the addresses of targets already running
/// (their counters are then not seen here).
fn integrity(
    transport: Transport,
    at: Result<IpAddr, Vec<SocketAddr>>,
    devices: &[PathBuf],
    seed: u64,
) -> Result<(), String> {
    let port0 = if transport == Transport::Tcp {
        4440
    } else {
        4450
    };
    let (targets, stats) = match at {
        Ok(ip) => start_targets(transport, ip, devices, port0)?,
        Err(addrs) => (addrs, Vec::new()),
    };
    let nt = targets.len() as u64;
    let (mut v, rep) =
        Volume::open(volume_cfg(transport, &targets)).map_err(|e| format!("open: {e}"))?;
    if rep
        .prefix_end
        .iter()
        .take(STREAMS as usize)
        .any(|&p| p != 1)
    {
        return Err(format!(
            "fresh logs, yet recovery found prefixes {:?}",
            rep.prefix_end
        ));
    }

    // 1. Ordered writes of 4..128 KiB, one group each; orderless writes between them.
    let sizes = [4096u64, 8192, 16384, 65536, 131072, 4096, 12288];
    let mut written: Vec<(u64, usize)> = Vec::new();
    let mut next = [0u64; STREAMS as usize];
    let mut done: Vec<Done> = Vec::new();
    let t0 = Instant::now();
    let mut bytes = 0u64;
    for g in 0..240usize {
        for s in 0..STREAMS {
            let len = sizes[(g + s as usize) % sizes.len()];
            let off = s as u64 * AREA + next[s as usize];
            next[s as usize] += len;
            let mut b = alloc(&mut v, len as usize, &mut done)?;
            fill_pattern(&mut b, off, seed);
            v.submit(s, off, b, true)
                .map_err(|e| format!("submit: {e}"))?;
            written.push((off, len as usize));
            bytes += len;
            done.extend(v.poll().map_err(|e| format!("poll: {e}"))?);
        }
        if g % 8 == 0 {
            let off = 2 * AREA + g as u64 * 16384;
            let mut b = alloc(&mut v, 16384, &mut done)?;
            fill_pattern(&mut b, off, seed);
            v.write_orderless(0, off, b)
                .map_err(|e| format!("orderless: {e}"))?;
            written.push((off, 16384));
            bytes += 16384;
        }
    }
    for s in 0..STREAMS {
        v.wait(s).map_err(|e| format!("wait: {e}"))?;
    }
    done.extend(v.poll().map_err(|e| format!("poll: {e}"))?);
    while done.len() < 240 * STREAMS as usize + 30 {
        done.extend(v.wait_any().map_err(|e| format!("wait_any: {e}"))?);
    }
    let secs = t0.elapsed().as_secs_f64();
    for d in &done {
        check_done(d)?;
    }
    for s in 0..STREAMS {
        let seqs: Vec<u64> = done
            .iter()
            .filter(|d| d.stream == s && d.seq != 0)
            .map(|d| d.seq)
            .collect();
        if seqs != (1..=240).collect::<Vec<_>>() {
            return Err(format!("stream {s}: handed back out of order: {seqs:?}"));
        }
    }
    drop(done);
    println!(
        "{} writes ({:.1} MiB, 4-128 KiB) durable in {secs:.2} s ({:.1} MB/s under emulation)",
        written.len(),
        bytes as f64 / (1 << 20) as f64,
        bytes as f64 / secs / 1e6
    );
    for &(off, len) in &written {
        let b = alloc(&mut v, len, &mut Vec::new())?;
        v.read(1, off, b).map_err(|e| format!("read: {e}"))?;
        let d = v.wait_any().map_err(|e| format!("read: {e}"))?;
        check_done(&d[0])?;
        let mut want = vec![0u8; len];
        fill_pattern(&mut want, off, seed);
        same(
            &format!("volume read at {off} ({len} bytes)"),
            &d[0].buf,
            &want,
        )?;
    }
    println!("read back through the volume: {} ranges", written.len());

    // 2. The backing devices hold each 4 KiB stripe unit where the stripe puts it.
    let engine = Engine::new(EngineConfig {
        arena_bytes: 4 << 20,
        huge_pages: false,
        ..EngineConfig::default()
    })
    .map_err(|e| format!("engine: {e}"))?;
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default())
        .map_err(|e| format!("lbio: {e}"))?;
    let backs: Vec<Device> = devices
        .iter()
        .map(|d| {
            Device::open(&lbio, d, DeviceConfig::default())
                .map_err(|e| format!("{}: {e}", d.display()))
        })
        .collect::<Result<_, _>>()?;
    let mut units = 0;
    for &(off, len) in &written {
        let mut at = off;
        while at < off + len as u64 {
            let (t, toff) = locate(at, nt);
            let mut b = engine
                .alloc_blocking(STRIPE as usize)
                .map_err(|e| e.to_string())?;
            b.set_len(STRIPE as usize).map_err(|e| e.to_string())?;
            let b = backs[t]
                .read_at_blocking(toff, b)
                .map_err(|e| format!("backing read: {e}"))?;
            let mut want = vec![0u8; STRIPE as usize];
            fill_pattern(&mut want, at, seed);
            same(
                &format!("{} at {toff} (volume byte {at})", devices[t].display()),
                &b,
                &want,
            )?;
            at += STRIPE;
            units += 1;
        }
    }
    println!("the backing devices hold all {units} stripe units in place");

    // 3. An initiator that vanishes with writes in flight; a new one recovers.
    let base = 3 * AREA;
    let mut acked: Vec<u64> = Vec::new();
    for g in 0..200u64 {
        let off = base + g * 8192;
        let mut early = Vec::new();
        let mut b = alloc(&mut v, 8192, &mut early)?;
        for d in early {
            check_done(&d)?;
            acked.push(d.seq);
        }
        fill_pattern(&mut b, off, seed ^ 0xdead);
        v.submit(0, off, b, true)
            .map_err(|e| format!("submit: {e}"))?;
        for d in v.poll().map_err(|e| format!("poll: {e}"))? {
            check_done(&d)?;
            acked.push(d.seq);
        }
    }
    let first_seq = v.next_seq(0).map_err(|e| e.to_string())? - 200;
    drop(v);
    let (mut v, rep) = Volume::open(volume_cfg(transport, &targets))
        .map_err(|e| format!("recovery after the initiator vanished: {e}"))?;
    let prefix = rep.prefix_end[0];
    let last_acked = acked.iter().copied().max().unwrap_or(0);
    println!(
        "initiator vanished with {} of 200 writes acknowledged; recovery: stream 0 prefix ends at group {prefix} (first of the 200: {first_seq}), {} discarded, took {:?}",
        acked.len(),
        rep.discarded,
        rep.took
    );
    if prefix <= last_acked {
        return Err(format!(
            "group {last_acked} was acknowledged durable but recovery cut stream 0 at {prefix}"
        ));
    }
    for seq in first_seq..prefix {
        let off = base + (seq - first_seq) * 8192;
        let b = alloc(&mut v, 8192, &mut Vec::new())?;
        v.read(1, off, b).map_err(|e| format!("read: {e}"))?;
        let d = v.wait_any().map_err(|e| format!("read: {e}"))?;
        check_done(&d[0])?;
        let mut want = vec![0u8; 8192];
        fill_pattern(&mut want, off, seed ^ 0xdead);
        same(
            &format!("group {seq} below the recovered prefix"),
            &d[0].buf,
            &want,
        )?;
    }
    drop(v);

    // 4. Merging: a volume that holds 8 closed groups and stripes by 64 KiB. Sequential 4 KiB
    //    groups go out as merged commands (each one copy in the arena: over RDMA the targets
    //    pull it with one READ) and read back through the volume.
    let mut cfg = volume_cfg(transport, &targets);
    cfg.stripe = 64 << 10;
    cfg.batch = 8;
    let (mut v, _) = Volume::open(cfg).map_err(|e| format!("open with merging: {e}"))?;
    // Past the orderless writes of the third quarter.
    let base = 2 * AREA + (8 << 20);
    let n = 256u64;
    let mut done: Vec<Done> = Vec::new();
    for g in 0..n {
        let off = base + g * 4096;
        let mut b = alloc(&mut v, 4096, &mut done)?;
        fill_pattern(&mut b, off, seed ^ 0x3e3e);
        v.submit(0, off, b, true)
            .map_err(|e| format!("submit: {e}"))?;
        if (g + 1) % 8 == 0 {
            done.extend(v.poll().map_err(|e| format!("poll: {e}"))?);
        }
    }
    v.wait(0).map_err(|e| format!("wait: {e}"))?;
    done.extend(v.poll().map_err(|e| format!("poll: {e}"))?);
    for d in &done {
        check_done(d)?;
    }
    if done.len() as u64 != n {
        return Err(format!("merging: {} of {n} writes handed back", done.len()));
    }
    let st = v.stats();
    if st.merged_cmds == 0 {
        return Err(format!("merging: no merged command went out ({st:?})"));
    }
    for g in 0..n {
        let off = base + g * 4096;
        let b = alloc(&mut v, 4096, &mut Vec::new())?;
        v.read(0, off, b).map_err(|e| format!("read: {e}"))?;
        let d = v.wait_any().map_err(|e| format!("read: {e}"))?;
        check_done(&d[0])?;
        let mut want = vec![0u8; 4096];
        fill_pattern(&mut want, off, seed ^ 0x3e3e);
        same(&format!("merged group {g}"), &d[0].buf, &want)?;
    }
    println!(
        "merging: {n} groups of 4 KiB went out in {} merged commands ({} groups) and {} commands in all; read back",
        st.merged_cmds, st.merged_groups, st.ordered_cmds
    );
    drop(v);
    let mut total_reads = 0;
    let mut total_r2t = 0;
    for (i, h) in stats.iter().enumerate() {
        let s = h.stats();
        println!(
            "target {i}: {} connections, {} ordered writes, {} orderless, {} reads, {} pulled by RDMA READ, {} R2Ts, {} closed on errors",
            s.connections, s.ordered_writes, s.orderless, s.reads, s.rdma_reads, s.r2ts, s.closed_on_error
        );
        total_reads += s.rdma_reads;
        total_r2t += s.r2ts;
    }
    if transport == Transport::Rdma && !stats.is_empty() && (total_reads == 0 || total_r2t != 0) {
        return Err(format!(
            "over RDMA the targets should pull every write with RDMA READ: {total_reads} READs, {total_r2t} R2Ts"
        ));
    }
    Ok(())
}
