"""Run by the vLLM venv's interpreter: what vLLM's own DSpark code makes of exported DSpark drafts.

    python _vllm_dspark.py VERIFIER_DIR CASES_JSON PROBE_FILE

``CASES_JSON`` maps a name to a draft directory. For each, in this one process: the method and
token count ``vllm serve DRAFT`` resolves (``bare``) and ``--speculative-config`` resolves
(``flag``), the draft hf config's DSpark fields, then vLLM's ``Qwen3DSparkForCausalLM`` built on
the CPU and loaded with its own ``load_weights`` from the draft's safetensors; with the probe's
``hidden [M, H]`` and ``prev [M]`` (a safetensors file), after vLLM's ``process_weights_after_loading``, its Markov bias ``markov_w2(markov_w1[prev])``
and its confidence ``sigmoid(proj([hidden; markov_w1[prev]]))``. vLLM's config validation refuses
DSpark without its V2 (Triton, GPU) runner, so the speculative config is attached after it. Prints
one JSON object: name -> results, or ``{"error": ...}`` where vLLM refused the case.
"""

from __future__ import annotations

import json
import os
import sys


def resolve(verifier: str, draft: str, probe: dict, port: int) -> dict:
    import torch
    from safetensors.torch import load_file
    from vllm.config import (
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.transformers_utils.config import maybe_override_with_speculators

    out: dict = {}
    _, _, bare = maybe_override_with_speculators(model=draft, tokenizer=None, trust_remote_code=False)
    out["bare"] = {"method": bare["method"], "num_speculative_tokens": bare["num_speculative_tokens"]}
    target = ModelConfig(model=verifier, dtype="float32", max_model_len=1024)
    spec = SpeculativeConfig(model=draft, method=bare["method"], num_speculative_tokens=bare["num_speculative_tokens"],
                             target_model_config=target, target_parallel_config=ParallelConfig())  # fmt: skip
    out["flag"] = {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens}
    hf = spec.draft_model_config.hf_config
    out["hf"] = {k: getattr(hf, k, None) for k in ("architectures", "sample_from_anchor", "dspark_bonus_anchor",
                                                   "markov_rank", "markov_head_type", "enable_confidence_head",
                                                   "confidence_head_with_markov", "block_size", "mask_token_id",
                                                   "target_layer_ids", "draft_vocab_size")}  # fmt: skip
    config = VllmConfig(model_config=target, device_config=DeviceConfig("cpu"))
    object.__setattr__(config, "speculative_config", spec)
    with set_current_vllm_config(config):
        _distributed(port)
        from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

        model = Qwen3DSparkForCausalLM(vllm_config=config)
        weights = load_file(os.path.join(draft, "model.safetensors"))
        try:
            model.load_weights(weights.items())
        except Exception as e:
            out["load_error"] = f"{type(e).__name__}: {e}"
            return out
        loaded = dict(model.named_parameters())
        out["loaded"] = sorted(loaded)
        same = {}
        for name, t in weights.items():
            mine = {"d2t": "draft_id_to_target_id", "lm_head.weight": "lm_head.weight"}.get(
                name, f"model.{name}"
            )
            if name == "t2d" or mine not in loaded:
                continue
            have = loaded[mine].detach().to(t.dtype)
            # a vocabulary-parallel head pads its rows (to a multiple of 64): the file's are its first rows
            same[name] = bool(have.shape[1:] == t.shape[1:] and torch.equal(have[: t.shape[0]], t))
        out["same_weights"] = same
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        process_weights_after_loading(
            model, spec.draft_model_config, torch.device("cpu")
        )  # CPU kernels repack
        with torch.no_grad():
            emb = model.markov_embed(probe["prev"])
            out["bias"] = model.markov_bias(emb.float()).tolist()
            if model.model.confidence_head is not None:
                out["confidence"] = model.compute_confidence(probe["hidden"], emb.float()).tolist()
    return out


_INITIALISED = False


def _distributed(port: int) -> None:
    global _INITIALISED
    if _INITIALISED:
        return
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
    initialize_model_parallel(1, 1)
    _INITIALISED = True


def main() -> None:
    from safetensors.torch import load_file

    verifier, cases, probe_file = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    port = int(sys.argv[4]) if len(sys.argv) > 4 else 29533
    probe = load_file(probe_file)
    out = {}
    for name, draft in cases.items():
        try:
            out[name] = resolve(verifier, draft, probe, port)
        except Exception as e:  # reported per case: the test decides what a refusal means
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
