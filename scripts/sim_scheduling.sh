#!/usr/bin/env bash
# The simulated figures of docs/scheduling.md: the sweeps at 8, 64 and 512 replicas (and their
# plots), then each seed policy against its baseline at 64 replicas, workload seeds 0, 1, 2.
#     bash scripts/sim_scheduling.sh OUT_DIR        # a few minutes on one core
set -euo pipefail
O=${1:?usage: sim_scheduling.sh OUT_DIR}
mkdir -p "$O"
S=".venv/bin/outrider simulate --profile docs/scheduling-profile.json --records docs/scheduling-records.json"
$S --workload chat:load=0.9 --replicas 8,64,512 --policy least-load --policy always-spec --policy never-spec \
   --policy war --policy outlets --policy balance --json "$O/chat.json" --plot "$O/scheduling-chat.png"
$S --workload rollout --replicas 8,64,512 --policy least-load --policy tailsieve --policy tailsieve:tail=0.75 \
   --json "$O/rollout.json" --plot "$O/scheduling-rollout.png"
for s in 0 1 2; do
  $S --workload chat:load=1.0,seed=$s --replicas 64 --policy least-load --policy outlets --json "$O/outlets10-$s.json"
  $S --workload chat:load=1.5,seed=$s --replicas 64 --policy least-load --policy outlets --policy outlets:aging=0 \
     --policy outlets:history=0 --json "$O/outlets15-$s.json"
  $S --workload sessions:load=1.2,seed=$s --replicas 64 --policy always-spec --policy never-spec --policy war \
     --json "$O/war-$s.json"
  $S --workload memory:seed=$s --replicas 64 --policy least-load --policy never-spec --policy balance:draft_kv=0.5 \
     --json "$O/balance-$s.json"
  $S --workload rollout:seed=$s --replicas 64 --policy least-load --policy tailsieve --json "$O/tailsieve-$s.json"
done
