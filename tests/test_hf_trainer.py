"""`transformers.Trainer` through megatrain (issue 20, examples/hf_trainer.py).

A 2-layer Llama fine-tuned for a few steps on random tokens with the Trainer's own loop
(gradient accumulation, gradient clipping that bites, AdamW with a warmup schedule) gives the
same per-micro-batch losses and the same parameters through megatrain's compiled model on the
CPU stand-in, under a budget that makes the parameters stream, as with a plain Trainer, while
the model stays in host memory and the AdamW step runs as megatrain's host kernel.
"""
import copy
import importlib.util
import os

import pytest
import torch
import transformers

import megacompile
from megacompile.optimizer import host_step

_EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "hf_trainer.py")
_spec = importlib.util.spec_from_file_location("hf_trainer_example", _EXAMPLE)
hf_trainer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf_trainer)

VOCAB, SEQ, STEPS, BATCH, ACCUM = 64, 16, 3, 2, 2


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, count: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (count, SEQ), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _tiny_llama(layers: int = 2):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=False, tie_word_embeddings=False,
        attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _recording(trainer_class):
    class Recording(trainer_class):
        """Keeps each micro-batch's loss as ``training_step`` returns it (the Trainer's logs round)."""

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self.losses.append(loss.item())
            return loss

    return Recording


def _train(model, megatrain: bool, tmp_path, budget: int | None = None, gradient_checkpointing: bool = False):
    args = transformers.TrainingArguments(gradient_checkpointing=gradient_checkpointing,
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUM, learning_rate=1e-2, warmup_steps=1, lr_scheduler_type="linear",
        max_grad_norm=0.5, optim="adamw_torch", weight_decay=0.01, use_cpu=True, seed=0,
        save_strategy="no", report_to=[], logging_steps=1, disable_tqdm=True, dataloader_num_workers=0)
    dataset = RandomTokens(STEPS * BATCH * ACCUM)
    if megatrain:
        trainer = _recording(hf_trainer.MegatrainTrainer)(
            model, args, {"device": "cpu", "lowering": "eager", "memory_budget": budget}, train_dataset=dataset)
    else:
        trainer = _recording(transformers.Trainer)(model=model, args=args, train_dataset=dataset)
    trainer.losses = []
    trainer.train()
    return trainer


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_trainer_through_megatrain_matches_plain_trainer(tmp_path, gradient_checkpointing):
    """With the Trainer's gradient_checkpointing on too: megatrain inlines the checkpointed layers
    and plans their recompute itself (docs/guide.md, "A step's own regions")."""
    model = _tiny_llama()
    reference_model = copy.deepcopy(model)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # Too small to keep the parameters resident: they stream, and some activations are recomputed.
    budget = 5 * param_bytes // 2
    reference = _train(reference_model, megatrain=False, tmp_path=tmp_path / "plain",
                       gradient_checkpointing=gradient_checkpointing)
    trainer = _train(model, megatrain=True, tmp_path=tmp_path / "megatrain", budget=budget,
                     gradient_checkpointing=gradient_checkpointing)

    assert len(trainer.losses) == len(reference.losses) == STEPS * ACCUM
    torch.testing.assert_close(torch.tensor(trainer.losses), torch.tensor(reference.losses), rtol=1e-5, atol=0)
    # Clipping bit (norms above 0.5), so the comparison covers the Trainer's clipped update.
    norms = [entry["grad_norm"] for entry in reference.state.log_history if "grad_norm" in entry]
    assert len(norms) == STEPS and all(n > 0.5 for n in norms)
    for (name, p), (_, q) in zip(model.named_parameters(), reference_model.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")

    # What megatrain did: the model stayed on the host and streamed through the stand-in
    # device, and the Trainer's AdamW step was megatrain's host kernel.
    assert all(p.device.type == "cpu" for p in model.parameters())
    report = megacompile.last_report()
    assert report.device == "cpu" and report.h2d_bytes >= param_bytes
    assert report.planned_peak_device_bytes <= budget and report.measured_peak_device_bytes <= budget
    optimizer = trainer.optimizer.optimizer  # accelerate's wrapper around the torch AdamW
    assert getattr(optimizer.step, host_step.HOST_STEP_MARK, False)
    assert report.host_graphs == [host_step.host_step_label(optimizer)]
    assert report.host_bytes["optimizer_states"] == 2 * param_bytes + 4 * len(list(model.parameters()))


def test_trainer_evaluate_streams_the_model_like_training(tmp_path):
    """``Trainer.evaluate()`` runs the compiled model under ``torch.no_grad()``: a forward that
    streams through the device within the budget (not a host computation), with the plain
    Trainer's eval loss."""
    model = _tiny_llama(layers=6)
    reference_model = copy.deepcopy(model)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = param_bytes // 2  # the parameters cannot all be on the device at once
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=BATCH, use_cpu=True,
                                          report_to=[], disable_tqdm=True, dataloader_num_workers=0)
    dataset = RandomTokens(2 * BATCH)
    trainer = hf_trainer.MegatrainTrainer(model, args, {"device": "cpu", "lowering": "eager", "memory_budget": budget},
                                          eval_dataset=dataset)
    reference = transformers.Trainer(model=reference_model, args=args, eval_dataset=dataset)
    got, want = trainer.evaluate()["eval_loss"], reference.evaluate()["eval_loss"]
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    report = megacompile.last_report()
    assert [g.endswith("(no backward)") for g in report.graphs] == [True], report.graphs
    assert report.h2d_bytes >= param_bytes and report.measured_peak_device_bytes <= budget


def test_megatrain_trainer_refuses_what_would_put_the_model_elsewhere(tmp_path):
    model = _tiny_llama()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], torch_compile=True)
    with pytest.raises(ValueError, match="leave TrainingArguments.torch_compile off"):
        hf_trainer.MegatrainTrainer(model, args, {"device": "cpu"})
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match="keeps the model in host memory"):
        hf_trainer.MegatrainTrainer(model.to("meta"), args, {"device": "cpu"})


def test_example_command_line_trains_on_the_cpu_stand_in(tmp_path, capsys):
    hf_trainer.main(["--device", "cpu", "--steps", "2", "--layers", "1", "--hidden", "32", "--seq-len", "16",
                     "--batch", "2", "--grad-accum", "2", "--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "trained 2 steps" in out
    report = megacompile.last_report()
    assert report.device == "cpu" and report.graphs and report.host_graphs == ["optimizer (host, fused AdamW)"]
