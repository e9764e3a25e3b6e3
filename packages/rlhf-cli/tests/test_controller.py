"""The RL controller's own logic, with its workers replaced by plain objects: refilling filtered groups,
keeping accepted ones when the data runs out, stopping on repeated non-finite steps, resumable state."""

import pytest
from rlhf_cli.rl.controller import Groups, RLController, RLRunError
from rlhf_cli.rl.prompts import Prompt, PromptStream
from rlhf_core.config import RLConfig
from rlhf_core.types import Trajectory


def config(**rollout) -> RLConfig:
    cfg = RLConfig()
    cfg.algo.advantage.estimator = "group_norm"
    cfg.rollout.n_samples_per_prompt = 2
    cfg.rollout.batch_size = 3
    cfg.algo.dynamic_filtering_enable = True
    for k, v in rollout.items():
        setattr(cfg.rollout, k, v)
    return cfg


def controller(cfg, num_prompts: int) -> RLController:
    prompts = [Prompt(i, [1, 2], f"p{i}", label=i) for i in range(num_prompts)]
    return RLController(cfg, Groups(actor=None, rollout=[]), PromptStream(prompts, seed=0), pad_token_id=0)


def fake_generate(pass_uids):
    """Every sample of a prompt in ``pass_uids`` scores 0.5 (kept by the (0, 1) filter); others 1.0 (dropped)."""
    calls = []

    def generate(prompts, step, eval_mode=False):
        calls.append([p.uid for p in prompts])
        trajs = [Trajectory([1], [3], [1], [0.0], prompt_uid=p.uid, sample_index=i,
                            reward=0.5 if p.uid in pass_uids else 1.0) for p in prompts for i in range(2)]
        return trajs, {}

    return generate, calls


def test_filtered_groups_are_refilled_until_the_batch_is_full():
    ctl = controller(config(), num_prompts=10)
    ctl.generate, calls = fake_generate(pass_uids=set(range(10)) - {0, 1, 2, 3, 4})
    # the seeded order decides which prompts come first; whatever it is, the batch fills with kept groups
    batch = ctl.collect(step=1)
    kept = {t.prompt_uid for t in batch.trajectories}
    assert len(kept) == 3 and kept.isdisjoint({0, 1, 2, 3, 4})
    assert sum(len(c) for c in calls) == batch.prompts_used and len(calls) >= 1
    assert batch.rollout_metrics["dynamic_filtering_pass_rate"] == pytest.approx(3 / batch.prompts_used)


def test_accepted_groups_survive_when_the_data_runs_out():
    ctl = controller(config(), num_prompts=4)
    ctl.generate, _ = fake_generate(pass_uids={2})
    batch = ctl.collect(step=1)
    assert {t.prompt_uid for t in batch.trajectories} == {2}  # one accepted group, not dropped
    assert ctl.stream.exhausted
    assert ctl.collect(step=2) is None


def test_repeated_nonfinite_steps_stop_the_run():
    cfg = config()
    cfg.train.max_nonfinite_steps = 2
    ctl = controller(cfg, 4)

    class Group:
        def __init__(self, skipped):
            self.skipped = skipped

        def train_policy_step(self, mbs, arg):
            return {"skipped": float(self.skipped.pop(0))}

    group = Group([1, 0, 1, 1])
    ctl._train_call(group, "train_policy_step", [], None, "policy")  # one skipped step is counted, not fatal
    ctl._train_call(group, "train_policy_step", [], None, "policy")  # a good step resets the count
    ctl._train_call(group, "train_policy_step", [], None, "policy")
    with pytest.raises(RLRunError, match="2 policy steps in a row had a non-finite loss"):
        ctl._train_call(group, "train_policy_step", [], None, "policy")


def test_client_state_round_trip():
    cfg = config()
    cfg.algo.kl.target = 0.1
    ctl = controller(cfg, 10)
    ctl.generate, _ = fake_generate(pass_uids=set(range(10)))
    batch = ctl.collect(step=1)
    ctl.step, ctl.best_metric, ctl.policy_version = 1, 0.7, 1
    ctl.kl_ctl.update(0.5, 64)
    state = ctl.client_state(batch)
    other = controller(cfg, 10)
    other.load_client_state(state)
    assert (other.step, other.best_metric, other.policy_version) == (1, 0.7, 1)
    assert other.kl_ctl.value == ctl.kl_ctl.value != cfg.algo.kl.init_coef
    assert [p.uid for p in other.stream.take(4)] == [p.uid for p in ctl.stream.take(4)]
