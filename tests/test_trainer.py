"""swapkit inside a transformers Trainer, end to end, on a tiny random Llama and an in-memory dataset."""
from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it

import torch  # noqa: E402

from swapkit.integrations.transformers import attach  # noqa: E402
from tests.hf_models import DECODER  # noqa: E402

CONFIG = {"swap_config": {"swap": True, "op_swap": [
    {"op_name": ["attention", "feed_forward"], "backward_prefetch": 2, "layers": True}]},
    "runtime": {"min_offload_bytes": 0}}


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 8) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, 64, (n, 12), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Recorder(transformers.TrainerCallback):
    """A user's callback (a reporting integration sees the logs the same way)."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        self.seen.append(dict(logs or {}))


def run(tmp_path, with_swapkit: bool, config=CONFIG):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**DECODER))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        logging_steps=1, learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
        seed=0, dataloader_num_workers=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[Recorder()])
    callback = attach(trainer, config) if with_swapkit else None
    trainer.train()
    return trainer, callback


def test_trainer_logs_say_how_many_regions_were_recomputed(tmp_path):
    """Nothing in the Trainer's logs showed that full recompute ran (``SwapStats.recomputed_by_scope``)."""
    trainer, callback = run(tmp_path, True, {"recompute_config": {"recompute": True}})
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["swapkit/recomputed_regions"] for entry in logs] == [DECODER["num_hidden_layers"]] * 3
    assert callback.session.stats.recomputed_by_scope == {"layer 0": 1, "layer 1": 1}
    callback.session.remove()


def test_trainer_with_swapkit_matches_the_plain_run(tmp_path):
    plain, _ = run(tmp_path / "plain", False)
    swapped, callback = run(tmp_path / "swap", True)
    assert callback.session.plan.preset == "llama"
    assert not callback.session.active  # only around the training steps
    for (name, p), (_, q) in zip(swapped.model.named_parameters(), plain.model.named_parameters()):
        assert torch.equal(p, q), name  # bit-identical training with swap
    logs = [entry for entry in swapped.state.log_history if "loss" in entry]
    assert len(logs) == 3
    stats = callback.session.stats
    assert set(stats.offloaded_by_scope) == {f"layer {i}: {s}" for i in range(2) for s in ("self_attn", "mlp")}
    for entry in logs:
        assert entry["swapkit/offloaded_MiB"] == round(stats.offloaded_bytes / 2**20, 3) > 0
        assert entry["swapkit/saved_MiB"] >= entry["swapkit/peak_saved_MiB"] > 0
        assert entry["swapkit/late_fetches"] >= 0 and entry["swapkit/wait_s"] >= 0
        assert entry["swapkit/recomputed_regions"] == 0  # swap only
    assert not any(key.startswith("swapkit/") for entry in plain.state.log_history for key in entry)
    recorder = next(c for c in swapped.callback_handler.callbacks if isinstance(c, Recorder))
    seen = [entry for entry in recorder.seen if "loss" in entry]
    assert len(seen) == 3 and all(entry["swapkit/offloaded_MiB"] > 0 for entry in seen)  # callbacks see them too
    callback.session.remove()


class Failing(Tokens):
    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = super().__getitem__(i)
        return {**item, "input_ids": item["input_ids"] + 1000 * (i >= 4)}  # out of vocabulary: forward raises


def test_a_failing_step_leaves_no_hooks_behind(tmp_path):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**DECODER))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2,
                                          report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                                          dataloader_num_workers=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Failing())
    callback = attach(trainer, CONFIG)
    with pytest.raises(IndexError):
        trainer.train()
    assert not callback.session.active and callback.session.stats.aborted  # hooks popped, step aborted
    callback.session.remove()


def test_trainer_with_torch_compile_offloads(tmp_path):
    """TrainingArguments(torch_compile=True) compiles the whole model: before swapkit's saved-tensor hooks
    were kept out of Dynamo (swapkit.runtime.dynamo Note [Saved-tensor hooks stay out of Dynamo]), the
    first step failed with InternalTorchDynamoError in the pack hook."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**DECODER))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0, torch_compile=True,
        torch_compile_backend="aot_eager")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
    callback = attach(trainer, CONFIG)
    trainer.train()
    torch._dynamo.reset()
    stats = callback.session.stats
    assert stats.offloaded_bytes > 0 and stats.prefetched_bytes + stats.tail_bytes == stats.offloaded_bytes
    assert stats.unused_swaps == []
