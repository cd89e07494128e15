"""Convert a K3 / K3.1 release (safetensors) into a k31jax Orbax checkpoint.

    python convert/convert.py SRC DST [--verify] [--dry-run] ...

The same command as `k31jax convert` (the library is `k31jax.ckpt`); `--help` lists the options.
"""

import sys

from k31jax.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
