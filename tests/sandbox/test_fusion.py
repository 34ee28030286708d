"""SandboxFusion's API both ways: the project's server runs its sandbox behind ``POST /run_code`` and
answers as SandboxFusion answers (its documented examples replay field for field), and the code reward
through the client gives exactly the scores and reasons it gives locally."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rlfoundry.rewards import code
from rlfoundry.sandbox import SandboxLimits, SandboxUnavailable, run_python
from rlfoundry.sandbox.runner import run_job
from rlfoundry.sandbox.fusion import LANGUAGES, _to_result, handle_run_code, make_server, run_remote
from rlfoundry.sandbox.cgroup import memory_cgroups
from rlfoundry.sandbox.namespace import ISOLATION_ENV, SANDBOX_ID, Job, isolation
from rlfoundry.sandbox.stage import MAX_DEPTH
from tests.rewards.test_code import LIMITS, PROGRAMS, SUM_TESTS

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler (g++) on this machine")


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


@pytest.mark.parametrize("program, status", [
    ("print(1)", "ok"), ("raise SystemExit(3)", "error"), ("import time\ntime.sleep(9)", "timeout"),
    ("x = bytearray(8 << 30)", "memory"), ("print('x' * (1 << 20))", "output_limit"),
    # a system call refused for memory (a memory cgroup's limit reached in write() to a memfd) reads so
    ("import errno, os\nraise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))", "memory"),
])
def test_the_answer_tells_the_client_the_status_the_local_sandbox_gives(program, status):
    """No field of our own: the standard answer alone carries every status the code reward tells apart."""
    # a short wall clock only where the timeout is the point: under load an interpreter's start alone
    # can take half a second, and the other programs must reach their own ending first
    wall = 0.5 if status == "timeout" else 8.0
    limits = SandboxLimits(wall_time_s=wall, memory_bytes=256 << 20, max_output_bytes=64 << 10)
    assert run_python(program, limits).status == status
    http, answer = handle_run_code({"code": program, "language": "python", "run_timeout": wall, "memory_limit_MB": 256,
                                    "max_output_bytes": 64 << 10})
    assert http == 200 and set(answer) == set(SANDBOXFUSION_HELLO[1])
    assert _to_result(answer, 0.0, limits).status == status


def _post(url: str, body: bytes | None, method: str = "POST") -> tuple[int, object]:
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _ask(server, request) -> tuple[int, object]:
    return _post(server.url + "/run_code", json.dumps(request).encode())


# ---- SandboxFusion's documented examples, replayed ---------------------------------------------
# Each: (request, the response SandboxFusion's documentation shows). execution_time is the only field
# that differs run to run; everything else must match exactly, keys included.

# docs/docs/docs/get-started.mdx ("Get Started", Usage / Code Sandbox): the curl example
SANDBOXFUSION_HELLO = ({"code": "print(\"Hello, world!\")", "language": "python"}, {
    "status": "Success", "message": "", "compile_result": None,
    "run_result": {"status": "Finished", "execution_time": 0.016735315322875977, "return_code": 0,
                   "stdout": "Hello, world!\n", "stderr": ""},
    "executor_pod_name": None, "files": {}})
# docs/docs/docs/get-started.mdx: the C++ example made with requests
SANDBOXFUSION_CPP = ({"code": "\n#include <iostream>\n\nint main() {\n    std::cout << \"Hello, world!\" << std::endl;\n"
                              "    return 0;\n}\n", "language": "cpp"}, {
    "status": "Success", "message": "",
    "compile_result": {"status": "Finished", "execution_time": 0.45870447158813477, "return_code": 0,
                       "stdout": "", "stderr": ""},
    "run_result": {"status": "Finished", "execution_time": 0.002761363983154297, "return_code": 0,
                   "stdout": "Hello, world!\n", "stderr": ""},
    "executor_pod_name": None, "files": {}})
# docs/docs/docs/how-to/run-code/upload-download-files.mdx ("Upload & Download Files"): Upload, with a
# flag.txt holding "secret flag"
SANDBOXFUSION_UPLOAD = ({"code": "print(open(\"flag.txt\").read())", "language": "python",
                         "files": {"flag.txt": base64.b64encode(b"secret flag").decode()}}, {
    "status": "Success", "message": "", "compile_result": None,
    "run_result": {"status": "Finished", "execution_time": 0.018889427185058594, "return_code": 0,
                   "stdout": "secret flag\n", "stderr": ""},
    "executor_pod_name": None, "files": {}})
# the same page: Download
SANDBOXFUSION_DOWNLOAD = ({"code": "open(\"flag.txt\", \"w\").write(\"this is a secret\")", "language": "python",
                           "fetch_files": ["flag.txt"]}, {
    "status": "Success", "message": "", "compile_result": None,
    "run_result": {"status": "Finished", "execution_time": 0.023561477661132812, "return_code": 0,
                   "stdout": "", "stderr": ""},
    "executor_pod_name": None, "files": {"flag.txt": "dGhpcyBpcyBhIHNlY3JldA=="}})
# docs/src/openapi.json (the schema behind the API reference pages): RunCodeRequest.language's enum
SANDBOXFUSION_LANGUAGES = ["python", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "typescript",
                           "sql", "rust", "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest",
                           "junit", "kotlin_script", "jest", "verilog", "python_gpu", "lean", "swift", "racket"]


def _without_times(answer: dict) -> dict:
    out = json.loads(json.dumps(answer))
    for key in ("compile_result", "run_result"):
        if out.get(key) is not None:
            assert isinstance(out[key].pop("execution_time"), float)
    return out


@pytest.mark.parametrize("example", [
    SANDBOXFUSION_HELLO, SANDBOXFUSION_UPLOAD, SANDBOXFUSION_DOWNLOAD,
    pytest.param(SANDBOXFUSION_CPP, marks=needs_gxx),
], ids=["hello", "upload", "download", "cpp"])
def test_sandboxfusions_documented_examples_replay_identically(server, example):
    request, documented = example
    status, answer = _ask(server, request)
    assert status == 200
    assert _without_times(answer) == _without_times(documented)


def test_the_languages_are_sandboxfusions_and_ping_answers_pong(server):
    assert list(LANGUAGES) == SANDBOXFUSION_LANGUAGES
    assert _post(server.url + "/v1/ping", None, "GET") == (200, "pong")
    assert _post(server.url + "/nowhere", None, "GET") == (404, {"detail": "Not Found"})
    assert _post(server.url + "/run_code", None, "GET") == (405, {"detail": "Method Not Allowed"})


@pytest.mark.parametrize("request_body, error", [
    # SandboxFusion has no python3: its Language literal refuses it, as any name outside the list
    ({"code": "print(1)", "language": "python3"}, {"type": "literal_error", "loc": ["body", "language"], "input": "python3"}),
    ({"code": "print(1)", "language": "brainfuck"}, {"type": "literal_error", "loc": ["body", "language"]}),
    ({"language": "python"}, {"type": "missing", "loc": ["body", "code"], "msg": "Field required"}),
    ({"code": "print(1)"}, {"type": "missing", "loc": ["body", "language"]}),
    ({"code": "1", "language": "python", "run_timeout": "soon"}, {"type": "float_parsing", "loc": ["body", "run_timeout"]}),
    ({"code": "1", "language": "python", "files": ["a.txt"]}, {"type": "dict_type", "loc": ["body", "files"]}),
])
def test_a_request_sandboxfusion_would_not_validate_gets_fastapis_422(server, request_body, error):
    status, answer = _ask(server, request_body)
    assert status == 422 and len(answer["detail"]) == 1
    assert error.items() <= answer["detail"][0].items(), answer


def test_a_body_that_is_not_json_or_is_missing_gets_fastapis_422(server):
    status, answer = _post(server.url + "/run_code", b"{not json")
    assert status == 422 and answer["detail"][0]["type"] == "json_invalid"
    assert _post(server.url + "/run_code", b"") == (422, {"detail": [
        {"type": "missing", "loc": ["body"], "msg": "Field required", "input": None}]})


def test_a_known_language_without_a_runner_here_is_a_sandbox_error_naming_what_runs(server):
    status, answer = _ask(server, {"code": "class Main {}", "language": "java"})
    assert status == 200 and answer["status"] == "SandboxError" and "'java' is not available" in answer["message"]
    assert "python" in answer["message"] and answer["run_result"] is None and "executor_pod_name" in answer


def test_a_time_limit_is_failed_with_a_null_return_code_and_the_output_so_far(server):
    _, answer = _ask(server, {"code": "print('started', flush=True)\nimport time\ntime.sleep(30)",
                              "language": "python", "run_timeout": 1})
    run = answer["run_result"]
    assert answer["status"] == "Failed" and run["status"] == "TimeLimitExceeded" and run["return_code"] is None
    assert run["stdout"] == "started\n" and 1.0 <= run["execution_time"] < 5


def test_output_is_kept_to_one_mebibyte_by_default_and_to_max_output_bytes_when_asked(server):
    _, answer = _ask(server, {"code": "print('x' * (100 << 10))", "language": "python"})
    assert answer["status"] == "Success" and answer["run_result"]["stdout"] == "x" * (100 << 10) + "\n"
    _, answer = _ask(server, {"code": "import sys\nsys.stdout.write('y' * (3 << 20))", "language": "python"})
    assert answer["run_result"]["stdout"] == "y" * (1 << 20)  # SandboxFusion's 1 MiB; the rest is refused
    _, answer = _ask(server, {"code": "print('z' * 5000)", "language": "python", "max_output_bytes": 1000})
    assert answer["status"] == "Failed" and answer["run_result"]["stdout"] == "z" * 1000
    _, answer = _ask(server, {"code": "print('w' * 5000)", "language": "python", "max_output_bytes": 1 << 30})
    assert answer["run_result"]["stdout"] == "w" * 5000 + "\n"  # a request may lower the cap, never raise it


@pytest.fixture(params=["bwrap", "unshare"])
def backend(request, monkeypatch):
    monkeypatch.setenv(ISOLATION_ENV, request.param)
    if not isolation().available:
        pytest.skip(f"the {request.param} backend does not work here: {isolation().reason}")
    return request.param


def test_files_go_in_and_fetch_files_come_back_inside_the_working_directory_only(backend):
    program = ("import os\nprint(open('in/a.txt').read(), open('/sandbox/b.bin', 'rb').read().hex())\n"
               "open('out.txt', 'w').write('made inside')\nos.symlink('/etc/hostname', 'link')\n"
               "print(os.path.exists('skipped'))")
    _, answer = handle_run_code({"code": program, "language": "python", "files": {
        "in/a.txt": base64.b64encode(b"nested").decode(), "/sandbox/b.bin": base64.b64encode(b"\x00\xff").decode(),
        "skipped": None}, "fetch_files": ["out.txt", "/sandbox/in/a.txt", "link", "never_made"]})
    assert answer["status"] == "Success" and answer["run_result"]["stdout"] == "nested 00ff\nFalse\n", answer
    # a symlink the program left is not followed (it names a host file); a missing file is left out
    assert answer["files"] == {"out.txt": base64.b64encode(b"made inside").decode(),
                               "/sandbox/in/a.txt": base64.b64encode(b"nested").decode()}
    for outside in ("../escape.txt", "in/../../x", "/tmp/flag.txt", "/etc/passwd"):
        for key, value in (("files", {outside: "eA=="}), ("fetch_files", [outside])):
            start = time.monotonic()
            _, answer = handle_run_code({"code": "import time\ntime.sleep(30)", "language": "python", key: value})
            assert answer["status"] == "SandboxError" and "outside the working directory" in answer["message"]
            assert time.monotonic() - start < 1  # refused before anything ran (the program would sleep 10 s)


# what the program can tell about its own confinement: ids, host objects it must not change, its streams
HARDENING_PROBE = """import json, os, stat
def refused(f):
    try:
        f()
        return False
    except OSError:
        return True
open('/sandbox/made', 'w').write('x')
made = os.stat('/sandbox/made')
print(json.dumps({"ids": [os.getuid(), os.geteuid(), os.getgid(), os.getegid()], "made_by": [made.st_uid, made.st_gid],
    "sysctl_write": refused(lambda: open('/proc/sys/kernel/printk_ratelimit', 'w')),
    "init_environ": refused(lambda: open('/proc/1/environ', 'rb').read()),
    "dev_chmod": refused(lambda: os.chmod('/dev/null', 0o600)),
    "sys": os.path.exists('/sys/kernel'), "pipes": [stat.S_ISFIFO(os.fstat(i).st_mode) for i in (0, 1, 2)],
    "shmmax": open('/proc/sys/kernel/shmmax').read().strip()}))
"""


def test_a_jobs_program_is_confined_as_a_scripts_and_its_folder_works_for_a_root_caller(backend, tmp_path):
    """A job in a host folder gets the script's confinement field for field; for a root caller that is
    host uid 65534, which can still write its folder (a tmpfs the folder, mode 0700 under pytest's
    root-only 0700 base, is copied into), and what it writes comes back, the caller's."""
    limits = SandboxLimits(memory_bytes=512 << 20)
    work = tmp_path / "job"
    work.mkdir(mode=0o700)
    (work / "main.py").write_text(HARDENING_PROBE)
    as_script = run_python(HARDENING_PROBE, limits)
    as_job = run_job(Job((sys.executable, "-I", "-B", "main.py"), str(work)), limits)
    assert as_script.status == as_job.status == "ok", (as_script, as_job)
    report = json.loads(as_job.stdout)
    assert report == json.loads(as_script.stdout)
    assert report["ids"] == [SANDBOX_ID] * 4 and report["pipes"] == [True] * 3 and not report["sys"]
    assert report["sysctl_write"] and report["dev_chmod"] and report["made_by"] == [SANDBOX_ID] * 2
    made = (work / "made").stat()
    assert (work / "made").read_text() == "x" and (made.st_uid, made.st_gid) == (os.getuid(), os.getgid())
    root = os.geteuid() == 0
    if root:  # a root caller's sandbox has its own System V limits, at the memory limit
        assert report["shmmax"] == str(512 << 20) and report["init_environ"]


_FILL_FOLDER = """import os
print(len(open('big.bin', 'rb').read()) >> 20)  # an input larger than a file it may write (1 MiB) goes in
n = 0
try:
    for n in range(64):  # each file within RLIMIT_FSIZE: only the folder's own size stops it
        open(f'f{n}', 'wb').write(b'x' * (1 << 20))
    n = 64
except OSError as e:
    print(os.strerror(e.errno))
print(n)
"""


def test_a_jobs_folder_holds_at_most_its_disk_limit_whatever_the_number_of_files(backend, tmp_path):
    """64 files of 1 MiB (each within the 1 MiB file limit) against an 8 MiB folder: the folder is a tmpfs
    of 8 MiB past its inputs, so the writes stop there and the host folder gets no more back (a host
    folder bound in, as before, took all 64 MiB)."""
    work = tmp_path / "job"
    work.mkdir()
    (work / "main.py").write_text(_FILL_FOLDER)
    (work / "big.bin").write_bytes(b"i" * (3 << 20))
    limits = SandboxLimits(max_output_bytes=1 << 20, disk_bytes=8 << 20)
    r = run_job(Job((sys.executable, "-I", "-B", "main.py"), str(work)), limits)
    first, reason, written = r.stdout.splitlines()
    assert (r.status, first, reason) == ("ok", "3", "No space left on device"), r
    assert written == "8"  # 8 MiB of room past the inputs (and a page per input file: a few KiB more)
    made = sum(f.stat().st_size for f in work.glob("f*"))
    assert made < (8 << 20) + (64 << 10) and (work / "big.bin").stat().st_size == 3 << 20


def test_a_folder_tree_too_deep_for_the_hosts_tools_comes_back_cut_and_the_call_answers(backend):
    """1000 nested folders would make the server's own clean-up (a recursive rmtree) raise: what comes back
    stops at stage.MAX_DEPTH, and both the call and the server's clean-up end normally."""
    deep = "import os\nfor _ in range(1000):\n    os.mkdir('d')\n    os.chdir('d')\nprint('made')\n"
    _, answer = handle_run_code({"code": deep, "language": "python", "fetch_files": ["d"]})
    assert (answer["status"], answer["run_result"]["stdout"], answer["files"]) == ("Success", "made\n", {}), answer
    with tempfile.TemporaryDirectory() as work:
        Path(work, "main.py").write_text(deep)
        r = run_job(Job((sys.executable, "-I", "-B", "main.py"), work), SandboxLimits())
        depth = max(len(Path(top).relative_to(work).parts) for top, _, _ in os.walk(work))
    assert (r.status, depth) == ("ok", MAX_DEPTH)


@needs_gxx
def test_cpp_compiles_and_runs_inside_the_sandbox(backend):
    """Both phases are sandboxed: the compiler cannot read a host file, the program cannot start a process."""
    program = ("#include <cstdio>\n#include <unistd.h>\nint main() { char s[8]; scanf(\"%7s\", s);\n"
               "  FILE* f = fopen(\"out.txt\", \"w\"); fprintf(f, \"%s!\", s); fclose(f);\n"
               "  printf(\"%s %d\\n\", s, fork()); return 4; }\n")
    _, answer = handle_run_code({"code": program, "language": "cpp", "stdin": "hi", "fetch_files": ["out.txt"]})
    assert answer["compile_result"]["return_code"] == 0, answer
    assert answer["status"] == "Failed" and answer["run_result"]["return_code"] == 4
    assert answer["run_result"]["stdout"] == "hi -1\n"
    assert answer["files"] == {"out.txt": base64.b64encode(b"hi!").decode()}
    _, answer = handle_run_code({"code": '#include "/etc/passwd"\nint main() {}', "language": "cpp"})
    compiled = answer["compile_result"]
    assert answer["status"] == "Failed" and answer["run_result"] is None
    assert compiled["return_code"] != 0 and "/etc/passwd" in compiled["stderr"] and "No such file" in compiled["stderr"]


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
        caps = proc.stdout.readline()  # which mechanism caps memory here, and why not the cgroup if not
        cgroups = memory_cgroups()
        assert caps.startswith("rlfoundry sandbox caps: memory: ") and cgroups.reason in caps
        assert ("no memory cgroup" in caps) == (cgroups.parent is None)
        r = run_remote(url, "print(6 * 7)")
        assert (r.status, r.stdout) == ("ok", "42\n")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_request_cannot_buy_more_than_the_servers_caps():
    caps = SandboxLimits(wall_time_s=1.0, memory_bytes=256 << 20)
    _, slow = handle_run_code({"code": "import time\ntime.sleep(30)", "language": "python", "run_timeout": 1e9},
                              SandboxLimits(), caps)
    assert slow["run_result"]["status"] == "TimeLimitExceeded" and slow["run_result"]["execution_time"] < 30
    _, hungry = handle_run_code({"code": "x = bytearray(512 << 20)", "language": "python", "memory_limit_MB": 10**9},
                                SandboxLimits(), caps)
    assert "MemoryError" in hungry["run_result"]["stderr"] and hungry["status"] == "Failed"
    _, endless = handle_run_code({"code": "print(1)", "language": "python", "run_timeout": float("inf")})
    assert endless["status"] == "SandboxError" and "positive number of seconds" in endless["message"]
