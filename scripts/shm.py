"""Where the data-path benchmarks put their files."""

from __future__ import annotations

import logging
import shutil
import tempfile


def scratch_root(need_bytes: float) -> str:
    """``/dev/shm`` (where server files live in production) when it has ``need_bytes`` free, else
    the system temp dir, with a warning: containers often mount a 64 MB ``/dev/shm``."""
    try:
        if shutil.disk_usage("/dev/shm").free >= need_bytes:
            return "/dev/shm"
    except OSError:
        pass
    root = tempfile.gettempdir()
    logging.getLogger(__name__).warning("/dev/shm lacks %.1f GB free: files go to %s", need_bytes / 1e9, root)
    return root
