//! Async API on the engine's own single-thread executor: futures completed from CQEs.
//!
//! ```text
//! cargo run --example async_engine
//! ```

use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};

use aios::core::{Engine, EngineConfig, FixedBuf};
use aios::lbio::{Device, DeviceConfig, LbioArray, LbioConfig, LbioError};

/// Poll a set of futures until all finish (a minimal `join_all`, to show several reads in flight
/// at once on one thread).
struct JoinAll<F: Future> {
    futs: Vec<Option<Pin<Box<F>>>>,
    out: Vec<Option<F::Output>>,
}

// Only boxed (already pinned) futures and plain outputs are held: moving them is fine.
impl<F: Future> Unpin for JoinAll<F> {}

impl<F: Future> Future for JoinAll<F> {
    type Output = Vec<F::Output>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let mut pending = false;
        for (slot, out) in this.futs.iter_mut().zip(this.out.iter_mut()) {
            if let Some(f) = slot {
                match f.as_mut().poll(cx) {
                    Poll::Ready(v) => {
                        *out = Some(v);
                        *slot = None;
                    }
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(
                this.out
                    .iter_mut()
                    .map(|o| o.take().expect("finished"))
                    .collect(),
            )
        }
    }
}

fn join_all<F: Future>(futs: impl IntoIterator<Item = F>) -> JoinAll<F> {
    let futs: Vec<_> = futs.into_iter().map(|f| Some(Box::pin(f))).collect();
    let out = futs.iter().map(|_| None).collect();
    JoinAll { futs, out }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = format!("/var/tmp/aios-async-{}.img", std::process::id());
    std::fs::File::create(&path)?.set_len(8 << 20)?;
    let engine = Engine::new(EngineConfig::default())?;
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default())?;
    let dev = Device::open(
        &lbio,
        path.as_ref(),
        DeviceConfig {
            write: true,
            route: aios::lbio::RouteChoice::Ring,
            ..DeviceConfig::default()
        },
    )?;

    let result: Result<(), LbioError> = engine.block_on(async {
        // Eight 4 KiB blocks written concurrently, each stamped with its index.
        let writes = (0..8u8).map(|i| {
            let mut b = engine.try_alloc(4096).expect("arena room");
            b.fill(i);
            dev.write_at(i as u64 * 4096, b, false)
        });
        for r in join_all(writes).await {
            r?;
        }
        dev.flush().await?;
        // And read back concurrently.
        let reads = (0..8u64).map(|i| dev.read_at(i * 4096, engine.try_alloc(4096).expect("room")));
        for (i, r) in join_all(reads).await.into_iter().enumerate() {
            let b: FixedBuf = r?.expect("reads return their buffer");
            assert!(
                b.iter().all(|&x| x == i as u8),
                "block {i} reads back its stamp"
            );
        }
        Ok(())
    })?;
    result?;
    let m = engine.metrics();
    println!(
        "8 concurrent writes + flush + 8 concurrent reads: {} SQEs in {} io_uring_enter calls",
        m.sqes, m.enters
    );
    drop(dev);
    std::fs::remove_file(&path)?;
    Ok(())
}
