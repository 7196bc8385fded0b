"""Gradient accumulation: microbatches of a batch give the same gradients and update as the whole batch."""

from pathlib import Path

import pytest
import torch
from composer.core import Callback

from llm.train.builders import run_data
from llm.train.trainer import build_trainer, resolve_config
from tests.train_helpers import extra_callbacks, tiny_config

torch.set_num_threads(1)


class GradientGrabber(Callback):
    """Copies every gradient after the last microbatch (and gradient clipping), before the optimizer step."""

    def __init__(self):
        self.grads = {}

    def after_train_batch(self, state, logger):
        self.grads = {n: p.grad.detach().clone() for n, p in state.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("microbatch", [4, 8])
def test_microbatches_give_the_full_batch_update(tiny_data, tmp_path, microbatch):
    weights, grads, losses = {}, {}, {}
    for size in (16, microbatch):
        cfg = resolve_config(tiny_config(
            tiny_data, tmp_path / f"run{size}", max_duration="1ba", global_train_batch_size=16,
            device_train_microbatch_size=size, eval_interval="10ba", save_interval="10ba",
            # No warmup: Composer's linear warmup gives the first step lr 0. Adam's first step is
            # lr * g / (|g| + eps), about lr * sign(g): it turns float32 summation-order differences
            # (~1e-8) of near-zero gradients into weight differences up to lr * 1e-8 / eps, which an
            # eps of 1e-5 keeps below 1e-6 (with 1e-6, 1 weight in 28,640 differed by 1.05e-6).
            optimizer={"name": "decoupled_adamw", "lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-5, "weight_decay": 1e-4},
            scheduler={"name": "cosine_with_warmup", "t_warmup": "0ba", "alpha_f": 0.1},
        ))
        grabber = GradientGrabber()
        with extra_callbacks(grabber):
            trainer, _ = build_trainer(cfg, run_data(cfg))
        init = {k: v.detach().clone() for k, v in trainer.state.model.state_dict().items()}
        trainer.fit()
        assert int(trainer.state.timestamp.batch) == 1
        weights[size] = {k: v.detach().clone() for k, v in trainer.state.model.state_dict().items()}
        grads[size], losses[size] = grabber.grads, trainer.state.total_loss_dict["loss/train/total"]
        trainer.close()

    assert max((weights[16][k] - init[k]).abs().max().item() for k in init) > 5e-3  # a real step (lr 1e-2)
    assert losses[microbatch] == pytest.approx(losses[16], abs=1e-6)
    assert grads[16].keys() == grads[microbatch].keys() and len(grads[16]) > 0
    for name, full in grads[16].items():
        torch.testing.assert_close(grads[microbatch][name], full, atol=1e-7, rtol=1e-5, msg=name)
    for name, full in weights[16].items():
        torch.testing.assert_close(weights[microbatch][name], full, atol=1e-6, rtol=0, msg=name)


def _padded_batch_grads(microbatch, on_tokens):
    from composer import Trainer
    from composer.optim import DecoupledAdamW
    from composer.utils import reproducibility

    from llm.train.composer_model import ComposerMosaicGPT
    from llm.config import MosaicGPTConfig
    from llm.data import build_char_tokenizer, load_corpus
    from llm.train.builders import build_train_loader, token_counting_data_spec

    tokenizer = build_char_tokenizer(load_corpus("validation"))
    loader = build_train_loader({"name": "finetuning", "dataset": {"path": str(CUES)}, "drop_last": True}, [],
                                tokenizer, 256, 16, seed=0)
    reproducibility.seed_all(0)
    model = ComposerMosaicGPT(MosaicGPTConfig(vocab_size=len(tokenizer), max_seq_len=256, d_model=32, n_heads=2, n_layers=2))
    grabber = GradientGrabber()
    Trainer(model=model, train_dataloader=token_counting_data_spec(loader) if on_tokens else loader,
            accumulate_train_batch_on_tokens=on_tokens, optimizers=DecoupledAdamW(model.parameters(), lr=1e-3),
            max_duration="1ba", device_train_microbatch_size=microbatch, callbacks=[grabber], progress_bar=False,
            seed=0).fit()
    return grabber.grads


CUES = Path(__file__).resolve().parents[2] / "configs" / "data" / "shakespeare-cues-validation.jsonl"


def test_padded_microbatches_need_token_weighting():
    """Fine-tuning batches score different numbers of tokens per example: Composer's default
    weighting of microbatches by examples changes the gradient; weighting by tokens does not."""
    full = _padded_batch_grads(16, on_tokens=True)
    assert _padded_batch_grads(16, on_tokens=False).keys() == full.keys()
    by_tokens, by_examples = _padded_batch_grads(4, on_tokens=True), _padded_batch_grads(4, on_tokens=False)
    for name, grad in full.items():
        torch.testing.assert_close(by_tokens[name], grad, atol=1e-7, rtol=1e-5, msg=name)
    worst = max(((by_examples[k] - full[k]).norm() / full[k].norm()).item() for k in full)
    assert worst > 0.05  # 28% with this data
