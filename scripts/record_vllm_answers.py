"""Record a real vLLM's answers to the requests ``hsgen serve`` must answer like it.

Starts ``python -m vllm.entrypoints.openai.api_server`` (from the vLLM venv, e.g. the one
``scripts/install_vllm.sh`` makes) on a tiny Qwen3 model with ``--max-model-len 64`` and
``--enable-scale-out``, sends every request of :data:`CASES`, and writes them with vLLM's status
and JSON answer to ``--out`` (default ``tests/data/vllm-answers.json``), which
``tests/hsgen/serve/test_serve_vllm_errors.py`` replays against ``hsgen serve``. No hidden-state
connector is loaded: the answers recorded are the ones given before the engine runs.

    python scripts/record_vllm_answers.py --python .venv-vllm/bin/python

Prints one JSON object as its last line (``cases``, ``startup_s``, ``vllm_version``); exits non-zero
when the server did not start or a request got no answer.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

MAX_MODEL_LEN = 64
SERVED_NAME = "tiny"

CASES: dict[str, dict] = {
    "exact_len_ids": {"path": "/v1/completions", "body": {"model": "tiny", "prompt": list(range(5, 69)), "max_tokens": 1}},
    "over_len_ids": {"path": "/v1/completions", "body": {"model": "tiny", "prompt": list(range(5, 70)), "max_tokens": 1}},
    "way_over_len_ids": {"path": "/v1/completions", "body": {"model": "tiny", "prompt": list(range(5, 105)), "max_tokens": 1}},
    "over_len_text": {"path": "/v1/completions", "body": {"model": "tiny", "prompt": "hello world " * 60, "max_tokens": 1}},
    "max_tokens_clamped": {"path": "/v1/completions", "body": {"model": "tiny", "prompt": list(range(5, 65)), "max_tokens": 10}},
    "max_tokens_over_len": {"path": "/v1/completions", "body": {"model": "tiny", "prompt": [5, 6], "max_tokens": 100}},
    "default_max_tokens_near_len": {"path": "/v1/completions", "body": {"model": "tiny", "prompt": list(range(5, 60))}},
    "empty_text": {"path": "/v1/completions", "body": {"model": "tiny", "prompt": "", "max_tokens": 1}},
    "empty_list": {"path": "/v1/completions", "body": {"model": "tiny", "prompt": [], "max_tokens": 1}},
    "no_prompt": {"path": "/v1/completions", "body": {"model": "tiny", "max_tokens": 1}},
    "oov": {"path": "/v1/completions", "body": {"model": "tiny", "prompt": [5, 10**6], "max_tokens": 1}},
    "negative_id": {"path": "/v1/completions", "body": {"model": "tiny", "prompt": [5, -1], "max_tokens": 1}},
    "invalid_json": {"path": "/v1/completions", "raw": "{not json"},
    "json_array": {"path": "/v1/completions", "body": [1, 2]},
    "unknown_model": {"path": "/v1/completions", "body": {"model": "other", "prompt": [5], "max_tokens": 1}},
    "unknown_path_post": {"path": "/v1/nothing", "body": {}},
    "unknown_path_get": {"method": "GET", "path": "/nothing"},
    "wrong_method": {"method": "GET", "path": "/v1/completions"},
    "n2": {"path": "/v1/completions", "body": {"model": "tiny", "prompt": [5, 6], "max_tokens": 1, "n": 2}},
    "chat_over_len": {"path": "/v1/chat/completions", "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi " * 70}], "max_tokens": 1}},
    "chat_invalid_json": {"path": "/v1/chat/completions", "raw": "{not json"},
    "render": {"path": "/v1/chat/completions/render", "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}},
    "render_invalid_json": {"path": "/v1/chat/completions/render", "raw": "{"},
    "chat_ok": {"path": "/v1/chat/completions", "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "return_token_ids": True}},
    "render_no_model": {"path": "/v1/chat/completions/render", "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}},
    "completion_ok": {"path": "/v1/completions", "body": {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "return_token_ids": True}},
    "detokenize": {"path": "/detokenize", "body": {"model": "tiny", "tokens": [334, 78, 333]}},
    "tokenize_invalid_json": {"path": "/tokenize", "raw": "{"},
    "tokenize": {"path": "/tokenize", "body": {"model": "tiny", "prompt": "hello"}},
    "slash_request_id": {"path": "/v1/completions", "body": {"model": "tiny", "prompt": [5, 6], "max_tokens": 1}, "headers": {"X-Request-Id": "run/a"}},
}  # fmt: skip
"""Request name -> ``method`` (default POST), ``path``, ``body`` (JSON) or ``raw`` (text), ``headers``."""


def call(base: str, case: dict, timeout: float = 120.0) -> tuple[int, object]:
    """One request of :data:`CASES`; returns (status, parsed JSON or text)."""
    if "raw" in case:
        data = case["raw"].encode()
    else:
        data = json.dumps(case["body"]).encode() if "body" in case else None
    method = case.get("method", "POST")
    req = urllib.request.Request(base + case["path"], data=data, method=method,
                                 headers={"Content-Type": "application/json", **case.get("headers", {})})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_model(cache: Path) -> Path:
    """The built-in tiny model with head_dim 32 (vLLM's CPU attention refuses 16), untrained."""
    from hsgen.hf.tiny import TinyModelSpec, ensure_tiny_model

    return ensure_tiny_model(cache, TinyModelSpec(head_dim=32, pretrain_steps=0))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=os.environ.get("VLLM_PYTHON", ".venv-vllm/bin/python"),
                    help="The vLLM venv's interpreter.")  # fmt: skip
    ap.add_argument(
        "--model", help="Model directory (default: the tiny model, built in a temporary directory)."
    )
    ap.add_argument("--out", default="tests/data/vllm-answers.json")
    ap.add_argument("--startup-timeout", type=float, default=1500.0, help="Seconds to wait for /health.")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else _tiny_model(Path(tmp))
        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        log_path = Path(tmp) / "vllm.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [args.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                 "--served-model-name", SERVED_NAME, "--max-model-len", str(MAX_MODEL_LEN), "--port", str(port),
                 "--host", "127.0.0.1", "--enforce-eager", "--dtype", "float32", "--enable-scale-out",
                 "--max-num-seqs", "4"],
                stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"),
            )  # fmt: skip
            try:
                t0 = time.monotonic()
                while True:
                    if proc.poll() is not None:
                        print(log_path.read_text()[-3000:], file=sys.stderr)
                        print(json.dumps({"error": "vLLM exited before answering /health"}))
                        return 1
                    try:
                        if call(base, {"method": "GET", "path": "/health"}, timeout=5)[0] == 200:
                            break
                    except OSError:
                        pass
                    if time.monotonic() - t0 > args.startup_timeout:
                        print(json.dumps({"error": f"no /health within {args.startup_timeout:.0f} s"}))
                        return 1
                    time.sleep(2)
                startup = time.monotonic() - t0
                version = call(base, {"method": "GET", "path": "/version"})[1]
                answers = {}
                for name, case in CASES.items():
                    status, body = call(base, case)
                    answers[name] = {**case, "status": status, "answer": body}
            finally:
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    vllm_version = version.get("version") if isinstance(version, dict) else None
    record = {"vllm_version": vllm_version, "max_model_len": MAX_MODEL_LEN, "served_model_name": SERVED_NAME,
              "cases": answers}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({"cases": len(answers), "startup_s": round(startup, 1), "vllm_version": vllm_version,
                      "out": args.out}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
