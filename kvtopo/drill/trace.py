"""The drill's per-request trace: one JSON line per event, in the drill's workdir.

Owns `trace.jsonl`: a request booked, each side's answer to its submit, each outcome
collected (side, status, reason), and each engine's life (started, drain begun, drained,
exited). When the report names a request (lost, failed falsely, reported twice), its lines
in the trace say what happened to it: `grep '"drill-0-1429"' out/drill/trace.jsonl`.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import IO, Any


class Trace:
    """Appends events to a JSONL file, stamped with seconds since the drill began."""

    def __init__(self, path: Path | None, t0: float) -> None:
        self.path = path
        self._t0 = t0
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("w", buffering=1)

    def __call__(self, event: str, **fields: Any) -> None:
        if self._file is None:
            return
        line = json.dumps({"t": round(time.monotonic() - self._t0, 4), "event": event, **fields})
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
