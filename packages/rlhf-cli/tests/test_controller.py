"""The RL controller's own logic, with its workers replaced by plain objects: refilling filtered groups,
keeping accepted ones when the data runs out, stopping on repeated non-finite steps, resumable state,
micro-batches (fixed or token-budget) that keep each row with its own results."""

import time
from types import SimpleNamespace

import pytest
import torch

from rlhf_cli.rl.controller import Batch, Groups, RLController, RLRunError
from rlhf_cli.rl.prompts import Prompt, PromptStream
from rlhf_core import handles
from rlhf_core.config import RLConfig
from rlhf_core.handles import done
from rlhf_core.types import Trajectory, derive_seed


def config(**rollout) -> RLConfig:
    cfg = RLConfig()
    cfg.algo.advantage.estimator = "group_norm"
    cfg.rollout.n_samples_per_prompt = 2
    cfg.rollout.batch_size = 3
    cfg.algo.dynamic_filtering_enable = True
    for k, v in rollout.items():
        setattr(cfg.rollout, k, v)
    return cfg


def controller(cfg, num_prompts: int, groups: Groups | None = None) -> RLController:
    prompts = [Prompt(i, [1, 2], f"p{i}", label=i) for i in range(num_prompts)]
    return RLController(
        cfg, groups or Groups(actor=None, rollout=[]), PromptStream(prompts, seed=0), pad_token_id=0
    )


def fake_generate(pass_uids):
    """Every sample of a prompt in ``pass_uids`` scores 0.5 (kept by the (0, 1) filter); others 1.0 (dropped)."""
    calls = []

    def generate(prompts, step, eval_mode=False):
        calls.append([p.uid for p in prompts])
        trajs = [
            Trajectory(
                [1],
                [3],
                [1],
                [0.0],
                prompt_uid=p.uid,
                sample_index=i,
                reward=0.5 if p.uid in pass_uids else 1.0,
            )
            for p in prompts
            for i in range(2)
        ]
        return trajs, {}

    return generate, calls


def test_filtered_groups_are_refilled_until_the_batch_is_full():
    ctl = controller(config(), num_prompts=10)
    ctl.rollout.generate, calls = fake_generate(pass_uids=set(range(10)) - {0, 1, 2, 3, 4})
    # the seeded order decides which prompts come first; whatever it is, the batch fills with kept groups
    batch = ctl.rollout.collect(step=1)
    kept = {t.prompt_uid for t in batch.trajectories}
    assert len(kept) == 3 and kept.isdisjoint({0, 1, 2, 3, 4})
    assert sum(len(c) for c in calls) == batch.prompts_used and len(calls) >= 1
    assert batch.rollout_metrics["dynamic_filtering_pass_rate"] == pytest.approx(3 / batch.prompts_used)


def test_accepted_groups_survive_when_the_data_runs_out():
    ctl = controller(config(), num_prompts=4)
    ctl.rollout.generate, _ = fake_generate(pass_uids={2})
    batch = ctl.rollout.collect(step=1)
    assert {t.prompt_uid for t in batch.trajectories} == {2}  # one accepted group, not dropped
    assert ctl.stream.exhausted
    assert ctl.rollout.collect(step=2) is None


def test_repeated_nonfinite_steps_stop_the_run():
    cfg = config()
    cfg.train.max_nonfinite_steps = 2
    ctl = controller(cfg, 4)

    class Learner:
        def __init__(self, skipped):
            self.skipped = skipped

        def forward_backward(self, mbs, loss, loss_cfg):
            return {}

        def optim_step(self):
            return {"skipped": float(self.skipped.pop(0))}

    learner = Learner([1, 0, 1, 1])
    ctl.policy.train_step(learner, [], "policy", None, "policy")  # one skipped step is counted, not fatal
    ctl.policy.train_step(learner, [], "policy", None, "policy")  # a good step resets the count
    ctl.policy.train_step(learner, [], "policy", None, "policy")
    with pytest.raises(RLRunError, match="2 policy steps in a row had a non-finite loss"):
        ctl.policy.train_step(learner, [], "policy", None, "policy")


def test_client_state_round_trip():
    """The state a checkpoint holds loads back, also as written before the controller was split into parts
    (its waiting groups and batches pickled as classes of ``rlhf_cli.rl.controller``)."""
    import copy
    import pickle

    cfg = config(vllm_generate_batch_size=5)
    cfg.algo.kl.target = 0.1
    ctl = controller(cfg, 10)
    ctl.rollout.generate, _ = fake_generate(pass_uids=set(range(10)))
    ctl.rollout.collect(step=1)  # 5 groups generated, 3 trained: 2 wait
    ctl.schedule.ready = [Batch(ctl.rollout.waiting[0].trajectories, prompts_used=5)]
    ctl.step, ctl.evaluation.best_metric, ctl.sync.policy_version = 1, 0.7, 1
    ctl.kl_ctl.update(0.5, 64)
    state = ctl.client_state()
    before_split = pickle.dumps(state, protocol=0).replace(
        b"rlhf_cli.rl.rollout\n", b"rlhf_cli.rl.controller\n"
    )
    assert (
        b"rlhf_cli.rl.controller\nWaitingGroup" in before_split
        and b"rlhf_cli.rl.controller\nBatch" in before_split
    )
    upcoming = [p.uid for p in copy.deepcopy(ctl.stream).take(4)]
    for saved in (state, pickle.loads(before_split)):
        other = controller(cfg, 10)
        other.load_client_state(saved)
        assert (other.step, other.evaluation.best_metric, other.sync.policy_version) == (1, 0.7, 1)
        assert other.kl_ctl.value == ctl.kl_ctl.value != cfg.algo.kl.init_coef
        assert len(other.rollout.waiting) == 2 and other.rollout.waiting == ctl.rollout.waiting
        assert other.schedule.ready == ctl.schedule.ready
        assert [p.uid for p in other.stream.take(4)] == upcoming


class FakeRank:
    """Stands in for a training rank (called through ``rlhf_core.handles.local``, as a single-process run
    calls its rank). Its "log-prob" of a response token is ``-token / 100``, so every result says which row
    it belongs to."""

    def __init__(self):
        self.passes: list[list[int]] = []  # first prompt token of each row, per forward pass
        self.trained: list = []

    def forward(self, batches, temperature, head, teacher, loss_cfg):
        if head == "values":
            return [torch.zeros(len(b), b.num_response_positions) for b in batches]
        self.passes += [b.input_ids[:, 0].tolist() for b in batches]
        return [token_logprobs(b) for b in batches]

    def forward_backward(self, micro_batches, loss, loss_cfg, counts):
        self.trained.append(micro_batches)
        return self.optim_step()

    def optim_step(self):
        from rlhf_train_deepspeed.strategy import StepResult

        return StepResult(0.0, False, 1.0, 0.0, {})


def rank_group(ranks: list[FakeRank]):
    from rlhf_train_deepspeed.group import WorkerGroup

    return WorkerGroup([handles.local(r) for r in ranks], "actor", SimpleNamespace(kind="causal"))


def token_logprobs(b) -> torch.Tensor:
    out = torch.zeros(len(b), b.num_response_positions)
    for i, (pl, rl) in enumerate(zip(b.prompt_lens.tolist(), b.response_lens.tolist())):
        out[i, :rl] = -b.input_ids[i, pl : pl + rl].float() / 100
    return out


@pytest.mark.parametrize("dynamic", [False, True])
def test_micro_batches_keep_each_row_with_its_own_results(dynamic):
    ranks = [FakeRank(), FakeRank()]
    cfg = config()
    cfg.rollout.micro_batch_size = 2
    cfg.train.batch_size, cfg.train.micro_batch_size = 8, 2
    cfg.train.dynamic_batch_enable, cfg.train.max_tokens_per_gpu = dynamic, 12 if dynamic else None
    cfg.train.max_epochs = 2  # off-policy after the first epoch: the old log-probs are computed
    # row i: prompt [i + 1, ...], responses of 1 to 9 tokens (ids 10i + t); the 4th token of row 3 is feedback
    shapes = [(2, 2), (3, 9), (2, 1), (4, 6), (1, 2), (2, 9), (3, 1), (1, 2)]
    trajs = []
    for i, (p, r) in enumerate(shapes):
        response = [10 * i + t for t in range(r)]
        mask = [0 if (i, t) == (3, 3) else 1 for t in range(r)]
        trajs.append(
            Trajectory(
                [i + 1] * p,
                response,
                mask,
                [-x / 100 * m for x, m in zip(response, mask)],
                prompt_uid=i // 2,
                sample_index=i % 2,
                reward=float(i % 3),
            )
        )
    ctl = controller(cfg, 4, Groups(actor=rank_group(ranks), rollout=[]))
    exp = ctl.experience.make(trajs, kl_coef=0.0)

    seen = ranks[0].passes + ranks[1].passes
    assert sorted(x for rows in seen for x in rows) == list(range(1, 9))  # every row in one forward pass
    assert len(ranks[0].passes) == len(ranks[1].passes)
    if dynamic:  # grouped by length, not in row order, and within the budget (rows x longest row)
        assert [x for rows in seen for x in rows] != list(range(1, 9))
        assert len({len(rows) for rows in seen}) > 1
        assert all(len(rows) * max(sum(shapes[x - 1]) for x in rows) <= 12 for rows in seen)
    want = torch.zeros(8, 9)
    for i, t in enumerate(trajs):
        want[i, : len(t.response_ids)] = torch.tensor(t.rollout_logprobs)
    torch.testing.assert_close(exp.old_logprobs, want, atol=0, rtol=0)
    assert exp.info["policy/rollout_train_logprob_gap"] == 0.0

    ctl.policy.train(exp, step=1, kl_coef=0.0)
    steps = [rank.trained for rank in ranks]
    assert len(steps[0]) == len(steps[1]) == 2 and len(steps[0][0]) == len(steps[1][0])  # a step per epoch
    rows_trained = []
    for mb in steps[0][0] + steps[1][0]:
        rows_trained += mb.seq.input_ids[:, 0].tolist()
        lp = token_logprobs(mb.seq) * mb.seq.response_mask()
        assert mb.old_logprobs.shape == mb.advantages.shape == lp.shape  # cropped to the micro-batch's width
        torch.testing.assert_close(mb.old_logprobs, lp, atol=0, rtol=0)  # each row's own old log-probs
        if dynamic:
            assert len(mb.seq) == 1 or mb.seq.input_ids.numel() <= 12
        else:
            assert len(mb.seq) == 2
    assert sorted(rows_trained) == list(range(1, 9))


def test_an_on_policy_step_skips_the_old_logprob_pass():
    """One epoch, one optimizer step, no KL in the reward: the old log-probs would equal the current ones, so
    no forward pass is made for them and the policy step receives None (it uses its own, detached)."""
    ranks = [FakeRank(), FakeRank()]
    cfg = config()
    cfg.rollout.micro_batch_size = 2
    cfg.train.batch_size, cfg.train.micro_batch_size = 8, 2
    trajs = [
        Trajectory(
            [i + 1] * 2,
            [10 * i, 10 * i + 1],
            [1, 1],
            [-0.1, -0.2],
            prompt_uid=i // 2,
            sample_index=i % 2,
            reward=float(i % 3),
        )
        for i in range(8)
    ]
    ctl = controller(cfg, 4, Groups(actor=rank_group(ranks), rollout=[]))
    exp = ctl.experience.make(trajs, kl_coef=0.0)
    assert ranks[0].passes == ranks[1].passes == [] and exp.old_logprobs is None
    assert "policy/rollout_train_logprob_gap" not in exp.info  # the policy step reports it instead
    ctl.policy.train(exp, step=1, kl_coef=0.0)
    assert all(mb.old_logprobs is None for rank in ranks for mb in rank.trained[0])

    cfg.train.max_epochs = 2  # the second epoch is off-policy: the pass is back
    ranks[0].passes.clear()
    exp = ctl.experience.make(trajs, kl_coef=0.0)
    assert len(ranks[0].passes) == 2 and exp.old_logprobs is not None


def test_a_ring_group_gets_one_budget_per_rank():
    """With ring attention of size 2 both ranks run the same micro-batches, each holding half of it: a
    micro-batch may hold two ranks' budgets (24 tokens here), and no more."""
    ranks = [FakeRank(), FakeRank()]
    cfg = config()
    cfg.ds.packing_samples = True
    cfg.train.batch_size = 8
    cfg.train.dynamic_batch_enable, cfg.train.max_tokens_per_gpu = True, 12
    lengths = [2 + 5] * 8  # prompt + response tokens of every row
    trajs = [
        Trajectory(
            [i + 1] * 2,
            [10 * i + t for t in range(5)],
            [1] * 5,
            [-0.1] * 5,
            prompt_uid=i // 2,
            sample_index=i % 2,
            reward=float(i % 3),
        )
        for i in range(8)
    ]
    actor = rank_group(ranks)
    actor.ring_size = 2
    ctl = controller(cfg, 4, Groups(actor=actor, rollout=[]))
    ctl.policy.train(ctl.experience.make(trajs, kl_coef=0.0), step=1, kl_coef=0.0)
    assert ranks[0].trained == ranks[1].trained  # one ring group: the same micro-batches on both ranks
    sizes = [int(mb.seq.attention_mask.sum()) for mb in ranks[0].trained[0]]
    assert sum(sizes) == sum(lengths) and max(sizes) == 21  # three 7-token rows fit 24, never four


@pytest.mark.parametrize("shared", [True, False])
def test_token_budgets_keep_a_prompts_samples_together(shared):
    """With --ds.shared_prefix each dynamic micro-batch holds the samples of one prompt (the rank runs that
    prompt once), for the policy's 2 ranks and the critic's 1 rank alike (the critic's own cut once dropped the
    prompts); without it rows are dealt to the ranks in turn, so a micro-batch mixes prompts."""
    ranks, critic = [FakeRank(), FakeRank()], FakeRank()
    cfg = config()
    cfg.ds.shared_prefix = shared
    cfg.rollout.n_samples_per_prompt = 4
    cfg.train.batch_size = 16
    # a prompt's rows have 5 to 8 tokens: its four fit the budget padded; longest first they would mix prompts
    cfg.train.dynamic_batch_enable, cfg.train.max_tokens_per_gpu = True, 32
    trajs = [
        Trajectory(
            [i // 4 + 1] * 2,
            [10 * i + t for t in range(3 + i % 4)],
            [1] * (3 + i % 4),
            [-0.1] * (3 + i % 4),
            prompt_uid=i // 4,
            sample_index=i % 4,
            reward=float(i % 3),
        )
        for i in range(16)
    ]
    ctl = controller(cfg, 4, Groups(actor=rank_group(ranks), rollout=[], critic=rank_group([critic])))
    ctl.policy.train(ctl.experience.make(trajs, kl_coef=0.0), step=1, kl_coef=0.0)
    for mbs in (ranks[0].trained[0] + ranks[1].trained[0], critic.trained[0]):
        assert sorted(x for mb in mbs for x in mb.seq.input_ids[:, 2].tolist()) == [10 * i for i in range(16)]
        prompts_per_mb = [len(set(mb.seq.input_ids[:, 0].tolist())) for mb in mbs]
        if shared:
            assert prompts_per_mb == [1, 1, 1, 1]
        else:
            assert max(prompts_per_mb) > 1


class FakeEngineActor:
    """A rollout actor whose engine takes ``ranks`` ranks of the broadcast group (0: it cannot join one)."""

    def __init__(self, ranks: int, calls: list):
        def remote(name, result=None):
            return lambda *a, **kw: calls.append((self, name, a, kw)) or done(result)

        self.weight_sync_ranks = remote("ranks", ranks)
        self.init_weight_sync = remote("join")
        self.receive_weights = remote("receive")
        self.update_weights = remote("update")


@pytest.mark.parametrize(
    "ranks,with_ray",
    [([2, 1], False), ([1, 0], False), ([1, 1], True)],
    ids=["tp2-and-hf", "one-engine-cannot-join", "sync-with-ray"],
)
def test_weight_sync_gives_each_engine_its_ranks(monkeypatch, ranks, with_ray):
    calls, sends = [], []
    engines = [FakeEngineActor(r, calls) for r in ranks]
    actor = SimpleNamespace(
        weight_sync_address=lambda: ("10.0.0.1", 29500),
        broadcast_weights_to_engines_async=lambda *a: sends.append(a),
        weights=lambda: {"w": torch.ones(1)},
    )
    cfg = config()
    cfg.vllm.sync_with_ray = with_ray
    ctl = controller(cfg, 4, Groups(actor=actor, rollout=engines))
    for _ in range(2):
        ctl.sync.to_engines()
    names = [(engines.index(e), name) for e, name, _, _ in calls]
    if with_ray or 0 in ranks:  # every engine gets the state dict through the object store, each sync
        assert sends == [] and [n for n in names if n[1] != "ranks"] == [(0, "update"), (1, "update")] * 2
        assert [n for n in names if n[1] == "ranks"] == ([] if with_ray else [(0, "ranks"), (1, "ranks")])
        return
    # the TP-2 engine takes ranks 1-2, the next one rank 3; the group is joined once, then reused
    joins = [kw for _, name, _, kw in calls if name == "join"]
    assert [(j["first_rank"], j["world_size"], j["backend"]) for j in joins] == [
        (1, 4, "gloo"),
        (3, 4, "gloo"),
    ]
    assert names.count((0, "receive")) == names.count((1, "receive")) == 2
    assert [s[:3] for s in sends] == [("10.0.0.1", 29500, 4)] * 2


class FakeRolloutActor:
    """A rollout actor (called through ``rlhf_core.handles.local``) that answers with one trajectory per row,
    or dies (Ray's ``ActorDiedError``)."""

    def __init__(self, dies: bool, calls: list):
        self.dies, self.calls = dies, calls

    def rollout(self, rows, sampling, step):
        import ray

        self.calls.append((self, "rollout", [r["prompt_uid"] for r in rows], step))
        if self.dies:
            raise ray.exceptions.ActorDiedError()
        return [Trajectory([1], [2], [1], [0.0], prompt_uid=r["prompt_uid"]) for r in rows], {}

    def ping(self):
        return True

    def update_weights(self, w):
        self.calls.append((self, "update", w))
        return 1


@pytest.mark.parametrize(
    "replacements_die,budget", [(0, 3), (5, 2), (0, 0)], ids=["replaced", "crash-loop", "off"]
)
def test_a_dead_engine_is_replaced_with_the_current_weights_and_its_prompts_rerun(
    monkeypatch, replacements_die, budget
):
    calls, started, made = [], [], []

    def new_engine(i):
        started.append(FakeRolloutActor(len(started) < replacements_die, calls))
        made.append(handles.local(started[-1]))
        return made[-1]

    engines = [FakeRolloutActor(False, calls), FakeRolloutActor(True, calls)]
    actor = SimpleNamespace(weights=lambda: {"w": 7})
    cfg = config(max_engine_restarts=budget)
    rollout = [handles.local(e) for e in engines]
    ctl = controller(cfg, 4, Groups(actor=actor, rollout=list(rollout), new_engine=new_engine))
    ctl.sync.address = ("10.0.0.1", 29500)
    prompts = [Prompt(i, [1, 2], f"p{i}") for i in range(4)]
    if replacements_die or not budget:
        with pytest.raises(RLRunError) as err:
            ctl.rollout.generate(prompts, step=5)
        cause = "The actor died unexpectedly before finishing this task."
        if budget:
            assert str(err.value) == (
                f"rollout engine 1 died after 2 engine restart(s), the most "
                f"--rollout.max_engine_restarts allows (2): {cause}"
            )
        else:
            assert (
                str(err.value)
                == (
                    f"rollout engine 1 died: {cause} (--rollout.max_engine_restarts 0: a dead "
                    f"engine stops the run)"
                )
                and started == []
            )
        return
    trajs, _ = ctl.rollout.generate(prompts, step=5)
    assert [t.prompt_uid for t in trajs] == [0, 1, 2, 3]  # engine order kept
    (new,) = started
    assert ctl.groups.rollout == [rollout[0], made[0]] and ctl.rollout.engine_restarts == 1
    # the new engine loads the policy's weights before it takes the dead one's prompts, with the same step (seeds)
    assert [c[1:] for c in calls if c[0] is new] == [("update", {"w": 7}), ("rollout", [2, 3], 5)]
    assert [c[2:] for c in calls if c[0] is engines[1]] == [([2, 3], 5)]
    assert ctl.sync.address is None  # the next sync builds a new group: the old one has a dead rank


def test_a_new_run_in_an_old_run_directory_starts_its_own_metrics(tmp_path):
    """Without --ckpt.load_enable the rows of the run before are kept as metrics.1.jsonl, not mixed in (the
    report would draw both runs as one line)."""
    import json

    from rlhf_core.runloop import MetricsLogger

    cfg = config()
    cfg.ckpt.output_dir = str(tmp_path)
    for run in (1, 2):
        logger = MetricsLogger(cfg, total_steps=2)
        for step in (1, 2):
            logger.log(step, {"reward/mean": float(run)})
        logger.close()
    now = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    before = [json.loads(x) for x in (tmp_path / "metrics.1.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward/mean"]) for r in now] == [(1, 2.0), (2, 2.0)]
    assert [(r["step"], r["reward/mean"]) for r in before] == [(1, 1.0), (2, 1.0)]


def test_over_generation_serves_later_steps_from_one_round_and_resumes_without_regenerating():
    """--rollout.vllm_generate_batch_size 7 with batches of 3: one round of 7 prompts feeds steps 1 and 2,
    step 3 takes the last group and starts the next round. A checkpoint of step 1 holds the 4 groups still
    waiting: the resumed controller trains them as they were, generating nothing until step 3."""
    cfg = config(vllm_generate_batch_size=7)
    cfg.algo.dynamic_filtering_enable = False
    ctl = controller(cfg, num_prompts=20)
    ctl.rollout.generate, calls = fake_generate(pass_uids=set())
    order = [p.uid for p in PromptStream(ctl.stream.prompts, seed=0).take(20)]
    b1 = ctl.rollout.collect(step=1)
    state = ctl.client_state()
    ctl.sync.policy_version = 1
    b2 = ctl.rollout.collect(step=2)
    assert calls == [order[:7]]  # one round so far
    b3 = ctl.rollout.collect(step=3)
    assert calls == [order[:7], order[7:14]]
    uids = [sorted({t.prompt_uid for t in b.trajectories}, key=order.index) for b in (b1, b2, b3)]
    assert uids == [order[:3], order[3:6], order[6:9]]
    assert [b.prompts_used for b in (b1, b2, b3)] == [7, 0, 7]
    # step 3 (policy version 2) trains order[6] of the first round (version 0) and two groups of version 1
    assert [b.rollout_metrics["policy_version_lag"] for b in (b1, b2, b3)] == [0, 1, 2]
    assert b3.rollout_metrics["policy_version_lag_mean"] == pytest.approx((2 + 1 + 1) / 3)
    resumed = controller(cfg, num_prompts=20)
    resumed.load_client_state(state)
    resumed.rollout.generate, resumed_calls = fake_generate(pass_uids=set())
    resumed.sync.policy_version = 1
    assert resumed.rollout.collect(step=2).trajectories == b2.trajectories and resumed_calls == []
    assert resumed.rollout.collect(step=3).trajectories == b3.trajectories and resumed_calls == [order[7:14]]


def test_stale_groups_are_dropped_and_their_prompts_generated_again():
    """--train.max_staleness 1, one round of 9 prompts for batches of 3: step 3 trains policy version 2, and
    the round's last 3 groups (version 0) are 2 versions old: they are dropped, and their prompts generated
    again first in step 3's round (version 2), not lost."""
    cfg = config(vllm_generate_batch_size=9)
    cfg.algo.dynamic_filtering_enable = False
    cfg.train.async_enable, cfg.train.max_staleness = True, 1
    ctl = controller(cfg, num_prompts=30)
    ctl.rollout.generate, calls = fake_generate(pass_uids=set())
    order = [p.uid for p in PromptStream(ctl.stream.prompts, seed=0).take(30)]
    batches = []
    for step in (1, 2, 3, 4):
        ctl.sync.policy_version = step - 1  # as one weight sync per step leaves it
        batches.append(ctl.rollout.collect(step))
    assert calls == [order[:9], order[6:9] + order[9:15]]
    uids = [sorted({t.prompt_uid for t in b.trajectories}, key=order.index) for b in batches]
    assert uids == [order[:3], order[3:6], order[6:9], order[9:12]]
    m = [b.rollout_metrics for b in batches]
    assert [x["async/stale_groups_requeued"] for x in m] == [0, 0, 3, 0]
    assert [x["policy_version_lag"] for x in m] == [0, 1, 0, 1]
    assert [b.prompts_used for b in batches] == [9, 0, 9, 0]


def test_filtered_groups_come_back_once_in_a_later_round():
    """Dynamic filtering drops the groups of X and Y at step 1; both are generated again at step 2 (after the
    data ran out), before anything else: Y passes then, X is dropped a second time and lost (counted). A
    checkpoint between the steps holds the re-queued prompts."""
    cfg = config()
    ctl = controller(cfg, num_prompts=5)
    order = [p.uid for p in PromptStream(ctl.stream.prompts, seed=0).take(5)]
    x, y = order[0], order[1]
    calls = []

    def generate(prompts, step, eval_mode=False):  # a score of 0.5 passes the (0, 1) filter, 1.0 does not
        calls.append([p.uid for p in prompts])
        passes = {p.uid: p.uid != x and (p.uid != y or step != 1) for p in prompts}
        return [
            Trajectory(
                [1], [3], [1], [0.0], prompt_uid=p.uid, sample_index=i, reward=0.5 if passes[p.uid] else 1.0
            )
            for p in prompts
            for i in range(2)
        ], {}

    ctl.rollout.generate = generate
    b1 = ctl.rollout.collect(step=1)
    state = ctl.client_state()
    assert calls == [order[:3], order[3:5]]  # the refill of the same round takes new prompts
    assert {t.prompt_uid for t in b1.trajectories} == set(order[2:5])
    assert ctl.rollout.requeued == [(x, True), (y, True)]
    m = b1.rollout_metrics
    assert (m["rollout/filtered_requeued"], m["rollout/filtered_lost"], m["dynamic_filtering_pass_rate"]) == (
        2,
        0,
        3 / 5,
    )
    b2 = ctl.rollout.collect(step=2)
    assert calls[2:] == [[x, y]] and {t.prompt_uid for t in b2.trajectories} == {y}
    assert (b2.rollout_metrics["rollout/filtered_requeued"], b2.rollout_metrics["rollout/filtered_lost"]) == (
        0,
        1,
    )
    assert ctl.rollout.collect(step=3) is None
    resumed = controller(cfg, num_prompts=5)
    resumed.load_client_state(state)
    resumed.rollout.generate = generate
    assert resumed.rollout.collect(step=2).trajectories == b2.trajectories


class FakeTrainer:
    """The policy and the engine of an async run, in plain numbers: ``trained`` lists each step's prompts
    and rewards, and the engine's weights are the count of steps trained when they were last synced."""

    def __init__(self):
        self.trained: list = []
        self.engine_weights = 0

    def push_weights_to_hosted(self, name):
        self.engine_weights = len(self.trained)

    def save_state(self, path):
        torch.save(self.trained, path)

    def load_state(self, path):
        self.trained = torch.load(path)


def async_run(tmp_path, ahead, max_steps, resume=None, stop_after=None):
    """Fit a controller of 30 prompts (batches of 3, over-generation of 5, 2 samples) with a fake trainer and
    engine that sleep at random (a seeded 0-20 ms) to shuffle the threads' timing; a sample's reward is a
    function of its prompt, step and the engine's weights. Returns the trainer and, per step, the policy
    version each of its generate calls ran on."""
    import random

    cfg = config(vllm_generate_batch_size=5)
    cfg.algo.dynamic_filtering_enable = False
    cfg.train.async_enable, cfg.train.async_queue_size, cfg.train.max_steps = True, ahead, max_steps
    cfg.ckpt.save_steps = 2
    from rlhf_core.checkpoint import CheckpointManager

    checkpoints = CheckpointManager(tmp_path / "ckpt", max_num=10)
    trainer = FakeTrainer()
    prompts = [Prompt(i, [1, 2], f"p{i}") for i in range(30)]
    ctl = RLController(
        cfg,
        Groups(actor=trainer, rollout=[], rollout_in_actor=True),
        PromptStream(prompts, 0),
        0,
        checkpoints,
    )
    jitter = random.Random(resume or 0)
    generated_on: dict = {}

    def generate(prompts, step, eval_mode=False):
        time.sleep(jitter.random() / 50)
        generated_on[step] = trainer.engine_weights
        return [
            Trajectory(
                [1],
                [3],
                [1],
                [0.0],
                prompt_uid=p.uid,
                sample_index=i,
                reward=float(derive_seed(p.uid, step, trainer.engine_weights) % 97),
            )
            for p in prompts
            for i in range(2)
        ], {}

    def train(exp, step, kl_coef):
        time.sleep(jitter.random() / 50)
        trainer.trained.append([(t.prompt_uid, t.reward) for t in exp])
        return {}

    ctl.rollout.generate, ctl.policy.train = generate, train
    ctl.experience.make = lambda trajs, kl_coef: _Exp(trajs)
    if resume is not None:
        path = checkpoints.latest()
        trainer.load_state(path / "actor")
        ctl.sync.to_engines()
        ctl.load_client_state(checkpoints.load_client_state(path))

    class Logger:
        def log(self, step, metrics):
            if step == stop_after:
                raise KeyboardInterrupt("killed")  # after the step's checkpoint, as a kill would

    ctl.logger = Logger()
    try:
        ctl.fit()
    except KeyboardInterrupt:
        pass
    return trainer, generated_on


class _Exp(list):
    def __init__(self, trajectories):
        super().__init__(trajectories)
        self.info = {"kl/mean": 0.0}
        self.sequences = [[1]]


@pytest.mark.parametrize("ahead", [1, 2])
def test_the_async_schedule_fixes_each_batchs_policy_and_a_checkpoint_resumes_exactly(tmp_path, ahead):
    """Whatever the threads' timing, batch k is generated by the weights after step k-1-Q (Q =
    --train.async_queue_size), so two runs train the same samples; a run stopped after the checkpoint of step
    4 and resumed from it trains what the uninterrupted run trains, step for step (over-generated groups
    and the batches generated ahead come from the checkpoint, not generated again by newer weights)."""
    full, generated_on = async_run(tmp_path / "full", ahead, max_steps=8)
    assert len(full.trained) == 8
    # one round of 5 prompts every 5 groups: rounds at steps 1, 2, 4, 6, 7 (5 groups feed 1 2/3 steps of 3)
    assert generated_on == {k: max(0, k - 1 - ahead) for k in (1, 2, 4, 6, 7)}
    again, _ = async_run(tmp_path / "again", ahead, max_steps=8, resume=None)
    assert again.trained == full.trained
    stopped, _ = async_run(tmp_path / "b", ahead, max_steps=8, stop_after=4)
    assert stopped.trained == full.trained[:4]
    resumed, _ = async_run(tmp_path / "b", ahead, max_steps=8, resume=1)
    assert resumed.trained == full.trained


def test_async_trainers_sleep_while_they_wait_for_a_batch():
    """--train.async_enable --train.colocate_all --ds.enable_sleep: the trainers sleep only while the queue is
    empty, and every sleep is followed by a wake-up before training."""
    import threading

    cfg = config()
    cfg.train.async_enable = cfg.train.colocate_all = cfg.ds.enable_sleep = True
    events = []
    asleep = threading.Event()

    class Trainer:
        def sleep(self):
            events.append("sleep")
            asleep.set()

        def wake_up(self):
            events.append("wake")

    ctl = RLController(cfg, Groups(actor=Trainer(), rollout=[], ref=Trainer()), PromptStream([], seed=0), 0)

    def collect(step):
        if step == 1:
            assert asleep.wait(timeout=60)  # the first batch comes once the trainers wait for it
        return SimpleNamespace(step=step, rollout_metrics={})

    ctl.rollout.collect = collect
    for batch in ctl.schedule.batches(step=0, total_steps=2):
        events.append(f"train {batch.step}")
    assert events[:5] == ["sleep", "sleep", "wake", "wake", "train 1"]  # actor and reference
    assert events.count("sleep") == events.count("wake") and "train 2" in events
    for i, e in enumerate(events):
        if e.startswith("train"):
            assert events[:i].count("sleep") == events[:i].count("wake")  # awake whenever it trains


def test_a_plugin_policy_loss_without_a_default_aggregation_gets_token_mean(register_plugin):
    """``default_loss_agg_mode`` is optional in the policy-loss contract (it once raised AttributeError here)."""
    from rlhf_algos import ppo_loss
    from rlhf_core import hookimpl

    class Plugin:
        @staticmethod
        @hookimpl
        def rlhf_register_policy_losses(register):
            register("bare_ppo", lambda batch: ppo_loss(batch))

    register_plugin(Plugin, "bare-loss-plugin")
    cfg = config()
    cfg.actor.policy_loss_type = "bare_ppo"
    assert controller(cfg, 3).policy.config(kl_coef=0.0).agg_mode == "token_mean"
    cfg.actor.policy_loss_type = "gspo"
    assert controller(cfg, 3).policy.config(kl_coef=0.0).agg_mode == "seq_mean_token_mean"


def per_call_batch():
    """Two prompts x two episodes; three episodes are per-call samples (segments), one a plain trajectory.
    Row r's prompt starts with token r + 1, its response tokens are 10 (r + 1) + t."""
    shapes = {
        0: [(2, 2), (3, 3)],
        1: [(2, 2)],
        2: [(2, 1), (4, 2), (5, 2)],
        3: [(3, 2), (2, 3)],
    }  # (prompt, response)
    rewards = {0: 1.0, 1: 0.0, 2: 2.0, 3: 0.5}
    row = 0
    trajs = []
    for e, parts in shapes.items():
        segs = []
        for p, r in parts:
            row += 1
            segs.append(Trajectory([row] * p, [10 * row + t for t in range(r)], [1] * r, [-0.1] * r))
        last = segs[-1]
        trajs.append(
            Trajectory(
                last.prompt_ids,
                last.response_ids,
                last.action_mask,
                last.rollout_logprobs,
                prompt_uid=e // 2,
                sample_index=e % 2,
                reward=rewards[e],
                segments=segs if len(segs) > 1 else [],
            )
        )
    return trajs, shapes, rewards


def test_per_call_samples_are_trained_with_their_episodes_advantage():
    """Each segment is a row of its own, trained, with the advantage its episode gets in its group: group_norm
    over two episodes gives +-1/sqrt(2) on every action token of every call (float32, 1e-9 epsilon: 1e-6),
    whatever the number of calls; counting the calls as samples would not."""
    ranks = [FakeRank(), FakeRank()]
    cfg = config()
    cfg.rollout.micro_batch_size = 2
    cfg.train.batch_size, cfg.train.micro_batch_size = 8, 2
    trajs, shapes, rewards = per_call_batch()
    ctl = controller(cfg, 2, Groups(actor=rank_group(ranks), rollout=[]))
    exp = ctl.experience.make(trajs, kl_coef=0.0)
    assert len(exp.sequences) == 8 and exp.episode_of.tolist() == [0, 0, 1, 2, 2, 2, 3, 3]
    assert exp.info["reward/mean"] == pytest.approx(sum(rewards.values()) / 4)  # episodes counted once
    ctl.policy.train(exp, step=1, kl_coef=0.0)
    sign = {0: 1, 1: -1, 2: 1, 3: -1}
    want = {}
    row = 0
    for e, parts in shapes.items():
        for _ in parts:
            row += 1
            want[row] = sign[e] * 2**-0.5
    trained = {}
    for mb in ranks[0].trained[0] + ranks[1].trained[0]:
        for i, (first, rl) in enumerate(zip(mb.seq.input_ids[:, 0].tolist(), mb.seq.response_lens.tolist())):
            trained[first] = mb.advantages[i, :rl]
    assert sorted(trained) == list(range(1, 9))
    for r, adv in trained.items():
        torch.testing.assert_close(adv, torch.full_like(adv, want[r]), atol=1e-6, rtol=0)


def test_per_call_advantages_with_kl_in_the_reward_are_those_of_the_whole_episode():
    """``reinforce`` with KL folded into the reward: token t of an episode gets r - c * (KL of the episode's
    action tokens from t on, across its calls), then whitening over all action tokens (hand-computed below in
    float64; float32 sums of ~10 terms: 1e-5)."""
    from rlhf_algos.advantages import ADVANTAGE_ESTIMATORS
    from rlhf_cli.rl.experience import build_experience, estimate_advantages

    cfg = config()
    cfg.algo.advantage.estimator = "reinforce"
    trajs, _, rewards = per_call_batch()
    exp = build_experience(trajs, cfg)
    kl = (torch.arange(exp.action_mask.numel(), dtype=torch.float32).view(exp.action_mask.shape) % 7) / 10
    kl = kl * exp.action_mask
    coef = 0.3
    out = estimate_advantages(ADVANTAGE_ESTIMATORS["reinforce"], exp, cfg, kl, coef)
    expected = {}
    for e in range(4):
        tokens = [
            (r, c)
            for r in (exp.episode_of == e).nonzero().flatten().tolist()
            for c in exp.action_mask[r].nonzero().flatten().tolist()
        ]
        for k, (r, c) in enumerate(tokens):
            expected[r, c] = rewards[e] - coef * sum(float(kl[q]) for q in tokens[k:])
    values = torch.tensor(list(expected.values()), dtype=torch.float64)
    mean, std = values.mean(), values.var(unbiased=False).sqrt()
    for (r, c), v in expected.items():
        assert float(out.advantages[r, c]) == pytest.approx(float((v - mean) / std), abs=1e-5)
    assert float(out.advantages[~exp.action_mask].abs().sum()) == 0.0
