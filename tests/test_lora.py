"""Many LoRA adapters on one base: greedy tokens and logprobs equal to peft's merged models in
transformers (float32), one adapter alone, four and the base in one batch, more adapters than slots
(eviction and reload), and prefix-cache hits that never cross adapters."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
from lora_adapters import SPECS, make_adapter
from reference import hf_greedy

from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.engine.kv_events import BlockStored
from tokenmill.lora.adapter import LoRAError, inspect_adapter

pytestmark = pytest.mark.slow
pytest.importorskip("peft", reason="peft makes the adapters and the merged reference")

NEW_TOKENS = 12
LOGPROB_TOL = 2e-3  # float32, the same math in another order (as tests/test_correctness_hf.py)
PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "In 1969, the first humans landed on the Moon. The mission was called",
    "List three prime numbers greater than 100.",
]


@pytest.fixture(scope="module")
def adapters(hf_model, llm, tmp_path_factory) -> dict:
    """name -> (LoRARequest, [reference tokens and logprobs per prompt]); "base" -> the base's."""
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    root = tmp_path_factory.mktemp("loras")
    out: dict = {"base": (None, [hf_greedy(hf_model, p, NEW_TOKENS) for p in ids]), "ids": ids}
    for i, spec in enumerate(SPECS):
        merged = make_adapter(hf_model, spec, root / spec.name)
        out[spec.name] = (
            LoRARequest(spec.name, i + 1, str(root / spec.name)),
            [hf_greedy(merged, p, NEW_TOKENS) for p in ids],
        )
        del merged
        gc.collect()
    return out


@pytest.fixture(scope="module")
def llm():
    engine = LLM(
        dtype="float32",
        max_model_len=512,
        enable_lora=True,
        max_loras=4,
        max_lora_rank=16,
        enable_kv_events=True,
    )
    yield engine
    engine.close()


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)


def check(out, ref) -> None:
    tokens, lps = ref
    assert out.outputs[0].token_ids == tokens
    for ours, theirs in zip(out.outputs[0].logprobs, lps, strict=True):
        assert abs(ours.logprob - float(theirs[ours.token_id])) < LOGPROB_TOL


def test_adapters_change_the_output(adapters) -> None:
    """Otherwise every comparison below would pass with the adapters ignored."""
    base = [t for t, _ in adapters["base"][1]]
    for spec in SPECS:
        assert [t for t, _ in adapters[spec.name][1]] != base, spec.name


def test_one_adapter_matches_peft(llm: LLM, adapters) -> None:
    lora, refs = adapters["all16"]
    outs = llm.generate(adapters["ids"], greedy(), lora_request=lora)
    for out, ref in zip(outs, refs, strict=True):
        check(out, ref)


def test_four_adapters_and_the_base_in_one_batch(llm: LLM, adapters) -> None:
    names = ["base"] + [s.name for s in SPECS]
    prompts, loras, refs = [], [], []
    for k, name in enumerate(names):
        for j, p in enumerate(adapters["ids"]):
            if (j + k) % 2 == 0:  # a mix: every adapter, several prompts, in one batch
                prompts.append(p)
                loras.append(adapters[name][0])
                refs.append(adapters[name][1][j])
    outs = llm.generate(prompts, greedy(), lora_request=loras)
    for out, ref in zip(outs, refs, strict=True):
        check(out, ref)


def test_prefix_hits_never_cross_adapters(llm: LLM, adapters) -> None:
    prompt = adapters["ids"][2]
    llm.engine.kv.pool.reset_prefix_cache()  # earlier tests cached this prompt under these adapters
    llm.engine.kv.take_events()
    for name in ("attn8", "kv16"):
        lora, refs = adapters[name]
        out = llm.generate([prompt], greedy(), lora_request=lora)[0]
        check(out, refs[2])  # the second adapter reads none of the first's blocks
    stored = [e for e in llm.engine.kv.take_events() if isinstance(e, BlockStored)]
    assert {e.lora_name for e in stored} >= {"attn8", "kv16"}
    assert all(e.lora_id == adapters[e.lora_name][0].lora_int_id for e in stored if e.lora_name)
    hits = llm.engine.kv.prefix_cache_hits
    again = llm.generate([prompt], greedy(), lora_request=adapters["kv16"][0])[0]
    check(again, adapters["kv16"][1][2])
    assert llm.engine.kv.prefix_cache_hits > hits  # the same adapter does hit


def test_more_adapters_than_slots(adapters) -> None:
    """Two slots, four adapters in one batch: requests wait for a slot, idle adapters are evicted and
    read again, and every output still matches."""
    engine = LLM(dtype="float32", max_model_len=512, enable_lora=True, max_loras=2, max_lora_rank=16)
    try:
        prompts, loras, refs = [], [], []
        for spec in SPECS:
            for j in (0, 3):
                prompts.append(adapters["ids"][j])
                loras.append(adapters[spec.name][0])
                refs.append(adapters[spec.name][1][j])
        outs = engine.generate(prompts, greedy(), lora_request=loras)
        for out, ref in zip(outs, refs, strict=True):
            check(out, ref)
        assert engine.engine.scheduler.loras.num_loads >= 4
        # Loaded again under a new id (an unload and reload): read again, same answers.
        old = adapters["all16"][0]
        again = LoRARequest(old.lora_name, 99, old.lora_path)
        check(engine.generate([adapters["ids"][1]], greedy(), lora_request=again)[0], adapters["all16"][1][1])
    finally:
        engine.close()


def test_bad_adapters_are_refused(llm: LLM, adapters, tmp_path: Path) -> None:
    cfg = llm.engine.model_config
    with pytest.raises(LoRAError, match="does not exist"):
        inspect_adapter(tmp_path / "missing", cfg, 16)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAError, match="not valid JSON"):
        inspect_adapter(bad, cfg, 16)
    good = Path(adapters["all16"][0].lora_path)
    with pytest.raises(LoRAError, match="above --max-lora-rank 8"):
        inspect_adapter(good, cfg, 8)
    odd = tmp_path / "odd"
    odd.mkdir()
    conf = json.loads((good / "adapter_config.json").read_text())
    (odd / "adapter_config.json").write_text(json.dumps({**conf, "target_modules": ["q_proj", "wte"]}))
    with pytest.raises(LoRAError, match="not linears of this model"):
        inspect_adapter(odd, cfg, 16)
    (odd / "adapter_config.json").write_text(json.dumps({**conf, "use_dora": True}))
    with pytest.raises(LoRAError, match="DoRA"):
        inspect_adapter(odd, cfg, 16)
    with pytest.raises(ValueError, match="enable_lora"):
        off = LLM.__new__(LLM)
        off.config, off._loras = llm.config.__class__(), {}
        off._check_lora(adapters["all16"][0])


def _text(llm: LLM, tokens: list[int]) -> str:
    return llm.tokenizer.decode(tokens)


def test_served_adapters_through_the_openai_client(llm: LLM, adapters) -> None:
    """Each adapter a model name; adapters loaded and unloaded at run time while streams run on others,
    none failing; bad loads refused with 4xx while the server keeps serving."""
    import threading
    import time

    import httpx
    import openai
    from server_fixture import running_server

    all16, attn8 = adapters["all16"][0], adapters["attn8"][0]
    args = ["--dtype", "float32", "--max-loras", "2", "--enable-lora-runtime-updating"]
    with running_server(*args, "--lora-modules", f"all16={all16.lora_path}") as proc:
        base = proc.base_url
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        models = {m.id: m for m in client.models.list().data}
        (base_name,) = set(models) - {"all16"}
        assert models["all16"].model_extra["parent"] == base_name

        def complete(model: str, j: int) -> str:
            r = client.completions.create(
                model=model, prompt=adapters["ids"][j], max_tokens=NEW_TOKENS, temperature=0.0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert r.model == model
            return r.choices[0].text

        assert complete("all16", 0) == _text(llm, adapters["all16"][1][0][0])
        # vLLM's lora_requests_info, as llm-d's LoRA affinity reads it (the engine's stats arrive with
        # its heartbeat: polled briefly).
        deadline = time.monotonic() + 10
        while 'resident_lora_adapters="all16"' not in httpx.get(f"{base}/metrics").text:
            assert time.monotonic() < deadline, "the adapter never showed in /metrics"
            time.sleep(0.2)

        # Streams on all16 run while attn8 is loaded, used, and all16 itself unloaded.
        results: list[str] = []

        def stream(j: int) -> None:
            chunks = client.completions.create(
                model="all16", prompt=adapters["ids"][j], max_tokens=48, temperature=0.0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            results.append("".join(c.choices[0].text for c in chunks if c.choices))

        threads = [threading.Thread(target=stream, args=(j,)) for j in (1, 3)]
        for t in threads:
            t.start()
        r = httpx.post(
            f"{base}/v1/load_lora_adapter", json={"lora_name": "attn8", "lora_path": attn8.lora_path}
        )
        assert r.status_code == 200, r.text
        assert complete("attn8", 2) == _text(llm, adapters["attn8"][1][2][0])
        r = httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "all16"})
        assert r.status_code == 200, r.text
        for t in threads:
            t.join(timeout=120)
        assert len(results) == 2 and all(results)
        with pytest.raises(openai.NotFoundError):
            complete("all16", 0)

        bad = [
            ({"lora_name": "x", "lora_path": "/nonexistent"}, 400, "does not exist"),
            ({"lora_name": "attn8", "lora_path": attn8.lora_path}, 400, "already been loaded"),
            ({"lora_name": base_name, "lora_path": attn8.lora_path}, 400, "base model"),
            ({"lora_name": "y"}, 400, "lora_path"),
        ]
        for body, status, words in bad:
            r = httpx.post(f"{base}/v1/load_lora_adapter", json=body)
            assert r.status_code == status and words in r.text, (body, r.text)
        r = httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "nope"})
        assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]
        assert complete("attn8", 2) == _text(llm, adapters["attn8"][1][2][0])  # still serving
        assert complete(base_name, 0) == _text(llm, adapters["base"][1][0][0])


@pytest.mark.parametrize(
    "split", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"]
)
def test_parallel_two_ranks(adapters, split: dict) -> None:
    """Tensor parallel: A split with the base's column/row split; pipeline parallel: each stage its layers'
    share of the adapter. The same tokens as peft's merged model."""
    engine = LLM(dtype="float32", max_model_len=512, enable_lora=True, max_loras=2, **split)
    try:
        names = ["all16", "base", "attn8"]
        prompts = [adapters["ids"][j] for j in range(3)]
        outs = engine.generate(prompts, greedy(), lora_request=[adapters[n][0] for n in names])
        for j, (out, name) in enumerate(zip(outs, names, strict=True)):
            check(out, adapters[name][1][j])
    finally:
        engine.close()


@pytest.mark.parametrize("quantization", ["int4", "int8", "fp8"])
def test_delta_on_every_quantized_form(adapters, quantization: str) -> None:
    """Each wrapped linear of a quantized model (whatever form this CPU gives it) adds exactly the
    adapter's delta to its base's output, on the rows of its segment only."""
    import torch

    from tokenmill.lora.adapter import read_adapter

    engine = LLM(max_model_len=256, enable_lora=True, max_loras=2, quantization=quantization)
    try:
        lora = adapters["all16"][0]
        model = engine.engine.runner.model
        model.lora.load(1, lora.lora_int_id, lora.lora_path)
        info, weights = read_adapter(lora.lora_path, engine.engine.model_config, 16)
        names = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
        g = torch.Generator().manual_seed(0)
        dtype = engine.engine.executor.worker.dtype  # the rows' (arithmetic's) dtype
        for (layer, fused), w in list(model.lora.linears.items())[:8]:
            x = torch.randn(5, w.in_features, generator=g).to(dtype)
            model.lora.set_segments([(1, 4, 1)])
            try:
                got = w(x).float()
            finally:
                model.lora.set_segments([])
            base = w.base(x).float()
            want = base.clone()
            for (lo, hi), name in zip(w.parts, names.get(fused, (fused,)), strict=True):
                a, b = weights[(layer, name)]
                want[1:4, lo:hi] += (x[1:4].float() @ a.t()) @ b.t() * info.scaling
            scale = want.abs().max()
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
            assert (got - want).abs().max() <= tol * scale, (quantization, layer, fused)
            assert torch.equal(got[[0, 4]], base[[0, 4]])
            assert not torch.allclose(got[1:4], base[1:4])  # the delta is there
    finally:
        engine.close()


def test_speculative_decoding_verifies_with_the_adapter(adapters) -> None:
    """Prompt-lookup drafts ignore the adapter; verification applies it: the adapter's own tokens."""
    engine = LLM(
        dtype="float32",
        max_model_len=512,
        enable_lora=True,
        max_loras=2,
        speculative_config={"method": "ngram"},
    )
    try:
        names = ["kv16", "base", "all16"]
        outs = engine.generate(adapters["ids"][:3], greedy(), lora_request=[adapters[n][0] for n in names])
        for j, (out, name) in enumerate(zip(outs, names, strict=True)):
            assert out.outputs[0].token_ids == adapters[name][1][j][0], name
    finally:
        engine.close()


def test_an_adapter_that_cannot_be_read_fails_its_requests_alone(llm: LLM, adapters, tmp_path: Path) -> None:
    """Files broken after the check: the request on it ends with an error saying why, its slot holds
    nothing afterwards, and the engine goes on serving (the base and other adapters)."""
    import shutil

    from tokenmill.engine.protocol import EngineRequest, FinishReason

    good = Path(adapters["all16"][0].lora_path)
    broken = tmp_path / "broken"
    shutil.copytree(good, broken)
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    engine = llm.engine
    lora = LoRARequest("broken", 77, str(broken))
    engine.add_request(EngineRequest("broken-1", adapters["ids"][0], greedy(), lora=lora))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    (out,) = [o for o in outs if o.request_id == "broken-1"]
    assert out.finish_reason == FinishReason.ERROR and "could not be loaded" in (out.error or "")
    assert 77 not in engine.scheduler.loras.resident
    for name in ("base", "attn8"):
        check(
            llm.generate([adapters["ids"][1]], greedy(), lora_request=adapters[name][0])[0],
            adapters[name][1][1],
        )


def test_a_cache_salt_cannot_pose_as_an_adapter(llm: LLM, adapters) -> None:
    with pytest.raises(ValueError, match="NUL"):
        llm.generate([adapters["ids"][0]], greedy(), cache_salt="\x00lora\x00all16")


def test_cpp_decode_step_gives_the_python_loops_bits_with_adapters(adapters) -> None:
    """Decode steps with rows on adapters run in the C++ layer loop (the deltas by the same kernel, from
    the same slots): every logit equal to the Python loop's."""
    import torch
    from test_decode_step import _counted, _record_logits

    engine = LLM(max_model_len=256, enable_prefix_caching=False, enable_lora=True, max_loras=2)
    try:
        model = engine.engine.executor.worker.model
        step = model.layer_loop
        if step is None:
            pytest.skip("this CPU's kernels for the model are not all ones the C++ step calls")
        calls = _counted(step)
        names = ["all16", "base", "kv16", "all16"]
        loras = [adapters[n][0] for n in names]
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 5, 7, 9)]
        seen = _record_logits(engine)
        fast = [o.outputs[0].token_ids for o in engine.generate(adapters["ids"], params, lora_request=loras)]
        fast_logits = list(seen)
        assert calls[0] >= 5, "the decode steps with adapter rows ran in C++"
        seen.clear()
        model.layer_loop = None
        slow = [o.outputs[0].token_ids for o in engine.generate(adapters["ids"], params, lora_request=loras)]
        assert fast == slow
        assert len(fast_logits) == len(seen)
        for a, b in zip(fast_logits, seen, strict=True):
            assert torch.equal(a, b)
    finally:
        engine.close()


def test_structured_output_on_adapters(llm: LLM, adapters) -> None:
    """A grammar constrains an adapter's rows as the base's: every output parses, and matches its schema."""
    import json

    from tokenmill.sampling_params import StructuredOutputs

    schema = {
        "type": "object",
        # Bounded values: an output always fits max_tokens, so each one must parse.
        "properties": {"city": {"enum": ["Paris", "Houston", "Rome"]}, "year": {"enum": [1969, 2024]}},
        "required": ["city", "year"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        temperature=0.0, max_tokens=48, structured=StructuredOutputs(json=json.dumps(schema))
    )  # fmt: skip
    names = ["all16", "base", "attn8"]
    outs = llm.generate(adapters["ids"][:3], params, lora_request=[adapters[n][0] for n in names])
    for out in outs:
        value = json.loads(out.outputs[0].text)
        assert value["city"] in ("Paris", "Houston", "Rome") and value["year"] in (1969, 2024)
