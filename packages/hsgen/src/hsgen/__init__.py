"""hsgen: hidden states from vLLM, landed in chunked zarr stores."""

__version__ = "0.1.0"
