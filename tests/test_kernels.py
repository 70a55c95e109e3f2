"""mirrorsd's MatMulNBits kernel (devices/kernels) in real ONNX Runtime sessions: every row's bits independent of M
and of the thread count, the instruction-set paths bit for bit equal, the error within the bound its quantization
implies, clear errors for what it refuses. Symmetric weights and weights with float zero points alike."""
from __future__ import annotations

import contextlib
import ctypes
import platform
import sys
from dataclasses import replace

import numpy as np
import pytest
from kernel_graphs import (activation_error_bound, library_or_skip, model_bytes, open_session, quantize_q4k,
                           random_layers, reference, run)

from mirrorsd.devices import kernels

ort = pytest.importorskip("onnxruntime")
PATHS = ("amx", "avx512vnni", "avx2", "scalar")
# every tile shape of every path (tiles of at most 6 rows on AVX2, 8 on AVX-512 VNNI, 16 on AMX) and uneven splits
# into tiles
ROWS = (*range(1, 18), 23, 33)
# what each path needs of the CPU (and of the OS), said when a test skips it
NEEDS = {"amx": "AMX tiles (amx_tile, amx_int8) with AVX-512 VNNI, and Linux granting the tile state",
         "avx512vnni": "AVX-512 F/BW/VL and VNNI", "avx2": "AVX2 and FMA", "scalar": "nothing"}
# every numerics test runs on symmetric weights and on weights with float zero points (input 3)
ZERO_POINTS = pytest.mark.parametrize("zero_points", [False, True], ids=["symmetric", "float_zero_points"])


@pytest.fixture(scope="module")
def lib():
    return library_or_skip()


def need(lib, path: str) -> None:
    if not lib.paths.get(path):
        pytest.skip(f"this CPU cannot run the {path} path: it needs {NEEDS[path]}")


@ZERO_POINTS
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("path", PATHS)
def test_rows_are_bitwise_independent_of_m_and_threads(lib, path, bits, zero_points, monkeypatch):
    need(lib, path)
    rng = np.random.default_rng(bits)
    # K = 200 and 1000 are not multiples of 32, N = 100 and 1100 not of 16; the 1000 -> 1100 layer (> 512 KB packed)
    # is split into ParallelFor tasks over the columns
    single = model_bytes(random_layers(rng, [200, 100], bits, bias=True, zero_points=zero_points), kernels.DOMAIN)
    chain = model_bytes(random_layers(rng, [200, 1000, 1100, 64], bits, bias=True, zero_points=zero_points),
                        kernels.DOMAIN)
    a = rng.standard_normal((max(ROWS), 200)).astype(np.float32)
    for model in (single, chain):
        alone_by_threads = []
        for threads in (1, 2):
            session = open_session(model, monkeypatch, threads, isa=path)
            alone = np.concatenate([run(session, a[i:i + 1]) for i in range(len(a))])
            for m in ROWS:
                np.testing.assert_array_equal(run(session, a[:m]), alone[:m], err_msg=f"M={m} threads={threads}")
            alone_by_threads.append(alone)
        np.testing.assert_array_equal(alone_by_threads[0], alone_by_threads[1])


@ZERO_POINTS
@pytest.mark.parametrize("bits", [4, 8])
def test_paths_agree_bit_for_bit(lib, bits, zero_points, monkeypatch):
    runnable = [p for p in PATHS if lib.paths.get(p)]
    if len(runnable) < 2:
        pytest.skip(f"this CPU runs only {runnable}")
    rng = np.random.default_rng(10 + bits)
    model = model_bytes(random_layers(rng, [200, 1000, 100], bits, bias=True, zero_points=zero_points),
                        kernels.DOMAIN)
    a = rng.standard_normal((13, 200)).astype(np.float32)
    outputs = {p: run(open_session(model, monkeypatch, 2, isa=p), a) for p in runnable}
    for p in runnable[1:]:
        np.testing.assert_array_equal(outputs[p], outputs[runnable[0]], err_msg=f"{p} vs {runnable[0]}")


def prefetch_setting(lib) -> int:
    handle = ctypes.CDLL(str(lib.path))
    handle.mirrorsd_kern_prefetch.restype = ctypes.c_int
    return handle.mirrorsd_kern_prefetch()


def test_prefetch_follows_the_setting_and_changes_no_bit(lib, monkeypatch):
    """MIRRORSD_KERNELS_PREFETCH=0/1 turns the tiles' prefetching off/on, N on for tiles of N rows or more, anything
    else is ignored; unset, every tile prefetches, except on the AVX-512 path of a CPU that is not Intel's (the vendor
    /proc/cpuinfo names): tiles of 5 rows or more there. Every path this CPU runs gives the same bits every way, with and without zero points and
    in super-blocks (7 rows: one tile of 7 on the AVX-512 and AMX paths, tiles of 4 and 3 on the AVX2 path)."""
    monkeypatch.delenv("MIRRORSD_KERNELS_PREFETCH", raising=False)
    monkeypatch.delenv(kernels.ISA_ENV, raising=False)
    vendor = next((line.split(":")[1].strip() for line in open("/proc/cpuinfo") if line.startswith("vendor_id")), "")
    for path in (p for p in PATHS if lib.paths.get(p)):
        monkeypatch.setenv(kernels.ISA_ENV, path)
        expected = 5 if path == "avx512vnni" and vendor != "GenuineIntel" else 1
        assert prefetch_setting(lib) == expected, (path, vendor)
    monkeypatch.delenv(kernels.ISA_ENV, raising=False)
    for value in ("0", "1", "4"):
        monkeypatch.setenv("MIRRORSD_KERNELS_PREFETCH", value)
        assert prefetch_setting(lib) == int(value)
    monkeypatch.setenv("MIRRORSD_KERNELS_PREFETCH", "1")
    on = prefetch_setting(lib)
    monkeypatch.delenv("MIRRORSD_KERNELS_PREFETCH")
    default = prefetch_setting(lib)
    monkeypatch.setenv("MIRRORSD_KERNELS_PREFETCH", "yes")
    assert prefetch_setting(lib) == default and on == 1
    rng = np.random.default_rng(30)
    models = [model_bytes(random_layers(rng, [512, 300, 64], 4, zero_points=zp), kernels.DOMAIN) for zp in (False, True)]
    models.append(model_bytes(q4k_layers(rng, [512, 256, 64]), kernels.DOMAIN))
    a = rng.standard_normal((7, 512)).astype(np.float32)
    for path in (p for p in PATHS if lib.paths.get(p)):
        for model in models:
            got = {}
            for value in ("0", "1", "4"):
                monkeypatch.setenv("MIRRORSD_KERNELS_PREFETCH", value)
                got[value] = run(open_session(model, monkeypatch, 2, isa=path), a)
            np.testing.assert_array_equal(got["0"], got["1"], err_msg=path)
            np.testing.assert_array_equal(got["0"], got["4"], err_msg=path)


@ZERO_POINTS
@pytest.mark.parametrize("bits", [4, 8])
def test_every_row_count_equals_the_scalar_path(lib, bits, zero_points, monkeypatch):
    fast = [p for p in PATHS if p != "scalar" and lib.paths.get(p)]
    if not fast:
        pytest.skip("this CPU runs no SIMD path")
    rng = np.random.default_rng(20 + bits)
    model = model_bytes(random_layers(rng, [200, 100, 36], bits, bias=True, zero_points=zero_points),
                        kernels.DOMAIN)  # partial groups
    a = rng.standard_normal((max(ROWS), 200)).astype(np.float32)
    scalar = open_session(model, monkeypatch, 1, isa="scalar")
    for path in fast:
        session = open_session(model, monkeypatch, 2, isa=path)
        for m in ROWS:
            np.testing.assert_array_equal(run(session, a[:m]), run(scalar, a[:m]), err_msg=f"{path} M={m}")


def special_rows(K: int) -> np.ndarray:
    """Rows that exercise the rounding corners of step 1, [5, K]."""
    rows = np.zeros((5, K), np.float32)
    rows[0, :] = np.tile(np.arange(-15.5, 16.5, 1.0, dtype=np.float32), K // 32 + 1)[:K]  # halves: ties to even
    rows[0, ::32] = 127.0  # max|a| = 127: the inverse is exactly 1, a * inverse is the half itself
    rows[1, : K // 2] = 1e-30  # a zero block and a block of one repeated tiny value
    rows[2, 5] = 3e38  # one huge value next to ordinary ones
    rows[2, 6:40] = np.linspace(-1, 1, 34)
    rows[3, :] = np.float32(2.0) ** np.arange(-20, 20, 40 / K, dtype=np.float32)[:K]
    rows[4, :] = -rows[3, ::-1]
    return rows


@ZERO_POINTS
@pytest.mark.parametrize("bits", [4, 8])
def test_paths_agree_on_rounding_corners(lib, bits, zero_points, monkeypatch):
    runnable = [p for p in PATHS if lib.paths.get(p)]
    rng = np.random.default_rng(30 + bits)
    model = model_bytes(random_layers(rng, [256, 48], bits, zero_points=zero_points), kernels.DOMAIN)
    a = special_rows(256)
    outputs = {}
    for path in runnable:
        session = open_session(model, monkeypatch, 2, isa=path)
        outputs[path] = run(session, a)
        np.testing.assert_array_equal(np.concatenate([run(session, a[i:i + 1]) for i in range(len(a))]),
                                      outputs[path])
    for p in runnable[1:]:
        np.testing.assert_array_equal(outputs[p], outputs[runnable[0]], err_msg=f"{p} vs {runnable[0]}")


@contextlib.contextmanager
def flush_denormals():
    """Turn on flush-to-zero and denormals-are-zero (MXCSR bits 15 and 6) in this thread, as ONNX Runtime's
    session.set_denormal_as_zero or another library may; glibc's x86-64 fenv_t keeps MXCSR at byte 28."""
    libc = ctypes.CDLL(None)
    saved = ctypes.create_string_buffer(32)
    assert libc.fegetenv(saved) == 0
    mxcsr = int.from_bytes(saved.raw[28:32], "little") | 0x8040
    assert libc.fesetenv(ctypes.create_string_buffer(saved.raw[:28] + mxcsr.to_bytes(4, "little"))) == 0
    try:
        yield
    finally:
        libc.fesetenv(saved)


@pytest.mark.skipif(not (sys.platform.startswith("linux") and platform.machine() == "x86_64"),
                    reason="sets MXCSR through glibc's x86-64 fenv_t")
@ZERO_POINTS
def test_results_do_not_depend_on_the_callers_float_mode(lib, zero_points, monkeypatch):
    # tiny activations make the per-block scales and the products denormal
    rng = np.random.default_rng(40)
    session = open_session(model_bytes(random_layers(rng, [256, 2000], 4, zero_points=zero_points), kernels.DOMAIN),
                           monkeypatch)
    a = rng.standard_normal((3, 256)).astype(np.float32) * np.float32(1e-36)
    plain = run(session, a)
    assert np.any((plain != 0) & (np.abs(plain) < np.finfo(np.float32).tiny))  # denormal results exist
    with flush_denormals():
        flushed = run(session, a)  # one thread: the kernel runs on this one
    np.testing.assert_array_equal(plain, flushed)


@ZERO_POINTS
@pytest.mark.parametrize("bits", [4, 8])
def test_error_within_the_activation_quantization_bound(lib, bits, zero_points, monkeypatch):
    rng = np.random.default_rng(20 + bits)
    layers = random_layers(rng, [1000, 300], bits, bias=True, zero_points=zero_points)
    a = rng.standard_normal((8, 1000)).astype(np.float32) * np.linspace(0.01, 3, 1000, dtype=np.float32)
    ours = run(open_session(model_bytes(layers, kernels.DOMAIN), monkeypatch, 2), a)
    bound = activation_error_bound(layers[0], a)
    error = np.abs(ours - reference(layers, a))
    assert np.all(error <= bound), f"max error / bound = {np.max(error / bound):.3f}"
    assert np.max(error / bound) > 0.01  # the bound is of the right size, not vacuous
    if zero_points and bits == 8:
        return  # ONNX Runtime's CPU kernel refuses 8-bit weights with float zero points (test_gguf_blocks.py)
    # ONNX Runtime's own kernel (accuracy level 4: int8 activations; with float zero points it dequantizes the
    # weights) obeys the same bound on the same weights
    ort_level4 = run(ort.InferenceSession(model_bytes(layers, kernels.ORT_DOMAIN), providers=["CPUExecutionProvider"]),
                     a)
    assert np.all(np.abs(ours - ort_level4) <= 2 * bound)


@pytest.mark.parametrize("bits", [4, 8])
def test_zero_points_at_the_center_give_the_symmetric_results(lib, bits, monkeypatch):
    """u = (center - zp) * s = 0 makes the second fma add nothing: the same numbers as without zero points."""
    symmetric = random_layers(np.random.default_rng(50 + bits), [200, 100], bits, bias=True)
    centered = [replace(layer, zero_points=np.full(layer.scales.shape, 2.0 ** (bits - 1), np.float32))
                for layer in symmetric]
    a = np.random.default_rng(60).standard_normal((7, 200)).astype(np.float32)
    for path in (p for p in PATHS if lib.paths.get(p)):
        expected = run(open_session(model_bytes(symmetric, kernels.DOMAIN), monkeypatch, 2, isa=path), a)
        np.testing.assert_array_equal(
            run(open_session(model_bytes(centered, kernels.DOMAIN), monkeypatch, 2, isa=path), a), expected)


BAD_NODES = [
    ({"extra_attributes": {"bits": 3}}, "bits=3"),
    ({"extra_attributes": {"block_size": 64}}, "block_size=64"),
    ({"extra_attributes": {"K": None}}, "attribute 'K' is missing"),
    ({"extra_attributes": {"N": 101}}, "B has shape [100, 7, 16]"),
    ({"zero_points": True}, "packed uint8 zero_points are given"),
    ({"zero_points": np.zeros(3, np.float32)}, "zero_points has 3 values, expected N * ceil(K/32) = 700"),
    ({"zero_points": np.zeros(700, np.float16)}, "zero_points are neither float nor uint8"),
    ({"g_idx": True}, "g_idx is given"),
    ({"B_as_input": True}, "B is not a constant initializer"),
]


@pytest.mark.parametrize("tweak, message", BAD_NODES, ids=[m for _, m in BAD_NODES])
def test_a_node_it_cannot_run_fails_the_session_with_the_reason(lib, tweak, message, monkeypatch):
    layers = random_layers(np.random.default_rng(0), [200, 100], 4)
    with pytest.raises(Exception, match="mirrorsd.kern MatMulNBits node 'mm0'") as caught:
        open_session(model_bytes(layers, kernels.DOMAIN, **tweak), monkeypatch)
    assert message in str(caught.value)


def test_bad_inputs_at_run_time_give_an_error_not_a_crash(lib, monkeypatch):
    layers = random_layers(np.random.default_rng(0), [200, 100], 4)
    session = open_session(model_bytes(layers, kernels.DOMAIN, free_k=True), monkeypatch)
    with pytest.raises(Exception, match=r"A has shape \[2, 201\], whose last dimension is not K=200"):
        run(session, np.zeros((2, 201), np.float32))
    assert run(session, np.zeros((0, 200), np.float32)).shape == (0, 100)  # no rows: an empty output
    assert np.all(np.isfinite(run(session, np.zeros((3, 200), np.float32))))  # all-zero blocks: scale 0, no NaN


def test_an_unknown_or_unsupported_path_is_refused(lib, monkeypatch):
    model = model_bytes(random_layers(np.random.default_rng(0), [64, 32], 4), kernels.DOMAIN)
    with pytest.raises(Exception, match="names no path"):
        open_session(model, monkeypatch, isa="avx9000")
    missing = [p for p in PATHS if not lib.paths.get(p)]
    for path in missing:
        with pytest.raises(Exception, match="names a path this CPU cannot run"):
            open_session(model, monkeypatch, isa=path)


def test_register_refuses_a_bad_replace_value(lib):
    opts = ort.SessionOptions()
    opts.add_session_config_entry(kernels.REPLACE_KEY, "yes")
    with pytest.raises(Exception, match="must be"):
        opts.register_custom_ops_library(str(lib.path))


def arena_counts(lib) -> tuple[int, int, int]:
    """(chunks, bytes reserved, parts live) of the library's packed-weight arena (src/arena.hpp), read through the
    library ONNX Runtime loaded (dlopen of the same path gives the same copy)."""
    handle = ctypes.CDLL(str(lib.path))
    counts = (ctypes.c_size_t * 3)()
    handle.mirrorsd_kern_arena_counts(counts)
    return counts[0], counts[1], counts[2]


def test_packed_weights_share_huge_page_chunks_and_go_back_when_released(lib, monkeypatch):
    import gc

    rng = np.random.default_rng(3)
    # 40 small layers (a few KB packed each): one chunk holds them all, where each used to be an allocation of its own
    model = model_bytes(random_layers(rng, [64] * 41, 4, zero_points=True), kernels.DOMAIN)
    before = arena_counts(lib)
    session = open_session(model, monkeypatch)
    during = arena_counts(lib)
    assert during[2] - before[2] == 40, "every node's packed B is carved from the arena"
    assert during[0] - before[0] <= 1 and during[1] % (2 << 20) == 0, "in whole 2 MiB pages, at most one new chunk"
    a = rng.standard_normal((3, 64)).astype(np.float32)
    first = run(session, a)
    again = run(open_session(model, monkeypatch), a)  # a second session's parts sit beside the first's
    np.testing.assert_array_equal(again, first)
    del session
    gc.collect()
    after = arena_counts(lib)
    assert after == before, "released parts go back, and a chunk they emptied goes back to the system"


def test_reopening_a_graph_while_another_session_lives_does_not_grow_the_arena(lib, monkeypatch):
    """Open, run and close the same graph over and over while another session stays open (its parts keep their
    chunk): what the arena holds from the system does not grow, because a chunk the closed sessions filled goes back
    when they close (their parts in the shared chunk stay unused until it empties: one chunk at most)."""
    import gc

    rng = np.random.default_rng(4)
    # 8 layers of 1024 x 1024 int4 (~0.6 MiB packed each, ~5 MiB a session): 8 sessions would need a second chunk
    model = model_bytes(random_layers(rng, [1024] * 9, 4), kernels.DOMAIN)
    a = rng.standard_normal((2, 1024)).astype(np.float32)
    kept = open_session(model, monkeypatch)
    expected = run(kept, a)
    reserved = []
    for _ in range(8):
        session = open_session(model, monkeypatch)
        np.testing.assert_array_equal(run(session, a), expected)
        del session
        gc.collect()
        reserved.append(arena_counts(lib)[1])
    assert len(set(reserved)) == 1, f"bytes reserved after each reopening: {reserved}"
    np.testing.assert_array_equal(run(kept, a), expected)


def superblock_nodes(lib) -> int:
    """MatMulNBits nodes the loaded library packed in a super-block layout so far (src/superblocks.cpp)."""
    handle = ctypes.CDLL(str(lib.path))
    handle.mirrorsd_kern_superblock_nodes.restype = ctypes.c_size_t
    return handle.mirrorsd_kern_superblock_nodes()


def q4k_layers(rng, dims: list[int], **options) -> list:
    return [quantize_q4k((rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32),
                         rng.standard_normal(N).astype(np.float32) * 0.1, **options)
            for K, N in zip(dims[:-1], dims[1:])]


# the paths with a super-block layout (src/superblocks.cpp; amx and scalar have none)
SUPERBLOCK_PATHS = ("avx512vnni", "avx2")


@pytest.mark.parametrize("largest", [63, 40])
@pytest.mark.parametrize("path", SUPERBLOCK_PATHS)
def test_q4k_nodes_take_the_superblock_layout_and_keep_every_bit(lib, path, largest, monkeypatch):
    """Carried Q4_K weights (scales d * sc, zero points dmin * m / scale) are packed in the path's super-block
    layout (~21 % fewer bytes), and every row's bits equal the usual layout's, the scalar path's, and the row alone,
    for every row count and thread count; largest 40: super-blocks whose largest sc and m are not 63."""
    need(lib, path)
    rng = np.random.default_rng(largest)
    # K = 512, 256 (one super-block), 1536; N = 1100 not a multiple of 8 or 16; the 1536 -> 1100 layer (> 512 KB
    # packed) is split into ParallelFor tasks
    model = model_bytes(q4k_layers(rng, [512, 256, 1536, 1100], largest=largest), kernels.DOMAIN)
    a = rng.standard_normal((max(ROWS), 512)).astype(np.float32)
    before = superblock_nodes(lib)
    sessions = {threads: open_session(model, monkeypatch, threads, isa=path) for threads in (1, 2)}
    assert superblock_nodes(lib) - before == 2 * 3, "every node of both sessions has Q4_K's form"
    usual = open_session(model, monkeypatch, 2, isa=path, superblocks=False)
    scalar = open_session(model, monkeypatch, 1, isa="scalar")
    assert superblock_nodes(lib) - before == 2 * 3, "neither the usual layout nor the scalar path packs them so"
    alone = np.concatenate([run(sessions[1], a[i:i + 1]) for i in range(len(a))])
    for threads, session in sessions.items():
        for m in ROWS:
            np.testing.assert_array_equal(run(session, a[:m]), alone[:m], err_msg=f"M={m} threads={threads}")
    np.testing.assert_array_equal(run(usual, a), alone)
    np.testing.assert_array_equal(run(scalar, a), alone)


@pytest.mark.parametrize("case", ["scale_one_step_off", "k_not_whole_superblocks", "symmetric", "8_bit",
                                  "zero_points_of_no_q4k"])
def test_nodes_without_q4k_form_keep_the_usual_layout(lib, case, monkeypatch):
    """A node whose numbers cannot be written as super-blocks exactly is packed as before (and computes as before):
    one scale a float step off d * sc, K not a multiple of 256, no zero points, 8-bit weights, min-max zero points
    of another quantizer."""
    path = next((p for p in SUPERBLOCK_PATHS if lib.paths.get(p)), None)
    if path is None:
        pytest.skip(f"this CPU runs none of {SUPERBLOCK_PATHS}, the paths with a super-block layout")
    rng = np.random.default_rng(7)
    if case == "scale_one_step_off":
        layers = q4k_layers(rng, [512, 64])
        layers[0].scales[5] = np.nextafter(layers[0].scales[5], np.float32(1.0))
    elif case == "k_not_whole_superblocks":
        layers = random_layers(rng, [288, 64], 4, zero_points=True)
    else:
        layers = random_layers(rng, [512, 64], 8 if case == "8_bit" else 4, zero_points=case != "symmetric")
    model = model_bytes(layers, kernels.DOMAIN)
    before = superblock_nodes(lib)
    session = open_session(model, monkeypatch, 2, isa=path)
    assert superblock_nodes(lib) == before
    a = rng.standard_normal((7, layers[0].K)).astype(np.float32)
    np.testing.assert_array_equal(run(session, a), run(open_session(model, monkeypatch, 1, isa="scalar"), a))


@pytest.mark.parametrize("path", SUPERBLOCK_PATHS)
def test_q4k_nodes_with_constant_blocks_compute_as_before(lib, path, monkeypatch):
    """All-constant blocks (sc = 0: scale = offset, zero point 1) may or may not have a super-block form (the search
    accepts only exact ones); either way the bits are those of the usual layout and of the scalar path."""
    need(lib, path)
    rng = np.random.default_rng(9)
    model = model_bytes(q4k_layers(rng, [512, 256, 64], constant_blocks=5), kernels.DOMAIN)
    a = rng.standard_normal((7, 512)).astype(np.float32)
    expected = run(open_session(model, monkeypatch, 1, isa="scalar"), a)
    for superblocks in (True, False):
        got = run(open_session(model, monkeypatch, 2, isa=path, superblocks=superblocks), a)
        np.testing.assert_array_equal(got, expected, err_msg=f"superblocks={superblocks}")


@pytest.mark.parametrize("path", SUPERBLOCK_PATHS)
def test_q4k_layer_error_within_the_activation_quantization_bound(lib, path, monkeypatch):
    """The super-block layout's results against the float64 product through the carried weights."""
    need(lib, path)
    rng = np.random.default_rng(8)
    layers = q4k_layers(rng, [1536, 300])
    a = rng.standard_normal((5, 1536)).astype(np.float32)
    got = run(open_session(model_bytes(layers, kernels.DOMAIN), monkeypatch, 2, isa=path), a)
    error = np.abs(got - reference(layers, a))
    assert np.all(error <= activation_error_bound(layers[0], a))


def test_python_asks_the_library_which_nodes_take_superblocks(lib, monkeypatch, tmp_path):
    """devices/kernels/superblocks.py puts the kernel's own question to the library for arrays read from a graph, and
    counts 5 bytes per column and block of every node with the form as not streamed; the form is in use only on a
    path that has the layout and while MIRRORSD_KERNELS_SUPERBLOCKS is not 0. The graph is read without onnx."""
    from mirrorsd.devices.kernels import superblocks

    rng = np.random.default_rng(11)
    q4k = q4k_layers(rng, [512, 256, 64])
    off = q4k_layers(rng, [512, 64])[0]
    off.scales[9] = np.nextafter(off.scales[9], np.float32(1.0))
    symmetric = random_layers(rng, [512, 64], 4)[0]
    assert superblocks.has_superblock_form(lib, 512, 256, q4k[0].scales, q4k[0].zero_points)
    assert not superblocks.has_superblock_form(lib, 512, 64, off.scales, off.zero_points)
    assert not superblocks.has_superblock_form(lib, 512, 64, off.scales[:-1], off.zero_points[:-1])  # wrong size
    model = model_bytes([*q4k, off, symmetric], kernels.DOMAIN)
    assert superblocks.bytes_saved(model, tmp_path, lib) == 5 * (256 * 16 + 64 * 8)
    monkeypatch.delenv("MIRRORSD_KERNELS_ISA", raising=False)
    monkeypatch.delenv(superblocks.ENV, raising=False)
    assert superblocks.in_use(lib) == (lib.fast_path in superblocks.PATHS)
    for path, expected in (("avx2", True), ("avx512vnni", True), ("amx", False), ("scalar", False)):
        monkeypatch.setenv("MIRRORSD_KERNELS_ISA", path)
        assert superblocks.in_use(lib) == expected, path
    monkeypatch.setenv("MIRRORSD_KERNELS_ISA", "avx2")
    monkeypatch.setenv(superblocks.ENV, "0")
    assert not superblocks.in_use(lib)


def test_the_bandwidth_ceiling_counts_the_bytes_the_kernel_streams(lib, tmp_path, monkeypatch):
    """mirrorsd.apps.bandwidth.target_weight_bytes: the graph files' bytes, less what the super-block layout does not
    stream when sessions here use it (5 bytes per column and block of each Q4_K-form node), and no less when the
    layout is off. (The manifest is a plain record of the four fields the function reads.)"""
    from types import SimpleNamespace

    from mirrorsd.apps.bandwidth import target_weight_bytes
    from mirrorsd.devices.kernels import superblocks

    monkeypatch.delenv("MIRRORSD_KERNELS_ISA", raising=False)
    monkeypatch.delenv(superblocks.ENV, raising=False)
    if not superblocks.in_use(lib):
        pytest.skip(f"sessions here run {lib.fast_path}, which has no super-block layout")
    rng = np.random.default_rng(12)
    graphs = {"prefix": q4k_layers(rng, [512, 256]), "suffix": random_layers(rng, [256, 64], 4)}
    for role, layers in graphs.items():
        (tmp_path / f"{role}.onnx").write_bytes(model_bytes(layers, kernels.ORT_DOMAIN))
    manifest = SimpleNamespace(export_options={}, target=SimpleNamespace(vocab_size=1, hidden_size=1),
                               graph=lambda role: SimpleNamespace(file=f"{role}.onnx", validation={}))
    files = sum((tmp_path / f"{role}.onnx").stat().st_size for role in graphs)
    assert target_weight_bytes(tmp_path, manifest, kernel_layout=False) == files - 4  # less the 1 x 1 float table
    assert target_weight_bytes(tmp_path, manifest) == files - 4 - 5 * 256 * 16
    monkeypatch.setenv(superblocks.ENV, "0")
    assert target_weight_bytes(tmp_path, manifest) == files - 4
