//! Fault tests for rio-net over network namespaces (root and iproute2; skipped otherwise):
//! SIGKILL a target mid-stream and restart it; SIGKILL the initiator and recover with a new
//! one; take a target's link down and up again. After each run the volume must hold exactly a
//! prefix of the stream's order — every write before the recovered prefix end reads back with
//! its pattern, the next ones read zero — and every acknowledged write must be inside it.
//!
//! Each write of the stream is its own group and goes to its own 4 KiB block (out-of-place:
//! group `q` writes block `q`), so the prefix is visible on the volume. Runs per kind:
//! `AIOS_NET_FAULT_RUNS` (default 20).

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aios::netlab::NetLab;
use aios::rio_net::{Volume, VolumeConfig};

const WINDOW: u32 = 16;

fn pattern(seq: u64, buf: &mut [u8]) {
    for (i, c) in buf.chunks_mut(8).enumerate() {
        c.copy_from_slice(&(seq.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i as u64).to_le_bytes());
    }
}

fn cfg(addrs: &[SocketAddr]) -> VolumeConfig {
    let mut c = VolumeConfig::new(addrs.to_vec(), 1);
    c.window = WINDOW;
    c.io_timeout = Duration::from_millis(800);
    c.reconnect_for = Duration::from_secs(20);
    c
}

/// Write groups `from..from+n` (block = seq); returns the highest acknowledged seq.
fn workload(v: &mut Volume, n: u64, mut on_ack: impl FnMut(u64)) -> Result<u64, String> {
    let blocks = v.bytes() / 4096;
    let mut acked = 0;
    for _ in 0..n {
        let seq = v.next_seq(0);
        let mut b = v.alloc(4096).ok_or("arena exhausted")?;
        pattern(seq, &mut b);
        v.submit(0, (seq % blocks) * 4096, b, true)
            .map_err(|e| e.to_string())?;
        for d in v.poll().map_err(|e| e.to_string())? {
            d.result.clone()?;
            acked = acked.max(d.seq);
            on_ack(d.seq);
        }
    }
    v.wait(0).map_err(|e| e.to_string())?;
    for d in v.poll().map_err(|e| e.to_string())? {
        d.result.clone()?;
        acked = acked.max(d.seq);
        on_ack(d.seq);
    }
    Ok(acked)
}

/// Blocks of seqs `from..prefix` hold their pattern; `prefix..prefix+beyond` read zero.
fn check_prefix(v: &mut Volume, from: u64, prefix: u64, beyond: u64) -> Result<(), String> {
    let blocks = v.bytes() / 4096;
    for seq in from..prefix + beyond {
        // A read caught by a recovery fails; read again.
        let mut tries = 0;
        let d = loop {
            let b = v.alloc(4096).ok_or("arena exhausted")?;
            v.read(0, (seq % blocks) * 4096, b)
                .map_err(|e| e.to_string())?;
            let d = v.wait_any().map_err(|e| e.to_string())?;
            let d = d.into_iter().next().ok_or("no read completion")?;
            tries += 1;
            match &d.result {
                Ok(()) => break d,
                Err(e) if tries >= 5 => return Err(format!("reading group {seq}: {e}")),
                Err(_) => {}
            }
        };
        let mut want = vec![0u8; 4096];
        if seq < prefix {
            pattern(seq, &mut want);
        }
        if d.buf[..] != want[..] {
            return Err(format!(
                "group {seq} (prefix ends at {prefix}): block holds {} data",
                if d.buf.iter().all(|&x| x == 0) {
                    "no"
                } else if seq < prefix {
                    "wrong"
                } else {
                    "leftover"
                }
            ));
        }
    }
    Ok(())
}

fn rng(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

fn target_kill(lab: &Arc<Mutex<NetLab>>, runs: u32, seed: &mut u64) -> Result<(), String> {
    let addrs = lab.lock().unwrap().addrs();
    let (mut v, _) = Volume::open(cfg(&addrs)).map_err(|e| e.to_string())?;
    for run in 0..runs {
        let victim = (rng(seed) % addrs.len() as u64) as usize;
        let delay = Duration::from_millis(20 + rng(seed) % 150);
        let down = Duration::from_millis(50 + rng(seed) % 200);
        let l = Arc::clone(lab);
        let killer = std::thread::spawn(move || {
            std::thread::sleep(delay);
            l.lock().unwrap().kill(victim);
            std::thread::sleep(down);
            l.lock().unwrap().spawn(victim, false)
        });
        let from = v.next_seq(0);
        // Keep writing until the fault is over, then a little more.
        let mut acked = 0;
        let mut written = 0;
        while !killer.is_finished() && written < 6000 {
            acked = workload(&mut v, 200, |_| {})?;
            written += 200;
        }
        killer.join().unwrap()?;
        acked = acked.max(workload(&mut v, 200, |_| {})?);
        // Everything written was waited for: the whole run is the prefix.
        let prefix = v.next_seq(0);
        if acked + 1 != prefix {
            return Err(format!(
                "run {run}: acknowledged up to {acked}, stream at {prefix}"
            ));
        }
        check_prefix(&mut v, from, prefix, 4).map_err(|e| format!("target-kill run {run}: {e}"))?;
        println!("target-kill run {run}: target {victim} killed after {delay:?}; groups {from}..{prefix} durable, recoveries so far {}", v.stats().recoveries);
    }
    Ok(())
}

fn link_cut(lab: &Arc<Mutex<NetLab>>, runs: u32, seed: &mut u64) -> Result<(), String> {
    let addrs = lab.lock().unwrap().addrs();
    let (mut v, _) = Volume::open(cfg(&addrs)).map_err(|e| e.to_string())?;
    for run in 0..runs {
        let victim = (rng(seed) % addrs.len() as u64) as usize;
        let delay = Duration::from_millis(20 + rng(seed) % 150);
        let down = Duration::from_millis(300 + rng(seed) % 1200);
        let l = Arc::clone(lab);
        let cutter = std::thread::spawn(move || {
            std::thread::sleep(delay);
            l.lock().unwrap().link(victim, false)?;
            std::thread::sleep(down);
            l.lock().unwrap().link(victim, true)
        });
        let from = v.next_seq(0);
        // Keep writing until the fault is over, then a little more.
        let mut acked = 0;
        let mut written = 0;
        while !cutter.is_finished() && written < 6000 {
            acked = workload(&mut v, 200, |_| {})?;
            written += 200;
        }
        cutter.join().unwrap()?;
        acked = acked.max(workload(&mut v, 200, |_| {})?);
        let prefix = v.next_seq(0);
        if acked + 1 != prefix {
            return Err(format!(
                "run {run}: acknowledged up to {acked}, stream at {prefix}"
            ));
        }
        check_prefix(&mut v, from, prefix, 4).map_err(|e| format!("link-cut run {run}: {e}"))?;
        println!("link-cut run {run}: link of target {victim} down {down:?}; groups {from}..{prefix} durable, recoveries so far {}", v.stats().recoveries);
    }
    Ok(())
}

fn initiator_kill(lab: &Arc<Mutex<NetLab>>, runs: u32, seed: &mut u64) -> Result<(), String> {
    let addrs = lab.lock().unwrap().addrs();
    let list = addrs
        .iter()
        .map(|a| a.to_string())
        .collect::<Vec<_>>()
        .join(",");
    for run in 0..runs {
        let (v, rep) = Volume::open(cfg(&addrs)).map_err(|e| e.to_string())?;
        let from = rep.prefix_end[0];
        drop(v);
        let mut child = Command::new(std::env::current_exe().unwrap())
            .env("AIOS_NET_FAULT_CHILD", &list)
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| e.to_string())?;
        let out = child.stdout.take().unwrap();
        let kill_after = Duration::from_millis(100 + rng(seed) % 400);
        let start = Instant::now();
        let mut acked = 0u64;
        let mut lines = BufReader::new(out).lines();
        // Read acknowledgements until the kill time, then kill.
        let (tx, rx) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            for l in lines.by_ref().map_while(Result::ok) {
                if let Some(s) = l.strip_prefix("ack ") {
                    let _ = tx.send(s.parse::<u64>().unwrap_or(0));
                }
            }
        });
        while start.elapsed() < kill_after {
            while let Ok(a) = rx.try_recv() {
                acked = acked.max(a);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = child.kill();
        let _ = child.wait();
        reader.join().unwrap();
        while let Ok(a) = rx.try_recv() {
            acked = acked.max(a);
        }
        let (mut v, rep) = Volume::open(cfg(&addrs)).map_err(|e| e.to_string())?;
        let prefix = rep.prefix_end[0];
        if acked >= prefix {
            return Err(format!("initiator-kill run {run}: group {acked} was acknowledged but recovery ends the prefix at {prefix}"));
        }
        check_prefix(&mut v, from, prefix, WINDOW as u64 + 4)
            .map_err(|e| format!("initiator-kill run {run}: {e}"))?;
        println!("initiator-kill run {run}: killed after {kill_after:?}; acknowledged < {}, prefix {from}..{prefix}, {} writes zeroed", acked + 1, rep.discarded);
    }
    Ok(())
}

fn child(list: &str) {
    let addrs: Vec<SocketAddr> = list.split(',').map(|s| s.parse().unwrap()).collect();
    let (mut v, _) = Volume::open(cfg(&addrs)).expect("child volume");
    let mut out = std::io::stdout();
    let _ = workload(&mut v, 1_000_000, |seq| {
        let _ = writeln!(out, "ack {seq}");
        let _ = out.flush();
    });
}

fn main() {
    if let Ok(list) = std::env::var("AIOS_NET_FAULT_CHILD") {
        child(&list);
        return;
    }
    // libtest-style filtering: `cargo test --test net_faults -- --list` etc. are not needed.
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let root = nix_is_root();
    let has_ip = Command::new("ip")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    if !root || !has_ip {
        println!("net_faults: skipped (needs root and iproute2 for network namespaces)");
        return;
    }
    let runs: u32 = std::env::var("AIOS_NET_FAULT_RUNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let aios = std::path::PathBuf::from(env!("CARGO_BIN_EXE_aios"));
    let mut seed = std::env::var("AIOS_NET_FAULT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_1234u64);
    println!("net_faults: seed {seed}, {runs} runs per kind");
    let started = Instant::now();
    let mut failed = false;
    for (name, f) in [
        (
            "target-kill",
            target_kill as fn(&Arc<Mutex<NetLab>>, u32, &mut u64) -> Result<(), String>,
        ),
        ("initiator-kill", initiator_kill),
        ("link-cut", link_cut),
    ] {
        // A fresh lab per kind: blocks are never reused within one (group q writes block q).
        let lab = NetLab::start(&aios, 2, 512 << 20, 4, false).expect("network lab");
        let lab = Arc::new(Mutex::new(lab));
        match f(&lab, runs, &mut seed) {
            Ok(()) => println!("net_faults: {name}: {runs} runs ok"),
            Err(e) => {
                println!("net_faults: {name}: FAILED: {e}");
                failed = true;
            }
        }
    }
    println!("net_faults: took {:.1} s", started.elapsed().as_secs_f64());
    if failed {
        std::process::exit(1);
    }
}

fn nix_is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}
