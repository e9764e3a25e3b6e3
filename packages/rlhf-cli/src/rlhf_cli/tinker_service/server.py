"""``rlhf serve-tinker``: the HTTP face of :class:`~rlhf_cli.tinker_service.service.TinkerService`, speaking the
wire format of the ``tinker`` SDK (JSON bodies; protobuf for ``forward_backward`` requests and for
``ForwardBackwardOutput`` / ``SampleResponse`` results, with the message classes the SDK ships). The client
config this server hands out turns off zstd bodies, the pyqwest transport, JWT exchange and parallel
chunks. docs/tinker.md lists every SDK method with served / refused."""

from __future__ import annotations

import argparse
import hmac
import importlib.util
import json
import logging
import os
import sys
from concurrent.futures import TimeoutError as FutureTimeout
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import torch

from rlhf_cli.tinker_service.service import Datum, TinkerService, UserError, check

logger = logging.getLogger("rlhf.serve_tinker")
API_KEY_ENV = "RLHF_TINKER_API_KEY"
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "use_pyqwest_transport": False,
    "proto_compress_fwdbwd": False,
    "parallel_fwdbwd_chunks": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}


def decode_datums(body: bytes) -> tuple[str, str, dict, bool, list[Datum]]:
    """A protobuf ``ForwardBackwardRequest``: model id, loss name, loss config, forward_only, the datums."""
    from tinker.proto import tinker_public_pb2 as pb

    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:
        raise UserError(
            f"forward_backward: the body is not a ForwardBackwardRequest protobuf ({exc})"
        ) from exc
    config = {k: v.number for k, v in msg.loss_fn_config_v2.items()} or dict(msg.loss_fn_config)
    check(all(not v.HasField("text") for v in msg.loss_fn_config_v2.values()), "loss_fn_config: numbers only")
    datums = []
    for i, d in enumerate(msg.data):
        check(
            all(c.HasField("encoded_text") for c in d.model_input), f"datum {i}: only text chunks are served"
        )
        tokens = [t for c in d.model_input for t in np.frombuffer(c.encoded_text.tokens, np.int32).tolist()]
        inputs = {}
        for name, t in d.loss_fn_inputs.items():
            check(t.HasField("dense"), f"datum {i}: {name} is sparse; send dense tensors")
            dtype = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64}.get(t.dtype)
            check(dtype is not None, f"datum {i}: {name} must be float32 or int64")
            inputs[name] = torch.from_numpy(np.frombuffer(t.dense, dtype).copy())
        targets = inputs.pop("target_tokens", None)
        check(
            targets is not None and len(targets) == len(tokens), f"datum {i}: target_tokens [N] are required"
        )
        check(
            targets[:-1].tolist() == tokens[1:],
            f"datum {i}: target_tokens must be model_input shifted by one (next-token targets)",
        )
        inputs = {k: v.float() for k, v in inputs.items()}
        datums.append(Datum(tokens + targets[-1:].tolist(), inputs))
    return msg.model_id, msg.loss_fn, config, msg.forward_only, datums


def encode_result(result: dict) -> bytes | dict:
    """A finished operation's result: ``ForwardBackwardOutput`` and ``SampleResponse`` as protobuf (the SDK
    takes no JSON for those), the rest as JSON."""
    from tinker.proto import tinker_public_pb2 as pb

    if "outputs" in result:
        msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=result["metrics"])
        record = msg.loss_fn_outputs.add(num_datums=len(result["outputs"]))
        sizes = [0] + [len(r) * 4 for r in result["outputs"]]
        field = record.fields["logprobs"]
        field.dtype = pb.DTYPE_FLOAT32
        field.data = b"".join(r.numpy().astype(np.float32).tobytes() for r in result["outputs"])
        field.offsets = np.cumsum(sizes, dtype=np.int64).tobytes()
        return msg.SerializeToString()
    if "sequences" in result:
        msg = pb.SampleResponse()
        for out in result["sequences"]:
            msg.sequences.add(
                stop_reason=pb.STOP_REASON_STOP if out.finish_reason == "stop" else pb.STOP_REASON_LENGTH,
                tokens=np.asarray(out.token_ids, np.int32).tobytes(),
                logprobs=np.asarray(out.logprobs, np.float32).tobytes(),
            )
        if "prompt_logprobs" in result:
            msg.prompt_logprobs = result["prompt_logprobs"].numpy().astype(np.float32).tobytes()
        return msg.SerializeToString()
    return result


def capabilities(s: TinkerService, r: dict) -> dict:
    model = {"model_name": s.base, "max_context_length": s.max_len, "trainable": True, "sampleable": True}
    return {"supported_models": [model]}


def create_sampling_session(s: TinkerService, r: dict) -> dict:
    seq, path = r["sampling_session_seq_id"], r.get("model_path")
    sampler = s.create_sampler(r["session_id"], seq, path, r.get("base_model"))
    return {"type": "create_sampling_session", "sampling_session_id": sampler}


def no_ttl(r: dict) -> None:
    check(r.get("ttl_seconds") is None, "ttl_seconds: checkpoints here stay until their directory is deleted")


def save_state(s: TinkerService, r: dict) -> dict:
    no_ttl(r)
    return s.save_state(r["model_id"], r.get("path"), bool(r.get("overwrite")))


def save_for_sampler(s: TinkerService, r: dict) -> dict:
    check(
        r.get("kind", "snapshot") == "snapshot",
        "kind='inflight' sampling clients are not served; use snapshot",
    )
    no_ttl(r)
    return s.save_for_sampler(r["model_id"], r.get("path"), r.get("sampling_session_seq_id"))


def create_model(s: TinkerService, r: dict) -> dict:
    s.check_base(r["base_model"])
    optimizer = (r.get("optimizer_config") or {}).get("type", "adamw")
    check(optimizer == "adamw", f"optimizer {optimizer!r} is not implemented; only adamw")
    return s.create_model(r["session_id"], r["model_seq_id"], r.get("lora_config"))


def get_info(s: TinkerService, model_id: str) -> dict:
    model = s.model(model_id)
    arch = (s.config.architectures or [s.config.model_type])[0]
    return {
        "type": "get_info",
        "model_id": model_id,
        "model_data": {"arch": arch, "model_name": s.base, "tokenizer_id": s.base},
        "is_lora": True,
        "lora_rank": model.lora["rank"],
        "model_name": s.base,
    }


def forward_backward(s: TinkerService, body: bytes) -> dict:
    model_id, loss_fn, config, forward_only, datums = decode_datums(body)
    return s.forward_backward(model_id, loss_fn, config, datums, forward_only)


def asample(s: TinkerService, r: dict) -> dict:
    refused = [k for k in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k") if r.get(k)]
    refused += [k for k in ("target_prompt_logprobs", "prompt_logprobs_last_n") if r.get(k) is not None]
    refused += ["record_stability_info"] if r.get("record_stability_info") else []
    check(not refused, f"asample: {', '.join(refused)} not served (docs/tinker.md)")
    check(r.get("sampling_session_id") is not None, "asample: sampling_session_id is required")
    chunks = r["prompt"]["chunks"]
    check(
        all(c.get("type", "encoded_text") == "encoded_text" for c in chunks), "only text prompts are served"
    )
    prompt = [t for c in chunks for t in c["tokens"]]
    return s.sample(
        r["sampling_session_id"],
        prompt,
        int(r.get("num_samples", 1)),
        r["sampling_params"],
        bool(r.get("prompt_logprobs")),
    )


def retrieve(s: TinkerService, request_id: str):
    try:
        return encode_result(s.retrieve(request_id))
    except FutureTimeout:
        return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
    except UserError as exc:
        if exc.status == 404 and "request_id" in str(exc):
            raise
        return {"error": str(exc), "category": "user"}
    except Exception as exc:  # noqa: BLE001 - the operation's failure is the future's result
        logger.exception("request %s failed", request_id)
        return {"error": f"{type(exc).__name__}: {exc}", "category": "server"}


ROUTES = {  # path -> handler(service, JSON body); forward_backward takes the raw protobuf body
    "/api/v1/healthz": lambda s, r: {"status": "ok"},
    "/api/v1/client/config": lambda s, r: CLIENT_CONFIG,
    "/api/v1/client/dynamic_config": lambda s, r: {},
    "/api/v1/telemetry": lambda s, r: {"status": "accepted"},
    "/api/v1/get_server_capabilities": capabilities,
    "/api/v1/create_session": lambda s, r: {"type": "create_session", "session_id": s.create_session()},
    "/api/v1/session_heartbeat": lambda s, r: s.heartbeat(r["session_id"]) or {"type": "session_heartbeat"},
    "/api/v1/create_model": create_model,
    "/api/v1/get_info": lambda s, r: get_info(s, r["model_id"]),
    "/api/v1/forward_backward": forward_backward,
    "/api/v1/optim_step": lambda s, r: s.optim_step(r["model_id"], r.get("adam_params")),
    "/api/v1/save_weights": save_state,
    "/api/v1/load_weights": lambda s, r: s.load_state(
        r["path"], bool(r["optimizer"]), r.get("model_id"), r.get("session_id"), r.get("model_seq_id", 0)
    ),
    "/api/v1/save_weights_for_sampler": save_for_sampler,
    "/api/v1/create_sampling_session": create_sampling_session,
    "/api/v1/asample": asample,
    "/api/v1/retrieve_future": lambda s, r: retrieve(s, r["request_id"]),
}


def make_handler(service: TinkerService, api_key: str | None, max_body: int):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the SDK polls futures over one connection

        def log_message(self, fmt, *args):
            logger.debug("%s " + fmt, self.address_string(), *args)

        def do_GET(self):
            self.do_POST()

        def do_POST(self):
            try:
                status, payload = 200, self.dispatch()
            except UserError as exc:
                status, payload = exc.status, {"detail": str(exc)}
            except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
                status, payload = 400, {"detail": f"bad request to {self.path}: {type(exc).__name__}: {exc}"}
            except Exception as exc:  # noqa: BLE001 - the client gets a message rather than a dropped connection
                logger.exception("%s failed", self.path)
                status, payload = 500, {"detail": f"{type(exc).__name__}: {exc}"}
            proto = isinstance(payload, bytes)
            data = payload if proto else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/x-protobuf" if proto else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def dispatch(self):
            length = int(self.headers.get("Content-Length") or 0)
            self.close_connection = True  # until the body is read: a refused one is never read
            if api_key is not None and self.path != "/api/v1/healthz":
                given = self.headers.get("X-API-Key", "")
                check(hmac.compare_digest(given.encode(), api_key.encode()), "missing or wrong API key", 401)
            check(
                length <= max_body,
                f"the body has {length} bytes; the limit is {max_body} (--max_body_bytes)",
                413,
            )
            body = self.rfile.read(length)
            self.close_connection = False
            check(not self.headers.get("Content-Encoding"), "compressed bodies are not accepted", 415)
            path = self.path.split("?")[0]
            if path.startswith("/api/v1/samplers/"):
                sampler = path.removeprefix("/api/v1/samplers/")
                check(sampler in service.samplers, f"unknown sampler {sampler!r}", 404)
                return {
                    "sampler_id": sampler,
                    "base_model": service.base,
                    "model_path": service.samplers[sampler],
                }
            check(path in ROUTES, f"{path} is not served by rlhf serve-tinker (docs/tinker.md)", 404)
            if path == "/api/v1/forward_backward":
                check(
                    "protobuf" in self.headers.get("Content-Type", ""), "forward_backward takes protobuf", 415
                )
                return ROUTES[path](service, body)
            return ROUTES[path](service, json.loads(body or b"{}"))

    return Handler


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlhf serve-tinker", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--base_model", required=True, help="Local HF model directory (or hub id) the LoRA models train on."
    )
    p.add_argument("--host", default="127.0.0.1", help="Interface; anything but loopback needs --api_key.")
    p.add_argument("--port", type=int, default=8000, help="Port (0: any free port; the address is printed).")
    p.add_argument(
        "--api_key", default=None, help=f"Key the clients send as TINKER_API_KEY (or ${API_KEY_ENV})."
    )
    p.add_argument("--workdir", default="tinker-service", help="Where save_state writes checkpoints.")
    p.add_argument(
        "--param_dtype", default="auto", choices=["auto", "bf16", "fp32"], help="auto: bf16 on GPU."
    )
    p.add_argument("--micro_batch_size", type=int, default=16, help="Datums per forward pass.")
    p.add_argument("--max_body_bytes", type=int, default=256 * 2**20, help="Larger request bodies get 413.")
    p.add_argument("--log_level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def serve(
    service: TinkerService, host: str, port: int, api_key: str | None, max_body: int
) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), make_handler(service, api_key, max_body))
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> int:
    from rlhf_agents.serve_rm import is_loopback

    args = build_parser().parse_args(argv)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    problem = None
    if not is_loopback(args.host) and not api_key:
        problem = f"refusing to listen on {args.host} without --api_key (or ${API_KEY_ENV})"
    elif api_key is not None and not api_key.startswith("tml-"):
        problem = "the tinker SDK only sends keys that start with 'tml-'"
    elif importlib.util.find_spec("tinker") is None:  # its message classes are the wire format
        problem = "it needs the tinker SDK: pip install 'rlhf-cli[tinker]'"
    if problem:
        print(f"rlhf serve-tinker: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    service = TinkerService(args.base_model, args.workdir, args.param_dtype, args.micro_batch_size)
    server = serve(service, args.host, args.port, api_key, args.max_body_bytes)
    host, port = server.server_address[:2]
    print(f"rlhf serve-tinker: serving {args.base_model} at http://{host}:{port}", flush=True)
    print(
        f"  export TINKER_BASE_URL=http://{host}:{port} TINKER_API_KEY={api_key or 'tml-local'}", flush=True
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0
