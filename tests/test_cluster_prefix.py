"""Cache-aware routing (issue 42, item 4): the router's per-replica prefix index, the `prefix`
policy and WAR's high-load arm, on plain records (no Ray)."""

from __future__ import annotations

import pytest

from outrider.cluster.policies import make_policy
from outrider.cluster.policies.war import WAR
from outrider.cluster.policy import Outcome, ReplicaView, RequestInfo
from outrider.cluster.prefix_index import PrefixIndex
from outrider.errors import ConfigError

SYSTEM = tuple(range(100, 164))  # a 64-token shared system prompt (4 blocks of 16)


def req(ids=(), id="r", session=None) -> RequestInfo:
    return RequestInfo(id, len(ids), 8, 0.0, session=session, prompt_ids=tuple(ids))


def views(*loads, dead=(), max_running=8) -> list[ReplicaView]:
    return [ReplicaView(i, alive=i not in dead, running=load, max_running=max_running) for i, load in enumerate(loads)]


def test_index_matches_whole_blocks_of_the_longest_common_prefix():
    index = PrefixIndex(block=4)
    index.add([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # two whole blocks; 9, 10 are not kept
    assert index.match([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]) == 8
    assert index.match([1, 2, 3, 4, 5, 6, 7, 0]) == 4  # the second block differs in its last token
    assert index.match([0, 2, 3, 4, 5, 6, 7, 8]) == 0  # a chain: the same second block after another first
    assert index.match([5, 6, 7, 8]) == 0
    assert index.match([1, 2, 3]) == 0  # shorter than a block
    index.clear()
    assert index.match([1, 2, 3, 4]) == 0 and len(index) == 0


def test_index_drops_the_least_recently_used_blocks_past_its_bound():
    index = PrefixIndex(block=2, max_blocks=4)
    index.add([1, 1, 2, 2])
    index.add([3, 3, 4, 4])
    assert index.match([1, 1, 2, 2]) == 4  # touched: [3, 3, 4, 4] is now the oldest
    index.add([5, 5, 6, 6])
    assert len(index) == 4
    assert index.match([3, 3]) == 0 and index.match([1, 1, 2, 2]) == 4 and index.match([5, 5, 6, 6]) == 4
    with pytest.raises(ValueError):
        PrefixIndex(block=0)


def test_prefix_sends_a_shared_prefix_where_it_was_prefilled_and_others_to_the_least_loaded():
    policy = make_policy("prefix:slack=2")
    first = policy.route(req(SYSTEM + (1, 2, 3)), views(3, 0, 1), 0.0)
    assert (first.replica, first.reason) == (1, "least-load")
    again = policy.route(req(SYSTEM + (9, 9, 9)), views(0, 2, 0), 0.0)  # replica 1 holds the system prompt
    assert (again.replica, again.reason) == (1, "prefix")
    other = policy.route(req(tuple(range(500, 564))), views(0, 2, 0), 0.0)
    assert (other.replica, other.reason) == (0, "least-load")
    busy = policy.route(req(SYSTEM), views(0, 3, 1), 0.0)  # its home is 3 above the least loaded
    assert (busy.replica, busy.reason) == (0, "least-load")
    # now replicas 0 and 1 both hold SYSTEM: the longer match wins, then the less loaded
    turn2 = SYSTEM + tuple(range(1, 17))
    policy.route(req(turn2), views(9, 0, 9), 0.0)  # -> 1 (prefix, lighter), which now holds turn2's 5 blocks
    assert policy.route(req(turn2 + (7,)), views(0, 2, 0), 0.0).replica == 1
    assert policy.route(req(SYSTEM + (7,)), views(1, 0, 0), 0.0).replica == 1  # equal matches: less loaded


def test_prefix_forgets_a_dead_replica_and_learns_where_a_request_ended():
    policy = make_policy("prefix")
    assert policy.route(req(SYSTEM), views(0, 0), 0.0).reason == "least-load"  # -> 0
    assert policy.route(req(SYSTEM), views(0, 0), 0.0).reason == "prefix"
    d = policy.route(req(SYSTEM), views(0, 0, dead=(0,)), 0.0)
    assert (d.replica, d.reason) == (1, "least-load")  # 0 is dead: forgotten
    d = policy.route(req(SYSTEM), views(0, 0), 0.0)  # 0 is back, empty; 1 holds it now
    assert (d.replica, d.reason) == (1, "prefix")
    policy.observe(Outcome(req(tuple(range(300, 332))), 1, 4, 1.0))  # a retry ended it on 1
    assert policy.route(req(tuple(range(300, 340))), views(0, 0), 0.0).replica == 1
    policy.observe(Outcome(req(tuple(range(400, 432))), 1, 0, 1.0, error="replica_died"))
    assert policy.route(req(tuple(range(400, 432))), views(0, 1), 0.0).reason == "least-load"
    assert policy.route(req(()), views(1, 0), 0.0).reason == "least-load"  # no token ids


def test_prefix_min_tokens_sets_how_long_a_match_must_be():
    policy = make_policy("prefix:min_tokens=64")
    policy.route(req(SYSTEM[:48]), views(1, 0), 0.0)  # -> 1, which holds 48 tokens
    assert policy.route(req(SYSTEM[:48] + (1,) * 20), views(0, 0), 0.0).reason == "least-load"
    policy.route(req(SYSTEM), views(1, 0), 0.0)
    assert policy.route(req(SYSTEM + (5,)), views(0, 1), 0.0).reason == "prefix"


def test_war_at_high_load_follows_the_cached_prefix_before_the_session():
    war = WAR(busy=0.5, slack=2)
    quiet = war.route(req(SYSTEM, session="a"), views(0, 1, 0), 0.0)  # low load: least-loaded, remembered
    assert (quiet.replica, quiet.speculate, quiet.reason) == (0, True, "low-load")
    busy = views(7, 6, 6)
    busy[2].sessions = frozenset({"a"})
    d = war.route(req(SYSTEM + (1, 2), session="a"), busy, 0.0)  # 0 holds its prefix, 1 above the least
    assert (d.replica, d.speculate, d.reason) == (0, True, "prefix")
    d = war.route(req(tuple(range(900, 932)), session="a"), busy, 0.0)  # no prefix anywhere: its session
    assert (d.replica, d.speculate, d.reason) == (2, True, "session")
    d = war.route(req(tuple(range(700, 732))), busy, 0.0)
    assert (d.replica, d.speculate, d.reason) == (1, False, "plain")
    busy[0].running = 9  # 3 above the least loaded: past the slack
    assert war.route(req(SYSTEM + (1, 2)), busy, 0.0).reason == "plain"


@pytest.mark.parametrize("text, words", [
    ("prefix:slack=-1", "slack must be an integer >= 0"), ("prefix:min_tokens=x", "min_tokens must be"),
    ("prefix:k=1", "prefix takes min_tokens=N and slack=N"), ("war:min_tokens=x", "min_tokens integers"),
    ("war:min_tokens=-3", "must be >= 0"),
])
def test_bad_prefix_options_are_refused_in_one_line(text, words):
    with pytest.raises(ConfigError) as err:
        make_policy(text)
    assert words in str(err.value) and "\n" not in str(err.value)
