"""Is the expert-parallel group inside one NVLink domain?

MoK reads and writes peer GPUs' memory directly (pull dispatch, push combine), so every EP rank
must reach every other over NVLink: one host, or one multi-node NVLink fabric (GB200/GB300 NVL72).
Anything wider is a clear error pointing at Megatron's flex dispatcher (HybridEP / DeepEP), which
handles RDMA between domains.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch.distributed as dist

from . import env
from .config import MAX_EP_RANKS


class MokTopologyError(RuntimeError):
    pass


@dataclass(frozen=True)
class RankPlace:
    host: str
    fabric: str | None  # NVLink fabric (clique) id shared by GPUs of one multi-node NVLink domain


def _fabric_id() -> str | None:
    """Multi-node NVLink fabric id of this GPU, if any (``MOK_NVLINK_FABRIC`` overrides)."""
    override = env.nvlink_fabric()
    if override:
        return override
    try:  # NVML exposes the fabric cluster of MNNVL systems; absent on single-host machines
        import pynvml

        pynvml.nvmlInit()
        import torch

        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        info = pynvml.nvmlDeviceGetGpuFabricInfo(handle)
        uuid = bytes(info.clusterUuid).hex()
        return f"{uuid}:{info.cliqueId}" if any(info.clusterUuid) else None
    except Exception:  # noqa: BLE001 - no NVML / no fabric: single-host NVLink only
        return None


def local_place() -> RankPlace:
    return RankPlace(host=socket.gethostname(), fabric=_fabric_id())


def check_places(places: list[RankPlace]) -> None:
    """Raise unless all places share one host or one NVLink fabric."""
    if len(places) > MAX_EP_RANKS:
        raise MokTopologyError(
            f"EP size {len(places)} exceeds one NVLink domain ({MAX_EP_RANKS} GPUs): "
            "use --moe-token-dispatcher-type flex (HybridEP / DeepEP) for EP across NVLink domains"
        )
    hosts = sorted({p.host for p in places})
    if len(hosts) == 1:
        return
    fabrics = {p.fabric for p in places}
    if None not in fabrics and len(fabrics) == 1:
        return
    raise MokTopologyError(
        f"the EP group spans {len(hosts)} hosts ({', '.join(hosts[:4])}{'...' if len(hosts) > 4 else ''}) "
        "that do not share one NVLink fabric; MoK needs every EP rank to reach the others over NVLink. "
        "Use --moe-token-dispatcher-type flex (HybridEP / DeepEP) for EP across NVLink domains, or keep "
        "expert_model_parallel_size within one node / NVL72 rack"
    )


def check_ep_group(group: dist.ProcessGroup | None = None) -> list[RankPlace]:
    """Gather every EP rank's place and check it (a collective over ``group``)."""
    places: list[RankPlace | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(places, local_place(), group=group)
    checked = [p for p in places if p is not None]
    check_places(checked)
    return checked
