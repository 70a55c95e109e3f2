"""Skip markers shared by the test modules: what a test needs that a machine may lack, said once."""
from __future__ import annotations

import pytest

from mirrorsd.devices.probe import probe

HAS_OPENVINO = probe().openvino_version is not None
needs_openvino = pytest.mark.skipif(not HAS_OPENVINO, reason="the openvino package is not installed "
                                    "(pip install -e '.[openvino]'; scripts/setup.sh does)")
