"""hsgen: hidden states from vLLM, landed in chunked zarr stores."""

__version__ = "0.1.0"

from hsgen import _moved

_moved.install()
