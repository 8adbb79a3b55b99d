"""The /v1/models answer and Prometheus text, each read by one function for client, CLI and eval."""

from __future__ import annotations

import pytest

from hsgen.protocol.extraction import (
    ProtocolError,
    models_url,
    parse_prometheus,
    prometheus_samples,
    served_model_ids,
)


def test_served_model_ids_reads_raw_or_parsed_and_refuses_the_rest():
    body = b'{"object": "list", "data": [{"id": "Qwen/Qwen3-8B"}, {"id": "lora-a"}]}'
    assert served_model_ids(body) == ["Qwen/Qwen3-8B", "lora-a"]
    assert served_model_ids({"data": [{"id": 7}]}) == ["7"]
    for bad in (b"not json", b'{"data": []}', b'{"models": []}', b'{"data": [{"name": "x"}]}', b"[1]"):
        with pytest.raises(ProtocolError):
            served_model_ids(bad)


def test_models_url_takes_a_v1_suffix_or_not():
    assert models_url("http://h:8000") == models_url("http://h:8000/v1/") == "http://h:8000/v1/models"


def test_prometheus_samples_keep_labels_and_the_sum_drops_them():
    text = "\n".join([
        "# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total accepted per position",
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m {x}",position="0"} 12.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m {x}",position="1"} 5',
        "vllm:num_requests_waiting 3",
        "garbage line",
    ])  # fmt: skip
    samples = list(prometheus_samples(text))
    assert samples[0] == (
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        {"model_name": "m {x}", "position": "0"},
        12.0,
    )
    assert [s[1].get("position") for s in samples] == ["0", "1", None]
    assert parse_prometheus(text) == {
        "vllm:spec_decode_num_accepted_tokens_per_pos_total": 17.0, "vllm:num_requests_waiting": 3.0
    }  # fmt: skip
