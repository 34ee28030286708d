"""Several roles in one process per rank (verl's ``create_colocated_worker_cls``).

Actor, rollout and reference share a process so that the rollout uses the actor's weights without
a copy, and a critic may join them on the same pool. The fused class holds one instance per role
and exposes each role's registered method ``m`` as ``<role>_m`` with the same dispatch spec;
``group.spawn(roles)`` then gives one view per role whose methods have the plain names.
"""

from __future__ import annotations

import copy

from rlfoundry.single_controller.base.decorator import register, registered_methods
from rlfoundry.single_controller.base.worker import Worker, WorkerRuntime, roles_inherit
from rlfoundry.single_controller.base.worker_group import ClassWithInitArgs


def _forward(role: str, name: str):
    def method(self, *args, **kwargs):
        return getattr(self.workers[role], name)(*args, **kwargs)

    method.__name__ = f"{role}_{name}"
    return method


def create_colocated_worker_cls(class_dict: dict[str, ClassWithInitArgs],
                                runtime: WorkerRuntime | None = None) -> ClassWithInitArgs:
    """One worker class holding an instance of each role's class; returns it with its init args.

    The result has the type of the inputs (``ClassWithInitArgs`` or ``RayClassWithInitArgs``, whose
    Ray options are taken from the first role), so it works with both back ends. ``runtime`` (the
    run's device, timeouts, malloc setting) is set for each rank's process before any role is built.
    """
    if not class_dict:
        raise ValueError("create_colocated_worker_cls needs at least one role")
    roles = {role: c.cls for role, c in class_dict.items()}
    inits = {role: (c.args, c.kwargs) for role, c in class_dict.items()}

    class ColocatedWorker(Worker):
        colocated_roles = roles

        def __init__(self, role_inits: dict, runtime: WorkerRuntime | None = None):
            super().__init__(runtime)  # sets the rendezvous env and the runtime every role below reads
            # Roles are built in the given order, so an earlier role (the actor) exists when a later
            # one is constructed; they share the process, its device and its process group.
            with roles_inherit(self.runtime):
                self.workers = {role: roles[role](*a, **k) for role, (a, k) in role_inits.items()}

    for role, cls in roles.items():
        for name, spec in registered_methods(cls).items():
            fused = register(spec.dispatch_mode, spec.execute_mode, spec.blocking)(_forward(role, name))
            setattr(ColocatedWorker, fused.__name__, fused)
    ColocatedWorker.__name__ = ColocatedWorker.__qualname__ = "Colocated_" + "_".join(roles)

    # A copy of the first role's wrapper keeps its type and back-end options (Ray runtime env).
    fused_init = copy.copy(next(iter(class_dict.values())))
    fused_init.cls, fused_init.args, fused_init.kwargs = ColocatedWorker, (inits, runtime), {}
    return fused_init
