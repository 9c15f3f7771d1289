"""vLLM's `kv_transfer_params` on the OpenAI routes: how a prefill/decode proxy of another project
(vllm-router's P/D mode, llm-d's routing sidecar) drives a tokenmill prefill server and a tokenmill
decode server, with no tokenmill router between them.

The proxy sends the prompt to the prefill server with `{"do_remote_decode": true, ...}` and max_tokens 1;
the prefill server keeps the prompt's blocks and answers with `kv_transfer_params` saying where they can
be read, in the shape of vLLM's NIXL connector (remote_host, remote_port, remote_block_ids,
remote_request_id, remote_engine_id, tp_size) plus fields of ours (remote_block_size, remote_grant, and
remote_block_hash, which binds the answer to its prompt; a prefill engine of several ranks adds
remote_endpoints, every rank's transfer server, and remote_pp_size).
The proxy hands that object, unchanged, to the decode server with the same request, and the decode
server reads the blocks from the prefill server's transfer port instead of computing the prompt
(engine/pd_connector.py). A read that fails (the blocks were freed, the grant lapsed, the prefill server
went away) is recomputed and counted (tokenmill:kv_transfer_read_failures), never answered wrong.
"""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any

import msgspec

from tokenmill.server.errors import APIError

PARAM = "kv_transfer_params"
MAX_RANKS = 1024  # transfer servers one answer may name (engine/pd_connector.py's bound on a layout)


class _Params(msgspec.Struct):
    """What a proxy may send; unknown fields (another connector's) are ignored, as vLLM does."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: list[int] | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_request_id: str | None = None
    remote_block_size: int | None = None
    remote_grant: str | None = None
    remote_block_hash: str | None = None
    tp_size: int | None = None
    remote_pp_size: int | None = None
    # HOST:PORT of each rank's transfer server, in rank order
    remote_endpoints: Annotated[list[str], msgspec.Meta(max_length=MAX_RANKS)] | None = None


def to_engine(
    params: dict[str, Any] | None, block_size: int, peers: set[str] | None = None
) -> dict[str, Any] | None:
    """A request's kv_transfer_params as the engine's kv_transfer (engine/protocol.py), or 400.

    `peers`: the HOST:PORT transfer servers a client may send the decode engine to read from; None when
    the workers' secret authenticates every peer (a server without it cannot complete the handshake).
    Anyone else could answer a read with KV of their own making, or name another process's cache."""
    if params is None:
        return None
    try:
        p = msgspec.convert(params, _Params)
    except msgspec.ValidationError as e:
        raise APIError(400, f"{PARAM}: {e}", PARAM) from None
    if p.do_remote_decode and p.do_remote_prefill:
        raise APIError(400, f"{PARAM}: do_remote_decode and do_remote_prefill are exclusive", PARAM)
    if p.do_remote_decode:
        return {"do_remote_decode": True}
    if not p.do_remote_prefill:
        return None
    if p.remote_host is None or p.remote_port is None or p.remote_request_id is None:
        raise APIError(
            400,
            f"{PARAM}: do_remote_prefill needs remote_host, remote_port and remote_request_id (the prefill "
            "server's answer, passed on unchanged)",
            PARAM,
        )
    if not p.remote_block_ids:
        return None  # a prompt shorter than a block: nothing to read, the decode server computes it
    host = p.remote_host
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass  # a host name; the engine checks the endpoint's shape
    endpoints = p.remote_endpoints or []
    for peer in [f"{host}:{p.remote_port}", *endpoints]:
        if peers is not None and peer not in peers:
            raise APIError(
                403,
                f"{PARAM}: {peer} is not a prefill server this one reads from: name it in "
                "--kv-transfer-peers, or give both servers the workers' secret (TOKENMILL_WORKER_SECRET)",
                PARAM,
            )
    remote = {
        "endpoint": f"tcp://{host}:{p.remote_port}",
        "request_id": p.remote_request_id,
        "block_ids": p.remote_block_ids,
        # A vLLM prefill server's answer has no block size: it must be ours, or the engine refuses it.
        "block_size": p.remote_block_size if p.remote_block_size is not None else block_size,
        "grant": p.remote_grant or "",
        "block_hash": p.remote_block_hash or "",
    }
    if endpoints or (p.tp_size or 1) > 1 or (p.remote_pp_size or 1) > 1:
        # A prefill engine of several ranks: the decode engine checks it has the same layout.
        remote.update(
            endpoints=[f"tcp://{e}" for e in endpoints], tp_size=p.tp_size or 1, pp_size=p.remote_pp_size or 1
        )
    return {"remote": remote}


def from_engine(kv_transfer: dict[str, Any] | None) -> dict[str, Any] | None:
    """A prefill server's answer (the engine's RemoteBlocks) in vLLM's kv_transfer_params shape."""
    if not kv_transfer or "endpoint" not in kv_transfer:
        return None
    hostport = kv_transfer["endpoint"].removeprefix("tcp://")
    host, _, port = hostport.rpartition(":")
    out = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": f"tokenmill@{hostport}",
        "remote_host": host.strip("[]"),
        "remote_port": int(port),
        "remote_block_ids": kv_transfer["block_ids"],
        "remote_request_id": kv_transfer["request_id"],
        "remote_block_size": kv_transfer["block_size"],
        "remote_grant": kv_transfer.get("grant", ""),
        "remote_block_hash": kv_transfer.get("block_hash", ""),
        "tp_size": kv_transfer.get("tp_size", 1),
    }
    if kv_transfer.get("endpoints"):  # every rank's transfer server, and the engine's layout
        out["remote_endpoints"] = [e.removeprefix("tcp://") for e in kv_transfer["endpoints"]]
        out["remote_pp_size"] = kv_transfer.get("pp_size", 1)
    return out
