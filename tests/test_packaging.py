"""A regular (non-editable) install: the wheel carries the configs, the core needs no lab packages, a
missing optional package is one clear error, and the torch floor excludes the weights_only bypass.
The full install-and-run check (fresh venv outside the checkout) is the `wheel` step of .ci/run."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_no_symlink_inside_the_package():
    links = [p for p in (ROOT / "src").rglob("*") if p.is_symlink()]
    assert links == []


@pytest.mark.slow
def test_wheel_ships_every_shipped_config(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path),
                        str(ROOT)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = tmp_path.glob("qkv-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = sorted(p.relative_to(ROOT / "src").as_posix()
                         for p in (ROOT / "src" / "qkv" / "configs").rglob("*.yaml"))
    assert (len(shipped) >= 20 and "qkv/configs/reverse.yaml" in shipped
            and "qkv/configs/ablations/01_sqrt_dk.yaml" in shipped)
    assert [s for s in shipped if s not in names] == []
    assert "qkv/configs/speedrun/quick.yaml" in names and "qkv/serve/static/chat.html" in names


def test_core_dependencies_leave_lab_packages_to_extras():
    project = _pyproject()["project"]
    core = " ".join(project["dependencies"])
    for heavy in ("scikit-learn", "scipy", "sacrebleu"):
        assert heavy not in core
    extras = project["optional-dependencies"]
    assert {"vision", "audio", "text", "lab"} <= set(extras)
    assert (any(d.startswith("scikit-learn") for d in extras["lab"])
            and any(d.startswith("sacrebleu") for d in extras["lab"]))


def test_torch_floor_excludes_the_weights_only_bypass():
    # CVE-2025-32434: torch.load(weights_only=True) could run code up to torch 2.5.1
    (torch_req,) = [d for d in _pyproject()["project"]["dependencies"] if d.startswith("torch")]
    assert torch_req.replace(" ", "").split("#")[0] == "torch>=2.6"


@pytest.mark.parametrize("task, module, extra",
                         [("digits", "sklearn", "vision"), ("numbers_zh", "sacrebleu", "text"),
                                                 ("captions", "sklearn", "vision"),
                          ("detection", "pycocotools", "detection")])
def test_missing_optional_package_is_one_clear_error(monkeypatch, task, module, extra):
    from qkv.config import ConfigError
    from qkv.tasks import build_task

    monkeypatch.setitem(sys.modules, module, None)  # as if not installed: `import sklearn` raises ImportError
    for sub in [m for m in sys.modules if m.startswith(module + ".")]:
        monkeypatch.setitem(sys.modules, sub, None)
    with pytest.raises(ConfigError, match=rf"pip install 'qkv\[{extra}\]'"):
        build_task(task)


def test_shipped_suite_found_without_the_repository_layout(monkeypatch, tmp_path):
    from qkv.experiments.suite import load_suite
    from qkv.run import config_path

    monkeypatch.chdir(tmp_path)  # nothing named configs/ here: the package data must serve
    assert load_suite("01_sqrt_dk").name == "sqrt_dk"
    assert config_path("reverse").is_file()
