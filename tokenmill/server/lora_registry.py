"""The LoRA adapters a server serves, each an OpenAI model name beside the base model's.

`--lora-modules name=path` (or vLLM's JSON form) names them at start; with
`--enable-lora-runtime-updating`, POST /v1/load_lora_adapter and /v1/unload_lora_adapter change the set
while serving (vLLM's routes and bodies). An adapter is checked against the model (lora/adapter.py) before
its name is accepted; the workers read it when a request first needs it. Unloading takes the name away at
once: requests already running on it finish on it, and its slot is reused once they have.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Any

from tokenmill.lora.adapter import LoRAError, fingerprint, inspect_adapter
from tokenmill.lora.request import LoRARequest
from tokenmill.models.config import ModelConfig
from tokenmill.server.errors import APIError


@dataclass(frozen=True)
class LoRAModule:
    name: str
    path: str


def parse_lora_module(text: str) -> LoRAModule:
    """'name=path', or vLLM's JSON {"name": ..., "path": ...}; ValueError says what is wrong."""
    text = text.strip()
    if text.startswith("{"):
        try:
            d = json.loads(text)
            return LoRAModule(str(d["name"]), str(d["path"]))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f'--lora-modules {text!r}: JSON needs "name" and "path" ({e})') from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: expected name=path")
    return LoRAModule(name, path)


class LoRARegistry:
    def __init__(self, base_name: str, model: ModelConfig | None, max_rank: int, enabled: bool) -> None:
        self.base_name = base_name
        self.model = model
        self.max_rank = max_rank
        self.enabled = enabled
        self.adapters: dict[str, LoRARequest] = {}
        # Unloaded adapters, for requests admitted before the unload (new ones get 404 by `knows`).
        self.retired: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def add(self, name: str, path: str) -> LoRARequest:
        """Accept an adapter under `name`; APIError (400) says why not."""
        if not self.enabled or self.model is None:
            raise APIError(400, "LoRA is off on this server: start it with --enable-lora or --lora-modules")
        if not name or not path:
            raise APIError(400, "both lora_name and lora_path are required", "lora_name")
        if name == self.base_name:
            raise APIError(400, f"{name!r} is the base model's name: an adapter needs another", "lora_name")
        if name in self.adapters:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", "lora_name")
        try:
            inspect_adapter(path, self.model, self.max_rank)
            mark = fingerprint(path)
        except (LoRAError, OSError) as e:
            raise APIError(400, str(e), "lora_path") from None
        lora = self.adapters[name] = LoRARequest(name, next(self._ids), path, mark)
        self.retired.pop(name, None)
        return lora

    def remove(self, name: str) -> LoRARequest:
        lora = self.adapters.pop(name, None)
        if lora is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
        self.retired[name] = lora
        return lora

    def get(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's model names (None: the base model, or no model given). A request
        checked before its adapter was unloaded still runs on it (never silently on the base)."""
        if model is None:
            return None
        return self.adapters.get(model) or self.retired.get(model)

    def knows(self, model: str) -> bool:
        return model == self.base_name or model in self.adapters

    def cards(self, created: int, max_model_len: int) -> list[dict[str, Any]]:
        return [
            {
                "id": lora.lora_name,
                "object": "model",
                "created": created,
                "owned_by": "tokenmill",
                "root": lora.lora_path,
                "parent": self.base_name,
                "max_model_len": max_model_len,
            }
            for lora in self.adapters.values()
        ]
