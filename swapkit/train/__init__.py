"""``swapkit train``: the built-in model, synthetic data, checkpoints, the loop and its summary."""
from swapkit.train.checkpoint import latest_checkpoint, save_checkpoint
from swapkit.train.data import SyntheticTokens
from swapkit.train.errors import RunFailed
from swapkit.train.loop import environment, resolve_device, train
from swapkit.train.state import RunState, TrainResult
from swapkit.train.summary import format_summary, human_bytes, summarize

__all__ = ["RunFailed", "RunState", "SyntheticTokens", "TrainResult", "environment", "format_summary", "human_bytes",
           "latest_checkpoint", "resolve_device", "save_checkpoint", "summarize", "train"]
