"""The accelerator figures the planner needs, by preset or given explicitly.

Memory is what ``nvidia-smi`` reports as the device's total (e.g. 81559 MiB on an H100 80GB SXM);
bandwidths and FLOP/s are the vendors' datasheet peaks (dense bf16, no sparsity). NVLink is one
direction per GPU; the network is one 400 Gb/s NIC per GPU (50 GB/s) unless given.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

GIB = 1024**3


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_bytes: int  # per device (the host's memory for ``cpu``)
    hbm_gbps: float  # device memory bandwidth, GB/s
    tflops: float  # dense bf16 peak (fp32 for cpu), TFLOP/s
    nvlink_gbps: float  # intra-node, one direction per device, GB/s
    network_gbps: float  # inter-node per device, GB/s
    pcie_gbps: float  # host <-> device (offload traffic), GB/s
    device: str = "cuda"  # "cpu": every rank shares the host's memory

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB


_MIB = 1024**2
PRESETS: dict[str, Hardware] = {
    "h100-80g": Hardware("h100-80g", 81559 * _MIB, 3350, 989, 450, 50, 64),
    "h200-141g": Hardware("h200-141g", 143771 * _MIB, 4800, 989, 450, 50, 64),
    "h20-96g": Hardware("h20-96g", 97871 * _MIB, 4000, 148, 450, 50, 64),
    "a100-80g": Hardware("a100-80g", 81920 * _MIB, 2039, 312, 300, 25, 32),
    "a100-40g": Hardware("a100-40g", 40960 * _MIB, 1555, 312, 300, 25, 32),
    "l40s-48g": Hardware("l40s-48g", 46068 * _MIB, 864, 362, 32, 25, 32),
    "b200-180g": Hardware("b200-180g", 183359 * _MIB, 8000, 2250, 900, 50, 64),
}


def host_memory_bytes() -> int:
    """This host's physical memory (``cpu``: the ranks' shared pool)."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def host_available_bytes() -> int:
    """Memory the kernel says a new allocation can have now (``MemAvailable``), else the total."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return host_memory_bytes()


def cpu_hardware(memory_bytes: int | None = None) -> Hardware:
    """The host as the device: memory bandwidth and FLOP/s are rough desktop-server figures (20 GB/s
    per process, 0.5 TFLOP/s fp32); give --hbm-gbps/--tflops for yours."""
    return Hardware("cpu", memory_bytes or host_memory_bytes(), 20, 0.5, 20, 10, 20, device="cpu")


def resolve_hardware(name: str | None, memory_gib: float | None = None, hbm_gbps: float | None = None,
                     tflops: float | None = None) -> Hardware:
    """A preset by name (``cpu`` = this host), with any explicit figure replacing the preset's."""
    name = (name or "h100-80g").lower()
    if name == "cpu":
        hw = cpu_hardware()
    elif name in PRESETS:
        hw = PRESETS[name]
    else:
        raise ValueError(f"--gpu {name}: unknown; one of {', '.join([*PRESETS, 'cpu'])}, or give "
                         "--gpu-memory-gib/--hbm-gbps/--tflops")
    if memory_gib is not None:
        hw = replace(hw, memory_bytes=int(memory_gib * GIB), name=f"{hw.name} ({memory_gib:g} GiB)")
    if hbm_gbps is not None:
        hw = replace(hw, hbm_gbps=hbm_gbps)
    if tflops is not None:
        hw = replace(hw, tflops=tflops)
    return hw
