"""The budget planner on a tiny random Hugging Face Llama (nothing downloaded): measure, plan, run."""
from __future__ import annotations

import logging

import pytest
import torch
import yaml

transformers = pytest.importorskip("transformers")

from swapkit.load import load_config  # noqa: E402
from swapkit.plan.emit import planned_config  # noqa: E402
from swapkit.plan.planner import KEEP, Planner, plan_budget  # noqa: E402
from swapkit.planner import ModelSource, ModelSteps, measure  # noqa: E402

CONFIG = {"model": {"model_config": {"num_layers": 3}}, "runtime": {"engine": "thread"}, "train": {"lr": 1e-3}}


def tiny_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=64, attention_dropout=0.0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def batch(step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def causal_lm_loss(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**inputs).loss


SOURCE = ModelSource(tiny_llama, batch, causal_lm_loss, "model.layers")


@pytest.fixture(autouse=True, scope="module")
def _deterministic_copies(inline_copies, one_thread):
    """Predicted and measured peaks are compared on copies that finish when issued (conftest), with
    one intra-op thread (tiny matrices; a copy costs microseconds, not an OpenMP wake-up)."""


@pytest.fixture(scope="module")
def planner():
    measured = measure(load_config(CONFIG), steps=2, warmup=1, model=SOURCE)
    assert "self_attn" in measured.scopes[0] and "mlp" in measured.scopes[0]  # the model's own module names
    return Planner(measured.trace, measured.links, measured.scopes, 1024)


def test_hf_baseline_is_the_sessions_own_peak(planner):
    steps = ModelSteps(load_config(CONFIG), SOURCE, torch.device("cpu"))
    try:
        for number in (1, 2):
            steps.step(number)
        assert steps.session.stats.peak_device_bytes == planner.predict((KEEP,) * 3).peak_device_bytes, planner.trace
    finally:
        steps.close()


@pytest.mark.parametrize("fraction", [0.8, 0.5, 0.25])
def test_hf_llama_planned_yaml_runs_within_5_percent_and_under_budget(planner, tmp_path, fraction):
    budget = int(planner.predict((KEEP,) * 3).peak_device_bytes * fraction)
    planned = plan_budget(planner, budget)
    assert any(not choice.keeps_all for choice in planned.choices)
    path = tmp_path / "planned.yaml"
    path.write_text(yaml.safe_dump(planned_config(CONFIG, planned.choices)), encoding="utf-8")
    steps = ModelSteps(load_config(path), SOURCE, torch.device("cpu"))  # the emitted file loads unchanged
    try:
        for number in (1, 2, 3):
            steps.step(number)
            if number > 1:  # steady state: the session skips the forward's tail, as predicted
                peak = steps.session.stats.peak_device_bytes
                why = f"{planned.choices} predicted {planned.predicted} measured {peak} links {planner.links}"
                assert peak <= budget, why
                predicted = planned.predicted.peak_device_bytes
                assert abs(peak - predicted) <= 0.05 * predicted, why
    finally:
        steps.close()


FIXED_PLANS = {
    "swap every layer k=1": lambda c: (c("swap", ("",), 1),) * 3,
    "recompute, swap, swap": lambda c: (c("recompute"), c("swap", ("",), 1), c("swap", ("",), 2)),
    "swap mlp k=2": lambda c: (c("swap", ("mlp",), 2),) * 3,
    "select mlp": lambda c: (c(select="mlp"),) * 3,
    "select mlp, recompute, select self_attn": lambda c: (c(select="mlp"), c("recompute"), c(select="self_attn")),
}


@pytest.mark.parametrize("name", FIXED_PLANS)
def test_hf_fixed_plans_run_at_their_predicted_peak(planner, tmp_path, name):
    """Layers passing rotary embeddings and the mask to each other, select-recompute regions that
    drop their saves in forward, mixed modes: the prediction is the session's own count, within 0.1%
    (with self_attn select-recomputed the session has counted 256 bytes more than the replay, one
    small int64 tensor; not explained yet)."""
    from swapkit.plan.planner import Choice

    choices = FIXED_PLANS[name](Choice)
    predicted = planner.predict(choices).peak_device_bytes
    path = tmp_path / "fixed.yaml"
    path.write_text(yaml.safe_dump(planned_config(CONFIG, choices)), encoding="utf-8")
    steps = ModelSteps(load_config(path), SOURCE, torch.device("cpu"))
    try:
        for number in (1, 2):
            steps.step(number)
        peak = steps.session.stats.peak_device_bytes
        assert abs(peak - predicted) <= 0.001 * predicted, f"measured {peak} predicted {predicted} {planner.links}"
    finally:
        steps.close()


def test_cli_plans_an_hf_config_json_under_budget(tmp_path, capsys):
    import json

    from swapkit.cli import main

    model_json = tmp_path / "config.json"
    model_json.write_text(json.dumps({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                                      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                      "vocab_size": 64, "max_position_embeddings": 64}))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": {"model_config": {"seq_length": 16}}, "train": {"batch_size": 2}}))
    argv = ["plan", str(config), "--model", f"hf:{model_json}", "--layers", "model.layers", "--json", "--budget"]
    assert main([*argv, "1GiB"]) == 0
    baseline = json.loads(capsys.readouterr().out)["baseline"]["peak_device_bytes"]
    out = tmp_path / "planned.yaml"
    assert main([*argv, str(baseline // 2), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    document = json.loads(captured.out)
    assert "use_cache" not in captured.err  # the planner's steps run without a cache (swapkit.planner.sources)
    assert document["predicted"]["peak_device_bytes"] <= baseline // 2
    assert {row["decision"] for row in document["layers"]} != {"keep"}
    assert load_config(out).swap.swap is True or load_config(out).recompute.recompute


def test_cli_budget_with_a_factory_model_is_a_clean_error(tmp_path, capsys):
    from swapkit.cli import main

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": {"model_config": {"num_layers": 2}}}))
    assert main(["plan", str(config), "--model", "mypkg.models:build", "--budget", "1MiB"]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and "ModelSource" in err and "Traceback" not in err


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def transformers_warnings():
    """The warnings transformers logs: on its own handler, which does not propagate (caplog misses them) and
    writes to the stream it found at import (capsys and capfd miss them)."""
    records, hf_logger = _Records(), logging.getLogger("transformers")
    hf_logger.addHandler(records)
    yield records.messages
    hf_logger.removeHandler(records)


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_cli_plans_an_encoder_only_config_as_its_masked_lm(model_type, tmp_path, capsys, transformers_warnings):
    """An encoder (BERT, RoBERTa) trains as its masked-LM model: not the causal-LM model, which is a
    decoder only with is_decoder=True and warns once per build without it."""
    import json

    from swapkit.cli import main
    from swapkit.integrations.transformers import random_model
    from swapkit.planner.sources import _loss

    model_json = tmp_path / "config.json"
    model_json.write_text(json.dumps({"model_type": model_type, "hidden_size": 32, "intermediate_size": 64,
                                      "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 64,
                                      "max_position_embeddings": 64, "pad_token_id": 1}))
    model = random_model(str(model_json)).eval()  # no dropout: the two losses below are comparable
    assert type(model).__name__.endswith("ForMaskedLM")
    ids = torch.randint(2, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    expected = model(input_ids=ids, labels=ids).loss  # the masked-LM loss, not a stand-in on the logits
    assert torch.equal(_loss(model, {"input_ids": ids}), expected)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": {"model_config": {"seq_length": 16}}, "train": {"batch_size": 2}}))
    assert main(["plan", str(config), "--model", f"hf:{model_json}", "--json", "--budget", "1GiB"]) == 0
    assert transformers_warnings == []
    assert len(json.loads(capsys.readouterr().out)["layers"]) == 2
