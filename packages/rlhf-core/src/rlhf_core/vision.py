"""Vision-language models (VLMs): images read from datasets, the model's image processor, image tokens, and
the forward-pass inputs that put image features where those tokens are; see docs/vision-language.md.

A VLM is a model whose config has a ``vision_config`` (:data:`SUPPORTED_MODEL_TYPES`). The text goes through
the tokenizer alone, not transformers' multimodal ``Processor`` (which also needs torchvision for video).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf_core.data import DataError, Row, get_field
from rlhf_core.types import ImageInput

SUPPORTED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
IMAGE_KEYS = ("bytes", "path")  # a dict image: datasets' Image feature as stored in parquet / arrow files


def is_vision_language(config: Any) -> bool:
    """Whether ``config`` (an HF model config) is a vision-language model's."""
    return getattr(config, "vision_config", None) is not None


def vlm_config(path: str) -> Any:
    """The HF config of the VLM at ``path``, or None for a text model; ValueError unless the VLM is of a family
    whose image inputs this module builds."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    if is_vision_language(config) and config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{path} is a vision-language model of type {config.model_type!r}; rlhf trains "
            f"images with {', '.join(SUPPORTED_MODEL_TYPES)} models only"
        )
    return config if is_vision_language(config) else None


def load_model(path: str, **kwargs: Any) -> torch.nn.Module:
    """``from_pretrained`` with the class that holds the whole model: ``AutoModelForImageTextToText`` for a
    VLM (vision tower and language model), ``AutoModelForCausalLM`` otherwise."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    model_class = AutoModelForCausalLM if vlm_config(path) is None else AutoModelForImageTextToText
    return model_class.from_pretrained(path, **kwargs)


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model inside a DeepSpeed engine (``.module``) or a peft wrapper (``.base_model.model``)."""
    model = getattr(model, "module", model)
    return model.base_model.model if hasattr(model, "peft_config") else model


def vision_tower(model: torch.nn.Module) -> torch.nn.Module:
    """The vision encoder of a Qwen-VL model (patch embedding, blocks and the merger into the text width)."""
    return base_model(model).model.visual


# --- reading images from dataset rows ----------------------------------------------------------------------


def _decode(data: bytes, what: str) -> Any:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.convert("RGB")
    except Exception as exc:  # PIL raises many kinds; all mean "not an image we can read"
        raise DataError(f"{what} cannot be read as an image ({type(exc).__name__}: {exc})") from None


def read_image(value: Any, base_dir: Path, where: str) -> Any:
    """One image of a dataset row as an RGB PIL image; ``value`` in any form docs/vision-language.md lists
    (the data file's folder is ``base_dir``). Anything else, a missing file, or data that is not an image
    raises a DataError that starts with ``where`` (file, row, key and image index)."""
    if isinstance(value, dict) and any(value.get(k) is not None for k in IMAGE_KEYS):
        value = value["bytes"] if value.get("bytes") is not None else value["path"]
    if isinstance(value, (bytes, bytearray)):
        return _decode(bytes(value), f"{where}: the embedded bytes")
    if not isinstance(value, str):
        raise DataError(
            f"{where}: expected a path, file:// URL, data URI or bytes, got {type(value).__name__}"
        )
    if value.startswith("data:"):
        try:
            data = base64.b64decode(value.split(",", 1)[1], validate=True)
        except (IndexError, ValueError):
            raise DataError(f"{where}: the data URI is not base64 (data:image/...;base64,...)") from None
        return _decode(data, f"{where}: the data URI")
    if value.startswith(("http://", "https://")):
        raise DataError(
            f"{where}: {value} is a web URL; rlhf reads local files only (download the images first "
            "and give their paths or file:// URLs)"
        )
    path = Path(value.removeprefix("file://")).expanduser()
    if not path.is_absolute() and not path.exists():
        path = base_dir / path
    if not path.is_file():
        raise DataError(
            f"{where}: image file {value} does not exist (looked in the working directory and in {base_dir})"
        )
    return _decode(path.read_bytes(), f"{where}: {path}")


@dataclass(frozen=True)
class ImageRef:
    """Where one image of a dataset row is: read (and checked) when a run loads its prompts, and read again
    each time the prompt is served, so that a run holds the pixels of one step's prompts, not the dataset's."""

    value: Any
    """As the row has it (see :func:`read_image`)."""
    base_dir: Path
    where: str
    """The data file, row, key and image index, for error messages."""

    def read(self) -> Any:
        return read_image(self.value, self.base_dir, self.where)


def row_images(row: Row, key: str, max_images: int) -> list[ImageRef]:
    """The images of ``row[key]`` (one value or a list; None or [] for a text-only row), at most
    ``max_images`` of them (0: any number); DataError naming the file, row and key otherwise."""
    if key not in row.data:
        get_field(row, key, flag="--data.image_key")  # raises: missing key
    value = row.data[key]
    values = [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]
    if max_images and len(values) > max_images:
        raise DataError(
            f"{row.where()}: {len(values)} images in key {key!r}, more than "
            f"--data.max_images_per_prompt {max_images}"
        )
    base_dir = Path(row.file.split("[")[0]).parent
    return [ImageRef(v, base_dir, f"{row.where()}: image {i} of key {key!r}") for i, v in enumerate(values)]


# --- the model's image processor and image tokens ------------------------------------------------------------


@dataclass(eq=False)
class ImageProcessing:
    """A VLM's image processor and image token: images become :class:`ImageInput` s, and each image
    placeholder id of a tokenized text (one per image, as the chat template writes it) becomes the image's
    ``num_tokens`` ids."""

    image_processor: Any
    image_token_id: int
    merge_size: int

    @classmethod
    def for_model(cls, path: str) -> ImageProcessing | None:
        """The image processing of the model at ``path``, or None for a text model."""
        from transformers import AutoImageProcessor

        if (config := vlm_config(path)) is None:
            return None
        try:
            image_processor = AutoImageProcessor.from_pretrained(path)
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"{path}: no image processor could be loaded ({exc}); a VLM directory needs its "
                "preprocessor_config.json"
            ) from None
        return cls(image_processor, config.image_token_id, config.vision_config.spatial_merge_size)

    @classmethod
    def from_pretrained(cls, path: str) -> ImageProcessing:
        """From a model directory with an image processor config (``preprocessor_config.json``)."""
        if (found := cls.for_model(path)) is None:
            raise ValueError(
                f"{path} is not a vision-language model (its config.json has no vision_config), so it "
                "cannot read images (--data.image_key)"
            )
        return found

    def process(self, images: Sequence[Any]) -> list[ImageInput]:
        """One :class:`ImageInput` per image (the processor runs once over all of them)."""
        if not images:
            return []
        out = self.image_processor(images=list(images), return_tensors="pt")
        grids = out["image_grid_thw"]
        patches = torch.split(out["pixel_values"], grids.prod(-1).tolist())
        return [
            ImageInput(pixel_values=p, grid_thw=g, num_tokens=int(g.prod()) // self.merge_size**2, image=img)
            for p, g, img in zip(patches, grids, images, strict=True)
        ]

    def expand(self, ids: Sequence[int], images: Sequence[ImageInput]) -> list[int]:
        """``ids`` with the k-th image placeholder repeated ``images[k].num_tokens`` times; ValueError when the
        number of placeholders is not the number of images."""
        found = list(ids).count(self.image_token_id)
        if found != len(images):
            raise ValueError(f"the text has {found} image placeholders for {len(images)} images")
        sizes = iter([im.num_tokens for im in images])
        return [x for t in ids for x in ([t] * next(sizes) if t == self.image_token_id else [t])]


def collapse_image_tokens(ids: Sequence[int], image_token_id: int) -> list[int]:
    """``ids`` with each run of image tokens back to one placeholder: the text as the chat template wrote it
    (what reward functions see as the prompt, and what vLLM expects with its images)."""
    return [t for k, t in enumerate(ids) if t != image_token_id or k == 0 or ids[k - 1] != image_token_id]


def count_image_tokens(ids: Sequence[int], images: Sequence[ImageInput], image_token_id: int) -> str | None:
    """Why ``ids`` and ``images`` do not fit together (None when the image tokens are the images')."""
    found = list(ids).count(image_token_id)
    want = sum(im.num_tokens for im in images)
    return f"{found} image tokens for {len(images)} images of {want} tokens" if found != want else None


# --- forward passes ---------------------------------------------------------------------------------------


def image_forward_inputs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    images: Sequence[Sequence[ImageInput]],
) -> tuple[dict, torch.Tensor]:
    """Keyword arguments that make ``model(input_ids=..., attention_mask=..., **kwargs)`` see each row's
    images, and the ``[B, 1]`` M-RoPE offset of each row.

    ``input_ids``/``attention_mask`` ``[B, L]`` (padding on either side); ``images[b]`` lists row ``b``'s
    images in the order of their tokens. Each distinct image (by identity: the samples of a group share
    theirs) goes through the vision tower once, with gradients only where the tower trains; its features
    fill the image tokens of every row that has it (``mm_encoder_outputs``). ``position_ids`` ``[3, B, L]``
    are M-RoPE's: text tokens count up by one, an image's tokens share its start in time and spread over
    its grid in height and width. The next text token of row ``b`` after position ``L_b - 1`` of its real
    tokens has position ``L_b + offset[b]`` on all three axes, which is how a decoder continues.
    """
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    hf = base_model(model)
    image_token_id = hf.config.image_token_id
    for b, row in enumerate(images):
        mismatch = count_image_tokens(input_ids[b][attention_mask[b].bool()].tolist(), row, image_token_id)
        if mismatch:
            raise ValueError(f"sequence {b} of the batch has {mismatch}")
    distinct = {id(im): im for row in images for im in row}
    kwargs = {}
    grids = None
    if distinct:
        train_tower = torch.is_grad_enabled() and any(p.requires_grad for p in hf.model.visual.parameters())
        pixels = torch.cat([im.pixel_values for im in distinct.values()]).to(input_ids.device)
        grid = torch.stack([im.grid_thw for im in distinct.values()]).to(input_ids.device)
        with torch.set_grad_enabled(train_tower):
            features = hf.model.get_image_features(pixels, grid, return_dict=True).pooler_output
        by_id = dict(zip(distinct, features, strict=True))
        per_row = tuple(by_id[id(im)] for row in images for im in row)
        kwargs["mm_encoder_outputs"] = {"image": BaseModelOutputWithPooling(pooler_output=per_row)}
        grids = torch.stack([im.grid_thw for row in images for im in row]).to(input_ids.device)
    kwargs["position_ids"], offsets = hf.model.get_rope_index(
        input_ids,
        mm_token_type_ids=(input_ids == image_token_id).int(),
        image_grid_thw=grids,
        attention_mask=attention_mask,
    )
    return kwargs, offsets
