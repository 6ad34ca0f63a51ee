"""`outrider simulate`: a discrete-event replay of a workload against N replicas with measured costs.

    costs.py      a replica's step cost by batch size and tree width, and prefill cost (a JSON profile)
    measure.py    measure that profile with the real engine on this machine
    workload.py   simulated requests and replicas; recorded load-test runs replayed as they ran
    synth.py      heavy-tailed synthetic workloads resampled from a rollout bench's requests
    replica.py    one replica: the engine loop's continuous batching at the level of step costs
    engine.py     the event loop: arrivals and step ends, the policy routing, ordering and moving
    baseline.py   reference policies (least-load FCFS, always / never speculate)
    report.py     a run's figures (throughput, latency percentiles, makespan) and the sweep plots
    cli.py        the sub-command

The policies are the real ones (cluster/policies/): the simulator hands them the same records
(policy.py) the Ray router does.
"""
