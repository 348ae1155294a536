"""transformers.Trainer training a tiny Qwen3-MoE with experts_implementation="moeblaze": a few
optimizer steps over a dataset made here, gradient accumulation 2, bf16 mixed precision (on the
CPU through Trainer's CPU autocast, which transformers allows with use_cpu=True; on the GPU its
CUDA autocast); the loss falls, and a run resumed from the checkpoint saved half-way (the model
loaded with from_pretrained, see below) logs the same losses and ends on the same weights as
the uninterrupted run (bitwise on the CPU; within tolerance on the GPU, whose attention kernels
promise no bits). Needs transformers >= 5 and
accelerate (Trainer's dependency)."""
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe", reason="transformers < 5: no experts "
                    "interface")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a tiny config built here: nothing to download

from helpers import TOL, rel_err, tiny_qwen3_moe  # noqa: E402
from moeblaze.integrations import hf as mb_hf  # noqa: E402

mb_hf.register()

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
STEPS, SAVE_AT = 8, 4


def _model(device, seed):
    d, n = (64, 64) if device == "cuda" else (32, 24)  # the GPU backend: multiples of 64
    torch.manual_seed(seed)
    return tiny_qwen3_moe(d, n, vocab=32)


def _dataset(seed):
    """Sequences counting up from a random start (mod 32): next-token prediction learns fast."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, 32, (32,), generator=gen)
    rows = [(s + torch.arange(16)) % 32 for s in starts]
    return [{"input_ids": r, "labels": r.clone()} for r in rows]


def _args(out, device, seed, steps):
    return transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_steps=steps, learning_rate=3e-3, lr_scheduler_type="constant", warmup_steps=0,
        logging_steps=1, save_strategy="steps", save_steps=SAVE_AT, report_to=[],
        use_cpu=device == "cpu", bf16=True, seed=seed, data_seed=seed,
        dataloader_num_workers=0, disable_tqdm=True)


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("device", DEVICES)
def test_trainer_trains_and_resumes(seed, device, tmp_path):
    data = _dataset(seed)
    full = transformers.Trainer(model=_model(device, seed), args=_args(tmp_path / "full", device,
                                                                       seed, STEPS),
                                train_dataset=data)
    full.train()
    losses = _losses(full)
    assert len(losses) == STEPS and all(l == l for l in losses), losses  # noqa: E741
    assert losses[-1] < 0.9 * losses[0], f"the loss did not fall: {losses}"
    ckpt = tmp_path / "full" / f"checkpoint-{SAVE_AT}"
    assert ckpt.is_dir(), sorted(os.listdir(tmp_path / "full"))

    # Resumed from the half-way checkpoint. The model comes from from_pretrained: save_pretrained
    # writes v5's fused experts in the per-expert layout of the original checkpoints, and
    # Trainer's resume loads the file with load_state_dict(strict=False), without transformers'
    # weight conversion: it would leave the experts as initialised (warning of missing keys;
    # the same with experts_implementation="eager").
    model = type(full.model).from_pretrained(str(ckpt), experts_implementation="moeblaze")
    assert model.config._experts_implementation == "moeblaze"
    resumed = transformers.Trainer(model=model,
                                   args=_args(tmp_path / "full", device, seed, STEPS),
                                   train_dataset=data)
    resumed.train(resume_from_checkpoint=str(ckpt))
    again = _losses(resumed)[-(STEPS - SAVE_AT):]
    want = dict(full.model.named_parameters())
    if device == "cpu":  # deterministic: the same bits
        assert again == losses[SAVE_AT:], (losses, again)
        for name, p in resumed.model.named_parameters():
            assert torch.equal(p, want[name]), f"{name} differs after resuming"
    else:  # CUDA kernels of the model (attention's backward) promise no bits
        assert again == pytest.approx(losses[SAVE_AT:], rel=1e-2), (losses, again)
        for name, p in resumed.model.named_parameters():
            assert rel_err(p, want[name]) <= TOL[torch.bfloat16], f"{name} after resuming"
