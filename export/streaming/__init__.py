"""Speculative Streaming drafts (arXiv 2402.11131): the draft emits 1 + n tokens per forward.

    model.py     the streaming draft as one PyTorch module (training and export share it), its config file
    lora.py      low-rank adapters for the streamed layers, merged into plain weights at the end
    data.py      SpecBench prompts, split by question_id, and the target's greedy answers to them
    train.py     the training loop, checkpoints and resume (``mirrorsd-train-draft``)
    graph.py     the ``draft_streaming`` export graph and its validation against the module
"""
