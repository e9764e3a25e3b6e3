"""What the agent layer costs: RolloutWorker episodes versus calling the HF engine directly, in one run.

- single-turn: B prompts, one sample each, ``max_new_tokens`` tokens (EOS ignored, so lengths are fixed);
  peer = one batched ``HFEngine.generate`` call over the same requests.
- multi-turn: the same, three turns with a fixed feedback between them; peer = three batched
  ``generate`` rounds, extending every prompt by hand.

Both sides use the same engine object, model and seeds; the ratio is worker time / peer time (1.0 = no
overhead). Run: ``.venv/bin/python packages/rlhf-agents/bench/rollout_overhead.py [--batch 64]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from rlhf_agents import AgentInstanceBase, MultiTurnAgentExecutor, RolloutWorker, SingleTurnAgentExecutor
from rlhf_agents.rewards import PythonFileRewardSource
from rlhf_core.config import RLConfig
from rlhf_core.rollout.async_engine import AsyncEngine
from rlhf_core.rollout.hf_engine import HFEngine
from rlhf_core.testing.tiny import make_tiny_llama
from rlhf_core.types import GenerationRequest, SamplingParams, derive_seed

FEEDBACK = " w50 w51 w52 w53"
TURNS = 3


class ThreeTurns(AgentInstanceBase):
    def __init__(self):
        self.turn = 0

    async def step(self, states, **kwargs):
        self.turn += 1
        return {"rewards": 0.0, "environment_feedback": FEEDBACK, "done": self.turn == TURNS}


def median_times(a, b, repeats: int) -> tuple[float, float]:
    """Median wall time of ``a`` and of ``b``, run alternately so that machine load hits both alike."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((a, times[0]), (b, times[1])):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max_new_tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=64)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp())
    model_dir = make_tiny_llama(tmp / "model", hidden_size=args.hidden, intermediate_size=2 * args.hidden)
    engine = HFEngine(model_dir, dtype="float32")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reward = tmp / "reward.py"
    reward.write_text("def reward_func(q, p, l):\n    return [0.0] * len(q)\n")
    cfg = RLConfig()
    cfg.data.max_len = 512
    cfg.train.seed = 1
    prompts = [{"prompt_text": f"w{i % 40} w{(i * 7) % 40} w3", "prompt_uid": i} for i in range(args.batch)]
    prompt_ids = [tokenizer.encode(p["prompt_text"], add_special_tokens=False) for p in prompts]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    feedback_ids = tokenizer.encode(FEEDBACK, add_special_tokens=False)

    def seeded(uid: int, turn: int | None = None) -> SamplingParams:
        seed = derive_seed(cfg.train.seed, 0, uid, 0)
        return SamplingParams(
            max_new_tokens=args.max_new_tokens,
            ignore_eos=True,
            seed=seed if turn is None else derive_seed(seed, "turn", turn),
        )

    def raw_single():
        engine.generate([GenerationRequest(ids, seeded(i)) for i, ids in enumerate(prompt_ids)])

    def raw_multi():
        contexts = [list(ids) for ids in prompt_ids]
        for turn in range(TURNS):
            outs = engine.generate([GenerationRequest(c, seeded(i, turn)) for i, c in enumerate(contexts)])
            contexts = [
                c + o[0].token_ids + (feedback_ids if turn < TURNS - 1 else [])
                for c, o in zip(contexts, outs)
            ]

    single = RolloutWorker(
        AsyncEngine(engine), tokenizer, SingleTurnAgentExecutor(), PythonFileRewardSource(str(reward)), cfg
    )
    multi = RolloutWorker(AsyncEngine(engine), tokenizer, MultiTurnAgentExecutor(ThreeTurns), None, cfg)
    rows = []
    for name, peer, worker, turns in (
        ("single-turn", raw_single, single, 1),
        ("multi-turn (3 turns)", raw_multi, multi, TURNS),
    ):
        tokens = args.batch * args.max_new_tokens * turns
        assert (
            sum(sum(t.action_mask) for t in worker.rollout(prompts, params, step=0)) == tokens
        )  # and warm up
        peer()
        t_peer, t_worker = median_times(
            peer, lambda w=worker: w.rollout(prompts, params, step=0), args.repeats
        )
        rows.append((name, tokens / t_peer, tokens / t_worker, t_worker / t_peer))
    single.close()
    multi.close()
    print(
        f"batch {args.batch}, {args.max_new_tokens} new tokens per turn, tiny Llama hidden {args.hidden}, CPU"
    )
    print("| episode | engine direct (tok/s) | RolloutWorker (tok/s) | worker / direct time |")
    print("| --- | --- | --- | --- |")
    for name, direct, worker, ratio in rows:
        print(f"| {name} | {direct:.0f} | {worker:.0f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
