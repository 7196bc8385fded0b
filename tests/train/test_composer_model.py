"""ComposerMosaicGPT: next-token loss on shifted labels, -100 ignored, metrics on the same targets."""

import math

import pytest
import torch
import torch.nn.functional as F

from llm import MosaicGPT, MosaicGPTConfig
from llm.train.composer_model import ComposerMosaicGPT, shift_labels

VOCAB = 61


@pytest.fixture
def composer_model() -> ComposerMosaicGPT:
    torch.manual_seed(0)
    config = MosaicGPTConfig(vocab_size=VOCAB, max_seq_len=32, d_model=32, n_heads=4, n_layers=2, init_std=0.2)
    return ComposerMosaicGPT(config).eval()


@pytest.fixture
def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, 5] = -100
    labels[1, 10:] = -100
    return {"input_ids": ids, "labels": labels}


def test_shift_labels_moves_left_and_ignores_the_last_position():
    labels = torch.tensor([[1, 2, 3, 4], [5, -100, 7, 8]])
    assert shift_labels(labels).tolist() == [[2, 3, 4, -100], [-100, 7, 8, -100]]


def test_loss_is_cross_entropy_on_shifted_labels(composer_model, batch):
    logits = composer_model(batch)
    assert logits.shape == (3, 16, VOCAB)
    expected = F.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1), ignore_index=-100
    )
    torch.testing.assert_close(composer_model.loss(logits, batch), expected)


def test_loss_ignores_minus_100_labels(composer_model, batch):
    logits = composer_model(batch)
    # By hand: the mean negative log-likelihood over the positions whose target is not -100.
    targets = batch["labels"][:, 1:]
    keep = targets != -100
    log_probs = logits[:, :-1].log_softmax(-1)
    nll = -log_probs[keep].gather(-1, targets[keep][:, None]).squeeze(-1)
    assert keep.sum() == 3 * 15 - 1 - 6
    torch.testing.assert_close(composer_model.loss(logits, batch), nll.mean())
    # Logits that predict ignored targets do not matter.
    changed = logits.clone()
    changed[1, 9:] = torch.randn_like(changed[1, 9:])
    torch.testing.assert_close(composer_model.loss(changed, batch), nll.mean())


def test_metrics_see_logits_and_shifted_targets(composer_model, batch):
    loss = composer_model.loss(composer_model(batch), batch)
    outputs = composer_model.eval_forward(batch)
    metrics = composer_model.get_metrics(is_train=False)
    assert set(metrics) == {"LanguageCrossEntropy", "LanguagePerplexity"}
    assert set(composer_model.get_metrics(is_train=True)) == {"LanguageCrossEntropy"}
    for metric in metrics.values():
        composer_model.update_metric(batch, outputs, metric)
    assert math.isclose(metrics["LanguageCrossEntropy"].compute().item(), loss.item(), rel_tol=1e-5)
    assert math.isclose(metrics["LanguagePerplexity"].compute().item(), math.exp(loss.item()), rel_tol=1e-5)
    assert composer_model.eval_forward(batch, outputs) is outputs


def test_the_training_metric_reuses_the_loss_of_the_same_logits(composer_model, batch):
    """After loss(), the metric of those logits takes their loss (no second log-softmax) and
    equals what the metric computes from the logits; other logits, padded targets included,
    are computed from the logits."""
    batch = {**batch, "labels": batch["labels"].clone()}
    batch["labels"][1, :6] = -100
    outputs = composer_model(batch)
    reused, computed = (composer_model.get_metrics(is_train=True)["LanguageCrossEntropy"].clone() for _ in range(2))
    composer_model.loss(outputs, batch)
    calls = []
    update = reused.update
    reused.update = lambda *args, **kwargs: calls.append(kwargs) or update(*args, **kwargs)
    composer_model.update_metric(batch, outputs, reused)
    assert list(calls[0]) == ["scored"]  # the loss was taken, not recomputed
    computed.update(outputs.float(), shift_labels(batch["labels"]))
    assert reused.total_items == computed.total_items
    torch.testing.assert_close(reused.sum_loss, computed.sum_loss)
    torch.testing.assert_close(reused.compute(), computed.compute())
    composer_model.update_metric(batch, outputs.detach().clone(), reused)
    assert calls[1] == {}  # logits that loss() did not score are computed from
    nothing = {**batch, "labels": torch.full_like(batch["labels"], -100)}
    empty = composer_model.get_metrics(is_train=True)["LanguageCrossEntropy"].clone()
    composer_model.loss(outputs, nothing)
    composer_model.update_metric(nothing, outputs, empty)
    assert empty.total_items == 0 and empty.sum_loss == 0  # no NaN from a batch with no target


def test_forward_passes_the_attention_mask(composer_model, batch):
    mask = torch.ones_like(batch["input_ids"])
    mask[2, :4] = 0  # left padding
    with_mask = composer_model({**batch, "attention_mask": mask})
    direct = composer_model.model(batch["input_ids"], attention_mask=mask).logits
    torch.testing.assert_close(with_mask, direct)
    torch.testing.assert_close(with_mask[:2], composer_model(batch)[:2])


def test_wraps_a_model_or_builds_one_from_a_config(composer_model):
    model = composer_model.model
    assert ComposerMosaicGPT(model).model is model
    assert isinstance(composer_model.model, MosaicGPT) and composer_model.config is model.config
    with pytest.raises(TypeError, match="MosaicGPTConfig or a MosaicGPT"):
        ComposerMosaicGPT({"d_model": 32})


def test_fullgraph_compiles_the_training_forward_in_one_graph(composer_model, batch):
    # no graph break (the token-id check is a traceable assertion when compiling): fullgraph=True
    # traces it, and its logits and gradients are eager's
    eager = composer_model(batch)
    eager_loss = composer_model.loss(eager, batch)
    eager_loss.backward()
    grads = [p.grad.clone() for p in composer_model.parameters()]
    composer_model.zero_grad()
    # aot_eager: dynamo's tracing and AOTAutograd's joint graph, without inductor's minutes of C++
    compiled = torch.compile(composer_model, fullgraph=True, backend="aot_eager")
    out = compiled(batch)
    composer_model.loss(out, batch).backward()
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
    for grad, p in zip(grads, composer_model.parameters()):
        torch.testing.assert_close(p.grad, grad, atol=1e-5, rtol=1e-4)
