"""``rlhf train ppo``: assemble the Ray job from an Assembly and run the controller.

Ray is imported only where a run uses it: a single-process run (``--ray.single_process``) never does, so it
runs where Ray is not installed (the GPU check's bare image, ``scripts/gpu-check``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from rlhf_cli.assemble import Assembly, RunConfigError, choose_engine
from rlhf_cli.rl.controller import Groups, RLController
from rlhf_cli.rl.prompts import PromptStream, load_prompts
from rlhf_core import handles
from rlhf_core.handles import wait
from rlhf_core.plugins import get_plugin_manager, resolve
from rlhf_core.runloop import MetricsLogger, open_checkpoints
from rlhf_core.vision import ImageProcessing


def _optimizer_steps(cfg, num_prompts: int) -> int:
    """Optimizer steps of the whole run, for the learning-rate schedule."""
    rl_steps = -(-num_prompts * cfg.train.num_episodes // cfg.rollout.batch_size)
    if cfg.train.max_steps > 0:
        rl_steps = min(rl_steps, cfg.train.max_steps)
    per_rl_step = max(1, cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt // cfg.train.batch_size)
    return max(1, rl_steps * per_rl_step * cfg.train.max_epochs)


def cpu_threads(processes: int, overlapped: bool = False) -> int:
    """Torch threads for each of ``processes`` processes that compute at the same time on this machine: its
    cores split between them (halved when ``overlapped``: the async pipeline overlaps generation and
    training), at most ``$OMP_NUM_THREADS``. Oversubscribed, OpenMP workers spin-wait for each other."""
    cores = os.cpu_count() or 1
    if overlapped:
        cores = max(1, cores // 2)
    return max(1, min(cores // processes, int(os.environ.get("OMP_NUM_THREADS") or cores)))


def build_groups(asm: Assembly, pools, total_steps: int, pad_token_id: int) -> Groups:
    """Start every worker group the plan names, each pinned to its pool's bundles, all side by side (a rank
    spends seconds importing torch, transformers and DeepSpeed and loading its model)."""
    cfg = asm.cfg
    backend = resolve(get_plugin_manager(), "train_backends", cfg.train.backend)
    made: dict = {}
    # the training groups' forward passes run side by side in make_experience (a hosted ref's in its rank, in turn)
    trainer_threads = cpu_threads(
        sum(g.num_workers for g in asm.plan.groups if g.role != "rollout" and g.role not in asm.in_actor),
        cfg.train.async_enable,
    )
    for spec in asm.plan.groups:
        if spec.role == "rollout" or spec.role in asm.in_actor:
            continue
        options = {"with_ref": True} if spec.role == "actor" and "ref" in asm.in_actor else {}
        pool = None if asm.single_process else pools[spec.pool]  # a single-process run has no placement group
        if pool is None:
            options["inline_rank"] = True
        else:
            options["bundle_indices"] = [r % pool.num_bundles for r in range(spec.num_workers)]
        made[spec.role] = backend.create_group(
            spec.role,
            cfg,
            pool and pool.group,
            spec.num_workers,
            total_steps=total_steps,
            wait=False,
            num_gpus_per_worker=spec.num_gpus_per_worker,
            num_cpus_per_worker=spec.num_cpus_per_worker,
            num_threads=trainer_threads,
            **options,
        )
    if "ref" in asm.in_actor:
        made["ref"] = made["actor"].hosted_ref()
    (rollout_spec,) = [g for g in asm.plan.groups if g.role == "rollout"]
    from rlhf_agents.rollout_actor import RewardModelWorkers, RolloutActor

    reward_model = None
    if "reward" in made:
        # on the driver's node, which has the train backend installed (inference nodes need not)
        from rlhf_cli.ray_launch import this_node

        made["reward"].wait_ready()
        reward_model = handles.ray_actor(
            RewardModelWorkers,
            made["reward"],
            pad_token_id,
            cfg.rollout.micro_batch_size,
            options={"num_cpus": 0, "scheduling_strategy": this_node()},
        )

    engine = choose_engine(cfg, get_plugin_manager())
    new_engine = None
    if "rollout" in asm.in_actor:
        rollout = made["actor"].host(
            "rollout",
            RolloutActor,
            [(cfg, engine, i, reward_model, None, True) for i in range(rollout_spec.num_workers)],
        )
    else:
        from rlhf_cli.ray_launch import worker_options

        # partial rollout: weights may land while a generation is running (a second concurrent call)
        concurrency = 2 if cfg.train.partial_rollout_enable else 1
        width = cfg.vllm.tensor_parallel_size if engine == "vllm" else 1  # bundles (GPUs) per engine
        # on CPU every engine (HF, or vLLM's CPU build) gets its share of the cores; vLLM on GPU threads itself
        threads = (
            cpu_threads(rollout_spec.num_workers, cfg.train.async_enable)
            if engine == "hf" or not torch.cuda.is_available()
            else None
        )

        def new_engine(i: int) -> handles.Handle:
            """Engine ``i`` on its own bundles: at start, and to replace a dead one."""
            options = worker_options(rollout_spec, pools[rollout_spec.pool], i, width)
            return handles.ray_actor(
                RolloutActor,
                cfg,
                engine,
                i,
                reward_model,
                threads,
                options={**options, "max_concurrency": concurrency},
            )

        rollout = [new_engine(i) for i in range(rollout_spec.num_workers)]
    for role, group in made.items():
        if role not in asm.in_actor:
            group.wait_ready()
    wait([a.ping() for a in rollout])
    places = wait([a.where() for a in rollout])
    for place in sorted(set(places)):
        print(f"rlhf: {places.count(place)} rollout engine(s) on {place}", file=sys.stderr)
    return Groups(
        actor=made["actor"],
        rollout=rollout,
        ref=made.get("ref"),
        critic=made.get("critic"),
        reward=made.get("reward"),
        rollout_in_actor="rollout" in asm.in_actor,
        new_engine=new_engine,
    )


def worker_processes(groups: Groups) -> int:
    """Ray worker processes of the run: one per training rank (a reference model hosted in the policy's ranks
    has none of its own), and one per engine not hosted in a rank."""
    ranks = {
        a for g in (groups.actor, groups.ref, groups.critic, groups.reward) if g is not None for a in g.actors
    }
    return len(ranks) + (0 if groups.rollout_in_actor else len(groups.rollout))


def run_rl(asm: Assembly) -> None:
    """Run the RL job."""
    cfg = asm.cfg
    out = Path(cfg.ckpt.output_dir)
    from rlhf_core.data import load_tokenizer

    try:
        tokenizer = load_tokenizer(cfg.actor.model_name_or_path, cfg.data)
    except OSError as exc:  # a model directory without tokenizer files, or a hub id the hub does not have
        raise RunConfigError(f"--actor.model_name_or_path {cfg.actor.model_name_or_path}: {exc}") from exc
    images = ImageProcessing.for_model(cfg.actor.model_name_or_path)
    prompts = load_prompts(cfg, tokenizer, images=images)
    eval_prompts = (
        load_prompts(
            cfg,
            tokenizer,
            paths=cfg.eval.dataset,
            split=cfg.eval.split,
            max_samples=cfg.eval.max_samples,
            images=images,
        )
        if cfg.eval.dataset
        else []
    )
    stream = PromptStream(prompts, cfg.train.seed, cfg.train.num_episodes)
    checkpoints, resume, resume_state = open_checkpoints(cfg, out)

    started = time.perf_counter()
    pools = {}
    own_ray = False
    if not asm.single_process:
        import ray

        from rlhf_cli.ray_launch import create_pools, init_ray, remove_pools

        own_ray = not ray.is_initialized()  # a caller's Ray session (tests, notebooks) is left running
        init_ray(cfg, asm.plan)
        pools = create_pools(asm.plan)
    groups = logger = None
    try:
        groups = build_groups(asm, pools, _optimizer_steps(cfg, len(prompts)), tokenizer.pad_token_id or 0)
        controller = RLController(
            cfg,
            groups,
            stream,
            tokenizer.pad_token_id or 0,
            checkpoints,
            eval_prompts=eval_prompts,
            image_processing=images,
        )
        if resume is not None:
            wait(groups.actor.load_state(str(resume / "actor")))
            if groups.critic is not None:
                wait(groups.critic.load_state(str(resume / "critic")))
            controller.sync.to_engines()  # the checkpoint's weights, which its policy version (loaded next) names
            controller.load_client_state(resume_state)
            print(f"resumed from {resume} at step {controller.step}", file=sys.stderr)
        where = (
            "the worker in this process (no Ray)"
            if asm.single_process
            else f"{worker_processes(groups)} worker processes"
        )
        print(
            f"rlhf: {len(prompts)} prompts, {controller.total_steps()} steps; {where} up in "
            f"{time.perf_counter() - started:.1f} s",
            file=sys.stderr,
        )
        logger = MetricsLogger(cfg, controller.total_steps(), controller.step)  # its bar after the line above
        controller.logger = logger
        controller.fit()
        wait(groups.actor.export(str(out / "model")))
        if groups.critic is not None and cfg.critic.save_value_network:
            wait(groups.critic.export(str(out / "critic")))
    finally:
        if logger is not None:
            logger.close()
        if groups is not None:
            for g in (groups.actor, groups.ref, groups.critic, groups.reward):
                if g is not None:
                    g.shutdown()
            for a in groups.rollout:  # an engine hosted in a rank ends with the rank
                handles.kill(a)
        if not asm.single_process:  # ray and remove_pools were imported above
            remove_pools(pools)
            if own_ray:
                ray.shutdown()
    from rlhf_cli.report import make_report

    print(f"report: {make_report(out)}", file=sys.stderr)
