"""The reference hidden-state server: vLLM's extraction protocol on top of transformers.

``hsgen serve`` behaves on the wire and on disk like ``vllm serve`` running the
``extract_hidden_states`` speculative method with ``ExampleHiddenStatesConnector``
(see ``docs/serve.md``). Needs the ``serve`` extra (torch, transformers, safetensors).

Tests and scripts start one with :func:`hsgen.serve.testing.running_server`.
"""

from hsgen.serve.config import ServeConfig, VersionBehaviour

__all__ = ["ServeConfig", "VersionBehaviour"]
