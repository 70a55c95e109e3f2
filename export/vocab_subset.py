"""A vocabulary-subset draft head (``mirrorsd-export --draft-vocab N``): the draft scores only N likely tokens.

    hidden [B, S, H] -> norm -> LM head on N rows -> subset logits [B, S, N]
        -> Pad with FLOOR -> [B, S, N + 1] -> Gather(slot of each vocabulary id) -> logits [B, S, vocab]

Every id outside the subset gets ``FLOOR`` (finite, so that nothing downstream meets inf or NaN), so the graph keeps
the draft's contract: logits of the full vocabulary. The runtime and the manifest's tensors are unchanged, and
decoding stays exact because the target verifies every drafted token; the draft only never proposes an id outside
the subset. What shrinks is the LM head, the largest single weight of a small draft: vocab / N times fewer rows.

Which N: the first N ids of ``token_order``, a ranking that needs no corpus:
    1. the tokenizer's added and special tokens (EOS, chat-template markers), always;
    2. a BPE model's base alphabet (one-character tokens no merge produces), then each merged token by the rank
       of its merge: BPE training merges the most frequent pair first, so earlier merges are the more frequent
       tokens; then the model's tokens that no merge can produce (padding entries such as "[PAD151935]");
       a Unigram model's pieces by descending score; any other model by id;
    3. ids the tokenizer does not know (padding rows of the embedding) last.

The head is cut from the finished draft graph (``restrict_head``): its LM-head MatMul (fp32/fp16) or MatMulNBits
(int8/int4) keeps only the subset's weight rows, bit for bit, so the subset logits equal the full graph's logits at
those ids; ``check_restricted`` measures exactly that on a batch, and the export records it as the draft's
``draft_vocab_subset`` check (the full graph was checked against PyTorch before).
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

from mirrorsd import names
from mirrorsd.errors import ExportOptionError, UnsupportedArchitectureError, ValidationError

FLOOR = -1.0e9  # the logit of every id outside the subset: probability exactly 0 after softmax, and finite
ORDER = "tokenizer-rank"  # VocabSubsetInfo.order: how the subset was chosen (module docstring)
SCOPE = "/vocab_subset"
CHECK = "draft_vocab_subset"  # max |restricted - full| over the subset's ids (FLOOR elsewhere is required)
TOLERANCE = (1e-5, 1e-5)  # fewer output columns may change a kernel's blocking, not a column's sum
ELEMENTWISE = ("Cast", "Tanh", "Mul", "Div")  # may sit between the LM head and the logits (Mul/Div: by a scalar)


def check_size(n: int | None, vocab: int | None = None) -> None:
    """``--draft-vocab N``: 1..vocab (``vocab`` None before the models are opened: only the lower bound)."""
    if n is None:
        return
    if n < 1 or (vocab is not None and n > vocab):
        raise ExportOptionError(f"--draft-vocab {n} is out of range",
                                f"it counts the draft's candidate ids: 1..{vocab or 'the vocabulary size'}",
                                "for example --draft-vocab 32768, or leave it out for the whole vocabulary")


def token_order(tokenizer_json: dict, vocab: int) -> np.ndarray:
    """All ids 0..vocab-1 [vocab] int64, most likely first (the ranking of the module docstring)."""
    model = tokenizer_json.get("model") or {}
    ranked: list[int] = [int(t["id"]) for t in sorted(tokenizer_json.get("added_tokens") or [], key=lambda t: t["id"])]
    kind = model.get("type")
    if kind == "BPE" and isinstance(model.get("vocab"), dict):
        ids = model["vocab"]
        merged = {}
        for rank, merge in enumerate(model.get("merges") or []):
            left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
            merged.setdefault(left + right, rank)
        unreachable = len(merged)  # several characters that no merge makes: padding entries ([PAD151935]), ...
        ranked += [i for _, i in sorted((merged.get(token, -1 if len(token) == 1 else unreachable), i)
                                        for token, i in ids.items())]
    elif kind == "Unigram" and isinstance(model.get("vocab"), list):
        ranked += [i for _, i in sorted((-float(score), i) for i, (_, score) in enumerate(model["vocab"]))]
    seen = np.zeros(vocab, dtype=bool)
    order = []
    for i in ranked + list(range(vocab)):
        if 0 <= i < vocab and not seen[i]:
            seen[i] = True
            order.append(i)
    return np.asarray(order, dtype=np.int64)


def subset_ids(tokenizer, vocab: int, n: int) -> np.ndarray:
    """The draft's subset [n] int64, ascending, from a Hugging Face fast tokenizer's ranking."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise UnsupportedArchitectureError("--draft-vocab needs a fast (tokenizer.json) tokenizer",
                                           "the subset is ranked from the tokenizer's merges or scores",
                                           "export without --draft-vocab")
    return subset_from_json(json.loads(backend.to_str()), vocab, n)


def subset_from_json(tokenizer_json: dict, vocab: int, n: int) -> np.ndarray:
    """The first ``n`` ids of ``token_order`` [n] int64, ascending."""
    return np.sort(token_order(tokenizer_json, vocab)[:n])


def restrict_head(model, ids: np.ndarray, vocab: int):
    """The draft graph ``model`` (onnx.ModelProto, weights loaded) with its LM head cut to the rows ``ids``, in place.

    The node chain from the logits output back to the LM head must be elementwise (a Cast of an fp16 graph, a
    soft-cap); the head is a MatMul on a weight initializer [H, vocab] or a MatMulNBits of N = vocab."""
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    producers = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            consumers[name] = consumers.get(name, 0) + 1
    initializers = {t.name: t for t in graph.initializer}
    node, chain = producers.get(names.LOGITS), []
    while node is not None and node.op_type in ELEMENTWISE:
        scalar = node.op_type not in ("Mul", "Div") or (
            node.input[1] in initializers and int(np.prod(initializers[node.input[1]].dims)) == 1)
        if not scalar or consumers.get(node.input[0], 0) != 1:
            node = None
            break
        chain.append(node)
        node = producers.get(node.input[0])
    if node is None or node.op_type not in ("MatMul", "MatMulNBits") or node.input[1] not in initializers \
            or consumers.get(node.output[0], 0) > 1:
        raise UnsupportedArchitectureError("The draft's LM head cannot be cut to a vocabulary subset",
                                           "--draft-vocab expects the logits to come from one MatMul on the LM-head "
                                           "weight, through elementwise nodes only", "export without --draft-vocab")
    n = len(ids)
    for index in (1, 2, 3, 5) if node.op_type == "MatMulNBits" else (1,):
        if index >= len(node.input) or not node.input[index]:
            continue
        old = initializers[node.input[index]]
        value = numpy_helper.to_array(old)
        if node.op_type == "MatMul":  # [H, vocab]: the subset's columns
            kept = np.ascontiguousarray(value[:, ids])
        else:  # MatMulNBits keeps N-major tensors: B [N, blocks, blob], scales/zero points [N * ...], bias [N]
            kept = np.ascontiguousarray(value.reshape(vocab, -1)[ids].reshape((n,) + value.shape[1:])
                                        if value.ndim > 1 else value.reshape(vocab, -1)[ids].reshape(-1))
        name = f"{old.name}{SCOPE}"
        graph.initializer.append(numpy_helper.from_array(kept, name))
        node.input[index] = name
        consumers[old.name] -= 1
        if consumers[old.name] == 0:
            graph.initializer.remove(old)
    if node.op_type == "MatMulNBits":
        for attribute in node.attribute:
            if attribute.name == "N":
                attribute.i = n
    last = chain[0] if chain else node
    subset = f"{SCOPE}/subset_logits"  # [B, S, n]
    last.output[0] = subset
    slot = np.full(vocab, n, dtype=np.int64)  # [vocab]: where each id's logit sits in the padded subset
    slot[ids] = np.arange(n)
    graph.initializer.extend([
        numpy_helper.from_array(np.array([0, 0, 0, 0, 0, 1], dtype=np.int64), f"{SCOPE}/pads"),
        numpy_helper.from_array(np.array(FLOOR, dtype=np.float32), f"{SCOPE}/floor"),
        numpy_helper.from_array(slot, f"{SCOPE}/slot")])
    graph.node.extend([
        helper.make_node("Pad", [subset, f"{SCOPE}/pads", f"{SCOPE}/floor"], [f"{SCOPE}/padded"],
                         name=f"{SCOPE}/pad", mode="constant"),  # [B, S, n + 1], FLOOR last
        helper.make_node("Gather", [f"{SCOPE}/padded", f"{SCOPE}/slot"], [names.LOGITS], name=f"{SCOPE}/gather",
                         axis=2)])  # [B, S, vocab]
    stale = {o for c in [node, *chain] for o in c.output} | {names.LOGITS}
    kept_infos = [v for v in graph.value_info if v.name not in stale]
    graph.ClearField("value_info")
    graph.value_info.extend(kept_infos)
    assert any(o.name == names.LOGITS and o.type.tensor_type.elem_type == TensorProto.FLOAT for o in graph.output)
    return model


def is_restricted(path: Path) -> bool:
    import onnx

    return any(n.name == f"{SCOPE}/gather" for n in onnx.load(str(path), load_external_data=False).graph.node)


def restrict_file(path: Path, ids: np.ndarray, vocab: int, kv) -> float:
    """Cut the head of the draft graph file ``path`` (+ .data) to ``ids``, check it against the full graph, replace
    the file; the check's max |diff| over the subset's ids. A file cut before (a resumed export) is only checked."""
    import onnx

    from mirrorsd.export.quantize import PROTOBUF_LIMIT

    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".vocab-{path.stem}-") as scratch:
        new = Path(scratch) / path.name
        model = restrict_head(onnx.load(str(path), load_external_data=True), ids, vocab)
        large = model.ByteSize() >= PROTOBUF_LIMIT
        onnx.save_model(model, str(new), save_as_external_data=large, all_tensors_to_one_file=True,
                        location=new.name + ".data" if large else None, size_threshold=1024)
        del model
        diff = check_restricted(path, new, ids, vocab, kv)
        for old in (path, path.with_name(path.name + ".data")):
            old.unlink(missing_ok=True)
        for item in Path(scratch).iterdir():
            shutil.move(str(item), str(path.parent / item.name))
    return diff


def check_restricted(full: Path, restricted: Path, ids: np.ndarray, vocab: int, kv) -> float:
    """Both graphs on the validation batch: equal logits at ``ids`` (max |diff| returned), FLOOR at every other id."""
    from mirrorsd.export.validate import Run, SEEDS, FileRunner, sample_batch

    ids_batch, mask, positions = sample_batch(vocab, SEEDS["draft"])
    feeds = {names.INPUT_IDS: ids_batch, names.ATTENTION_MASK: mask, names.POSITION_IDS: positions}
    want = FileRunner(full, kv).run([Run("full", feeds)])["full"][names.LOGITS]
    got = FileRunner(restricted, kv).run([Run("full", feeds)])["full"][names.LOGITS]
    outside = np.ones(vocab, dtype=bool)
    outside[ids] = False
    valid = mask.astype(bool)  # [B, S]: padding positions are left out, as in validate.compare
    diff = float(np.max(np.abs(got[valid][:, ids] - want[valid][:, ids])))
    atol, rtol = TOLERANCE
    if got.shape != want.shape or not np.all(got[..., outside] == FLOOR) \
            or not diff <= atol + rtol * float(np.max(np.abs(want[valid][:, ids]))):
        raise ValidationError("The draft graph cut to a vocabulary subset differs from the full draft graph",
                              f"max |diff| {diff:.3g} over the subset's ids (or ids outside it are not the floor)",
                              "export without --draft-vocab, and report the model")
    return diff
