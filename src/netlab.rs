//! Target servers in network namespaces on this machine: one namespace per target, joined to
//! the host by a veth pair (`10.77.N.1` on the host, `10.77.N.2` in namespace `aios-tN`), so a
//! benchmark or fault test can kill a target or take its link down. (Delay and loss with
//! `tc netem` are exercised in the lab guest instead, step `tcp-netem`: this host's kernel has
//! no `sch_netem`.) Needs root and iproute2. Everything created is removed on drop, or on
//! SIGINT/SIGTERM.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Port the targets listen on.
pub const PORT: u16 = 4420;

/// One target in its namespace.
pub struct LabTarget {
    pub ns: String,
    pub host_if: String,
    pub addr: SocketAddr,
    pub device: PathBuf,
    /// The attribute log file (survives the target process).
    pub log: PathBuf,
    pub child: Option<Child>,
}

/// The namespaces, links and target processes.
pub struct NetLab {
    pub targets: Vec<LabTarget>,
    aios: PathBuf,
    streams: u16,
    mem_log: bool,
    tag: String,
    /// Per target: deletes its link and namespace and removes its files (when the lab is
    /// dropped, or on SIGINT/SIGTERM once the target processes are stopped).
    undo: Vec<crate::bench::cleanup::Undo>,
}

fn run(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| format!("{}: {e} (is iproute2 installed?)", args.join(" ")))?;
    if !out.status.success() {
        return Err(format!(
            "{} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

impl NetLab {
    /// `n` namespaces with a target each, serving a file of `device_bytes` in /dev/shm with its
    /// attribute log in a file (`--attr-log file:`, which survives the target process) or, with
    /// `mem_log`, in the target's memory (`--attr-log mem`: persistent memory emulated in RAM,
    /// as fast as a PMR; lost when the target dies). `streams` log streams. `aios` is the binary
    /// to run (`std::env::current_exe()` from the CLI).
    pub fn start(
        aios: &Path,
        n: usize,
        device_bytes: u64,
        streams: u16,
        mem_log: bool,
    ) -> Result<NetLab, String> {
        let tag = format!("{}", std::process::id() % 10000);
        let mut lab = NetLab {
            targets: Vec::new(),
            aios: aios.to_path_buf(),
            streams,
            mem_log,
            tag: tag.clone(),
            undo: Vec::new(),
        };
        if !Path::new("/run/netns").exists() {
            std::fs::create_dir_all("/run/netns").map_err(|e| format!("/run/netns: {e}"))?;
        }
        for i in 0..n {
            let ns = format!("aios-t{i}-{tag}");
            let host_if = format!("aih{i}-{tag}");
            let ns_if = format!("ain{i}-{tag}");
            let net = 77 + i / 200;
            let sub = i % 200 + 1;
            let host_ip = format!("10.{net}.{sub}.1");
            let ns_ip = format!("10.{net}.{sub}.2");
            let device = PathBuf::from(format!("/dev/shm/aios-netlab-{tag}-{i}.img"));
            let log = PathBuf::from(format!("/dev/shm/aios-netlab-{tag}-{i}.log"));
            lab.targets.push(LabTarget {
                ns: ns.clone(),
                host_if: host_if.clone(),
                addr: format!("{ns_ip}:{PORT}").parse().expect("address"),
                device: device.clone(),
                log: log.clone(),
                child: None,
            });
            let (n, h, d, l) = (ns.clone(), host_if.clone(), device.clone(), log.clone());
            lab.undo.push(crate::bench::cleanup::register(
                "a target's network namespace, link and files",
                move || {
                    let _ = run(&["ip", "link", "del", &h]);
                    let _ = run(&["ip", "netns", "del", &n]);
                    let _ = std::fs::remove_file(&d);
                    let _ = std::fs::remove_file(&l);
                },
            ));
            run(&["ip", "netns", "add", &ns])?;
            run(&[
                "ip", "link", "add", &host_if, "type", "veth", "peer", "name", &ns_if,
            ])?;
            run(&["ip", "link", "set", &ns_if, "netns", &ns])?;
            run(&[
                "ip",
                "addr",
                "add",
                &format!("{host_ip}/24"),
                "dev",
                &host_if,
            ])?;
            run(&["ip", "link", "set", &host_if, "up"])?;
            run(&[
                "ip",
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{ns_ip}/24"),
                "dev",
                &ns_if,
            ])?;
            run(&["ip", "-n", &ns, "link", "set", &ns_if, "up"])?;
            run(&["ip", "-n", &ns, "link", "set", "lo", "up"])?;
            let f =
                std::fs::File::create(&device).map_err(|e| format!("{}: {e}", device.display()))?;
            f.set_len(device_bytes)
                .map_err(|e| format!("{}: {e}", device.display()))?;
            let _ = std::fs::remove_file(&log);
            lab.spawn(i, true)?;
        }
        Ok(lab)
    }

    /// Start target `i` (again); `format`: a fresh log.
    pub fn spawn(&mut self, i: usize, format: bool) -> Result<(), String> {
        let t = &self.targets[i];
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &t.ns])
            .arg(&self.aios)
            .arg("target")
            .arg("--listen")
            .arg(t.addr.to_string())
            .arg("--device")
            .arg(&t.device)
            .arg("--attr-log")
            .arg(if self.mem_log {
                "mem".to_string()
            } else {
                format!("file:{}", t.log.display())
            })
            .arg("--streams")
            .arg(self.streams.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        if format {
            cmd.arg("--format");
        }
        let child = cmd.spawn().map_err(|e| format!("starting a target: {e}"))?;
        self.targets[i].child = Some(child);
        // Ready when it accepts connections.
        let deadline = Instant::now() + Duration::from_secs(10);
        let addr = self.targets[i].addr;
        loop {
            if std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                return Ok(());
            }
            if let Some(c) = self.targets[i].child.as_mut() {
                if let Ok(Some(st)) = c.try_wait() {
                    return Err(format!("target {i} exited at start: {st}"));
                }
            }
            if Instant::now() > deadline {
                return Err(format!("target {i} did not start listening on {addr}"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL target `i` and reap it.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.targets[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Take target `i`'s link down or up.
    pub fn link(&self, i: usize, up: bool) -> Result<(), String> {
        run(&[
            "ip",
            "link",
            "set",
            &self.targets[i].host_if,
            if up { "up" } else { "down" },
        ])
    }

    /// Process id of target `i` (for its CPU time).
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.targets[i].child.as_ref().map(|c| c.id())
    }

    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.targets.iter().map(|t| t.addr).collect()
    }

    /// A unique tag for names.
    pub fn tag(&self) -> &str {
        &self.tag
    }
}

impl Drop for NetLab {
    fn drop(&mut self) {
        for i in 0..self.targets.len() {
            self.kill(i);
        }
        // Each runs its target's undo: link, namespace, device and log file.
        self.undo.clear();
    }
}

/// CPU seconds (user + system) a process has used, from /proc.
pub fn proc_cpu_s(pid: u32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}
