"""`qkv serve` starting and stopping: an address it cannot listen on, bad flags, a graceful shutdown whose
time runs out, a request cancelled under a stream."""

from __future__ import annotations

import logging
import socket
import threading
import time

import httpx
import pytest
from _servehelpers import running_server, sse_events

from qkv.cli.main import main
from qkv.serve import load_served


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if serve() loads the model: the errors below must come before that (minutes, for a big
    one)."""
    import qkv.serve.server

    def load(*a, **k):
        raise AssertionError("the model was loaded before the address was checked")

    monkeypatch.setattr(qkv.serve.server, "load_served", load)


def test_an_address_it_cannot_listen_on_is_a_user_error_before_the_model_loads(
    run_folder, no_model_load, capsys
):
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
    # no traceback
    assert err.startswith("qkv: error: cannot listen on 192.0.2.1:0: ") and err.count("\n") == 1, err


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_negative_shutdown_timeout_is_refused(run_folder, no_model_load, capsys, value):
    assert main(["serve", str(run_folder), "--port", "0", f"--shutdown-timeout={value}"]) == 2
    finite = "a finite number " if value == "nan" else ""
    assert f"qkv: error: --shutdown-timeout must be {finite}at least 0" in capsys.readouterr().err


def _slow(engine, seconds=0.1):
    """Each engine step takes `seconds` longer: a stream that outlives a short shutdown timeout."""
    step = engine.step

    def slow_step():
        time.sleep(seconds)
        return step()

    engine.step = slow_step


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_streams_cut_by_the_end_of_the_shutdown_timeout_end_with_an_error_and_done(run_folder):
    """When --shutdown-timeout runs out, uvicorn cancels what still runs: a stream then ends with an error
    event ("shutting down") and [DONE], a non-streamed request is a 503, and no "Exception in ASGI
    application" traceback is logged (before: the stream was cut, no [DONE], and uvicorn logged a
    CancelledError)."""
    served = load_served(run_folder)
    body = {"model": served.name, "prompt": "ab", "max_tokens": 50, "temperature": 0}
    log = _Records()
    try:
        with running_server(run_folder, block_size=4, shutdown_timeout=0.5) as (url, app):
            # after uvicorn has configured (reset) its loggers
            logging.getLogger("uvicorn.error").addHandler(log)
            _slow(app.state.api.engine)
            plain = {}
            th = threading.Thread(target=lambda: plain.setdefault("r", httpx.post(
                url + "/v1/completions", json=body, timeout=60)))
            with httpx.stream(
                "POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60
            ) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                th.start()
                deadline = time.monotonic() + 30
                while app.state.api.active < 2:  # the non-streamed request is admitted too
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                app.state.server.should_exit = True
                events, done = sse_events([first, *lines])
            th.join(60)
    finally:
        logging.getLogger("uvicorn.error").removeHandler(log)
    assert (
        done
        and events[-1]["error"]["code"] == "cancelled"
        and "shutting down" in events[-1]["error"]["message"]
    )
    assert 1 <= len(events) - 1 < 50  # cut short, not finished
    assert plain["r"].status_code == 503 and plain["r"].json()["error"]["code"] == "cancelled"
    assert not [r for r in log.records if "Exception in ASGI application" in r.getMessage()]
    # the cancelling is how --shutdown-timeout is documented to end: uvicorn's "ERROR: Cancel 2 running
    # task(s)" is not logged as an error
    assert not [r for r in log.records if r.levelno >= logging.ERROR], [r.getMessage() for r in log.records]


def test_a_stream_whose_request_the_engine_cancels_ends_with_an_error_and_done(run_folder):
    """The engine thread's end cancels what it still holds ("done", "cancelled"): the stream says so and ends
    with [DONE] (it used to stop without either)."""
    served = load_served(run_folder)
    body = {"model": served.name, "prompt": "ab", "max_tokens": 50, "temperature": 0, "stream": True}
    with running_server(run_folder, block_size=4) as (url, app):
        _slow(app.state.api.engine)
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            # the first (only) ticket, as a shutdown cancels it
            app.state.api.worker._commands.put(("cancel", 0))
            events, done = sse_events([first, *lines])
    assert done and events[-1]["error"]["code"] == "cancelled" and len(events) < 50


def test_the_exit_signal_stops_admitting_requests_at_once(run_folder):
    """qkv serve's server marks the app shutting down in its signal handler (uvicorn closes the listener then;
    the app used to learn of it only in its lifespan's end, after the running requests were done), so that a
    request accepted on a connection before the signal but not yet admitted gets a 503 (API.admit)."""
    import signal

    from qkv.serve import build_engine, create_app
    from qkv.serve.server import _make_server as make_server

    served = load_served(run_folder)
    app = create_app(served, build_engine(served, block_size=4))
    server = make_server(app, 1.0)
    assert not app.state.api.shutting_down
    server.handle_exit(signal.SIGTERM, None)
    assert server.should_exit and app.state.api.shutting_down


def test_serve_help_states_its_own_exit_statuses(capsys):
    """serve ends with 0 on SIGINT / SIGTERM (tests/serve/test_serve_api.py), not the 130 / 143 of
    training."""
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "0 stopped by SIGINT/SIGTERM" in out and "1 the engine failed" in out and "130" not in out
