"""Run by the vLLM venv's interpreter: what vLLM's own config code makes of exported drafts.

    python _vllm_resolve.py VERIFIER_DIR CASES_JSON

``CASES_JSON`` maps a name to ``{"draft": DRAFT_DIR, "spec": SPECULATIVE_CONFIG}``; all cases are
resolved in this one process (importing vLLM costs tens of seconds on 2 cores). Prints one JSON
object mapping each name to: the method ``vllm serve DRAFT_DIR`` resolves (``bare``), the method
and number of speculative tokens ``--model VERIFIER --speculative-config SPEC`` resolves
(``flag``), and per draft layer the (sliding window, causal) vLLM's DFlash model builds
(``dflash_layers``); or ``{"error": "..."}`` where vLLM refused the case.
"""

from __future__ import annotations

import json
import sys


def resolve(verifier: str, draft: str, spec_kw: dict) -> dict:
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig
    from vllm.transformers_utils.config import maybe_override_with_speculators

    out: dict = {}
    _, _, bare = maybe_override_with_speculators(model=draft, tokenizer=None, trust_remote_code=False)
    out["bare"] = {"method": bare["method"], "num_speculative_tokens": bare["num_speculative_tokens"]}
    target = ModelConfig(model=verifier, dtype="float32", max_model_len=1024)
    spec = SpeculativeConfig(**spec_kw, target_model_config=target, target_parallel_config=ParallelConfig())
    out["flag"] = {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens}
    hf = spec.draft_model_config.hf_config
    if spec.method == "dflash":
        from vllm.model_executor.models import qwen3_dflash

        out["dflash_layers"] = [
            list(qwen3_dflash._resolve_layer_attention(hf, i)) for i in range(hf.num_hidden_layers)
        ]
        out["dflash_target_layer_ids"] = list(hf.dflash_config["target_layer_ids"])
        # what the proposer passes as the attention metadata's ``causal`` (vllm/v1/spec_decode/dflash.py)
        out["dflash_proposer_causal"] = not qwen3_dflash.dflash_has_any_non_causal(hf)
    return out


def main() -> None:
    verifier, cases = sys.argv[1], json.loads(sys.argv[2])
    out = {}
    for name, case in cases.items():
        try:
            out[name] = resolve(verifier, case["draft"], case["spec"])
        except Exception as e:  # reported per case: the test decides what a refusal means
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
