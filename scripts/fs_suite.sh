#!/usr/bin/env bash
# aiosfs through FUSE against the standard suites: pjdfstest (the Rust port), fsx (100,000
# operations by default) and fio with --verify=crc32c, on a fresh image; then three
# model-checked storms (tests/fs/storm.py) and two fsx at once; aios fsck; a second mount
# that checks the storms' files; aios fsck again; extended attributes with --no-xattrs and
# after it.
# Installs pjdfstest and fsx with `cargo install` and creates pjdfstest's dummy user `tests`
# when missing. Needs root and /dev/fuse.
# Usage: scripts/fs_suite.sh [AIOS_BINARY]     (FSX_OPS=N to change the fsx length,
#        TRANSPORT=uring|classic|auto for how the mount gets FUSE requests, default auto;
#        MOUNT_ARGS="--writeback-cache ..." for more `aios mount` options, STORM_OPS=N per
#        storm (default 8000), STORM_SEED=N to replay the storms)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
aios=${1:-target/release/aios}
fsx_ops=${FSX_OPS:-100000}
transport=${TRANSPORT:-auto}

for tool in pjdfstest fsx; do
    command -v "$tool" >/dev/null 2>&1 || cargo install -q --locked "$tool"
done
id tests >/dev/null 2>&1 || echo 'tests:x:::Dummy user for pjdfstest:/:/usr/sbin/nologin' | newusers

work=$(mktemp -d /var/tmp/aios-fs-suite.XXXXXX)
chmod 755 "$work"       # pjdfstest switches to other users, who must reach the mount
mnt="$work/mnt"
second="$work/second"          # another file system, for the cross-device (EXDEV) tests
mkdir -p "$mnt" "$second"
mount -t tmpfs -o size=64m tmpfs "$second"
pid=""
cleanup() {
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
    mountpoint -q "$mnt" && umount -l "$mnt" || true
    mountpoint -q "$second" && umount "$second" || true
    rm -rf "$work"
}
trap cleanup EXIT

"$aios" mkfs "$work/fs.img" --size 1g
# shellcheck disable=SC2086 # MOUNT_ARGS is a list of words
# Mount the image with its log in $1; stop it with SIGTERM and wait for the process to end.
mount_fs() {
    "$aios" mount "$work/fs.img" "$mnt" --log "$1" --transport "$transport" ${MOUNT_ARGS:-}
    pid=$(pgrep -f -n "aios mount $work/fs.img") || { echo "no file system process" >&2; exit 1; }
}
stop_fs() {
    kill -TERM "$pid"
    for _ in $(seq 600); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then echo "the file system did not stop" >&2; exit 1; fi
    pid=""
}
mount_fs "$work/mount.log"
grep -E '^aiosfs: requests over' "$work/mount.log" || true

echo "--- pjdfstest"
mkdir "$mnt/pjd"
t0=$(date +%s)
(cd "$mnt/pjd" && pjdfstest -c "$root/tests/fs/pjdfstest.toml" -p "$mnt/pjd" -s "$second" \
    > "$work/pjd.log" 2>&1) || true
cfg_ok=1
grep -q '^Summary:' "$work/pjd.log" || cfg_ok=0
if [ "$cfg_ok" = 0 ]; then cat "$work/pjd.log"; echo "pjdfstest did not finish" >&2; exit 1; fi
summary=$(grep '^Summary:' "$work/pjd.log")
failed=$(sed -E 's/.* ([0-9]+) failed.*/\1/' <<<"$summary")
passed=$(sed -E 's/.* ([0-9]+) passed.*/\1/' <<<"$summary")
skipped=$(sed -E 's/.* ([0-9]+) skipped.*/\1/' <<<"$summary")
echo "$summary ($(( $(date +%s) - t0 )) s)"
if [ "$failed" != 0 ]; then
    echo "failing tests, with their reasons:"
    grep -A3 -E 'FAILED$|failed$' "$work/pjd.log" || true
fi
echo "skipped (not applicable here):"
grep -A1 -E 'skipped$' "$work/pjd.log" | grep -v '^--' | paste - - | sed -E 's/[[:space:]]+/ /g' \
    | sed -E 's/^([^ ]+) skipped /  \1: /' | sort
rate=$(python3 -c "print(f'{100*$passed/($passed+$failed):.1f}')")
echo "pjdfstest pass rate: $passed of $((passed + failed)) tests that ran = $rate % (target 95 %)"
python3 -c "import sys; sys.exit(0 if $passed >= 0.95*($passed+$failed) else 1)"

echo "--- fsx, $fsx_ops operations"
t0=$(date +%s)
(cd "$mnt" && fsx -N "$fsx_ops" -S 1 -P "$work" "$mnt/fsx.dat" > "$work/fsx.log" 2>&1) || {
    tail -40 "$work/fsx.log"; echo "fsx failed" >&2; exit 1; }
echo "fsx: $(tail -1 "$work/fsx.log") ($(( $(date +%s) - t0 )) s)"

echo "--- fio --verify=crc32c through the mount"
fio --name=buffered --directory="$mnt" --rw=randwrite --bs=4k --size=64m --numjobs=2 \
    --ioengine=psync --verify=crc32c --verify_state_save=0 --fsync=16 --output="$work/fio1.log"
fio --name=direct --directory="$mnt" --rw=randrw --bs=16k --size=32m --direct=1 \
    --ioengine=libaio --iodepth=8 --verify=crc32c --verify_state_save=0 --output="$work/fio2.log"
for f in "$work/fio1.log" "$work/fio2.log"; do
    if grep -qE 'err= *[1-9]|verify: bad|crc32c: verify failed' "$f"; then
        cat "$f"; echo "fio verify failed" >&2; exit 1
    fi
done
echo "fio: buffered 4 KiB random writes (2 jobs, fsync every 16) and O_DIRECT 16 KiB random read/write at QD8, verified with crc32c: no errors"

echo "--- at once: three model-checked storms of file operations, two fsx"
# Several processes on one mount, as the suites above never are: tests/fs/storm.py creates,
# overwrites, truncates, renames, links, unlinks and fsyncs in directories the storms share,
# checking every byte against its model; the models are checked again after a remount below.
seed=${STORM_SEED:-$RANDOM}
storm_ops=${STORM_OPS:-8000}
echo "seed $seed (STORM_SEED=$seed replays the storms' choices), $storm_ops operations per storm"
t0=$(date +%s)
mkdir "$mnt/storm"
pids=()
for i in 1 2 3; do
    STORM_STATE_DIR="$work" python3 "$root/tests/fs/storm.py" "$mnt/storm" "$i" "$storm_ops" \
        $((seed * 10 + i)) > "$work/storm$i.log" 2>&1 &
    pids+=($!)
done
for i in 1 2; do
    (cd "$mnt" && fsx -N $((fsx_ops / 4)) -S $((seed + i)) -P "$work" "$mnt/cfsx$i.dat" \
        > "$work/cfsx$i.log" 2>&1) &
    pids+=($!)
done
failed=0
for p in "${pids[@]}"; do wait "$p" || failed=1; done
if [ "$failed" = 1 ]; then
    tail -n 20 "$work"/storm*.log "$work"/cfsx*.log
    echo "the concurrent stage failed" >&2; exit 1
fi
echo "storms: $(cat "$work"/storm*.log | tr '\n' ' ')"
echo "fsx twice at once, $((fsx_ops / 4)) operations each: A-OK ($(( $(date +%s) - t0 )) s)"

echo "--- unmount (SIGTERM) and fsck"
stop_fs
grep -E '^aiosfs: ([0-9]+ requests served|unmounted)' "$work/mount.log"
if [ "$transport" = uring ] && ! grep -q 'requests served over io_uring' "$work/mount.log"; then
    echo "--transport uring, but no request was served over io_uring" >&2; exit 1
fi
"$aios" fsck "$work/fs.img"

echo "--- mount again: the storms' files as their models say"
mount_fs "$work/mount2.log"
for i in 1 2 3; do
    STORM_STATE_DIR="$work" python3 "$root/tests/fs/storm.py" "$mnt/storm" "$i" 0 0 verify
done
stop_fs
"$aios" fsck "$work/fs.img"

echo "--- --no-xattrs: programs get EOPNOTSUPP, files work, stored attributes come back after"
mount_fs "$work/mount3.log"
echo data > "$mnt/x"
python3 -c 'import os, sys; os.setxattr(sys.argv[1], "user.k", b"kept")' "$mnt/x"
stop_fs
MOUNT_ARGS="${MOUNT_ARGS:-} --no-xattrs" mount_fs "$work/mount4.log"
# The background process writes its "mounted" line just after the mount is up: wait for it.
for _ in $(seq 100); do grep -q 'extended attributes off' "$work/mount4.log" && break; sleep 0.1; done
grep -q 'extended attributes off' "$work/mount4.log" || { cat "$work/mount4.log"; echo "no word of --no-xattrs in the log" >&2; exit 1; }
python3 - "$mnt" <<'PY'
import errno, os, sys
m = sys.argv[1]
for what, f in [("getxattr", lambda: os.getxattr(f"{m}/x", "user.k")),
                ("setxattr", lambda: os.setxattr(f"{m}/x", "user.j", b"v")),
                ("listxattr", lambda: os.listxattr(f"{m}/x")),
                ("removexattr", lambda: os.removexattr(f"{m}/x", "user.k"))]:
    try:
        f()
    except OSError as e:
        assert e.errno == errno.EOPNOTSUPP, f"{what}: {e}"
    else:
        raise SystemExit(f"{what} succeeded on a mount without xattrs")
with open(f"{m}/y", "w") as w:
    w.write("written with xattrs off\n")
    w.flush(); os.fsync(w.fileno())
assert open(f"{m}/y").read() == "written with xattrs off\n"
assert open(f"{m}/x").read() == "data\n"
PY
stop_fs
mount_fs "$work/mount5.log"
python3 - "$mnt" <<'PY'
import os, sys
m = sys.argv[1]
assert os.getxattr(f"{m}/x", "user.k") == b"kept", "user.k lost"
assert os.listxattr(f"{m}/x") == ["user.k"], os.listxattr(f"{m}/x")
assert os.listxattr(f"{m}/y") == [], os.listxattr(f"{m}/y")
PY
stop_fs
"$aios" fsck "$work/fs.img"
echo "xattrs: EOPNOTSUPP for all four calls with --no-xattrs; user.k kept for the next mount"
