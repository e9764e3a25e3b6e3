"""RL prompts: read, formatted and tokenized once, then served in a seeded, resumable order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from rlhf_core import data, vision
from rlhf_core.config import opd_teachers
from rlhf_core.types import ImageInput, derive_seed


@dataclass(frozen=True)
class Prompt:
    uid: int
    """Position in the prepared prompt list: stable for the same data, so resume and filtering key on it."""
    ids: list[int]
    """Token ids, each image's placeholder already repeated once per image token."""
    text: str
    label: Any = None
    images: tuple[vision.ImageRef, ...] = ()
    """Where the prompt's images are (``--data.image_key``); read and processed when the prompt is served."""
    teacher: int = 0
    """Multi-teacher OPD: which of ``--algo.opd.teachers`` scores this prompt's samples (its column)."""

    def image_inputs(self, processing: vision.ImageProcessing | None) -> list[ImageInput]:
        """The prompt's images as the model's image processor makes them (one object per image, which every
        sample of the prompt then shares)."""
        if not self.images:
            return []
        return processing.process([ref.read() for ref in self.images])


def prompt_budget(cfg) -> int:
    """Most prompt tokens: ``--data.prompt_max_len``, else what ``--data.max_len`` leaves after generation."""
    if cfg.data.prompt_max_len:
        return cfg.data.prompt_max_len
    budget = cfg.data.max_len - cfg.rollout.max_new_tokens
    if budget < 1:
        raise data.DataError(
            f"--data.max_len ({cfg.data.max_len}) leaves no room for a prompt after "
            f"--rollout.max_new_tokens ({cfg.rollout.max_new_tokens}); set --data.prompt_max_len"
        )
    return budget


def load_prompts(
    cfg,
    tokenizer,
    paths=None,
    probs=None,
    split=None,
    max_samples=None,
    stats: data.DataStats | None = None,
    images: vision.ImageProcessing | None = None,
) -> list[Prompt]:
    """Read the prompt datasets of ``cfg`` (or ``paths``), render, tokenize and fit each prompt.

    Rows with a missing or mistyped key fail naming file, row and key, unless ``--data.skip_bad_rows``
    skips and counts them; overlong prompts follow ``--data.overlong_prompt_policy``.

    With ``--data.image_key`` (``images``: the model's image processing) each row's images are read and
    processed once here, so that a missing or unreadable image fails before anything starts; the prompt
    keeps where they are, and its ids hold each image's tokens (where a prompt places them:
    docs/vision-language.md).
    """
    d = cfg.data
    rows = data.load_rows(
        paths or d.prompt_dataset or [],
        probs if paths else d.prompt_probs,
        split or d.prompt_split,
        seed=cfg.train.seed,
        max_samples=max_samples or d.max_samples,
    )
    budget = prompt_budget(cfg)
    teachers = list(opd_teachers(cfg))
    stats = stats if stats is not None else data.DataStats()
    prompts: list[Prompt] = []
    for row in rows:
        refs: list[vision.ImageRef] = []
        try:
            raw = data.get_field(row, d.input_key, (str, list), "--data.input_key")
            if d.image_key:
                refs = vision.row_images(row, d.image_key, d.max_images_per_prompt)
            if isinstance(raw, list):
                data.check_messages(raw, row, d.input_key, parts=bool(d.image_key))
            elif refs and d.apply_chat_template:
                raw = [
                    {
                        "role": "user",
                        "content": [{"type": "image"}] * len(refs) + [{"type": "text", "text": raw}],
                    }
                ]
            label = data.get_field(row, d.label_key, object, "--data.label_key") if d.label_key else None
            teacher = 0
            if teachers and paths is None:  # training prompts; evaluation computes no teacher log-probs
                name = data.get_field(row, cfg.algo.opd.teacher_key, str, "--algo.opd.teacher_key")
                if name not in teachers:
                    raise data.DataError(
                        f"{row.where()}: teacher {name!r} (key {cfg.algo.opd.teacher_key!r}) is not "
                        f"one of --algo.opd.teachers: {', '.join(teachers)}"
                    )
                teacher = teachers.index(name)
            text = data.render_prompt(tokenizer, raw, d.input_template, d.apply_chat_template)
            ids = data.encode(tokenizer, text)
            if d.image_key:
                pictures = images.process([ref.read() for ref in refs])
                try:
                    ids = images.expand(ids, pictures)
                except ValueError as exc:
                    raise data.DataError(
                        f"{row.where()}: {exc} (key {d.input_key!r}; a chat template writes one placeholder per "
                        "{'type': 'image'} item, a prompt used as it is must contain them itself)"
                    ) from None
        except data.DataError:
            if not d.skip_bad_rows:
                raise
            stats.add("bad_rows_skipped")
            continue
        if refs and len(ids) > budget and d.overlong_prompt_policy == "truncate_left":
            raise data.DataError(
                f"{row.where()}: the prompt has {len(ids)} tokens with its images, more than the {budget} allowed, "
                "and a prompt with images cannot be cut (its image tokens would be); use "
                "--data.overlong_prompt_policy skip or a larger --data.prompt_max_len"
            )
        ids = data.fit_prompt(ids, budget, d.overlong_prompt_policy, row.where(), stats)
        if ids is None:
            continue
        prompts.append(Prompt(len(prompts), ids, text, label, tuple(refs), teacher))
    if not prompts:
        raise data.DataError(f"no usable prompts in {', '.join(paths or d.prompt_dataset or [])}")
    return prompts


class PromptStream:
    """Serves prompts episode after episode, each episode in its own seeded order.

    The position is the whole state: ``state_dict()`` taken after a step and loaded into a new stream
    serves exactly the prompts the uninterrupted run would have served next.
    """

    def __init__(self, prompts: list[Prompt], seed: int, num_episodes: int = 1):
        self.prompts = prompts
        self.seed = seed
        self.num_episodes = num_episodes
        self.episode = 0
        self.position = 0
        self._order = self._order_of(0)

    def _order_of(self, episode: int) -> np.ndarray:
        return np.random.default_rng(derive_seed(self.seed, "episode", episode)).permutation(
            len(self.prompts)
        )

    @property
    def exhausted(self) -> bool:
        return self.episode >= self.num_episodes

    def take(self, k: int) -> list[Prompt]:
        """The next ``k`` prompts, fewer (or none) once the last episode runs out."""
        out: list[Prompt] = []
        while len(out) < k and not self.exhausted:
            n = min(k - len(out), len(self.prompts) - self.position)
            out += [self.prompts[i] for i in self._order[self.position : self.position + n]]
            self.position += n
            if self.position == len(self.prompts):
                self.episode, self.position = self.episode + 1, 0
                self._order = self._order_of(self.episode)
        return out

    def total_steps(self, batch_size: int) -> int:
        return -(-len(self.prompts) * self.num_episodes // batch_size)

    def state_dict(self) -> dict:
        return {"episode": self.episode, "position": self.position, "num_prompts": len(self.prompts)}

    def load_state_dict(self, state: dict) -> None:
        if state["num_prompts"] != len(self.prompts):
            raise ValueError(
                f"the checkpoint was taken with {state['num_prompts']} prompts but the data now has "
                f"{len(self.prompts)}: resuming would serve different prompts (check --data.prompt_dataset)"
            )
        self.episode, self.position = state["episode"], state["position"]
        self._order = self._order_of(self.episode)
