"""Split mode: one step batch run as micro-batches that fit, retried after an OOM, on every rank.

``planner`` chooses the micro-batch size (or token budget), ``step`` runs one optimizer step's micro-batches and
agrees faults across ranks, ``sync`` holds back and syncs the gradients per strategy, ``step_logs`` combines what
``self.log`` records per micro-batch. Cutting a batch lives in `lightning_accum.batches`.
"""
