"""Export validation's noise floor (export/validate.py): where the fixed bound fails, ONNX may differ from PyTorch
by at most NOISE_FACTOR times PyTorch's own float32 error (the larger of its variation at one thread and twice its
distance from a float64 reference, each row run alone without its padding), asked for only then."""
from __future__ import annotations

import numpy as np
import pytest


def test_the_noise_floor_is_asked_for_only_when_the_fixed_bound_fails():
    from mirrorsd.export.validate import NOISE_FACTOR, compare

    want = np.zeros((1, 3, 4), np.float32)
    valid = np.ones((1, 3), np.int64)
    asked = []

    def noise(value):
        return lambda: asked.append(value) or value

    close = compare("x", want + 1e-5, want, valid, (1e-4, 1e-4), noise(1.0))
    assert close.passed and not asked
    far = want.copy()
    far[0, 1, 2] = 0.03
    covered = compare("x", far, want, valid, (1e-4, 1e-4), noise(0.02))
    assert covered.passed and covered.tolerance == pytest.approx(NOISE_FACTOR * 0.02) and asked == [0.02]
    assert not compare("x", far, want, valid, (1e-4, 1e-4), noise(0.01)).passed  # 0.03 > 2 x 0.01
    assert not compare("x", far, want, valid, (1e-4, 1e-4)).passed  # no floor given: the fixed bound alone
    masked = valid.copy()
    masked[0, 1] = 0
    assert compare("x", far, want, masked, (1e-4, 1e-4)).passed  # padding is never compared


def test_the_noise_is_pytorch_against_itself_at_one_thread_and_in_float64(tiny_model):
    import torch

    from mirrorsd.export.loading import open_model
    from mirrorsd.export.validate import Validation, torch_reference

    source = open_model(tiny_model("qwen2", layers=2), False)
    v = Validation(source, runner=None, exit_layer=1)
    ids, mask, pos = v.batch("target")
    default = torch_reference(source, ids, mask, pos, source.info.num_layers, 1)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = torch_reference(source, ids, mask, pos, source.info.num_layers, 1)
    finally:
        torch.set_num_threads(before)
    exact = v.reference64("target")
    valid = mask.astype(bool)
    assert not valid.all() and exact[0].dtype == np.float64 and exact[0].shape == default[0].shape
    assert np.isnan(exact[0][~valid]).all() and np.isfinite(exact[0][valid]).all()
    with v.float64():  # the padded row alone, without its padding
        row = torch_reference(source, ids[1:, valid[1]], mask[1:, valid[1]], pos[1:, valid[1]],
                              source.info.num_layers, 1)
    for output in (0, 1):
        assert np.array_equal(exact[output][1, valid[1]], row[output][0])
        threads = float(np.max(np.abs(one[output][valid] - default[output][valid])))
        precision = float(np.max(np.abs(exact[output][valid] - default[output][valid])))
        assert 0 < precision < 1e-3  # float32 rounding, not another model
        assert v.noise("target", output)() == max(threads, 2 * precision)
    assert torch.get_num_threads() == before  # the reference at one thread gives the threads back
    assert np.array_equal(v.reference("target")[0], default[0])


def test_float64_gives_the_model_back_in_float32(tiny_model):
    import torch

    from mirrorsd.export.loading import open_model
    from mirrorsd.export.validate import Validation

    source = open_model(tiny_model("qwen2", layers=2), False)
    v = Validation(source, runner=None, exit_layer=1)
    first = v.reference("target")[0]
    with v.float64():
        assert source.weights is None or source.weights.dtype == torch.float64
        assert all(p.dtype == torch.float64 for p in source.model.parameters())
    assert source.weights is None or source.weights.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in source.model.parameters())
    v.reference64("target")
    v.shared.clear()
    assert np.array_equal(v.reference("target")[0], first)  # nothing was left rounded or converted
