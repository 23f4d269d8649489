"""`qkv explore` user errors: a port in use or out of range, --export onto a folder (and no temporary file
left behind), --wav that is a folder: one line `qkv: error: ...`, exit 2, no server started."""

from __future__ import annotations

import socket

import pytest

from qkv.cli.main import main


@pytest.fixture
def no_server(monkeypatch):
    """Starting a server here would block the test: any attempt fails it instead."""
    import uvicorn

    def refuse(*args, **kwargs):
        raise AssertionError("the server was started")

    monkeypatch.setattr(uvicorn, "run", refuse)
    monkeypatch.setattr(uvicorn.Server, "run", refuse)


def test_port_in_use_is_a_one_line_error(charlm_run, capsys, no_server):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["explore", str(charlm_run), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err == f"qkv: error: port {port} on 127.0.0.1 is in use: choose another with --port\n"


@pytest.mark.parametrize("port", [0, -1, 65536])
def test_port_out_of_range_is_refused(charlm_run, capsys, no_server, port):
    assert main(["explore", str(charlm_run), "--port", str(port)]) == 2
    assert f"--port must be in [1, 65535], got {port}" in capsys.readouterr().err


def test_listen_binds_the_port_it_was_given():
    from qkv.explore.server import listen

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sock = listen("127.0.0.1", port)
    try:
        assert sock.getsockname()[1] == port
    finally:
        sock.close()


def test_export_onto_a_folder_is_a_one_line_error_and_leaves_nothing(charlm_run, tmp_path, capsys):
    folder = tmp_path / "out"
    folder.mkdir()
    assert main(["explore", str(charlm_run), "--input", "x = 1", "--export", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv: error: --export ") and "is a folder" in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and not any(folder.iterdir())
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["explore", str(charlm_run), "--input", "x", "--export", str(afile / "p.html")]) == 2
    assert "afile is a file, not a folder" in capsys.readouterr().err


def test_failed_write_removes_its_temporary_file(charlm_run, tmp_path, monkeypatch):
    from qkv import storage
    from qkv.explore import export
    from qkv.explore.adapter import ExploreError, load

    def fail(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(storage.os, "replace", fail)  # the one atomic writer's rename
    with pytest.raises(ExploreError, match="cannot write --export .*Permission denied"):
        export.export_html(load(str(charlm_run)), "x", tmp_path / "p.html")
    assert list(tmp_path.iterdir()) == []


def test_wav_that_is_a_folder_or_missing_is_a_one_line_error(charlm_run, tmp_path, capsys):
    page = tmp_path / "p.html"
    assert main(["explore", str(charlm_run), "--wav", str(tmp_path), "--export", str(page)]) == 2
    assert f"--wav {tmp_path} is not a file" in capsys.readouterr().err
    assert main(["explore", str(charlm_run), "--wav", str(tmp_path / "no.wav"), "--export", str(page)]) == 2
    assert "--wav file not found" in capsys.readouterr().err
    assert not page.exists()
