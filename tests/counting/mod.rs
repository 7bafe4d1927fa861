//! A counting global allocator for the "allocate at start, never on the hot path" tests
//! (`no_alloc`, `no_alloc_net`), and the scratch files they run on. A test binary installs it
//! with
//!
//! ```ignore
//! #[global_allocator]
//! static GLOBAL: counting::CountingAlloc = counting::CountingAlloc;
//! ```
//!
//! and measures with [`allocations_during`] (the calling thread's allocations: tests running in
//! parallel on other threads do not disturb each other) or [`allocations_during_all_threads`]
//! (every thread of the process: for a binary with one test, whose work runs on threads it does
//! not own). With `AIOS_ALLOC_TRACE=N` the stacks of the first N allocations counted are printed,
//! to find where they come from.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

pub struct CountingAlloc;

thread_local! {
    /// This thread counts its own allocations ([`allocations_during`]).
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
    /// Set while this thread prints a stack (which allocates): those are not counted.
    static TRACING: Cell<bool> = const { Cell::new(false) };
}

/// Every thread counts ([`allocations_during_all_threads`]).
static COUNTING_ALL: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS_ALL: AtomicU64 = AtomicU64::new(0);
/// Stacks still to print (`AIOS_ALLOC_TRACE`).
static TRACE_LEFT: AtomicU64 = AtomicU64::new(0);

fn note_allocation() {
    // `try_with`: the allocator can be called while this thread's locals are being torn down.
    if TRACING.try_with(|t| t.get()).unwrap_or(true) {
        return;
    }
    let counted = if COUNTING_ALL.load(Ordering::Relaxed) {
        ALLOCATIONS_ALL.fetch_add(1, Ordering::Relaxed);
        true
    } else {
        COUNTING
            .try_with(|on| {
                if on.get() {
                    ALLOCATIONS.with(|n| n.set(n.get() + 1));
                }
                on.get()
            })
            .unwrap_or(false)
    };
    if counted
        && TRACE_LEFT.load(Ordering::Relaxed) > 0
        && TRACE_LEFT
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok()
    {
        TRACING.with(|t| t.set(true));
        let thread = std::thread::current();
        // Not `eprintln!`: a panic must not unwind out of the allocator.
        let _ = writeln!(
            std::io::stderr(),
            "allocation on thread {:?}:\n{}",
            thread.name().unwrap_or("?"),
            std::backtrace::Backtrace::force_capture()
        );
        TRACING.with(|t| t.set(false));
    }
}

// SAFETY: every call is forwarded unchanged to the system allocator. Counting touches only
// atomics and const-initialised thread-locals, which never allocate; printing a stack does, with
// counting turned off for the thread meanwhile.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note_allocation();
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note_allocation();
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note_allocation();
        // SAFETY: forwarded with the caller's pointer, layout and size.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded with the caller's pointer and layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

fn arm_trace() {
    let n = std::env::var("AIOS_ALLOC_TRACE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    TRACE_LEFT.store(n, Ordering::Relaxed);
}

/// Run `f`, counting the heap allocations this thread makes meanwhile.
#[allow(dead_code)] // each binary uses one of the two
pub fn allocations_during<R>(f: impl FnOnce() -> R) -> (R, u64) {
    arm_trace();
    ALLOCATIONS.with(|n| n.set(0));
    COUNTING.with(|c| c.set(true));
    let r = f();
    COUNTING.with(|c| c.set(false));
    (r, ALLOCATIONS.with(|n| n.get()))
}

/// Run `f`, counting the heap allocations every thread of the process makes meanwhile.
#[allow(dead_code)] // each binary uses one of the two
pub fn allocations_during_all_threads<R>(f: impl FnOnce() -> R) -> (R, u64) {
    arm_trace();
    ALLOCATIONS_ALL.store(0, Ordering::SeqCst);
    COUNTING_ALL.store(true, Ordering::SeqCst);
    let r = f();
    COUNTING_ALL.store(false, Ordering::SeqCst);
    (r, ALLOCATIONS_ALL.load(Ordering::SeqCst))
}

/// A zero-filled scratch file of `bytes` under /var/tmp (a file system with `O_DIRECT`, unlike
/// tmpfs on older kernels), removed when dropped.
pub struct TempFile(pub PathBuf);

impl TempFile {
    pub fn new(tag: &str, bytes: usize) -> TempFile {
        let path = PathBuf::from(format!(
            "/var/tmp/aios-no-alloc-{}-{tag}.img",
            std::process::id()
        ));
        std::fs::write(&path, vec![0u8; bytes]).expect("create the test file");
        TempFile(path)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
