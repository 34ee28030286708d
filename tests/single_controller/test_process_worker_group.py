"""ProcessWorkerGroup: real spawned processes, real gloo, the same dispatch semantics as Ray's group.

The pytest process may already hold a torch.distributed group (in-process worker tests), so these
groups spawn every rank (``host_rank_zero=False``); the driver-hosted rank 0 that training uses is
exercised in a fresh interpreter by ``test_driver_hosted_rank_zero_trains_like_one_rank``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from rlfoundry.protocol import DataProto
from rlfoundry.single_controller import (
    ClassWithInitArgs,
    Dispatch,
    Execute,
    Worker,
    WorkerCallTimeout,
    WorkerDiedError,
    create_colocated_worker_cls,
    create_worker_group,
    register,
)
from rlfoundry.single_controller.process import _INLINE_BYTES, ProcessWorkerGroup, _MessagePickler, threads_per_rank
from tests.workers.test_actor_update import batch  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parents[2]


class Probe(Worker):
    def __init__(self, offset: int = 0):
        super().__init__()
        self.offset = offset

    @register(Dispatch.ONE_TO_ALL)
    def whoami(self, tag):
        return self.rank, self.world_size, tag, os.getpid(), torch.get_num_threads()

    @register(Dispatch.ALL_TO_ALL)
    def take(self, item):
        return self.rank, item

    @register(Dispatch.RANK_ZERO, execute_mode=Execute.RANK_ZERO)
    def only_rank_zero_runs(self):
        return self.rank

    @register(Dispatch.DP_COMPUTE_PROTO)
    def double(self, data: DataProto) -> DataProto:
        y = data.batch["x"] * 2 + self.offset
        return DataProto.from_single_dict({"y": y, "rank": torch.full_like(y, self.rank)},
                                          meta_info={"metrics": {"rows": len(data)}})

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce_sum(self, value: float):
        self.init_distributed(timeout_s=60)
        t = torch.tensor([value * (self.rank + 1)])
        dist.all_reduce(t)
        return t.item()

    @register(Dispatch.ONE_TO_ALL)
    def fail_on(self, rank: int):
        if self.rank == rank:
            raise KeyError("no such column")
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def echo_after(self, value, seconds):
        time.sleep(seconds)
        return value

    @register(Dispatch.ONE_TO_ALL)
    def sleep(self, seconds):
        time.sleep(seconds)
        return os.getpid()

    @register(Dispatch.ONE_TO_ALL)
    def wait_for(self, path):
        """A call that lasts until the test creates ``path``, however fast or slow the machine is."""
        while not os.path.exists(path):
            time.sleep(0.01)
        return os.getpid()

    @register(Dispatch.ONE_TO_ALL)
    def private_mb(self):
        """Memory only this process maps (Linux): what a rank really adds to the machine."""
        fields = dict(line.split(":", 1) for line in open("/proc/self/smaps_rollup").read().splitlines()[1:])
        return sum(int(fields[k].split()[0]) for k in ("Private_Clean", "Private_Dirty")) / 1024


class Critic(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def pid(self):
        return os.getpid()


class Broken(Worker):
    def __init__(self):
        super().__init__()
        if self.rank == 1:
            raise FileNotFoundError("model path /nope does not exist")


def five_rows() -> DataProto:
    return DataProto.from_single_dict({"x": torch.tensor([10, 11, 12, 13, 14])})


@pytest.fixture(scope="module")
def two_ranks():
    group = ProcessWorkerGroup(ClassWithInitArgs(Probe, offset=1), 2, name_prefix="probe", host_rank_zero=False)
    yield group
    group.shutdown()


def test_dispatch_modes_and_ranks_in_their_own_processes(two_ranks):
    who = two_ranks.whoami("t")
    assert [w[:3] for w in who] == [(0, 2, "t"), (1, 2, "t")]
    assert len({w[3] for w in who} | {os.getpid()}) == 3  # two fresh processes, not the driver
    assert {w[4] for w in who} == {threads_per_rank(2)}
    assert two_ranks.take(["a", "b"]) == [(0, "a"), (1, "b")]
    assert two_ranks.only_rank_zero_runs() == 0


def test_dp_compute_proto_splits_pads_and_unpads_in_order(two_ranks):
    out = two_ranks.double(five_rows())
    assert out.batch["y"].tolist() == [21, 23, 25, 27, 29]
    assert out.batch["rank"].tolist() == [0, 0, 0, 1, 1]
    assert out.meta_info == {"metrics": {"rows": [3, 3]}}


def _pickled_size(obj) -> int:
    import io
    import pickle

    buf = io.BytesIO()
    _MessagePickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.tell()


def test_tensors_cross_the_pipe_exactly_small_ones_inside_the_message(two_ranks):
    odd = [torch.tensor(3.5), torch.zeros(0, 4), torch.arange(10)[::3], torch.tensor([True, False, True]),
           torch.randn(4, 6, dtype=torch.bfloat16).t(), torch.randn(3, dtype=torch.complex64).conj(),
           torch.randn(700, 700)]  # the last one (1.9 MB) goes through shared memory
    for rank, back in two_ranks.take([odd, odd]):
        for sent, got in zip(odd, back):
            assert (got.dtype, got.shape, got.is_conj()) == (sent.dtype, sent.shape, False)
            assert torch.equal(got, sent.resolve_conj())
    # inline: a view sends its own elements only, not the batch it is cut from
    batch = torch.randn(4096, 128)
    assert 64 * 128 * 4 < _pickled_size(batch[:64]) < 64 * 128 * 4 + 512
    # past the inline size: a shared-memory handle, not the bytes
    big = torch.randn(_INLINE_BYTES // 4 + 1)
    assert _pickled_size(big) < 4096


def test_gloo_all_reduce_across_the_ranks(two_ranks):
    assert two_ranks.all_reduce_sum(1.5) == [4.5, 4.5]  # 1.5 * 1 + 1.5 * 2


def test_remote_exception_keeps_type_and_names_rank_then_group_goes_on(two_ranks):
    with pytest.raises(KeyError) as err:
        two_ranks.fail_on(1)
    assert any("worker group 'probe' rank 1, method 'fail_on'" in n for n in err.value.__notes__)
    assert two_ranks.fail_on(5) == [0, 1]  # the pipes stayed in step


def test_colocated_roles_share_each_rank_process():
    fused = create_colocated_worker_cls({"actor": ClassWithInitArgs(Probe), "critic": ClassWithInitArgs(Critic)})
    group = ProcessWorkerGroup(fused, 2, name_prefix="pool", host_rank_zero=False)
    try:
        roles = group.spawn({"actor", "critic"})
        actor_pids = [w[3] for w in roles["actor"].whoami("x")]
        assert roles["critic"].pid() == actor_pids and len(set(actor_pids)) == 2
        assert roles["actor"].all_reduce_sum(1.0) == [3.0, 3.0]
    finally:
        group.shutdown()


def test_factory_builds_it_by_name_and_refuses_a_second_group_size_in_one_process():
    from rlfoundry.single_controller import LocalWorkerGroup

    if not dist.is_initialized():  # join a 1-rank group here, as an in-process worker does
        LocalWorkerGroup(ClassWithInitArgs(Probe)).all_reduce_sum(1.0)
    with pytest.raises(RuntimeError, match=r"already belongs to a torch.distributed group of 1 rank\(s\)"):
        create_worker_group("process", ClassWithInitArgs(Probe), resource_pool=2)


def test_constructor_error_names_the_rank():
    with pytest.raises(FileNotFoundError, match="/nope") as err:
        ProcessWorkerGroup(ClassWithInitArgs(Broken), 2, name_prefix="rm", host_rank_zero=False)
    assert any("'rm' rank 1, method '__init__'" in n for n in err.value.__notes__)


def test_timeout_and_killed_rank_raise_fast_naming_the_rank(tmp_path):
    """No stopwatch: the calls last until the test opens their gate, so the first one cannot answer
    within its timeout; a killed rank must be reported as dead before the call's own timeout (10 s)
    would fire, while rank 0 is still inside its call."""
    group = ProcessWorkerGroup(ClassWithInitArgs(Probe), 2, name_prefix="critic", host_rank_zero=False,
                               call_timeout_s=0.5)
    try:
        with pytest.raises(WorkerCallTimeout, match=r"'critic' ranks \[0, 1\] did not finish 'wait_for' within 0.5 s"):
            group.wait_for(str(tmp_path / "open"))
        (tmp_path / "open").touch()
        group.call_timeout_s = None
        pids = group.sleep(0)  # the timed-out call's late replies are dropped: the group stays usable
        pending = group.execute_all_async("wait_for", str(tmp_path / "at_the_end"))
        os.kill(pids[1], signal.SIGKILL)
        group.call_timeout_s = 10  # a WorkerCallTimeout here would mean the death went unnoticed
        with pytest.raises(WorkerDiedError, match="worker group 'critic' rank 1 died while running 'wait_for'"):
            pending.get()
    finally:
        (tmp_path / "at_the_end").touch()  # rank 0 returns, and exits when asked
        group.shutdown()


def test_late_reply_of_a_timed_out_call_is_not_taken_for_the_next_one(tmp_path):
    """Replies come back in order on each rank's pipe: the answer to a call that timed out arrives
    later and must be dropped, and futures collected out of order each get their own answer."""
    group = ProcessWorkerGroup(ClassWithInitArgs(Probe), 2, name_prefix="p", host_rank_zero=False,
                               call_timeout_s=0.3)
    try:
        with pytest.raises(WorkerCallTimeout):
            group.wait_for(str(tmp_path / "open"))  # cannot answer before the gate opens
        (tmp_path / "open").touch()
        assert all(group._conns[rank].poll(60) for rank in (0, 1))  # the late replies are in the pipes now
        assert group.execute_all("echo_after", "next", 0.0) == ["next", "next"]
        group.call_timeout_s = None
        first = group.execute_all_async("echo_after", "first", 0.2)
        second = group.execute_all_async("echo_after", "second", 0.0)
        assert second.get() == ["second", "second"]
        assert first.get() == ["first", "first"]
        assert group.execute_all("echo_after", "last", 0.0) == ["last", "last"]
    finally:
        group.shutdown()


_DRIVER_SCRIPT = r"""
import json, os, sys, torch
from rlfoundry.single_controller import ClassWithInitArgs
from rlfoundry.single_controller.base.worker import WorkerRuntime
from rlfoundry.single_controller.process import ProcessWorkerGroup
from rlfoundry.workers.fsdp_workers import ActorRolloutRefWorker
sys.path.insert(0, {repo!r})
from tests.workers import worker_config
from tests.workers.test_actor_update import BASE
from rlfoundry.protocol import DataProto
model_dir, batch_dir, out_dir, micro, start_method, fsdp_size = sys.argv[1:7]
cfg = worker_config(model_dir, BASE + ["actor.ppo_mini_batch_size=4", f"actor.ppo_micro_batch_size_per_gpu={{micro}}",
                                        "model.use_shared_prompt=true", "actor.fsdp_config.reshard_after_forward=false",
                                        f"actor.fsdp_config.fsdp_size={{fsdp_size}}"])
group = ProcessWorkerGroup(ClassWithInitArgs(ActorRolloutRefWorker, cfg, "actor", WorkerRuntime(dist_timeout_s=60)), 2,
                           name_prefix="actor",
                           start_method=start_method)
group.init_model()
batch = DataProto.load_from_disk(batch_dir)
metrics = group.update_actor(batch).meta_info["metrics"]
group.update_actor(batch)
group.save_hf_model(out_dir)
group.save_checkpoint(out_dir + "-ckpt")
pids = group.execute_all("get_worker_info")
weight = group.worker.actor.module.lm_head.weight  # rank 0's DTensor
print(json.dumps({{"grad_norm": metrics["actor/grad_norm"], "pids": [p["pid"] for p in pids], "driver": os.getpid(),
                  "start_method": group.start_method, "mesh": list(weight.device_mesh.shape),
                  "local_rows": weight.to_local().shape[0], "rows": weight.shape[0]}}))
group.shutdown()
"""


_FORK_SCRIPT = r"""
import json, os, sys, time
sys.path.insert(0, {repo!r})
import torch, transformers.modeling_utils
from rlfoundry.single_controller import ClassWithInitArgs
from rlfoundry.single_controller.process import ProcessWorkerGroup
from tests.single_controller.test_process_worker_group import Probe
mode = sys.argv[1]
if mode == "memory":
    private = {{}}
    for method in ("fork", "spawn"):
        group = ProcessWorkerGroup(ClassWithInitArgs(Probe), 2, name_prefix=method, start_method=method)
        private[group.start_method] = group.private_mb()[1]
        group.shutdown()
    print(json.dumps(private))
else:  # orphans: every rank forked, then this driver is killed
    group = ProcessWorkerGroup(ClassWithInitArgs(Probe), 3, host_rank_zero=False, start_method="fork")
    print(json.dumps([pid for *_, pid, _ in group.whoami("x")]), flush=True)
    time.sleep(600)
"""


def _fork_script(mode: str, **kwargs):
    cmd = [sys.executable, "-c", _FORK_SCRIPT.format(repo=str(REPO)), mode]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, **kwargs)


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux /proc")
def test_forked_rank_shares_the_drivers_imported_libraries():
    """A forked rank maps torch/transformers' memory copy-on-write from the driver; a spawned one
    imports private copies (~150 MB of torch alone)."""
    out, err = _fork_script("memory").communicate(timeout=240)
    private = json.loads(out.strip().splitlines()[-1]) if out.strip() else pytest.fail(err[-3000:])
    assert private["fork"] < 80 < private["spawn"], private
    assert private["spawn"] - private["fork"] > 100, private


def test_forked_ranks_exit_when_the_driver_is_killed():
    """Forked children inherit the driver's ends of every pipe; each closes them, or a dead driver's
    pipes would never read as closed and the ranks would live on as orphans."""
    proc = _fork_script("orphans")
    try:
        line = proc.stdout.readline()
        pids = json.loads(line) if line.strip() else pytest.fail(proc.stderr.read()[-3000:])
        assert len(set(pids)) == 3 and proc.pid not in pids
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in pids), "ranks outlived their driver"
    finally:
        proc.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie already exited; only its parent (gone) could reap it
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_start_method_auto_forks_only_where_it_is_safe(monkeypatch):
    from rlfoundry.single_controller.process import resolve_start_method

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert resolve_start_method("auto", 1) == "fork"
    assert resolve_start_method("auto", 2) == "spawn"  # GNU OpenMP's pool does not survive a fork
    assert resolve_start_method("spawn", 1) == "spawn"
    with pytest.raises(RuntimeError, match="cannot fork worker ranks: 4 intra-op threads.*start_method='spawn'"):
        resolve_start_method("fork", 4)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert resolve_start_method("auto", 1) == "spawn"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="already belongs to a torch.distributed group"):
        resolve_start_method("fork", 1)
    with pytest.raises(ValueError, match="start_method must be one of"):
        resolve_start_method("forkserver", 1)
    # ranks on CUDA are spawned even before the driver holds a context: asking CUDA anything (as the
    # device check does) already leaves forked children unable to initialise it
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    assert resolve_start_method("auto", 1, "cuda") == "spawn"
    with pytest.raises(RuntimeError, match="the ranks use CUDA"):
        resolve_start_method("fork", 1, "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_start_method("auto", 1, "auto") == "spawn"
    assert resolve_start_method("auto", 1, "cpu") == "fork"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_start_method("auto", 1, "auto") == "fork"


def test_the_group_reads_the_ranks_device_from_their_runtime():
    """What ``_start`` hands ``resolve_start_method``: the colocated class's ``WorkerRuntime`` device
    (trainer.device), else a worker's default, auto."""
    from rlfoundry.single_controller import create_colocated_worker_cls
    from rlfoundry.single_controller.base.worker import WorkerRuntime
    from rlfoundry.single_controller.process import _ranks_device

    roles = {"probe": ClassWithInitArgs(Probe)}
    assert _ranks_device(create_colocated_worker_cls(roles, WorkerRuntime(device="cuda"))) == "cuda"
    assert _ranks_device(create_colocated_worker_cls(roles, WorkerRuntime(device="cpu"))) == "cpu"
    assert _ranks_device(ClassWithInitArgs(Probe)) == "auto"


# Rows (4 prompts x n=2; rows 2i, 2i+1 share prompt i; rank r gets rows 4r..4r+3) and micro-batch:
# "paired": both ranks see each prompt twice, 2 micro-batches accumulate; "mixed": rank 0 sees two
# prompts twice (shared-prompt path: two forwards) while rank 1's four prompts are distinct (one
# padded forward would do), so the ranks must agree on the path or FSDP's collectives hang.
_ROWS = {"paired": ([0, 1, 2, 3, 4, 5, 6, 7], 2), "mixed": ([0, 1, 2, 3, 4, 6, 1, 3], 4)}


@pytest.mark.parametrize("rows,start_method,fsdp_size", [("paired", "fork", -1), ("mixed", "spawn", -1),
                                                         ("paired", "fork", 1)])
@pytest.mark.numerics
def test_driver_hosted_rank_zero_trains_like_one_rank(tiny_model_dir, batch, tmp_path, rows, start_method, fsdp_size):
    """The trainer's layout (rank 0 in the driver, rank 1 a child process): two Adam steps over 2
    ranks give the weights of the same steps on one in-process rank (there with one padded forward
    per row, here with FSDP2 over 2 ranks, the shared-prompt forward (two forwards before each
    backward) and parameters kept gathered with gradients reduced once per mini-batch).
    ``fsdp_size=1``: the ranks replicate the weights (a (2, 1) mesh, gradients all-reduced). Either
    way the checkpoint (sharded with per-layer units, or replicated in one unit) loads into one
    rank's mesh, where the model is a single unit."""
    from tests.workers import worker_config
    from tests.workers.test_actor_update import BASE, two_updates_on_one_rank_match

    index, micro = _ROWS[rows]
    batch = batch.select_idxs(index)
    batch.save_to_disk(tmp_path / "batch.pt")
    script = _DRIVER_SCRIPT.format(repo=str(REPO))
    run = subprocess.run([sys.executable, "-c", script, str(tiny_model_dir), str(tmp_path / "batch.pt"),
                          str(tmp_path / "two"), str(micro), start_method, str(fsdp_size)],
                         capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["pids"][0] == report["driver"] and report["pids"][1] != report["driver"]
    assert report["start_method"] == start_method
    cfg = worker_config(tiny_model_dir, BASE + ["actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=2"])
    one = two_updates_on_one_rank_match(cfg, batch, tmp_path / "one", tmp_path / "two")
    assert report["grad_norm"] == pytest.approx(one["actor/grad_norm"] * 2, rel=1e-4)
    replicated = fsdp_size == 1
    assert report["mesh"] == ([2, 1] if replicated else [2])
    assert report["local_rows"] == (report["rows"] if replicated else report["rows"] // 2)
    # the 2-rank checkpoint reshards into one rank's single-unit mesh: the weights of its HF export
    from rlfoundry.checkpoint import load_checkpoint
    from tests.workers import full_params, local_worker

    local = local_worker(cfg, role="actor")
    load_checkpoint(str(tmp_path / "two-ckpt"), local.worker.actor.module, local.worker.optimizer)
    weights = full_params(local.worker.actor.module)
    exported = load_file(tmp_path / "two" / "model.safetensors")
    for name, value in exported.items():
        # the same run's weights saved two ways (sharded checkpoint, gathered HF export): equal but for the copies
        torch.testing.assert_close(weights[name], value, atol=1e-6, rtol=0, msg=name)


def _run_as_rank_zero(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter that is rank 0 of a one-rank group."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**os.environ, "RANK": "0", "WORLD_SIZE": "1"})


def test_rank_zero_outside_ray_does_not_import_ray():
    """The process back end's driver hosts rank 0; importing Ray there only to learn that no Ray
    runtime is up cost the run ~30-60 MB of memory."""
    code = ("import os, sys\n"
            "os.environ.pop('MASTER_ADDR', None)\n"
            "from rlfoundry.single_controller.base.worker import Worker\n"
            "Worker()\n"
            "print(os.environ['MASTER_ADDR'], 'ray' in sys.modules)\n")
    out = _run_as_rank_zero(code)
    assert out.stdout.split() == ["127.0.0.1", "False"], out.stderr[-2000:]


def test_a_process_leaves_its_group_and_closes_its_store_before_it_exits():
    """Left to the interpreter's teardown, gloo's and the store's threads can abort a finished process
    (exit -6 after ``rlfoundry export`` had written its files, CI 2026-11-26). The group is closed
    by an exit finalizer: hooks made before the group see it closed with no gloo or store thread left;
    hooks made after it (vLLM's engine tears down its subgroups of it) still see it open."""
    code = ("import os, weakref\n"
            "os.environ.pop('MASTER_ADDR', None)\n"
            "import torch.distributed as dist\n"
            "def report(when):\n"
            "    tasks = os.listdir('/proc/self/task')\n"
            "    names = [open(f'/proc/self/task/{t}/comm').read().strip() for t in tasks]\n"
            "    print(when, dist.is_initialized(), sorted(n for n in names if 'gloo' in n or 'tcpstore' in n) != [])\n"
            "class Owner:\n"
            "    pass\n"
            "earlier, later = Owner(), Owner()\n"
            "weakref.finalize(earlier, report, 'earlier')\n"
            "from rlfoundry.single_controller.base.worker import Worker, WorkerRuntime\n"
            "w = Worker(WorkerRuntime(device='cpu'))\n"
            "w.init_distributed()\n"
            "weakref.finalize(later, report, 'later')\n"
            "print('before', dist.is_initialized(), dist.get_backend())\n")
    out = _run_as_rank_zero(code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["before True gloo", "later True True", "earlier False False"], \
        out.stdout + out.stderr[-2000:]


_VIEWS_AT_EXIT = """
import json, sys
sys.path.insert(0, {repo!r})
from rlfoundry.single_controller import ClassWithInitArgs, create_colocated_worker_cls
from rlfoundry.single_controller.process import ProcessWorkerGroup
from tests.single_controller.test_process_worker_group import Critic, Probe
fused = create_colocated_worker_cls({{"actor": ClassWithInitArgs(Probe), "critic": ClassWithInitArgs(Critic)}})
# as the trainer keeps them: the role views only (the group they were copied from is dropped), held
# in a reference cycle (trainer <-> its sample source) that the interpreter has not collected at exit
views = ProcessWorkerGroup(fused, 1, name_prefix="rollout_pool", host_rank_zero=False,
                           start_method=sys.argv[1]).spawn({{"actor", "critic"}})
cycle = {{"views": views}}
cycle["self"] = cycle
import gc
gc.collect()  # a long run collects the dropped group (a cycle through its bound methods) long before exit
print(json.dumps(views["critic"].pid()), flush=True)
"""


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_a_driver_that_keeps_only_role_views_exits_and_ends_its_ranks(start_method):
    """Issue 33: a one-step-off run printed ``finished at step 4`` and never exited: the exit hook held
    the group the views were copied from (already collected), so nothing asked the rollout rank to stop
    and multiprocessing's own exit hook waited for it forever. The driver must exit by itself (the
    timeout here only bounds the test; the old code never returns) and leave no rank behind."""
    cmd = [sys.executable, "-c", _VIEWS_AT_EXIT.format(repo=str(REPO)), start_method]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pids = json.loads(out.splitlines()[0]) if out.strip() else []
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        pytest.fail(f"the driver did not exit after its last line (ranks {pids} left running)")
    assert proc.returncode == 0, err[-3000:]
    pids = json.loads(out.splitlines()[0])
    assert len(pids) == 1 and not any(_alive(pid) for pid in pids)
