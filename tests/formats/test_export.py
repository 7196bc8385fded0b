"""Exports proven by round trips: transformers loads our transformers folders with our logits
(cached too), greedy tokens and token ids; our GGUF files read back by our loader and by
transformers' give our logits, quantized ones our quantize-dequantize weights exactly, and
SmolLM2's own Q4_1 file is reproduced bit for bit."""

import shutil
import string
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from llm import MosaicGPT, load_tokenizer
from llm.utils.pretrained import REPO_ROOT
from llm.data import build_char_tokenizer
from llm.data.tokenizer import train_tokenizer
from llm.cli.export import main as export_main
from llm.formats.gguf import save_gguf
from llm.formats.transformers import save_transformers
from llm.kernels import cpu_quant
from llm.quant.quantize import projections
from llm.utils.pretrained import pretrained_path
from tests.conftest import tiny_model

SMOLLM2 = pretrained_path("smollm2-135m-instruct")
TEXT = "to be, or not to be, that is the question: whether tis nobler in the mind to suffer"


@pytest.fixture(scope="module")
def chars():
    return build_char_tokenizer(string.ascii_lowercase + " ,.:")


@pytest.fixture(scope="module")
def bpe():
    return train_tokenizer("bpe:320", [TEXT * 3, "the slings and arrows of outrageous fortune"])


def assert_transformers_equal(model, directory, ids):
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        ours = model(ids).logits
        torch.testing.assert_close(hf(ids).logits, ours, atol=1e-4, rtol=0)
        past = hf(ids[:, :-3], use_cache=True).past_key_values
        cached = hf(ids[:, -3:], past_key_values=past, use_cache=True).logits
        torch.testing.assert_close(cached, ours[:, -3:], atol=1e-4, rtol=0)
        theirs = hf.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    eos = hf.generation_config.eos_token_id  # the exported generation config's, which both stop at
    # greedy: a registered model's generation config samples (its recommended settings)
    ours = model.generate(ids, max_new_tokens=12, eos_token_id=eos, do_sample=False)
    # Greedy tokens of two float32 implementations may differ where the top two logits tie to the
    # last bits (which depends on the threads a busy machine gives them): each one's every token
    # must be the other's argmax up to such a tie.
    for tokens, judge in ((theirs, lambda t: model(t).logits), (ours, lambda t: hf(t).logits)):
        with torch.no_grad():
            logits = judge(tokens)[0, ids.shape[1] - 1:-1]
        chosen = logits.gather(-1, tokens[0, ids.shape[1]:, None])[:, 0]
        assert (logits.max(-1).values - chosen).max() <= 1e-4, (tokens.tolist(), theirs.tolist(), ours.tolist())
    return hf


@pytest.mark.parametrize("scheme, overrides, arch", [
    ("learned", {}, "gpt2"),
    ("learned", dict(no_bias=True, ffn_act="gelu_tanh", tie_word_embeddings=False), "gpt2"),
    ("alibi", dict(no_bias=True), "mpt"),
    ("llama", {}, "llama"),
    ("rope", dict(ffn_type="glu", ffn_act="silu", norm_type="rmsnorm", no_bias=False), "llama"),
])
def test_transformers_loads_the_export_with_our_logits_cache_and_tokens(tmp_path, chars, scheme, overrides, arch):
    model = tiny_model(scheme, vocab_size=len(chars), **overrides)
    assert save_transformers(model, tmp_path / "hf", chars) == arch
    hf = assert_transformers_equal(model, tmp_path / "hf", chars(TEXT[:40], return_tensors="pt").input_ids)
    assert hf.config.model_type == arch
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")(TEXT).input_ids == chars(TEXT).input_ids


@pytest.mark.parametrize("scheme, overrides, option", [
    ("rope", {}, "ffn_type='mlp'"),
    ("alibi", {}, "no_bias=False"),
    ("alibi", dict(no_bias=True, kv_n_heads=2), "kv_n_heads=2"),
    ("learned", dict(norm_type="rmsnorm"), "norm_type='rmsnorm'"),
])
def test_what_no_transformers_architecture_expresses_is_refused_by_name(tmp_path, chars, scheme, overrides, option):
    with pytest.raises(ValueError, match=option.replace("(", r"\(")):
        save_transformers(tiny_model(scheme, vocab_size=len(chars), **overrides), tmp_path / "hf", chars)
    assert not (tmp_path / "hf").exists()


def test_an_existing_output_is_kept_without_overwrite(tmp_path, chars, bpe):
    model = tiny_model("llama", vocab_size=len(chars))
    save_transformers(model, tmp_path / "hf", chars)
    with pytest.raises(FileExistsError, match="overwrite"):
        save_transformers(model, tmp_path / "hf", chars)
    (tmp_path / ".hf.old").mkdir()  # a folder of the user's with the name a replacement might pick
    (tmp_path / ".hf.old" / "keep.txt").write_text("mine")
    save_transformers(model, tmp_path / "hf", chars, overwrite=True)
    assert (tmp_path / ".hf.old" / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hf.old", "hf"]  # nothing left behind
    (tmp_path / "link").symlink_to(tmp_path / "hf")
    save_transformers(model, tmp_path / "link", chars, overwrite=True)  # the link is replaced, its target kept
    assert (tmp_path / "hf" / "config.json").is_file() and not (tmp_path / "link").is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hf.old", "hf", "link"]
    shutil.rmtree(tmp_path / "link")
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert (tmp_path / "hf").stat().st_mode == fresh.stat().st_mode  # the umask's, not mkdtemp's 0700
    (tmp_path / "m.gguf").write_text("mine")
    with pytest.raises(FileExistsError):
        save_gguf(tiny_model("llama", vocab_size=len(bpe)), bpe, tmp_path / "m.gguf")
    # --overwrite replaces only what an export wrote: never another file or folder
    with pytest.raises(FileExistsError, match="is not a GGUF file: not replacing it"):
        save_gguf(tiny_model("llama", vocab_size=len(bpe)), bpe, tmp_path / "m.gguf", overwrite=True)
    assert (tmp_path / "m.gguf").read_text() == "mine"
    (tmp_path / ".n.gguf.tmp").write_text("mine")  # the user's, with the name a writer might pick
    save_gguf(tiny_model("llama", vocab_size=len(bpe)), bpe, tmp_path / "n.gguf")
    assert (tmp_path / ".n.gguf.tmp").read_text() == "mine" and (tmp_path / "n.gguf").read_bytes()[:4] == b"GGUF"
    (fresh / "precious.txt").write_text("mine")
    for folder in (fresh, tmp_path):  # a folder of the user's; one holding a model folder and more
        with pytest.raises(FileExistsError, match="is not a model folder"):
            save_transformers(model, folder, chars, overwrite=True)
    assert (fresh / "precious.txt").read_text() == "mine"
    with pytest.raises(NotADirectoryError, match=f"{tmp_path / 'm.gguf'} is a file, not a folder"):
        save_transformers(model, tmp_path / "m.gguf" / "hf", chars)


def test_an_f32_gguf_reads_back_in_ours_and_in_transformers_with_our_logits(tmp_path, bpe):
    model = tiny_model("llama", vocab_size=len(bpe))
    save_gguf(model, bpe, tmp_path / "m.gguf")
    ids = bpe(TEXT, return_tensors="pt").input_ids
    back = MosaicGPT.from_pretrained(tmp_path / "m.gguf", quantization="none")
    with torch.no_grad():
        ours = model(ids).logits
        torch.testing.assert_close(back(ids).logits, ours, atol=1e-4, rtol=0)
        hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
        torch.testing.assert_close(hf(ids).logits, ours, atol=1e-4, rtol=0)
    assert load_tokenizer(tmp_path / "m.gguf")(TEXT).input_ids == bpe(TEXT).input_ids
    from gguf import GGUFReader

    assert GGUFReader(tmp_path / "m.gguf").fields["tokenizer.ggml.pre"].contents() == "gpt-2"  # llama.cpp's name


@pytest.mark.parametrize("gguf_type", ["q8_0", "q4_0", "q4_1", "f16"])
def test_a_quantized_gguf_holds_our_quantize_dequantize_weights_exactly(tmp_path, bpe, gguf_type):
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize

    model = tiny_model("llama", vocab_size=len(bpe), tie_word_embeddings=False)
    save_gguf(model, bpe, tmp_path / "m.gguf", gguf_type)
    back = MosaicGPT.from_pretrained(tmp_path / "m.gguf", quantization="none").state_dict()
    for name, weight in model.state_dict().items():
        w = weight.float().numpy()
        if w.ndim == 1:
            expected = w
        elif gguf_type == "f16":
            expected = w.astype(np.float16).astype(np.float32)
        else:
            qtype = T.Q8_0 if gguf_type == "q8_0" or name in ("wte.weight", "lm_head.weight") else T[gguf_type.upper()]
            expected = dequantize(quantize(w, qtype), qtype)
        assert np.array_equal(back[name].numpy(), expected), name
    if gguf_type in ("q4_0", "q4_1"):  # and its projections load onto int4 with the file's own codes, exactly
        if not cpu_quant.available():
            pytest.skip(f"our kernels (fp16 scales, exact for GGUF's) cannot run here: {cpu_quant.unavailable()}")
        native = MosaicGPT.from_pretrained(tmp_path / "m.gguf", backend="llm")
        assert native.quantization.kept == {} and native.quantization.method == "int4"
        for name in projections(native):
            layer = native.get_submodule(name)
            scales, zeros = layer.groups()
            dequantized = (layer.codes().float() - 8).view(layer.out_features, -1, 32) * scales[..., None] \
                + zeros[..., None]
            assert torch.equal(dequantized.view(layer.out_features, -1), back[name + ".weight"]), name


def test_gguf_refuses_what_llama_cpp_cannot_read(tmp_path, chars, bpe):
    with pytest.raises(ValueError, match="llama architecture"):
        save_gguf(tiny_model("learned", vocab_size=len(bpe)), bpe, tmp_path / "a.gguf")
    with pytest.raises(ValueError, match="character-level"):
        save_gguf(tiny_model("llama", vocab_size=len(chars)), chars, tmp_path / "b.gguf")
    with pytest.raises(ValueError, match="gguf_type"):
        save_gguf(tiny_model("llama", vocab_size=len(bpe)), bpe, tmp_path / "c.gguf", "q2_k")
    assert not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def smollm2():
    if not SMOLLM2.is_file():
        pytest.skip("SmolLM2 is fetched by make install (llm fetch smollm2-135m-instruct)")
    return MosaicGPT.from_pretrained("smollm2-135m-instruct", quantization="none"), load_tokenizer("smollm2-135m-instruct")


def test_re_exporting_smollm2_as_q4_1_reproduces_its_file_bit_for_bit(tmp_path, smollm2):
    from gguf import GGUFReader

    save_gguf(*smollm2, tmp_path / "again.gguf", "q4_1")
    original, again = GGUFReader(SMOLLM2), GGUFReader(tmp_path / "again.gguf")
    theirs = {t.name: t for t in original.tensors}
    ours = {t.name: t for t in again.tensors}
    assert set(ours) == set(theirs)
    for name, t in theirs.items():
        assert ours[name].tensor_type == t.tensor_type and bytes(ours[name].data) == bytes(t.data), name
    # and the tokenizer and architecture metadata llama.cpp reads
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                "tokenizer.chat_template", "llama.context_length", "llama.rope.freq_base", "llama.block_count",
                "llama.attention.head_count_kv", "general.file_type"):
        assert again.fields[key].contents() == original.fields[key].contents(), key


def test_smollm2_exported_to_transformers_gives_our_logits_and_chat_template(tmp_path, smollm2):
    model, tokenizer = smollm2
    save_transformers(model, tmp_path / "hf", tokenizer)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    assert_transformers_equal(model, tmp_path / "hf", ids)
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert theirs.apply_chat_template(messages, add_generation_prompt=True) == ids[0].tolist()


def export(*argv, cwd=REPO_ROOT):
    return subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "export.py"), *map(str, argv)],
                          capture_output=True, text=True, cwd=cwd, timeout=300)


def test_the_script_exports_a_bundle_and_a_checkpoint(tmp_path, tiny_data, capsys):
    from tests.train_helpers import tiny_config

    llama = {"max_seq_len": 32, "d_model": 32, "n_heads": 2, "n_layers": 2, "learned_pos_emb": False, "rope": True,
             "ffn_type": "glu", "ffn_act": "silu", "norm_type": "rmsnorm", "no_bias": True}
    cfg = tiny_config(tiny_data, tmp_path / "run", model=llama, max_duration="2ba", save_interval="2ba")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    # a process of its own: every streaming dataset of this process would stay attached to later ones
    trained = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "train.py"), tmp_path / "run.yaml"],
                             capture_output=True, text=True, timeout=300)
    assert trained.returncode == 0, trained.stderr[-2000:]
    checkpoint = tmp_path / "run" / "ep0-ba2-rank0.pt"
    done = export("--model", checkpoint, "--config", tmp_path / "run.yaml", "--to", "transformers",
                  "--out", tmp_path / "from-ckpt")
    assert done.returncode == 0, done.stderr
    bundle = tmp_path / "run" / "model"
    assert export_main(["--model", str(bundle), "--to", "transformers", "--out", str(tmp_path / "from-bundle")]) == 0
    model = MosaicGPT.from_pretrained(bundle)
    for out in ("from-ckpt", "from-bundle"):
        assert_transformers_equal(model, tmp_path / out, torch.tensor([[3, 4, 5, 6, 7, 8]]))
    for argv, message in (
            (["--model", bundle, "--to", "transformers", "--out", tmp_path / "from-bundle"], "exists: pass --overwrite"),
            (["--model", checkpoint, "--to", "gguf", "--out", tmp_path / "x.gguf"], "needs --config"),
            (["--model", bundle, "--config", tmp_path / "run.yaml", "--to", "transformers", "--out", tmp_path / "z"],
             "--config is for a training checkpoint"),
            (["--model", tmp_path / "run.yaml", "--config", tmp_path / "run.yaml", "--to", "transformers",
              "--out", tmp_path / "z"], "is not a checkpoint"),
            (["--model", bundle, "--to", "transformers", "--out", tmp_path, "--overwrite"], "is not a model folder"),
            (["--model", bundle, "--to", "transformers", "--out", ""], "--out must name a folder or file to write"),
            (["--model", bundle, "--to", "gguf", "--out", tmp_path / "y.gguf"], "character-level"),
            (["--model", bundle, "--to", "gguf", "--out", tmp_path / "y"], "a GGUF file's name ends in .gguf")):
        with pytest.raises(SystemExit) as exit_:
            export_main([str(a) for a in argv])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
