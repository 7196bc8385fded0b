"""Fine-tuning from a pretrained bundle on cue/reply pairs: the data, the loader dispatch, the training."""

from pathlib import Path

import pytest
import torch
from composer import Trainer
from composer.core import Evaluator
from composer.optim import DecoupledAdamW

from llm.data import load_tokenizer
from llm.data.cues import cue_pairs, make_cue_dataset, write_jsonl
from llm.data.finetune import IGNORE_INDEX, load_jsonl
from llm.data.tokenizer import CHATML_TEMPLATE
from llm.train.evaluate import evaluate
from llm.model import MosaicGPT
from llm.train.builders import build_eval_loaders, build_train_loader, load_pretrained
from llm.train.trainer import train
from llm.utils.config import ConfigError
from tests.train_helpers import make_tiny_data, tiny_config

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A char-level model pretrained for 20 batches (128-token blocks), and cue/reply JSONL files."""
    root = tmp_path_factory.mktemp("finetune")
    data = make_tiny_data(root, seq_len=128)
    cfg = tiny_config(data, root / "pretrain", model={"max_seq_len": 128, "d_model": 32, "n_heads": 2, "n_layers": 2},
                      max_duration="20ba", eval_interval="20ba", save_interval="20ba")
    bundle = train(cfg)["model_dir"]
    for split, n in (("train", 200), ("validation", 48)):
        # ChatML's markers take 21 of the 128 tokens (characters)
        write_jsonl(make_cue_dataset(split, n, max_chars=100), root / f"{split}.jsonl")
    return {"root": root, "bundle": bundle, "data": data}


def _loader_cfg(path, shuffle, chat_template="auto"):
    return {"name": "finetuning", "dataset": {"path": str(path), "padding_side": "right", "shuffle": shuffle,
                                              "chat_template": chat_template}, "drop_last": shuffle}


def test_cue_pairs():
    text = ("SCENE I. A room.\n\n[Enter A and B]\n\nA:\nWho's there?\nNay, answer me.\n\nB:\nLong live the king!\n"
            "[Aside] Hush.\nHe comes.\nAnd more.\n\n[Exit A]\n\nC:\nAlone.\n\nC:\nStill alone.\n")
    assert cue_pairs(text) == [{"prompt": "A:\nNay, answer me.\n\nB:\n", "response": "Long live the king!\nHe comes."}]
    assert cue_pairs(text, max_chars=30) == []


def test_shipped_data():
    for split, n in (("train", 1000), ("validation", 200)):
        examples = load_jsonl(REPO / "configs" / "data" / f"shakespeare-cues-{split}.jsonl")
        assert len(examples) == n
        # Fits the 256-token blocks of configs/shakespeare.yaml's model with any byte-level tokenizer.
        assert max(len((ex["prompt"] + ex["response"]).encode()) for ex in examples) < 256
        assert all(ex["prompt"].endswith(":\n") and ex["response"] for ex in examples)
    assert make_cue_dataset("validation", 200, seed=0) == load_jsonl(REPO / "configs/data/shakespeare-cues-validation.jsonl")


def test_loaders_dispatch_on_name(setup):
    tokenizer = load_tokenizer(setup["bundle"])
    batch = next(iter(build_train_loader(_loader_cfg(setup["root"] / "train.jsonl", False), [], tokenizer, 128, 4,
                                         seed=0)))
    assert set(batch) == {"input_ids", "labels", "attention_mask"} and batch["input_ids"].shape[0] == 4
    assert (batch["labels"][:, 0] == IGNORE_INDEX).all()  # the prompt is not scored
    (replies,) = build_eval_loaders(_loader_cfg(setup["root"] / "validation.jsonl", False), [], tokenizer, 128, 4, seed=0)
    assert replies.label == "validation" and replies.sequences == replies.available == 48
    assert 1.0 < replies.tokens_per_byte < 1.2  # characters, plus ChatML's "<|im_end|>\n" ending each reply
    responses = [ex["response"] for ex in load_jsonl(setup["root"] / "validation.jsonl")]
    assert replies.predicted_tokens == sum(len(tokenizer(r).input_ids) + 2 for r in responses)


def test_finetuning_a_pretrained_bundle_lowers_the_reply_loss(setup, tmp_path):
    model, tokenizer = load_pretrained(setup["bundle"])
    pretrained = MosaicGPT.from_pretrained(setup["bundle"])
    assert all(torch.equal(a, b) for a, b in zip(model.model.state_dict().values(), pretrained.state_dict().values()))
    (replies,) = build_eval_loaders(_loader_cfg(setup["root"] / "validation.jsonl", False), [], tokenizer, 128, 16,
                                    seed=0)
    evaluator = Evaluator(label="replies", dataloader=replies.loader, metric_names=["LanguageCrossEntropy"])
    trainer = Trainer(model=model, train_dataloader=build_train_loader(_loader_cfg(setup["root"] / "train.jsonl", True),
                                                                       [], tokenizer, 128, 8, seed=1),
                      optimizers=DecoupledAdamW(model.parameters(), lr=1e-2), max_duration="25ba", eval_dataloader=evaluator,
                      eval_interval="25ba", progress_bar=False, seed=1, save_folder=str(tmp_path), save_interval="25ba")
    trainer.eval()
    before = float(trainer.state.eval_metrics["replies"]["LanguageCrossEntropy"].compute())
    trainer.fit()
    after = float(trainer.state.eval_metrics["replies"]["LanguageCrossEntropy"].compute())
    assert after < before - 0.1, (before, after)

    # llm.train.evaluate scores the same replies, for the checkpoint (a load_pretrained config) and the bundle.
    cfg = {"load_pretrained": setup["bundle"], "eval_loader": _loader_cfg(setup["root"] / "validation.jsonl", False),
           "device_eval_batch_size": 16}
    tuned = evaluate(cfg, load_path=str(tmp_path / "ep0-ba25-rank0.pt"))
    figures = tuned["evaluators"]["validation"]
    assert figures["nats_per_token"] == pytest.approx(after, abs=1e-5)
    assert figures["sequences"] == figures["available"] == 48 and 1.0 < figures["tokens_per_byte"] < 1.2
    untuned = evaluate({**cfg, "eval_max_sequences": 12}, model=setup["bundle"])
    assert untuned["evaluators"]["validation"]["sequences"] == 12
    assert untuned["evaluators"]["validation"]["nats_per_token"] > after + 0.1


def test_train_finetunes_from_load_pretrained(setup, tmp_path):
    cfg = tiny_config(setup["data"], tmp_path / "ft", load_pretrained=setup["bundle"], max_duration="10ba",
                      eval_interval="5ba", save_interval="5ba", num_samples=1, sample_max_new_tokens=8,
                      sample_prompts=["A:\nWho's there?\n\nB:\n"])
    del cfg["model"]
    cfg["train_loader"] = _loader_cfg(setup["root"] / "train.jsonl", True)
    cfg["eval_loader"] = _loader_cfg(setup["root"] / "validation.jsonl", False)
    result = train(cfg)
    assert (result["start_batch"], result["batches"]) == (0, 10)
    assert result["vocab_size"] == len(load_tokenizer(setup["bundle"]))
    assert 1.0 < result["tokens_per_byte"] < 1.2 and result["bits_per_byte"] > 0
    assert MosaicGPT.from_pretrained(result["model_dir"]).config == MosaicGPT.from_pretrained(setup["bundle"]).config
    assert result["samples"][0].startswith("A:\nWho's there?\n\nB:\n")
    # the bundle talks ChatML, the template it was fine-tuned in, and stops at the end of its turn
    tuned = load_tokenizer(result["model_dir"])
    assert tuned.chat_template == CHATML_TEMPLATE
    ends = MosaicGPT.from_pretrained(result["model_dir"]).generation_config.eos_token_id
    assert ends == (tuned.convert_tokens_to_ids("<|im_end|>"), tuned.eos_token_id)
    with pytest.raises(ConfigError, match=r"load_pretrained"):
        train({**cfg, "model": {"d_model": 32}})


def test_bucketed_padding_changes_no_loss(setup):
    # batches padded to a power-of-two length (a compiled run's buckets) score the same loss
    from llm.data.finetune import PaddingCollator, build_finetune_dataset
    from llm.train.composer_model import next_token_loss

    tokenizer = load_tokenizer(setup["bundle"])
    model = MosaicGPT.from_pretrained(setup["bundle"]).eval()
    examples = [build_finetune_dataset(setup["root"] / "validation.jsonl", tokenizer, 128)[i] for i in range(5)]
    plain = PaddingCollator(tokenizer.pad_token_id)(examples)
    bucketed = PaddingCollator(tokenizer.pad_token_id, bucket_to=128)(examples)
    width = plain["input_ids"].shape[1]
    assert bucketed["input_ids"].shape[1] == min(128, max(16, 1 << (width - 1).bit_length())) > width
    with torch.no_grad():
        losses = [next_token_loss(model(b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1],
                                  b["labels"][:, 1:]) for b in (plain, bucketed)]
    torch.testing.assert_close(losses[0], losses[1], atol=1e-6, rtol=0)


def test_compiled_finetuning_on_padded_batches_of_varying_length(setup, tmp_path):
    # dynamic lengths crashed inductor's backward (a size/stride assertion): bucketed static shapes
    # in file order, batches of 4 whose longest example is 13 and then 29 tokens (raw text, no chat
    # template): buckets 16 and 32
    pairs = [{"prompt": "A:\n", "response": "x" * n} for n in (3, 5, 8, 9, 20, 18, 25, 12)]
    write_jsonl(pairs, tmp_path / "lengths.jsonl")
    cfg = tiny_config(setup["data"], tmp_path / "ft", load_pretrained=setup["bundle"], max_duration="2ba",
                      eval_interval="2ba", save_interval="2ba", compile_config={}, precision="fp32",
                      global_train_batch_size=4, device_eval_batch_size=4, eval_subset_num_batches=1)
    del cfg["model"]
    cfg["train_loader"] = _loader_cfg(tmp_path / "lengths.jsonl", False, "none")
    cfg["eval_loader"] = _loader_cfg(tmp_path / "lengths.jsonl", False, "none")
    lengths = set()
    from llm.data import finetune

    collate = finetune.PaddingCollator.__call__

    def recording(self, examples):
        batch = collate(self, examples)
        lengths.add(batch["input_ids"].shape[1])
        return batch

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(finetune.PaddingCollator, "__call__", recording)
        result = train(cfg)
    assert (result["start_batch"], result["batches"]) == (0, 2) and result["bits_per_byte"] > 0
    assert lengths == {16, 32}  # two lengths: without buckets, the second compiled with dynamic shapes
