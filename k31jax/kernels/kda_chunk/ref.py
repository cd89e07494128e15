"""The oracle for the KDA kernels: the XLA ops themselves (kda.md §4-§5), unchanged.

`kda_chunked_ref` materialises the pairwise decays per chunk (kda.md §6a), `kda_recurrent_ref`
is the token-by-token definition; both fp32. The float64 NumPy reference is
`tests/refs/kda.py::kda_recurrent`.
"""

from ...ops._kda import kda_chunked as kda_chunked_ref
from ...ops._kda import kda_recurrent as kda_recurrent_ref

__all__ = ["kda_chunked_ref", "kda_recurrent_ref"]
