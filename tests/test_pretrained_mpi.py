"""hp.save_pretrained / hp.load_pretrained under a real mpirun on 2 × 2: a transformers GPT-2 (head tied to the
embedding, across stages) and a Llama (untied head) split into a pipeline, trained a step, saved as a Hugging Face
folder that transformers' own from_pretrained loads (its outputs equal the pipeline's), and loaded back into a
pipeline built from other weights (its outputs equal again); ZeRO-3's freed parameters are gathered to be saved;
a folder lacking a tensor is refused on every rank, naming it."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from mpi4py import MPI

import hybridpipe as hp
from agree import ranks_agree

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "pipeline"))
from split_models import gpt2, llama  # noqa: E402

pytestmark = pytest.mark.mpi(ranks=[4], timeout=300, shared=True)

torch.set_num_threads(1)
MODELS = {"gpt2": gpt2, "llama": llama}


@pytest.fixture(scope="module", autouse=True)
def grid():
    yield hp.init(pipeline_stages=2)
    hp.shutdown()


def pipeline(name: str, seed: int = 0, zero: int = 0):
    module, batch, loss = MODELS[name](4)
    if seed:
        torch.manual_seed(seed)
        module = type(module)(module.config)  # the same configuration, other weights
    model = hp.PipelineModel(module, sample=batch(2, 0)[0], loss_fn=loss, micro_batches=2, split="auto")
    optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                        named_parameters=model.named_parameters(), zero=zero)
    return model, optimizer, batch


def logits(model, batch) -> torch.Tensor:
    output = model.predict(batch(4, 7)[0])
    return (output.logits if hasattr(output, "logits") else output).detach()


@pytest.mark.parametrize("name,zero", [("gpt2", 0), ("llama", 0), ("llama", 3)])
def test_a_pipeline_goes_to_hugging_face_and_back(name, zero, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp(name)) if hp.rank() == 0 else None)
    grid = hp.grid()
    model, optimizer, batch = pipeline(name, zero=zero)
    try:
        inputs, targets = batch(4, 1)
        rows = slice(grid.replica * 2, grid.replica * 2 + 2)
        optimizer.zero_grad()
        model.train_step({k: v[rows] for k, v in inputs.items()}, targets[rows])
        optimizer.step()
        trained = logits(model, batch)
        hp.save_pretrained(model, folder, optimizer=optimizer)
    finally:
        model.close()
    with ranks_agree(what="transformers loads it"):
        files = sorted(os.listdir(folder))
        assert "config.json" in files and "model.safetensors.index.json" in files
        assert [f for f in files if f.endswith(".safetensors")] == ["model-00001-of-00002.safetensors",
                                                                      "model-00002-of-00002.safetensors"]
        weight_map = json.loads(open(os.path.join(folder, "model.safetensors.index.json")).read())["weight_map"]
        if name == "gpt2":  # the tied head is written once, as the embedding (as transformers saves it)
            assert "transformer.wte.weight" in weight_map and "lm_head.weight" not in weight_map
        else:
            assert "lm_head.weight" in weight_map and "model.embed_tokens.weight" in weight_map
        loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            theirs = loaded(**batch(4, 7)[0]).logits
        torch.testing.assert_close(theirs, trained, rtol=1e-5, atol=1e-5)
    model, optimizer, batch = pipeline(name, seed=11, zero=zero)
    try:
        before = logits(model, batch)
        report = hp.load_pretrained(model, folder, optimizer=optimizer)
        after = logits(model, batch)
        with ranks_agree(what="loaded back"):
            assert not torch.allclose(before, trained)  # other weights before the load
            torch.testing.assert_close(after, trained, rtol=1e-5, atol=1e-5)
            assert report["tensors"] > 0 and len(report["files"]) == 2
    finally:
        model.close()


def test_a_folder_lacking_a_tensor_is_refused_on_every_rank(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    folder = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("broken")) if hp.rank() == 0 else None)
    model, optimizer, batch = pipeline("llama")
    try:
        hp.save_pretrained(model, folder)
        if hp.rank() == 0:  # drop the final norm from the second shard
            path = os.path.join(folder, "model-00002-of-00002.safetensors")
            tensors = load_file(path)
            del tensors["model.norm.weight"]
            save_file(tensors, path, metadata={"format": "pt"})
            index = json.loads(open(os.path.join(folder, "model.safetensors.index.json")).read())
            del index["weight_map"]["model.norm.weight"]
            open(os.path.join(folder, "model.safetensors.index.json"), "w").write(json.dumps(index))
        MPI.COMM_WORLD.Barrier()
        with ranks_agree(what="refused"), pytest.raises(hp.CheckpointError, match=r"model\.norm\.weight"):
            hp.load_pretrained(model, folder)
    finally:
        model.close()
