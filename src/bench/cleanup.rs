//! Undoing what a bench set up (loop devices and their images in /dev/shm, mounts) also when it
//! is interrupted. Each resource registers its undo when it is made; dropping the returned
//! [`Undo`] runs it. SIGINT or SIGTERM runs every undo still registered, newest first (a mount
//! before the device under it), says so on stderr and exits with 128 + the signal's number.
//! Without this, a bench stopped with Ctrl-C or `kill` left its 1 GiB `ull` image in RAM and
//! its loop device attached.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, Once};
use std::time::Duration;

type Action = Box<dyn FnOnce() + Send>;

static PENDING: Mutex<Vec<(u64, &'static str, Action)>> = Mutex::new(Vec::new());
static NEXT: AtomicU64 = AtomicU64::new(0);
static WATCHER: Once = Once::new();
/// Set by the watcher once it has taken the undos, just before it runs them.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// A registered undo: runs once, when dropped or when the process is interrupted.
#[must_use = "dropping it undoes at once"]
#[derive(Debug)]
pub struct Undo(u64);

/// Register `action` (what undoes `what`, for the message on interruption).
pub fn register(what: &'static str, action: impl FnOnce() + Send + 'static) -> Undo {
    WATCHER.call_once(start_watcher);
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    pending().push((id, what, Box::new(action)));
    Undo(id)
}

/// Register the removal of the file at `path` (`what` names it on interruption).
pub fn remove_file(what: &'static str, path: &std::path::Path) -> Undo {
    let path = path.to_path_buf();
    register(what, move || {
        let _ = std::fs::remove_file(&path);
    })
}

fn pending() -> std::sync::MutexGuard<'static, Vec<(u64, &'static str, Action)>> {
    PENDING.lock().unwrap_or_else(|p| p.into_inner())
}

impl Undo {
    /// Drop the undo without running it (the owner undoes by other means). After an
    /// interruption this does not return: the watcher is undoing everything and will end the
    /// process, and the owner must not race it.
    pub fn cancel(&self) {
        pending().retain(|(id, _, _)| *id != self.0);
        wait_if_interrupted();
    }
}

/// If the process was interrupted, block for good: the watcher ends the process once it has
/// undone everything (a thread that went on could return from `main` and end the process in
/// the middle of that).
fn wait_if_interrupted() {
    if INTERRUPTED.load(Ordering::SeqCst) {
        loop {
            std::thread::park();
        }
    }
}

impl Drop for Undo {
    fn drop(&mut self) {
        let action = {
            let mut p = pending();
            p.iter()
                .position(|(id, _, _)| *id == self.0)
                .map(|i| p.remove(i).2)
        };
        match action {
            Some(a) => a(),
            None => wait_if_interrupted(),
        }
    }
}

/// Start the thread that undoes and exits, then catch SIGINT and SIGTERM for it. If either
/// step fails the signals keep their default action (the process dies as before) and a warning
/// says so.
fn start_watcher() {
    use std::io::Read;
    let (tx, rx) = std::sync::mpsc::channel::<std::fs::File>();
    let spawned = std::thread::Builder::new()
        .name("aios-cleanup".into())
        .spawn(move || {
            let Ok(mut pipe) = rx.recv() else {
                return;
            };
            let mut b = [0u8; 1];
            if pipe.read_exact(&mut b).is_err() {
                return;
            }
            let all: Vec<(u64, &'static str, Action)> = {
                let mut p = pending();
                INTERRUPTED.store(true, Ordering::SeqCst);
                std::mem::take(&mut *p)
            };
            eprintln!(
                "\ninterrupted (signal {}): undoing {} set-up step(s) before exiting",
                b[0],
                all.len()
            );
            // First the processes the bench started (fio, the file system): one still
            // running would keep a mount busy, or write into a mount point once it is gone.
            stop_children(Duration::from_secs(5));
            for (_, what, action) in all.into_iter().rev() {
                eprintln!("  undoing: {what}");
                action();
            }
            std::process::exit(128 + b[0] as i32);
        });
    if let Err(e) = spawned {
        eprintln!("warning: no cleanup on interruption (thread: {e})");
        return;
    }
    match aios_core::sys::interrupt_pipe() {
        Ok(pipe) => {
            let _ = tx.send(pipe);
        }
        Err(e) => eprintln!("warning: no cleanup on interruption ({e})"),
    }
}

/// `pid`'s state letter and parent from `/proc/PID/stat` ("pid (comm) state ppid ...", where
/// comm may hold spaces and parentheses); `None` once it is gone.
fn proc_state(pid: u32) -> Option<(String, u32)> {
    let st = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut rest = st[st.rfind(')')? + 1..].split_whitespace();
    let state = rest.next()?.to_string();
    let ppid = rest.next()?.parse().ok()?;
    Some((state, ppid))
}

/// Wait up to `limit` until every process in `pids` has exited: gone, or a zombie (its exit
/// status not yet collected, which may never happen while the bench is being undone).
pub fn wait_exited(pids: &[u32], limit: Duration) {
    let running = |pid: &u32| proc_state(*pid).is_some_and(|(state, _)| state != "Z");
    let t0 = std::time::Instant::now();
    while t0.elapsed() < limit && pids.iter().any(running) {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// SIGTERM every process whose parent is this one, and wait up to `limit` for them to exit.
fn stop_children(limit: Duration) {
    let me = std::process::id();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return;
    };
    let children: Vec<u32> = dir
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| proc_state(pid).is_some_and(|(_, ppid)| ppid == me))
        .collect();
    if children.is_empty() {
        return;
    }
    eprintln!("  stopping {} child process(es)", children.len());
    for &pid in &children {
        let _ = aios_core::sys::terminate(pid);
    }
    wait_exited(&children, limit);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// An undo runs once when dropped, never after `cancel`, and not at all for others.
    #[test]
    fn an_undo_runs_once_when_dropped_and_not_after_cancel() {
        let runs = Arc::new(AtomicU64::new(0));
        let r = Arc::clone(&runs);
        let a = register("test a", move || {
            r.fetch_add(1, Ordering::Relaxed);
        });
        let r = Arc::clone(&runs);
        let b = register("test b", move || {
            r.fetch_add(10, Ordering::Relaxed);
        });
        drop(a);
        assert_eq!(runs.load(Ordering::Relaxed), 1);
        b.cancel();
        drop(b);
        assert_eq!(runs.load(Ordering::Relaxed), 1);
        assert!(pending().iter().all(|(_, w, _)| !w.starts_with("test ")));
    }
}
