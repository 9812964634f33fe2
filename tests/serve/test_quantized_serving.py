"""A quantized checkpoint served over HTTP: it loads through the path `jaxinfer serve` uses
(`load_engine`), and greedy completions equal the reference `generate` of the same
quantized model. The tiny model keeps it fast; it borrows the demo's tokenizer (its 512 ids
are valid demo ids) so the server can detokenize."""

from __future__ import annotations

import json
import urllib.request

from jaxinfer.config import get_preset
from jaxinfer.engine.async_engine import AsyncEngine
from jaxinfer.engine.factory import load_engine
from jaxinfer.generate import generate
from jaxinfer.model_loading import load_model, resolve_model_path
from jaxinfer.models import create_model
from jaxinfer.quant import QuantizationConfig, quantize_model, save_quantized_model
from serve.server import BackgroundServer
from serve.service import InferenceService, ServiceConfig


def test_a_quantized_checkpoint_serves_its_reference_output(tmp_path):
    config = QuantizationConfig.for_method("rtn", bits=4, group_size=32, symmetric=False)
    quantized = quantize_model(create_model(get_preset("tiny"), seed=0), config)
    directory = save_quantized_model(quantized, config, tmp_path / "tiny-int4",
                                     tokenizer_directory=resolve_model_path("builtin:demo"))
    prompt = [1, 450, 101, 134, 338]  # token ids: no text round trip in the comparison
    [expected] = generate(load_model(directory), [prompt], max_new_tokens=8, eos_token_ids=())
    engine = load_engine(directory, page_size=16, max_num_batched_tokens=32,
                                    max_num_seqs=2, max_model_len=64, bucket_growth=4)
    service = InferenceService(AsyncEngine(engine, warm_up=False),
                               ServiceConfig(model_name="tiny-int4"))
    with BackgroundServer(service, grpc=False) as server:
        body = json.dumps({"model": "tiny-int4", "prompt": prompt, "max_tokens": 8,
                           "temperature": 0, "ignore_eos": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v1/completions",
                                         body, {"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            answer = json.loads(response.read())
    assert answer["choices"][0]["text"] == engine.tokenizer.decode(expected)
    assert answer["usage"]["completion_tokens"] == 8
