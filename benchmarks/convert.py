"""Converter throughput and memory vs a plain read of the same files, in one run.

    python benchmarks/convert.py [--layers 24] [--experts 128] [--dir /tmp/k31jax-bench-convert] [--record]

Writes a synthetic K3-shaped release (`k31jax.conversion.synthetic_config`: MXFP4
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

The memory bound checked: peak RSS < 1.5 GB + the largest single layer. `--record` appends
the table to benchmarks/RESULTS.md under `## convert`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
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


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} CPU cores ({cpu}), {mem:.0f} GiB RAM, {platform.system()} {platform.release()}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--dir", default="/tmp/k31jax-bench-convert")
    ap.add_argument("--repeats", type=int, default=3, help="cold runs of each measurement (the best is kept)")
    ap.add_argument("--record", action="store_true", help="append the results to benchmarks/RESULTS.md")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic files")
    a = ap.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    from k31jax.ckpt._release_layout import tensor_nbytes, release_layout
    from k31jax.conversion._synthetic import synthetic_config, write_synthetic_release

    base = Path(a.dir)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    cfg = synthetic_config(a.layers, a.experts)
    layout = release_layout(cfg, placement="release")
    largest = max(sum(tensor_nbytes(t) for t in ts) for _, ts in layout)
    t = time.perf_counter()
    src = write_synthetic_release(base / "src", cfg, placement="release")
    gen = time.perf_counter() - t
    files = sorted(str(f) for f in src.glob("*.safetensors"))
    total = sum(os.path.getsize(f) for f in files)
    print(f"synthetic release: {len(files)} shards, {total / 1e9:.2f} GB, largest layer {largest / 1e6:.0f} MB "
          f"(written in {gen:.1f} s)")

    results = {}
    for mode in ("cold", "warm"):
        best = {}
        for _ in range(a.repeats if mode == "cold" else 1):
            if mode == "cold":
                evict(files)
            r = plain_read(files)
            if not best.get("read") or r["seconds"] < best["read"]["seconds"]:
                best["read"] = r
            shutil.rmtree(base / "ckpt", ignore_errors=True)  # not timed: removing the previous output
            if mode == "cold":
                evict(files)
            c = run(CONVERT, src, base / "ckpt")
            if not best.get("convert") or c["seconds"] < best["convert"]["seconds"]:
                best["convert"] = c
        if mode == "cold":
            evict(files)
        best["copy"] = run(PLAIN_COPY, base / "copy", *files)
        shutil.rmtree(base / "copy", ignore_errors=True)
        results[mode] = best
        read_mbs = best["read"]["bytes"] / 1e6 / best["read"]["seconds"]
        conv_mbs = best["convert"]["bytes"] / 1e6 / best["convert"]["seconds"]
        print(f"[{mode}] plain read {read_mbs:,.0f} MB/s ({best['read']['seconds']:.2f} s); convert "
              f"{conv_mbs:,.0f} MB/s ({best['convert']['seconds']:.2f} s) = {100 * conv_mbs / read_mbs:.0f}% of the "
              f"read rate; plain copy {best['copy']['bytes'] / 1e6 / best['copy']['seconds']:,.0f} MB/s; "
              f"convert peak RSS {best['convert']['rss'] / 1e9:.2f} GB")
    shutil.rmtree(base / "ckpt", ignore_errors=True)
    evict(files)
    k3c = run(CONVERT, src, base / "ckpt", 16 << 20)
    k3c_mbs = k3c["bytes"] / 1e6 / k3c["seconds"]
    print(f"[cold] convert with the experts chunked per expert as for K3's 4.9 GB expert leaves "
          f"(chunk_byte_size=16 MiB here): {k3c_mbs:,.0f} MB/s")
    shutil.rmtree(base / "exported", ignore_errors=True)
    e = run(EXPORT, base / "ckpt", base / "exported")
    export_mbs = e["bytes"] / 1e6 / e["seconds"]
    print(f"export {export_mbs:,.0f} MB/s ({e['seconds']:.2f} s), peak RSS {e['rss'] / 1e9:.2f} GB")
    bound = 1.5e9 + largest
    peak = max(results[m]["convert"]["rss"] for m in results)
    print(f"memory: convert peak RSS {peak / 1e9:.2f} GB vs bound 1.5 GB + largest layer "
          f"{largest / 1e9:.2f} GB = {bound / 1e9:.2f} GB -> {'OK' if peak < bound else 'EXCEEDED'}")

    if a.record:
        rows = []
        for mode in ("cold", "warm"):
            r, c = results[mode]["read"], results[mode]["convert"]
            rm, cm = r["bytes"] / 1e6 / r["seconds"], c["bytes"] / 1e6 / c["seconds"]
            cp = results[mode]["copy"]
            cpm = cp["bytes"] / 1e6 / cp["seconds"]
            rows.append(f"| {mode} | {rm:,.0f} | {cpm:,.0f} | {cm:,.0f} | {100 * cm / rm:.0f}% | {100 * cm / cpm:.0f}% | "
                        f"{c['seconds']:.1f} | {c['rss'] / 1e9:.2f} |")
        text = textwrap.dedent(f"""
            ## convert

            {datetime.date.today().isoformat()}, {machine()}; `python benchmarks/convert.py` (defaults).
            Synthetic K3-shaped release (`synthetic_config({a.layers}, {a.experts})`): {len(files)} shards,
            {total / 1e9:.2f} GB, largest layer {largest / 1e6:.0f} MB; MXFP4 experts copied verbatim. Cold =
            the source files evicted from the page cache before each run (best of {a.repeats}); every number is
            a fresh process; convert includes fsync of the output and the atomic rename.

            | page cache | plain read MB/s | plain copy MB/s | convert MB/s | convert / read | convert / copy | convert s | convert peak RSS GB |
            |---|---|---|---|---|---|---|---|
            """).lstrip("\n") + "\n".join(rows) + "\n" + textwrap.dedent(f"""
            Cold convert with every expert leaf chunked per expert (what K3's 4.9 GB expert leaves get):
            {k3c_mbs:,.0f} MB/s. Export (checkpoint -> release layout) {export_mbs:,.0f} MB/s. Memory bound:
            peak RSS {peak / 1e9:.2f} GB < 1.5 GB + largest layer ({bound / 1e9:.2f} GB). Load average
            during the run: {os.getloadavg()[0]:.1f} (other sessions share the 2 cores).
            """)
        res = ROOT / "benchmarks" / "RESULTS.md"
        old = res.read_text() if res.exists() else "# Benchmark results\n"
        res.write_text(old.rstrip("\n") + "\n\n" + text)
        print(f"recorded in {res}")
    if not a.keep:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
