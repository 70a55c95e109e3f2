"""RSS per 1k tokens over identical 10k-token runs in one process, and what glibc's heap holds after each.

    python scripts/lab/openvino_heap.py [--runs 3] [--tokens 10000] [--draft openvino:CPU] [--every N] [--trim] [--shapes]

The setup of tests/test_long_run.py (the tiny 2-layer model of scripts/lab/openvino_memory.py, target on ONNX Runtime's
CPU provider, 1 + 1 threads, mirror with two branches). Prints per run: RSS at each 1k (MiB), then glibc's mallinfo2
(heap bytes, in use, free inside the heap, mmapped). --every N trims every N OpenVINO calls instead of
devices/heap.py's TRIM_EVERY (-1: no trims); --trim calls malloc_trim(0) after each run and prints the RSS after it;
--shapes counts the draft's distinct input shape sets. Linux/glibc only. docs/reliability.md has the numbers.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from openvino_memory import PROMPT, build  # noqa: E402

MiB = 2**20
LIBC = ctypes.CDLL(None)


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                "uordblks", "fordblks", "keepcost")]


LIBC.mallinfo2.restype = MallInfo2


def heap() -> str:
    m = LIBC.mallinfo2()
    return (f"heap {m.arena / MiB:.0f} in use {m.uordblks / MiB:.0f} free {m.fordblks / MiB:.0f} "
            f"mmapped {m.hblkhd / MiB:.0f} MiB")


def count_shapes(backends) -> dict:
    shapes: dict = {}
    run = backends.OpenVINOSession.run

    def counting(self, feeds):
        key = tuple((name, value.shape) for name, value in sorted(feeds.items()))
        shapes[key] = shapes.get(key, 0) + 1
        return run(self, feeds)

    backends.OpenVINOSession.run = counting
    return shapes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=10_000)
    parser.add_argument("--draft", default="openvino:CPU")
    parser.add_argument("--every", type=int, default=0, help="trim every N calls (0: as shipped, -1: never)")
    parser.add_argument("--trim", action="store_true", help="malloc_trim(0) after each run")
    parser.add_argument("--shapes", action="store_true", help="count the draft's distinct input shape sets")
    parser.add_argument("--work", type=Path, default=Path("/tmp/mirrorsd-openvino-memory"))
    args = parser.parse_args()
    folder = build(args.work)
    import psutil

    from mirrorsd.devices import backends
    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.runtime import GenerationConfig, Pipeline

    shapes = count_shapes(backends) if args.shapes else {}
    process = psutil.Process()
    print(f"MALLOC_ARENA_MAX={os.environ.get('MALLOC_ARENA_MAX')}", flush=True)
    request = DeviceRequest(target="cpu", draft=args.draft, target_threads=1, draft_threads=1)
    with Pipeline.load(folder, request) as pipe:
        sessions = [o for o in gc.get_objects() if isinstance(o, backends.OpenVINOSession) and o.heap is not None]
        for session in sessions:
            if args.every:
                session.heap = None if args.every < 0 else dataclass_replace_every(session.heap, args.every)
        trimmers = [s.heap for s in sessions if s.heap is not None]
        print(f"loaded: RSS {process.memory_info().rss / MiB:.1f} MiB, {heap()}, draft "
              f"{pipe.placements['draft'].describe()}, trims every {[t.every for t in trimmers]}", flush=True)
        reference = None
        for r in range(args.runs):
            marks: dict = {}

            def on_text(piece: str) -> None:
                mark = (pipe.target.length + 1 - len(PROMPT)) // 1000 * 1000
                if mark and mark not in marks:
                    marks[mark] = process.memory_info().rss

            began = time.perf_counter()
            out = pipe.generate(PROMPT, GenerationConfig(mode="mirror", max_new_tokens=args.tokens, branches=2),
                                on_text=on_text)
            reference = reference or out.tokens
            line = (f"run {r}: {time.perf_counter() - began:.0f} s, same tokens {out.tokens == reference}, RSS by 1k "
                    + " ".join(f"{marks[m] / MiB:.0f}" for m in sorted(marks))
                    + f", end {process.memory_info().rss / MiB:.1f}; {heap()}")
            line += "".join(f"; {t.trims} trims so far, {t.seconds * 1e3:.0f} ms" for t in trimmers)
            if args.trim:
                LIBC.malloc_trim(0)
                line += f"; after malloc_trim {process.memory_info().rss / MiB:.1f}"
            print(line, flush=True)
            if args.shapes:
                print(f"   distinct draft input shape sets so far {len(shapes)}, calls {sum(shapes.values())}",
                      flush=True)
    return 0


def dataclass_replace_every(trimmer, every: int):
    import dataclasses

    return dataclasses.replace(trimmer, every=every)


if __name__ == "__main__":
    sys.exit(main())
