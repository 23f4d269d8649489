"""The always-available corpora: the stdlib sources split by file (disjoint, deterministic, tests
excluded)."""

from __future__ import annotations

import pytest

from qkv.config import ConfigError
from qkv.tasks import build_task
from qkv.tasks.corpora import is_val_file, stdlib_files, stdlib_split, stdlib_texts


@pytest.fixture
def fake_stdlib(tmp_path):
    files = {"os.py": "import sys\n", "json/__init__.py": "x = 1\n", "json/decoder.py": "y = 2\n",
             "test/test_os.py": "T\n", "json/tests/test_x.py": "T\n", "idlelib/idle_test/t.py": "T\n",
             "site-packages/pkg.py": "P\n", "__pycache__/os.py": "C\n", "README.txt": "not python\n",
             "latin.py": b"s = '\xe9'\n"}
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return tmp_path


def test_only_python_sources_outside_test_folders(fake_stdlib):
    assert stdlib_files(fake_stdlib) == ["json/__init__.py", "json/decoder.py", "latin.py", "os.py"]


def test_a_file_keeps_its_side_whatever_else_is_there(fake_stdlib):
    split = stdlib_split(0.5, fake_stdlib)
    assert set(split["train"]).isdisjoint(split["val"])
    assert sorted(split["train"] + split["val"]) == stdlib_files(fake_stdlib)
    (fake_stdlib / "os.py").unlink()  # another Python version: a file fewer
    later = stdlib_split(0.5, fake_stdlib)
    for side in ("train", "val"):
        assert set(later[side]) == set(split[side]) - {"os.py"}


def test_texts_skip_files_that_are_not_utf8(fake_stdlib):
    texts = stdlib_texts(0.5, fake_stdlib)
    joined = texts["train"] + texts["val"]
    assert "# file: latin.py" not in joined and "# file: os.py\nimport sys" in joined
    for side, other in (("train", "val"), ("val", "train")):
        for p in stdlib_split(0.5, fake_stdlib)[side]:
            if p != "latin.py":
                assert f"# file: {p}\n" in texts[side] and f"# file: {p}\n" not in texts[other]


def test_the_real_stdlib_split():
    files = stdlib_files()
    split = stdlib_split(0.1)
    assert len(files) > 300 and not any("/test/" in f or f.startswith("test/") for f in files)
    assert (set(split["train"]).isdisjoint(split["val"])
            and len(split["train"]) + len(split["val"]) == len(files))
    assert 0.05 < len(split["val"]) / len(files) < 0.15  # a hash split: about val_fraction of the files
    assert split == stdlib_split(0.1)
    assert all(is_val_file(p, 0.1) for p in split["val"])


def test_char_lm_on_the_stdlib():
    task = build_task("charlm", corpus="stdlib", context=32)
    assert task.n_chars["train"] > 5_000_000 and task.n_chars["val"] > 300_000
    assert len(task.data["val"]) == task.n_chars["val"]  # one token per character
    assert task.batch(0, 4)["input_ids"].shape == (4, 32)


def test_bad_corpus_options():
    with pytest.raises(ConfigError, match=r"task.corpus must be one of \('pydoc', 'stdlib'\), got 'wiki'"):
        build_task("charlm", corpus="wiki")
    with pytest.raises(ConfigError, match="task.corpus: give either path or corpus"):
        build_task("charlm", corpus="stdlib", path="x.txt")
