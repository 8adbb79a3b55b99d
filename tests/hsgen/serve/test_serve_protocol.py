"""The reference server on the wire: vLLM's fields, ids, file names, errors, auth and metrics."""

from __future__ import annotations

import os
import re

import pytest
from _serve_util import TINY_LAYERS, http, load_states, tiny_dir, wait_lock_shared

from hsgen.protocol import extraction as protocol
from hsgen.serve.testing import running_server

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    shared = tmp_path_factory.mktemp("hs")
    with running_server(
        tiny_dir(),
        TINY_LAYERS,
        shared,
        max_model_len=MAX_MODEL_LEN,
        served_model_name="tiny",
        enable_scale_out=True,
    ) as url:
        yield url


def _complete(url, prompt, **extra):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "return_token_ids": True, **extra}
    status, resp = http(url, "/v1/completions", body)
    assert status == 200, resp
    return resp


def test_models_lists_the_served_model(server):
    status, body = http(server, "/v1/models")
    assert status == 200
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == "tiny" and card["object"] == "model" and card["owned_by"] == "vllm"
    assert card["max_model_len"] == MAX_MODEL_LEN


def test_health_and_version(server):
    assert http(server, "/health")[0] == 200
    status, body = http(server, "/version")
    assert status == 200 and body["version"] == "0.24"


def test_completion_with_token_ids_writes_vllm_file(server):
    prompt = [11, 12, 13, 14, 15, 16, 17]
    body = protocol.completion_request("tiny", prompt)
    status, resp = http(server, "/v1/completions", body)
    assert status == 200, resp
    assert resp["object"] == "text_completion"
    assert re.fullmatch(r"cmpl-[0-9a-f]{16}", resp["id"])
    result = protocol.parse_extraction_response(resp)
    assert list(result.prompt_token_ids) == prompt
    assert len(result.output_token_ids) == 1 and result.finish_reason == "length"
    assert resp["usage"] == {
        "prompt_tokens": 7,
        "total_tokens": 8,
        "completion_tokens": 1,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    path = result.hidden_states_path
    assert os.path.dirname(path) == str(server.shared_dir)
    assert re.fullmatch(re.escape(resp["id"]) + r"-0-[0-9a-f]{8}\.safetensors", os.path.basename(path))
    wait_lock_shared(path)
    states = load_states(path)
    assert tuple(states["hidden_states"].shape) == (7, len(TINY_LAYERS), 64)
    assert str(states["token_ids"].dtype) == "torch.int64"
    assert states["token_ids"].tolist() == prompt


def test_x_request_id_names_the_completion_and_file(server):
    status, resp = http(
        server,
        "/v1/completions",
        protocol.completion_request("tiny", [5, 6]),
        headers={"X-Request-Id": "abc123"},
    )
    assert status == 200
    assert resp["id"] == "cmpl-abc123"
    assert os.path.basename(resp["kv_transfer_params"]["hidden_states_path"]).startswith("cmpl-abc123-0-")


def test_text_prompt_matches_tokenize(server):
    status, tok = http(server, "/tokenize", {"model": "tiny", "prompt": "hello world, how are you"})
    assert status == 200 and tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == MAX_MODEL_LEN
    resp = _complete(server, "hello world, how are you")
    assert resp["choices"][0]["prompt_token_ids"] == tok["tokens"]
    assert isinstance(resp["choices"][0]["text"], str)


def test_return_token_ids_false_omits_ids(server):
    status, resp = http(server, "/v1/completions", {"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 1})
    assert status == 200
    assert resp["choices"][0]["prompt_token_ids"] is None and resp["choices"][0]["token_ids"] is None
    assert "hidden_states_path" in resp["kv_transfer_params"]


def test_multiple_prompts_report_the_first_file(server):
    resp = _complete(server, [[7, 8, 9], [10, 11]])
    assert [c["index"] for c in resp["choices"]] == [0, 1]
    assert resp["choices"][1]["prompt_token_ids"] == [10, 11]
    path = resp["kv_transfer_params"]["hidden_states_path"]
    assert os.path.basename(path).startswith(resp["id"] + "-0-")
    wait_lock_shared(path)
    assert load_states(path)["token_ids"].tolist() == [7, 8, 9]


def test_chat_matches_render_and_local_template(server):
    from transformers import AutoTokenizer

    messages = [
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Four."},
    ]
    body = protocol.chat_request("tiny", messages)
    status, resp = http(server, "/v1/chat/completions", body)
    assert status == 200, resp
    assert resp["object"] == "chat.completion" and resp["id"].startswith("chatcmpl-")
    assert isinstance(resp["choices"][0]["message"]["content"], str)
    ids = resp["prompt_token_ids"]
    tok = AutoTokenizer.from_pretrained(tiny_dir(), local_files_only=True)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    status, rendered = http(server, "/v1/chat/completions/render", body)
    assert status == 200 and rendered["token_ids"] == ids
    result = protocol.parse_extraction_response(resp)
    wait_lock_shared(result.hidden_states_path)
    assert load_states(result.hidden_states_path)["token_ids"].tolist() == ids


def test_chat_generation_prompt_flags(server):
    messages = [{"role": "user", "content": "hi"}]
    _, with_gen = http(server, "/v1/chat/completions/render", {"messages": messages})
    _, without = http(
        server, "/v1/chat/completions/render", {"messages": messages, "add_generation_prompt": False}
    )
    assert len(with_gen["token_ids"]) > len(without["token_ids"])
    assert with_gen["token_ids"][: len(without["token_ids"])] == without["token_ids"]
    partial = [*messages, {"role": "assistant", "content": "Hel"}]
    status, cont = http(
        server,
        "/v1/chat/completions/render",
        {"messages": partial, "add_generation_prompt": False, "continue_final_message": True},
    )
    assert status == 200 and "prompt" not in cont
    assert http(server, "/detokenize", {"tokens": cont["token_ids"]})[1]["prompt"].endswith("Hel")
    status, err = http(
        server,
        "/v1/chat/completions",
        {"model": "tiny", "messages": partial, "add_generation_prompt": True, "continue_final_message": True},
    )
    assert status == 400 and "continue_final_message" in err["error"]["message"]


def test_include_output_tokens_saves_all_but_the_last(server):
    resp = _complete(
        server,
        [20, 21, 22, 23],
        max_tokens=3,
        ignore_eos=True,
        kv_transfer_params={"include_output_tokens": True},
    )
    out = resp["choices"][0]["token_ids"]
    assert len(out) == 3
    path = resp["kv_transfer_params"]["hidden_states_path"]
    wait_lock_shared(path)
    states = load_states(path)
    assert states["token_ids"].tolist() == [20, 21, 22, 23, *out[:2]]
    assert states["hidden_states"].shape[0] == 6


def test_custom_save_path_is_ignored_without_permission(server, tmp_path):
    custom = str(tmp_path / "mine.safetensors")
    resp = _complete(server, [1, 2, 3], kv_transfer_params={"hidden_states_path": custom})
    path = resp["kv_transfer_params"]["hidden_states_path"]
    assert path != custom and os.path.dirname(path) == str(server.shared_dir)
    wait_lock_shared(path)
    assert not os.path.exists(custom)


def test_metrics_count_prompt_tokens(server):
    status, text = http(server, "/metrics")
    assert status == 200
    before = protocol.parse_prometheus(text)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert name in before
    assert "# TYPE vllm:prompt_tokens counter" in text
    _complete(server, [30, 31, 32, 33, 34])
    after = protocol.parse_prometheus(http(server, "/metrics")[1])
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 5
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 1


def test_api_key_like_vllm(tmp_path):
    with running_server(tiny_dir(), TINY_LAYERS, tmp_path, api_key="sekret") as url:
        status, body = http(url, "/v1/models")
        assert status == 401 and body == {"error": "Unauthorized"}
        status, _ = http(url, "/v1/completions", protocol.completion_request(url.model_name, [1, 2]))
        assert status == 401
        status, body = http(url, "/v1/models", headers=protocol.auth_headers("sekret"))
        assert status == 200 and body["data"][0]["id"] == url.model_name
        assert http(url, "/health")[0] == 200
        assert http(url, "/metrics")[0] == 200


def test_api_key_guards_exactly_vllms_routes(tmp_path):
    """vLLM's AuthenticationMiddleware: paths starting with /v1 need the key (scheme ``Bearer`` in any
    case); /health, /ping, /version, /metrics, /tokenize, /detokenize do not; OPTIONS never."""
    with running_server(tiny_dir(), TINY_LAYERS, tmp_path, api_key="sekret") as url:
        for path, body in [("/version", None), ("/ping", None), ("/metrics", None),
                           ("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})]:  # fmt: skip
            assert http(url, path, body)[0] == 200, path
        chat = {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True}
        assert http(url, "/v1/chat/completions/render", chat)[0] == 401
        for header in ("Bearer sekret", "bearer sekret", "BEARER sekret"):
            assert http(url, "/v1/models", headers={"Authorization": header})[0] == 200, header
        for header in ("Bearer sekret2", "Token sekret", "Bearersekret", "sekret"):
            assert http(url, "/v1/models", headers={"Authorization": header})[0] == 401, header
        assert http(url, "/v1/models", method="OPTIONS")[0] != 401


def test_custom_save_path_honoured_when_allowed(tmp_path):
    custom = tmp_path / "elsewhere" / "x.safetensors"
    with running_server(tiny_dir(), TINY_LAYERS, tmp_path / "hs", allow_custom_save_path=True) as url:
        body = protocol.completion_request(url.model_name, [4, 5, 6], hidden_states_path=str(custom))
        status, resp = http(url, "/v1/completions", body)
        assert status == 200
        assert resp["kv_transfer_params"]["hidden_states_path"] == str(custom)
        wait_lock_shared(str(custom))
        assert load_states(str(custom))["token_ids"].tolist() == [4, 5, 6]
