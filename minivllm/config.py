"""EngineConfig: every engine knob, validated once, up front."""

import os
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

from minivllm.quantization import Fp8Config, resolve_fp8_config
from minivllm.reasoning import reasoning_parser_class

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


# GPUs with at least this much memory take vLLM's larger default token budget (below).
LARGE_GPU_BYTES = 70 * 2**30


def is_gguf(path: str) -> bool:
    """Whether the model path names a GGUF file (gguf_loader.py reads those) rather than a
    Hugging Face model directory."""
    return path.endswith(".gguf")


def default_max_num_batched_tokens(device: torch.device) -> int:
    """Tokens a step may hold when max_num_batched_tokens is not given: vLLM's default for
    its LLM class (offline), 16,384 on a GPU of at least 70 GiB other than an A100, else
    8,192. A larger budget means fewer, larger prompt steps. (`minivllm serve` passes 8,192,
    vLLM's server default on such GPUs.)"""
    if device.type == "cuda" and torch.cuda.is_available():  # else the GPU check reports it
        props = torch.cuda.get_device_properties(device)
        if props.total_memory >= LARGE_GPU_BYTES and "a100" not in props.name.lower():
            return 16384
    return 8192


def cpu_threads(reserved_cores: int = 0, num_engines: int = 1) -> int:
    """Intra-op threads for an engine: the cores this process may use (its affinity mask, as
    torch's default), less `reserved_cores` left to other busy processes of the same
    deployment (a serving front's event loop), shared by `num_engines` engines (data-parallel
    replicas), at least 1. A thread more than the free cores
    costs far more than it brings: every parallel op waits for the thread the OS set aside.
    An explicit count wins: OMP_NUM_THREADS, or torch.set_num_threads to other than torch's
    default."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if "OMP_NUM_THREADS" in os.environ or torch.get_num_threads() != cores:
        return torch.get_num_threads()
    return max(1, (cores - reserved_cores) // num_engines)


def _refuse_unknown_keys(name: str, config_class: type, values: dict[str, Any]) -> None:
    """Raise ValueError naming the first key of values that config_class has no field for."""
    known = {f.name for f in fields(config_class)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{name} has no key {unknown[0]!r}; its keys are {', '.join(sorted(known))}.")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Engine-wide structured-output settings: vLLM's `--structured-outputs-config` (the keys
    minivllm has)."""

    backend: str = "auto"  # "auto" or "xgrammar": the one backend
    # JSON grammars allow no free whitespace, for every request (as the per-request flag of
    # StructuredOutputsParams).
    disable_any_whitespace: bool = False

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "StructuredOutputsConfig":
        """Raises ValueError naming an unknown key, a wrong type or a backend minivllm lacks."""
        _refuse_unknown_keys("structured_outputs_config", cls, values)
        config = cls(**values)
        if config.backend not in ("auto", "xgrammar"):
            raise ValueError(f"structured_outputs_config backend {config.backend!r} is not available: minivllm's "
                             "structured outputs use xgrammar (\"auto\" or \"xgrammar\").")
        if not isinstance(config.disable_any_whitespace, bool):
            raise ValueError("structured_outputs_config disable_any_whitespace must be true or false, got "
                             f"{config.disable_any_whitespace!r}.")
        return config


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: vLLM's `speculative_config` (the keys minivllm has). Draft tokens
    come from the sequence's own tokens (and earlier outputs); the model verifies them in one
    step. "ngram" drafts by prompt lookup: where the sequence's last n tokens (n from
    prompt_lookup_max down to prompt_lookup_min) occurred before in its prompt or output, the
    tokens that followed them there, up to num_speculative_tokens (engine/ngram_proposer.py).
    "suffix" drafts by suffix decoding: the longest match of its last tokens (at most
    suffix_decoding_max_tree_depth) in its own tokens or in the outputs of the last
    suffix_decoding_max_cached_requests requests, continued by the most frequent tokens that
    followed there (engine/suffix_proposer.py). "draft_model" drafts with a smaller model of the
    same vocabulary (`model`: its directory or .gguf file), num_speculative_tokens greedy steps
    on its own paged KV cache (engine/draft_model_proposer.py)."""

    method: str = "ngram"
    num_speculative_tokens: int = None  # type: ignore[assignment]  # required for ngram and draft_model
    model: str | None = None  # the draft model's path (draft_model only)
    # As vLLM: either alone sets both; neither: 5 and 5 (typed as resolved, as EngineConfig's lengths).
    prompt_lookup_max: int = None  # type: ignore[assignment]
    prompt_lookup_min: int = None  # type: ignore[assignment]
    # Suffix decoding's, with vLLM's defaults; its num_speculative_tokens defaults to the depth.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SpeculativeConfig":
        """Raises ValueError naming an unknown key, a wrong value or a method minivllm lacks."""
        _refuse_unknown_keys("speculative_config", cls, values)
        return cls(**values)

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "suffix", "draft_model"):
            raise ValueError(f"speculative_config method {self.method!r} is not available: minivllm drafts "
                             "by prompt lookup (\"ngram\"), by suffix decoding (\"suffix\") and with a "
                             "draft model (\"draft_model\").")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config needs model (the draft model's directory or .gguf file) "
                             "with method \"draft_model\", and only with it.")
        if self.method == "suffix" and self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", self.suffix_decoding_max_tree_depth)  # (frozen)
        if self.num_speculative_tokens is None:
            raise ValueError("speculative_config needs num_speculative_tokens (the draft tokens per step).")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                     "suffix_decoding_max_tree_depth"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"speculative_config {name} must be an integer of at least 1, got {value!r}.")
        cached = self.suffix_decoding_max_cached_requests
        if isinstance(cached, bool) or not isinstance(cached, int) or cached < 0:
            raise ValueError("speculative_config suffix_decoding_max_cached_requests must be an integer of at "
                             f"least 0 (0: no earlier outputs), got {cached!r}.")
        factor, min_prob = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise ValueError(f"speculative_config suffix_decoding_max_spec_factor must be a number above 0, "
                             f"got {factor!r}.")
        if isinstance(min_prob, bool) or not isinstance(min_prob, (int, float)) or not 0 <= min_prob <= 1:
            raise ValueError(f"speculative_config suffix_decoding_min_token_prob must be a number from 0 to 1, "
                             f"got {min_prob!r}.")
        lookup_max = self.prompt_lookup_max or self.prompt_lookup_min or 5
        lookup_min = self.prompt_lookup_min or self.prompt_lookup_max or 5
        if lookup_min > lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({lookup_min}) must not exceed "
                             f"prompt_lookup_max ({lookup_max}).")
        object.__setattr__(self, "prompt_lookup_max", lookup_max)
        object.__setattr__(self, "prompt_lookup_min", lookup_min)


@dataclass
class EngineConfig:
    model: str
    dtype: str | torch.dtype = "auto"
    # Typed as resolved: None (the default) is taken, and __post_init__ replaces it (the model's
    # max_position_embeddings; a default for the device), as in vLLM.
    max_model_len: int = None  # type: ignore[assignment]
    max_num_seqs: int = 256
    max_num_batched_tokens: int = None  # type: ignore[assignment]
    # KV-cache page size (vLLM's default is 16): 64-token pages give the scheduler a quarter of the
    # blocks to hash, allocate and write into block tables; prefix-cache hits are whole pages, so a
    # shared prefix's last partial page is recomputed.
    block_size: int = 64
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None  # KV-cache blocks, instead of sizing by memory (as vLLM)
    seed: int = 0
    load_format: str = "auto"  # "auto": safetensors from a model directory, or a .gguf file; "dummy": random
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    # Where tensor-parallel ranks and data-parallel replicas run (vLLM's name): "mp", processes this
    # host spawns; "ray", Ray actors in placement groups over a Ray cluster (executor/ray_utils.py).
    distributed_executor_backend: str = "mp"
    skip_tokenizer_init: bool = False
    device: str = "auto"  # "auto": cuda when available, else cpu
    # "triton": our Triton kernels for attention, norms, q/k-norm + RoPE + KV store, SiLU,
    # sampling and small matmuls, and CUDA graphs; "torch": the torch reference ops (no
    # graphs). "auto": triton on cuda, torch on cpu.
    kernels: str = "auto"
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8" (or "fp8_e4m3"): float8 e4m3
    # None: the checkpoint's quantization_config, if any; "fp8": FP8 weights, quantised at load from a
    # 16/32-bit checkpoint (quantization.py says which schemes run).
    quantization: str | None = None
    # Splits reasoning from answers (minivllm.reasoning): the server's `reasoning` field, and where
    # constrained decoding starts. A name of REASONING_PARSERS, or None.
    reasoning_parser: str | None = None
    # A dict of StructuredOutputsConfig's keys is read into one.
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    # Speculative decoding (a dict of SpeculativeConfig's keys is read into one); None: off.
    speculative_config: SpeculativeConfig | None = None
    # Derived in __post_init__.
    hf_config: PretrainedConfig = field(init=False, repr=False)
    torch_dtype: torch.dtype = field(init=False)
    kv_cache_torch_dtype: torch.dtype = field(init=False)
    fp8_config: Fp8Config | None = field(init=False)  # the linear layers' FP8 scheme, or None
    # The draft model's config (speculative_config's "draft_model" method), else None.
    draft_config: "EngineConfig | None" = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs_config, dict):
            self.structured_outputs_config = StructuredOutputsConfig.from_dict(self.structured_outputs_config)
        if isinstance(self.speculative_config, dict):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        self.hf_config = self._load_hf_config()
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.kernels == "auto":
            self.kernels = "triton" if self.device == "cuda" else "torch"
        self.torch_dtype = self._resolve_dtype()
        self.kv_cache_torch_dtype = self._resolve_kv_cache_dtype()
        self.fp8_config = resolve_fp8_config(self.hf_config, self.quantization)
        self._resolve_lengths()
        self._validate()
        self.draft_config = self._draft_config()

    def _load_hf_config(self) -> PretrainedConfig:
        if is_gguf(self.model):
            if not os.path.isfile(self.model):
                raise ValueError(f"GGUF file {self.model!r} does not exist: pass the path of a .gguf file "
                                 "(or of a Hugging Face model directory).")
            from minivllm.gguf_loader import gguf_config  # the gguf package only for GGUF models
            return gguf_config(self.model)
        if not os.path.isdir(self.model):
            raise ValueError(
                f"Model directory {self.model!r} does not exist: pass the path of a Hugging Face "
                "model directory (config.json, *.safetensors, tokenizer files) or of a .gguf file.")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"{self.model!r} has no config.json: is it a Hugging Face model directory?")
        return AutoConfig.from_pretrained(self.model)

    def _resolve_dtype(self) -> torch.dtype:
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype == "auto":
            config_dtype = getattr(self.hf_config, "dtype", None) or getattr(
                self.hf_config, "torch_dtype", None) or torch.float32
            if isinstance(config_dtype, str):
                config_dtype = _DTYPES[config_dtype]
            # As vLLM: float32 checkpoints run in bfloat16 on GPUs, where fp32 is rarely wanted.
            if config_dtype == torch.float32 and self.device == "cuda":
                return torch.bfloat16
            return config_dtype
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported: use 'auto', "
                             "'float32', 'float16' or 'bfloat16'.")
        return _DTYPES[self.dtype]

    def _resolve_kv_cache_dtype(self) -> torch.dtype:
        if self.kv_cache_dtype == "auto":
            return self.torch_dtype
        if self.kv_cache_dtype in ("fp8", "fp8_e4m3"):
            return torch.float8_e4m3fn
        raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported: use 'auto' (the model's "
                         "dtype) or 'fp8' (float8 e4m3).")

    def _resolve_lengths(self) -> None:
        model_limit = getattr(self.hf_config, "max_position_embeddings", None)
        if self.max_model_len is None:
            self.max_model_len = model_limit or 2048
        elif model_limit is not None and self.max_model_len > model_limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's "
                f"max_position_embeddings={model_limit}: lower max_model_len.")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = default_max_num_batched_tokens(torch.device(self.device))

    def _validate(self) -> None:
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}.")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}.")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be at least 1, got {self.num_gpu_blocks_override}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.load_format not in ("auto", "dummy", "safetensors", "gguf"):
            raise ValueError(f"load_format must be 'auto', 'safetensors', 'gguf' or 'dummy', got {self.load_format!r}.")
        if self.load_format in ("safetensors", "gguf") and (self.load_format == "gguf") != is_gguf(self.model):
            raise ValueError(f"load_format={self.load_format!r} does not fit {self.model!r}: 'gguf' loads a .gguf "
                             "file, 'safetensors' a model directory ('auto' picks by the path).")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}.")
        if self.kernels not in ("torch", "triton"):
            raise ValueError(f"kernels must be 'auto', 'torch' or 'triton', got {self.kernels!r}.")
        # On CPU the Triton kernels run only in Triton's interpreter (tests use it).
        if self.kernels == "triton" and self.device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("kernels='triton' needs a CUDA device (or TRITON_INTERPRET=1); "
                             "use 'torch' on CPU.")
        if self.reasoning_parser is not None:
            reasoning_parser_class(self.reasoning_parser)  # raises for an unknown name
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}.")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be 'mp' or 'ray', got "
                             f"{self.distributed_executor_backend!r}.")
        # With Ray the GPUs are the cluster's: its placement groups check them (executor/ray_utils.py).
        if (self.device == "cuda" and self.distributed_executor_backend == "mp"
                and self.tensor_parallel_size > torch.cuda.device_count()):
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} needs as many GPUs, but "
                             f"{torch.cuda.device_count()} are visible: lower tensor_parallel_size.")
        num_kv_heads = getattr(self.hf_config, "num_key_value_heads", None) or self.hf_config.num_attention_heads
        if self.hf_config.num_attention_heads % self.tensor_parallel_size or num_kv_heads % self.tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} must divide the number of attention "
                f"heads ({self.hf_config.num_attention_heads}) and KV heads ({num_kv_heads}).")
        # Each expert's intermediate dimension is split across the ranks (layers/fused_moe.py).
        moe_intermediate = getattr(self.hf_config, "moe_intermediate_size", None)
        if moe_intermediate is not None and moe_intermediate % self.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} must divide the experts' "
                             f"moe_intermediate_size ({moe_intermediate}): choose a tensor_parallel_size "
                             "that divides it.")

    def _draft_config(self) -> "EngineConfig | None":
        """The draft model's config: this engine's settings (its dtype, lengths, block size,
        device, kernels), the draft's weights, no prefix caching. Raises ValueError where the
        draft cannot serve this model."""
        spec = self.speculative_config
        if spec is None or spec.model is None:
            return None
        if self.tensor_parallel_size > 1:
            raise ValueError("speculative_config's draft_model runs with tensor_parallel_size=1 only for now: "
                             "use method \"ngram\" or \"suffix\" with tensor parallelism.")
        try:
            draft = replace(self, model=spec.model, dtype=self.torch_dtype, speculative_config=None,
                            enable_prefix_caching=False, quantization=None, reasoning_parser=None,
                            load_format="dummy" if self.load_format == "dummy" else "auto")
        except ValueError as error:
            raise ValueError(f"speculative_config's draft model {spec.model!r}: {error}") from error
        if draft.hf_config.vocab_size != self.hf_config.vocab_size:
            raise ValueError(f"speculative_config's draft model {spec.model!r} has a vocabulary of "
                             f"{draft.hf_config.vocab_size} tokens, the model {self.hf_config.vocab_size}: "
                             "a draft model must share the model's vocabulary.")
        return draft

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)
