//! NVMe/TCP interoperability with the Linux kernel, in the lab guest (`harness = false`).
//!
//! `tcp_lab --linux-host`: an aios target in this process serves `AIOS_LAB_TCP_DEVICE`
//! (default `/dev/nullb0`) on 127.0.0.1:4420; the guest kernel's NVMe/TCP host (`nvme-tcp`)
//! connects through `/dev/nvme-fabrics`; the namespace it creates is written and read back
//! with O_DIRECT (lbio; small writes in the capsule, large ones after R2T, some split by MDTS)
//! and with buffered writes + fsync (FLUSH); every range is then compared with the backing
//! device itself, so the target put each byte at the right place. Then the controller is
//! deleted and the target must see every connection close cleanly.
//!
//! `tcp_lab --linux-target`: the kernel's `nvmet-tcp` target (configured through configfs)
//! exports a file (4 KiB blocks) and `/dev/nullb0` (512-byte blocks) on 127.0.0.1:4421;
//! rio-net's initiator (a standard target: orderless mode) writes — in the capsule and after
//! R2T — flushes and reads back each, and the bytes are compared with the backing stores.
//!
//! Both need root, configfs and the modules the lab loads; they are not run on the host.

mod common;
use common::{fill_pattern, same};

use std::fs::{self, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::rc::Rc;
use std::time::{Duration, Instant};

use aios_core::{Engine, EngineConfig, FixedBuf};
use lbio::{Device, DeviceConfig, LbioArray, LbioConfig};
use rio_net::{Target, TargetConfig, TargetLogKind, Volume, VolumeConfig};

const TARGET_NQN: &str = "nqn.2026-11.io.aios:lab-target";
const MODEL: &str = "aios rio-net target";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--list") {
        return ExitCode::SUCCESS;
    }
    let r = if args.iter().any(|a| a == "--linux-host") {
        linux_host()
    } else if args.iter().any(|a| a == "--linux-target") {
        linux_target()
    } else {
        println!("tcp_lab: runs in the lab guest only (cargo xtask lab): pass --linux-host or --linux-target");
        return ExitCode::SUCCESS;
    };
    match r {
        Ok(()) => {
            println!("tcp_lab: ok");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tcp_lab: FAILED: {e}");
            if let Ok(out) = Command::new("dmesg").output() {
                let text = String::from_utf8_lossy(&out.stdout);
                let lines: Vec<&str> = text.lines().collect();
                eprintln!("--- dmesg (last 30 lines)");
                for l in &lines[lines.len().saturating_sub(30)..] {
                    eprintln!("{l}");
                }
            }
            ExitCode::FAILURE
        }
    }
}

fn pattern(offset: u64, len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill_pattern(&mut v, offset, seed);
    v
}

fn engine() -> Result<Rc<Engine>, String> {
    Engine::new(EngineConfig {
        arena_bytes: 16 << 20,
        huge_pages: false,
        ..EngineConfig::default()
    })
    .map_err(|e| format!("engine: {e}"))
}

fn alloc(e: &Engine, len: usize) -> FixedBuf {
    let mut b = e.alloc_blocking(len).expect("arena room");
    b.set_len(len).expect("fits");
    b
}

fn drop_caches() {
    let _ = fs::write("/proc/sys/vm/drop_caches", "3");
}

fn read_sys(p: impl AsRef<Path>) -> Option<String> {
    fs::read_to_string(p).ok().map(|s| s.trim().to_string())
}

/// The block device whose model is ours (`/dev/nvmeXnY`), waited for.
fn find_namespace(limit: Duration) -> Result<PathBuf, String> {
    let t0 = Instant::now();
    loop {
        if let Ok(rd) = fs::read_dir("/sys/block") {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().to_string();
                if !name.starts_with("nvme") {
                    continue;
                }
                if read_sys(e.path().join("device/model")).as_deref() == Some(MODEL) {
                    let dev = PathBuf::from("/dev").join(&name);
                    if dev.exists() {
                        return Ok(dev);
                    }
                }
            }
        }
        if t0.elapsed() > limit {
            return Err(format!(
                "no block device with model {MODEL:?} appeared in {limit:?}"
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn linux_host() -> Result<(), String> {
    let backing = PathBuf::from(
        std::env::var("AIOS_LAB_TCP_DEVICE").unwrap_or_else(|_| "/dev/nullb0".into()),
    );
    let ns_bytes: u64 = 256 << 20;
    let mut cfg = TargetConfig::new(&backing, TargetLogKind::Mem(1 << 20));
    cfg.ns_bytes = Some(ns_bytes);
    cfg.subnqn = TARGET_NQN.into();
    // Writes up to 8 KiB travel in the capsule; larger ones wait for an R2T.
    cfg.in_capsule = 8192;
    let t = Target::bind("127.0.0.1:4420".parse().unwrap(), cfg).map_err(|e| e.to_string())?;
    let stats = t.stats_handle();
    t.spawn();
    println!(
        "aios target on 127.0.0.1:4420 serving {} ({ns_bytes} bytes, 8 KiB in-capsule)",
        backing.display()
    );

    // The kernel ties a host ID to one host NQN: give this host NQN its own.
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
        ^ (std::process::id() as u64) << 32;
    let hostid = format!(
        "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        n as u32,
        (n >> 32) as u16,
        (n >> 48) & 0xfff,
        (n >> 20) & 0xfff,
        n & 0xffff_ffff_ffff
    );
    let opts = format!(
        "transport=tcp,traddr=127.0.0.1,trsvcid=4420,nqn={TARGET_NQN},hostnqn=nqn.2026-11.io.aios:lab-linux-host,hostid={hostid},nr_io_queues=2"
    );
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/nvme-fabrics")
        .map_err(|e| format!("/dev/nvme-fabrics: {e} (is nvme-tcp loaded?)"))?;
    let t0 = Instant::now();
    f.write_all(opts.as_bytes())
        .map_err(|e| format!("connect ({opts}): {e}"))?;
    let mut answer = String::new();
    f.seek(SeekFrom::Start(0)).ok();
    f.read_to_string(&mut answer)
        .map_err(|e| format!("reading /dev/nvme-fabrics: {e}"))?;
    drop(f);
    let instance = answer
        .split([',', '\n'])
        .find_map(|kv| kv.strip_prefix("instance="))
        .ok_or_else(|| format!("unexpected answer from /dev/nvme-fabrics: {answer:?}"))?
        .trim()
        .to_string();
    let ctrl = PathBuf::from(format!("/sys/class/nvme/nvme{instance}"));
    println!(
        "the kernel's NVMe/TCP host connected in {:.2} s: {} (transport {}, state {})",
        t0.elapsed().as_secs_f64(),
        answer.trim(),
        read_sys(ctrl.join("transport")).unwrap_or_default(),
        read_sys(ctrl.join("state")).unwrap_or_default()
    );
    let dev = find_namespace(Duration::from_secs(20))?;
    let name = dev.file_name().unwrap().to_string_lossy().to_string();
    let lbs: u64 = read_sys(format!("/sys/block/{name}/queue/logical_block_size"))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let sectors: u64 = read_sys(format!("/sys/block/{name}/size"))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let max_kb = read_sys(format!("/sys/block/{name}/queue/max_hw_sectors_kb")).unwrap_or_default();
    println!(
        "namespace {}: {} bytes, {lbs}-byte blocks, max transfer {max_kb} KiB, write cache {}",
        dev.display(),
        sectors * 512,
        read_sys(format!("/sys/block/{name}/queue/write_cache")).unwrap_or_default()
    );
    if lbs != 4096 || sectors * 512 != ns_bytes {
        return Err(format!(
            "the host sees {} bytes in {lbs}-byte blocks; the target serves {ns_bytes} in 4096",
            sectors * 512
        ));
    }

    // O_DIRECT through lbio: in-capsule, R2T, and transfers the host splits at MDTS.
    let e = engine()?;
    let lbio = LbioArray::new(Rc::clone(&e), LbioConfig::default()).map_err(|e| e.to_string())?;
    let dcfg = DeviceConfig {
        write: true,
        ..DeviceConfig::default()
    };
    let nvme = Device::open(&lbio, &dev, dcfg).map_err(|e| format!("{name}: {e}"))?;
    let ranges: [(u64, usize); 6] = [
        (0, 4096),
        (4096, 8192),
        (1 << 20, 64 << 10),
        (3 << 20, 200 << 10),
        (8 << 20, 1 << 20),
        (ns_bytes - 4096, 4096),
    ];
    let seed = 0x1ab;
    let t0 = Instant::now();
    for &(off, len) in &ranges {
        let mut b = alloc(&e, len);
        fill_pattern(&mut b, off, seed);
        nvme.write_at_blocking(off, b, false)
            .map_err(|e| format!("write {len} at {off}: {e}"))?;
    }
    nvme.flush_blocking().map_err(|e| format!("flush: {e}"))?;
    for &(off, len) in &ranges {
        let b = nvme
            .read_at_blocking(off, alloc(&e, len))
            .map_err(|e| format!("read {len} at {off}: {e}"))?;
        same(
            &format!("O_DIRECT read-back of {len} at {off}"),
            &b,
            &pattern(off, len, seed),
        )?;
    }
    println!(
        "O_DIRECT: {} ranges (4 KiB .. 1 MiB) written, flushed and read back in {:.2} s",
        ranges.len(),
        t0.elapsed().as_secs_f64()
    );

    // Buffered writes and fsync (the kernel sends FLUSH), then a cold read.
    let boff: u64 = 32 << 20;
    let blen = 4 << 20;
    let bseed = 0x2cd;
    let t0 = Instant::now();
    {
        let f = OpenOptions::new()
            .write(true)
            .open(&dev)
            .map_err(|e| format!("{}: {e}", dev.display()))?;
        f.write_all_at(&pattern(boff, blen, bseed), boff)
            .map_err(|e| format!("buffered write: {e}"))?;
        f.sync_all().map_err(|e| format!("fsync: {e}"))?;
    }
    drop_caches();
    let mut got = vec![0u8; blen];
    fs::File::open(&dev)
        .and_then(|f| f.read_exact_at(&mut got, boff))
        .map_err(|e| format!("buffered read: {e}"))?;
    same("buffered read-back", &got, &pattern(boff, blen, bseed))?;
    println!(
        "buffered: 4 MiB written, fsync'd and read back cold in {:.2} s",
        t0.elapsed().as_secs_f64()
    );

    // Sequential throughput through the kernel host (TCG guest: for the record, not a claim).
    let chunk = 128 << 10;
    let total: u64 = 32 << 20;
    let base: u64 = 64 << 20;
    let t0 = Instant::now();
    for i in 0..total / chunk as u64 {
        let off = base + i * chunk as u64;
        let mut b = alloc(&e, chunk);
        fill_pattern(&mut b, off, 7);
        nvme.write_at_blocking(off, b, false)
            .map_err(|e| e.to_string())?;
    }
    let w = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    for i in 0..total / chunk as u64 {
        let off = base + i * chunk as u64;
        let b = nvme
            .read_at_blocking(off, alloc(&e, chunk))
            .map_err(|e| e.to_string())?;
        same("sequential read", &b, &pattern(off, chunk, 7))?;
    }
    let r = t0.elapsed().as_secs_f64();
    println!(
        "sequential 128 KiB at QD1: write {:.1} MB/s, read {:.1} MB/s",
        total as f64 / w / 1e6,
        total as f64 / r / 1e6
    );
    drop(nvme);

    // Every byte sits at the same offset of the backing device.
    let back =
        Device::open(&lbio, &backing, dcfg).map_err(|e| format!("{}: {e}", backing.display()))?;
    for &(off, len) in &ranges {
        let b = back
            .read_at_blocking(off, alloc(&e, len))
            .map_err(|e| format!("backing read: {e}"))?;
        same(
            &format!("backing device at {off} ({len} bytes)"),
            &b,
            &pattern(off, len, seed),
        )?;
    }
    let b = back
        .read_at_blocking(boff, alloc(&e, blen))
        .map_err(|e| format!("backing read: {e}"))?;
    same(
        "backing device, buffered range",
        &b,
        &pattern(boff, blen, bseed),
    )?;
    println!("the backing device holds every range at its offset");

    // Disconnect: the target sees every connection end cleanly.
    fs::write(ctrl.join("delete_controller"), "1")
        .map_err(|e| format!("delete_controller: {e}"))?;
    let t0 = Instant::now();
    while stats.stats().open_connections > 0 {
        if t0.elapsed() > Duration::from_secs(20) {
            return Err(format!(
                "{} connections still open 20 s after the host deleted the controller",
                stats.stats().open_connections
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let s = stats.stats();
    println!(
        "host disconnected: the target served {} connections, {} writes ({} by R2T), {} reads; {} closed on errors",
        s.connections, s.orderless, s.r2ts, s.reads, s.closed_on_error
    );
    if s.r2ts == 0 {
        return Err("no write larger than the capsule came by R2T".into());
    }
    if s.closed_on_error != 0 {
        return Err(format!(
            "{} connections of the kernel host were closed on errors",
            s.closed_on_error
        ));
    }
    Ok(())
}

const CFG: &str = "/sys/kernel/config/nvmet";

fn put(path: impl AsRef<Path>, v: &str) -> Result<(), String> {
    fs::write(path.as_ref(), v).map_err(|e| format!("{}: {e}", path.as_ref().display()))
}

fn mkdir(path: impl AsRef<Path>) -> Result<(), String> {
    match fs::create_dir(path.as_ref()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(format!("mkdir {}: {e}", path.as_ref().display())),
    }
}

/// Export `device` as namespace 1 of subsystem `nqn` (nvmet, through configfs).
fn export(nqn: &str, device: &Path, buffered: bool) -> Result<(), String> {
    let sub = PathBuf::from(CFG).join("subsystems").join(nqn);
    mkdir(&sub)?;
    put(sub.join("attr_allow_any_host"), "1")?;
    let ns = sub.join("namespaces/1");
    mkdir(&ns)?;
    put(ns.join("device_path"), &device.to_string_lossy())?;
    if buffered {
        put(ns.join("buffered_io"), "1")?;
    }
    put(ns.join("enable"), "1")
}

fn unexport(port: &Path, nqn: &str) {
    let sub = PathBuf::from(CFG).join("subsystems").join(nqn);
    let _ = fs::remove_file(port.join("subsystems").join(nqn));
    let _ = put(sub.join("namespaces/1/enable"), "0");
    let _ = fs::remove_dir(sub.join("namespaces/1"));
    let _ = fs::remove_dir(&sub);
}

fn linux_target() -> Result<(), String> {
    if !Path::new(CFG).exists() {
        let st = Command::new("mount")
            .args(["-t", "configfs", "none", "/sys/kernel/config"])
            .status()
            .map_err(|e| format!("mount configfs: {e}"))?;
        if !st.success() || !Path::new(CFG).exists() {
            return Err(format!(
                "{CFG} is missing (nvmet loaded? configfs mounted?)"
            ));
        }
    }
    let file = PathBuf::from("/tmp/nvmet-lab.img");
    let file_bytes: u64 = 64 << 20;
    fs::File::create(&file)
        .and_then(|f| f.set_len(file_bytes))
        .map_err(|e| format!("{}: {e}", file.display()))?;
    let nullb = PathBuf::from(
        std::env::var("AIOS_LAB_TCP_DEVICE").unwrap_or_else(|_| "/dev/nullb0".into()),
    );
    let subs = [
        ("nqn.2026-11.io.aios:lab-nvmet-file", file.clone(), true),
        ("nqn.2026-11.io.aios:lab-nvmet-nullb", nullb.clone(), false),
    ];
    for (nqn, dev, buffered) in &subs {
        export(nqn, dev, *buffered)?;
    }
    let port = PathBuf::from(CFG).join("ports/1");
    mkdir(&port)?;
    put(port.join("addr_trtype"), "tcp")?;
    put(port.join("addr_adrfam"), "ipv4")?;
    put(port.join("addr_traddr"), "127.0.0.1")?;
    put(port.join("addr_trsvcid"), "4421")?;
    let inline = read_sys(port.join("param_inline_data_size")).unwrap_or_default();
    for (nqn, _, _) in &subs {
        let link = port.join("subsystems").join(nqn);
        if !link.exists() {
            std::os::unix::fs::symlink(PathBuf::from(CFG).join("subsystems").join(nqn), &link)
                .map_err(|e| format!("{}: {e}", link.display()))?;
        }
    }
    println!(
        "nvmet-tcp on 127.0.0.1:4421 exports a 64 MiB file and {} (port inline data size {inline})",
        nullb.display()
    );
    let r = (|| {
        for (nqn, dev, _) in &subs {
            initiator_against(nqn, dev)?;
        }
        Ok(())
    })();
    for (nqn, _, _) in &subs {
        unexport(&port, nqn);
    }
    let _ = fs::remove_dir(&port);
    let _ = fs::remove_file(&file);
    r
}

/// rio-net's initiator (orderless: nvmet is a standard target) against subsystem `nqn`.
fn initiator_against(nqn: &str, backing: &Path) -> Result<(), String> {
    let mut cfg = VolumeConfig::new(vec!["127.0.0.1:4421".parse().unwrap()], 2);
    cfg.subnqn = nqn.into();
    cfg.hostnqn = "nqn.2026-11.io.aios:lab-initiator".into();
    cfg.stripe = 64 << 10;
    let t0 = Instant::now();
    let mut v = Volume::connect(cfg).map_err(|e| format!("{nqn}: connect: {e}"))?;
    let incap = v.in_capsule()[0];
    println!(
        "{nqn}: connected in {:.2} s, {} bytes in {}-byte blocks, {incap} bytes of write data in the capsule",
        t0.elapsed().as_secs_f64(),
        v.bytes(),
        v.block_size()[0]
    );
    if !(4096..64 << 10).contains(&incap) {
        return Err(format!(
            "{nqn}: in-capsule size {incap}: this test needs 4 KiB writes in the capsule and 64 KiB ones after R2T"
        ));
    }
    // Ordered writes need a Rio target: refused with a clear error, nothing sent.
    let b = v.alloc(4096).ok_or("arena")?;
    match v.submit(0, 0, b, true) {
        Err(e) => println!("{nqn}: an ordered write is refused: {e}"),
        Ok(_) => {
            return Err(format!(
                "{nqn}: an ordered write to a standard target was accepted"
            ))
        }
    }
    // 4 KiB (in the capsule) and 64 KiB (after R2T, above nvmet's inline size) writes, on
    // two streams (two I/O queues), then FLUSH and read-back.
    let mut ranges: Vec<(u16, u64, usize)> = Vec::new();
    for i in 0..64u64 {
        ranges.push(((i % 2) as u16, i * 4096, 4096));
        ranges.push(((i % 2) as u16, (8 << 20) + i * (64 << 10), 64 << 10));
    }
    ranges.push((0, v.bytes() - 4096, 4096));
    let seed = 0x3ef;
    let t0 = Instant::now();
    let mut out = 0usize;
    for &(s, off, len) in &ranges {
        let mut b = v.alloc(len).ok_or("arena")?;
        fill_pattern(&mut b, off, seed);
        v.write_orderless(s, off, b)
            .map_err(|e| format!("{nqn}: write {len} at {off}: {e}"))?;
        out += 1;
    }
    let mut done = 0usize;
    while done < out {
        for d in v.wait_any().map_err(|e| format!("{nqn}: {e}"))? {
            d.result.map_err(|e| format!("{nqn}: write: {e}"))?;
            done += 1;
        }
    }
    v.flush_all(0).map_err(|e| format!("{nqn}: flush: {e}"))?;
    let wrote = t0.elapsed().as_secs_f64();
    for &(s, off, len) in &ranges {
        let b = v.alloc(len).ok_or("arena")?;
        v.read(s, off, b).map_err(|e| format!("{nqn}: read: {e}"))?;
        let d = v.wait_any().map_err(|e| format!("{nqn}: {e}"))?;
        if d.len() != 1 {
            return Err(format!("{nqn}: {} completions for one read", d.len()));
        }
        let d = &d[0];
        d.result
            .clone()
            .map_err(|e| format!("{nqn}: read {len} at {off}: {e}"))?;
        same(
            &format!("{nqn}: read-back of {len} at {off}"),
            &d.buf,
            &pattern(off, len, seed),
        )?;
    }
    println!(
        "{nqn}: {} writes (4 KiB in the capsule, 64 KiB after R2T) on 2 queues, FLUSH and read-back in {:.2} s + {:.2} s",
        ranges.len(),
        wrote,
        t0.elapsed().as_secs_f64() - wrote
    );
    drop(v);
    // The bytes are where the initiator put them on the target's store.
    drop_caches();
    let f = fs::File::open(backing).map_err(|e| format!("{}: {e}", backing.display()))?;
    for &(_, off, len) in &ranges {
        let mut got = vec![0u8; len];
        f.read_exact_at(&mut got, off)
            .map_err(|e| format!("{}: {e}", backing.display()))?;
        same(
            &format!("{} at {off}", backing.display()),
            &got,
            &pattern(off, len, seed),
        )?;
    }
    println!(
        "{nqn}: {} holds every write at its offset",
        backing.display()
    );
    Ok(())
}
