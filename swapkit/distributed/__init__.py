"""Pipeline and data parallel training on ``torch.distributed`` (pipelining schedules, FSDP2).

``pipeline`` builds a pipeline stage's chunks of the built-in model and its schedule; ``launch``
starts the ranks of ``swapkit train``; ``train`` is the per-rank loop.
"""
