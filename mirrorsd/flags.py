"""Command-line flags made from settings dataclasses: a flag's destination and default are its field's, so each
setting is defined once (in GenerationConfig, BenchOptions, ExportOptions, TrainOptions) and the CLI follows it.

    add(group, GenerationConfig, "gamma", help=...)            --gamma, type int, default GenerationConfig.gamma
    add(group, GenerationConfig, "exit_head", "--no-exit-head")  a True default: the flag switches it off
    build(GenerationConfig, args)                               GenerationConfig from the flags named after its fields
"""
from __future__ import annotations

import argparse
from dataclasses import MISSING, fields


def default(cls, name: str):
    """The default of field ``name`` of the dataclass ``cls`` (None for a required field)."""
    for f in fields(cls):
        if f.name == name:
            return None if f.default is MISSING else f.default
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def add(group, cls, name: str, *flags: str, **kw) -> argparse.Action:
    """A flag (``--name-with-dashes`` unless ``flags`` are given) for field ``name`` of ``cls``. A bool field becomes
    a switch towards the other value; otherwise the type is the default's, unless ``type`` is given."""
    value = default(cls, name)
    if isinstance(value, bool):
        kw.setdefault("action", "store_false" if value else "store_true")
    elif value is not None and "action" not in kw:
        kw.setdefault("type", type(value))
    return group.add_argument(*(flags or ("--" + name.replace("_", "-"),)), dest=name, default=value, **kw)


def build(cls, args: argparse.Namespace, **values):
    """``cls`` from the parsed flags whose names are its fields; ``values`` are given explicitly (and win)."""
    names = {f.name for f in fields(cls)}
    return cls(**{**{k: v for k, v in vars(args).items() if k in names}, **values})
