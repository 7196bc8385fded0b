"""Training at the hardware's speed: bf16 autocast on the CPU (trains, resumes exactly), Composer's
compile option, weight decay on matrices only, FLOPs per token and the measured peak for MFU.

Trainings run in processes of their own: streaming keeps every dataset's shared memory attached
for the life of a process, and the suite's other trainings already hold most of its file limit."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llm import MosaicGPTConfig
from llm.train.composer_model import ComposerMosaicGPT
from llm.train.speed import flops_per_token, measure_peak_flops
from llm.train.trainer import optimizer_groups, resolve_config
from llm.utils.config import ConfigError
from tests.train_helpers import tiny_config

REPO = Path(__file__).resolve().parents[2]


def test_flops_per_token_counts_every_matrix_six_times_plus_attention():
    c = MosaicGPTConfig(vocab_size=100, d_model=8, n_heads=2, n_layers=3, kv_n_heads=1, ffn_type="glu",
                        ffn_act="silu", ffn_hidden_size=20, learned_pos_emb=False, rope=True)
    per_layer = 8 * (8 + 2 * 4) + 8 * 8 + 3 * 8 * 20  # Wqkv (4-wide kv head), out_proj, gate/up/down
    assert flops_per_token(c, seq_len=16) == 6 * (3 * per_layer + 100 * 8) + 12 * 3 * 8 * 16


def test_the_measured_peak_is_a_plausible_matmul_rate():
    peak = measure_peak_flops(torch.float32, size=256, seconds=0.05)
    assert 1e8 < peak < 1e14


def test_weight_decay_falls_on_matrices_only_unless_all_is_asked():
    model = ComposerMosaicGPT(MosaicGPTConfig(vocab_size=50, d_model=16, n_heads=2, n_layers=2, max_seq_len=8))
    names = {id(p): n for n, p in model.named_parameters()}
    decayed, kept = optimizer_groups(model, weight_decay=0.1, decay="matrices")
    assert decayed["weight_decay"] == 0.1 and kept["weight_decay"] == 0.0
    assert {names[id(p)] for p in decayed["params"]} == {n for n, p in model.named_parameters() if p.dim() >= 2}
    assert all(p.dim() == 1 for p in kept["params"])  # norms and biases
    assert any("bias" in names[id(p)] for p in kept["params"]) and any("norm" in names[id(p)] for p in kept["params"])
    (everything,) = optimizer_groups(model, weight_decay=0.1, decay="all")
    assert len(everything["params"]) == len(list(model.parameters()))


def test_eval_metrics_of_bf16_logits_are_summed_in_float32():
    """Under autocast the logits are bf16; the metric's cross-entropy and its sum over the batch's
    tokens must still be float32 (in bf16 they were rounded to ~1e-2 nats)."""
    torch.manual_seed(0)
    model = ComposerMosaicGPT(MosaicGPTConfig(vocab_size=300, d_model=32, n_heads=2, n_layers=1, max_seq_len=64,
                                              init_std=0.2)).eval()
    model.autocast_dtype = torch.bfloat16
    batch = {"input_ids": torch.randint(0, 300, (8, 64)), "labels": torch.randint(0, 300, (8, 64))}
    with torch.no_grad():
        logits = model.eval_forward(batch)
    assert logits.dtype == torch.bfloat16
    metric = model.get_metrics(is_train=False)["LanguageCrossEntropy"]
    model.update_metric(batch, logits, metric)
    exact = torch.nn.functional.cross_entropy(logits[:, :-1].double().flatten(0, 1), batch["labels"][:, 1:].flatten())
    assert abs(float(metric.compute()) - float(exact)) < 1e-5


AUTOCAST = """
import json, sys
import torch
from llm.train.trainer import build_trainer, resolve_config, run_data
from tests.train_helpers import tiny_config

cfg = resolve_config(tiny_config(sys.argv[1], sys.argv[2], precision="amp_bf16", max_duration="2ba"))
trainer, _ = build_trainer(cfg, run_data(cfg))
model, seen = trainer.state.model, []
model.model.blocks[0].attn.Wqkv.register_forward_hook(lambda m, i, o: seen.append(str(o.dtype)))
trainer.fit()
print(json.dumps([sorted(set(seen)), sorted({str(p.dtype) for p in model.parameters()})]))
"""


def test_bf16_on_the_cpu_autocasts_the_forward_and_keeps_fp32_weights(tiny_data, tmp_path):
    done = subprocess.run([sys.executable, "-c", AUTOCAST, str(tiny_data), str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    activations, weights = json.loads(done.stdout.strip().splitlines()[-1])
    assert activations == ["torch.bfloat16"] and weights == ["torch.float32"]


RUNS = """
import json, sys
from llm.train.trainer import train
from tests.train_helpers import tiny_config

data, root = sys.argv[1], sys.argv[2]
run = lambda folder, **kw: train(tiny_config(data, f"{root}/{folder}", precision="amp_bf16", num_samples=0, **kw))
straight = run("a", max_duration="4ba")
run("b", max_duration="2ba")
resumed = run("b", max_duration="4ba", autoresume=True)
compiled = train(tiny_config(data, f"{root}/c", max_duration="2ba", num_samples=0, compile_config={"backend": "eager"}))
print(json.dumps([straight["heldout_nats_per_token"], resumed["heldout_nats_per_token"], resumed["start_batch"],
                  compiled["batches"], compiled["tokens_per_s"], compiled["mfu"], compiled["compile_seconds"],
                  compiled["train_seconds"]]))
"""


def test_bf16_resumes_exactly_and_compile_config_compiles_the_step(tiny_data, tmp_path):
    done = subprocess.run([sys.executable, "-c", RUNS, str(tiny_data), str(tmp_path)], capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    straight, resumed, start, batches, tokens_per_s, mfu, compile_s, train_s = json.loads(done.stdout.strip().splitlines()[-1])
    assert start == 2 and resumed == straight  # 4 bf16 batches straight = 2, then 2 more after a resume
    assert batches == 2 and tokens_per_s > 0 and 0 < mfu < 1  # the compiled run trained and was measured
    assert train_s > compile_s > 0  # the first batch traced the step: its extra time is compiling
    # only the compiled run says so, before its first batch and with that batch's time after it
    assert done.stderr.count("; the first batch compiles the training step (torch.compile)\n") == 1
    assert re.search(r"^run plan: the first batch took \d+ s \(compiling\)$", done.stderr, re.M)
    assert done.stderr.count("run plan: the first batch took") == 1


def test_a_compiled_run_compiles_the_loss_and_it_equals_the_eager_loss():
    """compile_config compiles the loss too (Composer compiles only the forward): the same
    value and gradient of the logits as the eager loss, ignored targets included."""
    torch.manual_seed(0)
    model = ComposerMosaicGPT(MosaicGPTConfig(vocab_size=64, max_seq_len=16, d_model=32, n_heads=2, n_layers=1))
    labels = torch.randint(0, 64, (2, 16))
    labels[1, :5] = -100
    batch = {"input_ids": labels.clamp_min(0), "labels": labels}
    logits = torch.randn(2, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    eager = model.loss(logits, batch)
    (eager_grad,) = torch.autograd.grad(eager, logits)
    compiled_graphs = []

    def record(gm, example_inputs):
        compiled_graphs.append(gm)
        return gm

    model.compile_loss({"backend": record, "fullgraph": True})
    loss = model.loss(logits, batch)
    (grad,) = torch.autograd.grad(loss, logits)
    assert len(compiled_graphs) == 1
    assert loss.dtype == torch.float32 and torch.allclose(loss, eager, rtol=1e-6)
    torch.testing.assert_close(grad, eager_grad)


def test_bad_speed_options_are_refused_by_name(tiny_data, tmp_path):
    with pytest.raises(ConfigError, match="compile_config.mdoe"):
        resolve_config(tiny_config(tiny_data, tmp_path / "run", compile_config={"mdoe": "default"}))
    # a backend torch.compile does not know: one line before training, naming the ones it does
    with pytest.raises(ConfigError, match=r"^compile_config.backend: expected a torch.compile backend \(.*inductor.*\), "
                                          r"got 'nope'$"):
        resolve_config(tiny_config(tiny_data, tmp_path / "run", compile_config={"backend": "nope"}))
    assert resolve_config(tiny_config(tiny_data, tmp_path / "run", compile_config={"backend": "aot_eager"}))
    with pytest.raises(ConfigError, match="optimizer.decay"):
        resolve_config(tiny_config(tiny_data, tmp_path / "run",
                                   optimizer={"name": "adamw", "decay": "norms"}))


@pytest.mark.parametrize("argv, message", [
    (["--batches", "0"], "argument --batches: must be an integer >= 1, got 0"),
    (["--warmup", "-1"], "argument --warmup: must be an integer >= 0, got -1"),
    (["configs/nope.yaml"], "no config file configs/nope.yaml"),
    (["README.md"], "README.md"),
    (["--json", "/nonexistent/dir/x.json"], "--json /nonexistent/dir/x.json: /nonexistent/dir is not an existing folder"),
])
def test_the_benchmark_refuses_bad_arguments_in_one_line_before_measuring(argv, message, capsys, monkeypatch):
    from benchmarks import train as bench

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(bench, "measure_peak_flops", lambda *a, **k: pytest.fail("it started measuring"))
    with pytest.raises(SystemExit) as exit_:
        bench.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith("python -m benchmarks.train: error: ") and message in err[0]


@pytest.mark.parametrize("native", [True, False])
def test_amp_bf16_runs_as_fp32_with_one_line_on_a_cpu_without_native_bf16(monkeypatch, capsys, native):
    import llm.train.trainer as trainer

    monkeypatch.setattr(trainer, "native_bf16", lambda: native)
    monkeypatch.setattr(trainer, "cpu_run", lambda: True)
    trainer._say_once.cache_clear()
    model = ComposerMosaicGPT(MosaicGPTConfig(vocab_size=50, d_model=16, n_heads=2, n_layers=1, max_seq_len=8))
    assert trainer.composer_precision("amp_bf16", model) == "fp32"  # Composer refuses amp_bf16 on a CPU
    assert trainer.composer_precision("amp_bf16", model) == "fp32"
    assert model.autocast_dtype == (torch.bfloat16 if native else None)
    assert trainer.run_precision("amp_bf16") == ("amp_bf16" if native else "fp32")
    assert trainer.run_precision("fp32") == "fp32"
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1  # said once, however often asked
    if native:
        assert lines[0].startswith("precision: amp_bf16 (the forward autocast to bfloat16 on the CPU")
    else:
        assert "no native bfloat16" in lines[0] and "fp32" in lines[0]
        measured = {}
        monkeypatch.setattr(trainer, "_peak_flops", lambda dtype: measured.setdefault("dtype", dtype))
        trainer.peak_flops({"precision": "amp_bf16"})
        assert measured["dtype"] == torch.float32  # MFU against the peak of the dtype the run computes in


def test_native_bf16_follows_the_cpu_flags(monkeypatch):
    from llm.utils import cpu

    for flags, expected in [({"avx2", "avx512f"}, False), ({"avx2", "avx512_bf16"}, True), ({"amx_bf16"}, True),
                            ({"fp", "asimd", "bf16"}, True)]:
        monkeypatch.setattr(cpu, "cpu_flags", lambda flags=flags: frozenset(flags))
        cpu.native_bf16.cache_clear()
        assert cpu.native_bf16() is expected
    cpu.native_bf16.cache_clear()


def test_without_a_cpp_compiler_a_compiled_run_trains_eager_saying_so_once(monkeypatch, capsys):
    from llm.train import trainer

    trainer._say_once.cache_clear()
    monkeypatch.setenv("CXX", "/no/such/c++")
    assert trainer.run_compile_config({"fullgraph": True}) is None
    assert trainer.run_compile_config({"fullgraph": True}) is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no C++ compiler (/no/such/c++" in err and "trains eager" in err
    assert trainer.run_compile_config({"backend": "eager"}) == {"backend": "eager"}  # needs no compiler
    monkeypatch.delenv("CXX")
    assert trainer.run_compile_config({}) == {}  # this machine has g++ (the suite compiles with it)
    trainer._say_once.cache_clear()
