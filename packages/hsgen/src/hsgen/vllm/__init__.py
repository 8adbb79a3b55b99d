"""The real vLLM: the exact ``vllm serve`` line for extraction (:mod:`~hsgen.vllm.command`), a server
started in its own environment (:mod:`~hsgen.vllm.server`), and the CPU connector it loads
(:mod:`~hsgen.vllm.connector`, named ``hsgen.vllm_connector`` in users' command lines)."""
