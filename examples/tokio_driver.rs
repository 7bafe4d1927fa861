//! Driving an engine from a tokio application: the ring's eventfd under `AsyncFd` tells a local
//! task when to reap completions; lbio futures are awaited like any other.
//!
//! The engine is per-thread (`!Send`), so it lives on a current-thread runtime inside a
//! `LocalSet`; other threads reach it through a channel, not a lock.
//!
//! ```text
//! cargo run --example tokio_driver
//! ```

use std::os::fd::{AsRawFd, RawFd};
use std::rc::Rc;

use aios::core::{Engine, EngineConfig};
use aios::lbio::{Device, DeviceConfig, LbioArray, LbioConfig, RouteChoice};
use tokio::io::unix::AsyncFd;

struct EventFd(RawFd);
impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async {
        let engine = Engine::new(EngineConfig {
            eventfd: true,
            ..EngineConfig::default()
        })?;
        let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default())?;
        let path = format!("/var/tmp/aios-tokio-{}.img", std::process::id());
        std::fs::File::create(&path)?.set_len(4 << 20)?;
        let dev = Device::open(
            &lbio,
            path.as_ref(),
            DeviceConfig {
                write: true,
                route: RouteChoice::Ring,
                ..DeviceConfig::default()
            },
        )?;

        // The driver: whenever the kernel signals the eventfd, dispatch completions (which
        // wakes the lbio futures through tokio's wakers).
        // `AsyncFd::new` is deprecated for descriptors it cannot prove alive; this one belongs to
        // the engine, which outlives the driver task (it is aborted before the engine drops).
        #[allow(deprecated)]
        let fd = AsyncFd::new(EventFd(engine.eventfd().expect("configured")))?;
        let driver_engine = Rc::clone(&engine);
        let driver = tokio::task::spawn_local(async move {
            loop {
                let mut ready = fd.readable().await?;
                driver_engine.drain_eventfd();
                ready.clear_ready();
                driver_engine.poll_completions()?;
            }
            #[allow(unreachable_code)]
            Ok::<(), Box<dyn std::error::Error>>(())
        });

        let mut buf = engine.try_alloc(4096).expect("arena room");
        buf.fill(0x42);
        dev.write_at(0, buf, true).await?;
        let back = dev
            .read_at(0, engine.try_alloc(4096).expect("room"))
            .await?;
        let back = back.expect("reads return their buffer");
        assert!(back.iter().all(|&b| b == 0x42));
        println!("tokio: wrote and read back 4 KiB through lbio futures woken via the eventfd");

        driver.abort();
        drop(dev);
        std::fs::remove_file(&path)?;
        Ok::<(), Box<dyn std::error::Error>>(())
    })
}
