"""Errors of fetching one prompt's hidden states (raised by :mod:`hsgen.client.fetch`)."""

from __future__ import annotations

import os


class FetchError(Exception):
    """A prompt whose hidden states could not be fetched.

    Attributes:
        reason: short machine-readable kind (``http_400``, ``timeout``, ``missing_file``, ...).
        transient: whether another attempt may succeed.
        endpoint: the server involved ("" if none).
        attempts: requests made for this prompt so far.
    """

    def __init__(self, reason: str, message: str, *, transient: bool, endpoint: str = "", attempts: int = 0):
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
        self.transient = transient
        self.endpoint = endpoint
        self.attempts = attempts


class FatalError(FetchError):
    """A failure no other prompt can avoid either (bad API key, wrong flag, every server down)."""

    def __init__(self, reason: str, message: str, endpoint: str = ""):
        super().__init__(reason, message, transient=False, endpoint=endpoint)


class FetchStopped(Exception):
    """The client stopped retrying before this prompt was fetched (not the prompt's fault).

    Raised by :meth:`hsgen.client.fetch.HiddenStateClient.fetch` once
    :meth:`~hsgen.client.fetch.HiddenStateClient.stop_retrying` was called, instead of a retry or of
    a wait for a server to come back.
    """

    def __init__(self) -> None:
        super().__init__("the client stopped retrying")


def describe_transport(e: BaseException, timeout_s: float) -> str:
    """A transport error in a few words: ``connection refused``, ``no answer within 10 s``, ..."""
    if isinstance(e, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    for err in (getattr(e, "os_error", None), e):
        if isinstance(err, OSError) and err.errno:
            return os.strerror(err.errno).lower()
        if isinstance(err, OSError) and err.strerror:
            return err.strerror.lower()
    return f"{type(e).__name__}: {e}"


__all__ = ["FatalError", "FetchError", "FetchStopped", "describe_transport"]
