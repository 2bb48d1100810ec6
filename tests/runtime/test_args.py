"""The service flags: ports in range, and an environment variable's value checked by the command that reads it."""

from __future__ import annotations

import argparse

import pytest

from services.decode.server import add_arguments as decode_arguments
from services.router.server import add_arguments as router_arguments


def parse(add: object, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rackserve")
    add(parser)  # type: ignore[operator]
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--port", "99999"], "--port"),
        (["--port", "-1"], "--port"),
        (["--health-port", "70000"], "--health-port"),
        (["--metrics-port", "-2"], "--metrics-port"),
    ],
)
def test_a_port_out_of_range_is_a_usage_error_naming_the_flag(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """grpc bound 99999 mod 65536 (34463) and -1 as 65535 without a word."""
    with pytest.raises(SystemExit) as e:
        parse(router_arguments, argv)
    assert e.value.code == 2
    assert f"argument {flag}: " in capsys.readouterr().err
    assert parse(router_arguments, ["--port", "0", "--metrics-port", "-1"]).metrics_port == -1


def test_a_bad_environment_value_fails_only_the_command_that_reads_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The variable's text is converted when the parser parses: building every command's parser (as `rackserve`
    does for any subcommand) no longer fails with a traceback."""
    monkeypatch.setenv("RACKSERVE_THREADS", "abc")
    parser = argparse.ArgumentParser()
    decode_arguments(parser)  # built without an error
    with pytest.raises(SystemExit):
        parser.parse_args([])
    assert "argument --threads: invalid int value: 'abc'" in capsys.readouterr().err
    assert parse(decode_arguments, ["--threads", "2"]).threads == 2  # the command line wins
    monkeypatch.setenv("RACKSERVE_THREADS", "3")
    assert parse(decode_arguments, []).threads == 3
