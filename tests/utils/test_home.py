"""Where llm keeps its caches: inductor's is keyed by the CPU it was compiled on."""

from pathlib import Path

from llm.utils import home


def test_inductor_cache_is_one_folder_per_cpu_model(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("LLM_HOME", str(tmp_path))
    folder = home.use_inductor_cache()
    assert folder.parent == tmp_path / "inductor" and len(folder.name) == 12
    assert Path(home.os.environ["TORCHINDUCTOR_CACHE_DIR"]) == folder
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setattr(home.platform, "processor", lambda: "another cpu")
    assert home.use_inductor_cache() != folder  # a graph generated for one instruction set is not found on another


def test_a_cache_folder_the_user_chose_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert home.use_inductor_cache() == tmp_path / "mine"
