"""Flat alias module: everything in tests.refs, for `from ...refs.numpy_refs import X`."""

from . import __all__  # noqa: F401
from . import *  # noqa: F401,F403
