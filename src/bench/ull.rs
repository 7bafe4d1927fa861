//! The `ull` device: a loop device with direct I/O over an image in /dev/shm, the stand-in for an
//! ultra-low-latency SSD on machines without NVMe (DESIGN.md, "Devices on these machines").

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::bench::report::human_bytes;
use crate::bench::BenchError;

/// Default size of the `ull` image.
pub const ULL_BYTES: u64 = 1 << 30;

/// A loop device created for a benchmark; detached and its image removed on drop.
pub struct UllDevice {
    loop_dev: PathBuf,
    /// Detaches the device (when dropped, or on SIGINT/SIGTERM). Dropped before `_image`.
    _undo: crate::bench::cleanup::Undo,
    /// Removes the image (when dropped, or on SIGINT/SIGTERM, also while it is being filled).
    _image: crate::bench::cleanup::Undo,
}

impl std::fmt::Debug for UllDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UllDevice")
            .field("loop_dev", &self.loop_dev)
            .finish()
    }
}

/// Refuse `count` ull devices of `bytes` each when their images would not fit the free space
/// of /dev/shm (with a tenth of it kept free): the fill would run the memory-backed file system
/// dry part way, squeezing everything else on the machine, before failing. `what` names the
/// options that set the sizes, for the message.
pub fn check_room(count: u64, bytes: u64, what: &str) -> Result<(), BenchError> {
    // /dev/shm's pages are memory: its free space and the memory available, whichever is less.
    let free = shm_free_bytes()?.min(mem_available_bytes().unwrap_or(u64::MAX));
    let need = count.saturating_mul(bytes);
    if need > free / 10 * 9 {
        return Err(BenchError::Invalid(format!(
            "{what}: {count} ull device(s) of {} need {} of /dev/shm and memory; {:.1} GiB is \
             free (at most nine tenths of it is taken): use fewer or smaller devices",
            human_bytes(bytes),
            human_bytes(need),
            free as f64 / (1u64 << 30) as f64
        )));
    }
    Ok(())
}

/// `MemAvailable` of /proc/meminfo, in bytes.
fn mem_available_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Bytes free in /dev/shm (tmpfs keeps no reserve for root).
fn shm_free_bytes() -> Result<u64, BenchError> {
    aios_core::sys::free_bytes(Path::new("/dev/shm"))
        .map_err(|e| BenchError::Setup(format!("statvfs /dev/shm (where ull devices live): {e}")))
}

impl UllDevice {
    /// Create the image (filled with non-zero data, so reads are not served from holes) and attach
    /// it with `losetup --direct-io=on`. Needs root.
    pub fn create(bytes: u64) -> Result<UllDevice, BenchError> {
        if !aios_core::sys::is_root() {
            return Err(BenchError::Setup(
                "the ull device is a loop device: creating it needs root (or pass --device PATH)"
                    .into(),
            ));
        }
        check_room(1, bytes, "the ull device")?;
        // Unique per device: a run may hold several at once (the fsync bench's journal and ext4).
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let image = PathBuf::from(format!("/dev/shm/aios-ull-{}-{n}.img", std::process::id()));
        // Registered before the image is written: a failed or interrupted fill removes it too.
        let image_undo = crate::bench::cleanup::remove_file("the ull device's image", &image);
        fill_file(&image, bytes)?;
        let out = Command::new("losetup")
            .args(["-f", "--show", "--direct-io=on"])
            .arg(&image)
            .output()
            .map_err(|e| BenchError::Setup(format!("running losetup (util-linux): {e}")))?;
        if !out.status.success() {
            return Err(BenchError::Setup(format!(
                "losetup -f --show --direct-io=on {} failed: {}",
                image.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        let loop_dev = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim().to_string());
        let l = loop_dev.clone();
        let undo = crate::bench::cleanup::register("the ull loop device", move || {
            // Leave the loop device as it was found (the setting outlives the attachment).
            let _ = set_write_cache(&l, "write back");
            let _ = Command::new("losetup").arg("-d").arg(&l).status();
        });
        let dev = UllDevice {
            loop_dev,
            _undo: undo,
            _image: image_undo,
        };
        // The kernel keeps a loop device's write-cache setting across detach and attach: start
        // from the ull device's definition (a volatile cache, like a loop device's default).
        dev.set_write_cache("write back")?;
        Ok(dev)
    }

    /// Declare the device free of a volatile write cache (`queue/write_cache` = "write
    /// through"), as an SSD with power-loss protection reports itself: the kernel then completes
    /// FLUSH at once and drops FUA, and lbio declares the device power-loss protected.
    pub fn set_write_through(&self) -> Result<(), BenchError> {
        self.set_write_cache("write through")
    }

    fn set_write_cache(&self, mode: &str) -> Result<(), BenchError> {
        set_write_cache(&self.loop_dev, mode)
    }

    /// The loop device's path (`/dev/loopN`).
    pub fn path(&self) -> &Path {
        &self.loop_dev
    }
}

/// Set loop device `dev`'s `queue/write_cache` to `mode`.
fn set_write_cache(dev: &Path, mode: &str) -> Result<(), BenchError> {
    let name = dev
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    let attr = PathBuf::from(format!("/sys/block/{name}/queue/write_cache"));
    std::fs::write(&attr, mode)
        .map_err(|e| BenchError::Setup(format!("writing {}: {e}", attr.display())))
}

/// Create (or overwrite) `path` with `bytes` of pseudo-random data, 1 MiB at a time.
pub fn fill_file(path: &Path, bytes: u64) -> Result<(), BenchError> {
    let setup = |e: std::io::Error| BenchError::Setup(format!("writing {}: {e}", path.display()));
    let mut f = std::fs::File::create(path).map_err(setup)?;
    let mut chunk = vec![0u8; 1 << 20];
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut left = bytes;
    while left > 0 {
        for w in chunk.chunks_exact_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            w.copy_from_slice(&x.to_le_bytes());
        }
        let n = left.min(chunk.len() as u64) as usize;
        f.write_all(&chunk[..n]).map_err(setup)?;
        left -= n as u64;
    }
    f.sync_all().map_err(setup)?;
    Ok(())
}
