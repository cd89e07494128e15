"""Write a random model of any config in the exact K3 release layout (fixtures, benchmarks, demos).

    python convert/make_synthetic_release.py OUT --config tiny --shards 3
    python convert/make_synthetic_release.py OUT --config k3 --vision --sparse --placement release
"""

import argparse
import json
import sys
from pathlib import Path

from k31jax.ckpt import write_synthetic_release
from k31jax.config import ModelConfig, preset_dir


def load_config(spec: str) -> tuple[ModelConfig, dict | None]:
    path = Path(spec)
    if not path.exists():
        path = preset_dir() / f"{spec}.json"
    raw = json.loads(path.read_text())
    return ModelConfig.from_hf(raw), raw


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python convert/make_synthetic_release.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="folder to write")
    p.add_argument("--config", default="tiny", help="preset name or path to a config.json (default tiny)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shards", type=int, default=3, help="number of shards for --placement size")
    p.add_argument("--placement", choices=("size", "release"), default="size")
    p.add_argument("--vision", action="store_true", help="also write the vision tower and projector "
                   "(from the config's vision_config)")
    p.add_argument("--sparse", action="store_true", help="headers only; tensor data left as file holes")
    p.add_argument("--bf16-experts", action="store_true", help="store routed experts as bf16 `.weight` "
                   "(default: MXFP4 weight_packed/weight_scale when the widths allow)")
    a = p.parse_args(argv)
    cfg, raw = load_config(a.config)
    want = "bf16" if a.bf16_experts else "mxfp4"
    if cfg.moe_layers and cfg.expert_weights != want:
        cfg = cfg.replace(expert_weights=want)
    vision = (raw or {}).get("vision_config") if a.vision else None
    if a.vision and not vision:
        p.error(f"--vision: {a.config} has no vision_config")
    raw_out = raw if ModelConfig.from_hf(raw) == cfg and (a.vision or not raw.get("vision_config")) else None
    out = write_synthetic_release(a.out, cfg, seed=a.seed, num_shards=a.shards, placement=a.placement,
                        vision_config=vision, sparse=a.sparse, config_json=raw_out)
    files = sorted(out.glob("*.safetensors"))
    print(f"wrote {out}: {len(files)} shard(s), {sum(f.stat().st_size for f in files):,} bytes"
          f"{' (sparse)' if a.sparse else ''}")
    return 0



if __name__ == "__main__":
    sys.exit(main())
