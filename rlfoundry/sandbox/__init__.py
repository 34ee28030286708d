"""Running untrusted code: the kernel-isolated sandbox (``runner``; ``namespace``: bubblewrap and the
seccomp filter; ``unshare``: the same namespaces made by the project where bubblewrap is missing), the unisolated
opt-in mode's audit-hook policy (``policy``), and SandboxFusion's HTTP API, as a client and as a
server over this sandbox (``fusion``). See docs/sandbox.md."""

from rlfoundry.sandbox.runner import (
    ALLOW_UNISOLATED_ENV,
    ISOLATION_ENV,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    caps_in_force,
    mode,
    run_python,
)

__all__ = ["ALLOW_UNISOLATED_ENV", "ISOLATION_ENV", "SandboxLimits", "SandboxResult", "SandboxUnavailable", "caps_in_force", "mode",
           "run_python"]
