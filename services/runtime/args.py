"""Command-line flags every worker shares, each also readable from an environment variable.

A flag `--kv-cache-bytes` reads `RACKSERVE_KV_CACHE_BYTES` when it is not given on the command line, so the same
names work in a shell, in a container's env and in the Helm values. `--help` shows each flag's variable.

This room only declares flags and turns them into typed config; it must never start anything.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Callable
from typing import Any

from services.engine.config import (
    ATTENTION_BACKENDS,
    NVFP4_GEMMS,
    NVFP4_LOAD_METHODS,
    SUPPORTED_DTYPES,
    SUPPORTED_QUANT,
    TIER2_CODECS,
    EngineConfig,
)
from services.kvtransfer.nixl import nixl_installed
from services.kvtransfer.ticket import TransferConfig

ENV_PREFIX = "RACKSERVE_"
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
TOPOLOGY_LABELS = ("node", "rack", "zone")
# 16 k tokens of an 8B model's bf16 KV, kept for device-direct readers / pulled device-direct and not yet written
DEFAULT_KV_DEVICE_COPY_BYTES = 2 << 30
DEFAULT_KV_DEVICE_PULL_BYTES = 2 << 30


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def client_api_key() -> str:
    """The Bearer key a client command (`rackserve timeline`, `rackserve bench run`) sends by default: $OPENAI_API_KEY
    (what OpenAI clients read), else the first of $RACKSERVE_API_KEY (what `rackserve up` and the frontend read)."""
    return os.environ.get("OPENAI_API_KEY") or os.environ.get("RACKSERVE_API_KEY", "").split(",")[0].strip()


def port_number(raw: str) -> int:
    """A TCP port, 0 (an ephemeral one) to 65535: grpc would bind 99999 mod 65536 without a word."""
    port = int(raw)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{raw} is no port (0 to 65535; 0: an ephemeral one)")
    return port


def port_or_off(raw: str) -> int:
    """A port, or -1 for off."""
    return -1 if int(raw) == -1 else port_number(raw)


def add_flag(
    group: argparse._ArgumentGroup,
    flag: str,
    default: Any,
    help: str,
    type: Callable[[str], Any] = str,
    choices: tuple[str, ...] | None = None,
) -> None:
    """Add `flag` to group, its default read from RACKSERVE_<FLAG> when that variable is set. The variable's text is
    converted when this parser parses (argparse converts a string default as it converts an argument), so a bad
    value is this command's usage error naming the flag, and no concern of other commands' parsers."""
    env = env_name(flag)
    raw = os.environ.get(env)
    value = raw if raw is not None else default
    group.add_argument(flag, type=type, default=value, choices=choices, help=f"{help} [env {env}]")


def switch(group: argparse._ArgumentGroup, flag: str, help: str) -> None:
    env = env_name(flag)
    on = os.environ.get(env, "").strip().lower() in ("1", "true", "yes", "on")
    group.add_argument(flag, action="store_true", default=on, help=f"{help} [env {env}=1]")


def add_advertise_host(group: argparse._ArgumentGroup) -> None:
    add_flag(group, "--advertise-host", "", "address registered in discovery, what peers dial (default: --host, "
             "or this machine's name where --host is a wildcard such as 0.0.0.0; in a pod, its IP)")  # fmt: skip


def advertised_host(args: argparse.Namespace) -> str:
    """The address other processes reach this one at: --advertise-host, else --host unless it binds every
    address (a wildcard is no address to dial), then this machine's name."""
    if args.advertise_host:
        return str(args.advertise_host)
    return socket.gethostname() if args.host in WILDCARD_HOSTS else str(args.host)


def add_service_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of any rackserve gRPC service: where etcd is, where to listen, who it is, where it stands."""
    g = parser.add_argument_group("service")
    add_flag(g, "--etcd", "http://127.0.0.1:2379", "etcd endpoint for discovery")
    add_flag(g, "--host", "127.0.0.1", "address to listen on and to register")
    add_advertise_host(g)
    add_flag(g, "--port", 0, "gRPC port (0: an ephemeral port; the bound one is registered)", port_number)
    add_flag(g, "--worker-id", "", "id in discovery (default: ROLE-HOSTNAME-PID)")
    add_flag(
        g, "--lease-ttl-s", 3.0, "etcd lease TTL: a dead process vanishes from discovery after this", float
    )
    add_flag(
        g,
        "--drain-grace-s",
        20.0,
        "on SIGTERM, how long in-flight requests may run before being aborted",
        float,
    )
    for label in TOPOLOGY_LABELS:
        add_flag(g, f"--{label}", "", f"topology label {label!r}")
    add_flag(g, "--health-port", 0, "also serve grpc.health.v1 alone, in plaintext, on this port (for "
             "Kubernetes gRPC probes, which cannot speak mutual TLS; 0: off)", port_number)  # fmt: skip
    add_security_arguments(parser)
    add_telemetry_arguments(parser, metrics_port=True)


def add_security_arguments(parser: argparse.ArgumentParser) -> None:
    """Mutual TLS of the internal gRPC links (services.runtime.tls) and etcd's TLS and auth (services.discovery).

    Secrets are read from files only (a mounted Kubernetes Secret), never from a flag's value, so they never
    show in `ps`, in logs or in --help defaults.
    """
    g = parser.add_argument_group("security")
    add_flag(g, "--tls-cert-file", "", "PEM certificate this service presents on gRPC (enables mutual TLS)")
    add_flag(g, "--tls-key-file", "", "PEM private key of --tls-cert-file")
    add_flag(g, "--tls-ca-file", "", "PEM CA that gRPC peers' certificates must chain to")
    add_flag(g, "--tls-server-name", "", "name in the peers' certificates, checked instead of their address")
    add_flag(g, "--etcd-ca-file", "", "PEM CA of etcd's server certificate (https:// etcd endpoints)")
    add_flag(g, "--etcd-cert-file", "", "PEM client certificate for etcd (client-cert auth)")
    add_flag(g, "--etcd-key-file", "", "PEM private key of --etcd-cert-file")
    add_flag(g, "--etcd-username", "", "etcd user (with --etcd-password-file)")
    add_flag(g, "--etcd-password-file", "", "file holding the etcd user's password")


def add_telemetry_arguments(parser: argparse.ArgumentParser, metrics_port: bool) -> None:
    """Flags of metrics and tracing (services.telemetry); the frontend serves /metrics on its own port."""
    g = parser.add_argument_group("telemetry")
    if metrics_port:
        add_flag(g, "--metrics-port", 0, "HTTP port of /metrics (0: an ephemeral port, registered in etcd; "
                 "-1: off)", port_or_off)  # fmt: skip
    add_flag(g, "--otlp-endpoint", "", "OpenTelemetry collector for traces, OTLP/gRPC, e.g. "
             "http://otel-collector:4317 (empty: tracing off)")  # fmt: skip
    add_flag(g, "--otlp-batch-delay-ms", 1000, "how often batched spans are exported", int)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of a worker that runs an engine (prefill and decode)."""
    g = parser.add_argument_group("engine")
    add_flag(g, "--model", "", "a .gguf file or a Hugging Face directory (default: SmolLM2-135M)")
    add_flag(g, "--dtype", "bfloat16", "weights and KV dtype", choices=SUPPORTED_DTYPES)
    add_flag(g, "--quant", "none", "weight quantization", choices=SUPPORTED_QUANT)
    add_flag(g, "--nvfp4-method", "rtn", "how --quant nvfp4 picks block scales and codes at load "
             "(docs/nvfp4-quality.md)", choices=NVFP4_LOAD_METHODS)  # fmt: skip
    add_flag(g, "--nvfp4-gemm", "auto", "NVFP4 layers: w4a16 keeps activations 16-bit; w4a4 quantizes them too "
             "(FP4 tensor cores; emulated on a CPU); auto: w4a4 where the GPU has FP4 tensor cores and the "
             "checkpoint does not declare 16-bit activations (docs/nvfp4-quality.md)", choices=NVFP4_GEMMS)  # fmt: skip
    add_flag(g, "--block-size", 16, "tokens per KV block", int)
    add_flag(g, "--kv-cache-bytes", 0, "memory for the paged KV cache (0: 1 GiB on CPU; on a GPU what "
             "--gpu-memory-utilization leaves after the weights and the activation peak)", int)  # fmt: skip
    add_flag(g, "--max-num-seqs", 64, "sequences in one batch", int)
    add_flag(g, "--max-num-batched-tokens", 0, "token budget of one step (longer prompts are chunked; 0: 512 on a "
             "CPU, 2048 on a GPU, 8192 on one of 70 GiB or more)", int)  # fmt: skip
    add_flag(g, "--max-model-len", 0, "context length (0: the model's)", int)
    switch(g, "--no-prefix-caching", "turn the prefix cache off")
    add_flag(g, "--kv-tier2-bytes", 0, "host memory for KV tier 2: cached blocks evicted from the KV cache are "
             "kept there and restored on a prefix hit (0: off; docs/kv-tiers.md)", non_negative_int)  # fmt: skip
    add_flag(g, "--kv-tier2-codec", EngineConfig.kv_tier2_codec, "how tier 2 keeps a block: bf16 (lossless, the "
             "cache dtype as is), fp8 or nvfp4 (compressed)", choices=TIER2_CODECS)  # fmt: skip
    add_flag(g, "--kv-disk-path", "", "directory of this worker's local-disk KV tier, below tier 2: blocks pushed "
             "out of host memory (or, with tier 2 off, out of the KV cache) are kept there, one file each, and "
             "survive a restart of the same model (docs/kv-tiers.md)")  # fmt: skip
    add_flag(g, "--kv-disk-bytes", 0, "disk bytes the KV disk tier may take (0: off; needs --kv-disk-path)",
             non_negative_int)  # fmt: skip
    switch(g, "--no-kv-async-restore", "write blocks restored from a KV tier, and KV imported from a prefill "
           "worker, before the step, not beside it")  # fmt: skip
    add_flag(g, "--threads", 1, "torch CPU threads for this worker (0: torch's default)", int)
    switch(g, "--no-cpu-kernels", "run the model on plain torch ops instead of the fused CPU kernels")
    add_flag(g, "--device", "auto", "where the engine computes: auto (CUDA when visible), cpu, cuda or cuda:N; "
             "asking for a GPU that is not there fails at start-up")  # fmt: skip
    add_flag(g, "--gpu-memory-utilization", 0.9, "share of the GPU's memory for weights, activations and the "
             "KV cache", float)  # fmt: skip
    switch(g, "--enforce-eager", "no CUDA graphs: run every decode step eagerly")
    add_flag(g, "--attention-backend", "auto", "decode attention: auto (Triton paged kernel on CUDA), torch, "
             "triton", choices=ATTENTION_BACKENDS)  # fmt: skip


KV_BACKENDS = (
    "cuda_ipc",
    "shm",
    "nixl",
    "tcp",
)  # services.kvtransfer's names; not imported here (it loads numpy and NIXL)


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def comma_list(text: str) -> tuple[str, ...]:
    """A `,`-separated flag value: its items, stripped, empty ones left out."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _backend_list(text: str) -> tuple[str, ...]:
    names = comma_list(text)
    unknown = [b for b in names if b not in KV_BACKENDS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"KV backends must be a comma list of {list(KV_BACKENDS)}, got {text!r}"
        )
    return names


def add_kv_transfer_arguments(parser: argparse.ArgumentParser, role: str) -> None:
    """Flags of the KV transfer engine: what a prefill worker offers, how a decode worker pulls."""
    g = parser.add_argument_group("kv transfer")
    add_flag(
        g, "--kv-backends", ("tcp", "shm", "nixl", "cuda_ipc"),
        "transfer backends to open (NIXL skipped if it cannot load; cuda_ipc used only between GPU caches)",
        _backend_list,
    )  # fmt: skip
    if role == "prefill":
        add_flag(g, "--kv-compress", "none", "transfer-only KV compression", choices=("none", "fp8", "nvfp4"))
        add_flag(g, "--kv-device-copy-bytes", DEFAULT_KV_DEVICE_COPY_BYTES, "GPU: device memory for the KV copies "
                 "kept for device-direct readers (cuda_ipc, NIXL VRAM) until one has read them, taken out of the KV "
                 "cache's plan; past it readers get the host bytes (0: none kept)", non_negative_int)  # fmt: skip
    if role in ("decode", "prefill"):  # a prefill worker pulls too: a peer's prefix blocks (PrefixPull)
        add_flag(
            g, "--kv-backend-preference", ("cuda_ipc", "shm", "nixl", "tcp"),
            "backend order to pull with (cuda_ipc and shm only when the producer is on this node)", _backend_list,
        )  # fmt: skip
        add_flag(g, "--kv-pull-timeout-s", 10.0, "deadline of one KV pull", float)
        add_flag(g, "--kv-device-pull-bytes", DEFAULT_KV_DEVICE_PULL_BYTES, "GPU: device memory device-direct "
                 "pulls (cuda_ipc, NIXL VRAM) may hold until the engine has written them into its cache, taken out "
                 "of the KV cache's plan; past it a pull reads the host bytes (0: never device-direct)",
                 non_negative_int)  # fmt: skip
        switch(
            g, "--kv-nixl-verify-checksum", "verify the producer's checksum on NIXL pulls too (default: size and "
            "publication only; TCP and shm pulls always verify it)",
        )  # fmt: skip
        add_flag(
            g, "--kv-release-timeout-s", 2.0, "deadline of the Release (ack) sent to the producer", float
        )
        add_flag(
            g, "--kv-nixl-lanes", 2, "NIXL agents (threads) a large pull is split over; 1: one", positive_int
        )
        add_flag(
            g, "--kv-prefix-pull-deadline-s", 2.0, "deadline of a prefix pull from a peer (ExportPrefix, transfer "
            "and import) when the plan's PrefixPull names none; past it the prompt is recomputed", float,
        )  # fmt: skip


def worker_id(args: argparse.Namespace, role: str) -> str:
    return args.worker_id or f"{role}-{socket.gethostname()}-{os.getpid()}"


def topology(args: argparse.Namespace) -> dict[str, str]:
    return {label: getattr(args, label) for label in TOPOLOGY_LABELS if getattr(args, label)}


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        dtype=args.dtype,
        quant=args.quant,
        nvfp4_method=args.nvfp4_method,
        nvfp4_gemm=args.nvfp4_gemm,
        block_size=args.block_size,
        kv_cache_bytes=args.kv_cache_bytes,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_tier2_bytes=args.kv_tier2_bytes,
        kv_tier2_codec=args.kv_tier2_codec,
        kv_disk_path=args.kv_disk_path,
        kv_disk_bytes=args.kv_disk_bytes,
        kv_async_restore=not args.no_kv_async_restore,
        num_threads=args.threads,
        cpu_kernels=not args.no_cpu_kernels,
        device=args.device,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_transit_bytes=kv_device_copy_bytes(args) + kv_device_pull_bytes(args),
        enforce_eager=args.enforce_eager,
        attention_backend=args.attention_backend,
    )


def kv_sink_config(args: argparse.Namespace) -> TransferConfig:
    """The KV sink of a pulling worker (a decode worker's KV, a prefill worker's peer prefixes)."""
    return TransferConfig(
        backends=tuple(args.kv_backends),
        host=args.host,
        nixl_verify_checksum=args.kv_nixl_verify_checksum,
        nixl_lanes=args.kv_nixl_lanes,
        device_pull_bytes=kv_device_pull_bytes(args),
    )


def kv_device_copy_bytes(args: argparse.Namespace) -> int:
    """A prefill worker's budget for KV device copies kept for device-direct readers (0 where none can read one,
    and the KV cache keeps that memory)."""
    return int(getattr(args, "kv_device_copy_bytes", 0)) if _device_direct(args) else 0


def kv_device_pull_bytes(args: argparse.Namespace) -> int:
    """A pulling worker's budget for device-direct pulls not yet written into its cache (0 where none can come)."""
    return int(getattr(args, "kv_device_pull_bytes", 0)) if _device_direct(args) else 0


def _device_direct(args: argparse.Namespace) -> bool:
    """Whether a device-direct KV backend can open: cuda_ipc, or NIXL where it is installed."""
    backends = getattr(args, "kv_backends", ())
    return "cuda_ipc" in backends or ("nixl" in backends and nixl_installed())


def model_path(args: argparse.Namespace) -> str:
    if args.model:
        return str(args.model)
    from services.engine.model_files import smollm2_gguf_path

    return smollm2_gguf_path()
