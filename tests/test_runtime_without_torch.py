"""The runtime (sessions, tokenizer, decoding, devices, CLI generate) works in a process where torch cannot load."""
from __future__ import annotations

import subprocess
import sys

BLOCK_TORCH = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'transformers', 'onnx', 'onnxscript'):
            raise ImportError(f'{name} is blocked: the runtime must not need it')
sys.meta_path.insert(0, _NoTorch())
"""


def test_generate_without_torch(exported):
    folder = exported("llama", draft_layers=2)
    code = BLOCK_TORCH + f"""
from mirrorsd.runtime import GenerationConfig, Pipeline
with Pipeline.load({str(folder)!r}) as pipe:
    for mode in ('ar', 'sd', 'mirror'):
        out = pipe.generate('Hello there', GenerationConfig(mode=mode, max_new_tokens=8))
        assert len(out.tokens) >= 1, mode
from mirrorsd.apps.cli import main
assert main(['generate', '--model', {str(folder)!r}, '--prompt', 'Hi', '--max-new-tokens', '4', '--json']) == 0
assert not any(m.split('.')[0] == 'torch' for m in sys.modules)
print('ok')
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")
