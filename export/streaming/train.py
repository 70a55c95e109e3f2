"""Fine-tune a draft for Speculative Streaming, distilled from the target's greedy answers (``mirrorsd-train-draft``).

    1. data    SpecBench prompts -> the target's greedy answers, cached in OUTPUT/distill-{train,eval}.jsonl
    2. model   the draft + n stream embeddings entering its top ``stream_layers`` layers (StreamingDraft);
               lora: adapters on those layers | top: those layers' weights | full: every weight
    3. loss    CE(main row, next token) + 0.1 * sum_j CE(stream j, the token j + 1 ahead), on answer tokens only.
               lora/top freeze the layers below the streams, so their output h_f is computed once per sample.
    4. state   OUTPUT/train_state/ every --save-every steps, at the end and on Ctrl-C; --resume continues there
    5. result  OUTPUT = merged HF draft + streams.safetensors + streaming.json (written last, marks it complete)
               -> mirrorsd-export --model TARGET --draft OUTPUT --output EXPORT
"""
from __future__ import annotations

import math
import resource
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from mirrorsd import specbench
from mirrorsd.errors import ExportOptionError, OutputFolderError
from mirrorsd.export.streaming import checkpoint, data
from mirrorsd.export.streaming.evaluate import evaluate, sample_inputs
from mirrorsd.export.streaming.lora import add_adapters, merge_adapters
from mirrorsd.user_files import resolved
from mirrorsd.export.streaming.model import (EMBEDDINGS_FILE, EMBEDDINGS_KEY, STREAM_LOSS_WEIGHT, STREAMING_FILE,
                                             StreamingConfig, StreamingDraft)
from mirrorsd.export.streaming.options import METHODS, TrainOptions

EMBEDDING_LR_SCALE = 10.0  # Adam moves a weight by ~lr per step whatever its size; the stream embeddings live at
#                            the residual stream's scale (about 1), far above adapter weights, so they get 10x
GRAD_CLIP = 1.0
DISTILL_KEYS = ("target", "prompts", "train_prompts", "eval_prompts", "holdout", "max_prompt_tokens",
                "max_new_tokens", "seed")  # the cached answers are reused only while these are unchanged
RESUME_KEYS = DISTILL_KEYS + ("draft", "streams", "stream_layers", "method", "lora_rank", "lora_alpha", "lr",
                              "warmup_steps", "anchors", "grad_accum")


@dataclass
class TrainResult:
    folder: Path
    config: StreamingConfig
    steps: int
    seconds: float
    losses: list[float] = field(default_factory=list)  # total loss per optimizer step of this run
    stream_losses: list[list[float]] = field(default_factory=list)  # per step: one per stream


def train(options: TrainOptions, log=lambda line: print(line, file=sys.stderr, flush=True)) -> TrainResult:
    """Distil, train, evaluate and write the streaming draft folder (see the module docstring)."""
    from mirrorsd.output_folder import StagedFolder, publish

    started = time.perf_counter()
    _check_options(options)
    output = resolved(options.output, "--output", OutputFolderError)
    record = _prepare_output(options, output)
    _check_sources(options)  # config and tokenizer only: before the target answers a single prompt
    threads = torch.get_num_threads()
    torch.set_num_threads(options.threads or threads)
    try:
        if options.resume:  # the saved run is continued where it lies (a folder this command wrote)
            return _train(options, output, output, record, log, started)
        with StagedFolder(output) as stage:  # a new run: nothing appears at --output until it is complete
            _reuse_answers(output, stage.path)
            try:
                result = _train(options, stage.path, output, None, log, started)
            except KeyboardInterrupt:
                if (stage.path / checkpoint.STATE_DIR).is_dir():  # a saved state: kept for --resume
                    publish(stage.path, output, terminated=True)
                raise
            stage.publish()
        result.folder = output
        return result
    finally:
        torch.set_num_threads(threads)


def _reuse_answers(previous: Path, stage: Path) -> None:
    """Copy the target's cached answers of a folder being replaced (--force) into the new run's scratch folder."""
    if previous.is_dir():
        for entry in previous.iterdir():
            if entry.name.startswith("distill") and entry.is_file() and not entry.is_symlink():
                shutil.copy2(entry, stage / entry.name)


def _train(options: TrainOptions, output: Path, final: Path, record: dict | None, log,
           started: float) -> TrainResult:
    """Train in folder ``output`` (a scratch folder published as ``final`` afterwards, or ``final`` itself)."""
    from mirrorsd.export.loading import load_model

    train_set, eval_set = _distill_data(options, output, log)
    log(f"data: {len(train_set)} training answers, {len(eval_set)} held out")
    if not train_set or not eval_set:
        raise ExportOptionError("No target answers to learn from" if not train_set else "No held-out answers",
                                f"{len(train_set)} training and {len(eval_set)} held-out prompts gave answers of two "
                                "tokens or more", "pass more prompts (--prompts, --train-prompts, --eval-prompts) "
                                "or a larger --max-new-tokens")
    draft = load_model(options.draft)
    _check_draft(options, draft, train_set + eval_set)
    run = _setup(options, draft, train_set)
    step, spent = 0, 0.0
    before = record.get("evaluation_before") if record else None
    if record is not None:
        checkpoint.load_state(output, run.params, run.optimizer)
        step, spent = record["step"], record["train_seconds"]
        log(f"resumed at step {step}")
    if run.trunks.frozen:  # the layers below the streams, once per sample (then every step runs the top only)
        bar = _bar(options, len(train_set) + len(eval_set), 0, "frozen layers", "sample")
        for sample in train_set + eval_set:
            run.trunks.get(sample)
            bar.update(1)
        bar.close()
    if before is None:
        before = evaluate(run.module, eval_set, run.trunks.get)
        log(f"held-out before: {_brief(before)} (RSS {_rss_mb():.0f} MB)")
    result = TrainResult(output, None, step, 0.0)
    save = lambda: checkpoint.save_state(output, run.params, run.optimizer,  # noqa: E731
                                         _record(options, step, spent, before))
    total = _total_steps(options, len(train_set))
    bar = _bar(options, total, step)
    try:
        while step < total and not (options.max_minutes and spent >= 60 * options.max_minutes):
            tick = time.perf_counter()
            loss, parts = _optimizer_step(run, step)
            step, spent = step + 1, spent + time.perf_counter() - tick
            result.losses.append(loss)
            result.stream_losses.append(parts)
            bar.set_postfix(loss=f"{loss:.3f}", s1=f"{parts[0]:.3f}", s_step=f"{spent / step:.2f}")
            bar.update(1)
            if options.save_every and step % options.save_every == 0 and step < total:
                save()
    except KeyboardInterrupt:
        bar.close()
        save()
        log(f"interrupted at step {step}: state saved in {final / checkpoint.STATE_DIR}; continue with --resume")
        raise
    bar.close()
    save()
    after = evaluate(run.module, eval_set, run.trunks.get)
    log(f"held-out after:  {_brief(after)} (RSS {_rss_mb():.0f} MB)")
    training = {"train_samples": len(train_set), "eval_samples": len(eval_set), "steps": step,
                "train_seconds": round(spent, 1), "seconds_per_step": round(spent / max(step, 1), 2),
                "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    result.config = _finalize(options, output, draft, run.module, step, {"before": before, "after": after},
                              training)
    result.steps, result.seconds = step, time.perf_counter() - started
    return result


@dataclass
class _Run:
    options: TrainOptions
    module: StreamingDraft
    trunks: "_TrunkCache"
    params: dict
    optimizer: torch.optim.Optimizer
    base_lrs: list[float]
    train_set: list[data.Sample]


def _setup(options: TrainOptions, draft, train_set: list[data.Sample]) -> _Run:
    torch.manual_seed(options.seed)
    init = torch.randn(options.streams, draft.info.hidden_size)
    module = StreamingDraft(draft.model, draft.arch, init, options.stream_layers).eval()  # eval: no dropout
    trunks = _TrunkCache(module, frozen=options.method != "full")
    with torch.no_grad():  # entries as large as a typical entry of h_f (the median: a few dims are huge)
        module.stream_embeddings.mul_(trunks.get(train_set[0]).abs().median())
    params = _make_trainable(options, module)
    optimizer = torch.optim.AdamW([
        {"params": [p for n, p in params.items() if n != EMBEDDINGS_KEY], "lr": options.lr},
        {"params": [params[EMBEDDINGS_KEY]], "lr": options.lr * EMBEDDING_LR_SCALE}], weight_decay=0.0)
    return _Run(options, module, trunks, params, optimizer, [g["lr"] for g in optimizer.param_groups], train_set)


def _optimizer_step(run: _Run, step: int) -> tuple[float, list[float]]:
    """One optimizer step over ``grad_accum`` samples; returns (total loss, per-stream losses)."""
    options = run.options
    run.optimizer.zero_grad(set_to_none=True)
    for group, base in zip(run.optimizer.param_groups, run.base_lrs):  # linear warm-up, then constant
        group["lr"] = base * min(1.0, (step + 1) / max(1, options.warmup_steps))
    total, parts = 0.0, [0.0] * options.streams
    for micro in range(options.grad_accum):
        index = step * options.grad_accum + micro
        sample = run.train_set[_order(options.seed, len(run.train_set), index)]
        loss, streams = _sample_loss(run.module, sample, run.trunks.get(sample), options.anchors,
                                     torch.Generator().manual_seed(options.seed * 1_000_003 + index))
        (loss / options.grad_accum).backward()
        total += float(loss.detach()) / options.grad_accum
        parts = [a + float(b.detach()) / options.grad_accum for a, b in zip(parts, streams)]
    torch.nn.utils.clip_grad_norm_(list(run.params.values()), GRAD_CLIP)
    run.optimizer.step()
    return total, parts


def _sample_loss(module: StreamingDraft, sample: data.Sample, h_f: torch.Tensor, anchors: int,
                 generator: torch.Generator) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """CE(main) + 0.1 * sum_j CE(stream j) on one sample; anchors drawn among the answer positions."""
    tokens, mask, positions = sample_inputs(sample)
    length, p, n = tokens.shape[1], len(sample.prompt), module.streams
    candidates = torch.arange(p - 1, length - 2)  # anchor t: stream 1's label t + 2 must exist
    if len(candidates) > anchors:
        candidates = candidates[torch.randperm(len(candidates), generator=generator)[:anchors]].sort().values
    anchor_ids = candidates.repeat_interleave(n)  # [Q]
    stream_ids = torch.arange(n).repeat(len(candidates))  # [Q]: j - 1
    main, streams = module.top(h_f, mask, positions, anchor_ids, stream_ids)
    main_loss = F.cross_entropy(module.head(main[0, p - 1:length - 1]), tokens[0, p:])
    label_at = anchor_ids + 2 + stream_ids  # stream j at t predicts token t + 1 + j
    valid = label_at < length
    labels = torch.where(valid, tokens[0, label_at.clamp(max=length - 1)], -100)
    ce = F.cross_entropy(module.head(streams[0]), labels, ignore_index=-100, reduction="none")  # [Q]
    per_stream = [ce[(stream_ids == j) & valid].mean() if bool(((stream_ids == j) & valid).any())
                  else ce.sum() * 0.0 for j in range(n)]
    return main_loss + STREAM_LOSS_WEIGHT * sum(per_stream), per_stream


class _TrunkCache:
    """h_f per sample: computed once when the layers below the streams are frozen, every time otherwise."""

    def __init__(self, module: StreamingDraft, frozen: bool) -> None:
        self.module, self.frozen, self.saved = module, frozen, {}

    def get(self, sample: data.Sample) -> torch.Tensor:
        key = (sample.question_id, len(sample.prompt))
        if key in self.saved:
            return self.saved[key]
        tokens, mask, positions = sample_inputs(sample)
        if not self.frozen:
            return self.module.trunk(tokens, mask, positions)
        with torch.no_grad():
            self.saved[key] = self.module.trunk(tokens, mask, positions)
        return self.saved[key]


def _make_trainable(options: TrainOptions, module: StreamingDraft) -> dict[str, torch.nn.Parameter]:
    for p in module.parameters():
        p.requires_grad_(options.method == "full")
    streamed = module.layers[module.first_streamed:]
    if options.method == "lora":
        add_adapters(streamed, options.lora_rank, options.lora_alpha)
    elif options.method == "top":
        for p in streamed.parameters():
            p.requires_grad_(True)
    module.stream_embeddings.requires_grad_(True)
    return {name: p for name, p in module.named_parameters() if p.requires_grad}


def _order(seed: int, count: int, index: int) -> int:
    """The sample of global micro-step ``index``: a fresh fixed permutation per epoch (resumable)."""
    import random

    epoch, offset = divmod(index, count)
    order = list(range(count))
    random.Random(seed * 7919 + epoch).shuffle(order)
    return order[offset]


def _total_steps(options: TrainOptions, samples: int) -> int:
    if options.max_steps is not None:
        return options.max_steps
    return max(1, math.ceil(options.epochs * samples / options.grad_accum))


def _distill_data(options: TrainOptions, output: Path, log) -> tuple[list[data.Sample], list[data.Sample]]:
    import json

    meta_path = output / "distill.json"
    meta = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items() if k in DISTILL_KEYS}
    files = output / "distill-train.jsonl", output / "distill-eval.jsonl"
    if _cached_meta(meta_path) == meta and all(f.is_file() for f in files):
        cached = data.load_samples(files[0]), data.load_samples(files[1])
        if all(cached):  # a damaged cache is answered again
            log("reusing the target's cached answers")
            return cached
    train_q, held_q = specbench.held_out(specbench.read(options.prompts, "--prompts"), options.holdout)
    log(f"loading target {options.target}")
    target = _target(options)
    chat = data.has_chat_template(target)
    if not chat:
        log("the target has no chat template: its prompts are raw completion (as mirrorsd bench runs them)")
    sets = []
    try:
        for questions, count, name in ((train_q, options.train_prompts, "train"),
                                       (held_q, options.eval_prompts, "eval")):
            prompts = data.encode(target.tokenizer, data.pick(questions, None, options.seed),
                                  options.max_prompt_tokens, chat)[:count]  # count after dropping long prompts
            bar = _bar(options, len(prompts), 0, f"target answers ({name})", "prompt")
            tick = time.perf_counter()
            samples = data.answer_all(target, prompts, options.generation_batch, target.eos_ids, bar.update)
            bar.close()
            tokens = sum(len(s.completion) for s in samples)
            log(f"target answers ({name}): {len(samples)} prompts, {tokens} tokens in "
                f"{time.perf_counter() - tick:.0f} s")
            sets.append([s for s in samples if len(s.completion) >= 2])
    finally:
        target.close()
    del target
    data.save_samples(files[0], sets[0])
    data.save_samples(files[1], sets[1])
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return sets[0], sets[1]


def _cached_meta(path: Path) -> dict | None:
    """The options the cached answers were made with, or None (none there, or an unreadable file: made again)."""
    from mirrorsd.user_files import JSON_LIMIT, read_json

    if not path.is_file():
        return None
    try:
        return read_json(path, JSON_LIMIT, lambda why: ExportOptionError(f"Cannot read {path}", why))
    except ExportOptionError:
        return None


def _finalize(options, output: Path, draft, module: StreamingDraft, steps: int, evaluation: dict,
              training: dict) -> StreamingConfig:
    from safetensors.torch import save_file

    if options.method == "lora":
        merge_adapters(draft.model)
    draft.model.save_pretrained(str(output), safe_serialization=True)
    draft.tokenizer.save_pretrained(str(output))
    save_file({EMBEDDINGS_KEY: module.stream_embeddings.detach().contiguous()}, str(output / EMBEDDINGS_FILE))
    config = StreamingConfig(options.streams, options.stream_layers, draft.info.num_layers, draft.info.hidden_size,
                             str(options.draft), str(options.target), options.method,
                             options.lora_rank if options.method == "lora" else 0, steps, STREAM_LOSS_WEIGHT,
                             evaluation, training)
    config.save(output)  # last: its presence marks a complete streaming draft
    return config


def _record(options: TrainOptions, step: int, spent: float, before: dict) -> dict:
    view = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items() if k in RESUME_KEYS}
    return {"step": step, "train_seconds": spent, "options": view, "evaluation_before": before}


def _prepare_output(options: TrainOptions, output: Path) -> dict | None:
    """Check the output folder; returns the saved state record when resuming."""
    from mirrorsd.export.loading import source_path
    from mirrorsd.output_folder import STREAMING_DRAFT, check_output

    sources = [source_path(options.draft), source_path(options.target)]
    check_output(options.output, sources, options.force or options.resume, STREAMING_DRAFT)
    record = checkpoint.read_record(output) if output.is_dir() else None
    if options.resume:
        if record is None:
            raise OutputFolderError(f"Nothing to resume in {output}", f"it has no {checkpoint.STATE_DIR}/",
                                    "drop --resume to start a new training")
        mine = _record(options, 0, 0.0, {})["options"]
        changed = sorted(k for k in RESUME_KEYS if record["options"].get(k) != mine.get(k))
        if changed:
            raise ExportOptionError(f"--resume with other options than the saved run: {', '.join(changed)}",
                                    "the saved state belongs to those settings",
                                    "repeat the first run's options (epochs, max-steps and max-minutes may change)")
        (output / STREAMING_FILE).unlink(missing_ok=True)  # the folder is incomplete until _finalize
        return record
    return None  # a new run: written into a scratch folder and published at the end (a --force run included)


def _check_options(options: TrainOptions) -> None:
    """Every flag, before any file is read: the method, and each number in its range (options.limits)."""
    from mirrorsd import ranges
    from mirrorsd.export.streaming.options import limits

    if options.method not in METHODS:
        raise ExportOptionError(f"--method {options.method!r} is unknown", f"it is one of {', '.join(METHODS)}",
                                "pick one of them (lora is the default)")
    ranges.check(options, limits(), ExportOptionError)


def _check_sources(options: TrainOptions) -> None:
    """What the draft and target configs decide, read without a weight: the draft has --stream-layers layers to
    carry the streams, and the target's vocabulary (the draft learns the target's token ids)."""
    draft_layers, draft_vocab = _sizes(options.draft)
    if options.stream_layers > draft_layers:
        raise ExportOptionError(f"--stream-layers {options.stream_layers} is out of range",
                                f"the draft has {draft_layers} layers", "pick fewer stream layers")
    if data.is_export_folder(options.target):
        from mirrorsd.manifest import load_manifest

        target_vocab = load_manifest(Path(options.target).expanduser()).target.vocab_size
    else:
        target_vocab = _sizes(options.target)[1]
    if target_vocab > draft_vocab:
        raise ExportOptionError("The draft cannot read the target's answers",
                                f"the target's vocabulary has {target_vocab} entries, the draft's {draft_vocab}",
                                "use a draft with the target's tokenizer")


def _sizes(model) -> tuple[int, int]:
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


def _check_draft(options: TrainOptions, draft, samples: list[data.Sample]) -> None:
    if options.stream_layers > draft.info.num_layers:
        raise ExportOptionError(f"--stream-layers {options.stream_layers} is out of range",
                                f"the draft has {draft.info.num_layers} layers", "pick fewer stream layers")
    top = max((max(s.tokens) for s in samples), default=0)
    if top >= draft.info.vocab_size or not samples:
        raise ExportOptionError("The draft cannot read the target's answers",
                                f"token id {top} vs draft vocabulary {draft.info.vocab_size}" if samples
                                else "no answer has two tokens or more",
                                "use a draft with the target's tokenizer, and prompts the target answers")


def _target(options: TrainOptions):
    """An export folder's target (ONNX Runtime), or a Hugging Face model / .gguf / pinned name (PyTorch)."""
    if data.is_export_folder(options.target):
        return data.ExportTarget(Path(options.target).expanduser(), options.max_new_tokens, options.threads)
    from mirrorsd.export.loading import load_model

    return data.TorchTarget(load_model(options.target), options.max_new_tokens)


def _brief(metrics: dict) -> str:
    streams = ", ".join(f"{a:.2f}" for a in metrics["stream_agrees_with_main"])
    return (f"main top-1 {metrics['main_top1']:.3f}, stream loss {metrics['stream_loss']:.3f}, "
            f"stream/main agreement [{streams}], tokens per forward {metrics['tokens_per_forward']:.2f}")


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * resource.getpagesize() / 2**20
    except OSError:
        return float("nan")


def _bar(options: TrainOptions, total: int, done: int, desc: str = "training", unit: str = "step"):
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc=desc, unit=unit, disable=not options.progress, dynamic_ncols=True)
