"""The four seed policies (WAR, OUTLETS, BALANCE, TailSieve) decide on hand-made replica views."""

from __future__ import annotations

import random

import pytest

from outrider.cluster.length import DEFAULT_PATH, LengthModel
from outrider.cluster.policies import make_policy
from outrider.cluster.policies.balance import BALANCE
from outrider.cluster.policies.outlets import OUTLETS
from outrider.cluster.policies.tailsieve import TailSieve
from outrider.cluster.policies.war import WAR
from outrider.cluster.policy import Decision, Outcome, ReplicaView, RequestInfo
from outrider.errors import ConfigError


def req(id="r", prompt=10, max_tokens=100, arrived=0.0, **kw) -> RequestInfo:
    return RequestInfo(id, prompt, max_tokens, arrived, **kw)


def views(*loads, max_running=8, **kw) -> list[ReplicaView]:
    return [ReplicaView(i, running=load, max_running=max_running, **kw) for i, load in enumerate(loads)]


# ---- OUTLETS ----------------------------------------------------------------------------------

def length_model() -> LengthModel:
    """Predicts output tokens = prompt tokens (log1p(out) = log1p(prompt)), whatever the workload."""
    return LengthModel(("a",), (0.0, 1.0, 0.0, 0.0, 0.0))


def test_outlets_orders_the_short_predicted_job_first():
    policy = OUTLETS(model=length_model(), aging=0.0)
    short, long = req("s", prompt=20), req("l", prompt=400)
    assert policy.model.predict(short) == pytest.approx(20)
    assert policy.priority(short, 0.0) < policy.priority(long, 0.0)
    assert policy.priority(short, 1000.0) < policy.priority(long, 1000.0)  # no aging: the long one waits forever


def test_outlets_aging_lets_an_old_long_job_go_first():
    policy = OUTLETS(model=length_model(), aging=10.0)
    long, short = req("l", prompt=400, max_tokens=1000, arrived=0.0), req("s", prompt=20, arrived=50.0)
    assert policy.priority(short, 50.0) < policy.priority(long, 30.0 + 0.0)  # early on: short first
    assert policy.priority(long, 50.0) < policy.priority(short, 50.0)  # waited 50 s x 10: 400 - 500 < 20


def test_outlets_routes_least_load_and_learns_a_prompts_lengths():
    policy = OUTLETS(model=length_model(), aging=0.0)
    d = policy.route(req(prompt=50), views(3, 1, 2), 0.0)
    assert d.replica == 1 and d.reason == "shortest-predicted"
    r = req(prompt=50, prompt_ids=(1, 2, 3))
    before = policy.predicted(r)
    for _ in range(3):
        policy.observe(Outcome(r, 0, 3, 1.0))
    assert policy.predicted(r) < before / 4  # pulled toward the 3 tokens it gave


def test_outlets_shipped_model_loads_and_predicts_within_max_tokens():
    policy = make_policy("outlets")
    assert policy.model.workloads and DEFAULT_PATH.exists()
    for workload in (*policy.model.workloads, None, "unknown"):
        p = policy.model.predict(req(prompt=120, max_tokens=64, workload=workload))
        assert 1.0 <= p <= 64


def test_length_model_fit_recovers_a_linear_law():
    rng = random.Random(0)
    records = [{"prompt_tokens": p, "workload": w, "output_tokens": int(p * (2 if w == "x" else 0.5))}
               for p in (rng.randint(20, 400) for _ in range(60)) for w in ("x", "y")]
    model = LengthModel.fit(records)
    assert model.predict(req(prompt=200, max_tokens=1000, workload="x")) > 3 * model.predict(
        req(prompt=200, max_tokens=1000, workload="y"))


# ---- WAR --------------------------------------------------------------------------------------

def test_war_speculates_everywhere_at_low_load():
    d = WAR(busy=0.5).route(req(session="s"), views(1, 0, 2), 0.0)
    assert (d.replica, d.speculate, d.reason) == (1, True, "low-load")


def test_war_at_high_load_sends_a_session_home_and_the_rest_plain():
    replicas = views(7, 6, 8)
    replicas[2].sessions = frozenset({"s"})
    war = WAR(busy=0.5, slack=2)
    home = war.route(req(session="s"), replicas, 0.0)
    assert (home.replica, home.speculate, home.reason) == (2, True, "session")
    other = war.route(req(session="t"), replicas, 0.0)
    assert (other.replica, other.speculate, other.reason) == (1, False, "plain")
    replicas[2].running = 16  # the home is now far busier than the least-loaded replica
    assert war.route(req(session="s"), replicas, 0.0).reason == "plain"


# ---- BALANCE ----------------------------------------------------------------------------------

def test_balance_speculates_where_memory_allows_else_decodes_plainly():
    policy = BALANCE(tree=8, draft_kv=0.5)
    r = req(prompt=100, max_tokens=100)  # plain 201 rows, speculating 308
    roomy = [ReplicaView(0, kv_rows_total=1000, kv_rows_used=0), ReplicaView(1, kv_rows_total=1000, kv_rows_used=900)]
    d = policy.route(r, roomy, 0.0)
    assert (d.replica, d.speculate) == (0, True)
    tight = [ReplicaView(0, kv_rows_total=1000, kv_rows_used=750), ReplicaView(1, kv_rows_total=1000, kv_rows_used=900)]
    d = policy.route(r, tight, 0.0)
    assert (d.replica, d.speculate, d.reason) == (0, False, "plain-memory")


def test_balance_never_exceeds_a_replicas_rows_when_one_has_room():
    rng = random.Random(1)
    policy = BALANCE(tree=8, draft_kv=0.5, batch=6)
    for trial in range(500):
        replicas = [ReplicaView(i, running=rng.randint(0, 8), queued=rng.randint(0, 3), max_running=8,
                                kv_rows_total=2000, kv_rows_used=rng.randint(0, 2000), speculative=rng.random() < 0.8)
                    for i in range(rng.randint(1, 5))]
        r = req(prompt=rng.randint(1, 600), max_tokens=rng.randint(1, 600))
        d = policy.route(r, replicas, 0.0)
        chosen = replicas[d.replica]
        if any(v.kv_free >= policy.rows(r, False) for v in replicas):
            assert policy.rows(r, bool(d.speculate)) <= chosen.kv_free, (trial, d)
        if d.speculate:
            assert chosen.speculative and chosen.running < 6


# ---- TailSieve --------------------------------------------------------------------------------

def test_tailsieve_moves_the_late_members_of_a_group_to_the_low_latency_set():
    replicas = views(2, 2, 0, max_running=4)
    replicas[0].speculative = replicas[1].speculative = False  # bulk; replica 2 is the low-latency one
    policy = TailSieve(tail=0.5)
    group = [req(f"g{i}", group="g") for i in range(4)]
    assert {policy.route(r, replicas, 0.0).replica for r in group} <= {0, 1}
    running = [(r, i % 2, 10.0) for i, r in enumerate(group)]
    assert policy.moves(running, replicas, 1.0) == []  # nobody finished: no tail yet
    policy.observe(Outcome(group[0], 0, 5, 1.0))
    assert policy.moves(running[1:], replicas, 1.0) == []  # 1 of 4 is under half
    policy.observe(Outcome(group[1], 1, 7, 2.0))
    moved = policy.moves(running[2:], replicas, 2.0)
    assert [m[0] for m in moved] == ["g2", "g3"]
    assert all(d.replica == 2 and d.speculate and d.reason == "tail" for _, d in moved)
    assert policy.moves([(group[2], 2, 10.0)], replicas, 2.0) == []  # already on the fast replica


def test_tailsieve_moves_no_more_than_the_fast_replicas_have_slots():
    replicas = views(0, 3, max_running=4)
    replicas[0].speculative = False
    policy = TailSieve(tail=0.5)
    group = [req(f"g{i}", group="g") for i in range(6)]
    for r in group:
        policy.route(r, replicas, 0.0)
    for r in group[:3]:
        policy.observe(Outcome(r, 0, 1, 1.0))
    assert len(policy.moves([(r, 0, 1.0) for r in group[3:]], replicas, 1.0)) == 1


# ---- options ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text, words", [
    ("war:busy=x", "busy takes"), ("war:nope=1", "unknown option 'nope'"),
    ("outlets:aging=-1", ">= 0"), ("outlets:model=/nonexistent.json", "cannot read"),
    ("balance:tree=1.5", "integers"), ("tailsieve:tail=0", "(0, 1]"), ("tailsieve:x=1", "unknown option"),
])
def test_bad_options_are_refused_in_one_line(text, words):
    with pytest.raises(ConfigError) as err:
        make_policy(text)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_every_seed_policy_is_made_by_name():
    for name, cls in (("war", WAR), ("outlets", OUTLETS), ("balance", BALANCE), ("tailsieve", TailSieve)):
        policy = make_policy(name)
        assert isinstance(policy, cls) and policy.name == name
        d = policy.route(req(), views(0, 0), 0.0)
        assert isinstance(d, Decision) and d.replica in (0, 1)
