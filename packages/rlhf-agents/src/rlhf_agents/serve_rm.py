"""``rlhf serve-rm``: a reward model behind HTTP (``python -m rlhf_agents.serve_rm``), OpenRLHF's
``POST /get_reward`` protocol. The package README ("rlhf serve-rm") describes the flags (OpenRLHF's too), the
safe defaults, limits and errors; query text is never logged."""

import argparse
import hmac
import ipaddress
import json
import logging
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("rlhf_agents.serve_rm")

API_KEY_ENV = "RLHF_RM_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlhf serve-rm", description="Serve a reward model over HTTP.")
    p.add_argument(
        "--reward.model_name_or_path",
        "--reward_pretrain",
        dest="model_name_or_path",
        required=True,
        help="Local HF reward model (AutoModelForSequenceClassification with value head 'score').",
    )
    p.add_argument(
        "--reward.normalize_enable",
        "--normalize_reward",
        dest="normalize",
        action="store_true",
        help="Return (r - mean) / std with the mean/std stored in the model's config.",
    )
    p.add_argument(
        "--ds.value_head_prefix",
        "--value_head_prefix",
        dest="value_head_prefix",
        default="score",
        help="Name of the value head module.",
    )
    p.add_argument(
        "--data.max_len",
        "--max_len",
        dest="max_len",
        type=int,
        default=2048,
        help="Most tokens per query; longer queries keep their last max_len tokens.",
    )
    p.add_argument("--port", type=int, default=5000, help="Port (0: any free port; the address is printed).")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="Interface to listen on. Anything but loopback needs --api_key or --insecure.",
    )
    p.add_argument("--batch_size", type=int, default=16, help="Queries per forward pass.")
    p.add_argument(
        "--ds.param_dtype",
        "--param_dtype",
        dest="param_dtype",
        default="auto",
        choices=["auto", "bf16", "fp16", "fp32"],
        help="Model precision (auto: bf16 on a GPU, fp32 on CPU).",
    )
    p.add_argument(
        "--bf16",
        dest="param_dtype",
        action="store_const",
        const="bf16",
        help="Same as --ds.param_dtype bf16.",
    )
    p.add_argument(
        "--ds.attn_implementation",
        "--attn_implementation",
        dest="attn_implementation",
        default="sdpa",
        help="HF attention implementation: eager, sdpa, flash_attention_2.",
    )
    p.add_argument(
        "--flash_attn",
        dest="attn_implementation",
        action="store_const",
        const="flash_attention_2",
        help="Same as --ds.attn_implementation flash_attention_2.",
    )
    p.add_argument(
        "--ds.experts_implementation",
        dest="experts_implementation",
        default=None,
        help="MoE experts implementation passed to transformers.",
    )
    p.add_argument(
        "--data.disable_fast_tokenizer",
        "--disable_fast_tokenizer",
        dest="disable_fast_tokenizer",
        action="store_true",
        help="Load the slow tokenizer.",
    )
    p.add_argument(
        "--ds.packing_samples",
        "--packing_samples",
        dest="packing_samples",
        action="store_true",
        help="Accepted for OpenRLHF scripts; no effect (batches are padded).",
    )
    p.add_argument(
        "--ds.load_in_4bit",
        "--load_in_4bit",
        dest="load_in_4bit",
        action="store_true",
        help="Not supported: refused with a message.",
    )
    p.add_argument(
        "--use_ms", action="store_true", help="Not supported (ModelScope): refused with a message."
    )
    p.add_argument(
        "--api_key",
        "--api-key",
        dest="api_key",
        default=None,
        help=f"Require 'Authorization: Bearer KEY' on /get_reward (default: ${API_KEY_ENV}).",
    )
    p.add_argument("--insecure", action="store_true", help="Allow a non-loopback --host without an API key.")
    p.add_argument(
        "--max_body_bytes", type=int, default=8 * 1024 * 1024, help="Larger request bodies get 413."
    )
    p.add_argument("--max_batch", type=int, default=1024, help="Requests with more queries get 422.")
    p.add_argument("--log_level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None, insecure: bool) -> str | None:
    """Why listening on ``host`` is refused, or None when it is allowed."""
    if is_loopback(host) or api_key or insecure:
        return None
    return (
        f"refusing to listen on {host} without an API key: anyone who can reach this machine could use the "
        f"reward model. Give --api_key KEY (or set ${API_KEY_ENV}), or --insecure to accept that."
    )


def create_app(
    score_texts: Callable[[list[str]], list[float]],
    api_key: str | None = None,
    max_body_bytes: int = 8 * 1024 * 1024,
    max_batch: int = 1024,
) -> Any:
    """The FastAPI app; ``score_texts`` runs in a worker thread, one call at a time."""
    from fastapi import FastAPI, Request
    from fastapi.concurrency import run_in_threadpool
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel

    from rlhf_agents import __version__

    class RewardQuery(BaseModel):
        query: list[str]
        """Prompt + response texts, one per sample."""
        prompts: list[str] | None = None
        labels: list[Any] | None = None

    class RewardAnswer(BaseModel):
        rewards: list[float | None]
        scores: list[float | None]
        extra_logs: dict[str, list[float]]

    app = FastAPI(
        title="rlhf serve-rm",
        version=__version__,
        description="A reward model over HTTP: POST /get_reward scores prompt+response texts.",
    )
    model_lock = threading.Lock()  # one forward pass at a time; the model is not re-entrant
    schema = {"application/json": {"schema": RewardQuery.model_json_schema()}}

    def scored(texts: list[str]) -> list[float]:
        with model_lock:
            return score_texts(texts)

    def fail(status: int, message: str, **headers: str) -> JSONResponse:
        return JSONResponse({"detail": message}, status_code=status, headers=headers or None)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.post(
        "/get_reward",
        response_model=RewardAnswer,
        responses={400: {}, 401: {}, 413: {}, 422: {}},
        openapi_extra={"requestBody": {"required": True, "content": schema}},
    )
    async def get_reward(request: Request) -> Any:
        if api_key is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return fail(
                    401,
                    "missing or wrong API key (send 'Authorization: Bearer KEY')",
                    **{"WWW-Authenticate": "Bearer"},
                )
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > max_body_bytes:
            return fail(413, f"the body has {length} bytes; the limit is {max_body_bytes} (--max_body_bytes)")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                return fail(413, f"the body is over the limit of {max_body_bytes} bytes (--max_body_bytes)")
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            return fail(400, f"the body is not UTF-8 text: byte {body[exc.start]:#04x} at offset {exc.start}")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            return fail(400, f"the body is not valid JSON: {exc}")
        except RecursionError:  # json gives up past Python's recursion limit (about 1000 levels)
            return fail(400, 'the body nests JSON arrays or objects too deeply; send {"query": [text, ...]}')
        except ValueError as exc:  # e.g. an integer of more than 4300 digits
            return fail(400, f"the body holds a number that cannot be read ({exc})")
        if not isinstance(data, dict):
            return fail(400, "the body must be a JSON object with a 'query' list")
        queries = data.get("query")
        if not isinstance(queries, list):
            return fail(400, "'query' must be a list of strings")
        if len(queries) > max_batch:
            return fail(422, f"{len(queries)} queries in one request; the limit is {max_batch} (--max_batch)")
        for i, query in enumerate(queries):
            if not isinstance(query, str) or not query.strip():
                return fail(400, f"query[{i}] must be a non-empty string")
            try:  # JSON escapes can spell a lone surrogate ("\ud800"), which no tokenizer can encode
                query.encode("utf-8")
            except UnicodeEncodeError as exc:
                return fail(
                    400,
                    f"query[{i}] is not valid Unicode: a lone surrogate "
                    f"\\u{ord(query[exc.start]):04x} at character {exc.start}",
                )
        for key in ("prompts", "labels"):
            extra = data.get(key)
            if extra is not None and (not isinstance(extra, list) or len(extra) != len(queries)):
                return fail(400, f"'{key}' must be a list as long as 'query' ({len(queries)})")
        start = time.perf_counter()
        rewards = await run_in_threadpool(scored, queries) if queries else []
        logger.info("scored %d queries in %.3f s", len(queries), time.perf_counter() - start)
        rewards = [r if math.isfinite(r) else None for r in rewards]
        return {"rewards": rewards, "scores": rewards, "extra_logs": {}}

    return app


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    problem = check_bind(args.host, api_key, args.insecure)
    if args.load_in_4bit:
        problem = "--ds.load_in_4bit is not supported by rlhf serve-rm; serve the model in bf16 or fp32"
    if args.use_ms:
        problem = "--use_ms (ModelScope) is not supported; pass a local model directory"
    if problem:
        print(f"rlhf serve-rm: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.packing_samples:
        logger.info("--ds.packing_samples has no effect here: batches are padded")
    if not is_loopback(args.host) and not api_key:
        logger.warning("listening on %s without an API key (--insecure)", args.host)

    import uvicorn

    from rlhf_agents.reward_model import RewardModelScorer
    from rlhf_core.config import resolve_param_dtype

    experts = args.experts_implementation
    scorer = RewardModelScorer(
        args.model_name_or_path,
        value_head_prefix=args.value_head_prefix,
        normalize=args.normalize,
        max_len=args.max_len,
        batch_size=args.batch_size,
        dtype=resolve_param_dtype(args.param_dtype),
        attn_implementation=args.attn_implementation,
        use_fast_tokenizer=not args.disable_fast_tokenizer,
        model_kwargs={"experts_implementation": experts} if experts else None,
    )
    app = create_app(
        scorer.score_texts, api_key=api_key, max_body_bytes=args.max_body_bytes, max_batch=args.max_batch
    )
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(128)  # clients may connect from here on; uvicorn accepts them once it runs
    host = f"[{args.host}]" if family == socket.AF_INET6 else args.host
    print(
        f"rlhf serve-rm: listening on http://{host}:{sock.getsockname()[1]} (API docs at /docs)", flush=True
    )
    uvicorn.Server(uvicorn.Config(app, log_level=args.log_level)).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
