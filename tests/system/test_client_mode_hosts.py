"""A peer behind a NAT (no inbound connections) trains with --client-mode, across hosts
(network namespaces on a shaped bridge, tests/support/netns_hosts.py; the NAT is an iptables rule on the
host's link that drops every new inbound connection). The reachability check tells the two kinds
of host apart. Needs root, ``ip netns`` and iptables; skips cleanly without them (the loopback test
runs anywhere).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.netns_hosts import Hosts, netns_unavailable
from tests.support.swarm_harness import Swarm, assert_groups_identical, groupmate_pairs
from tests.chain.test_chain_hosts import HostSwarm

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]

# a DHT node that joins through argv[1], asks that node to dial it back, and prints what it found
CHECK = r"""
import json, sys
from multiaddr import Multiaddr
from swarm.dht.node import start_dht
from swarm.access.reachability import check_reachability
join = Multiaddr(sys.argv[1])
dht = start_dht([join], ["/ip4/0.0.0.0/tcp/0"])
check = check_reachability(dht, [join.value_for_protocol("p2p")])
print(json.dumps({"reach": check.reach, "answers": check.answers, "addrs": check.addrs}), flush=True)
dht.shutdown()
"""


@pytest.fixture
def _needs_netns():
    why = netns_unavailable()
    if why:
        pytest.skip(f"needs network namespaces: {why}")


def test_a_client_mode_peer_trains_on_loopback_too(tmp_path):
    """Without namespaces: hivemind's client mode serves no averager RPC, so without voloco's fix the
    groupmates could never fetch the client's payload and excluded it every round."""
    swarm = Swarm(tmp_path)
    try:
        swarm.add_peer("full")
        swarm.add_peer("client", "--client-mode")
        swarm.wait_shared(["full", "client"], 4, 240, "rounds of the full peer and the client in one group")
        assert assert_groups_identical([swarm.status("full"), swarm.status("client")]) >= 4
        assert "--client-mode" in swarm.peers["client"].text()  # its reachability line
    finally:
        swarm.close()


def behind_nat(hosts: Hosts, name: str) -> None:
    try:
        hosts.block_inbound(name)
    except RuntimeError as e:
        pytest.skip(f"needs iptables with conntrack in a namespace: {e}")


def reachability_of(hosts: Hosts, name: str, join: str) -> dict:
    r = subprocess.run(hosts.prefix(name) + [sys.executable, "-c", CHECK, join], capture_output=True, text=True,
                       timeout=120, cwd=REPO, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.usefixtures("_needs_netns")
def test_the_check_says_public_for_a_reachable_host_and_client_for_one_behind_a_nat(tmp_path):
    with Hosts(["coord", "open", "nat"], rate="100mbit") as hosts:
        behind_nat(hosts, "nat")
        swarm = HostSwarm(hosts, tmp_path)
        join = swarm.join[1]
        public = reachability_of(hosts, "open", join)
        assert public["reach"] == "public", public
        (answer,) = public["answers"].values()
        assert answer["seen"] == hosts.addr("open") and f"/ip4/{hosts.addr('open')}/tcp/" in answer["addr"]
        hidden = reachability_of(hosts, "nat", join)
        assert hidden["reach"] == "client", hidden
        (answer,) = hidden["answers"].values()
        assert answer["ok"] is False and answer["seen"] == hosts.addr("nat") and answer["why"] == "timed out", answer


@pytest.mark.usefixtures("_needs_netns")
def test_a_client_mode_peer_behind_a_nat_trains_in_groups(tmp_path):
    with Hosts(["coord", "full", "nat"], rate="100mbit") as hosts:
        behind_nat(hosts, "nat")
        swarm = HostSwarm(hosts, tmp_path)
        swarm.add_peer("full")
        swarm.wait(lambda: swarm.rounds("full") >= 2, 180, "the full peer's first rounds alone")
        swarm.add_peer("nat", "--client-mode")  # late: it must download the swarm's state, connecting out

        def shared():
            full, nat = swarm.status("full"), swarm.status("nat")
            if not (full and nat):
                return []
            return [r for r in full["history"] if nat["peer_id"] in r["group"] and nat["peer_id"] not in r["excluded"]
                    and r["contributors"] == len(r["group"])]

        both = lambda: groupmate_pairs([swarm.status("full"), swarm.status("nat")])  # noqa: E731  (both wrote the round)
        swarm.wait(lambda: len(shared()) >= 3 and both() >= 6, 300, "rounds the full peer spent in one group with the "
                   "NAT'd client")
        full, nat = swarm.status("full"), swarm.status("nat")
        assert assert_groups_identical([full, nat]) >= 6  # the client's payload counted, and all end with one θ
        nat_rounds = {r["round"]: r for r in nat["history"]}
        for rec in shared():  # the client's own records agree: it was a member whose payload counted
            mine = nat_rounds.get(rec["round"])
            if mine is not None:
                assert full["peer_id"] in mine["group"] and not mine["excluded"], mine
        # the check runs beside training and may end after the rounds above (a dial-back times out)
        swarm.wait(lambda: all("reachability:" in swarm.text(n) for n in ("full", "nat")), 90, "both reachability checks")
        assert "reachability: public" in swarm.text("full"), swarm.text("full")[-2000:]
        nat_log = swarm.text("nat")
        assert "as expected with --client-mode, other nodes cannot dial this peer" in nat_log, nat_log[-2000:]
        assert "installed the state of round" in nat_log, nat_log[-2000:]
        assert "Traceback" not in nat_log
