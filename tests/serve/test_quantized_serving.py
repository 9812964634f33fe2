"""A quantized checkpoint served over HTTP: `jaxinfer quantize` output loads through the same
path `jaxinfer serve` uses (`Engine.from_pretrained`), and greedy completions equal the
reference `generate` of the same quantized model."""

from __future__ import annotations

import json
import urllib.request

from jaxinfer.cli import main as jaxinfer_main
from jaxinfer.engine.async_engine import AsyncEngine
from jaxinfer.engine.engine import Engine
from jaxinfer.generate import generate
from jaxinfer.model_loading import load_model
from serve.server import BackgroundServer
from serve.service import InferenceService, ServiceConfig


def test_a_quantized_checkpoint_serves_its_reference_output(tmp_path):
    directory = tmp_path / "demo-int4"
    assert jaxinfer_main(["quantize", "--model", "builtin:demo", "--method", "rtn", "--bits",
                          "4", "--group-size", "32", "--asymmetric", "--out",
                          str(directory)]) == 0
    prompt = [1, 450, 1051, 1134, 338]  # token ids: no text round trip in the comparison
    [expected] = generate(load_model(directory), [prompt], max_new_tokens=8, eos_token_ids=())
    engine = Engine.from_pretrained(directory, page_size=16, max_num_batched_tokens=32,
                                    max_num_seqs=2, max_model_len=64, bucket_growth=4)
    service = InferenceService(AsyncEngine(engine, warm_up=False),
                               ServiceConfig(model_name="demo-int4"))
    with BackgroundServer(service, grpc=False) as server:
        body = json.dumps({"model": "demo-int4", "prompt": prompt, "max_tokens": 8,
                           "temperature": 0, "ignore_eos": True, "logprobs": 1}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v1/completions",
                                         body, {"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            answer = json.loads(response.read())
    choice = answer["choices"][0]
    assert choice["text"] == engine.tokenizer.decode(expected)
    assert answer["usage"]["completion_tokens"] == 8
