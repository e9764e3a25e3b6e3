"""``rlhf generate``: OpenRLHF's batch inference. n samples per prompt on Ray workers, scored, post-processed.

The data flow, the resume from ``<output_path>.samples.jsonl`` and the seeds are in docs/generation.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import groupby
from operator import itemgetter
from pathlib import Path
from typing import Any

from rlhf_core import data, plugins
from rlhf_core.checkpoint import write_atomic
from rlhf_core.config import GenerateConfig, RLConfig
from rlhf_core.config_parser import redact_text, shown_config
from rlhf_core.errors import UserError
from rlhf_core.types import (
    GenerationRequest,
    PostProcessInput,
    PostProcessOptions,
    RewardRequest,
    SamplingParams,
    ScoredSample,
    derive_seed,
)

TASKS = ("generate", "generate_vllm", "rm")


class GenerateError(UserError, ValueError):
    """A setting or input that cannot work; the message names the flag, file or row."""


@dataclass
class Plan:
    """What a run will do, all checked: the prompts, the engine, the reward source, the post-processor."""

    cfg: GenerateConfig
    prompts: list[dict]
    """``{"index", "text", "ids", "label"}`` (+ ``"output"``, ``"output_ids"`` for ``--generate.task rm``)."""
    engine: str | None
    """Rollout engine name; None for ``--generate.task rm``."""
    reward: str | None
    """Description of the reward source; None without one."""
    samples_path: Path
    output_path: Path
    notes: list[str] = field(default_factory=list)

    @property
    def n(self) -> int:
        return 1 if self.engine is None else self.cfg.rollout.n_samples_per_prompt

    def fingerprint(self) -> dict:
        """What a resumed run must share with the run that wrote the samples."""
        c = self.cfg
        return {
            "task": c.generate.task,
            "model": c.model.model_name_or_path,
            "dataset": c.data.dataset,
            "iter": c.generate.iter,
            "seed": c.generate.seed,
            "prompts": len(self.prompts),
            "n": self.n,
            "sampling": shown_config(c, "generate")["rollout"] | {"micro_batch_size": None, "engine": None},
            "reward": {
                k: getattr(c.reward, k)
                for k in ("model_name_or_path", "source", "normalize_enable", "weights")
            }
            | {
                "remote_url": c.reward.remote_url and redact_text(c.reward.remote_url)
            },  # saved: no credentials
            "enable_csft": c.generate.enable_csft,
            "csft_prompt": c.generate.csft_prompt if c.generate.enable_csft else None,
        }

    def describe(self) -> str:
        c = self.cfg
        return "\n".join(
            [
                f"prompts: {len(self.prompts)} from {', '.join(c.data.dataset or [])}"
                + (
                    f" (iteration {c.generate.iter}: rows {c.generate.iter * c.rollout.batch_size}.."
                    f"{(c.generate.iter + 1) * c.rollout.batch_size - 1})"
                    if c.generate.iter is not None
                    else ""
                ),
                f"task: score the rows' own responses (--data.output_key {c.data.output_key}); no policy"
                if self.engine is None
                else f"generation: {self.n} sample(s) per prompt with the {self.engine} "
                f"engine on {c.vllm.num_engines} Ray worker(s), {c.rollout.micro_batch_size} prompts per call",
                f"reward: {self.reward or 'none (samples are not scored)'}",
                f"precision: {c.ds.param_dtype} (--ds.param_dtype; auto is bf16 on GPUs, fp32 on CPU)",
                f"post-processor: {c.generate.post_processor or 'none (every sample is written)'}",
                f"samples: {self.samples_path} (resume state)\noutput: {self.output_path}",
            ]
        )


# --- planning (the driver, before any worker) ----------------------------------------------------------


def plugin_config(cfg: GenerateConfig) -> RLConfig:
    """The run config that rollout-engine and reward-source plugins read: generate's own section objects, with
    the policy as the actor and the sampling seed as ``train.seed``."""
    rl = RLConfig(
        rollout=cfg.rollout, reward=cfg.reward, data=cfg.data, ds=cfg.ds, vllm=cfg.vllm, ray=cfg.ray
    )
    rl.actor.model_name_or_path, rl.train.seed = cfg.model.model_name_or_path, cfg.generate.seed
    return rl


def load_tokenizer(cfg: GenerateConfig) -> Any:
    """The policy's tokenizer, else the reward model's, else None (a reward file scoring text alone)."""
    path = cfg.model.model_name_or_path or cfg.reward.model_name_or_path
    return None if path is None else data.load_tokenizer(path, cfg.data)


def select_rows(cfg: GenerateConfig) -> list[data.Row]:
    """The rows of this run: ``[iter * R, (iter + 1) * R)`` with ``--generate.iter``, else the first
    ``--data.max_samples``."""
    d, it = cfg.data, cfg.generate.iter
    rows = data.load_rows(
        d.dataset or [],
        d.dataset_probs,
        d.dataset_split,
        cfg.generate.seed,
        None if it is not None else d.max_samples,
    )
    if it is None:
        return rows
    size = cfg.rollout.batch_size
    picked = rows[it * size : (it + 1) * size]
    if not picked:
        raise GenerateError(
            f"--generate.iter {it} with --rollout.batch_size {size} starts at row {it * size}, but "
            f"the data has only {len(rows)} rows"
        )
    return picked


def build_prompts(cfg: GenerateConfig, tokenizer: Any, stats: data.DataStats) -> list[dict]:
    d, rm_task = cfg.data, cfg.generate.task == "rm"
    if d.apply_chat_template and tokenizer is None:
        raise GenerateError(
            "--data.apply_chat_template needs a tokenizer: give --model.model_name_or_path "
            "or --reward.model_name_or_path"
        )
    prompts = []
    for row in select_rows(cfg):
        try:
            raw = data.get_field(row, d.input_key, (str, list), "--data.input_key")
            if isinstance(raw, list):
                data.check_messages(raw, row, d.input_key)
            text = data.render_prompt(tokenizer, raw, d.input_template, d.apply_chat_template)
            output = data.get_field(row, d.output_key, str, "--data.output_key") if rm_task else None
            label = data.get_field(row, d.label_key, object, "--data.label_key") if d.label_key else None
        except data.DataError:
            if not d.skip_bad_rows:
                raise
            stats.add("bad_rows_skipped")
            continue
        if cfg.generate.enable_csft:
            text += cfg.generate.csft_prompt.strip() + " "
        ids = (
            []
            if tokenizer is None
            else data.fit_prompt(
                data.encode(tokenizer, text), d.prompt_max_len, d.overlong_prompt_policy, row.where(), stats
            )
        )
        if ids is None:
            continue
        prompt = {"index": len(prompts), "text": text, "ids": ids, "label": label}
        if rm_task:
            out_ids = data.encode(tokenizer, output) if tokenizer is not None else []
            eos = getattr(tokenizer, "eos_token_id", None)
            if eos is not None and (not out_ids or out_ids[-1] != eos):
                out_ids.append(eos)  # a reward model reads the score at the EOS, as it was trained
            prompt |= {"output": output, "output_ids": out_ids}
        prompts.append(prompt)
    if not prompts:
        raise GenerateError(f"no usable prompts in {', '.join(d.dataset or [])}")
    return prompts


class _UnloadedRewardModel:
    """Stands in for the reward model while the driver checks the reward configuration (workers load it)."""

    def compute_rewards(self, sequences):
        raise RuntimeError("the driver does not score")


def check_reward(cfg: GenerateConfig, pm) -> str | None:
    """Build the reward source of ``--reward.*`` once in the driver (loading a reward file, checking URLs,
    resolving a named source) without loading a reward model; returns its description, or None."""
    from rlhf_agents.loading import UserCodeError
    from rlhf_agents.rewards import build_reward_source

    path = cfg.reward.model_name_or_path
    if path and not (Path(path) / "config.json").is_file():
        raise GenerateError(f"--reward.model_name_or_path {path}: no model there (no config.json)")
    try:
        source = build_reward_source(plugin_config(cfg), pm, reward_model_handle=_UnloadedRewardModel())
    except (UserCodeError, plugins.PluginError, ValueError, TypeError) as exc:
        raise GenerateError(f"the reward source cannot score: {exc}") from None
    if source is None:
        return None
    description = getattr(source, "description", type(source).__name__)
    asyncio.run(source.aclose())
    return description


def plan(cfg: GenerateConfig) -> Plan:
    """Check everything and read the prompts; raises GenerateError (or DataError) naming what is wrong."""
    from rlhf_cli.assemble import choose_engine, gpus_available
    from rlhf_core.config import resolve_param_dtype

    pm = plugins.get_plugin_manager()
    g, r = cfg.generate, cfg.rollout
    cfg.ds.param_dtype = resolve_param_dtype(cfg.ds.param_dtype, gpus_available())  # as rlhf train does
    problems = [
        message
        for failed, message in [
            (g.task not in TASKS, f"--generate.task {g.task}: choose one of {', '.join(TASKS)}"),
            (not g.output_path, "--generate.output_path is required (the JSON-lines file to write)"),
            (not cfg.data.dataset, "--data.dataset is required (the prompts)"),
            (
                g.task != "rm" and not cfg.model.model_name_or_path,
                "--model.model_name_or_path (--pretrain) is required: the policy that generates",
            ),
            (
                r.repetition_penalty != 1.0,
                f"--rollout.repetition_penalty {r.repetition_penalty}: the rollout "
                "engines sample without a repetition penalty; leave it at 1.0",
            ),
            *[
                (value < 1, f"{flag} {value}: must be at least 1")
                for flag, value in (
                    ("--rollout.n_samples_per_prompt", r.n_samples_per_prompt),
                    ("--rollout.micro_batch_size", r.micro_batch_size),
                    ("--rollout.batch_size", r.batch_size),
                    ("--vllm.num_engines", cfg.vllm.num_engines),
                )
            ],
            (g.iter is not None and g.iter < 0, f"--generate.iter {g.iter}: must be 0 or more"),
            (r.temperature < 0, f"--rollout.temperature {r.temperature}: must be 0 (greedy) or more"),
        ]
        if failed
    ]
    if problems:
        raise GenerateError("this run cannot start:\n  - " + "\n  - ".join(problems))

    engine = None
    if g.task != "rm":
        rl = plugin_config(cfg)
        if g.task == "generate_vllm" and r.engine not in ("auto", "vllm"):
            raise GenerateError(
                f"--generate.task generate_vllm asks for the vllm engine, but --rollout.engine is {r.engine}"
            )
        engine = "vllm" if g.task == "generate_vllm" else choose_engine(rl, pm)
        try:
            factory = plugins.resolve(pm, "rollout_engines", engine, "--rollout.engine")
        except plugins.PluginError as exc:
            raise GenerateError(str(exc)) from None
        reason = factory.available() or getattr(factory, "config_problem", lambda cfg: None)(rl)
        if reason:
            raise GenerateError(f"--rollout.engine {engine} cannot run here: {reason}")
        if not (Path(cfg.model.model_name_or_path) / "config.json").is_file():
            raise GenerateError(
                f"--model.model_name_or_path {cfg.model.model_name_or_path}: no model there (no config.json)"
            )
    reward = check_reward(cfg, pm)
    if g.task == "rm" and reward is None:
        raise GenerateError(
            "--generate.task rm scores the dataset's responses: give a reward source "
            "(--reward.model_name_or_path, --reward.remote_url or --reward.source)"
        )
    if g.post_processor:
        try:
            processor = plugins.resolve(pm, "post_processors", g.post_processor, "--generate.post_processor")
            processor.check(PostProcessOptions(g.reward_template, g.normalize_reward))
        except (plugins.PluginError, ValueError) as exc:
            raise GenerateError(str(exc)) from None
        if reward is None:
            raise GenerateError(
                f"--generate.post_processor {g.post_processor} works on rewards: give a reward "
                "source (--reward.model_name_or_path, --reward.remote_url or --reward.source)"
            )
    stats = data.DataStats()
    prompts = build_prompts(cfg, load_tokenizer(cfg), stats)
    notes = [f"{k}: {int(v)}" for k, v in stats.counts.items()]
    if engine is not None and r.temperature == 0 and r.n_samples_per_prompt > 1:
        notes.append("greedy sampling gives every sample of a prompt the same tokens")
    out = Path(g.output_path)
    return Plan(cfg, prompts, engine, reward, out.with_name(out.name + ".samples.jsonl"), out, notes)


# --- the samples file: append, resume ---------------------------------------------------------------------


def recover_samples(plan: Plan) -> tuple[set[int], str | None]:
    """Read the samples file of an earlier run of the same command; returns the prompts it finished and a
    note on what was repaired. A partial last line is cut and the samples of unfinished prompts are
    dropped (file rewritten through a temporary file), so the file holds only finished prompts."""
    path, meta_path = plan.samples_path, plan.samples_path.with_suffix(".meta.json")
    fingerprint = json.loads(json.dumps(plan.fingerprint()))  # as it reads back (tuples become lists)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and meta_path.exists():
        saved = json.loads(meta_path.read_text())
        changed = [k for k in fingerprint if saved.get(k) != fingerprint[k]]
        if changed:
            raise GenerateError(
                f"{path} was written by a run with other settings ({', '.join(changed)} differ: "
                f"{ {k: saved.get(k) for k in changed} } there, { {k: fingerprint[k] for k in changed} } now); "
                "delete it or choose another --generate.output_path"
            )
    else:
        write_atomic(meta_path, json.dumps(fingerprint, indent=1) + "\n")
    if not path.exists():
        path.touch()
        return set(), None
    blob = path.read_bytes()
    complete = blob[: blob.rfind(b"\n") + 1]
    repaired = []
    if len(complete) != len(blob):
        repaired.append("a partial last line")
    records = [(json.loads(line)["prompt_index"], line) for line in complete.decode("utf-8").splitlines()]
    counts = Counter(i for i, _ in records)
    done = {i for i, c in counts.items() if c == plan.n}
    unfinished = set(counts) - done
    if unfinished:
        repaired.append(f"the samples of {len(unfinished)} unfinished prompt(s)")
    if repaired:
        write_atomic(path, "".join(line + "\n" for i, line in records if i in done))
    note = f"resuming {path}: {len(done)} of {len(plan.prompts)} prompts done" + (
        f"; dropped {' and '.join(repaired)}" if repaired else ""
    )
    return done, note


def append_records(path: Path, records: list[dict], chunk_number: int) -> None:
    """Append one micro-batch's samples in one write, then fsync: a kill leaves at most a partial tail."""
    blob = "".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records).encode("utf-8")
    with path.open("ab") as f:
        if os.environ.get("RLHF_FAULT") == f"generate_mid_write:{chunk_number}":  # crash tests
            cut = len(blob) // 2
            if blob[cut - 1 : cut] == b"\n":  # a cut just after a record would leave no partial line to test
                cut -= 1
            f.write(blob[:cut])
            f.flush()
            print(f"RLHF_FAULT: exiting in the write of micro-batch {chunk_number}", flush=True)
            os._exit(137)
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())


# --- the Ray worker ------------------------------------------------------------------------------------------


class GenerationWorker:
    """One rollout engine and one reward source, in a Ray actor; plugins are resolved in this process."""

    def __init__(self, cfg: GenerateConfig, engine_name: str | None, index: int, num_threads: int):
        import torch

        from rlhf_agents.rewards import build_reward_source

        torch.set_num_threads(num_threads)
        pm = plugins.get_plugin_manager()
        rl = plugin_config(cfg)
        self.cfg = cfg
        self.engine = (
            plugins.resolve(pm, "rollout_engines", engine_name).create(rl, index=index)
            if engine_name is not None
            else None
        )
        self.tokenizer = load_tokenizer(cfg)
        self.reward = build_reward_source(rl, pm)
        self.loop = asyncio.new_event_loop()  # kept: HTTP sessions live on it

    def run(self, prompts: list[dict]) -> list[dict]:
        """Every sample of ``prompts`` (micro-batch), scored: one record per sample, prompt by prompt."""
        c, tok = self.cfg, self.tokenizer
        if self.engine is None:
            samples = [(p, 0, p["output_ids"], p["output"], "stop") for p in prompts]
        else:
            r = c.rollout
            requests = [
                GenerationRequest(
                    p["ids"],
                    SamplingParams(
                        r.n_samples_per_prompt,
                        r.temperature,
                        r.top_p,
                        r.top_k,
                        r.max_new_tokens,
                        seed=derive_seed(c.generate.seed, c.generate.iter or 0, p["index"]),
                    ),
                )
                for p in prompts
            ]
            outs = self.engine.generate(requests)
            samples = [
                (
                    p,
                    j,
                    o.token_ids,
                    tok.decode(o.token_ids, skip_special_tokens=True),
                    o.finish_reason,
                )
                for p, group in zip(prompts, outs)
                for j, o in enumerate(group)
            ]
        ps, js, ids, texts, finishes = zip(*samples)
        rewards = errors = [None] * len(samples)  # replaced, never changed in place
        if self.reward is not None:
            request = RewardRequest(
                queries=[
                    tok.decode(p["ids"] + list(i), skip_special_tokens=False)
                    if tok is not None
                    else p["text"] + t
                    for p, i, t in zip(ps, ids, texts)
                ],
                prompts=[p["text"] for p in ps],
                labels=[p["label"] for p in ps],
                prompt_ids=[list(p["ids"]) for p in ps],
                response_ids=[list(i) for i in ids],
                finish_reasons=list(finishes),
                responses=list(texts),
            )
            result = self.loop.run_until_complete(self.reward.score(request))
            rewards, errors = list(result.rewards), list(result.errors) or errors
        return [
            {
                "prompt_index": p["index"],
                "sample_index": j,
                "input": p["text"],
                "output": text,
                "reward": reward,
                "finish_reason": finish,
                **({"label": p["label"]} if p["label"] is not None else {}),
                **({"error": error or "unscorable"} if self.reward is not None and reward is None else {}),
            }
            for p, j, text, finish, reward, error in zip(ps, js, texts, finishes, rewards, errors)
        ]


# --- the run ---------------------------------------------------------------------------------------------------


def generate_samples(plan: Plan, todo: list[dict]) -> None:
    """Share ``todo`` out to the Ray workers, a micro-batch at a time, appending answers as they come."""
    from rlhf_cli.ray_launch import init_ray
    from rlhf_cli.rl.run import cpu_threads
    from rlhf_core import handles

    cfg = plan.cfg
    workers_n = min(cfg.vllm.num_engines, max(1, len(todo)))
    init_ray(cfg, min_cpus=workers_n)
    import torch

    gpus = cfg.vllm.tensor_parallel_size if (plan.engine is not None and torch.cuda.is_available()) else 0
    options = {"num_cpus": 1, "num_gpus": gpus}
    workers = [
        handles.ray_actor(GenerationWorker, cfg, plan.engine, k, cpu_threads(workers_n), options=options)
        for k in range(workers_n)
    ]
    size = cfg.rollout.micro_batch_size
    chunks = [todo[i : i + size] for i in range(0, len(todo), size)]
    # a progress line per answered micro-batch, at most every 5 s (and always the last one)
    total, done_before = len(plan.prompts), len(plan.prompts) - len(todo)
    done_now = samples = written = 0
    rewards = []
    t0, last = time.perf_counter(), 0.0
    pending = {}  # call -> (worker, its micro-batch)
    idle = list(workers)
    try:
        while chunks or pending:
            while idle and chunks:
                w, chunk = idle.pop(0), chunks.pop(0)
                pending[w.run(chunk)] = (w, chunk)
            done = handles.first_done(list(pending))
            w, chunk = pending.pop(done)
            idle.append(w)
            records = handles.wait(done)
            if plan.reward is not None and all(rec["reward"] is None for rec in records):
                raise GenerateError(
                    f"the reward source ({plan.reward}) could not score any sample of a micro-batch; "
                    f"first error: {records[0].get('error')}. The samples made so far are kept: fix "
                    "the reward source and run the same command again to resume"
                )
            written += 1
            append_records(plan.samples_path, records, written)
            done_now += len(chunk)
            samples += len(records)
            rewards += [rec["reward"] for rec in records if rec["reward"] is not None]
            now, prompts_done = time.perf_counter(), done_before + done_now
            if now - last >= 5.0 or prompts_done == total:
                last = now
                reward = f", mean reward {sum(rewards) / len(rewards):.4f}" if rewards else ""
                print(
                    f"generate: {prompts_done}/{total} prompts ({prompts_done / total:.0%}), {samples} "
                    f"samples this run, {done_now / max(now - t0, 1e-9):.2f} prompts/s{reward}",
                    flush=True,
                )
    finally:
        for w in workers:
            handles.kill(w)


def read_samples(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def finish(plan: Plan) -> dict:
    """Post-process the complete samples file into the output (written whole); returns a summary."""
    cfg = plan.cfg
    records = sorted(read_samples(plan.samples_path), key=lambda r: (r["prompt_index"], r["sample_index"]))
    scored = [r for r in records if r["reward"] is not None]
    unscorable = len(records) - len(scored) if plan.reward is not None else 0
    if cfg.generate.post_processor:
        processor = plugins.resolve(
            plugins.get_plugin_manager(), "post_processors", cfg.generate.post_processor
        )
        groups = [
            [
                ScoredSample(
                    r["input"], r["output"], float(r["reward"]), i, r["sample_index"], r.get("label")
                )
                for r in group
            ]
            for i, group in groupby(scored, key=itemgetter("prompt_index"))  # records are sorted
        ]
        options = PostProcessOptions(cfg.generate.reward_template, cfg.generate.normalize_reward)
        rows = processor(PostProcessInput(groups, options))
    else:
        keys = (
            ("input", "output", "reward", "label")
            if plan.reward is not None
            else ("input", "output", "label")
        )
        rows = [{k: r[k] for k in keys if k in r} for r in records]
    write_atomic(plan.output_path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    summary = {
        "prompts": len(plan.prompts),
        "samples": len(records),
        "unscorable": unscorable,
        "rows": len(rows),
        "output": str(plan.output_path),
    }
    if scored:
        rewards = [float(r["reward"]) for r in scored]
        summary["reward_mean"] = mean = sum(rewards) / len(rewards)
        summary["reward_std"] = (sum((x - mean) ** 2 for x in rewards) / max(len(rewards) - 1, 1)) ** 0.5
    return summary


def run_generate(plan: Plan) -> dict:
    """Generate what is missing from the samples file, then write the output; returns the summary."""
    done, note = recover_samples(plan)
    if note:
        print(note, flush=True)
    todo = [p for p in plan.prompts if p["index"] not in done]
    if todo:
        generate_samples(plan, todo)
    summary = finish(plan)
    reward = (
        f"; reward mean {summary['reward_mean']:.4f}, std {summary['reward_std']:.4f}"
        if "reward_mean" in summary
        else ""
    )
    unscorable = f", {summary['unscorable']} unscorable" if summary["unscorable"] else ""
    print(
        f"generate: {summary['samples']} samples of {summary['prompts']} prompts{unscorable}{reward}; "
        f"wrote {summary['rows']} rows to {summary['output']}",
        flush=True,
    )
    return summary


def main(argv: list[str]) -> int:
    from rlhf_core.config_parser import build_argparser, config_to_yaml, parse_config

    if "-h" in argv or "--help" in argv:
        build_argparser("generate").print_help()
        print(
            "\n  --config FILE        YAML file with any of the options above (repeatable)"
            "\n  --dry-run            check everything, print the resolved config and plan, start nothing"
        )
        return 0
    dry_run = "--dry-run" in argv
    try:
        cfg, notes = parse_config("generate", [a for a in argv if a != "--dry-run"])
        the_plan = plan(cfg)
    except UserError as exc:
        print(f"rlhf generate: {exc}", file=sys.stderr)
        return 2
    for note in notes + the_plan.notes:
        print(f"note: {note}", file=sys.stderr)
    if dry_run:
        print("# rlhf generate --dry-run: resolved configuration (nothing was started)")
        print(config_to_yaml(cfg, "generate"), end="")
        print("# " + the_plan.describe().replace("\n", "\n# "))
        return 0
    try:
        run_generate(the_plan)
    except UserError as exc:
        print(f"rlhf generate: {exc}", file=sys.stderr)
        return 1
    return 0
