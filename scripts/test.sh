#!/usr/bin/env bash
# The whole test suite: installs what it needs (fio), then format, lint, tests, benches compiled.
# Usage: scripts/test.sh        (as root on Debian/Ubuntu for the package install and loop devices)
set -euo pipefail
cd "$(dirname "$0")/.."

# Each step is stamped with the time since the start, so a slow step shows in CI's log.
t_start=$(date +%s)
stamp() { local s=$(( $(date +%s) - t_start )); printf '%02d:%02d' $(( s / 60 )) $(( s % 60 )); }
step() { printf '\n==> [%s] %s\n' "$(stamp)" "$*"; }

# fio (the benchmark anchor); the RDMA transport's build needs (libibverbs, librdmacm, clang for
# rdma-sys' bindings) and what the lab guest gets from the host (iproute2's ip and rdma, the
# Soft-RoCE provider).
need=()
command -v fio >/dev/null 2>&1 || need+=(fio)
for p in libibverbs-dev librdmacm-dev libclang-dev ibverbs-providers iproute2 postmark; do
    dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        step "installing ${need[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    else
        echo "WARNING: ${need[*]} missing and not installable here (need root + apt-get);" \
             "the fio comparisons are skipped and the rdma feature will not build" >&2
    fi
fi

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy --all-targets -D warnings (without and with the rdma feature)"
cargo clippy --workspace --all-targets -- -D warnings
cargo clippy --workspace --all-targets --features rdma -- -D warnings

step "cargo doc --no-deps, warnings denied (broken or ambiguous intra-doc links)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet

# aiosfs takes FUSE over io_uring when the kernel offers it; the fuse module keeps it off until
# its enable_uring parameter is set. The mount tests then run both transports.
if [ "$(id -u)" = 0 ] && [ -e /dev/fuse ]; then
    modprobe fuse 2>/dev/null || true
    if [ -w /sys/module/fuse/parameters/enable_uring ]; then
        step "enabling FUSE over io_uring (echo 1 > /sys/module/fuse/parameters/enable_uring)"
        echo 1 > /sys/module/fuse/parameters/enable_uring
    fi
fi
step "cargo test (unit, integration, property, doc tests)"
log=$(mktemp)
cargo test --workspace 2>&1 | tee "$log"
totals=$(grep -E '^test result:' "$log" |
    sed -E 's/.* ([0-9]+) passed; ([0-9]+) failed; ([0-9]+) ignored.*/\1 \2 \3/' |
    awk '{p+=$1; f+=$2; i+=$3} END {print p, f, i}')
rm -f "$log"
read -r passed failed ignored <<<"$totals"

step "examples run"
for ex in blocking async_engine tokio_driver ordered_log striped_volume kv_journal; do
    cargo run -q --example "$ex"
done

step "release build, and one short lbio vs fio comparison on the ull device"
# With the RDMA transport: the lab below builds exactly this binary for its guest, so one
# release build of the dependency tree serves both (without the feature, the lab rebuilt it).
cargo build --release -q --bin aios --features rdma
if [ "$(id -u)" = 0 ] && command -v fio >/dev/null 2>&1; then
    ./target/release/aios bench lbio --device ull --seconds 1 --rounds 1 --vs-fio
else
    echo "SKIPPED: the ull comparison needs root (loop device) and fio" >&2
fi
step "per-core scaling, briefly (aios bench scale: mem, and a ull device per thread beside fio)"
./target/release/aios bench scale --device mem --size 64m --threads 1,2 --seconds 0.3 --rounds 1
if [ "$(id -u)" = 0 ] && command -v fio >/dev/null 2>&1; then
    ./target/release/aios bench scale --device ull --size 64m --threads 1,2 --seconds 0.3 \
        --rounds 2 --vs-fio --plot target/bench-report/scale.png
else
    echo "SKIPPED: the ull scaling run needs root (loop devices) and fio" >&2
fi
step "one short page-cache comparison on the ull device (aios bench pagecache)"
if [ "$(id -u)" = 0 ]; then
    ./target/release/aios bench pagecache --device ull --seconds 0.3 --rounds 1 \
        --out target/bench-report
else
    echo "SKIPPED: the ull device is a loop device: it needs root" >&2
fi
step "one short fsync comparison on the ull device (aios bench fsync: vanilla, overlapped, one-write, ext4, ext4-meta)"
if [ "$(id -u)" = 0 ] && command -v mkfs.ext4 >/dev/null 2>&1; then
    ./target/release/aios bench fsync --device ull --seconds 0.3 --rounds 1 --threads 1,2 \
        --out target/bench-report
    ./target/release/aios bench fsync --device ull --seconds 0.3 --rounds 1 --threads 2 --areas 1 \
        --modes overlapped --json --out target/bench-report
else
    echo "SKIPPED: the fsync comparison needs root (loop devices, mount) and e2fsprogs" >&2
fi
step "one short ordered-write comparison (aios bench ordered: rio, sync, orderless; ull and sim)"
if [ "$(id -u)" = 0 ]; then
    ./target/release/aios bench ordered --device ull --streams 1,2 --seconds 0.3 --rounds 1 \
        --log pmr,block
fi
./target/release/aios bench ordered --device sim --streams 1 --rounds 1 --sim-writes 3000 \
    --batch 1,32 --seq
step "ordered writes over NVMe/TCP: two aios targets in network namespaces (rio-net)"
if [ "$(id -u)" = 0 ] && command -v ip >/dev/null 2>&1; then
    ./target/release/aios bench ordered --targets netns:2 --seconds 1 --rounds 3 --qd 32
else
    echo "SKIPPED: network namespaces need root and iproute2" >&2
fi
step "crash states explored: the journal's SimDisk crash simulation and Rio's recovery model (each at least 100,000)"
# The workspace run above already passed them; run again without capture to print the counts.
cargo test -q -p journal --test crash_sim crashes_at_random_points -- --nocapture 2>&1 \
    | grep -E 'crash states|test result|panicked|FAILED'
cargo test -q -p rio-ordering --test crash_model -- --nocapture 2>&1 \
    | grep -E 'crash states|test result|panicked|FAILED'
step "aiosfs under power cuts on a SimDisk: 10,000 crash states (the test build above, debug assertions on)"
AIOS_FS_SIM_CUTS=400 cargo test -q -p fs-fuse --test crash_sim -- --nocapture 2>&1 | grep -E 'crash states|test result|panicked|FAILED'
step "aiosfs through FUSE over io_uring: pjdfstest, fsx (100,000 operations), fio --verify=crc32c, fsck"
if [ "$(id -u)" = 0 ] && [ -e /dev/fuse ]; then
    if [ -f /sys/module/fuse/parameters/enable_uring ]; then
        TRANSPORT=uring scripts/fs_suite.sh target/release/aios
    else
        echo "SKIPPED the io_uring pass: this kernel's fuse has no enable_uring (before 6.14)" >&2
    fi
    step "aiosfs through FUSE over /dev/fuse: pjdfstest, fsx (20,000 operations), fio --verify=crc32c, fsck"
    TRANSPORT=classic FSX_OPS=20000 scripts/fs_suite.sh target/release/aios
else
    echo "SKIPPED: mounting through FUSE needs root and /dev/fuse" >&2
fi
step "aiosfs beside ext4 on ull devices (aios bench fs: random read QD1, write + fsync, create + fsync, postmark)"
if [ "$(id -u)" = 0 ] && [ -e /dev/fuse ] && command -v mkfs.ext4 >/dev/null 2>&1; then
    ./target/release/aios bench fs --seconds 1 --rounds 1 --threads 1,2
else
    echo "SKIPPED: aios bench fs needs root (loop devices, mount), /dev/fuse and e2fsprogs" >&2
fi
step "the QEMU lab: NVMe passthrough, IOPOLL and null_blk in a guest (cargo xtask lab)"
# Installs qemu and busybox-static if missing, fetches the guest kernel once (cached under
# target/lab/), builds the guest's binaries, boots, runs tests/nvme_lab.rs and the probes and
# benches inside, then tests/pmr_lab.rs across two power cuts (three boots on one disk image and
# PMR file). Fails loudly if this machine cannot run QEMU.
lab_t0=$(date +%s)
cargo xtask lab
lab_s=$(( $(date +%s) - lab_t0 ))
lab_steps=$(python3 -c 'import json; d=json.load(open("target/lab/run/summary.json")); print(sum(1 for s in d["steps"] if s.get("result","").startswith("ok")))' 2>/dev/null || echo "?")
step "rio-net over RDMA between two network namespaces (Soft-RoCE; Debian's 7.x kernel from trixie-backports)"
# 6.12's rxe routes only through the initial namespace, so this step boots a newer kernel.
AIOS_LAB_KERNEL_SUITE=trixie-backports cargo xtask lab --only rdma-netns
echo
echo "all checks passed in $(stamp) (minutes:seconds)"
echo "tests: $passed passed, $failed failed, $ignored skipped on the host (the NVMe ones run in the lab)"
echo "lab: $lab_steps guest steps ok in ${lab_s} s, then rdma-netns on the 7.x kernel"

