"""The routing policies of `outrider serve --replicas N` (least-load, sticky) on plain records, and
the one-line refusals of bad cluster options; no Ray needed."""

from __future__ import annotations

import sys

import pytest

from outrider.cluster.policies import make_policy
from outrider.cluster.policy import NoReplica, ReplicaView, RequestInfo
from outrider.errors import ConfigError
from outrider.serve.server import ServeOptions


def views(*loads, dead=(), sessions=None) -> list[ReplicaView]:
    """Replicas with these loads (running; queued above 2), `dead` indices, {index: sessions}."""
    out = []
    for i, load in enumerate(loads):
        out.append(ReplicaView(i, alive=i not in dead, running=min(load, 2), queued=max(load - 2, 0),
                               max_running=2, sessions=frozenset((sessions or {}).get(i, ()))))
    return out


def request(session=None) -> RequestInfo:
    return RequestInfo("r", 4, 8, 0.0, session=session)


def test_least_load_takes_the_fewest_running_and_queued_lowest_index_on_ties():
    policy = make_policy("least-load")
    assert policy.route(request(), views(3, 1, 2), 0).replica == 1
    assert policy.route(request(), views(5, 4, 4), 0).replica == 1  # queued count too; tie -> lowest
    assert policy.route(request(), views(0, 0), 0).replica == 0
    assert policy.route(request("s"), views(0, 3, sessions={1: {"s"}}), 0).replica == 0  # sessions ignored


def test_least_load_skips_dead_replicas_and_says_when_none_is_left():
    policy = make_policy("least-load")
    assert policy.route(request(), views(0, 5, 9, dead=(0,)), 0).replica == 1
    with pytest.raises(NoReplica, match="no live replica"):
        policy.route(request(), views(0, 0, dead=(0, 1)), 0)


def test_sticky_sends_a_session_home_until_its_replica_is_too_busy():
    policy = make_policy("sticky:max_skew=2")
    home = {1: {"alice"}}
    assert policy.route(request("alice"), views(0, 0, sessions=home), 0).replica == 1
    d = policy.route(request("alice"), views(0, 2, sessions=home), 0)
    assert (d.replica, d.reason) == (1, "sticky")  # 2 above the least loaded: still home
    d = policy.route(request("alice"), views(0, 3, sessions=home), 0)
    assert (d.replica, d.reason) == (0, "moved")  # 3 above: moves to the least loaded
    d = policy.route(request("alice"), views(4, 0, 0, dead=(1,), sessions=home), 0)
    assert (d.replica, d.reason) == (2, "new-session")  # its home is dead
    assert policy.route(request("bob"), views(1, 0, sessions=home), 0).replica == 1  # new: least-load
    assert policy.route(request(None), views(0, 0, sessions=home), 0).reason == "least-load"


def test_sticky_prefers_the_less_busy_of_two_homes_and_defaults_to_skew_4():
    policy = make_policy("sticky")
    assert policy.max_skew == 4
    both = {0: {"s"}, 2: {"s"}}
    assert policy.route(request("s"), views(3, 0, 1, sessions=both), 0).replica == 2
    assert policy.route(request("s"), views(4, 0, 9, sessions=both), 0).replica == 0  # 4 above: stays


@pytest.mark.parametrize("text, message", [
    ("nope", "unknown policy 'nope': choose one of least-load, sticky"),
    ("sticky:max_skew=-1", "max_skew must be an integer >= 0"),
    ("sticky:max_skew=x", "max_skew must be an integer >= 0"),
    ("sticky:skew=2", "sticky takes max_skew=N"),
    ("sticky:max_skew", "options are key=value pairs"),
    ("least-load:k=1", "least-load takes no options"),
    ("tailsieve:fast=-1", "fast must be >= 0 replicas"),
    ("tailsieve:fast=x", "fast a number of replicas"),
])
def test_bad_policies_are_refused_in_one_line(text, message):
    with pytest.raises(ConfigError, match=message) as err:
        make_policy(text)
    assert "\n" not in str(err.value)


def test_bad_cluster_options_are_refused_before_anything_starts(monkeypatch):
    with pytest.raises(ConfigError, match="--replicas must be a positive integer, got 0"):
        ServeOptions(replicas=0).check()
    with pytest.raises(ConfigError, match="--policy sticky routes between replicas: give --replicas N"):
        ServeOptions(policy="sticky").check()
    with pytest.raises(ConfigError, match=r"--replica-restarts must be an integer >= 0 \(0: never restart\), got -1"):
        ServeOptions(replicas=2, replica_restarts=-1).check()
    from outrider.cluster import backend

    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(ConfigError, match=r"need Ray, which is not installed: pip install 'outrider\[cluster\]'"):
        backend.build(ServeOptions(replicas=2))
