"""A causal LM whose weights stay on disk: the transformers module tree with every parameter on the meta device.

    skeleton (meta params, real buffers) ──forward──►  embed / layer i / norm / lm_head
                                                       each part loads its tensors just before its forward
                                                       and drops them right after (a forward pre-/post-hook)

So the unchanged transformers forward (its masks, its rotary embedding, its layers) serves as the PyTorch reference
at the cost of one decoder layer in memory, whatever the model's size. ``materialized()`` loads everything, for the
graphs that are still traced whole (the static and the streaming draft).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from mirrorsd.export.architectures import Architecture
from mirrorsd.export.checkpoint import TensorReader, parameter_sources


class LazyWeights:
    """The checkpoint behind a meta skeleton: one tensor, one part, or everything, loaded on demand."""

    def __init__(self, model: nn.Module, reader: TensorReader, dtype: torch.dtype = torch.float32) -> None:
        self.model, self.reader, self.dtype = model, reader, dtype
        self.sources = parameter_sources(model, reader)  # parameter name -> stored tensor (tied weights share)
        self.loaded = False  # True inside materialized(): the hooks leave the parameters alone

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """One parameter by its model name, converted to ``dtype`` (a bf16 tensor costs its fp32 copy only)."""
        return self.reader.get(self.sources[name]).to(dtype or self.dtype)

    def load(self, module: nn.Module, prefix: str) -> None:
        """Real tensors for every parameter of ``module``; names that share one parameter (tied) keep sharing."""
        for names in _tied_groups(module):
            value = nn.Parameter(self.tensor(f"{prefix}{names[0]}"), requires_grad=False)
            for name in names:
                _set(module, name, value)

    def release(self, module: nn.Module) -> None:
        for names in _tied_groups(module):
            shape = _get(module, names[0]).shape
            value = nn.Parameter(torch.empty(shape, dtype=self.dtype, device="meta"), requires_grad=False)
            for name in names:
                _set(module, name, value)

    def attach(self, arch: Architecture, num_layers: int) -> None:
        """Hooks that load each part (embedding, every decoder layer, final norm, LM head) for its forward only."""
        parts = [arch.embed, arch.final_norm, arch.lm_head] + [f"{arch.layers}.{i}" for i in range(num_layers)]
        for dotted in parts:
            module = arch.part(self.model, dotted)
            module.register_forward_pre_hook(self._pre_hook(dotted + "."))
            module.register_forward_hook(self._post_hook())

    def _pre_hook(self, prefix: str):
        def hook(module, args):
            if not self.loaded:
                self.load(module, prefix)
        return hook

    def _post_hook(self):
        def hook(module, args, output):
            if not self.loaded:
                self.release(module)
        return hook

    @contextlib.contextmanager
    def materialized(self) -> Iterator[nn.Module]:
        """The whole model in memory (fp32), released again on exit, errors included."""
        self.load(self.model, "")
        self.loaded = True
        try:
            yield self.model
        finally:
            self.loaded = False
            self.release(self.model)


def skeleton(config: Any, folder, trust_remote_code: bool = False) -> nn.Module:
    """The model's module tree with meta parameters and real (CPU) buffers, and the generation config
    ``from_pretrained`` would attach (the folder's generation_config.json, else one made from the config)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, GenerationConfig

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager",
                                                 trust_remote_code=trust_remote_code)
    model.tie_weights()  # from_config skips it on the meta device; tied parameters must share one tensor
    try:  # what from_pretrained does, GGUF or not (a GGUF's folder rarely has one)
        model.generation_config = GenerationConfig.from_pretrained(folder)
    except OSError:
        pass
    return model.eval()


def _tied_groups(module: nn.Module) -> list[list[str]]:
    groups: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return list(groups.values())


def _get(module: nn.Module, dotted: str) -> nn.Parameter:
    *path, leaf = dotted.split(".")
    for attr in path:
        module = getattr(module, attr)
    return module._parameters[leaf]


def _set(module: nn.Module, dotted: str, value: nn.Parameter) -> None:
    *path, leaf = dotted.split(".")
    for attr in path:
        module = getattr(module, attr)
    module._parameters[leaf] = value
