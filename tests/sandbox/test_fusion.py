"""SandboxFusion's API both ways: the project's server runs its sandbox behind ``POST /run_code``,
and the code reward through the client gives exactly the scores and reasons it gives locally."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.request

import pytest

from rlfoundry.rewards import code
from rlfoundry.sandbox import SandboxLimits, SandboxUnavailable
from rlfoundry.sandbox.fusion import _to_result, handle_run_code, make_server, run_remote
from tests.rewards.test_code import LIMITS, PROGRAMS, SUM_TESTS


class _CountingServer:
    def __init__(self):
        self.server = make_server("127.0.0.1", 0)
        self.requests = 0
        handle = self.server.RequestHandlerClass.do_POST

        def counted(handler):
            self.requests += 1
            handle(handler)

        self.server.RequestHandlerClass.do_POST = counted
        self.url = "http://127.0.0.1:%d" % self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def server():
    s = _CountingServer()
    yield s
    s.close()


@pytest.mark.parametrize("kind", list(PROGRAMS))
def test_the_code_reward_scores_the_same_through_a_sandboxfusion_server(server, kind):
    response, score, reason = PROGRAMS[kind]
    before = server.requests
    result = code.compute_score(response, SUM_TESTS, limits=LIMITS, sandbox_fusion_url=server.url)
    assert result["score"] == pytest.approx(score) and result["reason"] == reason, result
    # one request per test, and none after a limit was hit (the reward's rule, kept over HTTP)
    assert server.requests - before == {"no_code": 0, "looping": 1, "memory_hungry": 1, "printing_megabytes": 1}.get(kind, 3)


def test_stdin_and_limits_travel_in_the_request(server):
    r = run_remote(server.url + "/run_code", "import sys\nprint(sys.stdin.read()[::-1])",
                   SandboxLimits(wall_time_s=3.0), stdin="abc")
    assert (r.status, r.stdout) == ("ok", "cba\n")
    slow = run_remote(server.url, "import time\ntime.sleep(30)", SandboxLimits(wall_time_s=1.0))
    assert slow.status == "timeout"


def test_a_plain_sandboxfusion_answer_is_understood_without_our_extra_field():
    limits = SandboxLimits()
    for program, status in (("print(1)", "ok"), ("raise SystemExit(3)", "error"), ("import time\ntime.sleep(9)", "timeout"),
                            ("x = bytearray(8 << 30)", "memory")):
        answer = handle_run_code({"code": program, "run_timeout": 1, "memory_limit_MB": 256}, limits)
        assert answer.pop("rlfoundry_status") == status
        assert _to_result(answer, 0.0, limits).status == status


@pytest.mark.parametrize("request_body, message", [
    ({"code": "print(1)", "language": "cpp"}, "python only"),
    ({"language": "python"}, "string 'code'"),
    ([1, 2], "JSON object"),
    ({"code": "print(1)", "files": {"a.txt": "eA=="}}, "'files'"),
])
def test_bad_requests_get_a_sandbox_error_not_a_crash(server, request_body, message):
    req = urllib.request.Request(server.url + "/run_code", data=json.dumps(request_body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as response:
        answer = json.loads(response.read())
    assert answer["status"] == "SandboxError" and message in answer["message"]


def test_an_unreachable_server_is_named_in_the_error(monkeypatch):
    monkeypatch.setattr("rlfoundry.sandbox.fusion.time.sleep", lambda s: None)
    with pytest.raises(SandboxUnavailable, match="127.0.0.1:9"):
        run_remote("http://127.0.0.1:9", "print(1)")


def test_the_reward_manager_sends_code_rows_to_the_configured_server(server):
    from omegaconf import OmegaConf

    from rlfoundry.config.schema import PPOConfig
    from rlfoundry.rewards.reward_manager import _sandbox_fusion_kwargs
    from rlfoundry.rewards.default import default_compute_score

    cfg = OmegaConf.merge(OmegaConf.structured(PPOConfig), {"reward_model": {"sandbox_fusion": {"url": server.url}}})
    kwargs = _sandbox_fusion_kwargs(cfg.reward_model)
    assert kwargs == {"sandbox_fusion_url": server.url, "memory_limit_mb": None, "max_concurrent": 64}
    before = server.requests
    assert default_compute_score("codecontests", PROGRAMS["correct"][0], SUM_TESTS, **kwargs)["score"] == 1.0
    assert server.requests - before == 3
    # the other scorers never see the sandbox arguments
    assert default_compute_score("openai/gsm8k", "#### 72", "72", **kwargs) == 1.0


def test_rlfoundry_sandbox_serve_answers_on_the_port_it_prints():
    proc = subprocess.Popen([sys.executable, "-m", "rlfoundry", "sandbox", "serve", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        banner = proc.stdout.readline()
        url = banner.strip().rsplit(" ", 1)[-1]
        assert url.startswith("http://127.0.0.1:"), banner + proc.stderr.read() if proc.poll() is not None else banner
        r = run_remote(url, "print(6 * 7)")
        assert (r.status, r.stdout) == ("ok", "42\n")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_request_cannot_buy_more_than_the_servers_caps():
    caps = SandboxLimits(wall_time_s=1.0, memory_bytes=256 << 20)
    slow = handle_run_code({"code": "import time\ntime.sleep(30)", "run_timeout": 1e9}, SandboxLimits(), caps)
    assert slow["rlfoundry_status"] == "timeout" and slow["run_result"]["execution_time"] < 30
    hungry = handle_run_code({"code": "x = bytearray(512 << 20)", "memory_limit_MB": 10**9}, SandboxLimits(), caps)
    assert hungry["rlfoundry_status"] == "memory"
    assert handle_run_code({"code": "print(1)", "run_timeout": float("inf")})["status"] == "SandboxError"
