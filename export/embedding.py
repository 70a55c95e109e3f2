"""Token embeddings stored quantized (``mirrorsd-export --embedding``): the largest tensor of a small model, kept as
float32 until now (933 MB of the Qwen2.5-Coder 1.5B target's 2 GB), becomes block codes looked up with standard ONNX
operators, so every host that runs the graphs (ONNX Runtime on any EP, OpenVINO, the C and C# hosts) runs them:

    ids [B, S] int64
      Gather(codes [V, C] uint8)              -> [B, S, C]         C = H (a code per byte) or H/2 (two 4-bit codes)
      Cast(int32), Gather(values [256, P])    -> [B, S, C, P]      the P numbers each byte stands for
      Reshape                                 -> [B, S, H/b, b]    b weights per scale (32; 16 for Q6_K)
      Mul(Gather(scales [V, H/b, 1]))         -> value * scale
      Sub(Gather(offsets [V, H/b, 1]))        -> value * scale - offset   (Q4_K and Q5_K only)
      Reshape                                 -> [B, S, H]

A row depends on its own id only, so rows stay bitwise independent of the batch (what greedy losslessness needs).

Where the codes come from:
    GGUF blocks   the source is a GGUF (or a folder converted from one) and its token embedding is Q4_0, Q4_K (two
                  4-bit codes per byte), Q5_0, Q5_K, Q6_K or Q8_0 (one per byte): the file's own blocks, carried
                  only when the lookup gives exactly gguf's dequantization, which the export checks on the whole
                  table (value * scale is exact in float32 for these formats: an fp16 d times a sub-block scale of
                  at most 8 bits times a value of at most 8 bits; the offset's subtraction is the one rounding, as
                  in gguf). Q4_K: 6 bits per weight against 32.
    int8          any other source or type: symmetric round-to-nearest per block of 32 (scale max|w| / 127), 9 bits
                  per weight; each weight within half a step of its float value.
``--embedding float`` keeps the float32 table. Only quantized models (int8, int4) change their embedding.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from mirrorsd.errors import ExportOptionError
from mirrorsd.names import INPUT_IDS

MODES = ("quantized", "float")
BLOCK = 32  # weights per scale of the int8 form
PACKED_TYPES = {"Q4_0": 8, "Q4_K": 0}  # GGUF type -> the bias its 4-bit code carries (value = code - bias)
BYTE_TYPES = {"Q5_0": 16, "Q8_0": 128, "Q5_K": 0, "Q6_K": 32}  # one code per byte
# bits per weight of each stored form: codes + float32 scales (and offsets) per block of 32 (Q6_K: 16)
BITS_PER_WEIGHT = {"Q4_0": 5, "Q4_K": 6, "Q5_0": 9, "Q8_0": 9, "int8": 9, "Q5_K": 10, "Q6_K": 10}
COUNT_PREFIX = "embedding."  # a graph's validation counts its table's form as embedding.KIND


def check_mode(value: str) -> str:
    if value not in MODES:
        raise ExportOptionError(f"--embedding {value!r} is not a mode", f"choose one of {', '.join(MODES)}",
                                "for example --embedding quantized")
    return value


def stored_bytes(validation: dict, vocab: int, hidden: int, float_bytes: int = 4) -> int:
    """Bytes of a graph's token embedding as stored, from the form its ``validation`` counts (none counted: a float
    table of ``float_bytes`` per weight; the lookup's 256-entry byte table is left out)."""
    kind = next((k[len(COUNT_PREFIX):] for k in validation if k.startswith(COUNT_PREFIX)), None)
    bits = BITS_PER_WEIGHT.get(kind, 8 * float_bytes)
    return vocab * hidden * bits // 8


def embedding_names() -> set[str]:
    """The initializer names a token embedding has in the traced graphs, one per supported architecture."""
    from mirrorsd.export.architectures import ARCHITECTURES

    return {f"{arch.embed}.weight" for arch in ARCHITECTURES.values()}


@dataclass(frozen=True)
class QuantizedTable:
    """A [V, H] table as codes [V, C] uint8, ``values`` [256, P] float32 (byte -> its P codes' numbers, P = H / C),
    ``scales`` [V, H/b] float32 and ``offsets`` like scales or None: w = values[code] * scale - offset."""

    kind: str  # the GGUF type carried, or "int8"
    codes: np.ndarray
    values: np.ndarray
    scales: np.ndarray
    offsets: np.ndarray | None = None
    stored: object = None  # packed_weights.PackedQ4K: Q4_K's scale bytes, stored instead of scales and offsets

    @property
    def per_scale(self) -> int:
        return self.hidden // self.scales.shape[1]

    @property
    def hidden(self) -> int:
        return self.codes.shape[1] * self.values.shape[1]

    def dequantize(self) -> np.ndarray:
        """[V, H] float32 with the graph's operations in the graph's order."""
        v = self.codes.shape[0]
        w = self.values[self.codes.astype(np.int32)].reshape(v, -1, self.per_scale) * self.scales[..., None]
        if self.offsets is not None:
            w = w - self.offsets[..., None]
        return w.reshape(v, self.hidden)


def byte_values(bias: int, packed: bool) -> np.ndarray:
    """[256, 2] (two 4-bit codes, low nibble first) or [256, 1]: the number each byte stands for."""
    byte = np.arange(256)
    columns = [byte & 0x0F, byte >> 4] if packed else [byte]
    return (np.stack(columns, axis=-1) - bias).astype(np.float32)


def int8_table(weight: np.ndarray) -> QuantizedTable:
    """[V, H] float (H a multiple of 32) -> 8-bit codes: per block of 32, s = max|w| / 127, c = rint(w / s) + 128."""
    v, h = weight.shape
    blocks = weight.reshape(v, h // BLOCK, BLOCK).astype(np.float32)
    scales = (np.abs(blocks).max(axis=-1) / np.float32(127)).astype(np.float32)  # [V, H/32]
    safe = np.where(scales > 0, scales, np.float32(1))
    codes = (np.clip(np.rint(blocks / safe[..., None]), -127, 127) + 128).astype(np.uint8)
    return QuantizedTable("int8", codes.reshape(v, h), byte_values(128, False), scales)


def gguf_table(reader, stored: str, keep_blocks: bool = False) -> QuantizedTable | None:
    """Tensor ``stored`` of a GGUF reader (HF name) as a QuantizedTable of its own blocks, or None when its type
    has no such form or its rows are not the file's in some order. ``keep_blocks``: a Q4_K table also keeps its
    scale bytes (packed storage)."""
    from mirrorsd.export.gguf_blocks import BLOCK as GGUF_BLOCK
    from mirrorsd.export.gguf_blocks import K_QUANTS, SCALE_BYTES, SUPER_BLOCK, block_integers, k_quant_parts, \
        row_order

    tensor = reader.tensors[stored]
    kind = tensor.tensor_type.name
    v, h = reader.shape(stored)
    per_block = SUPER_BLOCK if kind in K_QUANTS + ("Q6_K",) else GGUF_BLOCK
    if kind not in PACKED_TYPES and kind not in BYTE_TYPES or h % per_block:
        return None
    order = row_order(reader, stored, v)
    if order is None:
        return None
    blocks = np.asarray(tensor.data).reshape(v, h // per_block, -1)[order]  # [V, blocks, bytes per block]
    offsets = None
    if kind in K_QUANTS:
        q, scales, offsets = k_quant_parts(blocks, kind)  # q [V, H/32, 32]
        codes = q.reshape(v, h)
    elif kind == "Q6_K":
        from mirrorsd.export.q6_k import q6_k_parts

        codes, scales = q6_k_parts(blocks)
    else:
        scales = np.ascontiguousarray(blocks[..., :SCALE_BYTES]).view(np.float16)[..., 0].astype(np.float32)
        bias = PACKED_TYPES.get(kind, BYTE_TYPES.get(kind))
        codes = (block_integers(blocks, tensor.tensor_type) + bias).astype(np.uint8).reshape(v, h)
    packed = kind in PACKED_TYPES
    if packed:
        codes = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    bias = PACKED_TYPES.get(kind, BYTE_TYPES.get(kind))
    stored_form = None
    if keep_blocks and kind == "Q4_K":
        from mirrorsd.export.packed_weights import q4k_from_blocks

        stored_form = q4k_from_blocks(blocks)
    return QuantizedTable(kind, np.ascontiguousarray(codes), byte_values(bias, packed),
                          np.ascontiguousarray(scales.reshape(v, -1), np.float32),
                          None if offsets is None else np.ascontiguousarray(offsets.reshape(v, -1), np.float32),
                          stored_form)


@dataclass
class EmbeddingPlan:
    """Decides the form of each token embedding the quantizer meets, and counts it per graph role (``report``)."""

    mode: str  # quantized | float
    gguf: object = None  # a gguf_blocks.BlockPlan when the source is (or was converted from) a GGUF, else None
    counts: dict = field(default_factory=dict)  # role -> Counter({"embedding.Q4_K": 1, ...})

    def table(self, role: str, name: str, weight: np.ndarray) -> QuantizedTable | None:
        if self.mode == "float" or weight.ndim != 2:
            return None
        found = self._from_gguf(name, weight)
        if found is None and weight.shape[1] % BLOCK:
            return None
        found = found or int8_table(weight)
        self.counts.setdefault(role, Counter())[COUNT_PREFIX + found.kind] += 1
        return found

    def _from_gguf(self, name: str, weight: np.ndarray) -> QuantizedTable | None:
        """The GGUF's blocks when the lookup reproduces ``weight`` (the source's values) bit for bit."""
        plan = self.gguf
        if plan is None or plan.mode == "requantize":
            return None
        sources = plan.weights.sources  # a whole traced graph names the table otherwise: the model has one
        stored = sources.get(name) or next((sources[n] for n in sorted(embedding_names()) if n in sources), None)
        if stored is None or stored not in plan.weights.reader.tensors:
            return None
        found = gguf_table(plan.weights.reader, stored, plan.storage == "packed")
        if found is None or not np.array_equal(found.dequantize(), weight.astype(np.float32)):
            return None
        return found

    def report(self, role: str) -> dict[str, float]:
        return {k: float(v) for k, v in sorted(self.counts.get(role, {}).items())}


def replace_embeddings(model, plan: EmbeddingPlan, role: str) -> int:
    """Turn each Gather of a token embedding (a 2-D float initializer, used by that Gather only, named as in
    embedding_names or gathered by the graph's input_ids) into the lookup of the module docstring; returns how
    many."""
    from onnx import TensorProto, numpy_helper

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    uses = Counter(name for node in graph.node for name in node.input)
    wanted = embedding_names()
    replaced = shift = 0  # shift: nodes added before the current one
    for index, node in enumerate(list(graph.node)):
        name = node.input[0] if node.op_type == "Gather" else ""
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if name not in inits or not (name in wanted or node.input[1] == INPUT_IDS) or axis != 0 \
                or uses[name] != 1 or inits[name].data_type != TensorProto.FLOAT or len(inits[name].dims) != 2:
            continue
        table = plan.table(role, name, numpy_helper.to_array(inits[name]))
        if table is None:
            continue
        graph.initializer.remove(inits.pop(name))
        unpacking = _unpacking(name, table)
        graph.initializer.extend(_initializers(name, table) + (unpacking.initializers if unpacking else []))
        graph.node.remove(node)
        lookup = (unpacking.nodes if unpacking else []) + \
            _lookup_nodes(name, table, node.input[1], node.output[0], node.name)
        for offset, new in enumerate(lookup):
            graph.node.insert(index + shift + offset, new)
        shift += len(lookup) - 1
        replaced += 1
    return replaced


def _initializers(name: str, table: QuantizedTable) -> list:
    from onnx import numpy_helper

    v = table.codes.shape[0]
    out = [numpy_helper.from_array(table.codes, f"{name}.codes"),
           numpy_helper.from_array(table.values, f"{name}.values"),
           numpy_helper.from_array(np.array([table.scales.shape[1], table.per_scale], np.int64), f"{name}.blocks"),
           numpy_helper.from_array(np.array([table.hidden], np.int64), f"{name}.hidden")]
    if table.stored is not None:  # scales and offsets come from the unpacking nodes
        return out
    out.append(numpy_helper.from_array(table.scales.reshape(v, -1, 1), f"{name}.scales"))
    if table.offsets is not None:
        out.append(numpy_helper.from_array(table.offsets.reshape(v, -1, 1), f"{name}.offsets"))
    return out


def _unpacking(name: str, table: QuantizedTable):
    """Packed storage (export/packed_weights.py): the nodes and stored initializers that compute ``NAME.scales`` and
    ``NAME.offsets`` from the Q4_K table's own scale bytes; None when the table is stored plain."""
    if table.stored is None:
        return None
    from mirrorsd.export.packed_weights import q4k_embedding_nodes

    return q4k_embedding_nodes(name, table.stored, table.codes.shape[0], table.hidden, f"{name}.scales",
                               f"{name}.offsets")


def _lookup_nodes(name: str, table: QuantizedTable, ids: str, output: str, scope: str) -> list:
    from onnx import TensorProto, helper

    def node(op, inputs, out, **attrs):
        return helper.make_node(op, inputs, [f"{scope}/{out}" if out != output else out], name=f"{scope}/{out}",
                                **attrs)

    s = f"{scope}/"
    last = "scaled" if table.offsets is None else "shifted"
    nodes = [node("Gather", [f"{name}.codes", ids], "codes", axis=0),  # [B, S, C] uint8
             node("Cast", [s + "codes"], "code_ids", to=TensorProto.INT32),
             node("Gather", [f"{name}.values", s + "code_ids"], "values", axis=0),  # [B, S, C, P]
             node("Shape", [ids], "ids_shape"),
             node("Concat", [s + "ids_shape", f"{name}.blocks"], "block_shape", axis=0),
             node("Reshape", [s + "values", s + "block_shape"], "blocks"),  # [B, S, H/b, b]
             node("Gather", [f"{name}.scales", ids], "scales", axis=0),  # [B, S, H/b, 1]
             node("Mul", [s + "blocks", s + "scales"], "scaled")]
    if table.offsets is not None:
        nodes += [node("Gather", [f"{name}.offsets", ids], "offsets", axis=0),
                  node("Sub", [s + "scaled", s + "offsets"], "shifted")]
    nodes += [node("Concat", [s + "ids_shape", f"{name}.hidden"], "out_shape", axis=0),
              helper.make_node("Reshape", [s + last, s + "out_shape"], [output], name=f"{scope}/out")]  # [B, S, H]
    return nodes
