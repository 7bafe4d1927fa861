//! The kernel side of FUSE over io_uring (Linux 6.14+, `fuse.enable_uring`): a queue's ring and
//! the buffers its entries register. The protocol's decoding lives with the file system
//! (`fs-fuse`); this module only owns what needs `unsafe`: the 128-byte `URING_CMD`
//! submissions that hand the kernel the addresses of each entry's header and payload buffers,
//! and those buffers, which must stay put while the kernel may write them.
//!
//! An entry is registered once (`FUSE_IO_URING_CMD_REGISTER`); its command completes when the
//! kernel has put a request in the entry's buffers, and the answer written back into them goes
//! with the command that waits for the next request (`FUSE_IO_URING_CMD_COMMIT_AND_FETCH`).

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;

use io_uring::{cqueue, opcode, squeue, types, IoUring};

/// `FUSE_IO_URING_CMD_REGISTER`.
const CMD_REGISTER: u32 = 1;
/// `FUSE_IO_URING_CMD_COMMIT_AND_FETCH`.
const CMD_COMMIT_AND_FETCH: u32 = 2;

/// Bytes of an entry's header buffer (`struct fuse_uring_req_header`): the request's or
/// answer's fixed header (128), the operation's own header (128), and the entry's bookkeeping
/// (flags, commit id, payload size: 32).
pub const HEADER_BYTES: usize = 128 + 128 + 32;

/// An entry's buffers are raw allocations, not `Box`es: the kernel writes them through the
/// addresses it was given while the queue is moved and used, which a `Box` (a unique owner)
/// does not allow. References to them exist only while the entry is in user space's hands:
/// from its command's completion until it is handed back (`with_kernel`).
struct Entry {
    header: NonNull<[u8]>,
    payload: NonNull<[u8]>,
    iov: Box<[libc::iovec; 2]>,
    /// A command of this entry is with the kernel, which may write its buffers.
    with_kernel: bool,
}

/// A zeroed heap buffer of `len` bytes, owned through the returned pointer (freed with
/// [`free_buffer`]).
fn alloc_buffer(len: usize) -> NonNull<[u8]> {
    NonNull::from(Box::leak(vec![0u8; len].into_boxed_slice()))
}

/// Free a buffer of [`alloc_buffer`].
///
/// # Safety
/// `b` came from `alloc_buffer`, is freed once, and nothing (the kernel included) uses it after.
unsafe fn free_buffer(b: NonNull<[u8]>) {
    // SAFETY: per the contract, `b` is the leaked box of `alloc_buffer`, now unused.
    drop(unsafe { Box::from_raw(b.as_ptr()) });
}

/// One FUSE queue's io_uring and its entries' buffers.
pub struct FuseQueue {
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
    dev: Arc<OwnedFd>,
    qid: u16,
    ents: Vec<Entry>,
    /// Commands the kernel holds (registered or committed, not yet completed).
    outstanding: usize,
    /// The last [`FuseQueue::submit_and_spin`] found its completions while spinning (it did
    /// not sleep).
    caught_spinning: bool,
}

// SAFETY: the buffers and iovecs are the queue's own allocations, which move with it and are
// only touched by the thread that owns it (and by the kernel, for this queue's commands).
unsafe impl Send for FuseQueue {}

/// A completion: the entry it belongs to and the kernel's result (0 when the entry holds a
/// request, else a negative errno).
#[derive(Clone, Copy, Debug)]
pub struct Completion {
    pub entry: usize,
    pub result: i32,
}

impl FuseQueue {
    /// A ring with room for `depth` entries, each with a header buffer and a payload buffer of
    /// `payload` bytes, for queue `qid` of the connection behind `dev` (a `/dev/fuse`
    /// descriptor).
    pub fn new(dev: Arc<OwnedFd>, qid: u16, depth: usize, payload: usize) -> io::Result<FuseQueue> {
        let ring = IoUring::builder().build((depth as u32).next_power_of_two().max(2))?;
        let ents = (0..depth)
            .map(|_| {
                let header = alloc_buffer(HEADER_BYTES);
                let payload = alloc_buffer(payload);
                let iov = Box::new([
                    libc::iovec {
                        iov_base: header.as_ptr().cast(),
                        iov_len: header.len(),
                    },
                    libc::iovec {
                        iov_base: payload.as_ptr().cast(),
                        iov_len: payload.len(),
                    },
                ]);
                Entry {
                    header,
                    payload,
                    iov,
                    with_kernel: false,
                }
            })
            .collect();
        Ok(FuseQueue {
            ring,
            dev,
            qid,
            ents,
            outstanding: 0,
            caught_spinning: false,
        })
    }

    pub fn depth(&self) -> usize {
        self.ents.len()
    }

    /// The command for entry `i`: `cmd_op`, the `fuse_uring_cmd_req` (flags 0, commit id,
    /// queue id) in the command area, and for registration the entry's two iovecs.
    fn push(&mut self, i: usize, cmd_op: u32, commit_id: u64) -> io::Result<()> {
        // A second command on an entry the kernel holds: the first one's completion would mark
        // the entry user space's, and its buffers would be lent while the other command is
        // still with the kernel.
        if self.ents[i].with_kernel {
            return Err(io::Error::other(format!(
                "FUSE entry {i} already has a command with the kernel"
            )));
        }
        let mut cmd = [0u8; 80];
        cmd[8..16].copy_from_slice(&commit_id.to_le_bytes());
        cmd[16..18].copy_from_slice(&self.qid.to_le_bytes());
        let mut b = opcode::UringCmd80::new(types::Fd(self.dev.as_raw_fd()), cmd_op).cmd(cmd);
        let register = cmd_op == CMD_REGISTER;
        if register {
            b = b.addr(Some(self.ents[i].iov.as_ptr() as u64));
        }
        let mut e = b.build().user_data(i as u64);
        if register {
            // The iovec count goes in the SQE's `len` field (bytes 24..28), which the opcode
            // builder does not expose.
            // SAFETY: `Entry128` is the kernel's 128-byte SQE (`repr(C)`, plain integers);
            // viewing it as bytes and changing the four bytes of `len` keeps it valid.
            e = unsafe {
                let mut raw: [u8; 128] = std::mem::transmute(e);
                raw[24..28].copy_from_slice(&2u32.to_le_bytes());
                std::mem::transmute::<[u8; 128], squeue::Entry128>(raw)
            };
        }
        // SAFETY: the command names the entry's buffers (and, for registration, its iovecs),
        // boxed and owned by `self`; `Drop` leaks them rather than free them while the kernel
        // holds any command, so they outlive every use the kernel makes of them.
        unsafe { self.ring.submission().push(&e) }
            .map_err(|_| io::Error::other("FUSE queue: submission queue full"))?;
        self.outstanding += 1;
        self.ents[i].with_kernel = true;
        Ok(())
    }

    /// Hand entry `i` to the kernel for its first request.
    pub fn register(&mut self, i: usize) -> io::Result<()> {
        self.push(i, CMD_REGISTER, 0)
    }

    /// Send the answer written in entry `i` (for the request `commit_id`) and wait for the
    /// next request in it.
    pub fn commit_and_fetch(&mut self, i: usize, commit_id: u64) -> io::Result<()> {
        self.push(i, CMD_COMMIT_AND_FETCH, commit_id)
    }

    /// Submit what was pushed and wait for at least one completion; returns them all.
    pub fn submit_and_wait(&mut self) -> io::Result<Vec<Completion>> {
        loop {
            match self.ring.submit_and_wait(1) {
                Ok(_) => break,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(self.take_completions())
    }

    /// As [`FuseQueue::submit_and_wait`], but first spin on the completion queue for up to
    /// `spin` (yielding the CPU every few empty looks, so the thread whose request is on its way
    /// can run on it), and sleep in the kernel only when nothing came by then.
    pub fn submit_and_spin(&mut self, spin: std::time::Duration) -> io::Result<Vec<Completion>> {
        self.caught_spinning = false;
        if spin.is_zero() {
            return self.submit_and_wait();
        }
        loop {
            match self.ring.submit() {
                Ok(_) => break,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => return Err(e),
            }
        }
        let until = std::time::Instant::now() + spin;
        let mut empty = 0u32;
        while self.ring.completion().is_empty() {
            empty += 1;
            if empty % 8 == 0 {
                if std::time::Instant::now() >= until {
                    return self.submit_and_wait();
                }
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        self.caught_spinning = true;
        Ok(self.take_completions())
    }

    /// Whether the last [`FuseQueue::submit_and_spin`] got its completions by spinning (`false`:
    /// it slept, or was told not to spin).
    pub fn caught_spinning(&self) -> bool {
        self.caught_spinning
    }

    /// Every completion posted, taken off the queue.
    fn take_completions(&mut self) -> Vec<Completion> {
        let out: Vec<Completion> = self
            .ring
            .completion()
            .map(|c| Completion {
                entry: c.user_data() as usize,
                result: c.result(),
            })
            .collect();
        self.outstanding -= out.len().min(self.outstanding);
        for c in &out {
            if let Some(e) = self.ents.get_mut(c.entry) {
                e.with_kernel = false;
            }
        }
        out
    }

    /// Submit what was pushed without waiting.
    pub fn submit(&mut self) -> io::Result<()> {
        self.ring.submit().map(|_| ())
    }

    /// Entry `i`, which must be in user space's hands (its command completed, and it has not
    /// been handed back since): a programming error otherwise, as the kernel may be writing it.
    fn own(&self, i: usize) -> &Entry {
        let e = &self.ents[i];
        assert!(
            !e.with_kernel,
            "FUSE entry {i} is the kernel's until its command completes"
        );
        e
    }

    /// Entry `i`'s header buffer (the entry must be out of the kernel's hands: see
    /// [`FuseQueue::buffers_mut`]).
    pub fn header(&self, i: usize) -> &[u8] {
        let e = self.own(i);
        // SAFETY: a live allocation of the queue's; the kernel holds no command of this entry,
        // so nothing writes it while the shared borrow of `self` lasts.
        unsafe { e.header.as_ref() }
    }

    pub fn header_mut(&mut self, i: usize) -> &mut [u8] {
        self.buffers_mut(i).0
    }

    /// Entry `i`'s header and payload buffers, both writable. Only between the completion of
    /// the entry's command and the call that hands it back (`commit_and_fetch`); panics
    /// otherwise.
    pub fn buffers_mut(&mut self, i: usize) -> (&mut [u8], &mut [u8]) {
        let (mut h, mut p) = {
            let e = self.own(i);
            (e.header, e.payload)
        };
        // SAFETY: two distinct live allocations of the queue's; the kernel holds no command of
        // this entry, and the exclusive borrow of `self` keeps every other reference away.
        unsafe { (h.as_mut(), p.as_mut()) }
    }
}

impl Drop for FuseQueue {
    fn drop(&mut self) {
        if self.outstanding > 0 {
            // The kernel may still write into these buffers until it cancels the commands
            // (when the ring's teardown gets to them): keep them alive for good.
            for e in std::mem::take(&mut self.ents) {
                std::mem::forget(e);
            }
            return;
        }
        for e in std::mem::take(&mut self.ents) {
            // SAFETY: no command is with the kernel, and the queue is going: nothing uses
            // the buffers after this.
            unsafe {
                free_buffer(e.header);
                free_buffer(e.payload);
            }
        }
    }
}

/// Pin the calling thread to `cpu`.
pub fn pin_current_thread(cpu: usize) -> io::Result<()> {
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    // SAFETY: a zeroed cpu_set_t is a valid empty set, `cpu` is below CPU_SETSIZE (checked),
    // and sched_setaffinity only reads the set.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::panic::{catch_unwind, AssertUnwindSafe};

    /// An entry's buffers are lent out only while none of its commands is with the kernel:
    /// from the push of a command until its completion is taken, `header`, `header_mut` and
    /// `buffers_mut` refuse (a panic: the kernel may be writing the buffers), for that entry
    /// only; once the completion is taken they lend the same buffers again, unchanged. The
    /// command goes to `/dev/null`, which completes a `URING_CMD` at once (with 0 where, as on
    /// 6.18, it takes them and leaves the buffers alone; with an error where it has no handler),
    /// so no FUSE mount is needed. The entries were `Box`es lent at any time before (no check:
    /// this fails there).
    #[test]
    fn an_entry_is_not_lent_while_its_command_is_with_the_kernel() {
        let null = std::fs::File::open("/dev/null").unwrap();
        let mut q = FuseQueue::new(Arc::new(OwnedFd::from(null)), 0, 2, 4096).unwrap();
        q.buffers_mut(0).0[..4].copy_from_slice(b"mine");
        q.buffers_mut(0).1[..4].copy_from_slice(b"data");
        q.register(0).unwrap();
        // Pushed, so the kernel's as far as the queue knows (its submission may happen at any
        // call): no reference to it.
        let refused = |q: &mut FuseQueue, what: &str, f: &dyn Fn(&mut FuseQueue)| {
            let r = catch_unwind(AssertUnwindSafe(|| f(q)));
            assert!(
                r.is_err(),
                "{what} lent entry 0 while its command was pushed"
            );
        };
        refused(&mut q, "header", &|q| {
            let _ = q.header(0);
        });
        refused(&mut q, "header_mut", &|q| {
            let _ = q.header_mut(0);
        });
        refused(&mut q, "buffers_mut", &|q| {
            let _ = q.buffers_mut(0);
        });
        // A second command on it is refused: the first one's completion would lend the
        // buffers while the second was still with the kernel.
        assert!(q.register(0).is_err());
        assert!(q.commit_and_fetch(0, 1).is_err());
        // The other entry is still user space's.
        q.buffers_mut(1).0[0] = 1;
        // Submitted and completed: lent again, the same bytes.
        let done = q.submit_and_wait().unwrap();
        assert_eq!(done.len(), 1, "{done:?}");
        assert_eq!(done[0].entry, 0);
        assert_eq!(&q.header(0)[..4], b"mine");
        let (h, p) = q.buffers_mut(0);
        assert_eq!((&h[..4], &p[..4]), (&b"mine"[..], &b"data"[..]));
        assert_eq!(q.header(1)[0], 1);
    }
}
