"""A long prompt read by the target in one forward against PREFILL_CHUNK tokens per forward (TargetModel.prefill),
alternated in one process: seconds, ms per prompt token, the first token, and the last row's logits against the
first run's (0: bitwise the same).

    python scripts/lab/prefill_chunks_ab.py EXPORT PROMPT_FILE [ROUNDS (1)]

PROMPT_FILE is read as raw text (no chat template). Peak memory needs a process per variant:
`/usr/bin/time -v mirrorsd generate --model EXPORT --raw --prompt "$(cat PROMPT_FILE)" --mode ar --max-new-tokens 4`.
"""
from __future__ import annotations

import sys
import time

import numpy as np

from mirrorsd.devices.placement import DeviceRequest
from mirrorsd.runtime import GenerationConfig, Pipeline
from mirrorsd.runtime.models import PREFILL_CHUNK


def main(folder: str, prompt_file: str, rounds: int) -> None:
    pipe = Pipeline.load(folder, DeviceRequest(spin_in_run=True))
    with open(prompt_file, encoding="utf-8") as f:
        ids = pipe.encode(f.read(), GenerationConfig(chat=False))
    print(f"{folder}: {len(ids)} prompt tokens")
    chunked = f"chunks of {PREFILL_CHUNK}"
    reference = None
    for _ in range(rounds):
        for name in ("one forward", chunked, chunked, "one forward"):
            pipe.target.reset(1, len(ids) + 8)
            start = time.perf_counter()
            logits = pipe.target.extend(ids)[-1:] if name == "one forward" else pipe.target.prefill(ids)
            seconds = time.perf_counter() - start
            reference = logits if reference is None else reference
            print(f"{name:16s} {seconds:6.1f} s  {seconds / len(ids) * 1e3:5.1f} ms/token  first token "
                  f"{int(np.argmax(logits))}  max |diff| vs the first run {float(np.abs(logits - reference).max()):.2e}",
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 1)
