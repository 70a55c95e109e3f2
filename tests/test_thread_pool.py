"""--shared-pool (devices/thread_pool.py): every ONNX Runtime CPU session of the process on one spinning pool. The
pool is process-wide, so the checks run in a child process: ar, sd and mirror on the shared pool equal ar on
per-session pools, the placements say so (their profiles are cached apart), and another thread count is refused.
Speed is measured by the bench (docs/performance.md), not here."""
from __future__ import annotations

import os
import subprocess
import sys

CHILD = r'''
import sys
from mirrorsd.devices.placement import DeviceRequest
from mirrorsd.errors import DeviceError
from mirrorsd.runtime import GenerationConfig, Pipeline

folder, threads = sys.argv[1], int(sys.argv[2])
prompt = [1, 17, 42, 99, 7]
config = lambda mode: GenerationConfig(mode=mode, max_new_tokens=24, chat=False)
with Pipeline.load(folder, DeviceRequest(target_threads=threads, draft_threads=threads)) as plain:
    reference = plain.generate(prompt, config("ar")).tokens
    assert not any("shared pool" in p.describe() for p in plain.placements.values())
with Pipeline.load(folder, DeviceRequest(target_threads=threads, draft_threads=threads, shared_pool=True)) as pipe:
    assert all("shared pool" in p.describe() for p in pipe.placements.values()), pipe.placements
    for mode in ("ar", "sd", "mirror"):
        tokens = pipe.generate(prompt, config(mode)).tokens
        assert tokens == reference, (mode, tokens, reference)
if threads > 1:
    try:
        Pipeline.load(folder, DeviceRequest(target_threads=1, draft_threads=1, shared_pool=True))
    except DeviceError as exc:
        assert "shared thread pool" in exc.what and exc.fix, exc
    else:
        raise SystemExit("a shared pool of another size was not refused")
print("ok")
'''


def test_shared_pool_keeps_every_mode_exact_and_refuses_another_size(exported):
    folder = exported("llama", draft_layers=2)
    threads = min(2, os.cpu_count() or 1)
    result = subprocess.run([sys.executable, "-c", CHILD, str(folder), str(threads)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
