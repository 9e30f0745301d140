"""The local JAX devices a cluster's program runs on: device ``i`` of the cluster is the i-th."""
from __future__ import annotations

import jax

from hapsynth.cluster import Cluster, ClusterError

__all__ = ["local_devices"]


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
