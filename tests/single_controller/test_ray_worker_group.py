"""RayWorkerGroup with real Ray actors on a small local instance (4 logical CPUs, one per module)."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import ray
import torch
import torch.distributed as dist

from rlfoundry.protocol import DataProto
from rlfoundry.single_controller import (
    ClassWithInitArgs,
    Dispatch,
    Execute,
    LocalWorkerGroup,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    Worker,
    WorkerCallTimeout,
    WorkerDiedError,
    create_colocated_worker_cls,
    init_ray,
    register,
)

pytestmark = pytest.mark.ray


class ProbeWorker(Worker):
    """One method per dispatch mode, returning enough to check the split by hand."""

    def __init__(self, offset: int = 0):
        super().__init__()
        self.offset = offset

    @register(Dispatch.ONE_TO_ALL)
    def whoami(self, tag):
        return self.rank, self.world_size, tag

    @register(Dispatch.ALL_TO_ALL)
    def take(self, item):
        return self.rank, item

    @register(Dispatch.RANK_ZERO)
    def rank_value(self):
        return self.rank * 10 + self.offset

    @register(Dispatch.RANK_ZERO, execute_mode=Execute.RANK_ZERO)
    def only_rank_zero_runs(self):
        return self.rank

    @register(Dispatch.DP_COMPUTE_PROTO)
    def double(self, data: DataProto) -> DataProto:
        y = data.batch["x"] * 2 + self.offset
        rank = torch.full_like(y, self.rank)
        meta_info = {"rank": self.rank, "metrics": {"rows": len(data)}}
        return DataProto.from_single_dict({"y": y, "rank": rank}, meta_info=meta_info)

    @register(Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def apply(self, fn, data: DataProto) -> DataProto:
        return fn(data)

    @register(Dispatch.DP_COMPUTE_METRIC)
    def local_rows(self, data: DataProto):
        return {"rank": self.rank, "x": data.batch["x"].tolist()}

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def square_later(self, v):
        return v * v

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce_sum(self, value: float):
        self.init_distributed(timeout_s=60)
        t = torch.tensor([value * (self.rank + 1)])
        dist.all_reduce(t)
        return t.item(), dist.get_backend()

    @register(Dispatch.ONE_TO_ALL)
    def rows_seen(self, data: DataProto):
        return data.batch["x"].tolist()

    @register(Dispatch.ONE_TO_ALL)
    def info(self):
        return self.get_worker_info()

    @register(Dispatch.ONE_TO_ALL)
    def env(self, keys):
        return {k: os.environ.get(k) for k in keys}

    @register(Dispatch.ONE_TO_ALL)
    def wait_for(self, path):
        """A call that lasts until the test creates ``path``, however fast or slow the machine is."""
        while not os.path.exists(path):
            time.sleep(0.01)
        return self.rank


def add_ten(data: DataProto) -> DataProto:
    return DataProto.from_single_dict({"z": data.batch["x"] + 10})


def five_rows() -> DataProto:
    return DataProto.from_single_dict({"x": torch.tensor([10, 11, 12, 13, 14])})


@pytest.fixture(scope="module")
def ray_local():
    if ray.is_initialized():  # left over from another module: start clean
        ray.shutdown()
    started = init_ray(address="local", num_cpus=4)
    yield started
    ray.shutdown()


def make_group(world_size: int, cls=ProbeWorker, name="probe", **kwargs):
    pool = RayResourcePool(process_on_nodes=[world_size], name_prefix=name)
    return RayWorkerGroup(pool, RayClassWithInitArgs(cls, **kwargs), name_prefix=name), pool


@pytest.fixture(scope="module")
def two_ranks(ray_local):
    group, pool = make_group(2, offset=1)
    yield group
    group.shutdown()
    pool.remove()


def _is_rays(process: psutil.Process) -> bool:
    """Ray's own processes: its binaries and scripts live in the ray package; its workers are ``ray::...``."""
    try:
        line = " ".join(process.cmdline())
    except psutil.Error:  # ended meanwhile
        return False
    return f"{os.sep}ray{os.sep}" in line or line.startswith("ray::")


def test_local_ray_has_no_dashboard_and_listens_on_loopback_only(ray_local, two_ranks):
    assert ray_local is True
    two_ranks.all_reduce_sum(1.0)  # the torch.distributed store and gloo are up too
    tree = [psutil.Process()] + psutil.Process().children(recursive=True)
    heads = [" ".join(p.cmdline()) for p in tree if "dashboard/dashboard.py" in " ".join(p.cmdline())]
    # Ray keeps a head process for internal modules, but with no web front end (and no HTTP port).
    assert all("--disable-frontend" in c for c in heads), heads
    assert ray._private.worker.global_worker.node.webui_url == ""
    # no idle workers started for the driver: a rank's environment differs from the job's, so none would serve
    idle = [" ".join(p.cmdline()) for p in tree if " ".join(p.cmdline()).startswith("ray::IDLE")]
    assert not idle, idle
    # Ray's processes only: this pytest process may hold a one-rank gloo group of an earlier test
    # (tests/engines), and gloo's own listener is torch's, not the local Ray instance's; an earlier test's
    # child process (a worker of the process back end, a dist-checkpointing manager) is not Ray's either.
    pids = {p.pid for p in tree[1:] if _is_rays(p)}
    listening = {c.laddr.ip for c in psutil.net_connections("inet") if c.status == "LISTEN" and c.pid in pids}
    assert listening and listening <= {"127.0.0.1", "::ffff:127.0.0.1", "::1"}, listening
    assert ray.nodes()[0]["NodeManagerAddress"] == "127.0.0.1"


def test_workers_get_rank_env_and_rank_zero_rendezvous(two_ranks):
    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "RLFOUNDRY_WORKER_GROUP"]
    envs = two_ranks.env([*keys, "TOKENIZERS_PARALLELISM"])
    assert [e["RANK"] for e in envs] == ["0", "1"] and {e["WORLD_SIZE"] for e in envs} == {"2"}
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
    assert envs[0]["MASTER_ADDR"] == envs[1]["MASTER_ADDR"] == "127.0.0.1"
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]
    assert {e["RLFOUNDRY_WORKER_GROUP"] for e in envs} == {"probe"}
    assert {e["TOKENIZERS_PARALLELISM"] for e in envs} == {"false"}  # init_ray's runtime_env


def test_one_to_all_all_to_all_and_rank_zero(two_ranks):
    assert two_ranks.whoami("t") == [(0, 2, "t"), (1, 2, "t")]
    assert two_ranks.take(["a", "b"]) == [(0, "a"), (1, "b")]
    assert two_ranks.rank_value() == 1  # rank 0: 0 * 10 + offset 1
    assert two_ranks.only_rank_zero_runs() == 0
    assert two_ranks.rows_seen(five_rows()) == [[10, 11, 12, 13, 14]] * 2  # one batch, sent to both


def test_dp_compute_proto_over_two_ranks_unpads_in_order(two_ranks):
    out = two_ranks.double(five_rows())
    # Padded to [10 11 12 | 13 14 10]; rank 0 gets 3 rows, rank 1 gets 2 real rows + 1 pad row (dropped).
    assert out.batch["y"].tolist() == [21, 23, 25, 27, 29]
    assert out.batch["rank"].tolist() == [0, 0, 0, 1, 1]
    assert out.meta_info == {"rank": 0, "metrics": {"rows": [3, 3]}}


def test_dp_compute_proto_with_func_and_metric(two_ranks):
    assert two_ranks.apply(add_ten, five_rows()).batch["z"].tolist() == [20, 21, 22, 23, 24]
    assert two_ranks.local_rows(five_rows()) == [{"rank": 0, "x": [10, 11, 12]}, {"rank": 1, "x": [13, 14, 10]}]


def test_non_blocking_returns_a_future_that_can_feed_the_next_call(two_ranks):
    future = two_ranks.square_later(3)
    assert future.get() == [9, 9]
    assert two_ranks.take(two_ranks.square_later(4)) == [(0, 16), (1, 16)]  # resolved on the driver
    assert two_ranks.execute_all_async("whoami", "q").get() == [(0, 2, "q"), (1, 2, "q")]
    assert two_ranks.execute_rank_zero("rank_value") == 1


def test_gloo_all_reduce_across_two_ray_ranks(two_ranks):
    # rank r contributes 1.5 * (r + 1): 1.5 + 3.0 = 4.5 on both ranks.
    assert two_ranks.all_reduce_sum(1.5) == [(4.5, "gloo"), (4.5, "gloo")]


def test_local_and_ray_back_ends_give_identical_results(ray_local):
    ray_group, pool = make_group(1, name="probe1", offset=1)
    local_group = LocalWorkerGroup(ClassWithInitArgs(ProbeWorker, offset=1), name_prefix="probe1")
    try:
        for group in (ray_group, local_group):
            assert group.whoami("t") == [(0, 1, "t")]
            assert group.rank_value() == 1
            assert group.local_rows(five_rows()) == [{"rank": 0, "x": [10, 11, 12, 13, 14]}]
        ray_out, local_out = ray_group.double(five_rows()), local_group.double(five_rows())
        assert torch.equal(ray_out.batch["y"], local_out.batch["y"])
        assert ray_out.meta_info == local_out.meta_info == {"rank": 0, "metrics": {"rows": [5]}}
    finally:
        ray_group.shutdown()
        pool.remove()


class ActorRole(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def where(self):
        self.init_distributed(timeout_s=60)
        return "actor", os.getpid(), id(dist.distributed_c10d._get_default_group())

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce_rank(self):
        t = torch.tensor([float(self.rank)])
        dist.all_reduce(t)
        return t.item()


class CriticRole(Worker):
    def __init__(self, name):
        super().__init__()
        self.name = name

    @register(Dispatch.ONE_TO_ALL)
    def where(self):
        self.init_distributed(timeout_s=60)  # second call in the same process: no new group
        return self.name, os.getpid(), id(dist.distributed_c10d._get_default_group())

    @register(Dispatch.RANK_ZERO)
    def world(self):
        return dist.get_world_size()


def test_colocated_roles_share_pid_and_process_group(ray_local):
    fused = create_colocated_worker_cls(
        {"actor_rollout": RayClassWithInitArgs(ActorRole), "critic": RayClassWithInitArgs(CriticRole, "critic")}
    )
    pool = RayResourcePool(process_on_nodes=[2], name_prefix="global_pool")
    group = RayWorkerGroup(pool, fused, name_prefix="global_pool")
    try:
        roles = group.spawn({"actor_rollout", "critic"})
        actor, critic = roles["actor_rollout"], roles["critic"]
        actor_where, critic_where = actor.where(), critic.where()
        assert [w[0] for w in actor_where] == ["actor", "actor"]
        assert [w[0] for w in critic_where] == ["critic", "critic"]
        # Same rank -> same process and the same default process group object; ranks differ in pid.
        assert [w[1:] for w in actor_where] == [w[1:] for w in critic_where]
        assert actor_where[0][1] != actor_where[1][1]
        assert actor.all_reduce_rank() == [1.0, 1.0]  # 0 + 1 over the shared group
        assert critic.world() == 2
        assert group.critic_world() == 2  # the fused group keeps the prefixed names
    finally:
        group.shutdown()
        pool.remove()


def test_killed_worker_raises_naming_group_and_rank_fast(ray_local, tmp_path):
    """No stopwatch: the calls last until the test opens their gate, so the first one cannot answer
    within its timeout; the killed rank must be reported as dead before the calls' own timeout (30 s)
    would fire, while rank 0 is still inside its call."""
    group, pool = make_group(2, name="critic")
    try:
        group.call_timeout_s = 0.5
        with pytest.raises(WorkerCallTimeout, match=r"'critic' ranks \[0, 1\] did not finish 'wait_for' within 0.5 s"):
            group.wait_for(str(tmp_path / "open"))
        (tmp_path / "open").touch()
        group.call_timeout_s = None
        pids = [i["pid"] for i in group.info()]
        pending = group.execute_all_async("wait_for", str(tmp_path / "at_the_end"))  # the error must not wait for rank 0
        os.kill(pids[1], signal.SIGKILL)
        group.call_timeout_s = 30  # a WorkerCallTimeout below would mean the death went unnoticed
        with pytest.raises(WorkerDiedError, match="worker group 'critic' rank 1 died while running 'wait_for'") as err:
            pending.get()
        assert (err.value.group, err.value.rank) == ("critic", 1)
        with pytest.raises(WorkerDiedError, match="rank 1 died while running 'whoami'"):
            group.whoami("after")  # every later call fails the same way, instead of hanging
    finally:
        (tmp_path / "at_the_end").touch()
        group.shutdown()
        pool.remove()


def test_worker_exception_keeps_its_type_and_names_the_rank(two_ranks):
    with pytest.raises(ValueError, match="positional argument 0 must be a list with one item per rank \\(2\\)"):
        two_ranks.take("not a list")  # caught by the dispatch on the driver
    with pytest.raises(ZeroDivisionError) as err:
        two_ranks.apply(lambda d: 1 / 0, five_rows())
    assert any("worker group 'probe' rank" in note for note in err.value.__notes__)


class BrokenWorker(Worker):
    def __init__(self):
        super().__init__()
        raise RuntimeError("model path does not exist")


def test_constructor_error_surfaces_when_the_group_is_built(ray_local):
    pool = RayResourcePool(process_on_nodes=[1], name_prefix="reward_model")
    try:
        with pytest.raises(WorkerDiedError, match="'reward_model' rank 0 died while running '__init__'") as err:
            RayWorkerGroup(pool, RayClassWithInitArgs(BrokenWorker))
        assert "model path does not exist" in str(err.value)
    finally:
        pool.remove()
