"""Export a converted k31jax checkpoint back to the release safetensors layout (byte-exact).

    python convert/export.py CKPT OUT [--overwrite]

The same command as `k31jax export` (the library is `k31jax.ckpt`); `--help` lists the options.
"""

import sys

from k31jax.cli import main

if __name__ == "__main__":
    sys.exit(main(["export", *sys.argv[1:]]))
