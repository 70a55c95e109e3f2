"""Bad input through libmirrorsd's C ABI, run in a child process by tests/test_native.py (so that a crash shows as a
failed test, not as a dead test runner). Prints one JSON line: [[case, status, message], ...].

    python tests/native_bad_input.py LIBRARY GOOD_EXPORT_FOLDER WORK_FOLDER
"""
from __future__ import annotations

import ctypes
import json
import math
import os
import shutil
import sys
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for mirrorsd.runtime.native's structs

from mirrorsd.runtime.native import (TOKEN_CALLBACK, GenerateConfig, ModelInfo, OpenOptions, Stats,  # noqa: E402
                                     load_library)


def external_graph(location: str, nested: bool) -> bytes:
    """y = x + w with w's bytes in the external file ``location`` (inside an If branch when ``nested``)."""
    w = numpy_helper.from_array(np.ones(4, np.float32), "w")
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", "16")):
        entry = w.external_data.add()
        entry.key, entry.value = key, value
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    if not nested:
        graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g", [x], [y], [w])
    else:
        then = helper.make_graph([helper.make_node("Constant", [], ["y"], value=w)], "then", [], [y])
        other = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "else", [], [y])
        cond = helper.make_tensor_value_info("cond", TensorProto.BOOL, [])
        graph = helper.make_graph([helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)],
                                  "g", [cond, x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def folders(good: Path, work: Path) -> dict[str, Path]:
    """A damaged copy of ``good`` per case."""
    out = {}

    def copy(name: str, edit=None, manifest_edit=None) -> None:
        folder = work / name
        shutil.copytree(good, folder)
        if manifest_edit is not None:
            data = json.loads((folder / "mirrorsd.json").read_text())
            manifest_edit(data)
            (folder / "mirrorsd.json").write_text(json.dumps(data))
        if edit is not None:
            edit(folder)
        out[name] = folder

    (work / "empty").mkdir()
    out["no manifest"] = work / "empty"
    copy("garbage json", edit=lambda f: (f / "mirrorsd.json").write_text("{not json"))
    copy("schema version", manifest_edit=lambda m: m.update(schema_version=99))
    copy("missing graph", manifest_edit=lambda m: m["graphs"].pop("draft"))
    copy("file outside", manifest_edit=lambda m: m["graphs"]["suffix"].update(file="../suffix.onnx"))
    copy("absolute file", manifest_edit=lambda m: m["graphs"]["suffix"].update(file="/etc/passwd"))
    copy("wrong dtype", manifest_edit=lambda m: m["graphs"]["draft"]["inputs"][0].update(dtype="float16"))
    copy("graph deleted", edit=lambda f: (f / "draft.onnx").unlink())
    copy("graph truncated", edit=lambda f: (f / "prefix.onnx").write_bytes((f / "prefix.onnx").read_bytes()[:999]))
    copy("not a graph", edit=lambda f: (f / "suffix.onnx").write_bytes(b"\x08\x07" + b"\xff" * 64))
    secret = work / "secret.bin"
    secret.write_bytes(np.full(4, 7, np.float32).tobytes())
    copy("external dotdot", edit=lambda f: (f / "prefix.onnx").write_bytes(external_graph("../secret.bin", False)))
    copy("external absolute", edit=lambda f: (f / "draft.onnx").write_bytes(external_graph(str(secret), False)))
    copy("external nested", edit=lambda f: (f / "suffix.onnx").write_bytes(external_graph("../secret.bin", True)))
    copy("external symlink", edit=lambda f: (os.symlink(secret, f / "link.bin"),
                                             (f / "prefix.onnx").write_bytes(external_graph("link.bin", False))))
    return out


def main() -> None:
    lib, good, work = load_library(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    results = []

    def record(case: str, status: int) -> None:
        results.append([case, status, (lib.mirrorsd_last_error() or b"").decode()])

    def options(**fields) -> OpenOptions:
        o = OpenOptions()
        lib.mirrorsd_open_options_init(ctypes.byref(o))
        for key, value in fields.items():
            setattr(o, key, value.encode() if isinstance(value, str) else value)
        return o

    def open_folder(case: str, folder, opts=None) -> ctypes.c_void_p:
        handle = ctypes.c_void_p()
        record(case, lib.mirrorsd_open(None if folder is None else os.fsencode(folder),
                                       None if opts is None else ctypes.byref(opts), ctypes.byref(handle)))
        return handle

    open_folder("open: NULL folder", None)
    record("open: NULL model", lib.mirrorsd_open(os.fsencode(good), None, None))
    open_folder("open: no such folder", work / "nowhere")
    for case, folder in folders(good, work).items():
        open_folder(f"open: {case}", folder)
    open_folder("open: bad struct_size", good, options(struct_size=3))
    open_folder("open: negative threads", good, options(target_threads=-2))
    for device in ("bogus", "cuda", "dml", "openvino:CPU", "ort-openvino:NPU", "ort-openvino:CPU"):
        open_folder(f"open: device {device}", good, options(draft_device=device))

    open_folder("open: kernels missing", good, options(kernels_library=str(work / "nowhere" / "kern.so")))
    old = open_folder("open: ABI 1 struct_size", good, options(struct_size=OpenOptions.kernels_library.offset))
    info = ModelInfo(struct_size=ModelInfo.target_kernels.offset, target_kernels=b"untouched")
    record("info: ABI 1 struct_size", lib.mirrorsd_model_get_info(old, ctypes.byref(info)))
    results.append(["ABI 1 info", info.struct_size, f"{info.target_provider.decode()} {info.target_kernels.decode()}"])
    lib.mirrorsd_close(old)

    model = open_folder("open: good", good)
    tokens = []
    keep = TOKEN_CALLBACK(lambda token, _: tokens.append(token) or 0)

    def generate(case: str, handle=model, ids=(1, 17, 42), length=None, config=None, callback=keep, stats=None,
                 **fields) -> None:
        if config is None:
            config = GenerateConfig()
            lib.mirrorsd_generate_config_init(ctypes.byref(config))
            config.max_new_tokens = 6
            for key, value in fields.items():
                setattr(config, key, value)
        prompt = None if ids is None else (ctypes.c_int64 * max(len(ids), 1))(*ids)
        record(case, lib.mirrorsd_generate(handle, prompt, len(ids or ()) if length is None else length,
                                           None if config is False else ctypes.byref(config), callback, None,
                                           None if stats is None else ctypes.byref(stats)))

    generate("generate: NULL model", handle=None)
    generate("generate: NULL prompt", ids=None, length=3)
    generate("generate: empty prompt", ids=())
    generate("generate: negative length", length=-1)
    generate("generate: id -1", ids=(1, -1))
    generate("generate: id = vocab", ids=(1, 10**6))
    generate("generate: prompt over the context", ids=tuple(range(5)) * 200)
    generate("generate: NULL callback", callback=TOKEN_CALLBACK())
    generate("generate: NULL config", config=False)
    generate("generate: bad config struct_size", struct_size=7)
    generate("generate: gamma 0", gamma=0)
    generate("generate: mode 7", mode=7)
    generate("generate: budget 5", branch_budget=5)
    generate("generate: timeout NaN", draft_timeout_s=math.nan)
    generate("generate: bad stats struct_size", stats=Stats(struct_size=1))
    tokens.clear()
    generate("generate: good after errors", mode=2)
    results.append(["tokens after errors", len(tokens), ""])
    stop = TOKEN_CALLBACK(lambda token, _: tokens.append(token) or int(len(tokens) >= 3))
    tokens.clear()
    stats = Stats(struct_size=ctypes.sizeof(Stats))
    generate("generate: callback stops", callback=stop, stats=stats, mode=2, max_new_tokens=20)
    results.append(["stopped", len(tokens), f"finish {stats.finish_reason} new {stats.new_tokens}"])
    results.append(["closed", lib.mirrorsd_close(model) + lib.mirrorsd_close(None), ""])
    print(json.dumps(results))


if __name__ == "__main__":
    main()
