"""A worker-group loop on Ray actors, as verl drives its worker groups: N ranks, each a pair
of Ray actors on one placement-group bundle (trainer rank r, and engine rank r of one
tensor-parallel engine of colo's), the driver holding only the scheduler, a ledger and a
trace per rank. The loop's rollout and its training step are calls on the worker group;
colo hands the devices over between them on every rank at once, verifying each rank's shard
after every sync (digest) and the TP engine's logits against the trainer's (probe).

    python examples/ray_workers.py [--ranks 2] [--steps 6] [--address RAY_ADDRESS]

Without --address a local Ray cluster of the run's own is started and ended (on the CPU:
gloo groups, simulated devices). The workers are colo demo's N-rank ones
(``colo demo --gpus N --launcher ray``), driven here by a loop of your own.
"""

import argparse
import time

import anyio

import colo
from colo.apps.demo_multi import MultiDemoRun
from colo.apps.demo_setup import DemoConfig


async def main(ranks: int, steps: int, address: str | None, trace: str) -> list[float]:
    cfg = DemoConfig(gpus=ranks, launcher="ray", address=address, steps=steps, trace=trace, batch=16,
                     new_tokens=16)
    group = MultiDemoRun(cfg, ranks)
    rewards = []
    try:
        t0 = time.monotonic()
        await group.start()  # the rank actors, their process groups, the engine ranks
        print(f"{ranks} rank actors up in {time.monotonic() - t0:.0f} s", flush=True)
        async with group.sched as sched:
            await sched.to_rollout()
            for step in range(steps):
                # the worker group's rollout: every engine rank at once (one TP engine)
                rollout = (await sched.engines.each("generate", step))[0]
                rewards.append(rollout.reward)
                await sched.to_train(reward=rollout.reward, tokens=rollout.tokens)
                # the worker group's step: every trainer rank takes its rows of the batch
                await sched.trainers.each("train_step", rollout)
                await sched.to_rollout()  # offload, wake, sync rank by rank, verify, KV back
                print(f"step {step}: reward {rollout.reward:.3f} (chance 0.125), every engine rank at weight "
                      f"version {sched.engine_version}", flush=True)
    finally:
        await group.close()  # the actors, the placement group, a local cluster of the run's own
    traces = [trace.replace(".jsonl", f".rank{r}.jsonl") for r in range(ranks)]
    print(f"traces {', '.join(traces)} replay clean together: {colo.replay(traces).valid}")
    return rewards


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--address", default=None)
    ap.add_argument("--trace", default="traces/ray-workers.jsonl")
    a = ap.parse_args()
    anyio.run(main, a.ranks, a.steps, a.address, a.trace)
