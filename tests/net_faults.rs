//! Fault tests for rio-net over network namespaces (root and iproute2; skipped otherwise):
//! SIGKILL a target mid-stream and restart it; SIGKILL the initiator and recover with a new
//! one; take a target's link down and up again. After each run the volume must hold exactly a
//! prefix of the stream's order — every write before the recovered prefix end reads back with
//! its pattern, the next ones read zero — and every acknowledged write must be inside it.
//!
//! Each write of the stream is its own group and goes to its own 4 KiB block (out-of-place:
//! group `q` writes block `q`), so the prefix is visible on the volume. Runs per kind:
//! `AIOS_NET_FAULT_RUNS` (default 20; the lab's devices grow with it).

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
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

/// Groups held and merged (`VolumeConfig::batch`) in the target-kill runs and in every other
/// initiator-kill run: their recoveries then read merged log entries. The link-cut runs send
/// every group alone.
const MERGE_BATCH: u32 = 8;

/// `merge`: stripes of 64 KiB, so that consecutive groups (consecutive blocks) share a target
/// 16 at a time (200 groups still cover both targets), and, with `batch`, groups held and
/// merged. The stripe must be the same for every volume opened on one lab.
fn cfg(addrs: &[SocketAddr], merge: bool, batch: u32) -> VolumeConfig {
    let mut c = VolumeConfig::new(addrs.to_vec(), 1);
    c.window = WINDOW;
    c.io_timeout = Duration::from_millis(800);
    c.reconnect_for = Duration::from_secs(20);
    if merge {
        c.stripe = 64 << 10;
        c.batch = batch;
    }
    c
}

/// Write groups `from..from+n` (block = seq); returns the highest acknowledged seq. With
/// merging, it polls once per `VolumeConfig::batch` groups (a poll sends what is held).
fn workload(v: &mut Volume, n: u64, mut on_ack: impl FnMut(u64)) -> Result<u64, String> {
    let blocks = v.bytes() / 4096;
    let every = v.batch() as u64;
    let mut acked = 0;
    for i in 0..n {
        let seq = v.next_seq(0).map_err(|e| e.to_string())?;
        let mut b = v.alloc(4096).ok_or("arena exhausted")?;
        pattern(seq, &mut b);
        v.submit(0, (seq % blocks) * 4096, b, true)
            .map_err(|e| e.to_string())?;
        if (i + 1) % every != 0 {
            continue;
        }
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
    // Group q writes block q: past the volume's end blocks would be reused, and the check
    // would read an older run's data.
    if prefix + beyond > blocks {
        return Err(format!(
            "groups up to {} do not fit the volume's {blocks} blocks: fewer runs, or a bigger lab",
            prefix + beyond
        ));
    }
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

/// Write batches of 200 groups until the fault thread `fault` is done, then one batch more,
/// so that the fault lands while the stream is being written and writes complete after it
/// (not after a fixed number of writes that may run out before the fault fires). The fault
/// thread waits for `started` (the first batch acknowledged) before its delay, and sets `fired`
/// once the fault is in place. Returns the highest acknowledged group and how many batches were
/// under way when `fired` was set.
fn write_through_fault(
    v: &mut Volume,
    fault: std::thread::JoinHandle<Result<(), String>>,
    started: &AtomicBool,
    fired: &AtomicBool,
) -> Result<(u64, u32), String> {
    let t0 = Instant::now();
    let mut acked = 0;
    let mut straddling = 0;
    loop {
        let done = fault.is_finished();
        let before = fired.load(Ordering::SeqCst);
        acked = acked.max(workload(v, 200, |_| {})?);
        started.store(true, Ordering::SeqCst);
        if !before && fired.load(Ordering::SeqCst) {
            straddling += 1;
        }
        if done {
            break;
        }
        if t0.elapsed() > Duration::from_secs(120) {
            return Err("the fault thread did not finish within 120 s".into());
        }
    }
    fault
        .join()
        .map_err(|_| "the fault thread panicked".to_string())??;
    if !fired.load(Ordering::SeqCst) {
        return Err("the fault thread ended without firing its fault".into());
    }
    Ok((acked, straddling))
}

/// Sleep until `started` is set (the writer's first batch is acknowledged), then `delay`.
fn wait_for_writes(started: &AtomicBool, delay: Duration) -> Result<(), String> {
    let t0 = Instant::now();
    while !started.load(Ordering::SeqCst) {
        if t0.elapsed() > Duration::from_secs(60) {
            return Err("the writer acknowledged no write within 60 s".into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(delay);
    Ok(())
}

fn target_kill(lab: &Arc<Mutex<NetLab>>, runs: u32, seed: &mut u64) -> Result<(), String> {
    let addrs = lab.lock().unwrap().addrs();
    let (mut v, _) = Volume::open(cfg(&addrs, true, MERGE_BATCH)).map_err(|e| e.to_string())?;
    let (mut total_straddling, mut total_checked) = (0u32, 0u64);
    for run in 0..runs {
        let victim = (rng(seed) % addrs.len() as u64) as usize;
        let delay = Duration::from_millis(20 + rng(seed) % 150);
        let down = Duration::from_millis(50 + rng(seed) % 200);
        let l = Arc::clone(lab);
        let started = Arc::new(AtomicBool::new(false));
        let fired = Arc::new(AtomicBool::new(false));
        let (s, f) = (Arc::clone(&started), Arc::clone(&fired));
        let killer = std::thread::spawn(move || {
            wait_for_writes(&s, delay)?;
            l.lock().unwrap().kill(victim);
            f.store(true, Ordering::SeqCst);
            std::thread::sleep(down);
            l.lock().unwrap().spawn(victim, false)
        });
        let from = v.next_seq(0).map_err(|e| e.to_string())?;
        let recoveries_before = v.stats().recoveries;
        // Keep writing until the fault is over, then a little more.
        let (acked, straddling) = write_through_fault(&mut v, killer, &started, &fired)
            .map_err(|e| format!("target-kill run {run}: {e}"))?;
        // Everything written was waited for: the whole run is the prefix.
        let prefix = v.next_seq(0).map_err(|e| e.to_string())?;
        if acked + 1 != prefix {
            return Err(format!(
                "run {run}: acknowledged up to {acked}, stream at {prefix}"
            ));
        }
        // Writes went to the killed target after it died (the stripes alternate between the
        // targets), so its connection failed and the volume must have recovered.
        let recoveries = v.stats().recoveries - recoveries_before;
        if recoveries == 0 {
            return Err(format!(
                "target-kill run {run}: target {victim} was killed under writes, yet the volume \
                 never recovered"
            ));
        }
        check_prefix(&mut v, from, prefix, 4).map_err(|e| format!("target-kill run {run}: {e}"))?;
        total_straddling += straddling;
        total_checked += prefix - from;
        println!("target-kill run {run}: target {victim} killed {delay:?} into the writes ({straddling} batch in flight); groups {from}..{prefix} durable, {recoveries} recoveries in the run, {} so far", v.stats().recoveries);
    }
    // The runs held and merged groups (consecutive blocks share a 64 KiB stripe).
    let st = v.stats();
    if runs > 0 && st.merged_cmds == 0 {
        return Err(format!("target-kill: no group went out merged ({st:?})"));
    }
    println!(
        "target-kill: {} merged commands carried {} groups",
        st.merged_cmds, st.merged_groups
    );
    // Each run's kill fell while a batch was under way unless it hit the moment between two
    // batches: across the runs, some must have.
    if runs > 0 && (total_straddling == 0 || total_checked == 0) {
        return Err(format!(
            "no kill landed while writes were in flight ({total_straddling} batches) or nothing \
             was checked ({total_checked} groups)"
        ));
    }
    Ok(())
}

fn link_cut(lab: &Arc<Mutex<NetLab>>, runs: u32, seed: &mut u64) -> Result<(), String> {
    let addrs = lab.lock().unwrap().addrs();
    let config = cfg(&addrs, false, 1);
    // A link down this long leaves the writes to its target unanswered past the io timeout
    // (the initiator checks every 100 ms or sooner): the volume must recover. Shorter cuts may
    // be bridged by TCP's retransmissions.
    let io_timeout = config.io_timeout;
    let must_recover = io_timeout + Duration::from_millis(300);
    let (mut v, _) = Volume::open(config).map_err(|e| e.to_string())?;
    let (mut total_straddling, mut total_checked) = (0u32, 0u64);
    for run in 0..runs {
        let victim = (rng(seed) % addrs.len() as u64) as usize;
        let delay = Duration::from_millis(20 + rng(seed) % 150);
        let down = Duration::from_millis(300 + rng(seed) % 1200);
        let l = Arc::clone(lab);
        let started = Arc::new(AtomicBool::new(false));
        let fired = Arc::new(AtomicBool::new(false));
        let (s, f) = (Arc::clone(&started), Arc::clone(&fired));
        let cutter = std::thread::spawn(move || {
            wait_for_writes(&s, delay)?;
            l.lock().unwrap().link(victim, false)?;
            f.store(true, Ordering::SeqCst);
            std::thread::sleep(down);
            l.lock().unwrap().link(victim, true)
        });
        let from = v.next_seq(0).map_err(|e| e.to_string())?;
        let recoveries_before = v.stats().recoveries;
        // Keep writing until the fault is over, then a little more.
        let (acked, straddling) = write_through_fault(&mut v, cutter, &started, &fired)
            .map_err(|e| format!("link-cut run {run}: {e}"))?;
        let prefix = v.next_seq(0).map_err(|e| e.to_string())?;
        if acked + 1 != prefix {
            return Err(format!(
                "run {run}: acknowledged up to {acked}, stream at {prefix}"
            ));
        }
        let recoveries = v.stats().recoveries - recoveries_before;
        if down >= must_recover && recoveries == 0 {
            return Err(format!(
                "link-cut run {run}: the link of target {victim} was down {down:?} under writes \
                 (io timeout {io_timeout:?}), yet the volume never recovered"
            ));
        }
        check_prefix(&mut v, from, prefix, 4).map_err(|e| format!("link-cut run {run}: {e}"))?;
        total_straddling += straddling;
        total_checked += prefix - from;
        println!("link-cut run {run}: link of target {victim} down {down:?} ({straddling} batch in flight); groups {from}..{prefix} durable, {recoveries} recoveries in the run, {} so far", v.stats().recoveries);
    }
    if runs > 0 && (total_straddling == 0 || total_checked == 0) {
        return Err(format!(
            "no cut landed while writes were in flight ({total_straddling} batches) or nothing \
             was checked ({total_checked} groups)"
        ));
    }
    Ok(())
}

/// Exit codes of the child, which only ever ends by the parent's SIGKILL otherwise.
const CHILD_OPEN_FAILED: i32 = 3;
const CHILD_WORKLOAD_FAILED: i32 = 4;
const CHILD_WORKLOAD_ENDED: i32 = 5;
const CHILD_ACK_PIPE_FAILED: i32 = 6;

fn initiator_kill(lab: &Arc<Mutex<NetLab>>, runs: u32, seed: &mut u64) -> Result<(), String> {
    let addrs = lab.lock().unwrap().addrs();
    let list = addrs
        .iter()
        .map(|a| a.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let (mut total_acks, mut total_checked) = (0u64, 0u64);
    for run in 0..runs {
        let (v, rep) = Volume::open(cfg(&addrs, true, 1)).map_err(|e| e.to_string())?;
        // Every other run the child holds and merges its groups. It then writes several times
        // faster, so its kill comes sooner: the lab's blocks must last all the runs.
        let merging = run % 2 == 0;
        let batch = if merging { MERGE_BATCH } else { 1 };
        let from = rep.prefix_end[0];
        drop(v);
        let mut child = Command::new(std::env::current_exe().unwrap())
            .env("AIOS_NET_FAULT_CHILD", &list)
            .env("AIOS_NET_FAULT_BATCH", batch.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| e.to_string())?;
        let out = child.stdout.take().unwrap();
        let mut err = child.stderr.take().unwrap();
        let err_reader = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = std::io::Read::read_to_string(&mut err, &mut s);
            s
        });
        // The kill comes this long after the child's first acknowledgement.
        let kill_after = Duration::from_millis(rng(seed) % if merging { 150 } else { 400 });
        let mut lines = BufReader::new(out).lines();
        let (tx, rx) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            for l in lines.by_ref().map_while(Result::ok) {
                let a = l.strip_prefix("ack ").and_then(|s| s.parse::<u64>().ok());
                let _ = tx.send(a.ok_or(l));
            }
        });
        // Fails the run with the child's state and stderr (killing it if it still runs).
        let fail = |child: &mut std::process::Child,
                    err_reader: std::thread::JoinHandle<String>,
                    why: String| {
            let _ = child.kill();
            let status = child
                .wait()
                .map_or_else(|e| e.to_string(), |s| s.to_string());
            let err = err_reader.join().unwrap_or_default();
            Err(format!(
                "initiator-kill run {run}: {why} (the child: {status}); its stderr:\n{err}"
            ))
        };
        let (mut acked, mut acks) = (0u64, 0u64);
        let mut take = |a: Result<u64, String>| -> Result<(), String> {
            let a = a.map_err(|l| format!("the child wrote {l:?}, not an acknowledgement"))?;
            if a < from {
                return Err(format!(
                    "the child acknowledged group {a}, before the stream's start {from}"
                ));
            }
            acked = acked.max(a);
            acks += 1;
            Ok(())
        };
        // Wait for the first acknowledgement: the kill must come while the child writes.
        let waiting = Instant::now();
        loop {
            match rx.recv_timeout(Duration::from_millis(20)) {
                Ok(a) => {
                    if let Err(e) = take(a) {
                        return fail(&mut child, err_reader, e);
                    }
                    break;
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    return fail(
                        &mut child,
                        err_reader,
                        "the child closed its output before its first acknowledgement".into(),
                    );
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            }
            if let Ok(Some(st)) = child.try_wait() {
                return fail(
                    &mut child,
                    err_reader,
                    format!("the child ended ({st}) before its first acknowledgement"),
                );
            }
            if waiting.elapsed() > Duration::from_secs(60) {
                return fail(
                    &mut child,
                    err_reader,
                    "no acknowledgement from the child within 60 s".into(),
                );
            }
        }
        // Read acknowledgements until the kill time, then kill.
        let start = Instant::now();
        while start.elapsed() < kill_after {
            while let Ok(a) = rx.try_recv() {
                if let Err(e) = take(a) {
                    return fail(&mut child, err_reader, e);
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        if let Ok(Some(st)) = child.try_wait() {
            return fail(
                &mut child,
                err_reader,
                format!("the child ended by itself ({st}) before the kill"),
            );
        }
        let _ = child.kill();
        let status = child.wait().map_err(|e| e.to_string())?;
        reader.join().unwrap();
        let err = err_reader.join().unwrap_or_default();
        if status.signal() != Some(SIGKILL) {
            return Err(format!(
                "initiator-kill run {run}: the child did not die from the SIGKILL ({status}); \
                 its stderr:\n{err}"
            ));
        }
        while let Ok(a) = rx.try_recv() {
            take(a).map_err(|e| format!("initiator-kill run {run}: {e}"))?;
        }
        let (mut v, rep) = Volume::open(cfg(&addrs, true, 1)).map_err(|e| e.to_string())?;
        let prefix = rep.prefix_end[0];
        if acked >= prefix {
            return Err(format!("initiator-kill run {run}: group {acked} was acknowledged but recovery ends the prefix at {prefix}"));
        }
        check_prefix(&mut v, from, prefix, WINDOW as u64 + 4)
            .map_err(|e| format!("initiator-kill run {run}: {e}"))?;
        total_acks += acks;
        total_checked += prefix - from;
        println!("initiator-kill run {run} (batch {batch}): killed {kill_after:?} after the first acknowledgement; {acks} acknowledged, the last {acked}; prefix {from}..{prefix}, {} writes zeroed", rep.discarded);
    }
    // Every run waits for an acknowledgement, so these hold unless something above is broken.
    if runs > 0 && (total_acks == 0 || total_checked == 0) {
        return Err(format!(
            "{total_acks} writes acknowledged and {total_checked} groups checked across {runs} runs"
        ));
    }
    println!("initiator-kill: {total_acks} acknowledged writes, {total_checked} groups checked across {runs} runs");
    Ok(())
}

const SIGKILL: i32 = 9;

/// The initiator the parent kills: writes and reports each acknowledgement; any other end is a
/// distinct exit code (and a message on stderr), which the parent reports as a failure.
fn child(list: &str) {
    let addrs: Vec<SocketAddr> = list.split(',').map(|s| s.parse().unwrap()).collect();
    let batch = std::env::var("AIOS_NET_FAULT_BATCH")
        .ok()
        .and_then(|b| b.parse().ok())
        .unwrap_or(1);
    let (mut v, _) = match Volume::open(cfg(&addrs, true, batch)) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("net_faults child: opening the volume: {e}");
            std::process::exit(CHILD_OPEN_FAILED);
        }
    };
    let mut out = std::io::stdout();
    let r = workload(&mut v, 1_000_000, |seq| {
        // One write per line: the parent never sees a partial one.
        if let Err(e) = out
            .write_all(format!("ack {seq}\n").as_bytes())
            .and_then(|()| out.flush())
        {
            eprintln!("net_faults child: writing an acknowledgement: {e}");
            std::process::exit(CHILD_ACK_PIPE_FAILED);
        }
    });
    match r {
        Ok(_) => {
            eprintln!("net_faults child: the workload ended before the kill");
            std::process::exit(CHILD_WORKLOAD_ENDED);
        }
        Err(e) => {
            eprintln!("net_faults child: the workload failed: {e}");
            std::process::exit(CHILD_WORKLOAD_FAILED);
        }
    }
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
    for (name, f, target_bytes) in [
        (
            "target-kill",
            target_kill as fn(&Arc<Mutex<NetLab>>, u32, &mut u64) -> Result<(), String>,
            512u64 << 20,
        ),
        // Its merging children write the most (about 8,000 groups a run in 20-run tries):
        // room for 524,288 groups.
        ("initiator-kill", initiator_kill, 1 << 30),
        ("link-cut", link_cut, 512 << 20),
    ] {
        // A fresh lab per kind: blocks are never reused within one (group q writes block q).
        // The sizes above are for the default 20 runs; more runs get room in proportion (the
        // devices are sparse files in /dev/shm: only blocks the runs write take memory).
        let scale = u64::from(runs.div_ceil(20).max(1));
        let lab = NetLab::start(&aios, 2, target_bytes * scale, 4, false).expect("network lab");
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
