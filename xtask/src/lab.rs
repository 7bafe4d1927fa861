//! `cargo xtask lab`: tools → kernel → artifacts → initramfs → boot, then the report.

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::initramfs::BUSYBOX;
use crate::plan::{self, Step, MODULES};
use crate::qemu::{self, Outcome};
use crate::results::{self, Log};
use crate::{artifacts, initramfs, kernel, run_checked, say};

/// Exit status when the lab cannot run on this machine (no QEMU) and `--skip-if-unavailable` is not
/// given. Distinct from 1 (a failure) and 2 (clap's usage errors).
const EXIT_SKIPPED: u8 = 3;
const CONSOLE_TAIL_LINES: usize = 40;
const OUTPUT_LINES_SHOWN: usize = 200;
/// Console lines that fail the run: the guest kernel itself went wrong.
const KERNEL_TROUBLE: &[&str] = &[
    "Oops",
    "BUG:",
    "Kernel panic",
    "general protection fault",
    "Call Trace:",
];

/// How many times one boot is tried when its guest kernel crashes before /init reports.
const BOOT_TRIES: usize = 3;

/// The first kernel-trouble console line of a boot that exited before /init reported and before
/// any step began: a crash of the guest kernel's own start-up, which no step caused.
fn early_kernel_crash(outcome: &Outcome, log: &Log, console: &Path) -> Option<String> {
    if !matches!(outcome, Outcome::Exited(_)) || log.init_t.is_some() || !log.steps.is_empty() {
        return None;
    }
    qemu::read_lossy(console)
        .lines()
        .find(|l| KERNEL_TROUBLE.iter().any(|t| l.contains(t)))
        .map(|l| l.trim().to_string())
}

#[derive(clap::Args)]
pub struct Args {
    /// An ad-hoc step, NAME=COMMAND (repeatable); run instead of the default plan. COMMAND runs
    /// under busybox sh in the guest with PATH=/aios/bin:/bin, cwd /tmp.
    #[arg(long = "step", value_name = "NAME=COMMAND")]
    steps: Vec<String>,
    /// Run only this step of the default plan (repeatable).
    #[arg(long, value_name = "NAME")]
    only: Vec<String>,
    /// Comma-separated artifacts to build and copy to /aios/bin: bin:NAME, test:NAME, bench:NAME
    /// [default: those the selected steps need; for --step, known artifacts its command names]
    #[arg(long, value_name = "LIST")]
    artifacts: Option<String>,
    /// Limit on the guest run (boot to power-off), seconds.
    #[arg(long, value_name = "SECS", default_value_t = 240)]
    timeout: u64,
    /// Keep the whole run directory (disk image, initramfs, stripped binaries), not just the logs.
    #[arg(long)]
    keep: bool,
    /// Size of the emulated NVMe namespace (a fresh sparse file each run), MiB.
    #[arg(long, value_name = "MIB", default_value_t = 256)]
    disk_mib: u64,
    /// Leave out the NVMe controller's persistent memory region (PMR).
    #[arg(long)]
    no_pmr: bool,
    /// Exit 0 after "LAB SKIPPED" when this machine cannot run QEMU (otherwise exit 3).
    #[arg(long)]
    skip_if_unavailable: bool,
    /// QEMU's TCG threading: `multi` (a host thread per vCPU), `single` (one host thread for
    /// all vCPUs: slower, immune to the boot-time text-patching oops), or `auto` (single for
    /// 7.x kernels, which oops under multi-threaded TCG every time; multi otherwise).
    #[arg(long, value_enum, default_value_t = Tcg::Auto)]
    tcg: Tcg,
    /// Print the default plan and exit.
    #[arg(long)]
    list: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Tcg {
    Auto,
    Single,
    Multi,
}

enum Failure {
    /// QEMU cannot be had here.
    Skip(String),
    /// A phase before the guest's steps failed.
    Phase(&'static str, String),
}

fn phase<T>(name: &'static str, r: Result<T, String>) -> Result<T, Failure> {
    r.map_err(|e| Failure::Phase(name, e))
}

pub fn main(args: Args) -> ExitCode {
    if args.list {
        for s in plan::default_plan() {
            let env: String = s.env.iter().map(|(k, v)| format!("{k}={v} ")).collect();
            let arts: Vec<String> = s.artifacts.iter().map(|a| a.to_string()).collect();
            println!("{:<14} {env}{}    [{}]", s.name, s.command, arts.join(","));
        }
        println!("\nonly with --only NAME:");
        for s in plan::extra_steps() {
            let arts: Vec<String> = s.artifacts.iter().map(|a| a.to_string()).collect();
            println!("{:<14} {}    [{}]", s.name, s.command, arts.join(","));
        }
        return ExitCode::SUCCESS;
    }
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(Failure::Skip(reason)) => {
            say("");
            say(&format!("LAB SKIPPED: {reason}"));
            say("");
            if args.skip_if_unavailable {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(EXIT_SKIPPED)
            }
        }
        Err(Failure::Phase(name, msg)) => {
            say(&format!("lab: FAILED in phase '{name}': {msg}"));
            ExitCode::FAILURE
        }
    }
}

fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

fn target_dir(root: &Path) -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) => root.join(d),
        None => root.join("target"),
    }
}

fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

fn is_root() -> bool {
    let status = fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().nth(1))
        == Some("0")
}

fn qemu_runs() -> bool {
    Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// QEMU and a busybox for the guest, installed with apt when missing and we may.
fn ensure_tools() -> Result<(), Failure> {
    let have_qemu = qemu_runs();
    let have_busybox = Path::new(BUSYBOX).is_file();
    let mut pkgs = Vec::new();
    for (path, pkg) in crate::initramfs::HOST_FILES {
        if !Path::new(path).exists() && !pkgs.contains(pkg) {
            pkgs.push(*pkg);
        }
    }
    if have_qemu && have_busybox && pkgs.is_empty() {
        return Ok(());
    }
    if !have_qemu {
        pkgs.push("qemu-system-x86");
    }
    if !have_busybox {
        pkgs.push("busybox-static");
    }
    let why_not = if !is_root() {
        Some("not root".to_string())
    } else if which("apt-get").is_none() {
        Some("no apt-get".to_string())
    } else {
        say(&format!("lab: installing {} …", pkgs.join(" ")));
        let mut update = Command::new("apt-get");
        update.arg("update");
        let mut install = Command::new("apt-get");
        install
            .args(["install", "-y"])
            .args(&pkgs)
            .env("DEBIAN_FRONTEND", "noninteractive");
        run_checked(&mut update, "apt-get update")
            .and_then(|()| run_checked(&mut install, "apt-get install"))
            .err()
    };
    let why_not = why_not
        .map(|w| format!(" and could not install {} ({w})", pkgs.join(" ")))
        .unwrap_or_default();
    if !qemu_runs() {
        return Err(Failure::Skip(format!(
            "qemu-system-x86_64 is not available{why_not}"
        )));
    }
    if !Path::new(BUSYBOX).is_file() {
        return Err(Failure::Phase(
            "tool install",
            format!("{BUSYBOX} (Debian: busybox-static) is missing{why_not}"),
        ));
    }
    Ok(())
}

fn run(args: &Args) -> Result<bool, Failure> {
    let t_start = Instant::now();
    let (steps, specs) = phase(
        "plan",
        plan::select(&args.only, &args.steps, args.artifacts.as_deref()),
    )?;
    if args.timeout == 0 || args.disk_mib == 0 {
        return Err(Failure::Phase(
            "plan",
            "--timeout and --disk-mib must be positive".into(),
        ));
    }
    let root = workspace_root();
    let lab_dir = target_dir(&root).join("lab");
    let run_dir = lab_dir.join("run");

    let t = Instant::now();
    ensure_tools()?;
    let (pkg, source) = phase("kernel fetch", kernel::resolve_package(&lab_dir))?;
    let kernel = phase("kernel fetch", kernel::fetch(&pkg, &source, &lab_dir))?;
    say(&format!(
        "lab: kernel {} ({}) ready in {}",
        kernel.version,
        kernel.pkg,
        secs(t.elapsed())
    ));

    let t = Instant::now();
    let built = if specs.is_empty() {
        Vec::new()
    } else {
        let names: Vec<String> = specs.iter().map(|s| s.to_string()).collect();
        say(&format!("lab: building artifacts {} …", names.join(", ")));
        let built = phase("artifact build", artifacts::build(&root, &specs))?;
        say(&format!("lab: artifacts built in {}", secs(t.elapsed())));
        built
    };

    // From here on: the lab proper.
    let t_lab = Instant::now();
    let _ = fs::remove_dir_all(&run_dir);
    phase(
        "initramfs",
        fs::create_dir_all(&run_dir).map_err(|e| format!("{}: {e}", run_dir.display())),
    )?;
    let modules = phase("initramfs", kernel.plan_modules(MODULES))?;
    for m in modules.iter().filter(|m| m.file.is_none()) {
        say(&format!(
            "lab: module {} is built into {}, not loaded",
            m.name, kernel.version
        ));
    }
    let initrd = phase(
        "initramfs",
        initramfs::build(&run_dir, &kernel, &modules, &built, &steps),
    )?;
    let t_initramfs = t_lab.elapsed();
    say(&format!(
        "lab: initramfs {:.1} MiB ({} files) in {}",
        initrd.bytes as f64 / (1 << 20) as f64,
        initrd.entries,
        secs(t_initramfs)
    ));

    let disk = run_dir.join("nvme0.img");
    phase("boot", sparse_file(&disk, args.disk_mib << 20))?;
    let pmr = if args.no_pmr {
        None
    } else {
        let pmr = run_dir.join("pmr.img");
        phase("boot", sparse_file(&pmr, 1 << 20))?;
        Some(pmr)
    };
    let boots = plan::boots(&steps);
    let mut cfg = qemu::Config {
        vmlinuz: kernel.vmlinuz.clone(),
        initrd: initrd.path.clone(),
        disk,
        pmr,
        console_log: run_dir.join("console.log"),
        results_log: run_dir.join("results.log"),
        qemu_log: run_dir.join("qemu.log"),
        memory_mib: 2048,
        smp: 2,
        single_thread_tcg: match args.tcg {
            Tcg::Single => true,
            Tcg::Multi => false,
            Tcg::Auto => kernel
                .version
                .split('.')
                .next()
                .and_then(|m| m.parse::<u32>().ok())
                .is_some_and(|major| major >= 7),
        },
        boot: 1,
    };
    say(&format!(
        "lab: booting ({} TCG, {} MiB NVMe{}, timeout {} s{}) …",
        if cfg.single_thread_tcg {
            "single-threaded"
        } else {
            "multi-threaded"
        },
        args.disk_mib,
        if cfg.pmr.is_some() {
            " with 1 MiB PMR"
        } else {
            ""
        },
        args.timeout,
        if boots.len() > 1 {
            format!(
                " per boot; {} boots with a power cut between each, same disk and PMR",
                boots.len()
            )
        } else {
            String::new()
        }
    ));

    let mut problems = Vec::new();
    // All boots' result logs as one: steps keep their plan-wide ids.
    let mut log = Log::default();
    // Steps whose planned power cut happened.
    let mut cut_done: Vec<usize> = Vec::new();
    let mut timings: Option<qemu::Timings> = None;
    let mut guest_run = Duration::ZERO;
    let mut timed_out = false;
    let mut boot_json = Vec::new();
    let mut retried_boots = 0;
    for (b, range) in boots.iter().enumerate() {
        let n = b as u32 + 1;
        cfg.boot = n;
        let suffix = if n == 1 {
            String::new()
        } else {
            format!(".boot{n}")
        };
        cfg.console_log = run_dir.join(format!("console{suffix}.log"));
        cfg.results_log = run_dir.join(format!("results{suffix}.log"));
        cfg.qemu_log = run_dir.join(format!("qemu{suffix}.log"));
        let cut_step = range.clone().last().filter(|&i| steps[i].cuts_power);
        if boots.len() > 1 {
            let names: Vec<&str> = steps[range.clone()]
                .iter()
                .map(|s| s.name.as_str())
                .collect();
            say(&format!(
                "lab: boot {n} of {}: {}{}",
                boots.len(),
                names.join(", "),
                cut_step.map_or(String::new(), |i| format!(
                    " (then {} cuts the power)",
                    steps[i].name
                ))
            ));
        }
        let mut live = Live {
            total: steps.len(),
            start: Some(Instant::now()),
            ..Live::default()
        };
        // A boot whose guest kernel crashed before /init reported ran none of our code: no step
        // began, and nothing but the kernel's own probes touched the disk or the PMR. That is
        // QEMU's multi-threaded TCG racing the kernel's boot-time text patching (see
        // `qemu::Config::single_thread_tcg`), rare on the 6.x kernels, so such a boot is tried
        // again, at most `BOOT_TRIES` times in all, and each crash is kept and reported.
        let mut early_crashes = Vec::new();
        let (outcome, boot_log, boot_timings) = loop {
            let (outcome, boot_log, boot_timings) = phase(
                "boot",
                qemu::run(&cfg, Duration::from_secs(args.timeout), |log| {
                    live.update(log, false)
                }),
            )?;
            let crash = early_kernel_crash(&outcome, &boot_log, &cfg.console_log);
            match crash {
                Some(line) if early_crashes.len() + 1 < BOOT_TRIES => {
                    let tag = format!("try{}", early_crashes.len() + 1);
                    for f in [&cfg.console_log, &cfg.results_log, &cfg.qemu_log] {
                        let _ = fs::rename(f, f.with_extension(format!("{tag}.log")));
                    }
                    say(&format!(
                        "lab: boot {n}: the guest kernel crashed before /init ran ({line}, after {}); no step had begun, booting again (try {} of {BOOT_TRIES}); its console is in {}",
                        secs(boot_timings.exit),
                        early_crashes.len() + 2,
                        cfg.console_log.with_extension(format!("{tag}.log")).display()
                    ));
                    guest_run += boot_timings.exit;
                    early_crashes.push(line);
                    live = Live {
                        total: steps.len(),
                        start: Some(Instant::now()),
                        ..Live::default()
                    };
                }
                _ => {
                    retried_boots += early_crashes.len();
                    break (outcome, boot_log, boot_timings);
                }
            }
        };
        live.update(&boot_log, true);
        guest_run += boot_timings.exit;
        let before = problems.len();
        let console_tail = || {
            let tail = qemu::tail(&cfg.console_log, CONSOLE_TAIL_LINES);
            if tail.trim().is_empty() {
                "(console log is empty: no kernel messages at loglevel 4, no errors from /init)"
                    .to_string()
            } else {
                tail
            }
        };
        let console = qemu::read_lossy(&cfg.console_log);
        let reset_seen = console.contains("sysrq: Resetting");
        let boot_name = if boots.len() > 1 {
            format!("boot {n}: ")
        } else {
            String::new()
        };
        match (&outcome, cut_step) {
            (Outcome::TimedOut, _) => {
                timed_out = true;
                problems.push(format!(
                    "boot: {boot_name}guest did not finish within {} s; console tail:\n{}",
                    args.timeout,
                    console_tail()
                ))
            }
            (Outcome::Exited(_), Some(c)) => {
                let id = (c + 1).to_string();
                let step = boot_log.steps.iter().find(|s| s.id == id);
                let why = match step {
                    None => Some("it never began".to_string()),
                    Some(s) if s.rc.is_some() => Some(format!(
                        "it ended with rc={} instead",
                        s.rc.unwrap_or_default()
                    )),
                    Some(_) if boot_log.done => Some("the guest went on to finish".into()),
                    Some(_) if !reset_seen => Some(
                        "the console shows no sysrq reset (the guest died some other way)".into(),
                    ),
                    Some(_) => None,
                };
                match why {
                    None => {
                        say(&format!(
                            "lab: {boot_name}{} cut the power as planned (guest reset by sysrq, {})",
                            steps[c].name,
                            secs(boot_timings.exit)
                        ));
                        cut_done.push(c);
                    }
                    Some(why) => problems.push(format!(
                        "power cut: {boot_name}step {} was to cut the power, but {why}; console tail:\n{}",
                        steps[c].name,
                        console_tail()
                    )),
                }
            }
            (Outcome::Exited(status), None) if !boot_log.done => {
                let qlog = qemu::tail(&cfg.qemu_log, 20);
                let qlog = if qlog.trim().is_empty() {
                    String::new()
                } else {
                    format!("\nqemu said:\n{qlog}")
                };
                problems.push(format!(
                    "boot: {boot_name}guest stopped before finishing (qemu {status}{}); console tail:\n{}{qlog}",
                    if boot_log.init_t.is_none() {
                        ", /init never reported"
                    } else {
                        ""
                    },
                    console_tail()
                ));
            }
            (Outcome::Exited(_), None) => {}
        }
        // At loglevel 4 the console stays quiet unless something is wrong (and /init's own
        // errors land there), so whatever it holds besides the power-off or planned reset line
        // is worth showing.
        let noteworthy: Vec<&str> = console
            .lines()
            .filter(|l| {
                let planned_reset = cut_step.is_some() && l.contains("sysrq: Resetting");
                !(l.trim().is_empty() || l.contains("reboot: Power down") || planned_reset)
            })
            .collect();
        if !noteworthy.is_empty() && problems.len() == before {
            say(&format!(
                "lab: {boot_name}guest console ({} line(s), last {CONSOLE_TAIL_LINES} shown):",
                noteworthy.len()
            ));
            for l in &noteworthy[noteworthy.len().saturating_sub(CONSOLE_TAIL_LINES)..] {
                say(&format!("    ! {l}"));
            }
        }
        if let Some(l) = noteworthy
            .iter()
            .find(|l| KERNEL_TROUBLE.iter().any(|t| l.contains(t)))
        {
            problems.push(format!(
                "kernel: {boot_name}the guest kernel reported trouble: {}",
                l.trim()
            ));
        }
        for s in boot_log
            .steps
            .iter()
            .filter(|s| s.id.parse::<usize>().is_err())
        {
            let what = if s.name.starts_with("insmod-") {
                "module load"
            } else {
                "device wait"
            };
            problems.push(format!(
                "{what}: {boot_name}{} rc={}",
                s.name,
                s.rc.map_or("?".into(), |r| r.to_string())
            ));
        }
        boot_json.push(json!({
            "boot": n,
            "steps": steps[range.clone()].iter().map(|s| s.name.clone()).collect::<Vec<_>>(),
            "power_cut": cut_step.map(|c| steps[c].name.clone()),
            "guest_run_s": boot_timings.exit.as_secs_f64(),
            "boot_to_init_s": boot_timings.init.map(|d| d.as_secs_f64()),
            "early_kernel_crashes": early_crashes,
        }));
        if timings.is_none() {
            log.init_t = boot_log.init_t;
            log.ready_t = boot_log.ready_t;
        }
        log.done = boot_log.done;
        log.done_t = boot_log.done_t;
        log.info.extend(boot_log.info);
        log.stray.push_str(&boot_log.stray);
        log.steps.extend(boot_log.steps);
        timings.get_or_insert(boot_timings);
        if problems.len() > before && b + 1 < boots.len() {
            say(&format!(
                "lab: not booting again: boot {n} went wrong, so the later boots' steps are not run"
            ));
            break;
        }
    }
    let timings = timings.unwrap_or_default();
    let total = t_start.elapsed();
    let lab_time = t_lab.elapsed();

    let mut rows = rows(&steps, &log);
    for r in &mut rows {
        if let Ok(i) = r.id.parse::<usize>() {
            if cut_done.contains(&(i - 1)) {
                r.result = "ok (power cut)".into();
            }
        }
    }
    let failed: Vec<String> = rows
        .iter()
        .filter(|r| r.id.parse::<usize>().is_ok() && !r.result.starts_with("ok"))
        .map(|r| format!("{} ({})", r.name, r.result))
        .collect();
    if !failed.is_empty() {
        problems.push(format!("step: {}", failed.join(", ")));
    }
    let ok = problems.is_empty();

    // Summary: table on stdout, verdict on stderr, JSON for tools.
    println!();
    println!("{:<16} {:>5} {:>9}  result", "step", "rc", "guest s");
    for r in &rows {
        let rc = r.rc.map_or("-".to_string(), |rc| rc.to_string());
        let t = r.seconds.map_or("-".to_string(), |t| format!("{t:.2}"));
        println!("{:<16} {rc:>5} {t:>9}  {}", r.name, r.result);
    }
    println!("done marker: {}", if log.done { "yes" } else { "NO" });
    println!();
    let boot_to_first = timings.first_step.map_or("-".into(), secs);
    say(&format!(
        "lab: timings: initramfs {}, boot to /init {}, boot to first step {boot_to_first}, guest run {}, lab {} (after artifacts), total {}",
        secs(t_initramfs),
        timings.init.map_or("-".into(), secs),
        secs(guest_run),
        secs(lab_time),
        secs(total)
    ));
    let summary = json!({
        "ok": ok,
        "done": log.done,
        "timed_out": timed_out,
        "boots": boot_json,
        "problems": problems,
        "kernel": { "package": kernel.pkg, "version": kernel.version },
        "pmr": cfg.pmr.is_some(),
        "timings_s": {
            "initramfs": t_initramfs.as_secs_f64(),
            "boot_to_init": timings.init.map(|d| d.as_secs_f64()),
            "boot_to_first_step": timings.first_step.map(|d| d.as_secs_f64()),
            "guest_run": guest_run.as_secs_f64(),
            "lab": lab_time.as_secs_f64(),
            "total": total.as_secs_f64(),
        },
        "info": log.info,
        "steps": rows.iter().map(|r| json!({
            "id": r.id, "name": r.name, "rc": r.rc, "seconds": r.seconds, "result": r.result, "output": r.output,
        })).collect::<Vec<_>>(),
    });
    let summary_path = run_dir.join("summary.json");
    if let Err(e) = fs::write(
        &summary_path,
        serde_json::to_string_pretty(&summary).unwrap_or_default() + "\n",
    ) {
        say(&format!(
            "lab: warning: cannot write {}: {e}",
            summary_path.display()
        ));
    }
    if !args.keep {
        for f in [&cfg.disk, &cfg.initrd] {
            let _ = fs::remove_file(f);
        }
        if let Some(p) = &cfg.pmr {
            let _ = fs::remove_file(p);
        }
        let _ = fs::remove_dir_all(run_dir.join("stage"));
    }
    if ok {
        say(&format!(
            "lab: PASS: {} step(s) ok{}; logs in {}",
            steps.len(),
            if retried_boots > 0 {
                format!(
                    " ({retried_boots} boot(s) tried again after the guest kernel crashed before /init)"
                )
            } else {
                String::new()
            },
            run_dir.display()
        ));
    } else {
        for p in &problems {
            say(&format!("lab: FAILED: {p}"));
        }
        say(&format!(
            "lab: logs in {} (console.log, results.log, summary.json)",
            run_dir.display()
        ));
    }
    Ok(ok)
}

fn sparse_file(path: &Path, len: u64) -> Result<(), String> {
    File::create(path)
        .and_then(|f| f.set_len(len))
        .map_err(|e| format!("{}: {e}", path.display()))
}

struct Row {
    id: String,
    name: String,
    rc: Option<i32>,
    seconds: Option<f64>,
    result: String,
    output: String,
}

fn result_word(s: &results::Step) -> String {
    match s.rc {
        Some(0) => "ok".into(),
        Some(rc) => format!("FAILED rc={rc}"),
        None => "INTERRUPTED".into(),
    }
}

/// Setup failures, then every planned step (those the guest never began: "not run").
fn rows(steps: &[Step], log: &Log) -> Vec<Row> {
    let row = |s: &results::Step| Row {
        id: s.id.clone(),
        name: s.name.clone(),
        rc: s.rc,
        seconds: s.seconds(),
        result: result_word(s),
        output: s.output.clone(),
    };
    let mut rows: Vec<Row> = log
        .steps
        .iter()
        .filter(|s| s.id.parse::<usize>().is_err())
        .map(row)
        .collect();
    for (i, step) in steps.iter().enumerate() {
        let id = (i + 1).to_string();
        rows.push(match log.steps.iter().find(|s| s.id == id) {
            Some(s) => row(s),
            None => Row {
                id,
                name: step.name.clone(),
                rc: None,
                seconds: None,
                result: "not run".into(),
                output: String::new(),
            },
        });
    }
    rows
}

/// Prints the guest's progress as the result log grows.
#[derive(Default)]
struct Live {
    total: usize,
    start: Option<Instant>,
    infos: usize,
    stray: usize,
    begun: usize,
    ended: usize,
    init_seen: bool,
}

impl Live {
    fn elapsed(&self) -> String {
        self.start.map_or(String::new(), |s| {
            format!("{:>6.1}s", s.elapsed().as_secs_f64())
        })
    }

    fn label(&self, s: &results::Step) -> String {
        match s.id.parse::<usize>() {
            Ok(n) => format!("[{n}/{}] {}", self.total, s.name),
            Err(_) => format!("setup {}", s.name),
        }
    }

    fn update(&mut self, log: &Log, finished: bool) {
        if !self.init_seen && log.init_t.is_some() {
            self.init_seen = true;
            say(&format!(
                "lab: {} guest /init started (guest uptime {:.2} s)",
                self.elapsed(),
                log.init_t.unwrap_or(0.0)
            ));
        }
        for info in &log.info[self.infos..] {
            say(&format!("lab: {} guest: {info}", self.elapsed()));
        }
        self.infos = log.info.len();
        if log.stray.len() > self.stray {
            for line in log.stray[self.stray..].lines() {
                say(&format!("lab: guest (outside any step): {line}"));
            }
            self.stray = log.stray.len();
        }
        for (i, s) in log.steps.iter().enumerate() {
            if i >= self.begun {
                say(&format!("lab: {} {} …", self.elapsed(), self.label(s)));
                self.begun = i + 1;
            }
            let ended = s.rc.is_some() || i + 1 < log.steps.len() || finished;
            if !ended {
                break;
            }
            if i >= self.ended {
                let t = s
                    .seconds()
                    .map_or(String::new(), |t| format!(" ({t:.2} s in the guest)"));
                say(&format!(
                    "lab: {} {} {}{t}",
                    self.elapsed(),
                    self.label(s),
                    result_word(s)
                ));
                print_output(&s.output);
                self.ended = i + 1;
            }
        }
    }
}

fn print_output(output: &str) {
    let lines: Vec<&str> = output.lines().collect();
    let skip = lines.len().saturating_sub(OUTPUT_LINES_SHOWN);
    if skip > 0 {
        say(&format!(
            "    | … {skip} earlier lines (all of it: target/lab/run/summary.json, results.log)"
        ));
    }
    for l in &lines[skip..] {
        say(&format!("    | {l}"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;
    use std::process::ExitStatus;

    fn console(name: &str, text: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("aios-lab-{}-{name}.log", std::process::id()));
        fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn only_a_kernel_crash_before_init_is_worth_another_boot() {
        let oops = "[    2.09] Oops: int3: 0000 [#1] PREEMPT SMP NOPTI\n[    2.10] Kernel panic - not syncing\n";
        let crashed = console("crashed", oops);
        let quiet = console("quiet", "[    1.00] random: crng init done\n");
        let exited = Outcome::Exited(ExitStatus::from_raw(0));
        let none = Log::default();
        assert_eq!(
            early_kernel_crash(&exited, &none, &crashed).as_deref(),
            Some("[    2.09] Oops: int3: 0000 [#1] PREEMPT SMP NOPTI")
        );
        // No trouble on the console: the guest stopped for some other reason.
        assert_eq!(early_kernel_crash(&exited, &none, &quiet), None);
        // A hang is not retried: it already cost the whole timeout.
        assert_eq!(
            early_kernel_crash(&Outcome::TimedOut, &none, &crashed),
            None
        );
        // Once /init has reported, the guest's own code ran: a crash then is a result.
        let after_init = results::parse("@@AIOS-LAB init t=1.50\n");
        assert_eq!(early_kernel_crash(&exited, &after_init, &crashed), None);
        let step_begun = results::parse("@@AIOS-LAB step 1 begin x t=1\n");
        assert_eq!(early_kernel_crash(&exited, &step_begun, &crashed), None);
        let _ = fs::remove_file(crashed);
        let _ = fs::remove_file(quiet);
    }
}
