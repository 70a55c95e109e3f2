"""A trained early exit: a low-rank adapter before the target's LM head at the exit layer, fitted on the target's
own greedy tokens (``mirrorsd-train-exit``), and a sparse exit head that scores only candidate tokens."""
