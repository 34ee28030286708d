"""verl's module path for the hybrid worker (``verl.workers.fsdp_workers.ActorRolloutRefWorker``): the
worker is engine-neutral and lives in ``actor_rollout_ref``; its ``strategy`` picks the engine."""

from rlfoundry.workers.actor_rollout_ref import ROLES, ActorRolloutRefWorker

__all__ = ["ROLES", "ActorRolloutRefWorker"]
