"""What mirrorsd-train-draft checks before it trains (train.py): every flag before any file is read, what the draft's
and target's configs decide before any weight or target answer, and the draft against the distilled answers."""
from __future__ import annotations

from pathlib import Path

from mirrorsd.errors import ExportOptionError
from mirrorsd.export.streaming import data
from mirrorsd.export.streaming.options import METHODS, TrainOptions


def check_options(options: TrainOptions) -> None:
    """Every flag, before any file is read: the method, and each number in its range (options.limits)."""
    from mirrorsd import ranges
    from mirrorsd.export.streaming.options import limits

    if options.method not in METHODS:
        raise ExportOptionError(f"--method {options.method!r} is unknown", f"it is one of {', '.join(METHODS)}",
                                "pick one of them (lora is the default)")
    ranges.check(options, limits(), ExportOptionError)


def check_sources(options: TrainOptions) -> None:
    """What the draft and target configs decide, read without a weight: the draft has --stream-layers layers to
    carry the streams, and the target's vocabulary (the draft learns the target's token ids)."""
    draft_layers, draft_vocab = model_sizes(options.draft)
    if options.stream_layers > draft_layers:
        raise ExportOptionError(f"--stream-layers {options.stream_layers} is out of range",
                                f"the draft has {draft_layers} layers", "pick fewer stream layers")
    if data.is_export_folder(options.target):
        from mirrorsd.manifest import load_manifest

        target_vocab = load_manifest(Path(options.target).expanduser()).target.vocab_size
    else:
        target_vocab = model_sizes(options.target)[1]
    if target_vocab > draft_vocab:
        raise ExportOptionError("The draft cannot read the target's answers",
                                f"the target's vocabulary has {target_vocab} entries, the draft's {draft_vocab}",
                                "use a draft with the target's tokenizer")


def model_sizes(model) -> tuple[int, int]:
    """(layers, vocabulary rows) of a model: from a Hugging Face folder's checked config.json (no transformers
    import), else from its opened config (a .gguf file, a pinned name)."""
    from mirrorsd.export.loading import open_model, source_path
    from mirrorsd.export.source_checks import check_config_object
    from mirrorsd.errors import ModelSourceError
    from mirrorsd.user_files import JSON_LIMIT, read_json

    config = source_path(model) / "config.json"
    if config.is_file():
        raw = read_json(config, JSON_LIMIT, lambda why: ModelSourceError(f"Cannot read {config}", why,
                                                                         "restore the model's config.json"))
        raw = check_config_object(raw, config)
        if raw.get("num_hidden_layers") and raw.get("vocab_size"):  # else (a nested config): transformers reads it
            return raw["num_hidden_layers"], raw["vocab_size"]
    info = open_model(model).info
    return info.num_layers, info.vocab_size


def check_draft(options: TrainOptions, draft, samples: list[data.Sample]) -> None:
    if options.stream_layers > draft.info.num_layers:
        raise ExportOptionError(f"--stream-layers {options.stream_layers} is out of range",
                                f"the draft has {draft.info.num_layers} layers", "pick fewer stream layers")
    top = max((max(s.tokens) for s in samples), default=0)
    if top >= draft.info.vocab_size or not samples:
        raise ExportOptionError("The draft cannot read the target's answers",
                                f"token id {top} vs draft vocabulary {draft.info.vocab_size}" if samples
                                else "no answer has two tokens or more",
                                "use a draft with the target's tokenizer, and prompts the target answers")
