"""simulate_dp.py refuses bad input with one clear message and exit status 2, before any run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import simulate_dp

SCRIPT = Path(simulate_dp.__file__)


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exc_info:
        simulate_dp.main(list(argv))
    assert exc_info.value.code == 2
    return capsys.readouterr().err


def test_unknown_preset(capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(capsys, "--preset", "nope")
    assert "unknown preset 'nope'" in err and "rfc-dsv31" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dp-size", "0"], "--dp-size: must be >= 1, got 0"),
        (["--dp-size", "-3"], "--dp-size: must be >= 1, got -3"),
        (["--concurrency", "0"], "--concurrency: must be >= 1, got 0"),
        (["--max-num-seqs", "x"], "expected an integer, got 'x'"),
        (["--request-rate", "0"], "request rate must be > 0"),
        (["--output-spread", "1.5"], "output spread must be in [0, 1)"),
        (["--jitter-ms", "-1"], "jitter_ms must be >= 0"),
        (["--router", "random"], "invalid choice: 'random'"),
        (["--gate", "cap-2"], "invalid choice: 'cap-2'"),
        (["--concurrency", "4", "--no-concurrency-limit"], "contradict"),
        (["--no-concurrency-limit"], "give a concurrency (closed loop), a request rate"),
    ],
)
def test_bad_settings(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert message in refused(capsys, *argv)


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not valid JSON (line 1"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"step_overhead_ms": 1, "decode_ms_per_request": 1}', "missing key 'prefill_ms_per_token'"),
        (
            '{"step_overhead_ms": 1, "decode_ms_per_request": 1, "prefill_ms_per_token": -1}',
            "'prefill_ms_per_token' must be finite and >= 0",
        ),
        (
            '{"step_overhead_ms": "5", "decode_ms_per_request": 1, "prefill_ms_per_token": 1}',
            "'step_overhead_ms' must be a number",
        ),
        (
            '{"step_overhead_ms": 1, "decode_ms_per_request": 1, "prefill_ms_per_token": 1, "prefil_ms_per_token": 2}',
            "unknown key(s) ['prefil_ms_per_token']",
        ),
    ],
)
def test_malformed_profile(capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str, message: str) -> None:
    profile = tmp_path / "bad.json"
    profile.write_text(content)
    err = refused(capsys, "--profile", str(profile))
    assert str(profile) in err and message in err


def test_missing_profile(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert "cannot read cost profile" in refused(capsys, "--profile", str(tmp_path / "none.json"))


def test_shipped_profile_is_valid() -> None:
    data = json.loads((SCRIPT.parent.parent / "profiles" / "rfc-dsv31.json").read_text())
    from dpsim.costmodel import profile_from_dict

    assert profile_from_dict(data).prefill_ms_per_token > 0


def test_command_line_exit_status() -> None:
    """The real command, not just main(): status 2 and the message on stderr, nothing run."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--concurrency", "0"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert "--concurrency: must be >= 1, got 0" in done.stderr
    assert done.stdout == ""
