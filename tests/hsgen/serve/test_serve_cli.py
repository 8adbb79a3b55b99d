"""``hsgen serve`` as a command: options, bad input, and a real child process."""

from __future__ import annotations

import pytest
from _serve_util import TINY_LAYERS, http, load_states, tiny_dir, wait_lock_shared
from click.testing import CliRunner

from hsgen.cli import main
from hsgen.protocol import extraction as protocol
from hsgen.serve.capacity import CapacityModel
from hsgen.serve.config import VersionBehaviour
from hsgen.serve.testing import running_server


def test_help_lists_every_option():
    result = CliRunner().invoke(main, ["serve", "--help"])
    assert result.exit_code == 0, result.output
    for flag in (
        "--model",
        "--layers",
        "--shared-storage-path",
        "--host",
        "--port",
        "--api-key",
        "--max-model-len",
        "--max-num-seqs",
        "--dtype",
        "--device",
        "--vllm-version",
        "--allow-custom-save-path",
    ):
        assert flag in result.output


@pytest.mark.parametrize(
    "args,message",
    [
        (["--layers", "1,x"], "bad layer ids"),
        (["--layers", "1", "--vllm-version", "0.17"], "needs vLLM >= 0.18"),
        (["--layers", "1", "--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
        (["--layers", "1", "--faults", "boom=1"], "unknown fault kind"),
        (["--layers", "1", "--capacity", "speed=3"], "capacity setting"),
    ],
)
def test_bad_options_are_named(args, message):
    result = CliRunner().invoke(main, ["serve", "--model", "tiny", *args])
    assert result.exit_code != 0
    assert message in result.output


def test_missing_model_dir_and_bad_layer_are_named(tmp_path):
    result = CliRunner().invoke(
        main, ["serve", "--model", str(tmp_path / "nope"), "--layers", "1", "--port", "0"]
    )
    assert (
        result.exit_code != 0 and "nope" in result.output and "nor a Hugging Face model id" in result.output
    )
    result = CliRunner().invoke(
        main,
        [
            "serve",
            "--model",
            str(tiny_dir()),
            "--layers",
            "1,9",
            "--port",
            "0",
            "--shared-storage-path",
            str(tmp_path),
        ],
    )
    assert result.exit_code != 0 and "exceeds the model's 4 layers" in result.output


def test_version_rows():
    assert VersionBehaviour.for_version("0.18").write_mode == "sync"
    assert not VersionBehaviour.for_version("0.21.1").use_lock
    assert VersionBehaviour.for_version("0.23").write_mode == "pool"
    row = VersionBehaviour.for_version("0.33.0")
    assert row.write_mode == "after_response" and row.use_lock and row.supports_output_tokens
    with pytest.raises(ValueError, match="not a version"):
        VersionBehaviour.for_version("latest")


def test_capacity_model_times():
    cap = CapacityModel.parse("tokens_per_s=1000,max_seqs=4,overhead=0.01,write_bytes_per_s=100")
    assert cap.max_concurrent_seqs == 4
    assert cap.step_seconds(500) == pytest.approx(0.51)
    assert cap.step_seconds(0, decode_seqs=2) == pytest.approx(0.01 + cap.decode_step_s)
    assert cap.write_seconds(50) == pytest.approx(0.5)
    assert CapacityModel.parse(cap.to_text()) == cap


def test_child_process_server_with_tiny_model(tmp_path):
    with running_server("tiny", TINY_LAYERS, tmp_path, mode="process", api_key="k") as url:
        assert url.model_name == "tiny"
        headers = protocol.auth_headers("k")
        status, body = http(
            url, "/v1/completions", protocol.completion_request("tiny", [1, 2, 3]), headers=headers
        )
        assert status == 200, body
        path = body["kv_transfer_params"]["hidden_states_path"]
        wait_lock_shared(path)
        assert load_states(path)["token_ids"].tolist() == [1, 2, 3]


def test_wait_until_healthy_and_timeout(tmp_path):
    import socket

    from hsgen.serve.testing import running_server

    with running_server("tiny", TINY_LAYERS, tmp_path) as url:
        res = CliRunner().invoke(main, ["wait", url + "/v1", "--timeout", "600"])
        assert res.exit_code == 0 and "healthy after" in res.output
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = CliRunner().invoke(main, ["wait", f"http://127.0.0.1:{port}", "--timeout", "0.5"])
    assert res.exit_code == 1 and "/health: no answer within 0.5 s" in res.output


def test_a_relative_shared_dir_is_served_as_an_absolute_path(tmp_path, monkeypatch):
    from hsgen.cli.serve import config_from_options

    monkeypatch.chdir(tmp_path)
    cfg = config_from_options({"model": "tiny", "layers": "1,4", "shared_storage_path": "runs/hs"})
    assert cfg.shared_storage_path == str(tmp_path / "runs" / "hs")
