"""The torch side: bind a plan to a model, wrap recomputed scopes and run the saved-tensor hooks.

``binding`` finds the layer container and op scopes, ``scope`` tracks which scope is running,
``recompute`` wraps checkpointed layers and ops, ``session`` holds the hooks (thin), ``step`` the
per-step state (clock, queues, counters), ``records`` one swapped or kept storage, ``recipes`` the
outputs rebuilt in backward, ``schedule`` the tick queues and ``stats`` what a step reports.
Dependencies run one way: session -> step -> recipes -> records.
"""
