"""Scale-out: replicas of the engine, the router in front of them, scheduling policies, a simulator.

    policy.py      the contract every routing/scheduling policy keeps (real router and simulator alike)
    policies/      one small file per policy (least-load, sticky, WAR, OUTLETS, BALANCE, TailSieve)
    length.py      OUTLETS' output-length model (least squares, weights in outlets_length.json)
    replica.py     a Ray actor holding one engine (EngineWorker) and its metrics
    router.py      picks a replica per request through a policy; retries a dead replica's requests once
    info.py        what a policy knows of a request: session, X-Rollout-Group, X-Workload, features
    moves.py       moving a request to another replica while it runs (continued from its committed tokens)
    life.py        replicas' life: death noticed, a new actor in a dead replica's slot (--replica-restarts)
    queues.py      each replica's slots and its queue at the router, ordered by the policy's priority
    metrics.py     /metrics of the cluster: each replica's series, their sums, the router's own
    backend.py     `outrider serve --replicas N`: starts/joins Ray, the actors, one HTTP front end
    sim/           `outrider simulate`: a discrete-event replay against replicas with measured costs

Ray is an optional extra (`pip install 'outrider[cluster]'`); nothing here imports it at module
level, so the policies and the simulator run without it.
"""
