#!/usr/bin/env bash
# Inventory of a machine's storage and CPUs, then the release binary's benches at several thread
# counts: what a many-core machine says that a 2-vCPU one cannot.
#
#   scripts/scaling.sh [OUT_DIR]        (root; `aios` and `fio` on PATH, or AIOS=path/to/aios)
#
# Environment:
#   AIOS       the binary (default: `aios` on PATH, else target/release/aios)
#   THREADS    thread counts for the page-cache hit and fsync runs (default: 1,2,4,8,<nproc>)
#   ROUNDS     alternating rounds per bench (default 3)
#   SECONDS_   seconds per round (default 1)
#   BUDGET_S   stop starting new benches once this many seconds have passed (default 360)
#   BENCHES    which benches, by name, separated by spaces (default: all of them, in the order
#              below: scale-mem scale-ull lbio-qd1 lbio-qd32 pagecache-hits fsync fsync-group
#              ordered ordered-net)
#
# Every bench writes its table to OUT_DIR/log and its JSON lines to OUT_DIR/<name>.json. A bench
# that fails is reported and the script goes on to the next one; the exit status is the number
# of benches that failed.
set -u
out=${1:-./aios-report/scaling}
mkdir -p "$out"
log="$out/log"
: >"$log"
aios=${AIOS:-$(command -v aios || echo target/release/aios)}
ncpu=$(nproc)
threads=${THREADS:-}
if [ -z "$threads" ]; then
    threads=1
    for t in 2 4 8 16 32 64; do
        [ "$t" -le "$ncpu" ] && threads="$threads,$t"
    done
    case ",$threads," in *",$ncpu,"*) ;; *) threads="$threads,$ncpu" ;; esac
fi
rounds=${ROUNDS:-3}
secs=${SECONDS_:-1}
budget=${BUDGET_S:-360}
start=$(date +%s)
failed=0

say() { echo "== $*" | tee -a "$log"; }
sh_() { echo "\$ $*" >>"$log"; "$@" >>"$log" 2>&1; }

say "inventory ($(date -u +%FT%TZ))"
sh_ uname -a
sh_ nproc
sh_ sh -c "lscpu | grep -E 'Model name|^CPU\(s\)|Thread|Core|Socket|NUMA node\(s\)|L2|L3|Hypervisor'"
sh_ free -g
sh_ sh -c 'cat /sys/devices/system/cpu/cpuidle/current_driver /sys/devices/system/cpu/cpuidle/current_governor 2>&1'
sh_ lsblk -o NAME,SIZE,ROTA,TYPE,TRAN,MODEL,MOUNTPOINT
sh_ sh -c 'ls -l /dev/nvme* /dev/ng* 2>&1'
sh_ sh -c 'for d in /sys/block/*; do n=${d##*/}; case $n in loop*|ram*|zram*) continue;; esac; echo "$n: $(cat $d/queue/logical_block_size) B, max_sectors_kb $(cat $d/queue/max_sectors_kb), rotational $(cat $d/queue/rotational), nr_requests $(cat $d/queue/nr_requests), $(readlink -f $d/device 2>/dev/null)"; done'
sh_ sh -c 'modprobe loop 2>&1; ls -l /dev/loop-control 2>&1; grep -E "^(loop|nvme|fuse|tmpfs)" /proc/modules 2>&1; grep -wE "fuse|tmpfs|ext4" /proc/filesystems'
sh_ sh -c 'df -h / /dev/shm /tmp; ls -l /dev/kvm /dev/fuse 2>&1'
sh_ sh -c 'for t in fio mkfs.ext4 losetup; do printf "%s: " $t; command -v $t || echo missing; done; fio --version'
sh_ "$aios" --version

# The root file system's device, probed (read-only) like any device a user would hand the bench.
rootdev=$(findmnt -n -o SOURCE / 2>/dev/null)
case "$rootdev" in /dev/*) sh_ "$aios" probe "$rootdev" ;; esac
for n in /dev/nvme*n1; do [ -b "$n" ] && sh_ "$aios" probe "$n"; done

benches=${BENCHES:-scale-mem scale-ull lbio-qd1 lbio-qd32 pagecache-hits fsync fsync-group ordered ordered-net}

bench() {
    local name=$1
    shift
    case " $benches " in *" $name "*) ;; *) return ;; esac
    local now=$(($(date +%s) - start))
    if [ "$now" -ge "$budget" ]; then
        say "$name: skipped, ${now} s of the ${budget} s budget used"
        return
    fi
    say "$name: aios $* (at ${now} s)"
    local t0=$(date +%s)
    "$aios" "$@" --json >"$out/$name.json" 2>>"$log"
    local rc=$?
    if [ "$rc" -eq 0 ]; then
        say "$name: done in $(($(date +%s) - t0)) s"
    else
        failed=$((failed + 1))
        say "$name: FAILED (exit $rc) after $(($(date +%s) - t0)) s"
    fi
}

bench scale-mem bench scale --device mem --size 64m --threads "$threads" --rounds "$rounds" --seconds "$secs"
bench scale-ull bench scale --device ull --size 256m --threads "$threads" --vs-fio --rounds "$rounds" --seconds "$secs" --plot "$out/scale-ull.png"
bench lbio-qd1 bench lbio --device ull --rw randread --qd 1 --vs-fio --rounds "$rounds" --seconds "$secs"
bench lbio-qd32 bench lbio --device ull --rw randread --qd 32 --vs-fio --rounds "$rounds" --seconds "$secs"
bench pagecache-hits bench pagecache --modes aios --hot 1m,32m --threads "$threads" --rounds 1 --seconds "$secs"
bench fsync bench fsync --modes overlapped,ext4 --threads "$threads" --rounds "$rounds" --seconds "$secs"
bench fsync-group bench fsync --modes overlapped --threads "$threads" --areas 1 --rounds "$rounds" --seconds "$secs"
bench ordered bench ordered --streams "$threads" --rounds "$rounds" --seconds "$secs"
bench ordered-net bench ordered --targets netns:2 --streams 1,4 --rounds 1 --seconds "$secs"

say "finished in $(($(date +%s) - start)) s, $failed bench(es) failed"
exit "$failed"
