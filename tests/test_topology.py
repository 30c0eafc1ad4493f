from __future__ import annotations

import pytest

from megatron_mok.testing import spawn
from megatron_mok.topology import MokTopologyError, RankPlace, check_places


def test_one_host_or_one_fabric_is_fine():
    check_places([RankPlace("node0", None)] * 8)
    check_places([RankPlace(f"node{i // 4}", "fab:1") for i in range(72)])


def test_ep_across_nvlink_domains_points_to_flex():
    with pytest.raises(MokTopologyError, match="do not share one NVLink fabric.*flex"):
        check_places([RankPlace("node0", None), RankPlace("node1", None)])
    with pytest.raises(MokTopologyError, match="flex"):
        check_places([RankPlace("a", "fab:1"), RankPlace("b", "fab:2")])
    with pytest.raises(MokTopologyError, match="exceeds one NVLink domain"):
        check_places([RankPlace("a", "fab:1")] * 73)


def _two_hosts(rank, world_size):
    from megatron_mok import topology

    topology.socket.gethostname = lambda: f"host{rank}"  # this spawned rank pretends to be on a host of its own
    from megatron_mok.testing import build_moe_layer, moe_transformer_config

    with pytest.raises(MokTopologyError, match="spans 2 hosts"):
        build_moe_layer(moe_transformer_config(ep_size=world_size, dispatcher="mok"))


@pytest.mark.slow
def test_mok_layer_refuses_an_ep_group_across_hosts():
    spawn(_two_hosts, 2)
