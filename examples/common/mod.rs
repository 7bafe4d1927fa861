//! What the crash examples share: their working directory, and a writer process started,
//! let run, and killed with SIGKILL.

// Each example uses the part it needs.
#![allow(dead_code)]

use std::error::Error;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::rc::Rc;
use std::sync::mpsc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aios::core::{Engine, EngineConfig};
use aios::lbio::{Device, DeviceConfig, LbioArray, LbioConfig};

pub type Res<T> = Result<T, Box<dyn Error>>;

/// Run `body` in the directory named by the first argument (kept afterwards), or else in a
/// scratch directory `/var/tmp/aios-NAME-PID` (removed afterwards, whatever the outcome).
pub fn in_workdir(name: &str, body: impl FnOnce(&Path) -> Res<()>) -> Res<()> {
    let (dir, scratch) = match std::env::args().nth(1) {
        Some(d) => (PathBuf::from(d), false),
        None => (
            PathBuf::from(format!("/var/tmp/aios-{name}-{}", std::process::id())),
            true,
        ),
    };
    std::fs::create_dir_all(&dir)?;
    let result = body(&dir);
    if scratch {
        let _ = std::fs::remove_dir_all(&dir);
    }
    result
}

/// How a writer process ended.
pub struct Killed {
    /// The highest `acked N` line it printed.
    pub acked: u64,
    /// How long it ran after its first acknowledgement.
    pub after: Duration,
    /// It finished on its own before the kill (with this status).
    pub finished: Option<ExitStatus>,
}

impl std::fmt::Display for Killed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.finished {
            Some(status) => write!(f, "finished on its own ({status})")?,
            None => write!(f, "killed with SIGKILL")?,
        }
        write!(f, " after {} ms", self.after.as_millis())
    }
}

/// Start this example again as `writer DIR`, wait for its first `acked N` line, let it run
/// 50–450 ms more, then kill it with SIGKILL and collect every line it printed.
pub fn run_writer_and_kill(dir: &Path) -> Res<Killed> {
    let mut child = Command::new(std::env::current_exe()?)
        .arg("writer")
        .arg(dir)
        .stdout(Stdio::piped())
        .spawn()?;
    let out = child.stdout.take().ok_or("the writer's stdout")?;
    let (tx, rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let first = match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(line) => line,
        Err(_) => {
            let _ = child.kill();
            let _ = child.wait();
            return Err("the writer acknowledged nothing within 30 s".into());
        }
    };
    let mut acked = acked_count(&first);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH)?.subsec_nanos();
    let after = Duration::from_millis(50 + (nanos % 400) as u64);
    std::thread::sleep(after);
    let finished = child.try_wait()?;
    if finished.is_none() {
        child.kill()?; // SIGKILL
    }
    child.wait()?;
    reader.join().map_err(|_| "the reader thread panicked")?;
    for line in rx.try_iter() {
        acked = acked.max(acked_count(&line));
    }
    Ok(Killed {
        acked,
        after,
        finished,
    })
}

/// `acked N` → N.
fn acked_count(line: &str) -> u64 {
    line.strip_prefix("acked ")
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// An engine (4 MiB arena), its lbio array, and `path` open for writing on it.
pub fn open_writable(path: &Path) -> Res<(Rc<Engine>, Rc<LbioArray>, Device)> {
    let engine = Engine::new(EngineConfig {
        arena_bytes: 4 << 20,
        ..EngineConfig::default()
    })?;
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default())?;
    let config = DeviceConfig {
        write: true,
        ..DeviceConfig::default()
    };
    let dev = Device::open(&lbio, path, config)?;
    Ok((engine, lbio, dev))
}
