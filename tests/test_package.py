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
