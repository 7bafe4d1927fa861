#!/usr/bin/env python3
"""Model-checked storm of file operations, for several processes at once on one mount.

usage: storm.py ROOT ID OPS SEED           run OPS random operations, then save the model
       storm.py ROOT ID 0 0 verify         check the saved model (after a remount)

Each process owns the names p<ID>_* in four directories it shares with the others: it creates
files (some fsynced), overwrites ranges (some fdatasynced), truncates, renames across the
directories, unlinks, hard-links and fsyncs read-only descriptors. It keeps a model of every
name and every inode's bytes, checks a random file after some operations and everything every
500, compares link counts, and fails (exit 1, with the path and the first differing byte) on
any difference or on a name of its own it did not make. The model goes to model-ID.json in
$STORM_STATE_DIR (default ROOT) at the end, so that a later run with `verify` checks the same
files after an unmount, fsck and mount.
"""
import os, random, sys, json
root, pid, ops, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
verify_only = len(sys.argv) > 5
rng = random.Random(seed)
dirs = [os.path.join(root, f"d{i}") for i in range(4)]
for d in dirs:
    os.makedirs(d, exist_ok=True)
state = os.path.join(os.environ.get("STORM_STATE_DIR", root), f"model-{pid}.json")
paths, data = {}, {}   # path -> key; key -> bytes
if verify_only:
    s = json.load(open(state)); paths = s["paths"]; data = {int(k): bytes.fromhex(v) for k, v in s["data"].items()}
def check(path):
    with open(path, "rb") as f:
        got = f.read()
    want = data[paths[path]]
    if got != want:
        i = next((i for i in range(min(len(got), len(want))) if got[i] != want[i]), min(len(got), len(want)))
        print(f"MISMATCH p{pid} {path}: len {len(got)} want {len(want)}, first diff at {i}", flush=True)
        sys.exit(1)
    nl = sum(1 for k in paths.values() if k == paths[path])
    if os.stat(path).st_nlink != nl:
        print(f"NLINK p{pid} {path}: {os.stat(path).st_nlink} want {nl}", flush=True); sys.exit(1)
def verify_all():
    for p in list(paths):
        check(p)
    for d in dirs:
        for n in os.listdir(d):
            if n.startswith(f"p{pid}_") and os.path.join(d, n) not in paths:
                print(f"EXTRA p{pid} {d}/{n}", flush=True); sys.exit(1)
if verify_only:
    verify_all(); print(f"p{pid}: {len(paths)} names verified after remount"); sys.exit(0)
n = 0
def newname():
    global n
    n += 1
    return os.path.join(rng.choice(dirs), f"p{pid}_{n}")
for i in range(ops):
    r = rng.random()
    files = list(paths)
    if r < 0.25 or not files:
        p = newname(); b = rng.randbytes(rng.choice([0, 100, 4096, 5000, 20000, 70000]))
        with open(p, "wb") as f:
            f.write(b)
            if rng.random() < 0.3: os.fsync(f.fileno())
        n += 1; paths[p] = n; data[n] = b
    elif r < 0.45:
        p = rng.choice(files); k = paths[p]; cur = data[k]
        off = rng.randrange(0, len(cur) + 8192); b = rng.randbytes(rng.choice([1, 512, 4096, 9000]))
        with open(p, "r+b") as f:
            f.seek(off); f.write(b)
            if rng.random() < 0.3: os.fdatasync(f.fileno())
        if off > len(cur): cur = cur + bytes(off - len(cur))
        data[k] = cur[:off] + b + cur[off + len(b):]
    elif r < 0.55:
        p = rng.choice(files); k = paths[p]; sz = rng.randrange(0, len(data[k]) + 10000)
        os.truncate(p, sz); cur = data[k]
        data[k] = cur[:sz] + bytes(max(0, sz - len(cur)))
    elif r < 0.67:
        p = rng.choice(files); q = newname(); os.rename(p, q); paths[q] = paths.pop(p)
    elif r < 0.77:
        p = rng.choice(files); os.unlink(p); k = paths.pop(p)
        if k not in paths.values(): del data[k]
    elif r < 0.82:
        p = rng.choice(files); q = newname(); os.link(p, q); paths[q] = paths[p]
    elif r < 0.9:
        check(rng.choice(files))
    else:
        p = rng.choice(files)
        fd = os.open(p, os.O_RDONLY); os.fsync(fd); os.close(fd)
    if i % 500 == 0:
        verify_all()
verify_all()
json.dump({"paths": paths, "data": {k: v.hex() for k, v in data.items()}}, open(state, "w"))
print(f"p{pid}: {ops} ops, {len(paths)} names, verified")
