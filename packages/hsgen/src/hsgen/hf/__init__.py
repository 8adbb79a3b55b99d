"""Hugging Face models where hsgen and spectrain need them: hub ids resolved from the cache
(:mod:`~hsgen.hf.hub`), a checkpoint's head tensors, causal LMs loaded and their decoder layers
(:mod:`~hsgen.hf.causal_lm`), and the built-in tiny verifier (:mod:`~hsgen.hf.tiny`)."""
