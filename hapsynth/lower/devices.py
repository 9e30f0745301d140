"""The local JAX devices a cluster's program runs on: device ``i`` of the cluster is the i-th."""
from __future__ import annotations

import jax

from hapsynth.cluster import Cluster, ClusterError

__all__ = ["local_devices", "plan_devices"]


def local_devices(cluster: Cluster) -> list:
    """``jax.devices()[:cluster.num_devices]``: device ``i`` of the cluster runs on the i-th."""
    devs = jax.devices()
    n = cluster.num_devices
    if len(devs) < n:
        plat = devs[0].platform if devs else "?"
        raise ClusterError(
            f"cluster {cluster.name!r} needs {n} devices but JAX sees only {len(devs)} "
            f"({plat}); for simulated CPU devices set XLA_FLAGS="
            f"--xla_force_host_platform_device_count={n} (or JAX_NUM_CPU_DEVICES={n}) "
            "before JAX initialises")
    return list(devs[:n])


def plan_devices(plan, devices) -> list:
    """The devices `plan` runs on, out of its cluster's `devices` (all but the idle ones)."""
    devices = list(devices)
    if plan.devices is None:
        return devices
    if max(plan.devices) >= len(devices):
        raise ClusterError(f"the plan runs on device {max(plan.devices)} of cluster "
                           f"{plan.cluster!r}, but {len(devices)} devices were given")
    return [devices[i] for i in plan.devices]
