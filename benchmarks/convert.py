"""Converter throughput and memory vs a plain read of the same files, in one run.

    python benchmarks/convert.py [--layers 24] [--experts 128] [--dir /tmp/k31jax-bench-convert] [--repeats 3] [--record]

Writes a synthetic K3-shaped release (`k31jax.ckpt.synthetic_config`: MXFP4
experts dominate the bytes as in the release; the defaults give 3.07 GB in 25 shards,
133 MB per layer), then measures, each in a fresh process and each from a cold page cache
for the source files (`posix_fadvise(DONTNEED)` on our own files; nothing machine-wide)
and again warm:

- plain read: `cat SHARDS > /dev/null` (a 16 MiB-chunk Python loop where `cat` is missing);
- plain copy: the same bytes read and written to new files, fsynced (the `cp` floor: a
  conversion has to write every byte too);
- convert: `k31jax.convert(SRC, DST)` with its defaults (durable: files fsynced before the
  final rename), throughput = source bytes / wall time, and its peak RSS (VmHWM: ru_maxrss would include the parent's peak, carried across exec);
- export: the converted checkpoint back to the release layout.

The memory bound checked: peak RSS < 1.5 GB + the largest single layer. Method
(`benchmarks/_harness.py`): the sides alternate, one warm-up each, then --repeats rounds;
median [min, max]; `--record` writes RESULTS.md only on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PLAIN_READ = """
import os, sys, time
files = sys.argv[1:]
buf = bytearray(16 << 20)
t = time.perf_counter(); n = 0
for f in files:
    with open(f, "rb", buffering=0) as fh:
        while True:
            k = fh.readinto(buf)
            if not k:
                break
            n += k
dt = time.perf_counter() - t
print(f'{{"bytes": {n}, "seconds": {dt}, "rss": {next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM:'))}}}')
"""

PLAIN_COPY = """
import os, sys, time
dst = sys.argv[1]
os.makedirs(dst, exist_ok=True)
buf = bytearray(16 << 20)
t = time.perf_counter(); n = 0
for f in sys.argv[2:]:
    with open(f, "rb", buffering=0) as fh, open(os.path.join(dst, os.path.basename(f)), "wb", buffering=0) as out:
        while True:
            k = fh.readinto(buf)
            if not k:
                break
            out.write(memoryview(buf)[:k])
            n += k
        os.fsync(out.fileno())
dt = time.perf_counter() - t
print(f'{{"bytes": {n}, "seconds": {dt}, "rss": {next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM:'))}}}')
"""

CONVERT = """
import json, sys, time
t0 = time.perf_counter()
from k31jax import convert
t = time.perf_counter()
kw = {"chunk_byte_size": int(sys.argv[3])} if len(sys.argv) > 3 else {}
r = convert(sys.argv[1], sys.argv[2], progress=False, **kw)
dt = time.perf_counter() - t
print(json.dumps({"bytes": r.source_bytes, "seconds": dt, "import_seconds": t - t0,
                  "rss": next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))}))
"""

EXPORT = """
import json, sys, time
from k31jax import export
t = time.perf_counter()
r = export(sys.argv[1], sys.argv[2], progress=False)
print(json.dumps({"bytes": r.bytes, "seconds": time.perf_counter() - t,
                  "rss": next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))}))
"""


def plain_read(files) -> dict:
    """`cat` the shards to /dev/null (the issue's yardstick), timed around the process."""
    cat = shutil.which("cat")
    if cat is None:
        return run(PLAIN_READ, *files)
    t = time.perf_counter()
    with open(os.devnull, "wb") as null:
        subprocess.run([cat, *files], stdout=null, check=True)
    return {"bytes": sum(os.path.getsize(f) for f in files), "seconds": time.perf_counter() - t}


def evict(files) -> None:
    """Drop our own files from the page cache (no effect on anything else)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run(code: str, *args) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], capture_output=True,
                       text=True, env=env, cwd=ROOT)
    if p.returncode:
        raise RuntimeError(p.stderr[-4000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def _side(measure, *, before=None, after=None):
    """One side of `alternate`: untimed `before()`, then `measure()` -> {"MB/s", "rss GB"}."""
    def run_side():
        if before is not None:
            before()
        r = measure()
        if after is not None:
            after()
        return {"MB/s": r["bytes"] / 1e6 / r["seconds"], "rss GB": r.get("rss", 0) / 1e9}
    return run_side


def main(argv=None) -> int:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _harness import Session, add_record_arguments, alternate, report

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--dir", default="/tmp/k31jax-bench-convert")
    ap.add_argument("--repeats", type=int, default=3, help="recorded rounds, each side once per round (>= 3)")
    add_record_arguments(ap)
    ap.add_argument("--keep", action="store_true", help="keep the synthetic files")
    a = ap.parse_args(argv)

    from k31jax.ckpt import release_layout, synthetic_config, tensor_nbytes, write_synthetic_release

    session = Session()
    base = Path(a.dir)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    cfg = synthetic_config(a.layers, a.experts)
    layout = release_layout(cfg, placement="release")
    largest = max(sum(tensor_nbytes(t) for t in ts) for _, ts in layout)
    src = write_synthetic_release(base / "src", cfg, placement="release")
    files = sorted(str(f) for f in src.glob("*.safetensors"))
    total = sum(os.path.getsize(f) for f in files)

    def fresh(path):  # not timed: removing the previous run's output
        return lambda: shutil.rmtree(base / path, ignore_errors=True)

    stats = {}
    for mode in ("cold", "warm"):
        first = (lambda: evict(files)) if mode == "cold" else None

        def then(path, first=first):
            def prepare():
                fresh(path)()
                if first is not None:
                    first()
            return prepare

        sides = {"plain read": _side(lambda: plain_read(files), before=first),
                 "plain copy": _side(lambda: run(PLAIN_COPY, base / "copy", *files), before=then("copy")),
                 "convert": _side(lambda: run(CONVERT, src, base / "ckpt"), before=then("ckpt"))}
        if mode == "cold":  # every expert leaf chunked per expert, as K3's 4.9 GB expert leaves are
            sides["convert, chunked"] = _side(lambda: run(CONVERT, src, base / "ckpt_chunked", 16 << 20),
                                              before=then("ckpt_chunked"))
        stats[mode] = alternate(sides, a.repeats)
    fresh("ckpt_chunked")()
    fresh("copy")()
    export = alternate({"export": _side(lambda: run(EXPORT, base / "ckpt", base / "exported"),
                                        before=fresh("exported"))}, a.repeats)["export"]
    session.finish()
    peak = max(s["convert"]["rss GB"].high for s in stats.values()) * 1e9
    bound = 1.5e9 + largest
    lines = [f"synthetic K3-shaped release (synthetic_config({a.layers}, {a.experts})): {len(files)} shards, "
             f"{total / 1e9:.2f} GB, largest layer {largest / 1e6:.0f} MB; MXFP4 experts copied verbatim; "
             f"cold = the source files evicted from the page cache before each run; every run a fresh process; "
             f"convert includes fsync and the atomic rename; median [min, max] of {a.repeats} alternating rounds",
             f"{'page cache':>10} {'side':>17} {'MB/s':>26} {'/ plain read':>13} {'/ plain copy':>13}"]
    for mode, st in stats.items():
        read, copy = st["plain read"]["MB/s"].median, st["plain copy"]["MB/s"].median
        for name, s in st.items():
            mbs = s["MB/s"]
            lines.append(f"{mode:>10} {name:>17} {str(mbs):>26} {mbs.median / read:12.0%} {mbs.median / copy:12.0%}")
    lines.append(f"export (checkpoint -> release layout): {export['MB/s']} MB/s")
    lines.append(f"memory: convert peak RSS {peak / 1e9:.2f} GB (VmHWM) vs bound 1.5 GB + largest layer "
                 f"{largest / 1e9:.2f} GB = {bound / 1e9:.2f} GB -> {'OK' if peak < bound else 'EXCEEDED'}")
    report("convert", "convert", lines, session, a)
    if not a.keep:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
