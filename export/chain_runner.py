"""Run a Stack graph in fp32 piece by piece, for validation, when only its quantized file exists.

validate.py checks graphs through a runner (graph inputs in, graph outputs out); this one builds each layer's piece
again from the checkpoint (assembly.py), runs it for every run in order, and drops it, so the fp32 graph never exists
as a whole. It lives apart from validate.py so that validation does not import assembly (assembly -> templates ->
graphs -> validate).
"""
from __future__ import annotations

import numpy as np

from mirrorsd.export.assembly import instances, piece_model
from mirrorsd.export.validate import Run, cpu_session, past_input


class ChainRunner:
    """A Stack graph in fp32, one piece at a time: each piece is built from the checkpoint, run for every run
    in order, and dropped. It computes what the fp32 file would, without that file ever existing."""

    def __init__(self, stack, pieces: dict, source) -> None:
        self.stack, self.pieces, self.source = stack, pieces, source

    def run(self, runs: list[Run]) -> dict[str, dict[str, np.ndarray]]:
        env = {run.name: dict(run.feeds) for run in runs}
        kv = self.stack.io.kv
        for instance in instances(self.stack, self.pieces, self.source.arch):
            piece = instance.piece
            model, weights = piece_model(instance, self.source, piece.opset_import, piece.ir_version, False)
            session = cpu_session(model.SerializeToString(), weights)
            outputs = [o.name for o in session.get_outputs()]
            for run in runs:
                batch = next(iter(run.feeds.values())).shape[0]
                feeds = {i.name: env[run.name][i.name] if i.name in env[run.name]
                         else past_input(i.name, kv, run, env, batch) for i in session.get_inputs()}
                env[run.name].update(zip(outputs, session.run(None, feeds)))
            del session, model, weights
        wanted = [t.name for t in self.stack.io.outputs]
        return {run.name: {name: env[run.name][name] for name in wanted} for run in runs}
