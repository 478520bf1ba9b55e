"""A Hugging Face user's Trainer runs with swapkit: a model built by ``model_init``, and the checks of
what the Trainer does beyond plain training steps (evaluation, checkpoints, resuming)."""
from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it

import torch  # noqa: E402

from swapkit.integrations.transformers import attach  # noqa: E402
from tests.hf_models import DECODER  # noqa: E402
from tests.test_trainer import Tokens  # noqa: E402

LAYER_SWAP = {"swap_config": {"swap": True, "layer_swap": [{"backward_prefetch": 1, "layers": True}]},
              "runtime": {"min_offload_bytes": 0}}


def tiny_llama() -> torch.nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**DECODER, use_cache=False))


def arguments(tmp_path, **extra) -> transformers.TrainingArguments:
    values = dict(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, logging_steps=1,
                  learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
                  dataloader_num_workers=0)
    return transformers.TrainingArguments(**{**values, **extra})


def assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_trainer_with_model_init_swaps_the_model_it_trains(tmp_path):
    """``Trainer(model_init=...)`` builds a new model in ``train()``: swapkit was applied to the one built in
    ``__init__`` only, so the trained model swapped nothing, and the warning blamed torch.compile."""
    plain = transformers.Trainer(model_init=tiny_llama, args=arguments(tmp_path / "plain"), train_dataset=Tokens())
    plain.train()
    trainer = transformers.Trainer(model_init=tiny_llama, args=arguments(tmp_path / "swap"), train_dataset=Tokens())
    first = trainer.model
    callback = attach(trainer, LAYER_SWAP)
    trainer.train()
    session = callback.session
    assert trainer.model is not first and session.model is trainer.model
    assert set(session.stats.offloaded_by_scope) == {"layer 0", "layer 1"} and session.stats.unused_swaps == []
    assert getattr(first, "_swapkit_applied", None) is None  # the model built in __init__ is restored
    assert_same_parameters(trainer.model, plain.model)  # bit-identical training with swap
    session.remove()


class ActiveDuringEvaluation(transformers.TrainerCallback):
    """Records whether the swapkit session was active at each evaluation batch."""

    def __init__(self) -> None:
        self.session = None
        self.seen: list[bool] = []

    def on_prediction_step(self, args, state, control, **kwargs) -> None:
        if self.session is not None:
            self.seen.append(self.session.active)


def test_evaluation_checkpoints_and_resuming_match_the_plain_run(tmp_path):
    """Gradient accumulation with a short last step (4 micro-batches per epoch, 3 per step), evaluation and
    checkpoints every 2 steps, then a resume from the first checkpoint: each bit-identical to the plain run."""
    extra = dict(max_steps=4, gradient_accumulation_steps=3, eval_strategy="steps", eval_steps=2,
                 save_strategy="steps", save_steps=2)

    def run(out, with_swapkit, resume=None):
        torch.manual_seed(0)
        recorder = ActiveDuringEvaluation()
        trainer = transformers.Trainer(model=tiny_llama(), args=arguments(tmp_path / out, **extra),
                                       train_dataset=Tokens(), eval_dataset=Tokens(4), callbacks=[recorder])
        callback = attach(trainer, LAYER_SWAP) if with_swapkit else None
        recorder.session = callback.session if callback else None
        trainer.train(resume_from_checkpoint=resume)
        return trainer, callback, recorder

    plain, _, _ = run("plain", False)
    swapped, callback, recorder = run("swap", True)
    assert_same_parameters(swapped.model, plain.model)

    def eval_losses(trainer):
        return [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry]

    assert len(eval_losses(swapped)) == 2 and eval_losses(swapped) == eval_losses(plain)
    assert recorder.seen and not any(recorder.seen)  # evaluation ran outside the session
    assert callback.session.stats.offloaded_bytes > 0 and callback.session.stats.unused_swaps == []
    callback.session.remove()
    resumed, callback, _ = run("swap", True, resume=str(tmp_path / "swap" / "checkpoint-2"))
    assert resumed.state.global_step == 4 and callback.session.stats.offloaded_bytes > 0
    assert_same_parameters(resumed.model, plain.model)
    callback.session.remove()


def frozen_but_queries() -> torch.nn.Module:
    """PEFT-style fine-tuning: the base weights frozen, a few small matrices trained."""
    model = tiny_llama()
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(".q_proj." in name)
    return model


@pytest.mark.parametrize("config", [LAYER_SWAP, {"recompute_config": {"recompute": True}},
                                    {**LAYER_SWAP, "recompute_config": {"select_recompute": ["feed_forward"]}}],
                         ids=["layer swap", "full recompute", "layer swap + select recompute"])
@pytest.mark.parametrize("build,extra", [(frozen_but_queries, {}), (tiny_llama, {"bf16": True})],
                         ids=["frozen base weights", "bf16 autocast"])
def test_frozen_base_weights_and_bf16_match_the_plain_run(tmp_path, build, extra, config):
    runs = []
    for with_swapkit in (False, True):
        torch.manual_seed(0)
        trainer = transformers.Trainer(model=build(), args=arguments(tmp_path / str(with_swapkit), **extra),
                                       train_dataset=Tokens())
        callback = attach(trainer, config) if with_swapkit else None
        trainer.train()
        runs.append(trainer.model)
    assert_same_parameters(*runs)
    stats = callback.session.stats
    assert stats.offloaded_bytes > 0 or "swap_config" not in config
    assert sum(stats.recomputed_by_scope.values()) == 2 * ("recompute_config" in config)
    assert stats.unused_swaps == []
    callback.session.remove()
