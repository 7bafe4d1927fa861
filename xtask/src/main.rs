//! `cargo xtask`: project automation. Today one task: `cargo xtask lab`, the VM lab (see README.md).

mod artifacts;
mod cpio;
mod initramfs;
mod kernel;
mod lab;
mod ldd;
mod plan;
mod qemu;
mod results;

use std::process::{Command, ExitCode, Stdio};

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "Project automation for aios")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Boot Debian's kernel under QEMU (TCG) with an emulated NVMe drive and null_blk, and run
    /// project binaries in the guest. Without --step/--only, runs the default plan.
    Lab(lab::Args),
}

fn main() -> ExitCode {
    match Cli::parse().cmd {
        Cmd::Lab(args) => lab::main(args),
    }
}

/// A progress line on stderr.
pub fn say(line: &str) {
    eprintln!("{line}");
}

/// Runs `cmd` with its output on our stderr; an error names `what` and the exit status.
pub fn run_checked(cmd: &mut Command, what: &str) -> Result<(), String> {
    let status = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::from(std::io::stderr()))
        .stderr(Stdio::inherit())
        .status()
        .map_err(|e| format!("cannot run {what}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{what} failed ({status})"))
    }
}
