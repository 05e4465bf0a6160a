"""Embedding jobs: prefill-only sequences pooled into unit vectors, checked against transformers run by hand.

The vectors equal AutoModel's final hidden states pooled as the model's sentence-transformers config says and
normalised, on the fused layers (qwen2, llama) and on transformers' own forward (qwen3); a chunked prefill gives the
unchunked vector; embedding inputs share steps with generation without changing its tokens, and free their slot
right after their last chunk.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer, LlamaConfig, Qwen3Config

from rqbatcher.client import Client, JobFailed
from rqbatcher.jobs import keys
from rqbatcher.schema import GenerationRequest
from rqbatcher.workers.engine.api import RequestError
from rqbatcher.workers.job_worker.stats_publisher import StatsPublisher
from rqbatcher.workers.job_worker.worker import JobWorker
from rqbatcher.workers.model.loading import ModelLoadError
from rqbatcher.workers.model.pooling import embedding_facts
from tests.engine_helpers import engine_for, greedy, random_prompts, run_all
from tests.fake_engine import FakeEngine
from tests.jobs_support import fake_redis_fixture, keep_signal_handlers_fixture  # noqa: F401
from tests.tiny_models import build_embedding_model

Q = "embed"
NUM_BLOCKS = 96  # a small KV cache: the engines build fast
TEXTS = ["The quick brown fox jumps over the lazy dog. " * 3, "Redis streams", "café"]
TOLERANCE = 1e-5  # fp32: our kernels and transformers' sum in different orders
CHUNK_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny embedding models, built once: (pooling, family, matryoshka) -> folder."""
    built = {}

    def get(pooling="mean", family="qwen2", matryoshka=False):
        key = (pooling, family, str(matryoshka))
        if key not in built:
            built[key] = build_embedding_model(tmp_path_factory.mktemp(f"embed-{pooling}-{family}"), pooling,
                                               matryoshka, family)
        return built[key]

    return get


def engine(model_dir, **config):
    return engine_for(model_dir, num_blocks=NUM_BLOCKS, **config)


def vectors(out) -> list[np.ndarray]:
    return [np.frombuffer(base64.b64decode(e), "<f4") for e in out.embeddings]


def embed(eng, inputs, **fields) -> list[np.ndarray]:
    eng.add("e", GenerationRequest(embed=inputs, **fields))
    out = run_all(eng)["e"]
    assert out.error is None and (out.finish_reason, out.text, out.token_ids) == ("stop", "", [])
    return vectors(out)


def reference(model_dir, inputs, pooling) -> list[np.ndarray]:
    """AutoModel's last hidden state, pooled and normalised by hand."""
    model, tokenizer = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(
        model_dir)
    out = []
    for item in inputs:
        ids = torch.tensor([item]) if isinstance(item, list) else tokenizer(item, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            hidden = model(input_ids=ids).last_hidden_state[0]
        pooled = {"mean": hidden.mean(0), "lasttoken": hidden[-1], "cls": hidden[0]}[pooling]
        out.append(torch.nn.functional.normalize(pooled, dim=0).numpy())
    return out


@pytest.mark.parametrize("pooling,family", [("mean", "qwen2"), ("lasttoken", "qwen3"), ("cls", "llama")])
def test_vectors_equal_transformers_pooled_and_normalised(models, pooling, family):
    model_dir = models(pooling, family)
    eng = engine(model_dir)
    assert eng.tasks == ("embed",)
    inputs = [*TEXTS, [5, 6, 7, 8, 9]]
    got = embed(eng, inputs)
    for mine, ref in zip(got, reference(model_dir, inputs, pooling), strict=True):
        assert mine.shape == (64,) and abs(np.linalg.norm(mine) - 1) < 1e-5
        np.testing.assert_allclose(mine, ref, atol=TOLERANCE)


@pytest.mark.parametrize("pooling", ["mean", "lasttoken"])
def test_a_chunked_prefill_gives_the_unchunked_vector(models, pooling):
    model_dir = models(pooling)
    long_input = random_prompts(1, seed=3, min_len=100, max_len=100)[0]
    whole = embed(engine(model_dir), [long_input])[0]
    chunked = engine(model_dir, max_num_batched_tokens=16)
    chunked.add("e", GenerationRequest(embed=[long_input]))
    steps = 0
    while chunked.has_work():
        finals = chunked.step()
        steps += 1
    assert steps == 7  # ceil(100 / 16) chunks and no decode step
    np.testing.assert_allclose(vectors(finals[0])[0], whole, atol=CHUNK_TOLERANCE)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "transformers"])
def test_embeddings_share_steps_with_generation_without_changing_it(tiny_model_dir, fused):
    model_dir = tiny_model_dir("llama")
    prompts = random_prompts(3, seed=5, min_len=20, max_len=40)

    def run(with_embeddings):
        eng = engine(model_dir, tasks=("generate", "embed"), max_num_batched_tokens=32)
        if not fused:
            eng.runner.fused = None
        mixed_steps, execute = [], eng.runner.execute

        def recording(plan):
            kinds = {seq.embed for seq in plan.num_tokens}
            mixed_steps.append(kinds == {True, False})
            return execute(plan)

        eng.runner.execute = recording
        for i, prompt in enumerate(prompts):
            eng.add(f"g{i}", greedy(prompt, 8))
        if with_embeddings:
            eng.add("e", GenerationRequest(embed=[*TEXTS, prompts[0]]))
        finals = run_all(eng)
        return finals, any(mixed_steps)

    alone, _ = run(False)
    together, mixed = run(True)
    assert mixed
    assert {k: v.token_ids for k, v in alone.items()} == {k: together[k].token_ids for k in alone}
    for mine, ref in zip(vectors(together["e"]), reference(model_dir, [*TEXTS, prompts[0]], "mean"), strict=True):
        np.testing.assert_allclose(mine, ref, atol=TOLERANCE)
    assert together["e"].num_prompt_tokens == sum(len(AutoTokenizer.from_pretrained(model_dir)(t)["input_ids"])
                                                  for t in TEXTS) + len(prompts[0])


def test_an_input_frees_its_slot_right_after_its_last_chunk(models):
    eng = engine(models(), max_num_seqs=2)
    eng.add("e", GenerationRequest(embed=["Redis streams carry tokens", "café"]))
    assert eng.free_slots == 0
    outputs = eng.step()
    assert [o.request_id for o in outputs] == ["e"] and outputs[0].finished
    assert not eng.has_work() and eng.free_slots == 2 and eng.stats().kv_cache_usage == 0


def test_inputs_beyond_the_slots_wait_in_the_scheduler(models):
    eng = engine(models(), max_num_seqs=2)
    eng.add("e", GenerationRequest(embed=[f"input number {i}" for i in range(5)]))
    eng.step()
    assert len(eng.scheduler.running) == 0 and len(eng.scheduler.waiting) == 3 and eng.free_slots == 0
    assert len(run_all(eng)["e"].embeddings) == 5


def test_embedding_inputs_neither_read_nor_fill_the_prefix_cache(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    prompt = random_prompts(1, seed=8, min_len=64, max_len=64)[0]
    eng = engine(model_dir, tasks=("generate", "embed"))
    eng.add("g", greedy(prompt, 2))
    run_all(eng)
    hits = eng.stats().prefix_cache.hits
    first = embed(eng, [prompt])
    second = embed(eng, [prompt])
    assert eng.stats().prefix_cache.hits == hits
    np.testing.assert_array_equal(first, second)
    np.testing.assert_allclose(first[0], reference(model_dir, [prompt], "mean")[0], atol=TOLERANCE)


def test_an_input_longer_than_the_context_fails_naming_input(models):
    eng = engine(models(), max_model_len=64)
    with pytest.raises(RequestError, match="input 1 has 65 tokens"):
        eng.add("e", GenerationRequest(embed=[[5] * 10, [5] * 65]))
    assert not eng.has_work()
    assert len(embed(eng, [[5] * 64])) == 1  # the whole context is the limit: an input needs no room to grow


def test_dimensions_are_refused_without_matryoshka_and_honoured_with_it(models):
    plain = engine(models())
    with pytest.raises(RequestError, match="dimensions=16"):
        plain.add("e", GenerationRequest(embed=["café"], dimensions=16))
    assert embed(plain, ["café"], dimensions=64)[0].shape == (64,)  # its own size
    full = embed(plain, ["café"])[0]
    assert plain.stats().matryoshka_dimensions == ""

    matryoshka = engine(models(matryoshka=True))
    short = embed(matryoshka, ["café"], dimensions=16)[0]
    cut = full[:16] / np.linalg.norm(full[:16])  # the same weights: the same full vector
    np.testing.assert_allclose(short, cut, atol=1e-6)
    with pytest.raises(RequestError, match="dimensions=65"):
        matryoshka.add("e", GenerationRequest(embed=["café"], dimensions=65))

    listed = engine(models(matryoshka=[32, 16]))
    assert listed.stats().matryoshka_dimensions == "32,16"
    assert embed(listed, ["café"], dimensions=32)[0].shape == (32,)
    with pytest.raises(RequestError, match="dimensions=24"):
        listed.add("e", GenerationRequest(embed=["café"], dimensions=24))


def test_a_worker_serves_only_its_tasks(models, tiny_model_dir):
    embedder = engine(models())
    with pytest.raises(RequestError, match="does not serve generate jobs"):
        embedder.add("g", greedy([5, 6], 2))
    stats = embedder.stats()
    assert (stats.tasks, stats.embedding_size) == ("embed", 64)
    generator = engine(tiny_model_dir("llama"))
    with pytest.raises(RequestError, match="does not serve embed jobs"):
        generator.add("e", GenerationRequest(embed=["café"]))
    assert (generator.stats().tasks, generator.stats().embedding_size) == ("generate", 0)
    with pytest.raises(ModelLoadError, match="embedding model"):
        engine(models(), tasks=("generate",))


def test_an_aborted_embedding_request_frees_every_input(models):
    eng = engine(models(), max_num_batched_tokens=8)
    eng.add("e", GenerationRequest(embed=[[5] * 30, [6] * 30]))
    eng.step()
    out = eng.abort("e")
    assert out.finish_reason == "cancelled" and out.embeddings is None
    assert not eng.has_work() and eng.stats().kv_cache_usage == 0
    eng.add("t", GenerationRequest(embed=[[5] * 30]))
    eng.step()
    assert "timeout" in eng.abort("t", reason="timeout").error  # half an answer is none: a timeout fails the job


def test_a_model_folder_says_whether_and_how_it_embeds(tmp_path):
    bare_qwen3 = embedding_facts(str(tmp_path), Qwen3Config(architectures=["Qwen3Model"], hidden_size=64,
                                                              matryoshka_dimensions=[32]))
    assert (bare_qwen3.is_embedding_model, bare_qwen3.pooling, bare_qwen3.matryoshka) == (True, "last", "32")
    bare_llama = embedding_facts(str(tmp_path), LlamaConfig(architectures=["LlamaModel"]))
    assert (bare_llama.is_embedding_model, bare_llama.pooling) == (True, "mean")
    causal = embedding_facts(str(tmp_path), LlamaConfig(architectures=["LlamaForCausalLM"]))
    assert not causal.is_embedding_model and causal.dimensions_problem(causal.size) is None


def test_the_fake_engine_embeds_and_publishes_both_tasks():
    eng = FakeEngine()
    eng.add("e", GenerationRequest(embed=["a", [1, 2]], dimensions=4))
    out = eng.step()[0]
    assert [v.shape for v in vectors(out)] == [(4,), (4,)] and out.finish_reason == "stop"
    result = out.to_result()
    assert (result.embeddings, result.usage.prompt_tokens, result.usage.completion_tokens) == (out.embeddings, 3, 0)
    stats = eng.stats()
    assert (stats.tasks, stats.embedding_size, stats.matryoshka_dimensions) == ("generate,embed", 8, "any")


@pytest.mark.usefixtures("keep_signal_handlers")
def test_a_worker_runs_embedding_jobs_and_fails_what_it_does_not_serve(models, fake_redis):
    client = Client(fake_redis, queue=Q)
    embedding, generation = client.submit(GenerationRequest(embed=TEXTS)), client.submit(greedy([5, 6], 2))
    eng = engine(models())
    worker = JobWorker(keys.priority_queue_names([Q]), eng, connection=fake_redis)
    stats = StatsPublisher(worker).current()
    assert (stats.tasks, stats.embedding_size, stats.matryoshka_dimensions) == ("embed", 64, "")
    worker.work(burst=True)
    result = client.result(embedding, timeout=5)
    assert (result.text, result.token_ids, result.finish_reason, result.usage.completion_tokens) == ("", [], "stop", 0)
    for mine, ref in zip(vectors(result), reference(models(), TEXTS, "mean"), strict=True):
        np.testing.assert_allclose(mine, ref, atol=TOLERANCE)
    with pytest.raises(JobFailed, match="does not serve generate jobs"):
        client.result(generation, timeout=5)


def test_the_fake_engine_worker_publishes_both_tasks(fake_redis):
    worker = JobWorker(keys.priority_queue_names([Q]), FakeEngine(), connection=fake_redis)
    stats = StatsPublisher(worker).current()
    assert (stats.tasks, stats.embedding_size, stats.matryoshka_dimensions) == ("generate,embed", 8, "any")
