"""Memory is bounded: converting a >= 3 GB synthetic release-layout checkpoint keeps the
converter's peak RSS below 1.5 GB + the largest single layer (slow: writes ~3 GB twice)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from k31jax.ckpt._release_layout import tensor_nbytes, release_layout
from k31jax.ckpt._synthetic import synthetic_config, write_synthetic_release


@pytest.mark.slow
def test_convert_peak_rss_is_bounded(tmp_path):
    cfg = synthetic_config(layers=24, experts=128)
    layout = release_layout(cfg, placement="release")
    largest = max(sum(tensor_nbytes(t) for t in ts) for _, ts in layout)
    src = write_synthetic_release(tmp_path / "src", cfg, placement="release")
    total = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    assert total >= 3e9
    code = textwrap.dedent("""
        import json, sys
        from k31jax import convert
        r = convert(sys.argv[1], sys.argv[2], verify=False, progress=False)
        print(json.dumps({"rss": next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:")),
                          "bytes": r.source_bytes, "seconds": r.seconds}))
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code, str(src), str(tmp_path / "ckpt")], capture_output=True,
                          text=True, env=env, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    bound = 1.5e9 + largest
    print(f"\nconverted {out['bytes'] / 1e9:.2f} GB in {out['seconds']:.1f} s; peak RSS {out['rss'] / 1e9:.2f} GB "
          f"(bound {bound / 1e9:.2f} GB = 1.5 GB + largest layer {largest / 1e9:.2f} GB)")
    assert out["bytes"] >= 3e9
    assert out["rss"] < bound
    assert out["rss"] < out["bytes"] / 2  # nothing like the whole model is ever resident
