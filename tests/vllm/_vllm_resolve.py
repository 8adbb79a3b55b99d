"""Run by the vLLM venv's interpreter: what vLLM's own config code makes of an exported draft.

    python _vllm_resolve.py VERIFIER_DIR DRAFT_DIR SPECULATIVE_CONFIG_JSON

Prints one JSON object: the method ``vllm serve DRAFT_DIR`` resolves (``bare``), the method and the
number of speculative tokens ``--model VERIFIER --speculative-config JSON`` resolves (``flag``), and
per draft layer the (sliding window, causal) vLLM's DFlash model would build (``dflash_layers``).
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    verifier, draft, spec_json = sys.argv[1], sys.argv[2], sys.argv[3]
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig
    from vllm.transformers_utils.config import maybe_override_with_speculators

    out: dict = {}
    _, _, bare = maybe_override_with_speculators(model=draft, tokenizer=None, trust_remote_code=False)
    out["bare"] = {"method": bare["method"], "num_speculative_tokens": bare["num_speculative_tokens"]}
    target = ModelConfig(model=verifier, dtype="float32", max_model_len=1024)
    spec = SpeculativeConfig(**json.loads(spec_json), target_model_config=target,
                             target_parallel_config=ParallelConfig())  # fmt: skip
    out["flag"] = {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens}
    hf = spec.draft_model_config.hf_config
    if spec.method == "dflash":
        from vllm.model_executor.models import qwen3_dflash

        out["dflash_layers"] = [
            list(qwen3_dflash._resolve_layer_attention(hf, i)) for i in range(hf.num_hidden_layers)
        ]
        out["dflash_target_layer_ids"] = list(hf.dflash_config["target_layer_ids"])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
