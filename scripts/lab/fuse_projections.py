"""Fuse the MatMulNBits nodes that read the same input (q/k/v, gate/up) into one node and a Split, in a copy of an
export folder: fewer, larger weight streams per layer. Each column of MatMulNBits (ONNX Runtime's, and mirrorsd's
kernel: its columns are computed independently of N) gives the same bits in the fused node, so the outputs are
unchanged. Nodes are fused only with nodes of the same kind: same K, bits, block size, accuracy level, zero-point
presence and dtype, bias presence, and (with mirrorsd's kernel) the same answer to its super-block test, so a fused
node keeps the compact layout its parts had.

    python scripts/lab/fuse_projections.py EXPORT OUT [--roles draft,prefix,suffix]
"""
from __future__ import annotations

import argparse
import shutil
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper


def _attributes(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _kind(node, values, library) -> tuple:
    attrs = _attributes(node)
    zero_points = len(node.input) > 3 and bool(node.input[3])
    bias = len(node.input) > 5 and bool(node.input[5])
    if len(node.input) > 4 and node.input[4]:
        return ("g_idx", node.name)  # never fused
    form = None
    if zero_points and library is not None:
        from mirrorsd.devices.kernels import superblocks

        form = superblocks.has_superblock_form(library, attrs["K"], attrs["N"], values[node.input[2]],
                                               values[node.input[3]])
    return (node.input[0], attrs["K"], attrs["bits"], attrs["block_size"], attrs.get("accuracy_level", 0),
            zero_points, values[node.input[3]].dtype.str if zero_points else None, bias, form)


def fuse(model, library=None) -> int:
    graph = model.graph
    values = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    groups: dict[tuple, list] = defaultdict(list)
    for node in graph.node:
        if node.op_type == "MatMulNBits" and node.domain == "com.microsoft":
            groups[_kind(node, values, library)].append(node)
    fused = 0
    for members in groups.values():
        if len(members) < 2:
            continue
        first = members[0]
        attrs = _attributes(first)
        ns = [_attributes(m)["N"] for m in members]
        stem = first.name + "_fused"
        new_inputs = [first.input[0]]
        for index in range(1, len(first.input)):
            if not first.input[index]:
                new_inputs.append("")
                continue
            joined = np.concatenate([values[m.input[index]] for m in members], axis=0)
            name = f"{stem}.in{index}"
            graph.initializer.append(numpy_helper.from_array(joined, name))
            new_inputs.append(name)
        out = stem + "_output"
        matmul = helper.make_node("MatMulNBits", new_inputs, [out], name=stem, domain="com.microsoft",
                                  **{**attrs, "N": sum(ns)})
        sizes = f"{stem}.split"
        graph.initializer.append(numpy_helper.from_array(np.array(ns, np.int64), sizes))
        split = helper.make_node("Split", [out, sizes], [m.output[0] for m in members], name=stem + "_split", axis=-1)
        position = list(graph.node).index(first)
        used = {name for m in members for name in m.input[1:] if name}
        for m in members:
            graph.node.remove(m)
        graph.node.insert(position, split)
        graph.node.insert(position, matmul)
        still = {name for n in graph.node for name in n.input}
        for init in [i for i in graph.initializer if i.name in used and i.name not in still]:
            graph.initializer.remove(init)
        fused += 1
    return fused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("export", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--roles", default="draft,prefix,suffix")
    args = parser.parse_args()
    from mirrorsd.devices import kernels

    library = kernels.usable_library()
    shutil.copytree(args.export, args.out)
    for role in args.roles.split(","):
        path = args.out / f"{role}.onnx"
        model = onnx.load(str(path), load_external_data=True)
        count = fuse(model, library)
        for old in (path, path.with_name(path.name + ".data")):
            old.unlink(missing_ok=True)
        large = model.ByteSize() > 2 * 1024**3 - 64 * 1024**2
        onnx.save_model(model, str(path), save_as_external_data=large, all_tensors_to_one_file=True,
                        location=path.name + ".data" if large else None, size_threshold=1024)
        print(f"{role}: {count} fused nodes")


if __name__ == "__main__":
    main()
