"""Write a random model of any config in the exact K3 release layout (fixtures, benchmarks, demos).

    python convert/make_synthetic_release.py OUT --config tiny --shards 3
    python convert/make_synthetic_release.py OUT --config k3 --vision --sparse --placement release
"""

import sys

from k31jax.conversion._synthetic import main

if __name__ == "__main__":
    sys.exit(main())
