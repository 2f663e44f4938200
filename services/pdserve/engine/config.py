"""The engine's configuration (one per process). The model's shape is `core.model_config`.

Each field's metadata holds its help text: the worker's command line is made from these
fields (`pdserve serve --block-size ...`). torch is imported only where a field needs it,
so that building the command line does not load it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.scheduler import SchedulerConfig
from pdserve.engine.scheduling import DEFAULT_AGING, DEFAULT_DEADLINE_SCALE, SchedulingPolicy

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
# Share of the free GPU memory (after weights) that the KV cache takes at start-up.
CUDA_KV_CACHE_FRACTION = 0.85


@dataclass(slots=True)
class EngineConfig:
    """Everything one engine process needs, validated once."""

    model: str = field(
        metadata={"help": "model: a directory in Hugging Face layout, or a GGUF file"}
    )
    device: str = field(
        default="auto",
        metadata={"help": "cpu, cuda[:N] or auto (cuda if present, chosen at start-up)"},
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": "weights and KV cache dtype; auto (chosen at start-up): bfloat16 where "
            "the hardware computes it natively (a CPU with AMX or AVX512-BF16, a GPU with "
            "bf16), else float32 on a CPU and float16 on a GPU",
            "choices": DTYPES,
        },
    )
    block_size: int = field(default=16, metadata={"help": "tokens per KV-cache block"})
    # An explicit KV pool size wins over the memory budget.
    num_kv_blocks: int | None = field(
        default=None,
        metadata={"help": "KV-cache blocks (default: as many as the memory budget holds)"},
    )
    kv_cache_bytes: int | None = field(
        default=None,
        metadata={"help": "KV-cache memory budget (default: 1 GiB on CPU, 85% of free GPU)"},
    )
    max_num_seqs: int = field(default=64, metadata={"help": "requests running at once"})
    max_num_batched_tokens: int = field(
        default=2048, metadata={"help": "tokens scheduled per engine step"}
    )
    max_model_len: int | None = field(
        default=None,
        metadata={"help": "longest prompt + output (default: the model's context length)"},
    )
    enable_prefix_caching: bool = field(
        default=True, metadata={"help": "reuse the KV blocks of a prompt prefix seen before"}
    )
    enable_chunked_prefill: bool = field(
        default=True, metadata={"help": "split long prompts across engine steps"}
    )
    seed: int = field(default=0, metadata={"help": "seed of requests that set none"})
    scheduling_policy: SchedulingPolicy = field(
        default=SchedulingPolicy.LEAST_WORK,
        metadata={
            "help": "which prompts get a step's token budget first: fcfs (arrival order), "
            "priority (then arrival), least_work (priority, then least remaining prefill "
            "work, aged so that a long prompt is never starved)"
        },
    )
    scheduling_aging: float = field(
        default=DEFAULT_AGING,
        metadata={
            "help": "least_work: prefill tokens taken off a waiting prompt's remaining work "
            "per token the engine computes (higher: closer to arrival order)"
        },
    )
    scheduling_deadline_scale: float = field(
        default=DEFAULT_DEADLINE_SCALE,
        metadata={
            "help": "least_work: a prompt whose wait and remaining prefill, in tokens of "
            "the engine's work, pass this many times its own length (a step's budget at "
            "least) is late and goes behind the prompts still on time (0: off)"
        },
    )

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.device == "auto":  # chosen at start-up: the GPU when there is one
            self.device = "cuda" if _cuda_available() else "cpu"
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu', 'cuda[:N]' or 'auto', got {self.device!r}")
        if self.device.startswith("cuda") and not _cuda_available():
            raise ValueError(f"device {self.device!r} asked for, but CUDA is not available")
        if self.dtype == "auto":
            self.dtype = native_dtype(self.device)
        self.scheduling_policy = SchedulingPolicy(self.scheduling_policy)
        if self.scheduling_aging <= 0:
            raise ValueError(f"scheduling_aging must be > 0, got {self.scheduling_aging}")
        if self.scheduling_deadline_scale < 0:
            raise ValueError(
                f"scheduling_deadline_scale must be >= 0, got {self.scheduling_deadline_scale}"
            )
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_kv_blocks", "kv_cache_bytes", "max_model_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's share of this config, for a context of `max_model_len`."""
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            policy=self.scheduling_policy,
            aging=self.scheduling_aging,
            deadline_scale=self.scheduling_deadline_scale,
        )

    @property
    def torch_dtype(self):
        """The torch dtype of `dtype` (a `torch.dtype`)."""
        import torch

        return getattr(torch, self.dtype)


def native_dtype(device: str) -> str:
    """The dtype `auto` means on `device`: bfloat16 where its matrix units compute it
    (AMX or AVX512-BF16 on a CPU; on a GPU, whatever reports bf16 support), else float32
    on a CPU (bf16 there is converted to fp32 for every op: slower, not faster) and
    float16 on a GPU."""
    import torch

    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "bfloat16" if cpu_computes_bf16(torch.cpu.get_capabilities()) else "float32"


def cpu_computes_bf16(capabilities: dict) -> bool:
    """Whether a CPU with these capabilities (`torch.cpu.get_capabilities()`) has bf16
    matrix instructions."""
    return bool(capabilities.get("amx_bf16") or capabilities.get("avx512_bf16"))


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
