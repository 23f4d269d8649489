"""Every command the guides (docs/guide/*.md) mark runnable is run, in order, in one temporary folder per
guide: a fenced block opened with ```bash runnable. A `qkv ...` line runs through the CLI's main() in this
process (one interpreter start for the whole guide), any other line through bash; each must exit 0. A plain
```bash block is shown, not run, and its first line is a comment saying why (a download, minutes of CPU)."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from qkv.cli.main import main

GUIDES = Path(__file__).resolve().parents[1] / "docs" / "guide"
FENCE = re.compile(r"^```(?P<info>[^\n]*)\n(?P<body>.*?)^```$", re.M | re.S)
RUNNABLE = "bash runnable"


def blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced block."""
    return [(m["info"].strip(), m["body"]) for m in FENCE.finditer(text)]


def commands(body: str) -> list[str]:
    """The block's command lines: comments and blank lines dropped, backslash continuations joined."""
    out, pending = [], ""
    for raw in body.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        out.append(pending + line)
        pending = ""
    return out


def guide_names() -> list[str]:
    return sorted(p.name for p in GUIDES.glob("*.md"))


def test_the_guides_exist_and_the_readme_links_them():
    names = guide_names()
    for want in ("choosing.md", "out-of-memory.md", "debugging.md", "learning-path.md"):
        assert want in names
    readme = (GUIDES.parents[1] / "README.md").read_text(encoding="utf-8")
    assert all(f"docs/guide/{n}" in readme for n in names if n != "README.md")


@pytest.mark.parametrize("name", [n for n in guide_names() if n != "README.md"])
def test_every_runnable_command_of_a_guide_runs(name, tmp_path, monkeypatch, capsys):
    found = blocks((GUIDES / name).read_text(encoding="utf-8"))
    bash = [(info, body) for info, body in found if info.split()[:1] == ["bash"]]
    assert any(info == RUNNABLE for info, _ in bash), f"{name} has no runnable block"
    for info, body in bash:
        if info != RUNNABLE:  # shown only: it says why
            first = body.lstrip().splitlines()[0]
            assert first.startswith("# not run by the tests:"), f"{name}: a shown block without its reason"
    monkeypatch.chdir(tmp_path)
    for info, body in bash:
        if info != RUNNABLE:
            continue
        for line in commands(body):
            if line.startswith("qkv "):
                rc = main(shlex.split(line)[1:])
                err = capsys.readouterr().err
                assert rc == 0, f"{name}: `{line}` exited {rc}: {err[-2000:]}"
            else:
                r = subprocess.run(["bash", "-c", line], cwd=tmp_path, capture_output=True, text=True,
                                   timeout=120)
                assert r.returncode == 0, f"{name}: `{line}` exited {r.returncode}: {r.stderr[-2000:]}"


def test_the_block_parser():
    text = ("x\n```bash runnable\n# a comment\nqkv info gpt-tiny \\\n  --depth 1\n\nls\n```\n"
            "```bash\n# not run\n```\n")
    assert blocks(text) == [("bash runnable", "# a comment\nqkv info gpt-tiny \\\n  --depth 1\n\nls\n"),
                            ("bash", "# not run\n")]
    assert commands(blocks(text)[0][1]) == ["qkv info gpt-tiny --depth 1", "ls"]
