"""`qkv serve` starting and stopping: an address it cannot listen on, bad flags, a graceful shutdown whose time
runs out, a request cancelled under a stream."""

from __future__ import annotations

import socket

import pytest

from qkv.cli.main import main


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if serve() loads the model: the errors below must come before that (minutes, for a big one)."""
    import qkv.serve

    def load(*a, **k):
        raise AssertionError("the model was loaded before the address was checked")

    monkeypatch.setattr(qkv.serve, "load_served", load)


def test_an_address_it_cannot_listen_on_is_a_user_error_before_the_model_loads(run_folder, no_model_load, capsys):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        assert main(["serve", str(run_folder), "--port", str(port)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"qkv: error: cannot listen on 127.0.0.1:{port}: ") and "in use" in err, err
    finally:
        taken.close()
    # an address of no interface of this machine (TEST-NET-1, RFC 5737; a name that does not resolve raises
    # socket.gaierror, an OSError too, but looking one up could leave the machine)
    assert main(["serve", str(run_folder), "--host", "192.0.2.1", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv: error: cannot listen on 192.0.2.1:0: ") and err.count("\n") == 1, err  # no traceback


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_negative_shutdown_timeout_is_refused(run_folder, no_model_load, capsys, value):
    assert main(["serve", str(run_folder), "--port", "0", f"--shutdown-timeout={value}"]) == 2
    assert "qkv: error: --shutdown-timeout must be >= 0" in capsys.readouterr().err
