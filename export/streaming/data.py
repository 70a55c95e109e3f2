"""Distillation data: SpecBench prompts answered greedily by the target, split by category position, cached.

    question.jsonl --first turn, chat template--> prompt ids --target greedy--> completion ids
    split:  mirrorsd.specbench's hold-out rule: the first ``holdout`` questions of every category (file order) ->
            evaluation, the rest -> training; it depends on the file only (fixed across runs).
The answers are written as JSON lines (``distill-train.jsonl``, ``distill-eval.jsonl`` in the output folder), so a
resumed training never regenerates them.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from mirrorsd.specbench import Question


@dataclass(frozen=True)
class Sample:
    question_id: str
    prompt: list[int]
    completion: list[int]  # the target's greedy answer (ends with EOS unless cut at max_new_tokens)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.completion


def pick(questions: list[Question], count: int | None, seed: int) -> list[Question]:
    """A fixed pseudo-random subset (SpecBench files are grouped by category; this mixes them)."""
    order = list(questions)
    random.Random(seed).shuffle(order)
    return order if count is None else order[:count]


def encode(tokenizer, questions: list[Question], max_prompt_tokens: int,
           chat: bool = True) -> list[tuple[str, list[int]]]:
    """Chat-template each question (``chat`` False: raw completion, the text with the tokenizer's special tokens,
    as mirrorsd bench encodes it for a model without a template); drop those longer than ``max_prompt_tokens``."""
    out = []
    for q in questions:
        if not chat:
            ids = tokenizer.encode(q.text, add_special_tokens=True)
        else:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": q.text}], add_generation_prompt=True,
                                                tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        if len(ids) <= max_prompt_tokens:
            out.append((str(q.question_id), [int(t) for t in ids]))
    return out


def has_chat_template(target) -> bool:
    """Whether ``target`` (an ExportTarget or a TorchTarget) has a chat template: an export's manifest says (what
    mirrorsd bench and generate follow), a PyTorch model's tokenizer says."""
    pipe = getattr(target, "pipe", None)
    if pipe is not None:
        return bool(pipe.manifest.tokenizer.chat_template)
    return bool(getattr(target.tokenizer, "chat_template", None))


def answer_all(generate, prompts: list[tuple[str, list[int]]], batch_size: int, eos_ids: tuple[int, ...],
               progress) -> list[Sample]:
    """Greedy answers in batches of similar prompt length (less padding); ``generate(list of ids) -> list of
    completions`` is a Target's; each completion is cut after its first EOS. ``progress(n)`` after each batch."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i][1]))
    answers: dict[int, Sample] = {}
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        for i, completion in zip(batch, generate([prompts[i][1] for i in batch])):
            ends = [k for k, t in enumerate(completion) if t in eos_ids]
            answers[i] = Sample(prompts[i][0], prompts[i][1], completion[: ends[0] + 1] if ends else completion)
        progress(len(batch))
    return [answers[i] for i in range(len(prompts))]


class TorchTarget:
    """The target as a PyTorch model: transformers' batched greedy generate, left-padded."""

    def __init__(self, source, max_new_tokens: int) -> None:
        from transformers import GenerationConfig

        tok, gen = source.tokenizer, source.model.generation_config
        eos = [tok.eos_token_id, *(gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id])]
        self.eos_ids = tuple(sorted({int(t) for t in eos if t is not None}))
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.eos_ids[0]
        self.model, self.tokenizer = source.model, tok
        self.config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                       eos_token_id=list(self.eos_ids), pad_token_id=self.pad_id)

    def __call__(self, prompts: list[list[int]]) -> list[list[int]]:
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, tokens in enumerate(prompts):
            ids[row, width - len(tokens):] = torch.tensor(tokens)
            mask[row, width - len(tokens):] = 1
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=self.config,
                                      use_model_defaults=False)  # no sampling knobs from the model's config
        return [row[width:].tolist() for row in out]

    def close(self) -> None:
        pass


class ExportTarget:
    """The target of a mirrorsd export folder, run by ONNX Runtime (faster than PyTorch on a CPU; and when the
    export is the one being benchmarked, the draft learns exactly the target it will serve, precision included)."""

    def __init__(self, folder: Path, max_new_tokens: int, threads: int | None = None) -> None:
        from transformers import AutoTokenizer

        from mirrorsd.devices.placement import DeviceRequest
        from mirrorsd.runtime import Pipeline

        # batched generation is compute-bound: give the target every core unless told otherwise
        threads = threads or os.cpu_count() or 1
        self.pipe = Pipeline.load(folder, DeviceRequest(target_threads=threads, draft_threads=1))
        self.tokenizer = AutoTokenizer.from_pretrained(str(Path(folder) / self.pipe.manifest.tokenizer.directory))
        self.eos_ids = tuple(self.pipe.manifest.tokenizer.eos_token_ids)
        self.max_new_tokens = max_new_tokens

    def __call__(self, prompts: list[list[int]]) -> list[list[int]]:
        return self.pipe.generate_batch(prompts, self.max_new_tokens)

    def close(self) -> None:
        self.pipe.close()


def is_export_folder(path: Path) -> bool:
    from mirrorsd.names import MANIFEST_FILE

    return (Path(path).expanduser() / MANIFEST_FILE).is_file()


def save_samples(path: Path, samples: list[Sample]) -> None:
    tmp = Path(path).with_suffix(".partial")
    tmp.write_text("".join(json.dumps(asdict(s)) + "\n" for s in samples), encoding="utf-8")
    tmp.replace(path)


def load_samples(path: Path) -> list[Sample]:
    """The cached answers in ``path``; [] when the cache is unusable (damaged, not a file, implausibly large):
    the target answers again."""
    from mirrorsd.errors import ExportOptionError
    from mirrorsd.user_files import QUESTIONS_LIMIT, read_text

    try:
        text = read_text(path, QUESTIONS_LIMIT, lambda why: ExportOptionError(f"Cannot read {path}", why))
        samples = [Sample(**json.loads(line)) for line in text.splitlines() if line]
    except (ExportOptionError, ValueError, TypeError, RecursionError):
        return []
    ok = all(isinstance(s.prompt, list) and isinstance(s.completion, list) and
             all(isinstance(t, int) and not isinstance(t, bool) for t in s.prompt + s.completion) for s in samples)
    return samples if ok else []
