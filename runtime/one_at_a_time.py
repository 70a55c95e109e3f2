"""One call at a time per pipeline: generate, generate_batch and close hold one lock; calls from two threads
serialize, and a call from inside the pipeline's own on_text callback (the thread that holds the lock) is an error
line instead of a deadlock."""
from __future__ import annotations

import contextlib
import threading

from mirrorsd.errors import GenerationInputError


class OneAtATime:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread holding the lock (a call back into the pipeline is refused)

    @contextlib.contextmanager
    def __call__(self, call: str):
        if self._owner == threading.get_ident():
            raise GenerationInputError(f"Pipeline.{call} was called from inside the same pipeline's on_text callback",
                                       "the pipeline runs one generation at a time, and the one calling back is "
                                       "still running", f"collect the text and call {call} after generate returns "
                                                        "(or use another Pipeline)")
        with self._lock:
            self._owner = threading.get_ident()
            try:
                yield
            finally:
                self._owner = None
