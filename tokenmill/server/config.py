"""Server settings: one dataclass over the engine's tree, built from CLI flags or a YAML file."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.cluster.policies.base import DEFAULT_PREFILL_WEIGHT
from tokenmill.config import EngineConfig, setting


@dataclass
class FleetConfig:
    """How a fleet of workers is started and used (cluster/); only with --workers N > 1 or several
    --worker-url."""

    launcher: str = setting(
        "local", help='"local": --workers N processes on this host; "ray": N Ray actors, placed by Ray'
    )
    ray_address: str | None = setting(None, help="Ray cluster to join (default: a local Ray instance)")
    ray_cpus_per_worker: float = setting(1.0, help="CPUs each Ray worker actor reserves (and its threads)")
    ray_worker_host: str | None = setting(
        None, help="address Ray workers listen on (default: their node's IP; 127.0.0.1 on one machine)"
    )

    discovery: str | None = setting(
        None,
        help='find workers: "file" (one address a line), "dns" (a name\'s records), "k8s" (EndpointSlices)',
    )
    discovery_target: str | None = setting(
        None, help="the file, DNS name, or Kubernetes Service that discovery reads"
    )
    discovery_port: int = setting(7100, help="engine port of workers found by DNS")
    discovery_interval_s: float = setting(5.0, help="seconds between discovery look-ups")
    router: str = setting(
        "kv", help="kv, kv-approx, round-robin, random, least-load or session (sticky by `user`)"
    )
    router_temperature: float = setting(0.0, help="0: the cheapest worker; > 0: softmax over costs")
    router_prefill_weight: float = setting(
        DEFAULT_PREFILL_WEIGHT, help="weight of prefill blocks against decode blocks (kv cost)"
    )
    router_approx_ttl_s: float = setting(120.0, help="kv-approx: how long a routed prompt counts as held")
    router_queue: str = setting(
        "auto",
        help="hold requests at the router while every worker is full, then give each free place by band and "
        '(fair) tenant across the fleet: "auto" (on with --policy priority or fair), "on" or "off"',
    )
    disaggregate: str | None = setting(
        None, help='split the --workers into prefill and decode workers, e.g. "1P1D" (N prefill, M decode)'
    )
    disagg_min_prefill_tokens: int = setting(
        512, help="uncached prompt tokens from which a prompt is prefilled on a prefill worker"
    )
    disagg_max_prefill_inflight: int = setting(
        4, help="prompts in flight per prefill worker beyond which prompts are prefilled where they decode"
    )
    planner: str | None = setting(
        None,
        help='scale the workers within --workers MIN..MAX: "load" (queue/compute, waiting, KV use) or "sla"',
    )
    planner_interval_s: float = setting(10.0, help="seconds between the planner's decisions")
    planner_window_s: float = setting(60.0, help="seconds of recent traffic the planner's signals cover")
    planner_prometheus_url: str | None = setting(
        None, help="read the planner's signals from this Prometheus (which scrapes /metrics) instead"
    )
    planner_up_cooldown_s: float = setting(30.0, help="after a change, seconds before the next scale-up")
    planner_down_cooldown_s: float = setting(120.0, help="after a change, seconds before the next scale-down")
    planner_ttft_target_s: float = setting(1.0, help="sla: TTFT p95 target")
    planner_itl_target_s: float = setting(0.1, help="sla: inter-token latency p95 target")
    planner_surge: bool = setting(
        False, help="burst detection: scale at once to what the last interval's arrivals need"
    )
    planner_capacity_rps: float | None = setting(
        None,
        help="sla: requests/s one worker serves within the targets (tokenmill bench --goodput-search)",
    )
    planner_prefill_capacity_rps: float | None = setting(
        None,
        help="sla with --disaggregate: requests/s one prefill worker serves within the TTFT target",
    )
    planner_drain_timeout_s: float = setting(
        600.0, help="how long a removed worker may take to finish its requests"
    )
    scale_to_zero_after_s: float | None = setting(
        None,
        flag="scale-to-zero-after",
        help="with --workers 0..MAX: seconds without a request in flight or arriving after which the last "
        "worker is drained and stopped (default 300)",
    )
    cold_start_timeout_s: float = setting(
        120.0,
        flag="cold-start-timeout",
        help="with --workers 0..MAX: seconds a request waits for a worker to start when none runs (then 503)",
    )
    cold_start_max_waiting: int = setting(
        64, help="with --workers 0..MAX: requests that may wait for a worker to start (more get 503)"
    )
    disagg_prefill_timeout_s: float = setting(
        60.0, help="a remote prefill slower than this is computed locally"
    )


@dataclass
class ServerConfig:
    host: str = setting("127.0.0.1", help="address to listen on")
    port: int = setting(8000, help="HTTP port")
    served_model_name: str | None = setting(None, help="the model name clients use (default: --model)")
    api_key: str | None = setting(
        None,
        envvar="TOKENMILL_API_KEY",
        help="require this API key (several: comma-separated; each matched whole); see --named-api-key",
    )
    named_api_key: list[str] = setting(
        default_factory=list,
        envvar="TOKENMILL_NAMED_API_KEYS",
        help="also accept this key and serve its requests for the tenant NAME: NAME=KEY (repeat for more; "
        "the environment's are space-separated)",
    )
    tenant_header: str | None = setting(
        None,
        help="header naming the tenant of requests without a named key, e.g. x-tenant-id (set it from a "
        "trusted gateway); it may not name a named key's tenant, default or other",
    )
    tenant_priority_floor: str | None = setting(
        None,
        help='the most urgent priority each tenant may ask for, e.g. "alice=-5,default=-1" (others: 0); '
        "a lower priority is raised to it",
    )
    # Admission: requests beyond max_num_seqs that may wait in the engine; more get 429.
    max_queued_requests: int = setting(256, help="requests that may wait beyond max-num-seqs (then 429)")
    max_pending_tokens: int = setting(1_000_000, help="prompt tokens in flight before new requests get 429")
    drain_timeout_s: float = setting(
        30.0, flag="drain-timeout", help="seconds requests get to finish on SIGTERM"
    )
    tool_call_parser: str = setting(
        "auto",
        help="how the model writes tool calls: auto (from its chat template), hermes, qwen3, llama3_json, "
        "mistral or pythonic",
    )
    reasoning_parser: str | None = setting(
        None, help="split <think> reasoning from the answer: deepseek_r1 or qwen3 (default: none)"
    )
    # The Responses API's store (`store: true`): in memory, bounded by count, bytes and age.
    responses_store_max: int = setting(10_000, help="stored Responses kept at most (then the oldest go)")
    responses_store_mb: float = setting(256.0, help="memory the stored Responses may take")
    responses_store_ttl_s: float = setting(3600.0, help="how long a stored Response is kept")
    # Request bodies, compressed or after decompression (KServe's gzip/deflate), are capped at this.
    max_request_body_mb: float = setting(64.0, help="largest request body, compressed or inflated")
    # KServe v2 model repository (Triton's flags); None: the OpenAI API only.
    model_repository: str | None = setting(None, help="Triton-layout model repository served under /v2")
    model_control_mode: str = setting("none", help="none, poll or explicit (as Triton)")
    load_models: list[str] = setting(
        default_factory=list, flag="load-model", help="model to load at start in explicit mode ('*': all)"
    )
    repository_poll_secs: float = setting(15.0, help="rescan interval in poll mode")
    model_memory_budget_mb: float | None = setting(None, help="unload least recently used models past this")
    cache_config: list[str] = setting(
        default_factory=list,
        help="response cache for models with response_cache { enable: true }: local,size=<bytes> (as Triton)",
    )
    allow_client_shm: bool = setting(
        False,
        help="let KServe v2 clients register system shared memory: the server then reads and writes the "
        "/dev/shm objects they name (any its user can open)",
    )
    grpc_port: int = setting(8001, help="KServe v2 gRPC port with a model repository (0: off)")
    # Engines already serving at these addresses (`tokenmill worker --listen`) instead of one launched
    # here; `engine.model` must name the same model (the tokenizer is loaded here from it).
    worker_url: list[str] = setting(
        default_factory=list,
        help="use the engine a `tokenmill worker` serves at this tcp:// address (repeat for a fleet)",
    )
    workers: str = setting(
        "1",
        help='engine workers to start here, behind the router (cores divided); "MIN..MAX" with --planner '
        "(MIN 0: none while idle)",
    )

    @property
    def worker_range(self) -> tuple[int, int, int]:
        """(workers to start, fewest, most) from --workers N or MIN..MAX."""
        text = str(self.workers).strip()
        lo, sep, hi = text.partition("..")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"--workers takes N or MIN..MAX, got {text!r}") from None
        # MIN may be 0 (a planner's fleet that scales to zero when idle); MAX at least 1.
        if a < 0 or b < a or (sep and b < 1):
            raise ValueError(f"--workers {text}: need 0 <= N, or 0 <= MIN <= MAX and 1 <= MAX")
        return a, a, b

    # LoRA adapters served as model names of their own (server/lora_registry.py).
    lora_modules: list[str] = setting(
        default_factory=list, help="a LoRA adapter to serve: name=path (PEFT directory); repeat for more"
    )
    enable_lora_runtime_updating: bool = setting(
        False, help="let POST /v1/load_lora_adapter and /v1/unload_lora_adapter change the adapters"
    )
    fleet: FleetConfig = field(default_factory=FleetConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        if self.lora_modules or self.enable_lora_runtime_updating:
            self.engine.lora.enable_lora = True
        # Tenants (server/tenants.py): a bad or repeated key, floor or header fails at start.
        from tokenmill.server.tenants import check_tenant_header, named_tenants, parse_priority_floors

        self.api_keys()
        check_tenant_header(self.tenant_header)
        floors = parse_priority_floors(self.tenant_priority_floor)
        # The engine keeps the configured tenants' names for good: they never take one of the places
        # the names it meets are given (engine/fairness.py TenantLedger).
        sched = self.engine.scheduler
        names = {*named_tenants(self.named_api_key), *floors} - {"default"}
        known = [t.strip() for t in (sched.known_tenants or "").split(",") if t.strip()]
        if names - set(known):
            sched.known_tenants = ",".join(dict.fromkeys([*known, *sorted(names - set(known))]))

    def api_keys(self) -> list[tuple[str | None, bytes]]:
        """Every key a request may present, with its tenant's name (None: a plain key)."""
        from tokenmill.server.tenants import key_table

        return key_table(self.api_key, self.named_api_key)

    @property
    def requires_key(self) -> bool:
        return bool(self.api_key or self.named_api_key)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model
