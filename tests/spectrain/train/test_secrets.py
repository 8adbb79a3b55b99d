"""API keys are never persisted nor printed (issue 13, point 3)."""

from __future__ import annotations

from spectrain.online.config import OnlineConfig
from spectrain.train.loop import TrainConfig, train

SECRETS = ("sk-SECRET-1", "sk-SECRET-2", "sk-SECRET-3")


def test_api_keys_never_reach_a_checkpoint(tiny_store, tiny_model_dir, tmp_path):
    cfg = TrainConfig(
        store=str(tiny_store), verifier=str(tiny_model_dir), save_path=str(tmp_path / "run"),
        draft={"block_size": 4, "max_anchors": 16, "num_layers": 1, "mask_token_id": 5}, total_seq_len=256,
        max_steps=2, save_every=1, val_fraction=0.0,
        endpoints=[f"http://user:{SECRETS[0]}@gpu1:8000"],
        online_options={"api_key": SECRETS[1], "client_options": {"api_key": SECRETS[2], "max_retries": 2}},
    )  # fmt: skip
    train(cfg)
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    saved = (tmp_path / "run" / "checkpoint-00000002" / "trainer" / "train_config.json").read_text()
    assert saved.count("<redacted>") == 3
    assert '"mask_token_id": 5' in saved and '"max_retries": 2' in saved and "gpu1:8000" in saved
    for p in files:
        data = p.read_bytes()
        for secret in SECRETS:
            assert secret.encode() not in data, f"{secret} written to {p}"


def test_redaction_keeps_everything_else():
    from spectrain.train.loop import redact_secrets

    value = {"api_key": "k", "hf-token": "t", "x": [{"password": "p", "ok": 1}], "mask_token_id": 3,
             "url": "https://a:b@h:1/v1", "plain": "http://h:1", "none_key": None, "api_key2": None}  # fmt: skip
    out = redact_secrets(value)
    assert out == {"api_key": "<redacted>", "hf-token": "<redacted>", "x": [{"password": "<redacted>", "ok": 1}],
                   "mask_token_id": 3, "url": "https://<redacted>@h:1/v1", "plain": "http://h:1",
                   "none_key": None, "api_key2": None}  # fmt: skip
    # issue 33: a key holding an @ leaves no tail behind
    assert redact_secrets("http://u:p@ss@h:1/v1") == "http://<redacted>@h:1/v1"


def test_online_takes_the_key_from_vllm_api_key_and_never_shows_it(monkeypatch, tiny_model_dir, tmp_path):
    monkeypatch.setenv("VLLM_API_KEY", SECRETS[0])
    cfg = TrainConfig(verifier=str(tiny_model_dir), save_path=str(tmp_path), online=True,
                      endpoints=["http://h:8000"], prompts="p.jsonl")  # fmt: skip
    online = OnlineConfig.from_train_config(cfg)
    assert online.api_key == SECRETS[0] and SECRETS[0] not in repr(online)
    cfg.online_options = {"api_key": SECRETS[1]}
    assert OnlineConfig.from_train_config(cfg).api_key == SECRETS[1]
