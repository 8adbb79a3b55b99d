"""The client's configuration and what one fetch returns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from hsgen.client.shared_dir import new_client_prefix
from hsgen.protocol import extraction as protocol

if TYPE_CHECKING:
    from hsgen.client.hidden_file import ExpectedStates, FileRows


@dataclass
class ClientConfig:
    """How to reach the servers and how patient to be.

    Attributes:
        endpoints: server base URLs (``http://host:8000`` or ``http://host:8000/v1``).
        shared_dir: the directory the servers write to (their ``shared_storage_path``, as
            seen from this machine). A file anywhere else is refused.
        api_key: sent as ``Authorization: Bearer``; None = no header.
        model: model id to request; None = ask each server's ``GET /v1/models``.
        include_output_tokens: ask vLLM >= 0.24 to include generated tokens (they are dropped).
        targets: ``"states"`` (the file's last layer feeds the targets) or ``"argmax"`` (also ask
            for ``prompt_logprobs`` and return the verifier's greedy next token per position as
            :attr:`FetchedSample.target_ids`; the servers need not capture the final layer).
        request_timeout_s: limit for one HTTP request, queueing on the server included.
        connect_timeout_s: limit for opening a connection.
        file_wait_s: how long the file or its lock may take to appear after the response.
        lock_timeout_s: how long a writer may hold the lock.
        settle_s: after the lock is released, how long a missing or short file may take to
            become complete before the attempt fails (covers lock-creation races).
        max_retries: extra attempts after a transient failure (0 = no retry).
        backoff_s: first retry delay; doubles per attempt, with jitter, up to ``backoff_max_s``.
        backoff_max_s: longest retry delay.
        breaker_threshold: consecutive transient failures that open an endpoint's breaker.
        breaker_cooldown_s: how long an open breaker rejects requests before one probe.
        check_finite: refuse samples with NaN or infinite values.
        map_files: map the server's files instead of reading them: one copy less, but a writer
            that truncates a file later (a hostile server, anyone who can write the shared
            directory) kills this process with SIGBUS; only for trusted servers and directories.
        rows_in_file: leave the hidden states in the open file (its name removed all the same)
            as :class:`hsgen.client.hidden_file.FileRows`, for a consumer that copies each sample once
            (spectrain's read-once online mode): one copy, from the file into its buffer. The
            file's pages stay allocated until the rows are closed.
        delete_files: remove the server's file and lock after reading (vLLM never does).
        max_connections: keep-alive connections per endpoint (0 = unlimited).
        read_threads: threads reading and validating files.
        max_down_s: end with :class:`FatalError` when no endpoint has answered any request for
            this long (0 = never give up).
        probe_timeout_s: limit for each endpoint's ``GET /v1/models`` in :meth:`HiddenStateClient.probe`.
        expect_layers, expect_hidden_size, expect_dtype: what every file must hold (None =
            unknown): checked on the file's header before its payload is read; a file that does
            not fit ends the run (:class:`~hsgen.client.errors.FatalError` ``wrong_states``). Without a
            hidden size, one over :data:`hsgen.client.hidden_file.MAX_HIDDEN_SIZE` is refused.
        expected: the same, with where each figure comes from (a store's header, a model's
            config; :class:`hsgen.client.hidden_file.ExpectedStates`), for the refusal to say; the
            ``expect_*`` figures given win over its own.
        request_prefix: start of every ``X-Request-Id`` (and so of every file name) this client
            causes; default a fresh ``hsgen-<12 hex>-`` (:func:`hsgen.client.shared_dir.new_client_prefix`).
    """

    endpoints: Sequence[str]
    shared_dir: str = protocol.DEFAULT_SHARED_STORAGE_PATH
    api_key: str | None = field(default=None, repr=False)
    model: str | None = None
    include_output_tokens: bool = False
    targets: str = "states"
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    file_wait_s: float = 60.0
    lock_timeout_s: float = 300.0
    settle_s: float = 2.0
    max_retries: int = 3
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0
    breaker_threshold: int = 5
    breaker_cooldown_s: float = 10.0
    check_finite: bool = True
    map_files: bool = False
    rows_in_file: bool = False
    delete_files: bool = True
    max_connections: int = 0
    read_threads: int = 4
    max_down_s: float = 600.0
    probe_timeout_s: float = 10.0
    expect_layers: int | None = None
    expect_hidden_size: int | None = None
    expect_dtype: str | None = None
    expected: ExpectedStates | None = None
    request_prefix: str = field(default_factory=new_client_prefix)

    def __post_init__(self) -> None:
        if isinstance(self.endpoints, str):
            self.endpoints = [self.endpoints]
        self.endpoints = [normalize_endpoint(e) for e in self.endpoints]
        if not self.endpoints:
            raise ValueError("at least one endpoint is needed (--endpoint URL)")
        if len(set(self.endpoints)) != len(self.endpoints):
            raise ValueError(f"endpoints are repeated: {self.endpoints}")
        if self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if self.breaker_threshold < 1:
            raise ValueError("breaker_threshold must be >= 1")
        if self.max_down_s < 0:
            raise ValueError("max_down_s must be >= 0")
        if self.targets not in ("states", "argmax"):
            raise ValueError(f"targets must be 'states' or 'argmax', got {self.targets!r}")
        protocol.check_request_id(self.request_prefix)


def normalize_endpoint(url: str) -> str:
    """``http://h:8000/v1/`` -> ``http://h:8000``; a bare ``h:8000`` gets ``http://``.

    Raises ``ValueError`` (the URL redacted) for credentials in the URL: see
    :func:`hsgen.protocol.extraction.check_no_credentials`.
    """
    url = url.strip().rstrip("/")
    if not url:
        raise ValueError("empty endpoint URL")
    if "://" not in url:
        url = "http://" + url
    protocol.check_no_credentials(url)
    if url.endswith("/v1"):
        url = url[:-3]
    return url.rstrip("/")


@dataclass
class FetchedSample:
    """One prompt's validated hidden states.

    Attributes:
        sample_id: the prompt's id.
        hidden_states: ``[T, num_layers, hidden]`` in storage dtype (uint16 bits for bf16),
            read into this process's memory, or with ``map_files`` a read-only view of the
            mapped file (the file itself is already deleted), or with ``rows_in_file`` the rows
            still in that file (:class:`hsgen.client.hidden_file.FileRows`).
        token_ids: ``[T]`` int64, equal to the prompt's ids.
        loss_mask: ``[T]`` uint8.
        dtype: logical dtype of ``hidden_states``.
        endpoint: the server that produced it.
        latency_s: seconds from sending the request to the validated arrays.
        attempts: requests it took (1 = first try).
        target_ids: ``[T]`` int32, the verifier's greedy next token after each position (only
            with ``ClientConfig.targets = "argmax"``).
        source: the prompt's ``file:line`` (for a failure recorded after the fetch).
    """

    sample_id: str
    hidden_states: np.ndarray | FileRows
    token_ids: np.ndarray
    loss_mask: np.ndarray
    dtype: str
    endpoint: str = ""
    latency_s: float = 0.0
    attempts: int = 1
    target_ids: np.ndarray | None = None
    source: str = ""

    @property
    def nbytes(self) -> int:
        return int(self.hidden_states.nbytes)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


__all__ = ["ClientConfig", "FetchedSample", "normalize_endpoint"]
