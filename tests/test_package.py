"""What the installed package holds: llm's modules and kernel sources, no benchmark code (which lives
in benchmarks/, outside the wheel)."""

import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_packages_hold_no_benchmark_code():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = find_packages(str(ROOT), include=config["tool"]["setuptools"]["packages"]["find"]["include"])
    assert "llm" in packages and "llm.kernels" in packages and not any(p.startswith("benchmarks") for p in packages)
    modules = [p for package in packages for p in (ROOT / package.replace(".", "/")).glob("*.py")]
    assert modules and not [str(p.relative_to(ROOT)) for p in modules if "bench" in p.name]


def _run(code: str, tmp_path=None):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path or ROOT)


def test_the_core_imports_no_training_or_serving_library():
    done = _run("import sys, llm; from llm.model import MosaicGPT; from llm.cli import generate, chat; "
                "print([m for m in ('composer', 'streaming', 'starlette', 'uvicorn', 'pydantic', 'pyarrow', "
                "'matplotlib', 'transformers') if m in sys.modules])")
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr[-2000:]


def test_a_missing_extra_is_named_with_its_install_command(tmp_path):
    done = _run("import sys; sys.modules['composer'] = None; import llm.train")
    assert done.returncode != 0
    assert ("MissingExtra: training, evaluation and data preparation needs the 'train' extra: "
            "pip install 'mosaicgpt-llm[train]' (missing composer)") in done.stderr
    (tmp_path / "model").mkdir()  # a folder that looks like a model: the missing extra is what stops the server
    for name in ("config.yaml", "model.safetensors"):
        (tmp_path / "model" / name).touch()
    done = _run("import sys; sys.modules['starlette'] = None; from llm.cli.main import main; "
                f"sys.exit(main(['serve', '--model', {str(tmp_path / 'model')!r}, '--port', '0']))", tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == ("llm serve: error: the HTTP server needs the 'serve' extra: "
                                                    "pip install 'mosaicgpt-llm[serve]' (missing starlette)")
