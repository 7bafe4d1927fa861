//! Booting the guest under QEMU (TCG) and watching its result channel while it runs.

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use crate::results::{self, Log};

/// `iomem=relaxed`: the nvme driver claims every BAR of the controller, and Debian kernels have
/// `CONFIG_IO_STRICT_DEVMEM`, so mapping the PMR BAR from user space needs it.
pub const KERNEL_CMDLINE: &str =
    "console=ttyS0 panic=-1 loglevel=4 nvme.poll_queues=1 iomem=relaxed";

pub struct Config {
    pub vmlinuz: PathBuf,
    pub initrd: PathBuf,
    pub disk: PathBuf,
    /// Backing file of the NVMe controller's persistent memory region, if any.
    pub pmr: Option<PathBuf>,
    pub console_log: PathBuf,
    pub results_log: PathBuf,
    pub qemu_log: PathBuf,
    pub memory_mib: u32,
    pub smp: u32,
    /// One host thread for all vCPUs. Debian's 7.x kernels oops (int3 in boot-time text
    /// patching) under this QEMU's (7.2) multi-threaded TCG; single-threaded TCG boots them.
    pub single_thread_tcg: bool,
    /// Which boot of the run (`aios.boot=N` on the kernel command line; 1 for the first).
    pub boot: u32,
}

pub fn command(cfg: &Config) -> Command {
    let mut cmd = Command::new("qemu-system-x86_64");
    cmd.args([
        "-accel",
        if cfg.single_thread_tcg {
            "tcg,thread=single"
        } else {
            "tcg"
        },
        "-cpu",
        "max",
        "-smp",
        &cfg.smp.to_string(),
        "-m",
        &cfg.memory_mib.to_string(),
    ]);
    cmd.args([
        "-no-reboot",
        "-display",
        "none",
        "-nodefaults",
        "-no-user-config",
    ]);
    cmd.arg("-kernel")
        .arg(&cfg.vmlinuz)
        .arg("-initrd")
        .arg(&cfg.initrd)
        .arg("-append")
        .arg(format!("{KERNEL_CMDLINE} aios.boot={}", cfg.boot));
    cmd.arg("-drive").arg(format!(
        "file={},if=none,id=nv0,format=raw",
        cfg.disk.display()
    ));
    let mut nvme = "nvme,serial=aioslab0,drive=nv0".to_string();
    if let Some(pmr) = &cfg.pmr {
        let size = fs::metadata(pmr).map(|m| m.len()).unwrap_or(0);
        cmd.arg("-object").arg(format!(
            "memory-backend-file,id=pmr0,share=on,mem-path={},size={size}",
            pmr.display()
        ));
        nvme.push_str(",pmrdev=pmr0");
    }
    cmd.args(["-device", &nvme]);
    cmd.arg("-serial")
        .arg(format!("file:{}", cfg.console_log.display()));
    cmd.arg("-serial")
        .arg(format!("file:{}", cfg.results_log.display()));
    cmd
}

pub enum Outcome {
    Exited(ExitStatus),
    TimedOut,
}

/// Host-side times, from QEMU's start, at which the guest reached each point.
#[derive(Default)]
pub struct Timings {
    pub init: Option<Duration>,
    pub first_step: Option<Duration>,
    pub done: Option<Duration>,
    pub exit: Duration,
}

/// Runs QEMU until it exits or `timeout` passes (then kills it). `watch` sees the parsed result
/// log whenever it grows, and once more at the end.
pub fn run(
    cfg: &Config,
    timeout: Duration,
    mut watch: impl FnMut(&Log),
) -> Result<(Outcome, Log, Timings), String> {
    let mut cmd = command(cfg);
    let qlog =
        File::create(&cfg.qemu_log).map_err(|e| format!("{}: {e}", cfg.qemu_log.display()))?;
    cmd.stdin(Stdio::null())
        .stdout(qlog.try_clone().map_err(|e| e.to_string())?)
        .stderr(qlog);
    let start = Instant::now();
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start qemu-system-x86_64: {e}"))?;
    let mut timings = Timings::default();
    let mut seen_len = 0;
    let mut log = Log::default();
    let outcome = loop {
        let status = child.try_wait().map_err(|e| e.to_string())?;
        let text = read_lossy(&cfg.results_log);
        if text.len() != seen_len || status.is_some() {
            seen_len = text.len();
            log = results::parse(&text);
            let now = start.elapsed();
            if log.init_t.is_some() {
                timings.init.get_or_insert(now);
            }
            if log.steps.iter().any(|s| s.id.parse::<u32>().is_ok()) {
                timings.first_step.get_or_insert(now);
            }
            if log.done {
                timings.done.get_or_insert(now);
            }
            watch(&log);
        }
        if let Some(status) = status {
            break Outcome::Exited(status);
        }
        if start.elapsed() >= timeout {
            let _ = child.kill();
            let _ = child.wait();
            let text = read_lossy(&cfg.results_log);
            log = results::parse(&text);
            watch(&log);
            break Outcome::TimedOut;
        }
        sleep(Duration::from_millis(50));
    };
    timings.exit = start.elapsed();
    Ok((outcome, log, timings))
}

pub fn read_lossy(path: &Path) -> String {
    fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}

/// The last `n` lines of a file.
pub fn tail(path: &Path, n: usize) -> String {
    let text = read_lossy(path);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
