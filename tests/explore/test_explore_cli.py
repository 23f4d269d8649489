"""`qkv explore`: the command serves the page on loopback, exports a file, and reports user errors in one
line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

from qkv.cli.main import main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_command_serves_the_page_on_loopback(charlm_run):
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "qkv.cli.main", "explore", str(charlm_run), "--port",
                             str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        info = None
        for _ in range(300):  # bounded: at most ~60 s for start-up
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/info", timeout=2) as r:
                    info = json.load(r)
                break
            except OSError:
                if proc.poll() is not None:
                    break
                time.sleep(0.2)
        assert info is not None, proc.stdout.read() if proc.poll() is not None else "server did not answer"
        assert info["family"] == "gpt" and info["kind"] == "decoder" and info["context"] == 32
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as r:
            assert b"qkv explore" in r.read()
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_export_writes_one_self_contained_file(charlm_run, tmp_path, capsys):
    out = tmp_path / "sub" / "page.html"
    assert main(["explore", str(charlm_run), "--input", "x = 1", "--export", str(out)]) == 0
    html = out.read_text(encoding="utf-8")
    assert "window.QKV_EXPORT = " in html and 'src="static/' not in html and 'href="static/' not in html
    start = html.index("window.QKV_EXPORT = ") + len("window.QKV_EXPORT = ")
    data = json.loads(html[start: html.index(";</script>", start)])
    assert data["input"] == "x = 1" and data["analysis"]["tokens"]["input"] == ["x", "␣", "=", "␣", "1"]
    assert len(data["generation"]["steps"]) == 16 and data["positions"]["encodings"][0]["kind"] == "learned"
    assert "wrote" in capsys.readouterr().out


def test_user_errors_are_one_line_exit_2(charlm_run, tmp_path, capsys):
    assert main(["explore", str(tmp_path / "nope")]) == 2
    assert "qkv: error: checkpoint not found" in capsys.readouterr().err
    assert main(["explore", str(charlm_run), "--export", str(tmp_path / "p.html")]) == 2
    assert "--export needs --input" in capsys.readouterr().err
    assert main(["explore", str(charlm_run), "--input", "", "--export", str(tmp_path / "p.html")]) == 2
    assert "the input is empty" in capsys.readouterr().err
    assert not (tmp_path / "p.html").exists()
