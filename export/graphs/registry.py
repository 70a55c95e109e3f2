"""Every graph module by role, for code that starts from an export folder's manifest (``mirrorsd quantize``, tests).

The export pipeline names its graph modules itself (pipeline.TARGET_GRAPHS, DRAFT_GRAPHS and the optional ones);
this table adds nothing but the lookup by role.
"""
from __future__ import annotations

from mirrorsd.export.graphs import draft, draft_static, exit_head, prefix, suffix
from mirrorsd.export.streaming import graph as draft_streaming

MODULES = {m.ROLE: m for m in (prefix, exit_head, suffix, draft, draft_static, draft_streaming)}


def module_for(role: str):
    return MODULES[role]


def quantized_roles(roles, model: str) -> list[str]:
    """The roles among ``roles`` of ``model`` that --precision quantizes, in the given order."""
    return [r for r in roles if MODULES[r].MODEL == model and MODULES[r].QUANTIZED]


def effect_owner(model: str) -> str:
    """The role whose manifest entry records the effect of quantizing ``model`` on its logits."""
    return next(r for r, m in MODULES.items() if m.QUANT_EFFECT == model)


def tolerances() -> dict[str, tuple[float, float]]:
    """Every validation check any graph records, with its tolerance."""
    return {name: tol for m in MODULES.values() for name, tol in m.CHECKS.items()}
