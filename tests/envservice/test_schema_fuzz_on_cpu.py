"""Schemathesis against a live envservice: every generated request, valid or not, gets an answer that our own
OpenAPI schema allows, and none is a server error.

A real `python -m envservice` (frozenlake and textcraft, in-process) is fuzzed by schemathesis's CLI for a
bounded time per token setting: its coverage phase (boundary values of every field), fuzzing phase (random and
schema-violating bodies) and stateful phase (create -> step / evaluate / release chains, following the OpenAPI
links the service publishes from /create's session id). Checks: no 5xx, status codes, content types, headers
and bodies that conform to the schema, schema-violating requests refused, and, with a token, every route but
/healthz refused without it. `positive_data_acceptance` is left out: a schema-valid request may rightly be
refused by what the schema cannot say (an unknown task name, a full service, a session closed already).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from envservice.client import EnvClient
from envservice.process import EnvServiceProcess

pytestmark = [pytest.mark.slow, pytest.mark.startup]  # long fuzzing: the full run only

FUZZ_BUDGET = {"full": (45, 500), "fast": (20, 150)}
"""(seconds, fewest generated cases) of one schemathesis run (two runs: without and with a token). The fast loop
spends less on the same checks; every phase still runs to its end in it. Measured: 431 cases in 10 s alone, 91 in
10 s beside two other busy workers (the coverage phase alone took 8.4 s of them)."""
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,"
          "response_schema_conformance,negative_data_rejection,missing_required_header,unsupported_method,"
          "allow_header_conformance,use_after_free,ensure_resource_availability,ignored_auth")
CONFIG = """
[checks.negative_data_rejection]
# 413: a schema-violating body may also be over the service's size limit, refused before it is parsed.
expected-statuses = [400, 401, 403, 404, 405, 406, 409, 413, 415, 422, 428, 429]
"""


def _schemathesis(url: str, report_dir: Path, token: str | None, seconds: int) -> dict:
    """Run schemathesis's CLI against `url`; its JSON report."""
    config = report_dir / "schemathesis.toml"
    config.write_text(CONFIG)
    st = Path(sys.executable).with_name("st")
    command = [str(st), "--config-file", str(config), "run", f"{url}/openapi.json", "--checks", CHECKS,
               "--max-time", str(seconds), "--seed", "17", "--workers", "2", "--report", "json",
               "--report-dir", str(report_dir), "--output-truncate", "true"]
    if token is not None:
        command += ["--header", f"Authorization: Bearer {token}"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 120, cwd=report_dir)
    reports = sorted(report_dir.glob("json-*.json"))
    assert reports, f"schemathesis wrote no report (exit {run.returncode}):\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}"
    report = json.loads(reports[-1].read_text())
    report["console"] = run.stdout[-6000:]
    return report


@pytest.mark.parametrize("token", [None, "fuzz-token"], ids=["no_token", "token"])
def test_schemathesis_finds_no_server_error_and_no_schema_violation(tmp_path: Path, token: str | None,
                                                                      fast_loop: bool) -> None:
    seconds, fewest_cases = FUZZ_BUDGET["fast" if fast_loop else "full"]
    extra = ["--token", token] if token else []
    with EnvServiceProcess(["frozenlake", "textcraft"], extra_args=extra, log_path=tmp_path / "service.log",
                           startup_timeout_s=90, env={"ENVSERVICE_TOKEN": ""}) as service:
        report = _schemathesis(service.url, tmp_path, token, seconds)
        with EnvClient(service.url, token=token) as client:
            health = client.health()  # the service is still up, and every session it opened is accounted for
    console = report["console"]
    assert report["failures"] == [] and report["errors"] == [], console
    assert {phase: state["status"] for phase, state in report["phases"].items() if phase != "examples"} == {
        "coverage": "success", "fuzzing": "success", "stateful": "success"}, console
    assert report["test_cases"]["generated"] >= fewest_cases, console
    assert health.created > 0, "the stateful phase never created a session: the /create links are not followed"
    assert health.created == health.sessions + sum(health.closed.values())
    assert "Traceback" not in (tmp_path / "service.log").read_text()
