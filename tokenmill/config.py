"""Configuration of the engine, one dataclass per layer, built once and passed down.

Every field carries its help text; `tokenmill serve` and `tokenmill worker` generate their flags from
these dataclasses (cli/config_options.py), grouped by section, and read the same tree from
`--config FILE.yaml`. A new field is a new flag, with nothing copied by hand.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field
from typing import Any

from tokenmill.weights.catalog import DEFAULT_MODEL


def setting(default: Any = MISSING, *, help: str, flag: str | None = None, envvar: str | None = None,
            default_factory: Any = MISSING, aliases: tuple[str, ...] = ()) -> Any:  # fmt: skip
    """A config field with its command-line help (and, when the flag is not the field name, its flag;
    `aliases`: other flag names it also answers to)."""
    meta = {"help": help, "flag": flag, "envvar": envvar, "aliases": aliases}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = setting(
        2048, help="token budget of one step (prefill chunks + decode tokens)"
    )
    max_num_seqs: int = setting(256, help="requests running at once")
    policy: str = setting(
        "fcfs",
        aliases=("scheduling-policy",),
        help='"fcfs"; "priority": lower priority values first, preempted last; "fair": as priority, and '
        "within a priority the tenant served fewest tokens first (virtual token counters)",
    )
    long_prefill_token_threshold: int | None = setting(None, help="cap one request's tokens per step")
    # The fair policy (engine/fairness.py, docs/guides/fairness.md).
    tenant_weights: str | None = setting(
        None, help='fair: tenants\' shares, e.g. "a=2,b=1" (a tenant not named weighs 1)'
    )
    fair_input_weight: float = setting(1.0, help="fair: what one prompt token computed costs a tenant")
    fair_output_weight: float = setting(2.0, help="fair: what one generated token costs a tenant")
    known_tenants: str | None = setting(
        None,
        help="tenant names this engine keeps apart for good besides --tenant-weights', comma-separated "
        "(other names share 256 places, freed when idle); `serve` adds its --named-api-key and "
        "--tenant-priority-floor names",
    )

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority", "fair"):
            raise ValueError(f'policy must be "fcfs", "priority" or "fair", got {self.policy!r}')
        if not (self.fair_input_weight >= 0 and self.fair_output_weight >= 0):
            raise ValueError("fair_input_weight and fair_output_weight must be at least 0")
        from tokenmill.engine.fairness import parse_tenant_names, parse_tenant_weights

        parse_tenant_weights(self.tenant_weights)  # a bad spec fails when the config is built
        parse_tenant_names(self.known_tenants)


@dataclass
class CacheConfig:
    block_size: int = setting(16, help="tokens per KV block")
    kv_cache_memory_gb: float = setting(1.0, help="KV cache budget; the pool is preallocated from it")
    num_blocks: int | None = setting(None, help="KV blocks, overriding the memory budget")
    enable_prefix_caching: bool = setting(True, help="reuse the KV of shared prompt prefixes")
    kv_cache_dtype: str = setting(
        "auto",
        help='"auto" (the model dtype), or "int8" / "fp8" (e4m3): 8-bit keys and values with a scale per '
        "token and head, about half the bytes: twice the blocks in the same budget, and half the memory "
        "traffic of decode attention",
    )

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in ("auto", "int8", "fp8"):
            raise ValueError(f'kv_cache_dtype must be "auto", "int8" or "fp8", got {self.kv_cache_dtype!r}')

    @property
    def kv_format(self) -> str | None:
        """The 8-bit row format (models/attention/kv_quant.py), or None for the model's dtype."""
        return None if self.kv_cache_dtype == "auto" else self.kv_cache_dtype


@dataclass
class KVEventsConfig:
    """KV cache events in vLLM's wire format (engine/kv_events.py) on ZeroMQ: what a KV-aware router
    indexes. Off by default: a lone engine has nobody to tell."""

    enable_kv_events: bool = setting(False, flag="kv-events", help="publish KV cache events")
    kv_events_endpoint: str = setting(
        "tcp://127.0.0.1:5557", help="PUB socket the events go out on (bound; tcp://*:5557 for all hosts)"
    )
    kv_events_replay_endpoint: str | None = setting(
        "tcp://127.0.0.1:5558", help="ROUTER socket answering replay requests for missed events (bound)"
    )
    kv_events_topic: str = setting("", help="topic frame of every event message")
    kv_events_buffer_steps: int = setting(10_000, help="event batches kept for replay")


@dataclass
class KVOffloadConfig:
    """KV cache tiers below the engine's pool (Dynamo's G2-G4): blocks evicted from the pool go to host
    memory, those evicted from host memory to a local disk directory, and from there to a directory
    shared by all workers; admission loads a prompt's blocks back from whichever tier holds them."""

    kv_offload: str | None = setting(
        None,
        help='tiers, e.g. "host=4GB,disk=/var/kv:20GB,shared=/mnt/kv[:SIZE]" (any subset; sizes in '
        "B, KB, MB, GB, KiB, MiB, GiB)",
    )

    def __post_init__(self) -> None:
        if self.kv_offload is not None:
            from tokenmill.worker.kv_offload.tiers import parse_tiers

            parse_tiers(self.kv_offload)  # a bad spec fails when the config is built, not in a worker


@dataclass
class KVTransferConfig:
    """Disaggregated prefill and decode (engine/pd_connector.py): a prefill worker keeps a finished
    prompt's blocks and serves them; a decode worker reads them instead of computing the prompt."""

    kv_role: str | None = setting(
        None, help='"prefill", "decode" or "both" (serves and reads); unset: no KV transfer'
    )
    kv_transfer_host: str = setting("127.0.0.1", help="address the KV transfer server listens on")
    kv_transfer_port: int = setting(0, help="its port (0: any free one)")
    kv_transfer_shm: bool = setting(
        True, help="share the KV cache through /dev/shm, so readers on this host copy blocks directly"
    )
    kv_transfer_timeout_s: float = setting(10.0, help="a read slower than this is given up (recomputed)")
    kv_hold_timeout_s: float = setting(60.0, help="how long a prefill worker keeps blocks nobody reads")
    kv_transfer_peers: str | None = setting(
        None,
        help="prefill servers (HOST:PORT of their KV transfer servers, comma-separated) an HTTP client's "
        "kv_transfer_params may name; without the workers' secret none else is read from",
    )

    def allowed_peers(self) -> set[str]:
        return {p.strip() for p in (self.kv_transfer_peers or "").split(",") if p.strip()}

    def __post_init__(self) -> None:
        if self.kv_role not in (None, "prefill", "decode", "both"):
            raise ValueError(f'kv_role must be "prefill", "decode" or "both", got {self.kv_role!r}')

    @property
    def serves(self) -> bool:
        return self.kv_role in ("prefill", "both")


@dataclass
class SpeculativeConfig:
    """Speculative decoding: a cheap proposer guesses the next tokens, one target pass verifies them all
    (worker/spec_decode/). Greedy output is unchanged; sampled output keeps the target's distribution."""

    method: str | None = setting(
        None, flag="speculative",
        help='"ngram" (prompt lookup), "suffix" (suffix trees over this and recent requests), or '
        '"draft:MODEL" (a draft model with the same tokenizer; draft:self is the model itself in 4 bits)',
    )  # fmt: skip
    num_speculative_tokens: int = setting(8, help="most draft tokens per request per step")
    prompt_lookup_min: int = setting(2, help="ngram: shortest suffix of the context to look up")
    prompt_lookup_max: int = setting(5, help="ngram: longest suffix of the context to look up")
    suffix_max_tree_depth: int = setting(24, help="suffix: longest pattern and draft the trees hold")
    suffix_max_cached_requests: int = setting(1000, help="suffix: recent requests kept in the global tree")
    suffix_min_token_prob: float = setting(0.1, help="suffix: draft only tokens seen at least this often")
    draft_quantization: str | None = setting(
        "int4", help='draft model weights: "int4" (4-bit, the cheap default) or "none" (the dtype)'
    )
    # Past this many tokens in a step, verifying drafts costs more than the steps they save (the forward
    # pass stops being bound by reading the weights): speculation pauses until the batch shrinks.
    max_batch_tokens: int = setting(
        16, help="speculate only while running requests x (1 + draft length) stay within this"
    )

    @property
    def draft_model(self) -> str | None:
        """The draft model of draft:MODEL ("self": the target's own checkpoint), else None."""
        if self.method is None or not self.method.startswith("draft:"):
            return None
        return self.method.removeprefix("draft:").strip() or None

    def __post_init__(self) -> None:
        if self.method is not None:
            if self.method.startswith("draft:"):
                if not self.draft_model:
                    raise ValueError("speculative method draft:MODEL needs a model (a name, a path or self)")
            elif self.method not in ("ngram", "suffix"):
                raise ValueError(
                    f"speculative method must be ngram, suffix or draft:MODEL, got {self.method!r}"
                )
        if self.draft_quantization == "none":
            self.draft_quantization = None
        if self.draft_quantization not in (None, "int4"):
            raise ValueError(f'draft_quantization must be "int4" or "none", got {self.draft_quantization!r}')
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError(f"num_speculative_tokens must be in [1, 32], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = setting(
        1, help="rank processes that split each layer (heads, MLP, vocabulary)"
    )
    pipeline_parallel_size: int = setting(1, help="rank processes that each run a run of layers, in turn")
    enable_expert_parallel: bool = setting(
        False,
        help="a mixture of experts' experts spread whole over the tensor-parallel ranks, rather than each "
        "expert's columns split over them",
    )
    executor: str = setting(
        "auto",
        help='"uni": one worker in the engine process; "mp": a process per rank; "auto": mp past 1 rank',
    )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class LoRAConfig:
    """LoRA adapters served on the base model (tokenmill/lora): slots preallocated in every worker, an
    adapter read into one when a request first needs it."""

    enable_lora: bool = setting(False, help="serve LoRA adapters (on with --lora-modules)")
    max_loras: int = setting(4, help="adapters held in memory at once (least recently used idle ones go)")
    max_lora_rank: int = setting(16, help="highest adapter rank accepted (the slots' size)")

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be at least 1")


@dataclass
class EngineConfig:
    model: str = setting(DEFAULT_MODEL, help="catalog name, .gguf path or Hugging Face directory")
    # "auto": bf16 weights; their arithmetic in bf16 where the CPU has BF16 instructions (and on other
    # devices), in float32 where it has none (AVX2, AVX-512 without BF16), whose bf16 matmuls are emulated
    # (models/wide_linear.py). The start's log says which in one line.
    dtype: str = setting(
        "auto",
        help='"auto" (bfloat16 weights, computed in float32 on CPUs without BF16 instructions), "bfloat16" '
        '(bf16 arithmetic everywhere) or "float32" ("float16" where the device does it well)',
    )
    device: str = setting("cpu", help="torch device of the workers")
    max_model_len: int | None = setting(
        None, help="context length (default: the model's, capped at 8192 and at what the KV pool holds)"
    )
    num_threads: int | None = setting(
        None, flag="threads", help="torch threads per worker (default: all cores)"
    )
    # Fewer threads while other processes crowd the cores, all of them again once the machine is
    # quiet (worker/thread_governor.py): a busy neighbour costs its share, not a 70x stall.
    adaptive_threads: bool = setting(True, help="use fewer threads while other processes crowd the cores")
    # "torch": plain-PyTorch reference everywhere; "cpu": tokenmill's C++ kernels (paged decode attention,
    # fused norm/rope/silu) at the best instruction-set level this CPU runs; a level name ("avx2",
    # "avx512", "avx512_bf16"): that build, to test the path another CPU takes; "auto": the C++ kernels
    # on a CPU if they build and run here, else the reference with a one-line warning.
    kernels: str = setting(
        "auto", help='"auto", "torch" (reference), "cpu", or an ISA level (avx2, avx512, ...)'
    )
    # None: weights in `dtype`. "int4": 4-bit weights (groups of 32), the precision of a Q4_0/Q4_1 GGUF
    # file; where the 4-bit panel kernels run (AVX512-BF16 without AMX) for every step of a bf16 model,
    # elsewhere for decode-sized ones with a dtype copy for larger.
    quantization: str | None = setting(
        None,
        # Which kernels each form runs on which CPU: docs/guides/quantization.md.
        help='"int4": 4-bit weights (a Q4 file\'s own codes); "int8": 8-bit weights and activations '
        '(int8_scales: per row or per group of 32); "fp8": e4m3 weights and activations',
    )
    int8_smoothing: float = setting(
        0.7,
        help="with quantization int8: SmoothQuant's migration strength alpha (0-1), the share of each "
        "activation channel's range moved into the weights, calibrated at load on a text shipped with "
        "Python (the maxima are cached beside the weights for later starts); 0 quantizes unsmoothed",
    )
    int4_activations: str = setting(
        "int8",
        help='with quantization int4, the activations of steps above 2 rows: "int8" (per row and group of '
        "32, as llama.cpp multiplies Q4 by Q8_0: W4A8, faster from 3 rows, +0.16% perplexity against "
        'bf16) or "bf16" (exact products, W4A16: +0.04%, but slower than bf16 weights from 17 rows); only '
        "where the 4-bit panel kernels run (AVX512-BF16 without AMX)",
    )
    int8_scales: str = setting(
        "auto",
        help='with quantization int8, what a scale covers: "channel" (a weight scale per output channel, '
        'smoothed, and an activation scale per row: fastest at batches), "group" (a scale per group of 32 '
        "on both sides, as llama.cpp multiplies a Q8_0 file: about a quarter of channel's accuracy cost; "
        "where the group kernels run: AVX512-BF16 without AMX in a bf16 model, and CPUs without BF16 "
        'instructions (AVX2) in dtype "auto"\'s float32 model) or "auto" (group for a GGUF file whose layers '
        "hold Q8_0 linears, computing with the file's own codes, and on AVX2 CPUs, whose int8 kernels are "
        "the group ones; channel otherwise)",
    )
    cache_dir: str | None = setting(None, help="where dequantized GGUF weights are cached")
    seed: int = setting(0, help="random seed for requests without their own")
    # vLLM's flag. Every process of the deployment (front, router, engines) sends its spans there.
    otlp_traces_endpoint: str | None = setting(
        None,
        help="send OpenTelemetry traces (OTLP over HTTP/protobuf) to this URL, e.g. "
        "http://127.0.0.1:4318/v1/traces: a span per request in the front, the router and the engine",
    )
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    offload: KVOffloadConfig = field(default_factory=KVOffloadConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        if self.quantization not in (None, "int4", "int8", "fp8"):
            raise ValueError(f'quantization must be "int4", "int8" or "fp8", got {self.quantization!r}')
        if self.int4_activations not in ("bf16", "int8"):
            raise ValueError(f'int4_activations must be "bf16" or "int8", got {self.int4_activations!r}')
        if self.int8_scales not in ("auto", "channel", "group"):
            raise ValueError(f'int8_scales must be "auto", "channel" or "group", got {self.int8_scales!r}')
        if not 0 <= self.int8_smoothing < 1:
            raise ValueError(f"int8_smoothing must be in [0, 1), got {self.int8_smoothing}")
        endpoint = self.otlp_traces_endpoint
        if endpoint is not None and not endpoint.startswith(("http://", "https://")):
            raise ValueError(
                f"otlp_traces_endpoint must be an http:// or https:// URL (OTLP over HTTP), got {endpoint!r}"
            )
