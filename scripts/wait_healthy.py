#!/usr/bin/env python
"""Wait until a local server answers ``GET /health``; fail at once if its process dies.

python scripts/wait_healthy.py PORT PID [TIMEOUT_S]      (default 60 s; exit 1 on timeout or death)
"""

from __future__ import annotations

import os
import sys
import time
import urllib.request


def main() -> None:
    port, pid = sys.argv[1], int(sys.argv[2])
    deadline = time.monotonic() + (float(sys.argv[3]) if len(sys.argv) > 3 else 60.0)
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return
        except OSError:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                sys.exit(f"server process {pid} died before /health answered")
            time.sleep(0.1)
    sys.exit(f"server on port {port} did not become healthy")


if __name__ == "__main__":
    main()
