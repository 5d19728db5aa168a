"""A byte-level causal language model on Python's own documentation, trained with ``lightning_accum``.

Sequences have varying lengths, so micro-batches hold different numbers of loss-bearing tokens: the case where a
mean of per-micro-batch means is not the window mean and token normalization (``count_items``) matters.
"""
