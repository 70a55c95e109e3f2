"""Is a row's output independent of the window it is verified in? The target with its KV cache in place, after
DEPTH cached tokens: W tokens decoded one row at a time against the same W tokens as one window, logits compared
bit for bit (and the max |diff| if not), for each depth and window size.

    python scripts/lab/kv_in_place_rows.py EXPORT DEPTHS WINDOWS [in-place|concat]   e.g. exports/qwen-int4 200,3000 5,22,40
"""
import sys

import numpy as np

from mirrorsd.devices.placement import DeviceRequest
from mirrorsd.runtime import Pipeline

depths = [int(d) for d in sys.argv[2].split(",")]
windows = [int(w) for w in sys.argv[3].split(",")]
in_place = (sys.argv[4] if len(sys.argv) > 4 else "in-place") == "in-place"
text = [1000 + (i * 7919) % 50000 for i in range(max(depths) + max(windows))]
with Pipeline.load(sys.argv[1], DeviceRequest(target_kv_in_place=in_place)) as pipe:
    target = pipe.target
    print(pipe.placements["suffix"].describe(), flush=True)
    for depth in depths:
        target.reset(1, depth + max(windows) + 8)
        target.prefill(text[:depth])
        for w in windows:
            window = np.asarray(target.extend(text[depth:depth + w]))
            target.truncate(depth)
            rows = np.concatenate([np.asarray(target.extend([t])).reshape(1, -1) for t in text[depth:depth + w]])
            target.truncate(depth)
            window = window.reshape(w, -1)
            same = [bool(np.array_equal(window[i], rows[i])) for i in range(w)]
            print(f"depth {depth} window {w}: {sum(same)}/{w} rows bit for bit, max |diff| "
                  f"{float(np.abs(window - rows).max()):.3g}", flush=True)
