"""``rlhf serve-rm``: a reward model behind HTTP (``python -m rlhf_agents.serve_rm``), OpenRLHF's
``POST /get_reward`` protocol. The package README ("rlhf serve-rm") describes the flags (OpenRLHF's too), the
safe defaults, limits and errors; query text is never logged."""

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
LOG_LEVELS = ("debug", "info", "warning", "error")


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
    from rlhf_core import config_aliases
    from rlhf_core.config_parser import build_argparser, parse_config
    from rlhf_core.errors import UserError

    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        build_argparser("serve-rm").print_help()
        flat = [*config_aliases.table("serve-rm"), *config_aliases.constants("serve-rm")]
        print("\nOpenRLHF's flat spellings work too: " + ", ".join(f"--{name}" for name in flat))
        return 0
    try:
        cfg, notes = parse_config("serve-rm", argv)
    except UserError as exc:
        print(f"rlhf serve-rm: {exc}", file=sys.stderr)
        return 2
    serve, ds = cfg.serve, cfg.ds
    api_key = serve.api_key or os.environ.get(API_KEY_ENV) or None
    problems = [
        message
        for failed, message in [
            (
                not cfg.reward.model_name_or_path,
                "--reward.model_name_or_path (--reward_pretrain) is required",
            ),
            (
                ds.param_dtype not in ("auto", "bf16", "fp16", "fp32"),
                f"--ds.param_dtype {ds.param_dtype}: choose auto, bf16, fp16 or fp32",
            ),
            (
                serve.log_level not in LOG_LEVELS,
                f"--serve.log_level {serve.log_level}: choose {', '.join(LOG_LEVELS)}",
            ),
            (
                ds.load_in_4bit,
                "--ds.load_in_4bit is not supported by rlhf serve-rm; serve the model in bf16 or fp32",
            ),
        ]
        if failed
    ]
    if refusal := check_bind(serve.host, api_key, serve.insecure):
        problems.append(refusal)
    if problems:
        print("\n".join(f"rlhf serve-rm: {problem}" for problem in problems), file=sys.stderr)
        return 2
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    logging.basicConfig(
        level=serve.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if ds.packing_samples:
        logger.info("--ds.packing_samples has no effect here: batches are padded")
    if not is_loopback(serve.host) and not api_key:
        logger.warning("listening on %s without an API key (--insecure)", serve.host)

    import uvicorn

    from rlhf_agents.reward_model import RewardModelScorer
    from rlhf_core.config import resolve_param_dtype

    scorer = RewardModelScorer(
        cfg.reward.model_name_or_path,
        value_head_prefix=ds.value_head_prefix,
        normalize=cfg.reward.normalize_enable,
        max_len=cfg.data.max_len,
        batch_size=serve.batch_size,
        dtype=resolve_param_dtype(ds.param_dtype),
        attn_implementation=ds.attn_implementation,
        model_kwargs={"experts_implementation": ds.experts_implementation}
        if ds.experts_implementation
        else None,
    )
    app = create_app(
        scorer.score_texts, api_key=api_key, max_body_bytes=serve.max_body_bytes, max_batch=serve.max_batch
    )
    family = socket.AF_INET6 if ":" in serve.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((serve.host, serve.port))
    sock.listen(128)  # clients may connect from here on; uvicorn accepts them once it runs
    host = f"[{serve.host}]" if family == socket.AF_INET6 else serve.host
    print(
        f"rlhf serve-rm: listening on http://{host}:{sock.getsockname()[1]} (API docs at /docs)", flush=True
    )
    uvicorn.Server(uvicorn.Config(app, log_level=serve.log_level)).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
