"""The connector vLLM loads by this name (``"kv_connector_module_path": "hsgen.vllm_connector"`` in users'
``vllm serve`` lines): a permanent public path for :mod:`hsgen.vllm.connector`."""

from hsgen.vllm.connector import *  # noqa: F403
from hsgen.vllm.connector import __all__ as __all__
